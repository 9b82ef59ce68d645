"""`ray_lifetime` without starting Ray: an interrupt while Ray starts waits until it has started, Ray's own SIGTERM
handler stays out, and every process started while Ray started is stopped by pid, even one that ignores SIGTERM.

The start-up stands in for `ray.init` here (it installs Ray's handler the way `ray.init` does and starts a child the
way Ray starts its daemons); tests/e2e/test_startup_stop.py signals real runs at each moment of their start-up.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from rllm.experimental.fully_async.runtime.cluster import ray_session as processes
from rllm.experimental.fully_async.runtime.cluster.ray_session import RAY_PROCESS_MARKER_ENV, ray_lifetime

IGNORES_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
)


@pytest.fixture
def sigterm_raises_keyboard_interrupt():
    """The driver's handler (runtime/run/driver.py): SIGTERM unwinds like Ctrl-C."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    yield handler
    signal.signal(signal.SIGTERM, previous)


def _start(code: str) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "up"  # its handler is in place
    return child


def test_sigterm_while_ray_starts_is_raised_once_it_has_started_with_the_drivers_handler(
    sigterm_raises_keyboard_interrupt,
):
    from ray._private import utils as ray_utils

    steps = []

    def init():
        # What ray.init does first: install a handler that exits from whatever line the main thread is on.
        ray_utils.set_sigterm_handler(lambda signum, frame: sys.exit(signum))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # Python runs a handler between bytecodes: one would have run by now
        steps.append("started")

    with pytest.raises(KeyboardInterrupt, match="signal 15"), ray_lifetime(init):
        steps.append("block")
    assert steps == ["started"]  # init ran to its end; the block never began
    assert signal.getsignal(signal.SIGTERM) is sigterm_raises_keyboard_interrupt
    assert ray_utils.set_sigterm_handler.__module__ == "ray._private.utils"  # Ray's function is back


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # killed; its new parent may not reap it
    except psutil.NoSuchProcess:
        return True


def test_every_process_started_while_ray_starts_is_killed_even_an_orphan_that_ignores_sigterm(monkeypatch):
    monkeypatch.setattr(processes, "RAY_EXIT_GRACE_S", 0.5)
    children: list[subprocess.Popen] = []
    daemons: list[subprocess.Popen] = []
    orphans: list[int] = []

    def init():  # like ray.init: a daemon (gcs_server), and a process whose child outlives it (a raylet's agent)
        daemons.append(_start(IGNORES_SIGTERM))
        children.append(daemons[0])
        leaves_an_orphan = (
            "import subprocess, sys\n"
            f"print(subprocess.Popen([sys.executable, '-c', {IGNORES_SIGTERM!r}], stdout=subprocess.DEVNULL).pid)"
        )
        launcher = subprocess.run(
            [sys.executable, "-c", leaves_an_orphan], stdout=subprocess.PIPE, text=True, timeout=30
        )
        orphans.append(int(launcher.stdout.split()[0]))

    bystander = _start(IGNORES_SIGTERM)  # started before, like the engines: not Ray's, left alone
    children.append(bystander)
    try:
        with ray_lifetime(init):
            assert RAY_PROCESS_MARKER_ENV not in os.environ  # what starts after Ray (a restarted engine) is not marked
            later = _start(IGNORES_SIGTERM)
            children.append(later)
        # killed (and the daemon reaped, by psutil: Popen.wait cannot see its status)
        assert _gone(daemons[0].pid) and _gone(orphans[0])
        assert bystander.poll() is None and later.poll() is None
    finally:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            child.wait()
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # killed; its new parent may not reap it at once
    except psutil.NoSuchProcess:
        return True
