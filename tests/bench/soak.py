"""Soak (issue 6): does any process of a long fully-async run keep growing in memory?

    .venv/bin/python tests/bench/soak.py [--minutes 30] [--interval-s 15] [--out DIR] [--warmup-min 3]
        [--warmup-frac 0.2] [--flat-pct 5] [--flat-mb-per-h 50] [--echo] [-- key=value ...]

Runs the embedded default (`python -m rllm.experimental.fully_async train run.dir=OUT/run` with
`trainer.total_training_steps=10000000 trainer.total_epochs=100000 async_training.max_staleness=2
trainer.test_freq=200`, then any overrides given after `--`, which win) for `--minutes`. Every `--interval-s` it
records the resident set size (RSS, psutil) of every process of the run, named by role:
- `driver`: the training process itself;
- `engine`: the embedded inference engines (`engines/embedded/server.py`, one process each);
- `ray::<Class>`: Ray workers by the title Ray gives them (`ray::FullyAsyncTrainerActor`, `ray::RolloutExecutorActor`,
  `ray::MessageQueue`, `ray::IDLE` for pooled workers, `ray::DashboardAgent`, `ray::RuntimeEnvAgent`);
- `gcs_server`, `raylet`: Ray's native daemons; `ray:<script>`: its Python daemons (log_monitor, monitor, dashboard);
- `other:<program>`: anything else the run started.
A role's RSS is the sum over its processes. RSS counts shared pages in every process that maps them (the torch
libraries, Ray's plasma store in /dev/shm), so the "all processes" sum overstates the machine's use; a leak still
shows as growth in the role that leaks.

When the time is up the driver gets SIGINT (it checkpoints, stops its actors, engines and Ray, exits 130) and up to
60 s to do so; then any process of this run still alive is stopped by pid (SIGTERM, then SIGKILL). Ctrl-C or
SIGTERM to this script ends the soak early the same way, and the report covers what was sampled.

Written to OUT (default runs/bench/soak/<timestamp>/): `rss.csv` (time_s, role, pid, rss_mb: one row per process
per sample), `rss.png` (one line per role; skipped with a note when matplotlib is not importable), `summary.md`
(also printed): per role, RSS at the end of the warm-up (max(warmup-frac x run, warmup-min, the first optimizer
step): before it the processes are still loading) and at the end, the growth in MB and %, the slope of a
least-squares line over the post-warm-up samples in MB/hour, and the verdict "flat" when growth < --flat-pct % and
slope < --flat-mb-per-h (judged per role; the all-processes total is shown, not judged); the max and mean
`queue/size` against `queue/max_size`; the final ledger counts and the check issued == in_flight + trained +
filtered + dropped_stale + failed; the audit of the run's ledger journal (`run/ledger.jsonl`: no sample issued or
ended twice) and its size. Exit code: 0 when every role is flat, the ledger adds up, the journal audit passes and
the run stopped cleanly; 1 otherwise.

A measurement script, not a test: on a shared 2-core machine the step rate, hence the allocation rate, follows the
load; a run too short for the warm-up rule gets its warm-up cut (to half the run, or the first step if later), with
a note, and no meaningful verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import _metrics
import _runs
import psutil
from _runs import fmt

logger = logging.getLogger("soak")

# After the time is up the run is unbounded on purpose: the clock, not the data or a step count, ends it.
SOAK_OVERRIDES: tuple[str, ...] = (
    "trainer.total_training_steps=10000000",  # never reached in a soak
    "trainer.total_epochs=100000",  # the prompt iterator draws epochs lazily: the data never runs out
    "async_training.max_staleness=2",  # the async regime: rollouts up to two versions ahead keep the queue full
    # Sparse validation: it belongs to a real run's memory profile, but every step would make it the workload.
    "trainer.test_freq=200",
)
ENGINE_MODULE = "rllm.experimental.fully_async.engines.embedded.server"
RAY_NATIVE_DAEMONS = ("gcs_server", "raylet")
# The driver checkpoints and unwinds engines and Ray on SIGINT; tens of seconds on a loaded 2-core machine.
STOP_GRACE_S = 60.0
# RSS at the warm-up end and at the end are medians of this many samples, so one sample taken during a
# transient (a validation, a checkpoint, a garbage collection) does not decide the verdict.
EDGE_SAMPLES = 3
# A warm-up that leaves less than this share of the run for the fit is cut to half the run.
MIN_POST_WARMUP_FRAC = 0.2
LEDGER_ENDED = ("trained", "filtered", "dropped_stale", "failed")
TOTAL_ROLE = "all processes"


@dataclass(frozen=True)
class Sample:
    """One process at one sampling instant."""

    t_s: float  # seconds since the run was launched
    role: str
    pid: int
    rss_mb: float


@dataclass(frozen=True)
class RolePoint:
    """A role at one sampling instant: its processes' RSS summed."""

    t_s: float
    rss_mb: float
    procs: int


