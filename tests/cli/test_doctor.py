"""`doctor`: the report on this machine, the failure on unpatched verl, and the individual verdicts."""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from verl_helpers import make_verl_copy

from rllm.experimental.fully_async.backends.verl_patch import PatchState, PatchStatus
from rllm.experimental.fully_async.cli import doctor

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def doctor_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess[str]]:
    """`doctor` on this venv and on a pristine verl copy, side by side (each mostly waits for Ray to start)."""
    pristine = make_verl_copy(tmp_path_factory.mktemp("pristine"), patched=False)
    envs = {
        "here": dict(os.environ),
        "unpatched": {**os.environ, "PYTHONPATH": os.pathsep.join([str(pristine), str(REPO_ROOT)])},
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "rllm.experimental.fully_async.cli.doctor"],
            env=env,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, env in envs.items()
    }
    results = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return results


def report_lines(stdout: str) -> dict[str, str]:
    """{check name: 'status detail'} from the printed report."""
    lines = {}
    for line in stdout.splitlines()[1:]:
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[0] in ("ok", "FAIL", "warn"):
            status, rest = parts[0], line.split(None, 1)[1]
            name = rest[:14].strip()
            lines[name] = f"{status} {rest[14:].strip()}"
    return lines


@pytest.mark.slow  # two doctor processes, each starting Ray (~30 s on a busy 2-core machine)
def test_doctor_passes_here_and_reports_versions_patch_devices_and_ray(doctor_runs):
    result = doctor_runs["here"]
    assert result.returncode == 0, result.stdout + result.stderr
    lines = report_lines(result.stdout)
    assert lines["python"].startswith(f"ok {platform.python_version()}")
    for dist in ("torch", "verl", "transformers", "ray"):
        assert lines[dist].startswith(f"ok {importlib.metadata.version(dist)}"), lines[dist]
    assert "sglang" in lines  # reported even when absent (GPU hosts only)
    assert lines["verl patch"].startswith("ok verl_dp_actor.patch is applied")
    assert f"{len(os.sched_getaffinity(0))} CPUs" in lines["devices"]
    assert lines["ray start"].startswith("ok started on 127.0.0.1")
    assert lines["megatron path"] == "ok GPU hosts only (no CUDA here)"
    assert result.stdout.strip().endswith("all checks passed")


@pytest.mark.slow  # two doctor processes, each starting Ray (~30 s on a busy 2-core machine)
def test_doctor_fails_on_unpatched_verl_and_says_how_to_fix_it(doctor_runs):
    result = doctor_runs["unpatched"]
    assert result.returncode == 1, result.stdout
    lines = report_lines(result.stdout)
    assert lines["verl patch"].startswith("FAIL not applied")
    assert "fix: VERL_PYTHON=" in lines["verl patch"] and "apply_verl_patch.sh" in lines["verl patch"]
    assert lines["ray start"].startswith("ok")  # the other checks still run and report
    assert result.stdout.strip().endswith("1 check(s) failed: verl patch")


def test_version_verdicts():
    spec = SpecifierSet(">=2.9.1,<=2.13.0")
    assert doctor.check_version("torch", "2.13.0+cpu", spec).ok  # local build tags do not matter
    too_old = doctor.check_version("torch", "2.5.0", spec)
    assert not too_old.ok and too_old.required and "needs" in too_old.detail
    missing = doctor.check_version("verl", None, SpecifierSet("==0.7.1"))
    assert not missing.ok and missing.detail == "not installed"
    optional = doctor.check_version("sglang", "0.5.5", doctor.SGLANG_PIN, required=False)
    assert not optional.ok and optional.line().lstrip().startswith("warn")


def test_project_requirements_pin_verl():
    assert str(doctor.project_requirements()["verl"]) == "==0.7.1"


def test_patch_verdict_carries_the_fix_command():
    status = PatchStatus(PatchState.NOT_APPLIED, Path("/site"), "0.7.1", "verl_dp_actor.patch is not applied")
    check = doctor.check_patch(status)
    assert not check.ok and check.detail.endswith(status.fix_command())


def test_ray_check_reports_a_start_that_does_not_finish_in_time():
    check = doctor.check_ray(timeout_s=0.05)
    assert not check.ok and "within 0.05s" in check.detail


