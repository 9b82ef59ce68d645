"""Experiment (issues 5, 24, 31): learning at any staleness against synchronous controls that train the same
objective — held-out accuracy, time-to-accuracy, the trust region's bite and the trainer's idle share, per run.

    .venv/bin/python tests/bench/experiment_staleness.py --preset NAME [--seeds 0 1 2] [--dry-run]
    .venv/bin/python tests/bench/experiment_staleness.py --experiment NAME [--task default|agent|tool]
        [--regime trainer-bound|rollout-bound] [--etas 1 8] [--methods lag1 prev ...] [--sync-arms sync ...]
        [--seeds 0 1 2] [--steps N] [--test-freq N] [--threshold A] [--timeout-s S] [--quiet] [--dry-run]
        [-- key=value ...]
    .venv/bin/python tests/bench/experiment_staleness.py --list-presets

Arms. Synchronous arms (η=0, K=1: every batch from the current weights), one per objective (`SYNC_ARMS`):
- sync:          plain PPO, no correction: with one optimizer step per batch its ratio is 1 at the step, so its clip
                 never binds (the unclipped baseline of the earlier tables);
- sync-prev:     decoupled PPO whose proximal policy is the policy one step back, recomputed, for every token
                 (`control_prox: previous_step`): the same objective and trust region as the async arms lag1, prev,
                 lag-half and adaptive, applied at η=0, so the clip binds; their control;
- sync-prev-m2:  the same with AReaL's m2_threshold 0.04: the control of lag1-m2;
- sync-m2po:     M2PO's second moment taken against the policy one step back: the control of m2po.
Async arms `eta<η>-<method>` for each η in `--etas` and method in `--methods` (`METHODS`): lag1 (decoupled, proximal
one version back, interpolated), prev (recomputed under the previous version's weights), m2po (the paper's form),
lag1-m2 (AReaL's form), lag-half, naive, decoupled, and the adaptive bound starting at η (`adaptive` with lag1,
`adaptive-prev` with prev, `adaptive-nogate`, `adaptive-w0.3`: other `raise_when_waiting` gates). Each async arm names
its control (`Arm.control`); by default every control the chosen methods need runs, and `sync` always does.

Tasks (`TASKS`): default (config/tiny_cpu.yaml's 2-digit addition), agent (config/agent_cpu.yaml, the number-line
agent, multi-turn GiGPO), tool (config/tool_cpu.yaml, the calculator tool task); each with its steps, validation
interval and accuracy threshold. Regimes (`REGIMES`): trainer-bound (the configs as shipped: generation outruns the
trainer) and rollout-bound (`engines.forward_sleep_s` holds every forward pass of the embedded engines, so
generation takes most of the wall time without taking the trainer's CPU, as on a GPU cluster, and
`engines.max_running_requests` lets the engines take every rollout η admits: throughput grows with η).

Order and records. Per seed the arms run in a shuffled order (seeded by the experiment's name and the seed, so a
re-run has the same plan), printed and recorded in each run's result file. Each finished run writes
`tests/bench/results/<experiment>/<arm>-seed<k>.json` (`_results.py`: command, overrides, seed, order, commit,
load average, the summary), which `tests/bench/results_tables.py` turns into the READMEs' tables; a run whose
successful record exists is skipped, so an interrupted experiment resumes where it stopped, and `--seeds 3 4` adds
seeds to an experiment. Run dirs go to `--out` (default runs/bench/experiment_staleness/<timestamp>/).

An arm's identity cannot be overridden by accident: extra `key=value` overrides go to every run *before* the arm's
own, and one that names a key an arm or the regime sets (`ARM_KEYS`, the regime's keys) is refused before anything
runs (exit 2). A run the training CLI refuses (exit 2) stops the experiment; any other failure is recorded and the
others go on (exit 1 at the end).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import _results
import _runs

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


@dataclass(frozen=True)
class Task:
    """A task the grid runs on, with the figures its runs are read at, and its speed on 2 quiet cores (for the
    estimates: `run_estimate_s`)."""

    description: str
    config: str | None  # training YAML, relative to the repository root (None: the embedded default)
    steps: int  # optimizer steps per run
    test_freq: int  # steps between validations
    threshold: float  # held-out accuracy for time-to-accuracy
    startup_s: float  # command start to the first step, plus the validations (the task's cache built)
    step_s: float  # a fully-async step when generation outruns the trainer
    sync_step_s: float  # a synchronous step (the trainer waits for each batch)
    passes: float  # engine forward passes that finish one rollout (prefill + decodes; an episode's turns)


TASKS = {
    # 250 steps: 85-110 s of training async, 85-150 s sync, ~35 s of start-up (tests/bench/README.md, quiet runs)
    "default": Task("2-digit addition, config/tiny_cpu.yaml", None, 250, 25, 0.55, 45, 0.4, 0.5, 5.5),
    # the shipped 80 steps: 163 s of training, 28 s of warm-up (README "Measured results", load average 2.5-5.3)
    "agent": Task(
        "number-line agent (multi-turn GiGPO), config/agent_cpu.yaml",
        "config/agent_cpu.yaml",
        80,
        20,
        0.75,
        50,
        2.0,
        2.4,
        10.0,
    ),
    # the shipped 60 steps: 274 s of training at load average 8-11; ~2.5 s a step expected quiet
    "tool": Task(
        "calculator tool task (GiGPO), config/tool_cpu.yaml", "config/tool_cpu.yaml", 60, 20, 0.70, 50, 2.5, 3.0, 14.0
    ),
}


@dataclass(frozen=True)
class Regime:
    description: str
    overrides: tuple[str, ...]
    forward_sleep_s: float = 0.0  # engines.forward_sleep_s (for the estimates)


# The rollout-bound regime. Each engine forward pass sleeps 0.3 s, and rows are not capped below what η admits
# (2048 per engine, 8192 rollouts at once): a rollout takes ~5.5 passes, so (η + 1) x 512 rollouts in flight give a
# batch every ~5.5 x 0.3 / (η + 1) s: 0.8 s at η=1 against a ~0.3-0.4 s trainer step (the trainer waits most of its
# step), 0.55 s at η=2, 0.33 s at η=4, trainer-bound from η≈4-8; a synchronous step waits ~1.7 s for its batch.
ROLLOUT_BOUND_SLEEP_S = 0.3
REGIMES = {
    "trainer-bound": Regime("the configs as shipped: generation outruns the trainer", ()),
    "rollout-bound": Regime(
        f"every engine forward pass held {ROLLOUT_BOUND_SLEEP_S} s (engines.forward_sleep_s) and up to 2048 rows per "
        "engine: generation takes most of the wall time without taking the trainer's CPU, as on a GPU cluster",
        (
            f"engines.forward_sleep_s={ROLLOUT_BOUND_SLEEP_S}",
            "engines.max_running_requests=2048",
            "async_training.max_concurrent_rollouts=8192",
        ),
        ROLLOUT_BOUND_SLEEP_S,
    ),
}

NULL_CORRECTION = "algorithm.off_policy_correction=null"
PREV = "{mode: decoupled, prox_log_probs: previous"
LAG1 = "algorithm.off_policy_correction={mode: decoupled, prox_log_probs: loglinear, prox_lag: 1}"
PREVIOUS = f"algorithm.off_policy_correction={PREV}}}"
LAG1_M2 = (
    "algorithm.off_policy_correction={mode: decoupled, prox_log_probs: loglinear, prox_lag: 1, m2_threshold: 0.04}"
)
# Every arm states all of its identity, so a --config file cannot change one either (or is refused loudly: adaptive
# keys set in a file meet enable=false here and are refused by the training CLI, exit 2).
FIXED_ETA = "async_training.adaptive_staleness.enable=false"
SYNCHRONOUS = ("async_training.max_staleness=0", "async_training.trigger_parameter_sync_step=1", FIXED_ETA)

SYNC_ARMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "sync": ("plain PPO, no correction (its clip never binds)", (NULL_CORRECTION,)),
    "sync-prev": (
        "decoupled PPO, every token clipped against the policy one step back, recomputed (control_prox)",
        (f"algorithm.off_policy_correction={PREV}, control_prox: previous_step}}",),
    ),
    "sync-prev-m2": (
        "sync-prev with AReaL's m2_threshold 0.04",
        (f"algorithm.off_policy_correction={PREV}, m2_threshold: 0.04, control_prox: previous_step}}",),
    ),
    "sync-m2po": (
        "M2PO, its second moment against the policy one step back (control_prox)",
        ("algorithm.off_policy_correction={mode: m2po, control_prox: previous_step}",),
    ),
}


@dataclass(frozen=True)
class Method:
    description: str
    overrides: tuple[str, ...]  # may hold {half_eta}
    control: str  # the synchronous arm with the same objective and trust region
    adaptive: dict[str, float] | None = None  # adaptive_staleness keys beyond enable/min/max (None: fixed η)


METHODS: dict[str, Method] = {
    "lag1": Method(
        "decoupled PPO, proximal policy one version back (A-3PO log-linear), w capped at 2", (LAG1,), "sync-prev"
    ),
    "prev": Method(
        "decoupled PPO, proximal policy recomputed under the previous version's weights, w capped at 2",
        (PREVIOUS,),
        "sync-prev",
    ),
    "m2po": Method(
        "second-moment trust region (M2PO, tau 0.04)", ("algorithm.off_policy_correction={mode: m2po}",), "sync-m2po"
    ),
    "lag1-m2": Method(
        "lag1 with AReaL's M2PO mask on log pi_prox - log pi_behav (m2_threshold 0.04), the clip kept",
        (LAG1_M2,),
        "sync-prev-m2",
    ),
    "lag-half": Method(
        "decoupled PPO, proximal policy η/2 versions back (log-linear), w capped at 2",
        ("algorithm.off_policy_correction={{mode: decoupled, prox_log_probs: loglinear, prox_lag: {half_eta}}}",),
        "sync-prev",
    ),
    "naive": Method(
        "naive PPO (rollout log-probs as old, no correction)",
        ("async_training.use_rollout_log_probs=true", "async_training.compute_prox_log_prob=false", NULL_CORRECTION),
        "sync",
    ),
    "decoupled": Method(
        "decoupled PPO, proximal policy recomputed at the step, w capped at 2",
        ("algorithm.off_policy_correction={mode: decoupled, prox_log_probs: recompute}",),
        "sync",
    ),
    "adaptive": Method("lag1 with adaptive staleness starting at η (the rule's defaults)", (LAG1,), "sync-prev", {}),
    "adaptive-prev": Method(
        "prev with adaptive staleness starting at η (the rule's defaults)", (PREVIOUS,), "sync-prev", {}
    ),
    "adaptive-nogate": Method(
        "adaptive-prev raising η on the statistics alone (raise_when_waiting 0)",
        (PREVIOUS,),
        "sync-prev",
        {"raise_when_waiting": 0.0},
    ),
    "adaptive-w0.3": Method(
        "adaptive-prev raising η only while the trainer waits >= 30% of its step",
        (PREVIOUS,),
        "sync-prev",
        {"raise_when_waiting": 0.3},
    ),
}


@dataclass(frozen=True)
class Arm:
    name: str
    description: str
    overrides: tuple[str, ...]  # what makes the arm; applied after every other override
    control: str | None = None  # async arms: the synchronous arm with the same objective; None for sync arms
    eta: int = 0  # the staleness bound (adaptive: where it starts); 0 for sync arms


def sync_arm(name: str) -> Arm:
    description, overrides = SYNC_ARMS[name]
    return Arm(name, f"η=0, K=1, {description}", (*SYNCHRONOUS, *overrides))


def async_arm(eta: int, method_name: str) -> Arm:
    method = METHODS[method_name]
    overrides = [o.format(half_eta=max(1, eta // 2)) if "{half_eta}" in o else o for o in method.overrides]
    if method.adaptive is None:
        extra = [FIXED_ETA]
    else:
        extra = [
            "async_training.adaptive_staleness.enable=true",
            "async_training.adaptive_staleness.min=1",
            f"async_training.adaptive_staleness.max={max(16, eta)}",
            *(f"async_training.adaptive_staleness.{k}={v}" for k, v in method.adaptive.items()),
        ]
    return Arm(
        f"eta{eta}-{method_name}",
        f"η={eta}, {method.description}",
        (f"async_training.max_staleness={eta}", *overrides, *extra),
        control=method.control,
        eta=eta,
    )


def arms_for(etas: Sequence[int], methods: Sequence[str], sync_arms: Sequence[str] | None = None) -> list[Arm]:
    """The synchronous arms (`sync_arms`; None: `sync` and every control the methods need), then every (η, method)
    arm in grid order."""
    if sync_arms is None:
        sync_arms = ["sync", *dict.fromkeys(METHODS[m].control for m in methods if METHODS[m].control != "sync")]
    arms = [sync_arm(name) for name in sync_arms]
    return arms + [async_arm(eta, method) for eta in etas for method in methods]


def run_order(arms: Sequence[Arm], experiment: str, seed: int) -> list[Arm]:
    """The seed's arms in a shuffled order, the same for the same experiment name and seed (a re-run's plan)."""
    order = list(arms)
    random.Random(f"{experiment}:{seed}").shuffle(order)
    return order


@dataclass(frozen=True)
class Preset:
    """A named experiment of issue 31's plan (tests/bench/README.md lists them in priority order)."""

    description: str
    task: str
    regime: str
    etas: tuple[int, ...]
    methods: tuple[str, ...]
    sync_arms: tuple[str, ...] | None = None  # None: sync and the methods' controls


