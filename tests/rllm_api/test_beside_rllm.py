"""Installing beside rLLM itself is refused, by the installers before they install anything and by the import, in
one line: both distributions install the top-level package `rllm` (one would overwrite the other's files) and
rLLM's training extra pins verl 0.8.0 where this package needs 0.7.1.

rLLM is stood in for by its distribution metadata as pip writes it (`rllm-0.3.0.pre.dist-info/METADATA`, the name
and version of rllm-org/rllm's pyproject.toml) in a folder on the path: what `importlib.metadata` finds of an
installed rLLM.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "install" / "check_beside_rllm.py"


@pytest.fixture
def rllm_site(tmp_path: Path) -> Path:
    """A site folder where rLLM 0.3.0.pre is installed (its dist-info, as pip leaves it)."""
    site = tmp_path / "site-packages"
    info = site / "rllm-0.3.0.pre.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rllm\nVersion: 0.3.0.pre\n")
    (info / "top_level.txt").write_text("rllm\n")
    return site


def _python(args: list[str], site: Path | None, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    path = [str(REPO)] + ([str(site)] if site else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_import_refuses_beside_rllm_in_one_line(rllm_site):
    beside = _python(["-c", "import rllm.experimental.fully_async"], rllm_site)
    assert beside.returncode == 1
    last = beside.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: rllm-fully-async cannot share an environment with rLLM")
    assert "'rllm' 0.3.0.pre" in last and "virtual environment of its own" in last
    alone = _python(["-c", "import rllm.experimental.fully_async"], None)
    assert alone.returncode == 0, alone.stderr


def test_the_installers_check_exits_2_with_one_line(rllm_site, tmp_path):
    beside = _python([str(CHECK)], rllm_site, cwd=tmp_path)  # run from anywhere: it finds the source tree itself
    assert beside.returncode == 2 and beside.stdout == ""
    (line,) = beside.stderr.strip().splitlines()
    assert line.startswith("error: rllm-fully-async cannot share an environment with rLLM")
    assert _python([str(CHECK)], None, cwd=tmp_path).returncode == 0


def test_install_cpu_refuses_before_installing_anything(rllm_site, tmp_path):
    """install_cpu.sh on an environment where rLLM is installed: exit 2 with the line, and pip never ran."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    calls = tmp_path / "calls.log"
    python = venv / "bin" / "python"
    python.write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\nPYTHONPATH={rllm_site} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    env = {**os.environ, "VENV": str(venv)}
    result = subprocess.run(
        ["bash", str(REPO / "install" / "install_cpu.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "cannot share an environment with rLLM" in result.stderr.strip().splitlines()[-1]
    assert [line for line in calls.read_text().splitlines()] == ["install/check_beside_rllm.py"]


def test_the_gpu_installers_check_before_their_first_install(tmp_path):
    env = {**os.environ, "VENV": str(tmp_path / "venv"), "PYTHON": "python3"}
    for script in ("install_fsdp_sglang.sh", "install_megatron_sglang.sh"):
        out = subprocess.run(
            ["bash", str(REPO / "install" / script), "--dry-run"], env=env, capture_output=True, text=True, timeout=60
        ).stdout
        commands = [line.strip() for line in out.splitlines() if line.strip().startswith("$ ")]
        check = next(i for i, c in enumerate(commands) if c.endswith("install/check_beside_rllm.py"))
        first_install = next(i for i, c in enumerate(commands) if "pip install" in c)
        assert check < first_install, out
