"""Experiment (issue 5): final held-out accuracy over seeds, synchronous against stale fully-async training.

    .venv/bin/python tests/bench/experiment_staleness.py [--seeds 0 1 2] [--steps 120]
        [--arms sync async_naive async_decoupled async_decoupled_lag1] [--out DIR] [--config FILE]
        [--timeout-s S] [--quiet] [key=value ...]

Four arms, each trained once per seed (`run.seed=S data.seed=S`: trainer RNG, engine sampling and data order;
the task, hence the warmed-up starting model and the held-out set, stays fixed by `task.seed`):
- sync:            `max_staleness=0, trigger_parameter_sync_step=1`: on-policy, every batch from the current weights;
- async_naive:     `max_staleness=4`, naive PPO: the rollout (behaviour) log-probs serve as the old log-probs and
                   nothing corrects for staleness, so the PPO trust region is centred on a policy up to 4 versions old;
- async_decoupled: `max_staleness=4`, decoupled PPO (AReaL): proximal log-probs recomputed by the trainer before each
                   step centre the trust region, and the behaviour importance weight pi_prox/pi_behav (truncated at
                   the correction's cap, 2 by default) corrects for the stale behaviour policy;
- async_decoupled_lag1: as async_decoupled, with the proximal policy one version behind the trainer's weights
                   (`prox_lag=1`, log-linear interpolation from the recomputed log-probs, A-3PO), so the clip of
                   pi_theta/pi_prox binds even though each batch gets exactly one optimizer step.
The async arms keep the config's trigger_parameter_sync_step (1 in the default). Runs go seed by seed, each seed
running every arm, so a drift in machine load spreads over the arms rather than landing on one.

The final accuracy is the driver's last validation (greedy, `task.val_size` held-out prompts) after the last
step's weights reached the engines. Printed and written to OUT/results.json and OUT/results.md: per arm the
per-seed final accuracy, mean ± sample std, the initial accuracy, and mean staleness (to show the async arms were
in fact stale). Extra `key=value` overrides go to every run, after the script's own; put them before the options
or after `--` (`--seeds 0 1 -- trainer.test_freq=0`), since `--seeds` and `--arms` take several values.
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
from _runs import RunResult, fmt, mean_std

logger = logging.getLogger("experiment_staleness")

EXIT_BAD_CONFIG = 2  # the training CLI's exit code for a configuration it refuses


@dataclass(frozen=True)
class Arm:
    description: str
    overrides: tuple[str, ...]


ARMS: dict[str, Arm] = {
    "sync": Arm(
        "synchronous (η=0, K=1)",
        ("async_training.max_staleness=0", "async_training.trigger_parameter_sync_step=1"),
    ),
    "async_naive": Arm(
        "fully-async η=4, naive PPO (rollout log-probs as old, no correction)",
        (
            "async_training.max_staleness=4",
            "async_training.use_rollout_log_probs=true",
            "async_training.compute_prox_log_prob=false",
            "algorithm.off_policy_correction=null",
        ),
    ),
    "async_decoupled": Arm(
        "fully-async η=4, decoupled PPO (recomputed proximal, capped behaviour weight)",
        (
            "async_training.max_staleness=4",
            "algorithm.off_policy_correction={mode: decoupled, prox_log_probs: recompute}",
        ),
    ),
    "async_decoupled_lag1": Arm(
        "fully-async η=4, decoupled PPO with pi_prox one version back (log-linear, capped behaviour weight)",
        (
            "async_training.max_staleness=4",
            "algorithm.off_policy_correction={mode: decoupled, prox_log_probs: loglinear, prox_lag: 1}",
        ),
    ),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="run.seed = data.seed values")
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per run (default: 120)")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS), help="arms to run (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="folder for run dirs, results.json, results.md")
    parser.add_argument("--config", default=None, help="training YAML (default: the embedded tiny_cpu.yaml)")
    parser.add_argument("--timeout-s", type=float, default=None, help="per run (default: 300 + 10 x steps)")
    parser.add_argument("--quiet", action="store_true", help="do not echo the runs' output")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if len(set(args.seeds)) != len(args.seeds) or len(set(args.arms)) != len(args.arms):
        parser.error("--seeds and --arms must not repeat a value")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"overrides must be key=value, got {bad}")
    return args


def arm_rows(arms: Sequence[str], seeds: Sequence[int], results: dict[tuple[str, int], RunResult]) -> dict[str, Any]:
    """Per arm: final accuracy per seed (None: failed), mean, std, initial accuracy and staleness."""
    rows: dict[str, Any] = {}
    for arm in arms:
        runs = {seed: results[(arm, seed)] for seed in seeds if (arm, seed) in results}
        finals = {seed: (r.metrics.final_val_accuracy if r.ok else None) for seed, r in runs.items()}
        mean, std, n = mean_std(finals.values())
        initial, _, _ = mean_std(r.metrics.initial_val_accuracy for r in runs.values())
        rows[arm] = {
            "description": ARMS[arm].description,
            "overrides": list(ARMS[arm].overrides),
            "final_accuracy": {str(seed): acc for seed, acc in finals.items()},
            "mean": mean,
            "std": std,
            "n": n,
            "initial_accuracy_mean": initial,
            "staleness_mean": mean_std(r.metrics.staleness_mean for r in runs.values())[0],
            "staleness_max": max((r.metrics.staleness_max or 0.0 for r in runs.values()), default=None),
            "dropped_stale_groups_mean": mean_std(r.metrics.dropped_stale_groups for r in runs.values())[0],
            "train_wall_s_mean": mean_std(r.metrics.train_wall_s for r in runs.values())[0],
        }
    return rows


def _mean_pm_std(row: dict[str, Any]) -> str:
    if row["mean"] is None:
        return "n/a"
    return f"{row['mean']:.1%} ± {fmt(row['std'], '.1%')}"


def table_lines(rows: dict[str, Any], seeds: Sequence[int], markdown: bool) -> list[str]:
    """The result table, as aligned text or as a markdown table."""
    headers = [
        "arm",
        *[f"seed {s}" for s in seeds],
        "mean ± std",
        "initial",
        "Δ mean",
        "staleness mean/max",
        "dropped stale",
        "train s",
    ]
    body = []
    for arm, row in rows.items():
        finals = [row["final_accuracy"].get(str(s)) for s in seeds]
        mean, initial = row["mean"], row["initial_accuracy_mean"]
        delta = None if mean is None or initial is None else mean - initial
        body.append(
            [
                arm,
                *[fmt(a, ".1%", missing="failed") for a in finals],
                _mean_pm_std(row),
                fmt(row["initial_accuracy_mean"], ".1%"),
                fmt(None if delta is None else delta * 100, "+.1f") + (" pts" if delta is not None else ""),
                f"{fmt(row['staleness_mean'])}/{fmt(row['staleness_max'], '.0f')}",
                fmt(row["dropped_stale_groups_mean"], ".0f"),
                fmt(row["train_wall_s_mean"], ".0f"),
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
            "# Staleness experiment: final held-out accuracy",
            "",
            f"Command: `{command}`",
            "",
            f"{args.steps} steps per run; seeds {', '.join(map(str, args.seeds))} (`run.seed`, `data.seed`); "
            "accuracy = greedy exact match on the held-out set after the last step. std is the sample std (n-1).",
            "",
            arms,
            "",
            *table_lines(rows, args.seeds, markdown=True),
            "",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _runs.install_stop_handlers()
    out = (args.out or _runs.timestamped_dir(_runs.DEFAULT_RUNS_ROOT, "experiment_staleness")).resolve()
    timeout_s = args.timeout_s or _runs.default_timeout_s(args.steps)
    python = os.path.relpath(sys.executable, _runs.REPO_ROOT)  # `.venv/bin/python` when run as documented
    command = shlex.join([python, *sys.argv]) if argv is None else shlex.join(argv)
    plan = [(arm, seed, out / f"{arm}-seed{seed}") for seed in args.seeds for arm in args.arms]
    try:  # refuse a used --out before spending minutes on the first run
        for _, _, run_dir in plan:
            _runs.fresh_run_dir(run_dir)
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    results: dict[tuple[str, int], RunResult] = {}
    for arm, seed, run_dir in plan:
        overrides = [
            f"trainer.total_training_steps={args.steps}",
            f"run.seed={seed}",
            f"data.seed={seed}",
            *ARMS[arm].overrides,
            *args.overrides,
        ]
        result = _runs.launch(
            f"{arm}-seed{seed}", overrides, run_dir, timeout_s=timeout_s, config=args.config, echo=not args.quiet
        )
        results[(arm, seed)] = result
        if not result.ok:
            # One failed seed does not void the others: record it, say why, go on.
            logger.error("%s", result.failure())
        stop_early = result.returncode == EXIT_BAD_CONFIG  # every later run would be refused the same way
        # Rewritten after every run, so an interrupted experiment still leaves its finished runs' results.
        rows = arm_rows(args.arms, args.seeds, results)
        _runs.write_json(
            out / "results.json",
            {
                "command": command,
                "steps": args.steps,
                "seeds": args.seeds,
                "arms": rows,
                "runs": [r.to_json() for r in results.values()],
            },
        )
        (out / "results.md").write_text(markdown_report(rows, args, command), encoding="utf-8")
        if stop_early:
            logger.error("the training CLI rejected the configuration (exit 2); not starting the other runs")
            break

    print()
    for arm, row in rows.items():
        print(f"{arm}: {row['description']}")
    print()
    print("\n".join(table_lines(rows, args.seeds, markdown=False)))
    print(f"\nresults.json, results.md and run dirs in {out}")
    failed = [r.label for r in results.values() if not r.ok]
    if failed:
        print(f"failed runs: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