PRESETS: dict[str, Preset] = {
    "controls-default": Preset(
        "the fixed-η claims against their controls: lag1 and prev at η 1, 8, 16, beside sync and sync-prev",
        "default",
        "trainer-bound",
        (1, 8, 16),
        ("lag1", "prev"),
    ),
    "rollout-bound-grid": Preset(
        "the rollout-bound regime: prev at η 1, 2, 4, 8, 16 against adaptive-prev from η 1 and 16",
        "default",
        "rollout-bound",
        (1, 2, 4, 8, 16),
        ("prev",),
    ),
    "trainer-bound-grid": Preset(
        "the same grid in the default (trainer-bound) regime",
        "default",
        "trainer-bound",
        (1, 2, 4, 8, 16),
        ("prev",),
    ),
    "agent-eta4-16": Preset(
        "held-out task: the number-line agent, lag1/prev/m2po/lag1-m2 at η 4 and 16 against all four sync arms",
        "agent",
        "trainer-bound",
        (4, 16),
        ("lag1", "prev", "m2po", "lag1-m2"),
    ),
    "tool-eta4-16": Preset(
        "held-out task: the calculator tool task, as agent-eta4-16",
        "tool",
        "trainer-bound",
        (4, 16),
        ("lag1", "prev", "m2po", "lag1-m2"),
    ),
    "agent-eta8": Preset(
        "agent-eta4-16's methods at η 8", "agent", "trainer-bound", (8,), ("lag1", "prev", "m2po", "lag1-m2")
    ),
    "tool-eta8": Preset(
        "tool-eta4-16's methods at η 8", "tool", "trainer-bound", (8,), ("lag1", "prev", "m2po", "lag1-m2")
    ),
    "adaptive-agent": Preset(
        "adaptive staleness on a task it was not calibrated on: prev at η 1, 2, 4, 8, 16 against adaptive-prev",
        "agent",
        "trainer-bound",
        (1, 2, 4, 8, 16),
        ("prev",),
    ),
    "adaptive-tool": Preset(
        "adaptive-agent on the calculator tool task", "tool", "trainer-bound", (1, 2, 4, 8, 16), ("prev",)
    ),
    "adaptive-gates": Preset(
        "other gates of the adaptive rule from η 1 and 16, rollout-bound (their trainer-bound runs: --regime)",
        "default",
        "rollout-bound",
        (1, 16),
        ("adaptive-nogate", "adaptive-w0.3"),
        ("sync-prev",),
    ),
    "controls-default-m2": Preset(
        "the second-moment forms against their controls on the default task, η 4 and 8",
        "default",
        "trainer-bound",
        (4, 8),
        ("m2po", "lag1-m2"),
    ),
}
# The grids' adaptive arms start at both ends of η's range: the rule does not know the best η in advance.
ADAPTIVE_STARTS = {
    "rollout-bound-grid": (1, 16),
    "trainer-bound-grid": (1, 16),
    "adaptive-agent": (1, 16),
    "adaptive-tool": (1, 16),
}


