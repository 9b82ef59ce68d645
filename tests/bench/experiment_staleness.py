"""Experiment (issues 5, 24): learning at any staleness — held-out accuracy, time-to-accuracy and generation cost of
fully-async training at η = 1 .. 16 beside a synchronous baseline.

    .venv/bin/python tests/bench/experiment_staleness.py [--seeds 0 1 2] [--steps 250] [--etas 1 4 8 16]
        [--methods lag1 m2po adaptive] [--threshold 0.55] [--test-freq 25] [--out DIR] [--config FILE]
        [--timeout-s S] [--quiet] [--dry-run] [-- key=value ...]

Arms. Every seed runs the synchronous baseline `sync` (η=0, K=1: every batch from the current weights) and, for
each η in `--etas` and each method in `--methods`, the arm `eta<η>-<method>`:
- lag1:     decoupled PPO with the proximal policy one version back (log-linear, A-3PO; behaviour weight capped
            at 2): `algorithm.off_policy_correction={mode: decoupled, prox_log_probs: loglinear, prox_lag: 1}`;
- m2po:     the second-moment trust region (M2PO; algorithms/second_moment.py): `{mode: m2po}` (tau 0.04);
- prev:     decoupled PPO with the proximal policy recomputed under the trainer's weights before its last step
            (`{mode: decoupled, prox_log_probs: previous}`): the policy one version back that lag1 interpolates;
- lag-half: lag1 with the proximal policy η/2 versions back (`prox_lag: max(1, η // 2)`): for tokens η versions
            old, as almost all are once generation outruns training, pi_prox is halfway between the behaviour and
            the current policy, so the clip binds on half of the movement since the behaviour version (not in the
            default grid);
- lag1-m2:  lag1 with AReaL's form of M2PO: the second-moment mask on log pi_prox - log pi_behav before the clipped
            loss (`m2_threshold: 0.04`; not in the default grid);
- adaptive: lag1 with adaptive staleness starting at η (`async_training.adaptive_staleness`, [min, max] =
            [1, max(16, η)], the rule's default thresholds; core/adaptive_staleness.py);
- naive:    PPO against the rollout log-probs, no correction; decoupled: decoupled PPO with the proximal policy
            recomputed at the step (the two arms of the first experiment; not in the default grid).
The async arms keep the config's K (1 in the default). Runs go seed by seed, each seed running every arm, so a drift
in machine load spreads over the arms. `run.seed=S data.seed=S` per seed; the task seed, hence the warmed-up
starting model and the held-out set, stays fixed.

An arm's identity cannot be overridden by accident: extra `key=value` overrides go to every run *before* the
arm's own, and one that names a key an arm sets (the staleness bound, the sync interval, the correction, adaptive
staleness, the old log-prob source; `ARM_KEYS`) is refused before anything runs (exit 2), since it would turn
`sync` into an async run or one η into another. Change the grid with the options instead.

Measured per run (metrics.jsonl; `_metrics.MetricsSummary`): the final held-out accuracy (greedy, `task.val_size`
prompts, after the last step's weights reached the engines), the training seconds until the first validation at or
above `--threshold` (time-to-accuracy; validations every `--test-freq` steps, measured on that step's weights), and
generated tokens per trained token (`rollout/tokens_generated` at the end over the trained `batch/tokens`: what
stale groups dropped and groups generated but never taken cost). Printed, and written to OUT/results.json and
OUT/results.md (rewritten after every run): per arm the per-seed final accuracy, mean ± sample std, the paired
difference from `sync` of the same seed (mean ± std), time-to-accuracy (mean over the seeds that reached it, and
how many did), tokens generated per trained token, mean staleness and, for adaptive, the final η.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _runs
from _metrics import mean_std
from _runs import RunResult, fmt

logger = logging.getLogger("experiment_staleness")

EXIT_BAD_CONFIG = 2  # the training CLI's exit code for a configuration it refuses

# Keys (or sections) that make an arm what it is. An extra override naming one of them, or a key below one, is
# refused: it would silently change an arm's identity (`async_training.max_staleness=8` turned `sync` into η=8).
ARM_KEYS = (
    "async_training.max_staleness",
    "async_training.staleness_threshold",
    "async_training.trigger_parameter_sync_step",
    "async_training.adaptive_staleness",
    "async_training.use_rollout_log_probs",
    "async_training.compute_prox_log_prob",
    "algorithm.off_policy_correction",
    "algorithm.rollout_correction",
)
LAG1 = "algorithm.off_policy_correction={mode: decoupled, prox_log_probs: loglinear, prox_lag: 1}"
METHODS: dict[str, tuple[str, tuple[str, ...]]] = {
    "lag1": ("decoupled PPO, proximal policy one version back (A-3PO log-linear), w capped at 2", (LAG1,)),
    "m2po": ("second-moment trust region (M2PO, tau 0.04)", ("algorithm.off_policy_correction={mode: m2po}",)),
    "adaptive": ("lag1 with adaptive staleness starting at η", (LAG1, "async_training.adaptive_staleness.enable=true")),
    "prev": (
        "decoupled PPO, proximal policy recomputed under the weights before the last step, w capped at 2",
        ("algorithm.off_policy_correction={mode: decoupled, prox_log_probs: previous}",),
    ),
    "lag-half": (
        "decoupled PPO, proximal policy η/2 versions back (log-linear), w capped at 2",
        ("algorithm.off_policy_correction={{mode: decoupled, prox_log_probs: loglinear, prox_lag: {half_eta}}}",),
    ),
    "lag1-m2": (
        "lag1 with AReaL's M2PO mask on log pi_prox - log pi_behav (m2_threshold 0.04), the clip kept",
        (
            "algorithm.off_policy_correction={mode: decoupled, prox_log_probs: loglinear, prox_lag: 1, "
            "m2_threshold: 0.04}",
        ),
    ),
    "naive": (
        "naive PPO (rollout log-probs as old, no correction)",
        (
            "async_training.use_rollout_log_probs=true",
            "async_training.compute_prox_log_prob=false",
            "algorithm.off_policy_correction=null",
        ),
    ),
    "decoupled": (
        "decoupled PPO, proximal policy recomputed at the step, w capped at 2",
        ("algorithm.off_policy_correction={mode: decoupled, prox_log_probs: recompute}",),
    ),
}
# Every arm states all of its identity, so a --config file cannot change one either (or is refused loudly: adaptive
# keys set in a file meet enable=false here and are refused by the training CLI, exit 2).
FIXED_ETA = "async_training.adaptive_staleness.enable=false"
SYNC = (
    "async_training.max_staleness=0",
    "async_training.trigger_parameter_sync_step=1",
    "algorithm.off_policy_correction=null",
    FIXED_ETA,
)


@dataclass(frozen=True)
class Arm:
    name: str
    description: str
    overrides: tuple[str, ...]  # what makes the arm; applied after every other override


def arms_for(etas: Sequence[int], methods: Sequence[str]) -> list[Arm]:
    """`sync`, then every (η, method) arm in grid order."""
    arms = [Arm("sync", "synchronous (η=0, K=1)", SYNC)]
    for eta in etas:
        for method in methods:
            description, overrides = METHODS[method]
            extra: tuple[str, ...] = (FIXED_ETA,)
            if method == "adaptive":
                extra = (
                    "async_training.adaptive_staleness.min=1",
                    f"async_training.adaptive_staleness.max={max(16, eta)}",
                )
            arms.append(
                Arm(
                    f"eta{eta}-{method}",
                    f"η={eta}, {description}",
                    (
                        f"async_training.max_staleness={eta}",
                        *(o.format(half_eta=max(1, eta // 2)) if "{half_eta}" in o else o for o in overrides),
                        *extra,
                    ),
                )
            )
    return arms


def identity_conflicts(overrides: Sequence[str]) -> list[str]:
    """The extra overrides that would change an arm's identity (their keys are `ARM_KEYS` or below one)."""
    conflicts = []
    for item in overrides:
        key = item.split("=", 1)[0].strip().lstrip("+~")
        if any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in ARM_KEYS):
            conflicts.append(item)
    return conflicts


