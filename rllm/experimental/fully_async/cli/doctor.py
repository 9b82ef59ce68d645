"""`doctor`: can this machine train? Versions, the verl patch, devices, the GPU stack, and whether Ray starts.

On a host with CUDA it also checks the GPU stack: that a CUDA kernel runs, that NCCL is available (torch's
build), how many GPUs there are, that SGLang imports (in a child process, bounded by a timeout), and whether the
Megatron path can run (megatron-core, mbridge and TransformerEngine's PyTorch extension installed; a warning that
names what is missing when not, since the FSDP path trains without them).

Prints one line per check and returns 0 when every required check passed, 1 otherwise, so installers and CI can
run it as their last step. Version ranges come from this package's own requirements (its installed metadata, or
pyproject.toml in a checkout), so the doctor and the installers agree by construction. Ray is started in a child
process on loopback with the settings of shared/ENVIRONMENT.md and shut down again; a child process bounds a hang
with a timeout and leaves no Ray state in the caller.

Run it as `python -m rllm.experimental.fully_async doctor` (or `python -m rllm.experimental.fully_async.cli.doctor`).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from rllm.experimental.fully_async.backends import verl_patch

logger = logging.getLogger(__name__)

DIST_NAME = "rllm-fully-async"
RAY_START_TIMEOUT_S = 120.0  # a cold start takes ~3-10 s on two cores; two minutes means it is stuck
# (distribution, shown as): the packages whose versions decide whether training works.
REQUIRED_PACKAGES = (("torch", "torch"), ("verl", "verl"), ("transformers", "transformers"), ("ray", "ray"))
OPTIONAL_PACKAGES = (("sglang", "sglang"), ("megatron-core", "megatron-core"), ("flash-attn", "flash-attn"))
SGLANG_PIN = SpecifierSet("==0.5.6")  # the engine version verl 0.7.1's `sglang` extra and the GPU lock pin

_RAY_PROBE = """
import json, os, time
started = time.monotonic()
import ray
ctx = ray.init(num_cpus=os.cpu_count(), include_dashboard=False, object_store_memory=1_000_000_000,
               configure_logging=False, log_to_driver=False)
try:
    @ray.remote
    def ping():
        return "pong"
    reply = ray.get(ping.remote(), timeout=60)
    info = {"reply": reply, "node_ip": ctx.address_info["node_ip_address"], "cpus": ray.cluster_resources().get("CPU")}
finally:
    ray.shutdown()
info["seconds"] = time.monotonic() - started
print(json.dumps(info))
"""


@dataclass(frozen=True)
class Check:
    """One line of the report. A failed check with `required=False` is a warning and does not fail the run."""

    name: str
    ok: bool
    detail: str
    required: bool = True

    def line(self) -> str:
        status = "ok" if self.ok else ("FAIL" if self.required else "warn")
        return f"  {status:<5} {self.name:<14} {self.detail}"


def project_requirements() -> dict[str, SpecifierSet]:
    """This package's version specifiers by distribution name (lower-case), from metadata or pyproject.toml."""
    try:
        lines = importlib.metadata.requires(DIST_NAME) or []
    except importlib.metadata.PackageNotFoundError:
        lines = _pyproject_dependencies()
    specs: dict[str, SpecifierSet] = {}
    for line in lines:
        req = Requirement(line)
        if req.marker is not None and "extra" in str(req.marker):
            continue  # optional extras (test, gpu, megatron) are not requirements of a CPU host
        specs[req.name.lower()] = req.specifier
    return specs


def _pyproject_dependencies() -> list[str]:
    try:
        # optional: tomllib is in the standard library from Python 3.11 on
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: ranges are shown only when the package is installed
        return []
    path = verl_patch.REPO_ROOT / "pyproject.toml"
    if not path.is_file():
        return []
    return list(tomllib.loads(path.read_text())["project"]["dependencies"])


def check_version(name: str, version: str | None, spec: SpecifierSet | None, *, required: bool = True) -> Check:
    """Is `version` of `name` installed and inside `spec` (if any)? A local tag like +cpu is ignored."""
    if version is None:
        return Check(name, False, "not installed", required)
    if spec is None or not str(spec):
        return Check(name, True, version, required)
    public = version.split("+", 1)[0]
    if spec.contains(public, prereleases=True):
        return Check(name, True, f"{version} (wants {spec})", required)
    return Check(name, False, f"{version}, but this project needs {spec}", required)


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_python() -> Check:
    version = platform.python_version()
    ok = (3, 10) <= sys.version_info[:2] <= (3, 12)
    return Check("python", ok, f"{version} ({sys.executable})" if ok else f"{version}, but 3.10-3.12 is needed")


def check_packages() -> list[Check]:
    specs = project_requirements()
    checks = [check_version(shown, installed_version(dist), specs.get(dist)) for dist, shown in REQUIRED_PACKAGES]
    for dist, shown in OPTIONAL_PACKAGES:
        version = installed_version(dist)
        if version is None:
            checks.append(Check(shown, True, "not installed (GPU hosts only)", required=False))
        else:
            checks.append(check_version(shown, version, SGLANG_PIN if dist == "sglang" else None, required=False))
    return checks


def check_patch(status: verl_patch.PatchStatus) -> Check:
    if status.ok:
        return Check("verl patch", True, f"{status.detail} ({status.verl_root})")
    return Check("verl patch", False, f"{status.state.value}: {status.detail}; fix: {status.fix_command()}")


