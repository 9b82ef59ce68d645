"""Experiment (issue 33): does the default task learn with a LoRA adapter, against full fine-tuning at the same steps?

    .venv/bin/python tests/bench/experiment_lora.py [--arms full lora] [--seeds 0 1 2] [--steps N] [--test-freq N]
        [--experiment lora-vs-full] [--timeout-s S] [--quiet] [--dry-run] [-- key=value ...]

Two arms on the embedded default (config/tiny_cpu.yaml's 2-digit addition), differing only in LoRA:
- full: the embedded default as shipped (every weight trains, its lr 3e-4);
- lora: `actor_rollout_ref.model.lora_rank=8` (peft's adapter on all linear layers, the shipped lora_alpha) with
  `actor_rollout_ref.actor.optim.lr=5e-3`, the rate the README recommended when these runs were made (it collapsed
  the policy, so the README now says 1e-3: the lora-lr1e-3 arm). The rate differs because an
  adapter starts at zero (peft initialises B to 0: the first steps move only A's product with a zero B) and its
  few parameters want a larger step than full weights; the rate is part of the arm, so this experiment compares
  "LoRA as the README tells you to run it" with "the default as shipped", not LoRA at equal lr.
Both arms take the same steps, validation interval and seeds (`run.seed` = `data.seed` = the seed, as
experiment_staleness.py does); per seed the arms run in an order rotated by the seed (seed 0: full first, seed 1:
lora first, ...), so neither arm always runs first on a machine whose load drifts.
`--arms` adds LoRA at other rates (`ARMS`: lora-lr1e-3, and lora-lr3e-4 at full fine-tuning's own rate, where the
arms differ in LoRA alone); their runs go to the same folder, and the table pairs each with full per seed.

Each finished run writes `tests/bench/results/<experiment>/<arm>-seed<k>.json` (`_results.py`), with, beyond the
common record, `lora`: the trainable and total parameter counts and their share, counted from the run's own model
folder wrapped the way the trainer wraps it (backends/fsdp.py `_with_lora` with the run's resolved lora keys;
the full arm: every parameter trains), and the bytes one weight sync carries at fp32 (the adapter's tensors, or
every parameter), computed from those tensors (the runs' metrics record no sync bytes), beside the size of the
last version's tensor files the run left under param_sync.weights_dir (disk transport).
A run whose successful record exists is skipped (an interrupted experiment resumes). `tests/bench/results_tables.py`
renders the `lora` table from the files.
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

import _results
import _runs

logger = logging.getLogger("experiment_lora")

EXIT_BAD_CONFIG = 2
LORA_RANK = 8
LORA_LR = 5e-3  # the README's rate when the committed runs were made (now 1e-3; the results keep this arm's name)
ARM_KEYS = ("actor_rollout_ref.model.lora_rank", "actor_rollout_ref.actor.optim.lr")


@dataclass(frozen=True)
class Arm:
    name: str
    description: str
    overrides: tuple[str, ...]


def lora_arm(name: str, lr: float, why: str) -> Arm:
    return Arm(
        name,
        f"LoRA rank {LORA_RANK} over the frozen base, lr {lr:g} ({why})",
        (f"actor_rollout_ref.model.lora_rank={LORA_RANK}", f"actor_rollout_ref.actor.optim.lr={lr:g}"),
    )


ARMS = {
    "full": Arm("full", "the embedded default as shipped: every weight trains (lr 3e-4)", ()),
    "lora": lora_arm("lora", LORA_LR, "the README's rate for an adapter"),
    # Not in the default pair: the rate between, and the full arm's own rate (then the arms differ in LoRA alone).
    "lora-lr1e-3": lora_arm("lora-lr1e-3", 1e-3, "a rate between the README's and full fine-tuning's"),
    "lora-lr3e-4": lora_arm("lora-lr3e-4", 3e-4, "full fine-tuning's rate: the arms differ in LoRA alone"),
}
DEFAULT_ARMS = ("full", "lora")


def run_order(arms: Sequence[str], seed: int) -> list[Arm]:
    """The seed's arms, rotated by the seed: with two arms, the first runs first on even seeds, last on odd ones."""
    shift = seed % len(arms)
    return [ARMS[name] for name in (*arms[shift:], *arms[:shift])]


def run_overrides(arm: Arm, seed: int, steps: int, test_freq: int, extra: Sequence[str]) -> list[str]:
    common = [f"trainer.total_training_steps={steps}", f"trainer.test_freq={test_freq}", f"run.seed={seed}"]
    return [*common, f"data.seed={seed}", *extra, *arm.overrides]


def parameter_share(run_dir: Path) -> dict[str, Any] | None:
    """Trainable and total parameters of the run's policy, wrapped from its resolved config.yaml as the trainer
    wraps it, and the fp32 bytes one sync carries; None when the run left no config."""
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        return None
    # Imported here: torch, transformers and peft take seconds, and --dry-run needs none of them.
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from rllm.experimental.fully_async.backends.fsdp import _with_lora
    from rllm.experimental.fully_async.run_spec import trainer_lora_spec

    cfg = OmegaConf.load(config_path)
    model = AutoModelForCausalLM.from_pretrained(str(cfg.actor_rollout_ref.model.path), dtype="float32")
    spec = trainer_lora_spec(cfg)
    if spec is not None:
        model = _with_lora(model, spec.peft_kwargs())
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trainable = [p for p in params if p.requires_grad]
    count = sum(p.numel() for p in trainable)
    if spec is None:
        total_base, sync_bytes = total, sum(t.numel() * 4 for t in model.state_dict().values())
    else:
        total_base = total - count  # peft's total counts the adapter on top of the frozen base
        sync_bytes = sum(p.numel() * 4 for p in trainable)  # the adapter's tensors alone
    return {
        "rank": None if spec is None else spec.rank,
        "alpha": None if spec is None else spec.alpha,
        "target_modules": None if spec is None else spec.target_modules,
        "trainable_params": count,
        "total_params": total,
        "base_params": total_base,
        "trainable_share": count / total,
        "sync_bytes_fp32": sync_bytes,
        "last_sync_file_bytes": _last_sync_bytes(run_dir / "weights"),
    }