def run_overrides(arm: Arm, seed: int, steps: int, test_freq: int, extra: Sequence[str]) -> list[str]:
    """One run's overrides, in order: the experiment's, the user's extra ones, then the arm's (which win)."""
    common = [f"trainer.total_training_steps={steps}", f"trainer.test_freq={test_freq}", f"run.seed={seed}"]
    return [*common, f"data.seed={seed}", *extra, *arm.overrides]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="run.seed = data.seed values")
    parser.add_argument("--steps", type=int, default=250, help="optimizer steps per run (default: 250)")
    parser.add_argument("--etas", type=int, nargs="+", default=[1, 4, 8, 16], help="η of the async arms")
    parser.add_argument(
        "--methods", nargs="+", choices=list(METHODS), default=["lag1", "m2po", "adaptive"], help="async arms per η"
    )
    parser.add_argument("--threshold", type=float, default=0.55, help="held-out accuracy for time-to-accuracy")
    parser.add_argument("--test-freq", type=int, default=25, help="steps between validations (default: 25)")
    parser.add_argument("--out", type=Path, default=None, help="folder for run dirs, results.json, results.md")
    parser.add_argument("--config", default=None, help="training YAML (default: the embedded tiny_cpu.yaml)")
    parser.add_argument("--timeout-s", type=float, default=None, help="per run (default: 300 + 10 x steps)")
    parser.add_argument("--quiet", action="store_true", help="do not echo the runs' output")
    parser.add_argument("--dry-run", action="store_true", help="print every run's overrides and exit")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run (not the arms' own keys)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.test_freq < 1:
        parser.error("--steps and --test-freq must be >= 1")
    if any(eta < 1 for eta in args.etas):
        parser.error("--etas must be >= 1 (η=0 is the sync arm, which every seed runs)")
    if len(set(args.seeds)) != len(args.seeds) or len(set(args.etas)) != len(args.etas):
        parser.error("--seeds and --etas must not repeat a value")
    if len(set(args.methods)) != len(args.methods):
        parser.error("--methods must not repeat a value")
    if not 0 < args.threshold <= 1:
        parser.error("--threshold is a held-out accuracy in (0, 1]")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"overrides must be key=value, got {bad}")
    conflicts = identity_conflicts(args.overrides)
    if conflicts:
        parser.error(
            f"{conflicts[0]!r} would change what an arm is (keys under {', '.join(ARM_KEYS)} are the arms' own); "
            "choose the grid with --etas and --methods instead"
        )
    return args