def check_devices() -> Check:
    """CPU count and GPUs. No GPU is fine: the CPU path (embedded engine) is the default."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        # lazy: the doctor reports a torch that does not import, so it must start without it
        import torch
    except ImportError as exc:
        return Check("devices", False, f"{cpus} CPUs; torch does not import ({exc})")
    if not torch.cuda.is_available():
        return Check("devices", True, f"{cpus} CPUs, no GPU (CPU training with the embedded engine)")
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    return Check("devices", True, f"{cpus} CPUs, {torch.cuda.device_count()} GPU(s): {', '.join(names)}")


SGLANG_IMPORT_TIMEOUT_S = 180.0
_SGLANG_PROBE = "import sglang, sglang.srt.entrypoints.http_server; print(sglang.__version__)"


def import_sglang(timeout_s: float = SGLANG_IMPORT_TIMEOUT_S) -> tuple[bool, str]:
    """Import SGLang's server in a child process: (ok, version or the last error line)."""
    try:
        proc = subprocess.run([sys.executable, "-c", _SGLANG_PROBE], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"import did not finish within {timeout_s:g}s"
    if proc.returncode != 0:
        return False, (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return True, proc.stdout.strip().splitlines()[-1]


def _cuda_available() -> bool:
    try:
        # lazy: the doctor reports a torch that does not import, so it must start without it
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def check_gpu_stack(torch_module: Any = None) -> list[Check]:
    """CUDA, NCCL, GPU count and SGLang on a GPU host; nothing on a CPU host (the CPU path needs none of them)."""
    torch = torch_module
    if torch is None:
        try:
            # lazy: the doctor reports a torch that does not import, so it must start without it
            import torch
        except ImportError:
            return []
    if not torch.cuda.is_available():
        return []
    checks = []
    try:
        value = torch.ones(4, device="cuda:0").sum().item()
        ok = value == 4.0
        checks.append(
            Check("cuda", ok, f"CUDA {torch.version.cuda}: a kernel on cuda:0 {'ran' if ok else 'gave ' + str(value)}")
        )
    except Exception as exc:  # a broken driver raises anything from RuntimeError to AssertionError
        checks.append(Check("cuda", False, f"CUDA {torch.version.cuda}: a kernel on cuda:0 failed ({exc})"))
    if torch.distributed.is_available() and torch.distributed.is_nccl_available():
        version = ".".join(str(v) for v in torch.cuda.nccl.version())
        checks.append(Check("nccl", True, f"NCCL {version} (multi-GPU trainer ranks and weight broadcast)"))
    else:
        checks.append(Check("nccl", False, "torch was built without NCCL: multi-GPU training cannot run"))
    count = torch.cuda.device_count()
    checks.append(
        Check(
            "gpu count",
            count >= 1,
            f"{count} GPU(s) visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})",
        )
    )
    ok, detail = import_sglang()
    if ok and not SGLANG_PIN.contains(detail, prereleases=True):
        checks.append(Check("sglang import", False, f"sglang {detail} imports, but the engines need {SGLANG_PIN}"))
    elif ok:
        checks.append(Check("sglang import", True, f"sglang {detail} imports (engines.backend=sglang)"))
    else:
        checks.append(Check("sglang import", False, f"sglang does not import: {detail}"))
    return checks


def check_megatron(cuda_available: bool) -> Check:
    """Can `actor.strategy=megatron` run here? A warning naming what is missing when not (FSDP trains without it)."""
    # lazy: backends.megatron imports torch at its top, which the doctor must start without
    from rllm.experimental.fully_async.backends.megatron import megatron_unusable_reason

    if not cuda_available:
        return Check("megatron path", True, "GPU hosts only (no CUDA here)", required=False)
    reason = megatron_unusable_reason(cuda_available=True)
    if reason is not None:
        return Check("megatron path", False, reason, required=False)
    te = installed_version("transformer-engine-torch") or installed_version("transformer-engine") or "installed"
    return Check("megatron path", True, f"megatron-core, mbridge and TransformerEngine {te} (strategy megatron)", False)


def check_ray(timeout_s: float = RAY_START_TIMEOUT_S) -> Check:
    """Start Ray on loopback in a child process, run one task, shut it down."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)  # a private instance, never an existing cluster
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _RAY_PROBE], env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return Check("ray start", False, f"did not start and answer within {timeout_s:g}s")
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return Check("ray start", False, f"failed to start: {last}")
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    if info["node_ip"] != "127.0.0.1":
        return Check("ray start", False, f"started on {info['node_ip']}, not on loopback 127.0.0.1")
    detail = f"started on 127.0.0.1 with {info['cpus']:g} CPUs, ran a task, stopped ({info['seconds']:.1f}s)"
    return Check("ray start", True, detail)


def run_doctor(stream: TextIO | None = None) -> int:
    """Run every check, print the report to `stream` (stdout), return 0 if all required checks passed, else 1."""
    out = stream if stream is not None else sys.stdout
    print(f"{DIST_NAME} doctor", file=out, flush=True)
    checks: list[Check] = [check_python(), *check_packages(), check_patch(verl_patch.patch_status())]
    checks.append(check_devices())
    checks += check_gpu_stack()
    checks.append(check_megatron(_cuda_available()))
    for check in checks:
        print(check.line(), file=out, flush=True)
    started = time.monotonic()
    ray_check = check_ray()
    logger.debug("ray check took %.1fs", time.monotonic() - started)
    print(ray_check.line(), file=out, flush=True)
    checks.append(ray_check)
    failed = [c.name for c in checks if c.required and not c.ok]
    if failed:
        print(f"{len(failed)} check(s) failed: {', '.join(failed)}", file=out, flush=True)
        return 1
    print("all checks passed", file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_doctor())
