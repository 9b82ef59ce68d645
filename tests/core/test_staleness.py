"""Staleness policy: the capacity rule under random schedules, the training-time check, and rLLM's key mapping."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rllm.experimental.fully_async.api.trajectory import VersionedGroup, VersionedSequence, VersionedTrajectory
from rllm.experimental.fully_async.core.staleness import StalenessBounds, StalenessManager, is_too_stale
from rllm.experimental.fully_async.core.versions import groups_ahead_budget, groups_per_version, is_sync_step
from rllm.experimental.fully_async.settings.compat import max_staleness_from_rllm


class FakeVersion:
    """The ten-line fake the Protocol is for: a version the test moves by hand."""

    def __init__(self) -> None:
        self.version = 0

    def get_version(self) -> int:
        return self.version


def group(prompt_uid: str, versions: list[int]) -> VersionedGroup:
    seq = VersionedSequence(
        prompt_ids=[1],
        response_ids=list(range(len(versions))),
        response_logprobs=[0.0] * len(versions),
        response_versions=versions,
    )
    return VersionedGroup(
        prompt_uid, [VersionedTrajectory(uid=f"{prompt_uid}/0", prompt_uid=prompt_uid, sequences=[seq])]
    )


# --- the capacity rule ------------------------------------------------------------------------------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(["start", "finish_ok", "finish_rejected", "consume", "discard", "bump"]),
        st.integers(min_value=1, max_value=5),
    ),
    max_size=200,
)


@settings(max_examples=150, deadline=None)
@given(
    groups_per_version=st.integers(1, 6),
    max_staleness=st.integers(0, 3),
    max_concurrent=st.one_of(st.none(), st.integers(1, 10)),
    ops=OPS,
)
def test_random_schedules_never_exceed_the_budget_or_go_negative(
    groups_per_version, max_staleness, max_concurrent, ops
):
    version = FakeVersion()
    manager = StalenessManager(groups_per_version, max_staleness, max_concurrent, version_provider=version)
    for op, n in ops:
        before = manager.counts()
        try:
            if op == "start":
                n = min(n, manager.capacity())  # the executor's loop: start only what capacity allows
                if n <= 0:
                    continue
                manager.on_start(n)
            elif op == "finish_ok":
                manager.on_finish(True, n)
            elif op == "finish_rejected":
                manager.on_finish(False, n)
            elif op == "consume":
                manager.on_consumed(n)
            elif op == "discard":
                manager.on_discarded(n)
            else:
                version.version += 1
        except ValueError:
            assert manager.counts() == before, f"a rejected {op}({n}) must change nothing"
        c = manager.counts()
        assert min(c.running, c.accepted, c.consumed, c.rejected, c.discarded, c.pending) >= 0
        assert c.accepted + c.running <= (max_staleness + version.version + 1) * groups_per_version
        if max_concurrent is not None:
            assert c.running <= max_concurrent
        assert c.started == c.running + c.accepted + c.rejected + c.discarded


@settings(max_examples=100, deadline=None)
@given(groups_per_version=st.integers(1, 6), ops=OPS)
def test_with_staleness_zero_at_most_one_batch_starts_per_version(groups_per_version, ops):
    """η = 0 and nothing rejected or discarded: by version v at most (v + 1)·B groups were ever started."""
    version = FakeVersion()
    manager = StalenessManager(groups_per_version, max_staleness=0, version_provider=version)
    for op, n in ops:
        if op == "start":
            n = min(n, manager.capacity())
            if n > 0:
                manager.on_start(n)
        elif op == "finish_ok" and manager.counts().running >= n:
            manager.on_finish(True, n)
        elif op == "consume" and manager.counts().pending >= n:
            manager.on_consumed(n)
        elif op == "bump":
            version.version += 1
        assert manager.counts().started <= (version.version + 1) * groups_per_version


@settings(max_examples=100, deadline=None)
@given(
    required_samples=st.integers(1, 4),
    sync_every=st.integers(1, 4),
    eta=st.integers(0, 2),
    choices=st.lists(st.sampled_from(["start", "finish", "train"]), min_size=1, max_size=300),
)
def test_in_order_pipeline_trains_nothing_staler_than_max_staleness_and_never_deadlocks(
    required_samples, sync_every, eta, choices
):
    """Simulated loop in the runtime's units: R groups per step, a sync (one version) every K steps, the budget in
    B = R·K groups per version. Groups finish and are trained in start order. Every trained group is within η, and
    whenever the trainer lacks a batch and nothing runs, capacity is positive: any η >= 0 with any K makes
    progress (a version's B groups are always allowed), so no sync interval needs checking against η."""
    manager = StalenessManager(groups_per_version(required_samples, sync_every), eta)
    version, step = 0, 0
    running: list[int] = []  # start versions, oldest first
    queued: list[int] = []
    for choice in choices:
        if choice == "start" and manager.capacity(version) > 0:
            manager.on_start()
            running.append(version)
        elif choice == "finish" and running:
            manager.on_finish(True)
            queued.append(running.pop(0))
        elif choice == "train" and len(queued) >= required_samples:
            batch, queued = queued[:required_samples], queued[required_samples:]
            assert all(version - v <= eta for v in batch)
            assert not StalenessBounds(eta).split([group(f"p{i}", [v]) for i, v in enumerate(batch)], version)[1]
            manager.on_consumed(required_samples)
            step += 1
            if is_sync_step(step, sync_every):
                version += 1
        if not running and len(queued) < required_samples:
            assert manager.capacity(version) > 0, "the trainer waits for a batch nobody may start"


def test_capacity_shrinks_when_version_lags_and_grows_when_it_advances():
    manager = StalenessManager(groups_per_version=4, max_staleness=1)
    assert manager.capacity(0) == 8
    manager.on_start(8)
    assert manager.capacity(0) == 0
    manager.on_finish(True, 8)
    manager.on_consumed(4)  # trained groups keep their slot: only a new version frees budget
    assert manager.capacity(0) == 0
    assert manager.capacity(1) == 4


def test_discarded_and_rejected_groups_free_their_slots():
    manager = StalenessManager(groups_per_version=2, max_staleness=0)
    manager.on_start(2)
    manager.on_finish(False)
    assert manager.capacity(0) == 1
    manager.on_finish(True)
    manager.on_discarded(1)
    assert manager.capacity(0) == 2


def test_concurrency_limit_caps_capacity():
    manager = StalenessManager(groups_per_version=100, max_staleness=0, max_concurrent=3)
    manager.on_start(2)
    assert manager.capacity(0) == 1


def test_impossible_transitions_raise_and_change_nothing():
    manager = StalenessManager(groups_per_version=2, max_staleness=0)
    manager.on_start(1)
    before = manager.counts()
    with pytest.raises(ValueError, match="only 1 groups are running"):
        manager.on_finish(True, 2)
    with pytest.raises(ValueError, match="pending"):
        manager.on_consumed(1)
    with pytest.raises(ValueError, match="pending"):
        manager.on_discarded(1)
    with pytest.raises(ValueError):
        manager.on_start(0)
    assert manager.counts() == before


def test_capacity_without_version_or_provider_raises():
    with pytest.raises(ValueError, match="version_provider"):
        StalenessManager(1, 0).capacity()


def test_restore_resets_running_so_reissued_rollouts_are_not_counted_twice():
    manager = StalenessManager(groups_per_version=2, max_staleness=1)
    manager.on_start(4)
    manager.on_finish(True, 2)
    state = manager.state_dict()
    restored = StalenessManager(groups_per_version=2, max_staleness=1)
    restored.load_state_dict(state)
    assert restored.counts().running == 0
    assert restored.counts().accepted == 2
    assert restored.capacity(0) == 2  # the two that were running can be started again
    with pytest.raises(ValueError, match="inconsistent"):
        restored.load_state_dict(state | {"consumed": 5})


# --- the training-time check ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("min_version", "trainer_version", "max_staleness", "expected"),
    [(3, 5, 2, False), (2, 5, 2, True), (5, 5, 0, False), (4, 5, 0, True), (None, 100, 0, False)],
)
def test_is_too_stale_compares_lag_with_max_staleness(min_version, trainer_version, max_staleness, expected):
    assert is_too_stale(min_version, trainer_version, max_staleness) is expected