@dataclass(frozen=True)
class RoleGrowth:
    """A role's memory after warm-up. None: too few samples after the warm-up to say."""

    role: str
    procs_warm: int
    procs_end: int
    rss_warm_mb: float | None
    rss_end_mb: float | None
    growth_mb: float | None
    growth_pct: float | None
    slope_mb_per_h: float | None
    verdict: str  # "flat", "GROWING" or "n/a"


@dataclass
class SoakRun:
    """What the sampling loop collected and how the run ended."""

    command: list[str]
    run_dir: Path
    started_unix: float
    samples: list[Sample] = field(default_factory=list)
    returncode: int | None = None
    stop_s: float | None = None  # SIGINT to the driver's exit
    ended_early_s: float | None = None  # the run exited by itself at this time (not stopped by the soak)
    interrupted: bool = False  # Ctrl-C / SIGTERM to this script
    swept: list[str] = field(default_factory=list)  # "pid (command)" of leftovers stopped after the run


# --------------------------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------------------------


def classify(pid: int, driver_pid: int, argv: Sequence[str]) -> str:
    """The role of a process of the run, from its command line (Ray workers rewrite theirs to a title)."""
    if pid == driver_pid:
        return "driver"
    head = argv[0].split()[0] if argv and argv[0].strip() else ""
    if head.startswith("ray::"):
        # Ray retitles a worker `ray::Class.method` while a method runs: the role is the class.
        return "ray::" + re.split(r"[.(]", head.removeprefix("ray::"), maxsplit=1)[0]
    if ENGINE_MODULE in argv:
        return "engine"
    program = Path(head).name
    if program in RAY_NATIVE_DAEMONS:
        return program
    for arg in argv[1:3]:  # `python [-u] .../ray/.../<script>.py ...`
        if arg.endswith(".py") and "/ray/" in arg:
            return f"ray:{Path(arg).stem}"
    return f"other:{program or '?'}"


def sample_processes(driver_pid: int, pids: Sequence[int], t_s: float) -> list[Sample]:
    """RSS of the driver and the given descendants; processes that exit meanwhile are skipped."""
    samples: list[Sample] = []
    for pid in (driver_pid, *sorted(pids)):
        try:
            process = psutil.Process(pid)
            with process.oneshot():
                rss = process.memory_info().rss
                argv = process.cmdline()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        samples.append(Sample(t_s, classify(pid, driver_pid, argv), pid, rss / 2**20))
    return samples


def last_step(metrics_path: Path) -> int | None:
    """The newest `trainer/step` in metrics.jsonl, reading only the file's tail (it grows for the whole soak)."""
    try:
        with metrics_path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            if "trainer/step" in record:
                return int(record["trainer/step"])
    return None


def progress_line(t_s: float, step: int | None, samples: Sequence[Sample]) -> str:
    by_role: dict[str, list[float]] = defaultdict(list)
    for s in samples:
        by_role[s.role].append(s.rss_mb)
    parts = [f"{role}{f' {len(v)}x' if len(v) > 1 else ''} {sum(v):.0f}" for role, v in sorted(by_role.items())]
    total = sum(s.rss_mb for s in samples)
    return f"[soak {t_s / 60:5.1f} min] step {step if step is not None else '-'}  total {total:.0f} MB  " + "  ".join(
        parts
    )


