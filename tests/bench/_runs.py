"""Shared helper for the experiment scripts in tests/bench: launch one training run, wait, summarise its metrics.

A run is `python -m rllm.experimental.fully_async [--config FILE] run.dir=RUN_DIR key=value ...` in a subprocess,
into a fresh RUN_DIR, with a wall-clock timeout. Its whole output goes to `RUN_DIR/output.log` (and, optionally,
to this terminal with a `[label]` prefix); its `RUN_DIR/metrics.jsonl` is summarised into a `MetricsSummary`.

Process hygiene. The training driver starts Ray (raylet, GCS, workers) and the embedded engines; the engines lead
their own sessions (so a process-group signal to the driver does not reach them) and nothing ties their life to
the driver's if the driver is SIGKILLed. So while a run is alive this module records every descendant of the
driver (pid and kernel start time, which guards against pid reuse), and when the run ends, however it ends, any
recorded process still alive is sent SIGTERM, then SIGKILL. On timeout the driver itself first gets SIGTERM,
which it turns into an orderly unwind (engines stopped, Ray shut down), and `KILL_GRACE_S` to finish it.

The summary is `_metrics.summarize_metrics`, a pure function over the parsed records.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from _metrics import MetricsSummary, read_metrics, summarize_metrics

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAIN_MODULE = "rllm.experimental.fully_async"
DEFAULT_RUNS_ROOT = REPO_ROOT / "runs" / "bench"  # `runs/` is git-ignored

# After SIGTERM the driver stops its actors, each engine (SIGTERM then SIGKILL after its own stop timeout) and
# Ray; on a loaded 2-core machine that takes tens of seconds, so wait this long before killing everything.
KILL_GRACE_S = 60.0
# How often the process tree is re-scanned while a run is alive: engines and Ray workers start in the first
# seconds and live for the whole run, so a few seconds between scans catches all of them at negligible cost.
SCAN_INTERVAL_S = 2.0
# Seconds given to stragglers between SIGTERM and SIGKILL during the final sweep.
SWEEP_GRACE_S = 10.0
OUTPUT_TAIL_LINES = 40
OUTPUT_HEAD_LINES = 10  # the first lines, with when they came: where the start-up went


def default_timeout_s(steps: int) -> float:
    """A per-run timeout generous enough for a loaded 2-core machine.

    Measured on the tiny default: ~1.5 s per step under load average ~7 (120 steps in 178 s, including ~30 s of
    start-up and validation). 300 s + 10 s per step leaves a 5x margin for a run that is slower, not stuck.
    """
    return 300.0 + 10.0 * steps


# --------------------------------------------------------------------------------------------------------------
# Processes: one run in a subprocess, and nothing left behind
# --------------------------------------------------------------------------------------------------------------


ProcessKey = tuple[int, int]  # (pid, start time in clock ticks since boot): unique even if a pid is reused


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time) for every live process, from /proc (Linux). Zombies are left out: they
    have already exited and only wait for their parent to collect the exit status."""
    table: dict[int, tuple[int, int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:  # exited between the listing and the read
            continue
        # The command name (field 2) may contain spaces and parentheses: split after its last ')'.
        rest = stat.rsplit(")", 1)[1].split()
        if rest[0] == "Z":
            continue
        table[int(entry.name)] = (int(rest[1]), int(rest[19]))  # fields 4 (ppid) and 22 (starttime)
    return table


def descendants(root_pid: int) -> set[ProcessKey]:
    """Every live process below `root_pid` (not the root itself), as (pid, start time)."""
    table = _process_table()
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid, (ppid, _) in table.items():
        children[ppid].append(pid)
    found: set[ProcessKey] = set()
    stack = [root_pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add((child, table[child][1]))
            stack.append(child)
    return found


def _alive(keys: Iterable[ProcessKey]) -> set[ProcessKey]:
    table = _process_table()
    return {(pid, start) for pid, start in keys if pid in table and table[pid][1] == start}


def _command_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:80] or "?"
    except OSError:
        return "?"


def sweep(keys: set[ProcessKey], grace_s: float = SWEEP_GRACE_S) -> list[str]:
    """SIGTERM the recorded processes still alive, SIGKILL those left after `grace_s`.

    Only processes this module recorded as descendants of a run it started are touched, each by its pid.
    Returns "pid (command)" for each process signalled, for the log.
    """
    remaining = _alive(keys)
    signalled = [f"{pid} ({_command_name(pid)})" for pid, _ in sorted(remaining)]
    for pid, _ in remaining:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while remaining and time.monotonic() < deadline:
        time.sleep(0.2)  # other processes' exits: no event to wait on
        remaining = _alive(remaining)
    for pid, _ in remaining:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return signalled


def install_stop_handlers() -> None:
    """SIGTERM to an experiment script behaves like Ctrl-C, so `launch` still stops its run and sweeps.

    SIGINT gets Python's Ctrl-C handler back even when the script was started in the background (`nohup ... &`):
    a non-interactive shell starts background commands with SIGINT ignored, Python then installs no handler, and
    the ignored disposition survives exec into every run the script starts, so the SIGINT that stops a run in
    order would be lost (a 30-minute soak trained on for 60 s after it and was killed).
    """

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)


@dataclass(frozen=True)
class RunResult:
    """One finished (or failed, or timed-out) training run."""

    label: str
    run_dir: Path
    command: tuple[str, ...]
    returncode: int | None  # None: stopped at the timeout
    timeout_s: float  # the limit it ran under
    wall_s: float  # subprocess start to exit: start-up, validations and training
    metrics: MetricsSummary
    output_tail: str  # the last lines the run printed (for failure messages)
    swept: tuple[str, ...] = ()  # "pid (command)" of leftover processes this module had to stop after the run
    output_head: tuple[tuple[float, str], ...] = ()  # the first lines, each with the seconds since the start
    started_at: float | None = None  # wall clock (time.time()) when the subprocess started
    load_average: tuple[float, float] = (0.0, 0.0)  # the 1-minute load average when the run started and ended

    @property
    def startup_s(self) -> float | None:
        """Seconds from the command's start to the first step's start: imports, Ray, the task's data and warm-up
        (or its cache), engines, actors and the step-0 validation."""
        if self.started_at is None or self.metrics.first_step_started_at is None:
            return None
        return self.metrics.first_step_started_at - self.started_at

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.metrics.final_val_accuracy is not None

    def failure(self) -> str:
        """One paragraph saying why the run is not ok ('' when it is)."""
        if self.ok:
            return ""
        if self.returncode is None:
            why = f"reached its {self.timeout_s:.0f}s timeout and was stopped"
        elif self.returncode != 0:
            why = f"exited with code {self.returncode}"
        else:
            why = "exited 0 but wrote no final validation to metrics.jsonl"
        return f"run '{self.label}' {why} (log {self.run_dir / 'output.log'}); last output:\n{self.output_tail}"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["run_dir"] = str(self.run_dir)
        data["ok"] = self.ok
        return data


def fresh_run_dir(path: Path) -> Path:
    """`path`, absolute, checked not to hold an earlier run (the driver appends to an existing metrics.jsonl)."""
    path = path.resolve()
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"run dir {path} already holds files; choose another --out")
    return path