def arm_rows(
    arms: Sequence[Arm], seeds: Sequence[int], results: dict[tuple[str, int], RunResult], threshold: float
) -> dict[str, Any]:
    """Per arm: final accuracy per seed (None: failed), mean, std, the paired difference from sync, time to
    `threshold`, generated per trained token, staleness, and the final η of adaptive runs."""
    rows: dict[str, Any] = {}
    for arm in arms:
        runs = {seed: results[(arm.name, seed)] for seed in seeds if (arm.name, seed) in results}
        finals = {seed: (r.metrics.final_val_accuracy if r.ok else None) for seed, r in runs.items()}
        mean, std, n = mean_std(finals.values())
        deltas = []
        for seed, acc in finals.items():
            base = results.get(("sync", seed))
            if acc is not None and base is not None and base.ok:
                deltas.append(acc - base.metrics.final_val_accuracy)
        delta, delta_std, _ = mean_std(deltas)
        times = [r.metrics.time_to_accuracy(threshold) for r in runs.values() if r.ok]
        reached = [t for t in times if t is not None]
        rows[arm.name] = {
            "description": arm.description,
            "overrides": list(arm.overrides),
            "final_accuracy": {str(seed): acc for seed, acc in finals.items()},
            "mean": mean,
            "std": std,
            "n": n,
            "delta_vs_sync_mean": delta,
            "delta_vs_sync_std": delta_std,
            "initial_accuracy_mean": mean_std(r.metrics.initial_val_accuracy for r in runs.values())[0],
            "time_to_accuracy_s_mean": mean_std(reached)[0],
            "time_to_accuracy_reached": f"{len(reached)}/{len(times)}",
            "generated_per_trained_token": mean_std(r.metrics.generated_per_trained_token for r in runs.values())[0],
            "staleness_mean": mean_std(r.metrics.staleness_mean for r in runs.values())[0],
            "staleness_max": max((r.metrics.staleness_max or 0.0 for r in runs.values()), default=None),
            "dropped_stale_groups_mean": mean_std(r.metrics.dropped_stale_groups for r in runs.values())[0],
            "train_wall_s_mean": mean_std(r.metrics.train_wall_s for r in runs.values())[0],
            "eta_final": [r.metrics.eta_final for r in runs.values() if r.metrics.eta_final is not None],
            "val_curves": {str(seed): list(r.metrics.val_curve) for seed, r in runs.items()},
        }
    return rows


def _pm(mean: float | None, std: float | None, pattern: str, scale: float = 1.0) -> str:
    if mean is None:
        return "n/a"
    return f"{format(mean * scale, pattern)} ± {fmt(None if std is None else std * scale, pattern)}"