def run_soak(command: list[str], run_dir: Path, minutes: float, interval_s: float, echo: bool) -> SoakRun:
    """Launch the run, sample it until the time is up (or it exits, or Ctrl-C), stop it, sweep leftovers."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logger.info("%s", " ".join(command))
    with (run_dir / "output.log").open("w", encoding="utf-8") as log:
        # A new session: Ctrl-C in this terminal reaches only this script, which then stops the run in order.
        proc = subprocess.Popen(
            command,
            cwd=_runs.REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=None if echo else log,
            stderr=None if echo else subprocess.STDOUT,
            start_new_session=True,
        )
    started = time.monotonic()
    soak = SoakRun(command=command, run_dir=run_dir, started_unix=time.time())
    seen: set[_runs.ProcessKey] = set()  # every descendant ever seen: what the final sweep may stop
    deadline = started + minutes * 60
    next_sample = started
    try:
        try:
            while True:
                keys = _runs.descendants(proc.pid)
                seen |= keys
                now = time.monotonic()
                if now >= next_sample or now >= deadline:
                    batch = sample_processes(proc.pid, [pid for pid, _ in keys], now - started)
                    soak.samples.extend(batch)
                    # The soak's own progress display: print, like the run's progress line.
                    print(progress_line(now - started, last_step(run_dir / "metrics.jsonl"), batch), flush=True)
                    while next_sample <= now:  # after a stall (a loaded machine), resume the grid, not a burst
                        next_sample += interval_s
                if now >= deadline:
                    break
                wait_s = max(0.05, min(_runs.SCAN_INTERVAL_S, next_sample - now, deadline - now))
                try:
                    soak.returncode = proc.wait(timeout=wait_s)
                except subprocess.TimeoutExpired:
                    continue
                soak.ended_early_s = time.monotonic() - started
                logger.warning("the run exited by itself after %.0fs with code %d", soak.ended_early_s, proc.returncode)
                break
        except KeyboardInterrupt:
            soak.interrupted = True
            logger.warning("interrupted: stopping the run and reporting what was sampled")
        if proc.poll() is None:
            stop_started = time.monotonic()
            soak.returncode = _stop(proc, seen)
            soak.stop_s = time.monotonic() - stop_started
    finally:
        if proc.poll() is None:  # an error or a second Ctrl-C inside _stop: never leave the driver behind
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        soak.swept = _runs.sweep(seen)
        if soak.swept:
            logger.warning("stopped %d leftover process(es): %s", len(soak.swept), "; ".join(soak.swept))
    return soak


def _stop(proc: subprocess.Popen[bytes], seen: set[_runs.ProcessKey]) -> int:
    """SIGINT the driver (only the driver: it stops everything it started, in order), wait, SIGKILL if it hangs."""
    logger.info("SIGINT to the driver (pid %d): up to %.0fs to checkpoint and exit", proc.pid, STOP_GRACE_S)
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + STOP_GRACE_S
    while proc.poll() is None and time.monotonic() < deadline:
        seen |= _runs.descendants(proc.pid)  # shutdown may start helpers: record them before the driver goes
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=_runs.SCAN_INTERVAL_S)
    if proc.poll() is None:
        logger.warning("the driver did not exit within %.0fs of SIGINT; killing it", STOP_GRACE_S)
        seen |= _runs.descendants(proc.pid)
        proc.kill()
    return proc.wait()


# --------------------------------------------------------------------------------------------------------------
# Analysis: pure functions over the samples and metrics.jsonl records
# --------------------------------------------------------------------------------------------------------------


def role_series(samples: Sequence[Sample]) -> dict[str, list[RolePoint]]:
    """Per role (and TOTAL_ROLE), one point per sampling instant at which the role had a process."""
    sums: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for s in samples:
        sums[s.role][s.t_s].append(s.rss_mb)
        sums[TOTAL_ROLE][s.t_s].append(s.rss_mb)
    return {
        role: [RolePoint(t, sum(v), len(v)) for t, v in sorted(by_t.items())] for role, by_t in sorted(sums.items())
    }


def warmup_end_s(
    duration_s: float, warmup_frac: float, warmup_min: float, first_step_s: float | None
) -> tuple[float, str | None]:
    """max(warmup_frac x duration, warmup_min minutes, the first optimizer step), and a note when it was cut.

    The first step is a floor because before it the processes are still loading (model, optimizer state, the first
    batches): that rise is start-up, not a leak. A warm-up that leaves less than MIN_POST_WARMUP_FRAC of the run for
    the fit is cut to half the run (or to the first step, if later and still leaving room).
    """
    floor = first_step_s or 0.0
    warm = max(warmup_frac * duration_s, warmup_min * 60, floor)
    latest = (1 - MIN_POST_WARMUP_FRAC) * duration_s
    if warm <= latest:
        return warm, None
    cut = max(duration_s / 2, floor) if floor <= latest else duration_s / 2
    return cut, (
        f"the run ({duration_s / 60:.1f} min) is too short for a {warm / 60:.1f} min warm-up: warm-up cut to "
        f"{cut / 60:.1f} min, so the figures below check the script, not the trainer"
    )


def first_step_s(records: Sequence[dict[str, Any]], started_unix: float) -> float | None:
    """When the first optimizer step was logged, in seconds since the launch."""
    times = [float(r["time"]) for r in records if "trainer/step" in r and "time" in r]
    return min(times) - started_unix if times else None


def slope_per_h(points: Sequence[RolePoint]) -> float | None:
    """Least-squares slope of RSS against time, MB/hour; None below two distinct times."""
    if len(points) < 2:
        return None
    ts = [p.t_s / 3600 for p in points]
    t_mean, y_mean = statistics.fmean(ts), statistics.fmean(p.rss_mb for p in points)
    var = sum((t - t_mean) ** 2 for t in ts)
    if var == 0:
        return None
    return sum((t - t_mean) * (p.rss_mb - y_mean) for t, p in zip(ts, points, strict=True)) / var


def role_growth(role: str, points: Sequence[RolePoint], warm_s: float, flat_pct: float, flat_mb_h: float) -> RoleGrowth:
    """Growth of one role after the warm-up; RSS at each edge is the median of EDGE_SAMPLES samples."""
    post = [p for p in points if p.t_s >= warm_s]
    if len(post) < 2:
        return RoleGrowth(role, 0, 0, None, None, None, None, None, "n/a")
    edge = max(1, min(EDGE_SAMPLES, len(post) // 2))
    warm = statistics.median(p.rss_mb for p in post[:edge])
    end = statistics.median(p.rss_mb for p in post[-edge:])
    growth = end - warm
    pct = 100 * growth / warm if warm > 0 else None
    slope = slope_per_h(post)
    flat = pct is not None and slope is not None and pct < flat_pct and slope < flat_mb_h
    return RoleGrowth(role, post[0].procs, post[-1].procs, warm, end, growth, pct, slope, "flat" if flat else "GROWING")


@dataclass(frozen=True)
class QueueStats:
    steps: int
    size_max: float | None
    size_mean: float | None
    max_size: float | None  # queue/max_size (the last step's; it is fixed for a run)
    steps_full: int  # steps at which the queue was at max_size (back-pressure on the executor)


def queue_stats(records: Sequence[dict[str, Any]]) -> QueueStats:
    sizes = [float(r["queue/size"]) for r in records if "trainer/step" in r and "queue/size" in r]
    bounds = [float(r["queue/max_size"]) for r in records if "trainer/step" in r and "queue/max_size" in r]
    bound = bounds[-1] if bounds else None
    return QueueStats(
        steps=sum(1 for r in records if "trainer/step" in r),
        size_max=max(sizes) if sizes else None,
        size_mean=statistics.fmean(sizes) if sizes else None,
        max_size=bound,
        steps_full=sum(1 for s in sizes if bound is not None and s >= bound),
    )


def final_ledger(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The last ledger/* counts, prefix removed (per-reason counts keep their `filtered/<reason>` names)."""
    lines = [r for r in records if any(k.startswith("ledger/") for k in r)]
    if not lines:
        return {}
    return {k.removeprefix("ledger/"): float(v) for k, v in lines[-1].items() if k.startswith("ledger/")}