def _last_sync_bytes(weights_dir: Path) -> int | None:
    """Bytes of the newest version folder the run wrote under param_sync.weights_dir (disk transport: what the
    engines loaded at the last sync, README and config files excluded); None when none is left."""
    versions = sorted(
        (p for p in weights_dir.glob("v*") if p.is_dir() and p.name[1:].isdigit()), key=lambda p: int(p.name[1:])
    )
    if not versions:
        return None
    return sum(f.stat().st_size for f in versions[-1].iterdir() if f.suffix in (".safetensors", ".bin", ".pt"))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--experiment", default="lora-vs-full", help="results folder under tests/bench/results/")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(DEFAULT_ARMS), help="default: full lora")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="run.seed = data.seed values")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run (both arms)")
    parser.add_argument("--test-freq", type=int, default=25, help="steps between validations")
    parser.add_argument("--results", type=Path, default=_results.RESULTS_ROOT, help="root of the result folders")
    parser.add_argument("--out", type=Path, default=None, help="folder for the run dirs")
    parser.add_argument("--timeout-s", type=float, default=None, help="per run (default: 300 + 10 x steps)")
    parser.add_argument("--quiet", action="store_true", help="do not echo the runs' output")
    parser.add_argument("--dry-run", action="store_true", help="print the plan")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run (not the arms' keys)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.test_freq < 1:
        parser.error("--steps and --test-freq must be >= 1")
    for name, values in (("--seeds", args.seeds), ("--arms", args.arms)):
        if len(set(values)) != len(values):
            parser.error(f"{name} must not repeat a value")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"overrides must be key=value, got {bad}")
    owned = [o for o in args.overrides if o.split("=", 1)[0].strip().lstrip("+~") in ARM_KEYS]
    if owned:
        parser.error(f"{owned[0]!r} would change what an arm is ({', '.join(ARM_KEYS)} are the arms')")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    results_dir = args.results / args.experiment
    runs = [(seed, position, arm) for seed in args.seeds for position, arm in enumerate(run_order(args.arms, seed))]
    todo = [(s, p, a) for s, p, a in runs if not _results.finished(results_dir, a.name, s)]
    if args.dry_run:
        for seed, position, arm in runs:
            done = "" if (seed, position, arm) in todo else "  [recorded: skipped]"
            overrides = run_overrides(arm, seed, args.steps, args.test_freq, args.overrides)
            print(f"seed {seed} #{position} {arm.name}: {shlex.join(overrides)}{done}")
        print(f"{len(todo)} of {len(runs)} runs to go, {args.steps} steps each; results in {results_dir}")
        return 0
    _runs.install_stop_handlers()
    out = (args.out or _runs.timestamped_dir(_runs.DEFAULT_RUNS_ROOT, "experiment_lora")).resolve()
    timeout_s = args.timeout_s or _runs.default_timeout_s(args.steps)
    python = os.path.relpath(sys.executable, _runs.REPO_ROOT)
    invocation = shlex.join([python, *sys.argv]) if argv is None else shlex.join(["experiment_lora.py", *argv])
    commit = _results.git_commit()
    params = {"task": "default", "steps": args.steps, "test_freq": args.test_freq, "extra_overrides": args.overrides}
    failed: list[str] = []
    for seed, position, arm in todo:
        label = f"{arm.name}-seed{seed}"
        overrides = run_overrides(arm, seed, args.steps, args.test_freq, args.overrides)
        result = _runs.launch(label, overrides, out / label, timeout_s=timeout_s, echo=not args.quiet)
        record = _results.run_record(
            result,
            experiment=args.experiment,
            arm=arm.name,
            seed=seed,
            order=position,
            overrides=overrides,
            config=None,
            invocation=invocation,
            params=params | {"arm_description": arm.description},
            commit=commit,
        )
        record["lora"] = parameter_share(result.run_dir)
        _results.write_record(_results.record_path(results_dir, arm.name, seed), record)
        m = result.metrics
        logger.info(
            "%s: %s -> %s, %.0f s (load %.1f-%.1f)",
            label,
            _runs.fmt(m.initial_val_accuracy, ".1%"),
            _runs.fmt(m.final_val_accuracy, ".1%"),
            result.wall_s,
            *result.load_average,
        )
        if not result.ok:
            logger.error("%s", result.failure())
            failed.append(label)
        if result.returncode == EXIT_BAD_CONFIG:
            logger.error("the training CLI rejected the configuration (exit 2); not starting the other runs")
            return 2
    print(f"\nresult files in {results_dir}; run dirs in {out}; the tables: tests/bench/results_tables.py")
    if failed:
        print(f"failed runs: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