def fake_cuda_torch(*, nccl: bool = True, kernel_result: float = 4.0, gpus: int = 8):
    """Just enough of torch's CUDA surface for `check_gpu_stack` (this machine has no GPU)."""
    from types import SimpleNamespace

    def ones(n, device):
        assert device == "cuda:0"
        return SimpleNamespace(sum=lambda: SimpleNamespace(item=lambda: kernel_result))

    return SimpleNamespace(
        cuda=SimpleNamespace(
            is_available=lambda: True, device_count=lambda: gpus, nccl=SimpleNamespace(version=lambda: (2, 27, 3))
        ),
        version=SimpleNamespace(cuda="12.8"),
        distributed=SimpleNamespace(is_available=lambda: True, is_nccl_available=lambda: nccl),
        ones=ones,
    )


def test_gpu_stack_checks_cuda_nccl_gpu_count_and_sglang(monkeypatch):
    monkeypatch.setattr(doctor, "import_sglang", lambda: (True, "0.5.6"))
    checks = {c.name: c for c in doctor.check_gpu_stack(fake_cuda_torch())}
    assert list(checks) == ["cuda", "nccl", "gpu count", "sglang import"]
    assert all(c.ok and c.required for c in checks.values())
    assert "CUDA 12.8" in checks["cuda"].detail and "NCCL 2.27.3" in checks["nccl"].detail
    assert checks["gpu count"].detail.startswith("8 GPU(s)") and "0.5.6" in checks["sglang import"].detail


def test_gpu_stack_failures_are_named(monkeypatch):
    monkeypatch.setattr(doctor, "import_sglang", lambda: (True, "0.5.9"))
    checks = {c.name: c for c in doctor.check_gpu_stack(fake_cuda_torch(nccl=False, kernel_result=0.0, gpus=0))}
    assert not any(c.ok for c in checks.values())
    assert "without NCCL" in checks["nccl"].detail and "==0.5.6" in checks["sglang import"].detail
    monkeypatch.setattr(doctor, "import_sglang", lambda: (False, "ModuleNotFoundError: No module named 'sglang'"))
    (sglang,) = [c for c in doctor.check_gpu_stack(fake_cuda_torch()) if c.name == "sglang import"]
    assert not sglang.ok and "No module named 'sglang'" in sglang.detail


def test_gpu_stack_is_silent_on_a_cpu_host_and_the_sglang_probe_really_imports():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    assert doctor.check_gpu_stack() == []
    ok, detail = doctor.import_sglang(timeout_s=120)
    assert not ok and "sglang" in detail  # not installed on CPU machines (ENVIRONMENT.md)


MEGATRON_MODULES = {"megatron.core", "mbridge", "transformer_engine", "transformer_engine_torch"}


def installed_only(monkeypatch, present: set[str]) -> None:
    """find_spec as on a host where of the Megatron stack's modules only `present` are installed."""
    real = importlib.util.find_spec

    def find_spec(name, package=None):
        if name in MEGATRON_MODULES:
            return importlib.machinery.ModuleSpec(name, None) if name in present else None
        return real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_megatron_check_says_in_one_line_why_the_path_is_unusable_without_transformer_engine(monkeypatch):
    for present in ({"megatron.core", "mbridge"}, {"megatron.core", "mbridge", "transformer_engine"}):
        installed_only(monkeypatch, present)  # TransformerEngine absent, or present without its torch extension
        check = doctor.check_megatron(cuda_available=True)
        assert not check.ok and not check.required and check.line().lstrip().startswith("warn")
        assert check.detail.startswith("Megatron path unusable: TransformerEngine's PyTorch extension")
        assert "no binary wheel" in check.detail and "TE_WHEEL=" in check.detail and "\n" not in check.detail
    installed_only(monkeypatch, {"transformer_engine", "transformer_engine_torch"})
    check = doctor.check_megatron(cuda_available=True)
    assert not check.ok and "megatron-core and mbridge not installed" in check.detail
    assert "TransformerEngine" not in check.detail


def test_megatron_check_passes_with_the_whole_stack_and_stays_quiet_without_cuda(monkeypatch):
    installed_only(monkeypatch, MEGATRON_MODULES)
    check = doctor.check_megatron(cuda_available=True)
    assert check.ok and "TransformerEngine" in check.detail
    installed_only(monkeypatch, set())
    check = doctor.check_megatron(cuda_available=False)
    assert check.ok and check.detail == "GPU hosts only (no CUDA here)"