def preset_arms(name: str) -> list[Arm]:
    preset = PRESETS[name]
    arms = arms_for(preset.etas, preset.methods, preset.sync_arms)
    return arms + [async_arm(eta, "adaptive-prev") for eta in ADAPTIVE_STARTS.get(name, ())]


def identity_conflicts(overrides: Sequence[str], keys: Sequence[str] = ARM_KEYS) -> list[str]:
    """The extra overrides that would change an arm's identity (their keys are `keys` or below one)."""
    conflicts = []
    for item in overrides:
        key = item.split("=", 1)[0].strip().lstrip("+~")
        if any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in keys):
            conflicts.append(item)
    return conflicts


def run_overrides(
    arm: Arm, seed: int, steps: int, test_freq: int, extra: Sequence[str], regime: Sequence[str] = ()
) -> list[str]:
    """One run's overrides, in order: the experiment's, the regime's, the user's extra ones, then the arm's (which
    win)."""
    common = [f"trainer.total_training_steps={steps}", f"trainer.test_freq={test_freq}", f"run.seed={seed}"]
    return [*common, f"data.seed={seed}", *regime, *extra, *arm.overrides]


def run_estimate_s(task: str, regime: str, eta: int, steps: int | None = None) -> float:
    """One run's whole-command seconds on 2 quiet cores: start-up plus steps x the longer of the trainer's step
    and a batch's generation. Generation is free in the trainer-bound regime; in the rollout-bound one a batch takes
    passes x sleep / (η + 1) (η + 1 batches in flight), and a synchronous step waits passes x sleep, then trains."""
    t, sleep = TASKS[task], REGIMES[regime].forward_sleep_s
    step = t.sync_step_s + t.passes * sleep if eta == 0 else max(t.step_s, t.passes * sleep / (eta + 1))
    return t.startup_s + (steps or t.steps) * step


