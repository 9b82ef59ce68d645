"""Dynamic group filtering and over-sampling arithmetic, checked against hand-made groups and a loop reference."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from rllm.experimental.fully_async.algorithms.filters import (
    FilterConfig,
    FilterReason,
    build_group_filter,
    drop_by_length,
    drop_zero_variance,
    filter_groups,
    has_zero_reward_variance,
)
from rllm.experimental.fully_async.api.config import dataclass_from_config
from rllm.experimental.fully_async.api.trajectory import VersionedGroup, VersionedSequence, VersionedTrajectory


def make_group(
    prompt_uid: str,
    rewards: list[float],
    lengths: list[int] | list[list[int]] | None = None,
    finish: list[str] | None = None,
) -> VersionedGroup:
    """A group with one trajectory per reward; `lengths[i]` is an int (one sequence) or a list (one per step)."""
    trajectories = []
    for i, reward in enumerate(rewards):
        spec = 3 if lengths is None else lengths[i]
        step_lengths = [spec] if isinstance(spec, int) else spec
        sequences = [
            VersionedSequence(
                prompt_ids=[1, 2],
                response_ids=[5] * n,
                response_logprobs=[-0.5] * n,
                response_versions=[0] * n,
                finish_reason="stop" if finish is None else finish[i],
            )
            for n in step_lengths
        ]
        trajectories.append(
            VersionedTrajectory(uid=f"{prompt_uid}/{i}", prompt_uid=prompt_uid, sequences=sequences, reward=reward)
        )
    return VersionedGroup(prompt_uid=prompt_uid, trajectories=trajectories, metadata={"source": "test"})


def uids(groups) -> Counter[str]:
    return Counter(t.uid for g in groups for t in g.trajectories)


# --- reward variance ---------------------------------------------------------------------------------------------


def test_groups_with_equal_rewards_are_dropped_as_zero_variance():
    groups = [make_group("a", [1.0, 1.0, 1.0]), make_group("b", [0.0, 1.0]), make_group("c", [0.5, 0.5 + 1e-9])]
    result = drop_zero_variance(groups)
    assert [g.prompt_uid for g in result.kept] == ["b"]
    assert [(d.group.prompt_uid, d.reason) for d in result.dropped] == [
        ("a", FilterReason.ZERO_REWARD_VARIANCE),
        ("c", FilterReason.ZERO_REWARD_VARIANCE),
    ]
    assert result.keep_rate == pytest.approx(1 / 3)


def test_single_trajectory_group_has_zero_variance_and_small_spread_does_not():
    assert has_zero_reward_variance(make_group("a", [3.0]))
    assert not has_zero_reward_variance(make_group("a", [0.0, 1e-3]))
    assert has_zero_reward_variance(make_group("a", [0.0, 1e-3]), tol=1e-2)


# --- length ------------------------------------------------------------------------------------------------------


def test_trajectory_scope_drops_only_overlong_trajectories_and_keeps_group_identity():
    group = make_group("a", [0.0, 1.0, 0.0], lengths=[4, 9, 2])
    result = drop_by_length([group], max_response_length=8)
    assert len(result.kept) == 1
    kept = result.kept[0]
    assert [t.uid for t in kept.trajectories] == ["a/0", "a/2"]
    assert kept.prompt_uid == "a" and kept.metadata == {"source": "test"}
    (dropped,) = result.dropped
    assert dropped.reason is FilterReason.RESPONSE_OVER_MAX_LENGTH
    assert [t.uid for t in dropped.group.trajectories] == ["a/1"]


def test_group_scope_drops_the_whole_group():
    groups = [make_group("a", [0.0, 1.0], lengths=[4, 9]), make_group("b", [0.0, 1.0], lengths=[4, 8])]
    result = drop_by_length(groups, max_response_length=8, scope="group")
    assert [g.prompt_uid for g in result.kept] == ["b"]
    assert result.dropped[0].group is groups[0]
    assert result.dropped[0].num_trajectories == 2


def test_truncated_responses_are_dropped_only_when_configured():
    group = make_group("a", [0.0, 1.0, 1.0], lengths=[8, 5, 3], finish=["stop", "length", "stop"])
    assert drop_by_length([group], max_response_length=8).dropped == ()
    result = drop_by_length([group], max_response_length=8, drop_truncated=True)
    # a/0 hit the limit exactly, a/1 was cut by the engine: both truncated; a/2 survives.
    (dropped,) = result.dropped
    assert dropped.reason is FilterReason.RESPONSE_TRUNCATED
    assert [t.uid for t in dropped.group.trajectories] == ["a/0", "a/1"]
    assert [t.uid for t in result.kept[0].trajectories] == ["a/2"]


def test_every_step_of_a_multi_step_trajectory_is_checked():
    group = make_group("a", [0.0, 1.0], lengths=[[3, 3, 12], [3, 3]])
    result = drop_by_length([group], max_response_length=10)
    assert [t.uid for t in result.dropped[0].group.trajectories] == ["a/0"]


def test_over_length_wins_over_truncated_for_the_same_trajectory():
    group = make_group("a", [0.0, 1.0], lengths=[[12, 10], [2]], finish=["length", "stop"])
    result = drop_by_length([group], max_response_length=10, drop_truncated=True)
    assert result.dropped[0].reason is FilterReason.RESPONSE_OVER_MAX_LENGTH


# --- the pipeline ------------------------------------------------------------------------------------------------


def test_pipeline_drops_groups_left_too_small_and_records_each_stage():
    groups = [
        make_group("a", [0.0, 1.0], lengths=[20, 3]),  # loses a/0 to length, then too small
        make_group("b", [1.0, 1.0, 0.0], lengths=[3, 20, 3]),  # loses b/1, keeps variance
        make_group("c", [1.0, 1.0, 1.0]),  # zero variance
        make_group("d", [0.0, 2.0]),  # kept
    ]
    result = filter_groups(groups, FilterConfig(max_response_length=10))
    assert [g.prompt_uid for g in result.kept] == ["b", "d"]
    assert [t.uid for t in result.kept[0].trajectories] == ["b/0", "b/2"]
    assert [(d.group.prompt_uid, d.reason.value, d.num_trajectories) for d in result.dropped] == [
        ("a", "response_over_max_length", 1),
        ("b", "response_over_max_length", 1),
        ("a", "group_too_small", 1),
        ("c", "zero_reward_variance", 3),
    ]
    assert result.num_input_groups == 4 and result.num_input_trajectories == 10
    assert result.keep_rate == 0.5
    metrics = result.to_metrics()
    assert metrics["filter/dropped_trajectories/zero_reward_variance"] == 3.0
    assert metrics["filter/dropped_trajectories/response_over_max_length"] == 2.0
    assert metrics["filter/dropped_trajectories/response_truncated"] == 0.0
    assert metrics["filter/kept_trajectories"] == 4.0


def test_empty_input_is_kept_rate_one_and_no_drops():
    result = filter_groups([], FilterConfig(max_response_length=4, drop_truncated=True))
    assert result.kept == () and result.dropped == () and result.keep_rate == 1.0


def test_zero_variance_filter_can_be_switched_off():
    result = filter_groups([make_group("a", [1.0, 1.0])], FilterConfig(drop_zero_variance=False))
    assert len(result.kept) == 1


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"max_response_length": 0}, "max_response_length"),
        ({"length_scope": "batch"}, "length_scope"),
        ({"min_group_size": 0}, "min_group_size"),
        ({"reward_tol": -1.0}, "reward_tol"),
        ({"drop_truncated": True}, "drop_truncated"),
    ],
)
def test_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        FilterConfig(**kwargs)


def reference_fates(groups, config: FilterConfig) -> Counter[tuple[str, str]]:
    """Independent loop: the fate (reason or 'kept') of every trajectory uid."""
    fates: Counter[tuple[str, str]] = Counter()
    for group in groups:
        alive = []
        group_reason = None
        for t in group.trajectories:
            reason = None
            if config.max_response_length is not None:
                lengths = [len(s.response_ids) for s in t.sequences]
                if max(lengths) > config.max_response_length:
                    reason = "response_over_max_length"
                elif config.drop_truncated and any(
                    s.finish_reason == "length" or len(s.response_ids) == config.max_response_length
                    for s in t.sequences
                ):
                    reason = "response_truncated"
            if reason is not None and config.length_scope == "group" and group_reason is None:
                group_reason = reason
            if reason is None:
                alive.append(t)
            elif config.length_scope == "trajectory":
                fates[(t.uid, reason)] += 1
        if group_reason is not None:
            for t in group.trajectories:
                fates[(t.uid, group_reason)] += 1
            continue
        if len(alive) < config.min_group_size:
            final = "group_too_small"
        elif config.drop_zero_variance and (
            len(alive) < 2 or max(t.reward for t in alive) - min(t.reward for t in alive) <= config.reward_tol
        ):
            final = "zero_reward_variance"
        else:
            final = "kept"
        for t in alive:
            fates[(t.uid, final)] += 1
    return fates


group_spec = st.lists(
    st.tuples(
        st.sampled_from([0.0, 1.0, 0.5]),
        st.lists(st.integers(min_value=0, max_value=12), min_size=1, max_size=3),
        st.sampled_from(["stop", "length"]),
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(group_spec, max_size=6),
    max_len=st.one_of(st.none(), st.integers(min_value=1, max_value=12)),
    drop_truncated=st.booleans(),
    scope=st.sampled_from(["trajectory", "group"]),
    min_size=st.integers(min_value=1, max_value=3),
    drop_zero=st.booleans(),
)
def test_filter_accounting_adds_up_and_matches_a_loop_reference(
    specs, max_len, drop_truncated, scope, min_size, drop_zero
):
    groups = [
        make_group(f"p{i}", [r for r, _, _ in spec], lengths=[ls for _, ls, _ in spec], finish=[f for _, _, f in spec])
        for i, spec in enumerate(specs)
    ]
    config = FilterConfig(
        drop_zero_variance=drop_zero,
        max_response_length=max_len,
        drop_truncated=drop_truncated and max_len is not None,
        length_scope=scope,
        min_group_size=min_size,
    )
    result = filter_groups(groups, config)
    # Conservation: every trajectory is kept or dropped, exactly once.
    assert uids(result.kept) + uids(d.group for d in result.dropped) == uids(groups)
    assert result.num_kept_trajectories + sum(result.dropped_trajectories_by_reason().values()) == sum(
        len(g.trajectories) for g in groups
    )
    fates = Counter((t.uid, "kept") for g in result.kept for t in g.trajectories)
    fates += Counter((t.uid, d.reason.value) for d in result.dropped for t in d.group.trajectories)
    assert fates == reference_fates(groups, config)
    assert all(len(g.trajectories) >= min_size for g in result.kept)


def test_executor_filter_is_built_from_the_config_and_returns_ledger_reasons():
    def from_config(cfg):
        return build_group_filter(dataclass_from_config(cfg, "algorithm.group_filter", FilterConfig))

    assert from_config(OmegaConf.create({"algorithm": {"adv_estimator": "grpo"}})) is None
    group_filter = from_config(OmegaConf.create({"algorithm": {"group_filter": {"max_response_length": 8}}}))
    group = make_group("a", [0.0, 1.0, 1.0], lengths=[3, 9, 3])
    kept, dropped = group_filter([group, make_group("b", [1.0, 1.0])])
    assert [t.uid for t in kept[0].trajectories] == ["a/0", "a/2"] and kept[0] is not group
    assert [(g.prompt_uid, reason) for g, reason in dropped] == [
        ("a", "response_over_max_length"),
        ("b", "zero_reward_variance"),
    ]
    with pytest.raises(ValueError, match=r"unknown key algorithm\.group_filter\.max_len"):
        from_config(OmegaConf.create({"algorithm": {"group_filter": {"max_len": 8}}}))