def table_lines(rows: dict[str, Any], seeds: Sequence[int], threshold: float, markdown: bool) -> list[str]:
    """The result table, as aligned text or as a markdown table."""
    headers = [
        "arm",
        *[f"seed {s}" for s in seeds],
        "mean ± std",
        "Δ vs sync (pts)",
        f"time to {threshold:.0%} (s)",
        "gen/trained tok",
        "staleness mean/max",
        "dropped stale",
        "train s",
        "final η",
    ]
    body = []
    for arm, row in rows.items():
        ran = row["final_accuracy"]  # seeds that ran (None: the run failed); a seed not in it has not run yet
        finals = [fmt(ran[str(s)], ".1%", missing="failed") if str(s) in ran else "not run" for s in seeds]
        etas = row["eta_final"]
        body.append(
            [
                arm,
                *finals,
                _pm(row["mean"], row["std"], ".1%"),
                "-" if arm == "sync" else _pm(row["delta_vs_sync_mean"], row["delta_vs_sync_std"], "+.1f", 100),
                f"{fmt(row['time_to_accuracy_s_mean'], '.0f')} ({row['time_to_accuracy_reached']})",
                fmt(row["generated_per_trained_token"], ".3f"),
                f"{fmt(row['staleness_mean'])}/{fmt(row['staleness_max'], '.0f')}",
                fmt(row["dropped_stale_groups_mean"], ".0f"),
                fmt(row["train_wall_s_mean"], ".0f"),
                "/".join(f"{e:.0f}" for e in etas) or "-",
            ]
        )
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        return lines + ["| " + " | ".join(cells) + " |" for cells in body]
    widths = [max(len(h), *(len(cells[i]) for cells in body)) for i, h in enumerate(headers)]
    return ["  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) for cells in [headers, *body]]


def markdown_report(rows: dict[str, Any], args: argparse.Namespace, command: str) -> str:
    arms = "\n".join(f"- `{arm}`: {row['description']}; `{' '.join(row['overrides'])}`" for arm, row in rows.items())
    return "\n".join(
        [
            "# Staleness experiment: held-out accuracy, time-to-accuracy, generation cost",
            "",
            f"Command: `{command}`",
            "",
            f"{args.steps} steps per run; seeds {', '.join(map(str, args.seeds))} (`run.seed`, `data.seed`); "
            "accuracy = greedy exact match on the held-out set after the last step; std is the sample std (n-1); "
            f"Δ vs sync = paired per seed; time to {args.threshold:.0%} = training seconds to the first validation "
            f"(every {args.test_freq} steps) at or above it, mean over the seeds that reached it (reached/ran).",
            "",
            arms,
            "",
            *table_lines(rows, args.seeds, args.threshold, markdown=True),
            "",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    arms = arms_for(args.etas, args.methods)
    plan = [(arm, seed) for seed in args.seeds for arm in arms]
    if args.dry_run:
        for arm, seed in plan:
            overrides = run_overrides(arm, seed, args.steps, args.test_freq, args.overrides)
            print(f"{arm.name}-seed{seed}: {shlex.join(overrides)}")
        print(f"{len(plan)} runs of {args.steps} steps")
        return 0
    _runs.install_stop_handlers()
    out = (args.out or _runs.timestamped_dir(_runs.DEFAULT_RUNS_ROOT, "experiment_staleness")).resolve()
    timeout_s = args.timeout_s or _runs.default_timeout_s(args.steps)
    python = os.path.relpath(sys.executable, _runs.REPO_ROOT)  # `.venv/bin/python` when run as documented
    command = shlex.join([python, *sys.argv]) if argv is None else shlex.join(argv)
    try:  # refuse a used --out before spending minutes on the first run
        for arm, seed in plan:
            _runs.fresh_run_dir(out / f"{arm.name}-seed{seed}")
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    results: dict[tuple[str, int], RunResult] = {}
    rows: dict[str, Any] = {}
    for arm, seed in plan:
        label = f"{arm.name}-seed{seed}"
        overrides = run_overrides(arm, seed, args.steps, args.test_freq, args.overrides)
        result = _runs.launch(
            label, overrides, out / label, timeout_s=timeout_s, config=args.config, echo=not args.quiet
        )
        results[(arm.name, seed)] = result
        if not result.ok:
            # One failed run does not void the others: record it, say why, go on.
            logger.error("%s", result.failure())
        stop_early = result.returncode == EXIT_BAD_CONFIG  # every later run would be refused the same way
        # Rewritten after every run, so an interrupted experiment still leaves its finished runs' results.
        rows = arm_rows(arms, args.seeds, results, args.threshold)
        _runs.write_json(
            out / "results.json",
            {
                "command": command,
                "steps": args.steps,
                "seeds": args.seeds,
                "threshold": args.threshold,
                "arms": rows,
                "runs": [r.to_json() for r in results.values()],
            },
        )
        (out / "results.md").write_text(markdown_report(rows, args, command), encoding="utf-8")
        if stop_early:
            logger.error("the training CLI rejected the configuration (exit 2); not starting the other runs")
            break

    print()
    for arm in arms:
        print(f"{arm.name}: {arm.description}")
    print()
    print("\n".join(table_lines(rows, args.seeds, args.threshold, markdown=False)))
    print(f"\nresults.json, results.md and run dirs in {out}")
    failed = [r.label for r in results.values() if not r.ok]
    if failed:
        print(f"failed runs: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
