"""Stopping a run at any moment: SIGTERM while the task, the engines, Ray or the actors are starting, or while it
trains, leaves no process of that run behind, and the driver exits as interrupted (not killed, not crashed); one
SIGTERMed while it trains has checkpointed its step and stopped within 30 s.

Each run carries a marker in its environment (RLLM_TEST_MARKER=<uuid>), which its engines, Ray's daemons and
Ray's workers inherit; after the driver exits, /proc must hold no process with that marker. Moments are events
seen from outside (an engine's log file appears, Ray's gcs_server or a worker process exists, a step is logged), so
the test hits the same phase on a busy or a quiet machine. The first Ray worker appears while the driver's own core
worker is being built inside `ray.init`: a SIGTERM there crashed the driver at exit with SIGSEGV until start-up held
interrupts (runtime/cluster/ray_session.py). The driver runs with faulthandler on, so a crash shows its Python stack.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from run_helpers import addition_run_command

from rllm.experimental.fully_async.runtime.checkpoints.store import CheckpointManager

pytestmark = pytest.mark.slow

MARKER_ENV = "RLLM_TEST_MARKER"


def marked_processes(marker: str) -> dict[int, str]:
    """pid -> command line of every process whose environment carries MARKER_ENV=marker."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
        except OSError:  # gone meanwhile, or a zombie
            continue
    return found


def _engine_log_exists(run_dir: Path, marker: str) -> bool:
    return any((run_dir / "engines").glob("engine-*.log"))


def _ray_starting(run_dir: Path, marker: str) -> bool:
    return any("gcs_server" in cmd for cmd in marked_processes(marker).values())


def _actors_starting(run_dir: Path, marker: str) -> bool:
    return any(cmd.startswith("ray::") for cmd in marked_processes(marker).values())


def _training(run_dir: Path, marker: str) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and '"step": 1,' in metrics.read_text()


def _after(seconds: float) -> Callable[[Path, str], bool]:
    started = time.monotonic()
    return lambda run_dir, marker: time.monotonic() - started >= seconds


MOMENTS = {
    "during-imports": lambda: _after(1.0),
    "engines-starting": lambda: _engine_log_exists,
    "ray-starting": lambda: _ray_starting,
    "actors-starting": lambda: _actors_starting,
    "training": lambda: _training,
}
REACH_TIMEOUT_S = 400  # a loaded 2-core machine took 135 s to reach the actors (measured: load average 26)


def _start_marked(command: list[str], cwd: Path, marker: str, **env: str) -> subprocess.Popen:
    environment = dict(os.environ, **{MARKER_ENV: marker}, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", **env)
    return subprocess.Popen(
        command, cwd=cwd, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


def _sigterm_and_check_nothing_is_left(proc: subprocess.Popen, marker: str, what: str) -> str:
    """SIGTERM `proc`, wait for it, and assert that no process carrying `marker` survives it; its output."""
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    survivors = marked_processes(marker)
    deadline = time.monotonic() + 5  # processes that were killed may take a moment to vanish from /proc
    while survivors and time.monotonic() < deadline:
        time.sleep(0.2)
        survivors = marked_processes(marker)
    assert not survivors, f"left behind after SIGTERM {what}: {survivors}\n{output[-3000:]}"
    return output


def _kill_everything_marked(proc: subprocess.Popen, marker: str) -> None:
    """Never leak into the rest of the session, whatever failed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in marked_processes(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_sigterm_at_any_moment_leaves_no_process_behind(moment, addition_cache, tmp_path):
    marker = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    command = addition_run_command(run_dir, addition_cache, "trainer.total_training_steps=1000")
    reached = MOMENTS[moment]()
    proc = _start_marked(command, tmp_path, marker, RLLM_LOG_LEVEL="WARNING")
    try:
        deadline = time.monotonic() + REACH_TIMEOUT_S
        while not reached(run_dir, marker):
            assert proc.poll() is None, f"the run ended before {moment}: {proc.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, f"never reached {moment}"
            time.sleep(0.05)
        sent = time.monotonic()
        output = _sigterm_and_check_nothing_is_left(proc, marker, moment)
        elapsed = time.monotonic() - sent
        assert proc.returncode in (130, -signal.SIGTERM), output[-3000:]
        assert "Traceback" not in output, output[-3000:]
        if moment == "training":  # SIGTERM while training (test_resume stops one with Ctrl-C): checkpointed, <30 s
            assert elapsed < 30, f"took {elapsed:.1f}s to stop"
            assert proc.returncode == 130, output[-3000:]
            latest = CheckpointManager(run_dir / "checkpoints").latest()
            assert latest is not None and int(latest.name.split("_")[-1]) >= 1, output[-3000:]
    finally:
        _kill_everything_marked(proc, marker)


WAITS_WITH_RAY = """
import time

def test_waits_with_the_sessions_ray(ray_session):
    print("ray is up", flush=True)
    time.sleep(600)
"""


def test_sigterm_to_a_test_session_stops_its_ray_through_the_fixtures_teardown(tmp_path):
    """The test session's Ray (conftest.ray_session) is stopped like a run's when pytest gets SIGTERM: pytest
    unwinds as on Ctrl-C and the fixture's teardown stops every process that Ray started (gcs_server once outlived
    a SIGTERMed session)."""
    import sys

    marker = uuid.uuid4().hex
    (tmp_path / "test_waits.py").write_text(WAITS_WITH_RAY)
    tests = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "conftest", "test_waits.py"]
    proc = _start_marked(command, tmp_path, marker, PYTHONPATH=os.pathsep.join([str(tests), str(tests / "helpers")]))
    try:
        deadline = time.monotonic() + REACH_TIMEOUT_S
        while not any("gcs_server" in cmd for cmd in marked_processes(marker).values()):
            assert proc.poll() is None, f"pytest ended before Ray started: {proc.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, "Ray never started"
            time.sleep(0.05)
        for line in proc.stdout:  # the test body runs: Ray has started
            if "ray is up" in line:
                break
        output = _sigterm_and_check_nothing_is_left(proc, marker, "to pytest")
        assert proc.returncode == 2, output[-3000:]  # pytest's "interrupted"
    finally:
        _kill_everything_marked(proc, marker)


def test_a_run_starts_its_own_ray_even_when_another_ray_runs_on_the_machine(tmp_path):
    """ray.init() with no address joins any Ray already running on the machine (it reads the last cluster's
    address from /tmp/ray), and then refuses our num_cpus: a second run, another user's `ray start`, or a test's
    cluster made the driver fail with "When connecting to an existing cluster, num_cpus and num_gpus must not be
    provided". init_ray starts a private instance unless RAY_ADDRESS names a cluster to join."""
    import sys

    from ray.cluster_utils import Cluster

    other = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        code = (
            "import ray\n"
            "from rllm.experimental.fully_async.runtime.cluster.ray_session import init_ray\n"
            "init_ray(num_cpus=3)\n"
            "print('GCS', ray.get_runtime_context().gcs_address, int(ray.cluster_resources()['CPU']))\n"
        )
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path
        )
    finally:
        other.shutdown()
    assert done.returncode == 0, done.stderr[-2000:]
    gcs, cpus = done.stdout.split("GCS ", 1)[1].split()
    assert gcs != other.address and int(cpus) == 3