@dataclass(frozen=True)
class JournalAudit:
    """The replay of the run's ledger journal (`run/ledger.jsonl`): every sample issued and ended at most once."""

    size_mb: float
    counts: dict[str, int]  # SampleLedger.counts() format, from the replay
    error: str | None  # the audit's LedgerError, or why there is no journal


def audit_journal(run_dir: Path) -> JournalAudit:
    from rllm.experimental.fully_async.core.ledger_format import LedgerError, history_counts
    from rllm.experimental.fully_async.runtime.rollout.ledger_journal import read_journal

    path = run_dir / "ledger.jsonl"
    if not path.is_file():
        return JournalAudit(0.0, {}, f"no journal at {path}")
    size_mb = path.stat().st_size / 1e6
    try:
        return JournalAudit(size_mb, history_counts(read_journal(path)), None)
    except LedgerError as exc:
        return JournalAudit(size_mb, {}, str(exc))


def ledger_balance(ledger: dict[str, float]) -> tuple[float, float] | None:
    """(issued, in_flight + ended states); None if a count is missing."""
    if any(k not in ledger for k in ("issued", "in_flight", *LEDGER_ENDED)):
        return None
    return ledger["issued"], ledger["in_flight"] + sum(ledger[k] for k in LEDGER_ENDED)


