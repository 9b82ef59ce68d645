"""Benchmark (a script, not a test): the report's predicted-sync fit before and after warm starts, side by side.

Issue 32: the first `report RUN_DIR` fits the simulator to the run (simulate/calibrate.py) for its "a synchronous
run would take X". Before, the host-sharing fit ran 8 rounds of a 16-step bisection over the whole peak range, each
a whole-run simulation; after, each round's search starts from the last round's peak and slope, early rounds are
inexact, and the fit stops when a round moves nothing. Target: the first report on the default run in <= 20 s of
CPU, its prediction within 2% of the old fit's.

Per run directory (default: the committed fixture tests/fixtures/report_run; add `--run DIR`, e.g. a fresh default
run), each arm in a subprocess of its own source tree:
- before: `--before` (default d792328, the tree this work started from), its `rllm/` extracted with `git archive`
  into a temporary folder;
- after: this tree;
- fit: `simulate.from_run.predict_from_run` on the run's config.yaml and metrics.jsonl, cores = the run's recorded
  `host/cpus`: CPU seconds (time.process_time), wall seconds, whole-run simulations (Simulation.run calls), and
  the predictions: the run itself, the synchronous mode (or the other mode for a synchronous run);
- report (after only): the whole first `report RUN_DIR --out ...` command on a copy of the run without its cached
  prediction, CPU seconds of the child process (user + system, imports and rendering included).
Printed side by side with the prediction differences. Run from the repository root:

    PYTHONPATH=. .venv/bin/python tests/bench/bench_report_fit.py [--run DIR ...] [--before COMMIT]

Load matters (CPU seconds inflate under contention less than wall seconds do): the load average is printed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURE = REPO_ROOT / "tests" / "fixtures" / "report_run"
BEFORE_COMMIT = "d792328"

FIT = r"""
import json, sys, time
from omegaconf import OmegaConf
from rllm.experimental.fully_async.simulate import engine
from rllm.experimental.fully_async.simulate.from_run import predict_from_run

calls = [0]
run_one = engine.Simulation.run
def counted(self):
    calls[0] += 1
    return run_one(self)
engine.Simulation.run = counted
run = sys.argv[1]
records = [json.loads(line) for line in open(f"{run}/metrics.jsonl") if line.strip()]
cores = next((r["host/cpus"] for r in reversed(records) if "host/cpus" in r), None)
cpu, wall = time.process_time(), time.perf_counter()
result = predict_from_run(OmegaConf.load(f"{run}/config.yaml"), records, cores=cores)
cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
own = result.predicted_self_s  # after the clocks: the old fit simulates the run again here
print(json.dumps({"cpu_s": cpu, "wall_s": wall, "simulations": calls[0], "measured_s": result.fit.measured.wall_s,
                  "self_s": own, "other": result.other, "other_s": result.wall_s(result.other)}))
"""


def before_tree(commit: str, into: Path) -> Path:
    """`commit`'s rllm/ package extracted into `into` (no worktree, nothing else touched)."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit, "rllm"], cwd=REPO_ROOT, check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def fit(tree: Path, run: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", FIT, str(run)], cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"fit failed in {tree}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def first_report(run: Path, scratch: Path) -> tuple[float, float]:
    """CPU seconds (user + system) and wall seconds of `report` on a copy of `run` without its cached prediction."""
    copy = scratch / f"report-{run.name}"
    skip = shutil.ignore_patterns("report_prediction.json", "report.html", "checkpoints", "weights", "engines")
    shutil.copytree(run, copy, ignore=skip)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = os.times().elapsed
    command = [sys.executable, "-m", "rllm.experimental.fully_async", "report", str(copy), "--out", str(copy / "r.htm")]
    subprocess.run(command, cwd=REPO_ROOT, env=env, check=True, capture_output=True)
    wall = os.times().elapsed - wall
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", default=[], help="a run directory (repeatable); default the fixture")
    parser.add_argument("--before", default=BEFORE_COMMIT, help="commit of the 'before' arm")
    args = parser.parse_args()
    runs = [Path(r).resolve() for r in args.run] or [FIXTURE]
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-report-fit-") as scratch:
        old_tree = before_tree(args.before, Path(scratch) / "before")
        for run in runs:
            steps = sum('"trainer/step"' in line for line in (run / "metrics.jsonl").read_text().splitlines())
            old, new = fit(old_tree, run), fit(REPO_ROOT, run)
            report_cpu, report_wall = first_report(run, Path(scratch))
            print(f"\n{run} ({steps} steps, measured wall {new['measured_s']:.1f} s)")
            print(f"  {'':34}{'before':>12}{'after':>12}{'after/before':>14}")
            for label, key, fmt in [
                ("fit CPU s", "cpu_s", "{:.1f}"),
                ("fit wall s", "wall_s", "{:.1f}"),
                ("whole-run simulations", "simulations", "{:d}"),
                ("predicted for the run itself, s", "self_s", "{:.1f}"),
                (f"predicted {new['other']}, s", "other_s", "{:.1f}"),
            ]:
                ratio = new[key] / old[key] if old[key] else float("nan")
                print(f"  {label:34}{fmt.format(old[key]):>12}{fmt.format(new[key]):>12}{ratio:>14.3f}")
            print(f"  first `report` command (after): {report_cpu:.1f} s CPU, {report_wall:.1f} s wall")
    end = os.getloadavg()
    print(f"\nload average {load[0]:.1f} -> {end[0]:.1f} (1 min), machine has {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
