"""`doctor`: the report on this machine, the failure on unpatched verl, and the individual verdicts."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from test_verl_patch import make_verl_copy

from rllm.experimental.fully_async import doctor
from rllm.experimental.fully_async.verl_patch import PatchState, PatchStatus

REPO_ROOT = Path(__file__).resolve().parents[1]


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
            [sys.executable, "-m", "rllm.experimental.fully_async.doctor"],
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
    assert result.stdout.strip().endswith("all checks passed")


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