# --------------------------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------------------------


def write_csv(path: Path, samples: Sequence[Sample]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["time_s", "role", "pid", "rss_mb"])
        writer.writerows([f"{s.t_s:.1f}", s.role, s.pid, f"{s.rss_mb:.1f}"] for s in samples)


def write_plot(path: Path, series: dict[str, list[RolePoint]], warm_s: float) -> str:
    """rss.png, one line per role; returns a line for the summary (written, or why not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on the benchmark machines
        import matplotlib.pyplot as plt
    except ImportError:
        return "rss.png not written: matplotlib is not importable in this environment"
    fig, ax = plt.subplots(figsize=(12, 6))
    roles = [role for role in series if role != TOTAL_ROLE]  # the total dwarfs every role: summary only
    for i, role in enumerate(roles):
        points = series[role]
        # The default cycle has 10 colours and a run has ~15 roles: the line style tells repeated colours apart.
        style = ("-", "--", ":")[(i // 10) % 3]
        ax.plot([p.t_s / 60 for p in points], [p.rss_mb for p in points], style, marker=".", label=role)
    ax.axvline(warm_s / 60, color="black", linestyle="-.", alpha=0.6, label="warm-up end")
    ax.set_xlabel("minutes since launch")
    ax.set_ylabel("RSS, MB (sum over the role's processes)")
    ax.set_title("soak: resident memory by role")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"rss.png: {path}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    # Imported here: it pulls in torch, which only this last look needs.
    from rllm.experimental.fully_async.runtime.checkpoints.store import CheckpointManager

    return CheckpointManager(run_dir / "checkpoints").latest()


def render_summary(
    soak: SoakRun,
    args: argparse.Namespace,
    growth: Sequence[RoleGrowth],
    warm_s: float,
    warm_note: str | None,
    records: Sequence[dict[str, Any]],
    plot_note: str,
) -> tuple[str, bool]:
    """summary.md's text, and whether the soak passed (every role flat, ledger balanced, clean stop)."""
    times = sorted({s.t_s for s in soak.samples})
    duration = times[-1] if times else 0.0
    lines = [f"# Soak {datetime.fromtimestamp(soak.started_unix):%Y-%m-%d %H:%M}", ""]
    lines += [f"Command: `{' '.join(soak.command)}`", ""]
    if soak.interrupted:
        how = "stopped early by Ctrl-C/SIGTERM to the soak script"
    elif soak.ended_early_s is not None:
        how = f"**exited by itself** after {soak.ended_early_s / 60:.1f} min"
    else:
        how = f"stopped by SIGINT when the time was up (exited {fmt(soak.stop_s, '.0f')} s later)"
    first_s = first_step_s(records, soak.started_unix)
    clean = soak.returncode in (0, 130) and not soak.swept and soak.ended_early_s is None
    checkpoint = latest_checkpoint(soak.run_dir)
    lines += [
        f"- {len(times)} samples every {args.interval_s:g} s over {duration / 60:.1f} min; the run {how}, "
        f"exit code {soak.returncode}; leftover processes stopped after it: "
        f"{'; '.join(soak.swept) if soak.swept else 'none'}",
        f"- newest checkpoint: {checkpoint if checkpoint is not None else 'none'}",
        f"- warm-up end at {warm_s / 60:.1f} min (max({args.warmup_frac:g} x run, {args.warmup_min:g} min, first step "
        f"at {fmt(first_s / 60 if first_s is not None else None, '.1f')} min)); "
        f"flat = growth < {args.flat_pct:g}% and slope < {args.flat_mb_per_h:g} MB/h after warm-up",
    ]
    if warm_note:
        lines.append(f"- note: {warm_note}")
    # Roles seen only before the warm-up end: Ray processes before they take their title, start-up helpers.
    early = [g.role for g in growth if g.verdict == "n/a"]
    if early:
        lines.append(f"- seen only before the warm-up end (not judged): {', '.join(early)}")
    lines += ["", "## RSS by role (MB, summed over the role's processes; edges are medians of 3 samples)", ""]
    lines += ["| role | procs | at warm-up end | at end | growth MB | growth % | MB/h (fit) | verdict |"]
    lines += ["|---|---|---|---|---|---|---|---|"]
    for g in growth:
        if g.verdict == "n/a":
            continue
        procs = str(g.procs_end) if g.procs_warm == g.procs_end else f"{g.procs_warm}→{g.procs_end}"
        lines.append(
            f"| {g.role} | {procs} | {fmt(g.rss_warm_mb, '.0f')} | {fmt(g.rss_end_mb, '.0f')} | "
            f"{fmt(g.growth_mb, '+.1f')} | {fmt(g.growth_pct, '+.1f')} | {fmt(g.slope_mb_per_h, '+.1f')} | "
            f"{g.verdict} |"
        )
    # The verdict is over roles: the total sums ~15 processes, so the per-process MB/h bound does not apply to it.
    roles = [g for g in growth if g.role != TOTAL_ROLE and g.verdict != "n/a"]
    growing = [g.role for g in roles if g.verdict == "GROWING"]
    verdict = f"GROWING: {', '.join(growing)}" if growing else ("flat" if roles else "n/a (too few samples)")
    lines += ["", f"**Verdict (over the roles; the total is shown, not judged): {verdict}**", ""]

    q = queue_stats(records)
    lines += ["## Queue", ""]
    if q.size_max is None:
        lines.append("no step reported queue/size")
    else:
        share = f" ({q.size_max / q.max_size:.0%} of it)" if q.max_size else ""
        lines.append(
            f"queue/size over {q.steps} steps: max {q.size_max:.0f}{share}, mean {fmt(q.size_mean, '.1f')}, against "
            f"queue/max_size {fmt(q.max_size, '.0f')}; steps with the queue full: {q.steps_full}"
        )
    ledger = final_ledger(records)
    lines += ["", "## Ledger (the last step's counts)", ""]
    balance = ledger_balance(ledger)
    if balance is None:
        lines.append(f"incomplete ledger in metrics.jsonl: {ledger or 'none'}")
    else:
        lines.append(", ".join(f"{k}={v:.0f}" for k, v in ledger.items()))
        issued, accounted = balance
        ok = "OK" if issued == accounted else "MISMATCH"
        lines.append(
            f"\nissued {issued:.0f} == in_flight + trained + filtered + dropped_stale + failed {accounted:.0f}: {ok}"
        )
    # The journal holds every sample's issue and end (the executor keeps only in-flight ones in memory); it runs
    # past the last step's counts to the stop, so it is audited, not compared.
    audit = audit_journal(soak.run_dir)
    if audit.error is None:
        rate = audit.size_mb / (duration / 3600) if duration else None
        lines.append(
            f"\njournal audit OK: {audit.counts.get('issued', 0)} samples, none issued or ended twice; "
            + ", ".join(f"{k}={v}" for k, v in audit.counts.items())
            + f"; ledger.jsonl {audit.size_mb:.1f} MB ({fmt(rate, '.0f')} MB/h of disk)"
        )
    else:
        lines.append(f"\njournal audit FAILED: {audit.error}")
    lines += ["", "## Files", "", f"- rss.csv: {args.out / 'rss.csv'}", f"- {plot_note}", f"- run: {soak.run_dir}"]
    balanced = balance is not None and balance[0] == balance[1]
    passed = bool(roles) and not growing and balanced and audit.error is None and clean
    return "\n".join(lines) + "\n", passed


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the run trains (default: 30)")
    parser.add_argument("--interval-s", type=float, default=15.0, help="seconds between samples (default: 15)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: runs/bench/soak/<time>)")
    parser.add_argument("--warmup-min", type=float, default=3.0, help="minimum warm-up, minutes (default: 3)")
    parser.add_argument("--warmup-frac", type=float, default=0.2, help="warm-up as a share of the run (default: 0.2)")
    parser.add_argument("--flat-pct", type=float, default=5.0, help="flat: growth under this %% (default: 5)")
    parser.add_argument("--flat-mb-per-h", type=float, default=50.0, help="flat: slope under this (default: 50)")
    parser.add_argument("--echo", action="store_true", help="show the run's output here instead of in run/output.log")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for the run, after `--`")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.interval_s <= 0:
        parser.error("--minutes and --interval-s must be > 0")
    if not 0 <= args.warmup_frac < 1 or args.warmup_min < 0:
        parser.error("--warmup-frac must be in [0, 1) and --warmup-min >= 0")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"overrides must be key=value, got {bad}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _runs.install_stop_handlers()
    args.out = (args.out or _runs.timestamped_dir(_runs.DEFAULT_RUNS_ROOT, "soak")).resolve()
    try:
        run_dir = _runs.fresh_run_dir(args.out / "run")
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", _runs.TRAIN_MODULE, "train", f"run.dir={run_dir}", *SOAK_OVERRIDES]
    command += args.overrides
    soak = run_soak(command, run_dir, args.minutes, args.interval_s, args.echo)

    if not soak.samples:
        print("error: no sample taken", file=sys.stderr)
        return 1
    records = _metrics.read_metrics(run_dir / "metrics.jsonl")
    series = role_series(soak.samples)
    warm_s, warm_note = warmup_end_s(
        max(s.t_s for s in soak.samples), args.warmup_frac, args.warmup_min, first_step_s(records, soak.started_unix)
    )
    growth = [role_growth(r, pts, warm_s, args.flat_pct, args.flat_mb_per_h) for r, pts in series.items()]
    growth.sort(key=lambda g: (g.role == TOTAL_ROLE, -(g.rss_end_mb or 0.0)))  # biggest first, total last
    write_csv(args.out / "rss.csv", soak.samples)
    plot_note = write_plot(args.out / "rss.png", series, warm_s)
    summary, passed = render_summary(soak, args, growth, warm_s, warm_note, records, plot_note)
    (args.out / "summary.md").write_text(summary, encoding="utf-8")
    print("\n" + summary)  # the script's result display
    if soak.returncode not in (0, 130):
        print(f"the run failed; its output is in {run_dir / 'output.log'}", file=sys.stderr)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
