"""Benchmark (issue 4): wall time and trainer idle fraction, fully-async against synchronous training.

    .venv/bin/python tests/bench/bench_async_vs_sync.py [--steps 120] [--repeats 1] [--config FILE]
        [--out DIR] [--timeout-s S] [--quiet] [key=value ...]

Two runs of the same config and the same number of optimizer steps, one after the other in this invocation:
- async: `async_training.max_staleness=2` (rollouts for up to two versions ahead keep the engines busy while
  the trainer updates and syncs; K = the config's trigger_parameter_sync_step);
- sync:  `async_training.max_staleness=0 async_training.trigger_parameter_sync_step=1` (every batch is generated
  by the current weights, so the trainer waits for each one and the engines wait for each update).
With `--repeats R` the pair runs R times, alternating which goes first, so a drift in machine load hits both.

Measured per run (from metrics.jsonl): training wall time (first step's start to the last step; start-up and the
final validation excluded), the process wall time, mean step time, and the trainer idle fraction (time blocked
waiting for a batch / step time; both the mean over steps and the total ratio). Printed: each figure and the ratios
sync/async. Intermediate validation is off (`trainer.test_freq=0`): the engines serve it while async rollouts would
continue, which would blur the comparison. Extra `key=value` overrides go to both runs, after the script's own.

This is a measurement script, not a test: figures depend on the machine's load; compare the two arms of one
invocation, not invocations with each other. Results also go to OUT/results.json, and each run to
tests/bench/results/<experiment>/<arm>-seed<repeat>.json (`--experiment`, default async-vs-sync; results_tables.py
renders them). The arms' held-out accuracies
differ for a reason other than speed (the async arm's PPO clip binds against its stale behaviour policy, the
synchronous arm's never does; tests/bench/README.md, "Why the async arm led at step 150"): compare learning with
experiment_staleness.py.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import _results
import _runs
from _metrics import mean_std
from _runs import RunResult, fmt, ratio

logger = logging.getLogger("bench_async_vs_sync")

ARMS: dict[str, list[str]] = {
    "async": ["async_training.max_staleness=2"],
    "sync": ["async_training.max_staleness=0", "async_training.trigger_parameter_sync_step=1"],
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per run (default: 120)")
    parser.add_argument("--repeats", type=int, default=1, help="async/sync pairs, alternating order (default: 1)")
    parser.add_argument("--config", default=None, help="training YAML (default: the embedded tiny_cpu.yaml)")
    parser.add_argument("--out", type=Path, default=None, help="folder for the run dirs and results.json")
    parser.add_argument("--timeout-s", type=float, default=None, help="per run (default: 300 + 10 x steps)")
    parser.add_argument("--quiet", action="store_true", help="do not echo the runs' output")
    parser.add_argument("--experiment", default="async-vs-sync", help="results folder under tests/bench/results/")
    parser.add_argument("--results", type=Path, default=_results.RESULTS_ROOT, help="root of the result folders")
    parser.add_argument("--no-record", action="store_true", help="write no result files")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for both runs")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be >= 1")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"overrides must be key=value, got {bad}")
    return args


def run_order(repeats: int) -> list[tuple[int, str]]:
    """(repeat, arm) in run order: async first on even repeats, sync first on odd ones."""
    order: list[tuple[int, str]] = []
    for r in range(repeats):
        arms = ["async", "sync"] if r % 2 == 0 else ["sync", "async"]
        order.extend((r, arm) for arm in arms)
    return order


def print_runs(results: list[RunResult]) -> None:
    print(
        f"{'run':<12}{'train wall s':>13}{'process s':>11}{'steps':>7}{'step s':>8}{'idle mean':>11}"
        f"{'idle total':>12}{'stale max':>11}{'val before':>12}{'val after':>11}"
    )
    for r in results:
        m = r.metrics
        print(
            f"{r.label:<12}{fmt(m.train_wall_s, '.1f'):>13}{r.wall_s:>11.1f}{m.steps:>7}{fmt(m.step_s_mean):>8}"
            f"{fmt(m.idle_frac_mean, '.1%'):>11}{fmt(m.idle_frac_total, '.1%'):>12}{fmt(m.staleness_max, '.0f'):>11}"
            f"{fmt(m.initial_val_accuracy, '.1%'):>12}{fmt(m.final_val_accuracy, '.1%'):>11}"
        )


def summarise(results: list[RunResult]) -> dict[str, float | None]:
    """Means per arm over repeats and the sync/async ratios."""
    by_arm = {arm: [r for r in results if r.label.rsplit("-", 1)[0] == arm] for arm in ARMS}

    def arm_mean(arm: str, attr: str) -> float | None:
        return mean_std(getattr(r.metrics, attr) for r in by_arm[arm])[0]

    summary: dict[str, float | None] = {}
    for arm in ARMS:
        summary[f"{arm}/train_wall_s"] = arm_mean(arm, "train_wall_s")
        summary[f"{arm}/process_wall_s"] = mean_std(r.wall_s for r in by_arm[arm])[0]
        summary[f"{arm}/step_s_mean"] = arm_mean(arm, "step_s_mean")
        summary[f"{arm}/idle_frac_mean"] = arm_mean(arm, "idle_frac_mean")
        summary[f"{arm}/idle_frac_total"] = arm_mean(arm, "idle_frac_total")
    summary["sync_over_async/train_wall"] = ratio(summary["sync/train_wall_s"], summary["async/train_wall_s"])
    summary["sync_over_async/process_wall"] = ratio(summary["sync/process_wall_s"], summary["async/process_wall_s"])
    summary["sync_over_async/idle_frac_total"] = ratio(
        summary["sync/idle_frac_total"], summary["async/idle_frac_total"]
    )
    return summary


def print_summary(summary: dict[str, float | None], repeats: int) -> None:
    s = summary
    over = f" (means over {repeats} repeats)" if repeats > 1 else ""
    print(f"\nsync / async{over}:")
    print(
        f"  training wall time  {fmt(s['sync/train_wall_s'], '.1f')}s / {fmt(s['async/train_wall_s'], '.1f')}s"
        f" = {fmt(s['sync_over_async/train_wall'])}x"
    )
    print(
        f"  process wall time   {fmt(s['sync/process_wall_s'], '.1f')}s / {fmt(s['async/process_wall_s'], '.1f')}s"
        f" = {fmt(s['sync_over_async/process_wall'])}x  (start-up and validations included)"
    )
    print(
        f"  trainer idle        {fmt(s['sync/idle_frac_total'], '.1%')} / {fmt(s['async/idle_frac_total'], '.1%')}"
        f" of trainer time = {fmt(s['sync_over_async/idle_frac_total'])}x  (mean per step: "
        f"{fmt(s['sync/idle_frac_mean'], '.1%')} / {fmt(s['async/idle_frac_mean'], '.1%')})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _runs.install_stop_handlers()
    out = (args.out or _runs.timestamped_dir(_runs.DEFAULT_RUNS_ROOT, "bench_async_vs_sync")).resolve()
    timeout_s = args.timeout_s or _runs.default_timeout_s(args.steps)
    common = [f"trainer.total_training_steps={args.steps}", "trainer.test_freq=0"]
    plan = [(f"{arm}-{r}", out / f"{arm}-{r}", ARMS[arm]) for r, arm in run_order(args.repeats)]
    try:  # refuse a used --out before spending minutes on the first run
        for _, run_dir, _ in plan:
            _runs.fresh_run_dir(run_dir)
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    results: list[RunResult] = []
    commit = _results.git_commit()
    invocation = " ".join(["bench_async_vs_sync.py", *(sys.argv[1:] if argv is None else argv)])
    for position, (label, run_dir, arm_overrides) in enumerate(plan):
        overrides = [*common, *arm_overrides, *args.overrides]
        result = _runs.launch(label, overrides, run_dir, timeout_s=timeout_s, config=args.config, echo=not args.quiet)
        results.append(result)
        if not args.no_record:  # one result file per run: results_tables.py's `async-vs-sync` table
            arm, repeat = label.rsplit("-", 1)
            record = _results.run_record(
                result,
                experiment=args.experiment,
                arm=arm,
                seed=int(repeat),
                order=position % 2,
                overrides=overrides,
                config=args.config,
                invocation=invocation,
                params={"steps": args.steps, "repeats": args.repeats},
                commit=commit,
            )
            _results.write_record(_results.record_path(args.results / args.experiment, arm, int(repeat)), record)
        if not result.ok:
            # A ratio with one side missing means nothing: stop here and say why.
            logger.error("%s", result.failure())
            _runs.write_json(out / "results.json", {"runs": [r.to_json() for r in results], "failed": label})
            return 1

    print()
    print_runs(results)
    summary = summarise(results)
    print_summary(summary, args.repeats)
    _runs.write_json(
        out / "results.json",
        {"steps": args.steps, "repeats": args.repeats, "summary": summary, "runs": [r.to_json() for r in results]},
    )
    print(f"\nrun dirs and results.json in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