def test_the_split_uses_the_oldest_token_of_a_resumed_trajectory():
    resumed = group("a", [1, 1, 4])  # started at version 1, resumed after a sync to 4
    fresh = group("b", [4, 4])
    split = StalenessBounds(2).split([resumed, fresh], trainer_version=4)
    assert split.fresh == [fresh]
    assert split.too_stale == [resumed]


def test_a_group_keeps_the_eta_it_was_admitted_under_when_eta_falls_and_gains_when_it_rises():
    bounds = StalenessBounds(8)
    bounds.set(1, version=3)  # lowered at the sync to version 3
    assert bounds.current == 1
    assert bounds.bound(2) == 8 and bounds.bound(3) == 8  # started before, or during the version η fell
    assert bounds.bound(4) == 1 and bounds.bound(None) == 1
    split = bounds.split([group("old", [2, 9]), group("new", [4]), group("older", [0])], 10)
    assert [g.prompt_uid for g in split.fresh] == ["old"] and [g.prompt_uid for g in split.too_stale] == [
        "new",
        "older",
    ]
    bounds.set(4, version=6)  # raised: every group may now reach 4, the old ones still 8
    assert (bounds.bound(4), bounds.bound(7), bounds.bound(2)) == (4, 4, 8)
    bounds.set(4, version=9)  # unchanged: no new entry
    bounds.set(2, version=9)
    assert (bounds.bound(8), bounds.bound(9), bounds.bound(10)) == (4, 4, 2)
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        bounds.set(-1, version=10)


