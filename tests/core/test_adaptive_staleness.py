"""Adaptive staleness: the pure rule (core/adaptive_staleness.py), the statistics the trainer feeds it, its config,
and the rollout service's budget following the η a request carries."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rllm.experimental.fully_async.api.step_messages import Ack, BatchRequest
from rllm.experimental.fully_async.core.adaptive_staleness import (
    AdaptiveStalenessRule,
    OffPolicySignals,
    StalenessController,
)
from rllm.experimental.fully_async.run_spec import build_run_spec
from rllm.experimental.fully_async.runtime.trainer.fully_async_trainer import offpolicy_signals
from rllm.experimental.fully_async.settings.loader import ConfigError, load_config

RULE = AdaptiveStalenessRule(min=1, max=5, raise_after=2, raise_margin=0.5, min_ess=0.8, max_kl=0.02, max_cut=0.02)
INSIDE = OffPolicySignals(ess=0.95, kl=0.005, cut=0.01)  # clear: within half of every limit
BAND = OffPolicySignals(ess=0.85, kl=0.015, cut=0.01)  # inside the limits, not within half of them


def test_eta_drops_at_once_when_a_statistic_leaves_its_threshold_and_rises_after_clean_windows():
    controller = StalenessController(RULE, eta=3)
    controller.observe(INSIDE)
    assert controller.decide().after == 3  # one clean window: not yet
    controller.observe(INSIDE)
    decision = controller.decide()
    assert (decision.before, decision.after, decision.outside) == (3, 4, ())
    controller.observe(INSIDE)
    controller.observe(OffPolicySignals(ess=0.5, kl=0.005, cut=0.01))  # the window's mean ess 0.725 < 0.8
    decision = controller.decide()
    assert (decision.after, decision.outside) == (3, ("ess",))
    assert decision.signals.ess == pytest.approx(0.725)
    assert "η 4 -> 3" in decision.describe() and "outside: ess" in decision.describe()
    controller.observe(OffPolicySignals(kl=0.03))  # each statistic alone can lower it
    assert controller.decide().outside == ("kl",)
    controller.observe(OffPolicySignals(cut=0.05))
    assert controller.decide().after == 1


def test_in_the_dead_band_eta_holds_and_the_count_of_clear_windows_restarts():
    controller = StalenessController(RULE, eta=2)
    controller.observe(INSIDE)
    controller.decide()
    controller.observe(BAND)
    decision = controller.decide()
    assert (decision.after, decision.outside) == (2, ())
    controller.observe(INSIDE)
    assert controller.decide().after == 2  # one clear window since the band: not yet
    controller.observe(INSIDE)
    assert controller.decide().after == 3


def test_a_window_with_nothing_measured_holds_eta_and_breaks_no_streak():
    controller = StalenessController(RULE, eta=2)
    controller.observe(INSIDE)
    controller.decide()
    assert controller.decide().after == 2  # an empty window: hold
    controller.observe(INSIDE)
    assert controller.decide().after == 3  # the streak of clean windows went on


@settings(max_examples=80, deadline=None)
@given(
    start=st.integers(1, 5),
    windows=st.lists(
        st.lists(
            st.builds(
                OffPolicySignals,
                ess=st.none() | st.floats(0, 1),
                kl=st.none() | st.floats(0, 0.1),
                cut=st.none() | st.floats(0, 0.1),
            ),
            max_size=3,
        ),
        max_size=40,
    ),
)
def test_eta_stays_within_min_max_and_moves_one_step_per_decision(start, windows):
    controller = StalenessController(RULE, eta=start)
    for window in windows:
        for signals in window:
            controller.observe(signals)
        decision = controller.decide()
        assert RULE.min <= decision.after <= RULE.max
        assert abs(decision.after - decision.before) <= RULE.step
        if decision.outside:
            assert decision.after == max(RULE.min, decision.before - RULE.step)


def test_state_round_trips_and_a_checkpointed_eta_outside_the_rule_is_refused():
    controller = StalenessController(RULE, eta=2)
    controller.observe(INSIDE)
    controller.decide()
    restored = StalenessController(RULE, eta=1)
    restored.load_state_dict(controller.state_dict())
    restored.observe(INSIDE)
    assert restored.decide().after == 3  # η and the streak came back
    with pytest.raises(ValueError, match="outside adaptive_staleness"):
        restored.load_state_dict({"eta": 9, "clear_streak": 0})
    with pytest.raises(ValueError, match=r"within adaptive_staleness \[min, max\]"):
        StalenessController(RULE, eta=0)
    with pytest.raises(ValueError, match="min <= max"):
        AdaptiveStalenessRule(min=4, max=2)


def test_the_trainers_statistics_come_from_verls_update_metrics_in_any_correction_mode():
    ppo = offpolicy_signals({"rollout_corr/chi2_token": 0.25, "rollout_corr/k3_kl": 0.01, "actor/pg_clipfrac": 0.03})
    assert ppo == OffPolicySignals(ess=pytest.approx(0.8), kl=0.01, cut=0.03)
    m2po = offpolicy_signals({"rollout_corr/chi2_token": 0.0, "off_policy/masked_token_fraction": 0.1})
    assert m2po == OffPolicySignals(ess=1.0, kl=None, cut=0.1)
    areal_m2po = offpolicy_signals({"actor/pg_clipfrac": 0.02, "off_policy/m2_masked_token_fraction": 0.07})
    assert areal_m2po == OffPolicySignals(cut=0.07)  # the larger of the clipped and the masked fraction
    assert offpolicy_signals({}) == OffPolicySignals()


def test_config_builds_the_rule_refuses_its_keys_without_enable_and_sizes_the_queue_for_its_max():
    cfg = load_config(
        None, ["async_training.adaptive_staleness.enable=true", "async_training.adaptive_staleness.max=6"]
    )
    spec = build_run_spec(cfg)
    assert spec.schedule.adaptive == AdaptiveStalenessRule(max=6) and spec.schedule.max_staleness == 1
    assert cfg.async_training.queue_max_groups == (6 + 2) * cfg.async_training.required_samples
    with pytest.raises(ConfigError, match=r"'async_training.adaptive_staleness.max_kl' is read only with") as info:
        load_config(None, ["async_training.adaptive_staleness.max_kl=0.1"])
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"max_staleness \(8\) is where adaptive staleness starts"):
        load_config(
            None,
            [
                "async_training.adaptive_staleness.enable=true",
                "async_training.max_staleness=8",
                "async_training.adaptive_staleness.max=4",
            ],
        )


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("min", "0"),
        ("max", "9"),
        ("step", "2"),
        ("raise_after", "3"),
        ("min_ess", "0.5"),
        ("max_kl", "0.1"),
        ("max_cut", "0.1"),
        ("raise_when_waiting", "0.3"),
    ],
)
def test_every_rule_key_changes_the_run_spec_when_enabled(key, value):
    on = ["async_training.adaptive_staleness.enable=true"]
    baseline = build_run_spec(load_config(None, on))
    changed = build_run_spec(load_config(None, [*on, f"async_training.adaptive_staleness.{key}={value}"]))
    assert changed.schedule.adaptive != baseline.schedule.adaptive


def test_the_rollout_service_budget_follows_the_eta_a_request_carries_and_admitted_groups_keep_theirs():
    from rollout_helpers import WAIT_S, make_service, run

    async def scenario():
        service, workflow = make_service(40, max_staleness=0, groups_per_version=2, max_concurrent=100)
        rollouts = asyncio.create_task(service.run())
        # η = 0 at version 0: (0 + 0 + 1) x 2 groups may start, then the budget is spent.
        assert await service.queue.wait_for(lambda: len(service.queue) == 2, WAIT_S)
        await asyncio.sleep(0.2)
        started_at_eta0 = service.executor.stats.groups_started
        # The trainer raised η to 2 at its sync: the request brings it, and (2 + 0 + 1) x 2 may start.
        batch = await service.take_batch(BatchRequest(2, 0, Ack(), timeout_s=WAIT_S, max_staleness=2))
        ack = Ack.of(batch.groups)
        assert await service.queue.wait_for(lambda: len(service.queue) == 4, WAIT_S)
        await asyncio.sleep(0.2)
        started_at_eta2 = service.executor.stats.groups_started
        # η back to 0 at version 2: the queued groups (version 0) were admitted under η = 2, so they are trained,
        # not dropped, and the budget, (0 + 2 + 1) x 2 = 6, lets nothing new start.
        workflow.engine_version = 2
        kept = await service.take_batch(BatchRequest(2, 2, ack, timeout_s=WAIT_S, max_staleness=0))
        await asyncio.sleep(0.2)
        started_at_version2 = service.executor.stats.groups_started
        # Version 3: the two version-0 groups left are staler than their η = 2 and dropped inside; groups started
        # at version 3 under η = 0 fill the batch.
        workflow.engine_version = 3
        refilled = await service.take_batch(BatchRequest(2, 3, Ack.of(kept.groups), timeout_s=WAIT_S, max_staleness=0))
        service.stop()
        await rollouts
        return started_at_eta0, started_at_eta2, started_at_version2, kept, refilled, service

    started_at_eta0, started_at_eta2, started_at_version2, kept, refilled, service = run(scenario())
    assert started_at_eta0 == 2 and started_at_eta2 == 6 and started_at_version2 == 6
    assert kept.stale_groups == 0 and [g.min_version for g in kept.groups] == [0, 0]
    assert refilled.stale_groups == 2 and [g.min_version for g in refilled.groups] == [3, 3]
    assert service.executor.staleness.eta == 0 and service.metrics()["rollout/max_staleness"] == 0


def _simulated(
    kl_per_version: float,
    raise_margin: float = 0.5,
    eta: int = 2,
    steps: int = 60,
    engines: int = 2,
    raise_when_waiting: float = 0.0,
):
    from rllm.experimental.fully_async.simulate.engine import simulate
    from rllm.experimental.fully_async.simulate.model import SimConfig

    cfg = SimConfig(steps=steps)
    cfg.pipeline.max_staleness, cfg.pipeline.num_engines = eta, engines
    cfg.adaptive.enable, cfg.adaptive.kl_per_version, cfg.adaptive.raise_margin = True, kl_per_version, raise_margin
    cfg.adaptive.cut_per_version, cfg.adaptive.raise_when_waiting = 0.0, raise_when_waiting
    return simulate(cfg)


def test_the_simulator_drives_the_same_rule_up_when_data_stays_on_policy_and_down_when_it_does_not():
    calm = _simulated(kl_per_version=0.0005)  # kl 0.002 at staleness 4: clear at any η the run reaches
    assert calm.final_eta > 2 and all(after == before + 1 for _, before, after in calm.eta_changes)
    assert calm.mean_staleness > 2  # the budget followed: groups are trained staler than the starting η allows
    rough = _simulated(kl_per_version=0.05, eta=4)  # kl 0.05 per version of staleness: outside at any η >= 1
    assert rough.final_eta == 1 and max(rough.staleness) <= 4


def test_eta_rises_only_while_the_trainer_waits_and_settles_at_the_smallest_eta_that_feeds_it():
    # One engine: at η = 1 the trainer waits for 13% of the run, at η = 2 for 2% (and no less at any higher η).
    rule = AdaptiveStalenessRule()
    fed = _simulated(kl_per_version=0.0005, eta=1, engines=1, raise_when_waiting=rule.raise_when_waiting)
    on_statistics_alone = _simulated(kl_per_version=0.0005, eta=1, engines=1, raise_when_waiting=0.0)
    assert fed.final_eta == 2 and on_statistics_alone.final_eta > 4
    assert fed.mean_staleness < on_statistics_alone.mean_staleness
    assert fed.wall_s <= 1.02 * on_statistics_alone.wall_s  # the staleness it did not take bought no time
    alone = StalenessController(AdaptiveStalenessRule(max=5, raise_after=1, raise_when_waiting=0), eta=2)
    waits = StalenessController(AdaptiveStalenessRule(max=5, raise_after=1), eta=2)
    for controller in (alone, waits):
        controller.observe(INSIDE, trainer_wait=0.02)
        controller.observe(INSIDE, trainer_wait=0.04)
    decision = waits.decide()
    assert decision.after == 2 and decision.trainer_wait == pytest.approx(0.03)
    assert "trainer waited 3%" in decision.describe()
    assert alone.decide().after == 3
    waits.observe(INSIDE, trainer_wait=0.3)
    assert waits.decide().after == 3


def test_the_dead_band_keeps_eta_steady_where_a_rule_without_it_swings_and_lowering_drops_nothing_admitted():
    banded = _simulated(kl_per_version=0.004)
    swinging = _simulated(kl_per_version=0.004, raise_margin=1.0)
    assert len(banded.eta_changes) <= 3 and len(swinging.eta_changes) > 10
    # Without the band η climbs past where the statistics leave their limits; the groups admitted up there are
    # trained, not dropped, so the statistics stay outside while they arrive and η falls all the way to the floor.
    etas = [after for _, _, after in swinging.eta_changes]
    assert min(etas) == 1 and max(etas) >= 8 and max(swinging.staleness) > max(banded.staleness) + 3
    # only what slipped past the soft budget is dropped (docs/design.md#rule-hard-staleness-bound)
    for result in (banded, swinging):
        assert result.dropped_stale_groups < 0.01 * sum(result.staleness.values())
