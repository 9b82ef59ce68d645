"""Dynamic group filtering (DAPO / slime style): what is dropped from a batch, and why.

Group-relative estimators (GRPO, RLOO, GiGPO) learn nothing from a group whose samples all earned the same reward:
every advantage is zero, the group only dilutes the batch. DAPO (arXiv 2503.14476, Sec. 3.2 "Dynamic Sampling")
drops such groups and keeps sampling until the batch is full; slime does the same with its `dynamic_sampling_filter`.
Responses that ran into the length limit carry a reward for text that was cut off; DAPO's "overlong filtering"
(Sec. 3.4) keeps them out of the loss. This module does both on `VersionedGroup`s, before anything is tensorised.

Every function here is pure: lists in, a `FilterResult` out. Nothing is lost silently
(docs/design.md#rule-nothing-lost-silently): each dropped trajectory comes back inside a `DroppedGroup` carrying a
`FilterReason`, so the caller can write exactly one ``filtered(reason)`` ledger entry per sample. The invariant the
tests check is

    input trajectories = kept trajectories + dropped trajectories      (as multisets of `VersionedTrajectory.uid`).

Order of the stages in `filter_groups` (each sees only what the previous one kept):

1. length: a trajectory is *over length* when one of its sequences has more than `max_response_length` response
   tokens, and *truncated* when one of its sequences stopped because of the limit (``finish_reason == "length"``, or
   exactly `max_response_length` tokens). Over-length trajectories are always dropped when a limit is set;
   truncated ones only with `drop_truncated`. `length_scope="trajectory"` drops just those trajectories,
   `"group"` drops the whole group they belong to (keeps the group's baseline unbiased, costs more samples).
2. group size: a group left with fewer than `min_group_size` trajectories is dropped (a group baseline needs two).
3. reward variance: with `drop_zero_variance`, a group whose rewards all lie within `reward_tol` of each other is
   dropped. A group of one trajectory has zero variance by definition.

Over-sampling needs no arithmetic of its own: a group the filter drops frees its slot in the staleness budget at
once (`core/staleness.py`, `on_finish(accepted=False)`), so the executor starts a replacement and batches stay full
(tests/runtime/test_rollout_service.py shows it with the zero-variance filter).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from typing import Literal

from rllm.experimental.fully_async.api.trajectory import VersionedGroup, VersionedTrajectory

# Two rewards closer than this count as equal. Matches the epsilon verl's GRPO adds to the group std, so a group the
# filter keeps is one where GRPO's normalisation is not dominated by that epsilon.
REWARD_EQUAL_TOL = 1e-6


class FilterReason(str, Enum):
    """Why a trajectory was filtered; the value is what the ledger records."""

    ZERO_REWARD_VARIANCE = "zero_reward_variance"  # all rewards of the group equal: no group-relative signal
    RESPONSE_OVER_MAX_LENGTH = "response_over_max_length"  # a response longer than the trainer's response width
    RESPONSE_TRUNCATED = "response_truncated"  # a response cut off by the length limit (DAPO overlong filtering)
    GROUP_TOO_SMALL = "group_too_small"  # fewer than min_group_size trajectories left after the stages above


@dataclass(frozen=True)
class FilterConfig:
    """Which filters run. Proposed config keys: ``algorithm.group_filter.*`` (same names).

    drop_zero_variance: drop groups whose rewards are all equal. On for GRPO/RLOO/GiGPO (they give such groups zero
        advantage anyway); off for GAE, whose critic still learns from them.
    max_response_length: the trainer's response width in tokens (``data.max_response_length``); None disables the
        length stage.
    drop_truncated: also drop responses that stopped at the limit (DAPO overlong filtering). Off by default: the
        truncation is often what the reward should punish.
    length_scope: "trajectory" drops only the offending trajectories; "group" drops their whole group.
    min_group_size: smallest group worth training on after trajectory drops; 2 for any group baseline, 1 to keep
        everything (then singleton groups reach the advantage code, which gives them zero advantage by default).
    reward_tol: rewards within this distance count as equal.
    """

    drop_zero_variance: bool = True
    max_response_length: int | None = None
    drop_truncated: bool = False
    length_scope: Literal["trajectory", "group"] = "trajectory"
    min_group_size: int = 2
    reward_tol: float = REWARD_EQUAL_TOL

    def __post_init__(self) -> None:
        if self.max_response_length is not None and self.max_response_length < 1:
            raise ValueError(
                f"algorithm.group_filter.max_response_length must be >= 1 or null, got {self.max_response_length}"
            )
        if self.length_scope not in ("trajectory", "group"):
            raise ValueError(
                f"algorithm.group_filter.length_scope must be 'trajectory' or 'group', got {self.length_scope!r}"
            )
        if self.min_group_size < 1:
            raise ValueError(f"algorithm.group_filter.min_group_size must be >= 1, got {self.min_group_size}")
        if self.reward_tol < 0:
            raise ValueError(f"algorithm.group_filter.reward_tol must be >= 0, got {self.reward_tol}")
        if self.drop_truncated and self.max_response_length is None:
            raise ValueError(
                "algorithm.group_filter.drop_truncated needs max_response_length: set it to data.max_response_length"
            )


@dataclass(frozen=True)
class DroppedGroup:
    """Trajectories of one prompt group dropped for one reason.

    `group` keeps the prompt's identity and metadata but holds only the dropped trajectories; when the whole group
    was dropped it is the group itself.
    """

    group: VersionedGroup
    reason: FilterReason

    @property
    def num_trajectories(self) -> int:
        return len(self.group.trajectories)


@dataclass(frozen=True)
class FilterResult:
    """What survived, and every drop with its reason. `num_input_*` count what went in."""

    kept: tuple[VersionedGroup, ...]
    dropped: tuple[DroppedGroup, ...]
    num_input_groups: int
    num_input_trajectories: int

    @property
    def num_kept_groups(self) -> int:
        return len(self.kept)

    @property
    def num_kept_trajectories(self) -> int:
        return sum(len(g.trajectories) for g in self.kept)

    @property
    def keep_rate(self) -> float:
        """Kept groups / input groups (1.0 for an empty input: nothing was lost)."""
        return self.num_kept_groups / self.num_input_groups if self.num_input_groups else 1.0

    def dropped_trajectories_by_reason(self) -> dict[FilterReason, int]:
        counts: Counter[FilterReason] = Counter()
        for d in self.dropped:
            counts[d.reason] += d.num_trajectories
        return dict(counts)

    def to_metrics(self, prefix: str = "filter/") -> dict[str, float]:
        metrics = {
            f"{prefix}input_groups": float(self.num_input_groups),
            f"{prefix}kept_groups": float(self.num_kept_groups),
            f"{prefix}kept_trajectories": float(self.num_kept_trajectories),
            f"{prefix}keep_rate": self.keep_rate,
        }
        by_reason = self.dropped_trajectories_by_reason()
        for reason in FilterReason:
            metrics[f"{prefix}dropped_trajectories/{reason.value}"] = float(by_reason.get(reason, 0))
        return metrics


def _count_trajectories(groups: list[VersionedGroup] | tuple[VersionedGroup, ...]) -> int:
    return sum(len(g.trajectories) for g in groups)


def _trajectory_length_reason(
    trajectory: VersionedTrajectory, max_response_length: int, drop_truncated: bool
) -> FilterReason | None:
    """The length reason that drops `trajectory`, or None. Over length wins over truncated."""
    lengths = [len(s.response_ids) for s in trajectory.sequences]
    if any(n > max_response_length for n in lengths):
        return FilterReason.RESPONSE_OVER_MAX_LENGTH
    if drop_truncated and any(
        s.finish_reason == "length" or len(s.response_ids) == max_response_length for s in trajectory.sequences
    ):
        return FilterReason.RESPONSE_TRUNCATED
    return None


def drop_by_length(
    groups: list[VersionedGroup] | tuple[VersionedGroup, ...],
    max_response_length: int,
    *,
    drop_truncated: bool = False,
    scope: Literal["trajectory", "group"] = "trajectory",
) -> FilterResult:
    """Drop trajectories (scope "trajectory") or whole groups (scope "group") whose responses are too long.

    A group dropped with scope "group" is recorded under the reason of its first offending trajectory. A group whose
    trajectories are all dropped with scope "trajectory" is not kept as an empty group.
    """
    kept: list[VersionedGroup] = []
    dropped: list[DroppedGroup] = []
    for group in groups:
        reasons = [_trajectory_length_reason(t, max_response_length, drop_truncated) for t in group.trajectories]
        if all(r is None for r in reasons):
            kept.append(group)
            continue
        if scope == "group":
            first = next(r for r in reasons if r is not None)
            dropped.append(DroppedGroup(group, first))
            continue
        for reason in FilterReason:
            hit = [t for t, r in zip(group.trajectories, reasons, strict=True) if r is reason]
            if hit:
                dropped.append(DroppedGroup(replace(group, trajectories=hit), reason))
        survivors = [t for t, r in zip(group.trajectories, reasons, strict=True) if r is None]
        if survivors:
            kept.append(replace(group, trajectories=survivors))
    return FilterResult(tuple(kept), tuple(dropped), len(groups), _count_trajectories(groups))


def drop_small_groups(groups: list[VersionedGroup] | tuple[VersionedGroup, ...], min_group_size: int) -> FilterResult:
    """Drop groups with fewer than `min_group_size` trajectories."""
    kept = tuple(g for g in groups if len(g.trajectories) >= min_group_size)
    dropped = tuple(
        DroppedGroup(g, FilterReason.GROUP_TOO_SMALL) for g in groups if len(g.trajectories) < min_group_size
    )
    return FilterResult(kept, dropped, len(groups), _count_trajectories(groups))


def has_zero_reward_variance(group: VersionedGroup, tol: float = REWARD_EQUAL_TOL) -> bool:
    """True when max(reward) - min(reward) <= tol (always for groups of zero or one trajectory)."""
    rewards = group.rewards
    return len(rewards) < 2 or max(rewards) - min(rewards) <= tol


def drop_zero_variance(
    groups: list[VersionedGroup] | tuple[VersionedGroup, ...], tol: float = REWARD_EQUAL_TOL
) -> FilterResult:
    """Drop groups whose rewards are all equal (DAPO dynamic sampling)."""
    kept = tuple(g for g in groups if not has_zero_reward_variance(g, tol))
    dropped = tuple(
        DroppedGroup(g, FilterReason.ZERO_REWARD_VARIANCE) for g in groups if has_zero_reward_variance(g, tol)
    )
    return FilterResult(kept, dropped, len(groups), _count_trajectories(groups))


def filter_groups(groups: list[VersionedGroup] | tuple[VersionedGroup, ...], config: FilterConfig) -> FilterResult:
    """Run the configured stages in order (length, group size, reward variance); see the module docstring."""
    current: tuple[VersionedGroup, ...] = tuple(groups)
    dropped: list[DroppedGroup] = []
    if config.max_response_length is not None:
        stage = drop_by_length(
            current, config.max_response_length, drop_truncated=config.drop_truncated, scope=config.length_scope
        )
        current, dropped = stage.kept, dropped + list(stage.dropped)
    stage = drop_small_groups(current, config.min_group_size)
    current, dropped = stage.kept, dropped + list(stage.dropped)
    if config.drop_zero_variance:
        stage = drop_zero_variance(current, config.reward_tol)
        current, dropped = stage.kept, dropped + list(stage.dropped)
    return FilterResult(current, tuple(dropped), len(groups), _count_trajectories(groups))


GroupFilterFn = Callable[[list[VersionedGroup]], tuple[list[VersionedGroup], list[tuple[VersionedGroup, str]]]]


def build_group_filter(config: FilterConfig | None) -> GroupFilterFn | None:
    """The executor's filter from ``algorithm.group_filter`` as the run spec holds it (`ExecutorSpec.group_filter`;
    None when that section is absent: no filtering).

    The returned callable maps groups to (kept groups, [(dropped group, reason string)]); the reason strings are
    `FilterReason` values, what the ledger records. A kept group may hold fewer trajectories than the input group
    (trajectory-level length drops): callers must queue the kept objects, not their inputs.
    """
    if config is None:
        return None

    def group_filter(groups: list[VersionedGroup]) -> tuple[list[VersionedGroup], list[tuple[VersionedGroup, str]]]:
        result = filter_groups(groups, config)
        return list(result.kept), [(d.group, d.reason.value) for d in result.dropped]

    return group_filter