# --- rLLM keys --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("threshold", "sync_step", "expected_eta"),
    [(0.1, 4, 0), (0.0, 1, 0), (0.0, 4, 0), (0.99, 1, 0), (1.0, 1, 1), (1.0, 2, 1), (2.5, 2, 2), (3.0, 3, 3)],
)
def test_staleness_threshold_maps_to_the_largest_bound_in_versions_within_verls(threshold, sync_step, expected_eta):
    R = 8
    eta = max_staleness_from_rllm(threshold, R, sync_step)
    assert eta == expected_eta
    verl_bound = int(R * (1 + threshold) * sync_step)  # groups queued or running per sync period (verl, rLLM)
    budget = (eta + 1) * groups_per_version(R, sync_step)  # this project's, at any version (core/staleness.py)
    assert budget <= verl_bound < budget + groups_per_version(R, sync_step)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((-0.5, 4, 1), "staleness_threshold must be"),
        ((float("nan"), 4, 1), "staleness_threshold must be"),
        ((0.1, 0, 1), "required_samples must be an integer >= 1"),
        ((0.1, 4, 0), "trigger_parameter_sync_step must be an integer >= 1"),
    ],
)
def test_bad_rllm_keys_raise_one_line_naming_the_key(args, message):
    with pytest.raises(ValueError, match=message) as info:
        max_staleness_from_rllm(*args)
    assert "\n" not in str(info.value)


def test_a_sync_closes_every_kth_step_and_never_before_the_first():
    assert [step for step in range(0, 10) if is_sync_step(step, 3)] == [3, 6, 9]
    assert [step for step in range(0, 4) if is_sync_step(step, 1)] == [1, 2, 3]
    with pytest.raises(ValueError, match="trigger_parameter_sync_step"):
        is_sync_step(1, 0)


@given(
    eta=st.integers(0, 8),
    required=st.integers(1, 6),
    k=st.integers(1, 4),
    version=st.integers(0, 10),
)
@settings(max_examples=60, deadline=None)
def test_the_groups_ahead_budget_is_what_the_capacity_rule_lets_start_after_a_sync(eta, required, k, version):
    """The report's dashed budget line (core/versions.groups_ahead_budget) is the manager's own rule: with the
    trainer at `version` having consumed version·B groups, exactly (η+1)·B more may start before capacity is 0."""
    manager = StalenessManager(groups_per_version(required, k), max_staleness=eta)
    consumed = version * manager.B
    if consumed:
        manager.on_start(consumed)
        manager.on_finish(True, consumed)
        manager.on_consumed(consumed)
    started = 0
    while manager.capacity(version) > 0:
        manager.on_start()
        started += 1
    assert started == groups_ahead_budget(eta, required, k)
