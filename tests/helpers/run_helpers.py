"""Helpers for tests that run the CLI: the addition task's command line and what a finished run left behind."""

from __future__ import annotations

import sys
from pathlib import Path

QUICK_WARMUP_STEPS = 60


def addition_run_command(run_dir: Path, addition_cache: Path, *overrides: str) -> list[str]:
    """The CLI on the addition task from the session's cache (quick warm-up), writing to `run_dir`."""
    return [
        sys.executable,
        "-m",
        "rllm.experimental.fully_async",
        f"run.dir={run_dir}",
        f"task.cache_dir={addition_cache}",
        f"task.warmup_steps={QUICK_WARMUP_STEPS}",  # a weaker model than the default's, still a real task
        *overrides,
    ]


def leftover_processes(driver_pid: int, model_marker: str) -> list[str]:
    """Processes a finished run left behind: engines serving `model_marker`, Ray daemons of the driver's session.

    Ray names its session folder after the driver's pid (`/tmp/ray/session_<time>_<pid>/`).
    """
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        engine = "engines.embedded.server" in cmdline and model_marker in cmdline
        ray_daemon = "/tmp/ray/session_" in cmdline and f"_{driver_pid}/" in cmdline
        if engine or ray_daemon:
            found.append(cmdline[:200])
    return found
