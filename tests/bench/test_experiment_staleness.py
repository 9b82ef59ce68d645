"""The staleness experiment's plans (tests/bench/experiment_staleness.py), checked without running them: every async
arm has a synchronous control with its objective (and the control's keys load as a synchronous run whose clip can
bind), an arm's identity cannot be overridden by accident, arms run in a recorded shuffled order per seed, a
recorded run is not run again, and the figures it reports come out of metrics.jsonl records as defined. No training
runs here: the script's runs are benchmarks (tests/bench/README.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _metrics
import experiment_staleness as exp


def _correction(arm: exp.Arm):
    item = next(o for o in arm.overrides if o.startswith("algorithm.off_policy_correction="))
    return OmegaConf.from_dotlist([item]).algorithm.off_policy_correction


@pytest.mark.parametrize(
    "override",
    [
        "async_training.max_staleness=8",  # turned the sync arm into η=8 before (issue 24)
        "async_training.trigger_parameter_sync_step=4",
        "async_training.adaptive_staleness.max=4",
        "algorithm.off_policy_correction.cap=3",
        "algorithm.off_policy_correction={mode: tis}",
        "algorithm=null",  # a section above an arm key
        "+async_training.staleness_threshold=0.5",
    ],
)
def test_an_override_of_an_arms_own_key_is_refused_before_anything_runs(override, capsys):
    with pytest.raises(SystemExit) as info:
        exp.parse_args(["--experiment", "x", "--dry-run", "--", override])
    assert info.value.code == 2
    assert "would change what an arm or the regime is" in capsys.readouterr().err


def test_the_rollout_bound_regimes_own_keys_are_refused_too_and_free_elsewhere(capsys):
    with pytest.raises(SystemExit):
        exp.parse_args(["--preset", "rollout-bound-grid", "--", "engines.forward_sleep_s=0"])
    assert "engines.forward_sleep_s" in capsys.readouterr().err
    assert exp.parse_args(["--experiment", "x", "--", "engines.forward_sleep_s=0.1"]).regime == "trainer-bound"


def test_other_overrides_reach_every_run_before_the_regimes_and_the_arms_own_keys():
    args = exp.parse_args(["--experiment", "x", "--seeds", "0", "--etas", "8", "--", "engines.num_engines=1"])
    names = [a.name for a in args.arms]
    assert names == ["sync", "sync-prev", "eta8-lag1", "eta8-prev", "eta8-adaptive"]
    sync = exp.run_overrides(args.arms[0], 0, 250, 25, args.overrides, ("engines.forward_sleep_s=0.3",))
    assert sync[-4:] == [*exp.SYNCHRONOUS, exp.NULL_CORRECTION]
    assert (
        sync.index("engines.forward_sleep_s=0.3") < sync.index("engines.num_engines=1") < sync.index(exp.SYNCHRONOUS[0])
    )
    adaptive = exp.run_overrides(args.arms[4], 1, 250, 25, args.overrides)
    assert adaptive[-3:] == [
        "async_training.adaptive_staleness.enable=true",
        "async_training.adaptive_staleness.min=1",
        "async_training.adaptive_staleness.max=16",
    ]
    assert "async_training.max_staleness=8" in adaptive and "run.seed=1" in adaptive


@pytest.mark.parametrize("method", sorted(exp.METHODS))
def test_every_async_method_has_a_synchronous_control_with_its_trust_region(method):
    """The control of a decoupled method is decoupled PPO with the same cap and m2_threshold, its proximal policy
    the policy one step back for every token (control_prox); m2po's is m2po against it; the controls are
    synchronous (η=0, K=1, η fixed)."""
    arm = exp.async_arm(8, method)
    control = exp.sync_arm(arm.control)
    assert set(exp.SYNCHRONOUS) <= set(control.overrides)
    if arm.control == "sync":  # naive and decoupled: no trust region of their own to carry to η=0
        assert exp.NULL_CORRECTION in control.overrides
        return
    mine, theirs = _correction(arm), _correction(control)
    assert theirs.control_prox == "previous_step"
    assert mine.mode == theirs.mode
    for key in ("cap", "cap_mode", "level", "m2_threshold", "tau"):
        assert mine.get(key) == theirs.get(key), key


def test_the_controls_load_as_synchronous_runs_and_a_control_outside_one_is_refused():
    """Each control's overrides pass the training CLI's checks (no other exit-2 surprise mid-experiment)."""
    from rllm.experimental.fully_async.settings.loader import ConfigError, load_config

    for name in exp.SYNC_ARMS:
        cfg = load_config(None, list(exp.sync_arm(name).overrides))
        assert cfg.async_training.max_staleness == 0 and cfg.async_training.trigger_parameter_sync_step == 1
    control = next(o for o in exp.sync_arm("sync-prev").overrides if "control_prox" in o)
    with pytest.raises(ConfigError, match="control_prox"):
        load_config(None, ["async_training.max_staleness=1", control])


def test_each_seed_runs_every_arm_once_in_a_shuffled_order_that_a_rerun_repeats():
    args = exp.parse_args(["--preset", "controls-default", "--seeds", "0", "1", "2"])
    plan = exp.plan(args)
    orders = {seed: [arm.name for s, _, arm in plan if s == seed] for seed in (0, 1, 2)}
    assert all(sorted(order) == sorted(a.name for a in args.arms) for order in orders.values())
    assert len({tuple(order) for order in orders.values()}) > 1, "the seeds' orders differ"
    assert any(order[0] != "sync" for order in orders.values()), "sync is not always first"
    assert exp.plan(exp.parse_args(["--preset", "controls-default", "--seeds", "0", "1", "2"])) == plan
    assert [p for _, p, _ in plan[: len(args.arms)]] == list(range(len(args.arms)))


@pytest.mark.parametrize("name", sorted(exp.PRESETS))
def test_every_preset_plans_its_controls_and_an_estimate(name, capsys):
    args = exp.parse_args(["--preset", name, "--dry-run"])
    names = {a.name for a in args.arms}
    for arm in args.arms:
        assert arm.control is None or arm.control in names, (arm.name, arm.control)
    assert exp.estimate_s(args.task, args.regime, args.arms, 3) > 0
    exp.main(["--preset", name, "--dry-run", "--results", "/nonexistent"])
    assert f"{len(args.arms) * 3} of {len(args.arms) * 3} runs to go" in capsys.readouterr().out


def test_the_issue_grids_are_planned():
    """Issue 31's plan: the rollout-bound η grid against adaptive from both ends of η's range, the held-out tasks'
    methods at η 4, 8 and 16 against all four sync arms."""
    grid = {a.name for a in exp.preset_arms("rollout-bound-grid")}
    assert {f"eta{e}-prev" for e in (1, 2, 4, 8, 16)} | {"eta1-adaptive-prev", "eta16-adaptive-prev"} <= grid
    assert exp.PRESETS["rollout-bound-grid"].regime == "rollout-bound"
    for task in ("agent", "tool"):
        arms = {a.name for a in exp.preset_arms(f"{task}-eta4-16")} | {a.name for a in exp.preset_arms(f"{task}-eta8")}
        expected = {f"eta{e}-{m}" for e in (4, 8, 16) for m in ("lag1", "prev", "m2po", "lag1-m2")}
        assert expected | set(exp.SYNC_ARMS) <= arms


def test_the_rollout_bound_regime_is_estimated_generation_bound_at_low_eta_only():
    sync, one, sixteen = (exp.run_estimate_s("default", "rollout-bound", eta) for eta in (0, 1, 16))
    trainer_bound = exp.run_estimate_s("default", "trainer-bound", 1)
    assert sync > one > sixteen >= trainer_bound


def test_a_recorded_run_is_skipped_and_a_failed_one_runs_again(tmp_path, capsys):
    folder = tmp_path / "x"
    folder.mkdir()
    (folder / "sync-seed0.json").write_text(json.dumps({"ok": True}))
    (folder / "sync-prev-seed0.json").write_text(json.dumps({"ok": False}))
    exp.main(["--experiment", "x", "--results", str(tmp_path), "--seeds", "0", "--etas", "1", "--dry-run"])
    out = capsys.readouterr().out
    assert "sync: " in out and "#" in out
    skipped = [line for line in out.splitlines() if "[recorded: skipped]" in line]
    assert len(skipped) == 1 and " sync: " in skipped[0]
    assert "4 of 5 runs to go" in out


def _records() -> list[dict]:
    t0 = 1000.0
    rows: list[dict] = [{"step": 0, "time": t0 - 5, "val/accuracy": 0.44}]
    for step in range(1, 5):
        rows.append(
            {
                "step": step,
                "time": t0 + 2.0 * step,
                "trainer/step": step,
                "timing/step_s": 1.0,
                "timing/wait_batch_s": 0.5,
                "timing/take_overhead_s": 0.1,
                "batch/tokens": 100.0,
                "rollout/tokens_generated": 120.0 * step,
                "staleness/eta": 4.0 if step < 3 else 2.0,
                "actor/pg_clipfrac": 0.01 * step,
                "rollout_corr/chi2_token": 0.25,
                "rollout_corr/k3_kl": 0.01,
            }
        )
    rows.append({"step": 2, "time": t0 + 6.5, "val/step": 2, "val/accuracy": 0.50})
    rows.append({"step": 4, "time": t0 + 12, "val/accuracy": 0.58, "ledger/trained": 10})
    return rows


def test_time_to_accuracy_and_generated_per_trained_token_from_the_records():
    m = _metrics.summarize_metrics(_records())
    # training starts when step 1 began waiting (its log time minus its step time): t0 + 1
    assert m.val_curve == ((0, 0.0, 0.44), (2, 3.0, 0.50), (4, 7.0, 0.58))
    assert m.time_to_accuracy(0.5) == 3.0 and m.time_to_accuracy(0.55) == 7.0 and m.time_to_accuracy(0.6) is None
    assert m.time_to_accuracy(0.4) == 3.0  # the starting accuracy (step 0) never counts
    assert m.generated_per_trained_token == pytest.approx(480 / 400) and m.eta_final == 2.0


def test_the_trust_regions_bite_the_trainers_wait_and_the_eta_path_from_the_records():
    m = _metrics.summarize_metrics(_records())
    assert m.pg_clipfrac_mean == pytest.approx(0.025) and m.pg_clipfrac_early == pytest.approx(0.025)
    assert m.idle_frac_total == pytest.approx(0.5) and m.wait_share == pytest.approx(0.4)
    assert m.eta_trajectory == ((1, 4.0), (3, 2.0)) and m.eta_mean == pytest.approx(3.0)
    assert m.signals["ess"]["p50"] == pytest.approx(0.8) and m.signals["wait"]["p90"] == pytest.approx(0.4)
    assert m.first_step_started_at == 1001.0


@pytest.mark.slow  # ~33 configurations loaded and checked (~1 min on a busy 2-core machine)
def test_every_presets_runs_load_as_the_training_cli_would_check_them():
    """No preset meets an exit-2 refusal mid-experiment: each (task, regime, method) of every preset, at its largest
    η, passes the training CLI's loading and checks with the regime's and the arm's overrides."""
    import re

    from rllm.experimental.fully_async.settings.loader import load_config

    seen: dict[tuple[str, str, str], exp.Arm] = {}
    for name, preset in exp.PRESETS.items():
        for arm in sorted(exp.preset_arms(name), key=lambda a: -a.eta):
            seen.setdefault((preset.task, preset.regime, re.sub(r"^eta\d+-", "", arm.name)), arm)
    for (task, regime, _), arm in sorted(seen.items()):
        config = exp.TASKS[task].config
        overrides = exp.run_overrides(arm, 0, 10, 5, [], exp.REGIMES[regime].overrides)
        cfg = load_config(str(exp._runs.REPO_ROOT / config) if config else None, overrides, check_host=False)
        assert cfg.async_training.max_staleness == arm.eta, (task, regime, arm.name)