def estimate_s(task: str, regime: str, arms: Sequence[Arm], seeds: int, steps: int | None = None) -> float:
    """The experiment's wall time on 2 quiet cores (`run_estimate_s` over every run)."""
    return seeds * sum(run_estimate_s(task, regime, arm.eta, steps) for arm in arms)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--preset", choices=list(PRESETS), help="a named experiment (sets the grid and --experiment)")
    parser.add_argument("--list-presets", action="store_true", help="print the presets and their estimates")
    parser.add_argument("--experiment", help="results folder name under tests/bench/results/ (default: the preset)")
    parser.add_argument("--task", choices=list(TASKS), default=None, help="default: the preset's, else default")
    parser.add_argument(
        "--regime", choices=list(REGIMES), default=None, help="default: the preset's, else trainer-bound"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="run.seed = data.seed values")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the task's)")
    parser.add_argument("--etas", type=int, nargs="+", default=None, help="η of the async arms (default: 1 4 8 16)")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=None, help="async arms per η")
    parser.add_argument("--sync-arms", nargs="+", choices=list(SYNC_ARMS), default=None, help="default: controls")
    parser.add_argument("--threshold", type=float, default=None, help="held-out accuracy for time-to-accuracy")
    parser.add_argument("--test-freq", type=int, default=None, help="steps between validations (default: the task's)")
    parser.add_argument("--results", type=Path, default=_results.RESULTS_ROOT, help="root of the result folders")
    parser.add_argument("--out", type=Path, default=None, help="folder for the run dirs")
    parser.add_argument("--timeout-s", type=float, default=None, help="per run (default: 300 + 10 x steps)")
    parser.add_argument("--quiet", action="store_true", help="do not echo the runs' output")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (every run, its order and overrides)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run (not the arms' own keys)")
    args = parser.parse_args(argv)
    preset = PRESETS.get(args.preset) if args.preset else None
    if preset is not None and (args.etas or args.methods or args.sync_arms):
        parser.error("--preset sets --etas, --methods and --sync-arms; give the grid one way")
    args.task = args.task or (preset.task if preset else "default")
    args.regime = args.regime or (preset.regime if preset else "trainer-bound")
    args.experiment = args.experiment or args.preset
    if args.experiment is None and not args.list_presets:
        parser.error("name the experiment (--experiment NAME, its results folder) or choose a --preset")
    task = TASKS[args.task]
    args.steps = args.steps or task.steps
    args.test_freq = args.test_freq or task.test_freq
    args.threshold = args.threshold if args.threshold is not None else task.threshold
    if preset is not None:
        args.arms = preset_arms(args.preset)
    else:
        args.arms = arms_for(args.etas or [1, 4, 8, 16], args.methods or ["lag1", "prev", "adaptive"], args.sync_arms)
    if args.steps < 1 or args.test_freq < 1:
        parser.error("--steps and --test-freq must be >= 1")
    if args.etas and any(eta < 1 for eta in args.etas):
        parser.error("--etas must be >= 1 (η=0 is a sync arm's)")
    for name, values in (("--seeds", args.seeds), ("--etas", args.etas), ("--methods", args.methods)):
        if values and len(set(values)) != len(values):
            parser.error(f"{name} must not repeat a value")
    if not 0 < args.threshold <= 1:
        parser.error("--threshold is a held-out accuracy in (0, 1]")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"overrides must be key=value, got {bad}")
    owned = ARM_KEYS + tuple(o.split("=", 1)[0] for o in REGIMES[args.regime].overrides)
    conflicts = identity_conflicts(args.overrides, owned)
    if conflicts:
        parser.error(
            f"{conflicts[0]!r} would change what an arm or the regime is (keys under {', '.join(owned)} are theirs); "
            "choose the grid with --preset, --etas, --methods, --sync-arms and --regime instead"
        )
    return args


