"""The staleness experiment's plan (tests/bench/experiment_staleness.py): an arm's identity cannot be overridden by
accident, and the figures it reports (time-to-accuracy, generated per trained token) come out of metrics.jsonl
records as defined. No training runs here: the script's runs are benchmarks (tests/bench/README.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _metrics
import experiment_staleness as exp


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
        exp.parse_args(["--dry-run", "--", override])
    assert info.value.code == 2
    assert "would change what an arm is" in capsys.readouterr().err


def test_other_overrides_reach_every_run_before_the_arms_own_keys():
    args = exp.parse_args(["--seeds", "0", "--etas", "8", "--", "trainer.test_freq=5", "engines.num_engines=1"])
    arms = exp.arms_for(args.etas, args.methods)
    assert [a.name for a in arms] == ["sync", "eta8-lag1", "eta8-m2po", "eta8-adaptive"]
    sync = exp.run_overrides(arms[0], 0, 250, 25, args.overrides)
    assert sync[-4:] == list(exp.SYNC) and sync.index("engines.num_engines=1") < sync.index(exp.SYNC[0])
    adaptive = exp.run_overrides(arms[3], 1, 250, 25, args.overrides)
    assert adaptive[-3:] == [
        "async_training.adaptive_staleness.enable=true",
        "async_training.adaptive_staleness.min=1",
        "async_training.adaptive_staleness.max=16",
    ]
    assert "async_training.max_staleness=8" in adaptive and "run.seed=1" in adaptive


def test_the_lag_half_arm_puts_its_proximal_policy_half_its_eta_back():
    corrections = [
        OmegaConf.from_dotlist([next(o for o in arm.overrides if o.startswith("algorithm.off_policy_correction="))])
        for arm in exp.arms_for([1, 8, 16], ["lag-half"])[1:]
    ]
    assert [c.algorithm.off_policy_correction.prox_lag for c in corrections] == [1, 4, 8]
    assert {c.algorithm.off_policy_correction.mode for c in corrections} == {"decoupled"}


def test_the_default_grid_is_four_etas_by_three_methods_beside_sync_per_seed():
    args = exp.parse_args([])
    assert len(exp.arms_for(args.etas, args.methods)) == 1 + 4 * 3 and args.steps == 250 and args.seeds == [0, 1, 2]


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
                "batch/tokens": 100.0,
                "rollout/tokens_generated": 120.0 * step,
                "staleness/eta": 4.0,
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
    assert m.generated_per_trained_token == pytest.approx(480 / 400) and m.eta_final == 4.0
