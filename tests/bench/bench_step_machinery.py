"""Benchmark (a script, not a test): the trainer's step machinery before and after the rollout service, side by side.

Issue 11 §1: of each trainer step, how much is spent outside the update, the wait for a batch and the weight sync.

    machinery_s = timing/step_s - timing/update_s - timing/wait_batch_s - sync/total_s      (per step, from metrics)
    share       = machinery_s / timing/step_s

Two arms, run one after the other in one invocation, both the default CLI with
`trainer.total_training_steps=N trainer.test_freq=0`:
- before: commit 1f9167e (the layout move, before this work), checked out with `git worktree add` into a
  temporary folder and run from it (cwd and PYTHONPATH: `python -m` imports from the cwd first);
- after: this tree.
Printed per arm: median machinery share, median machinery seconds, median step time, training wall time
(`_metrics.summarize_metrics`: first step's start to the last step's log line), and process wall time.
Targets (issue 11): median share <= 10%; 500 default steps in <= 210 s of training on a quiet 2-core machine.

Run from the repository root: `PYTHONPATH=. .venv/bin/python tests/bench/bench_step_machinery.py --steps 500`.
Results go under runs/bench/step_machinery/<timestamp>/ (git-ignored); record them in tests/bench/README.md with
the load average.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _runs import (
    DEFAULT_RUNS_ROOT,
    REPO_ROOT,
    default_timeout_s,
    fmt,
    install_stop_handlers,
    launch,
    read_metrics,
    timestamped_dir,
)

logger = logging.getLogger(__name__)
BEFORE_COMMIT = "1f9167e"


def machinery(records: list[dict[str, Any]]) -> tuple[float | None, float | None, float | None]:
    """(median share, median seconds, median step time) over the step lines of one run."""
    shares, seconds, steps = [], [], []
    for r in records:
        if "trainer/step" not in r or "timing/step_s" not in r:
            continue
        step = float(r["timing/step_s"])
        outside = step - float(r.get("timing/update_s", 0.0)) - float(r.get("timing/wait_batch_s", 0.0))
        outside -= float(r.get("sync/total_s", 0.0))
        shares.append(outside / step if step > 0 else 0.0)
        seconds.append(outside)
        steps.append(step)
    if not steps:
        return None, None, None
    return statistics.median(shares), statistics.median(seconds), statistics.median(steps)


@contextmanager
def before_tree(commit: str):
    """A detached worktree of `commit` in a temporary folder, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="before-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=REPO_ROOT, check=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPO_ROOT, check=False)


@contextmanager
def pythonpath(path: Path):
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(path)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps per arm (issue target: 500)")
    parser.add_argument("--before", default=BEFORE_COMMIT, help="commit of the 'before' arm")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: a timestamped one)")
    parser.add_argument("--quiet", action="store_true", help="do not echo the runs' output")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    install_stop_handlers()
    out = args.out or timestamped_dir(DEFAULT_RUNS_ROOT, "step_machinery")
    overrides = [f"trainer.total_training_steps={args.steps}", "trainer.test_freq=0"]
    timeout_s = default_timeout_s(args.steps)
    load_before = os.getloadavg()
    results = {}
    with before_tree(args.before) as tree, pythonpath(tree):
        # cwd too: `python -m` puts the working directory ahead of PYTHONPATH on sys.path.
        results["before"] = launch(
            "before", overrides, out / "before", timeout_s=timeout_s, echo=not args.quiet, cwd=tree
        )
    with pythonpath(REPO_ROOT):
        results["after"] = launch("after", overrides, out / "after", timeout_s=timeout_s, echo=not args.quiet)
    load_after = os.getloadavg()

    load = f"load average {load_before[0]:.1f} -> {load_after[0]:.1f}"
    print(f"\nstep machinery, {args.steps} default steps per arm ({load})")
    print(f"{'':28}{'before':>12}{'after':>12}")
    rows = {}
    for name, result in results.items():
        # The before arm has timing/report_s (its report_consumed call); the after arm has timing/take_overhead_s.
        share, seconds, step = machinery(read_metrics(result.run_dir / "metrics.jsonl"))
        rows[name] = (share, seconds, step, result.metrics.train_wall_s, result.wall_s, result.ok)
    labels = ("median machinery share", "median machinery s", "median step s", "training wall s", "process wall s")
    specs = (".1%", ".3f", ".3f", ".1f", ".1f")
    for index, (label, spec) in enumerate(zip(labels, specs, strict=True)):
        print(f"{label:28}{fmt(rows['before'][index], spec):>12}{fmt(rows['after'][index], spec):>12}")
    for result in results.values():
        if not result.ok:
            print(result.failure())
    print(f"run dirs: {out}")


if __name__ == "__main__":
    main()