def timestamped_dir(root: Path, name: str) -> Path:
    """root/name/YYYYmmdd-HHMMSS: a new folder per invocation, so results are never overwritten."""
    return root / name / datetime.now().strftime("%Y%m%d-%H%M%S")


def launch(
    label: str,
    overrides: Sequence[str],
    run_dir: Path,
    *,
    timeout_s: float,
    config: str | None = None,
    echo: bool = True,
    cwd: Path = REPO_ROOT,
) -> RunResult:
    """Run one training to completion (or `timeout_s`) and summarise it. Never leaves a process behind.

    `overrides` are `key=value` strings given after `run.dir=RUN_DIR`, so a later one wins over an earlier one.
    Ctrl-C (or SIGTERM with `install_stop_handlers`) stops the run the same way as the timeout, then re-raises.
    `cwd` is where the run starts: `python -m` imports the package from there first (before PYTHONPATH).
    """
    run_dir = fresh_run_dir(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", TRAIN_MODULE, "train"]
    if config is not None:
        command += ["--config", str(Path(config).resolve())]
    command += [f"run.dir={run_dir}", *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    tail: collections.deque[str] = collections.deque(maxlen=OUTPUT_TAIL_LINES)
    head: list[tuple[float, str]] = []
    log_path = run_dir / "output.log"
    logger.info("[%s] %s", label, " ".join(command))

    started = time.monotonic()
    started_at, load_start = time.time(), os.getloadavg()[0]
    with log_path.open("w", encoding="utf-8") as log:
        # A new session: Ctrl-C in this terminal reaches only this script, which then stops the run in order.
        proc = subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        reader = threading.Thread(target=_copy_output, args=(proc, log, tail, head, started, label, echo), daemon=True)
        reader.start()
        seen: set[ProcessKey] = set()
        returncode: int | None = None
        try:
            returncode = _wait(proc, seen, deadline=started + timeout_s)
        finally:
            if returncode is None:  # timeout, Ctrl-C or an error here: stop the run before anything else
                _stop(proc, seen, label)
            wall_s = time.monotonic() - started
            swept = sweep(seen)
            if swept:
                logger.warning("[%s] stopped %d leftover process(es): %s", label, len(swept), "; ".join(swept))
            # Leftover processes held the output pipe open; with them gone the reader reaches EOF.
            reader.join(timeout=SWEEP_GRACE_S)

    return RunResult(
        label=label,
        run_dir=run_dir,
        command=tuple(command),
        returncode=returncode,
        timeout_s=timeout_s,
        wall_s=wall_s,
        metrics=summarize_metrics(read_metrics(run_dir / "metrics.jsonl")),
        output_tail="\n".join(tail),
        output_head=tuple(head),
        swept=tuple(swept),
        started_at=started_at,
        load_average=(load_start, os.getloadavg()[0]),
    )


def _wait(proc: subprocess.Popen[str], seen: set[ProcessKey], deadline: float) -> int | None:
    """Wait for the run to exit, recording its descendants meanwhile; None if the deadline passed first."""
    while True:
        seen |= descendants(proc.pid)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        try:
            return proc.wait(timeout=min(SCAN_INTERVAL_S, remaining))
        except subprocess.TimeoutExpired:
            continue


def _stop(proc: subprocess.Popen[str], seen: set[ProcessKey], label: str) -> None:
    """SIGTERM the driver (it unwinds: engines, actors, Ray), wait KILL_GRACE_S, then SIGKILL its group."""
    logger.warning("[%s] stopping the run (SIGTERM, up to %.0fs to unwind)", label, KILL_GRACE_S)
    seen |= descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + KILL_GRACE_S
    while proc.poll() is None and time.monotonic() < deadline:
        seen |= descendants(proc.pid)  # shutdown may start helpers; record them before the driver goes
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=SCAN_INTERVAL_S)
    if proc.poll() is None:
        logger.warning("[%s] driver ignored SIGTERM for %.0fs; killing it", label, KILL_GRACE_S)
        seen |= descendants(proc.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the driver's own group (it leads its session)
        proc.wait(timeout=SWEEP_GRACE_S)


def _copy_output(
    proc: subprocess.Popen[str],
    log: Any,
    tail: collections.deque[str],
    head: list[tuple[float, str]],
    started: float,
    label: str,
    echo: bool,
) -> None:
    """Copy the run's output to its log file (and this terminal), keeping the last lines for error messages and the
    first ones with the seconds since `started` (time.monotonic()) at which they came."""
    assert proc.stdout is not None  # Popen was given stdout=PIPE
    for line in proc.stdout:
        log.write(line)
        log.flush()
        tail.append(line.rstrip("\n"))
        if len(head) < OUTPUT_HEAD_LINES:
            head.append((round(time.monotonic() - started, 2), line.rstrip("\n")))
        if echo:
            # The script's own output is the progress display of a long experiment: print, not log.
            print(f"[{label}] {line}", end="", flush=True)


# --------------------------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------------------------


def fmt(value: float | None, spec: str = ".2f", missing: str = "n/a") -> str:
    """`format(value, spec)`, or `missing` for None."""
    return missing if value is None else format(value, spec)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