def plan(args: argparse.Namespace) -> list[tuple[int, int, Arm]]:
    """(seed, position, arm) for every run, seed by seed, each seed's arms in its shuffled order."""
    return [
        (seed, position, arm)
        for seed in args.seeds
        for position, arm in enumerate(run_order(args.arms, args.experiment, seed))
    ]


def print_presets() -> None:
    for name, preset in PRESETS.items():
        arms = preset_arms(name)
        hours = estimate_s(preset.task, preset.regime, arms, 3) / 3600
        print(
            f"{name}: {preset.description} [{preset.task}, {preset.regime}; {3 * len(arms)} runs at 3 seeds, "
            f"~{hours:.1f} h on 2 quiet cores]"
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.list_presets:
        print_presets()
        return 0
    task, regime = TASKS[args.task], REGIMES[args.regime]
    results_dir = args.results / args.experiment
    runs = plan(args)
    todo = [(seed, position, arm) for seed, position, arm in runs if not _results.finished(results_dir, arm.name, seed)]
    estimate = sum(run_estimate_s(args.task, args.regime, arm.eta, args.steps) for _, _, arm in todo)
    if args.dry_run:
        for seed, position, arm in runs:
            overrides = run_overrides(arm, seed, args.steps, args.test_freq, args.overrides, regime.overrides)
            done = "" if (seed, position, arm) in todo else "  [recorded: skipped]"
            print(f"seed {seed} #{position} {arm.name}: {shlex.join(overrides)}{done}")
        print(
            f"{len(todo)} of {len(runs)} runs to go, {args.steps} steps each, task {args.task}, regime {args.regime}: "
            f"~{estimate / 60:.0f} min on 2 quiet cores; results in {results_dir}"
        )
        return 0
    _runs.install_stop_handlers()
    out = (args.out or _runs.timestamped_dir(_runs.DEFAULT_RUNS_ROOT, "experiment_staleness")).resolve()
    timeout_s = args.timeout_s or _runs.default_timeout_s(args.steps)
    python = os.path.relpath(sys.executable, _runs.REPO_ROOT)  # `.venv/bin/python` when run as documented
    invocation = shlex.join([python, *sys.argv]) if argv is None else shlex.join(["experiment_staleness.py", *argv])
    commit = _results.git_commit()
    params = {
        "task": args.task,
        "regime": args.regime,
        "steps": args.steps,
        "test_freq": args.test_freq,
        "threshold": args.threshold,
        "regime_overrides": list(regime.overrides),
        "extra_overrides": list(args.overrides),
    }
    logger.info("%d runs to go (~%.0f min quiet); results in %s", len(todo), estimate / 60, results_dir)
    failed: list[str] = []
    for seed, position, arm in todo:
        label = f"{arm.name}-seed{seed}"
        overrides = run_overrides(arm, seed, args.steps, args.test_freq, args.overrides, regime.overrides)
        config = str(_runs.REPO_ROOT / task.config) if task.config else None
        result = _runs.launch(label, overrides, out / label, timeout_s=timeout_s, config=config, echo=not args.quiet)
        record = _results.run_record(
            result,
            experiment=args.experiment,
            arm=arm.name,
            seed=seed,
            order=position,
            overrides=overrides,
            config=task.config,
            invocation=invocation,
            params=params | {"arm_description": arm.description, "control": arm.control},
            commit=commit,
            threshold=args.threshold,
        )
        _results.write_record(_results.record_path(results_dir, arm.name, seed), record)
        m = result.metrics
        logger.info(
            "%s: final %s, time to %.0f%% %s s, pg_clipfrac %s, idle %s (load %.1f-%.1f)",
            label,
            _runs.fmt(m.final_val_accuracy, ".1%"),
            100 * args.threshold,
            _runs.fmt(m.time_to_accuracy(args.threshold), ".0f", "never"),
            _runs.fmt(m.pg_clipfrac_mean, ".3f"),
            _runs.fmt(m.idle_frac_total, ".1%"),
            *result.load_average,
        )
        if not result.ok:
            logger.error("%s", result.failure())  # one failed run does not void the others
            failed.append(label)
        if result.returncode == EXIT_BAD_CONFIG:  # every later run would be refused the same way
            logger.error("the training CLI rejected the configuration (exit 2); not starting the other runs")
            return 2
    print(f"\nresult files in {results_dir}; run dirs in {out}; the tables: tests/bench/results_tables.py")
    if failed:
        print(f"failed runs: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
