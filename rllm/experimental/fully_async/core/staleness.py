"""Staleness policy: how many rollouts may start now and what is too stale to train (rLLM's keys: settings/compat.py).

Pure code (no Ray, no asyncio, no I/O): the RolloutExecutor, the trainer, the simulator and the tests call the
same functions (docs/design.md#rule-functional-core). Modelled on AReaL's staleness manager.

Units (defined once in core/versions.py). Everything counts **groups** (one prompt's n samples, a
`VersionedGroup`); a **version** is one weight sync (the trainer bumps it once per sync, not per optimizer step),
and `B` is the number of groups consumed per version: required_samples × trigger_parameter_sync_step.

The rule (AReaL; docs/design.md#rule-hard-staleness-bound) — a new rollout starts only while

    accepted + running < (η + v + 1) · B

where η = max_staleness, v = the version the rollout will start with (the engines' current version), `running`
= groups started and not finished, `accepted` = groups finished and kept (queued, in the trainer's hands or
trained). Why it bounds staleness: the trainer reaches version t after consuming t·B groups; a group started at
version v was among the first (η + v + 1)·B kept groups, so if groups are trained in start order it is trained by
version η + v at the latest, i.e. with staleness ≤ η. Completion order is not start order (a long generation
finishes after later short ones), so the bound is soft; the hard bound is the training-time check
`is_too_stale`, which drops and counts what slipped through (docs/design.md#rule-hard-staleness-bound).

Groups that finish but are not kept (rejected by a workflow) or are kept and later discarded (dropped as too stale,
filtered at training time) leave `accepted`: they free budget so replacements can be generated — otherwise the
trainer could wait forever for a batch the budget no longer allows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from rllm.experimental.fully_async.api.trajectory import VersionedGroup


class VersionProvider(Protocol):
    """Anything that knows the policy version new rollouts start with (an engine pool, a fake in a test)."""

    def get_version(self) -> int: ...


@dataclass(frozen=True)
class RolloutCounts:
    """A snapshot of the manager's counters (groups)."""

    running: int  # started, not finished
    accepted: int  # finished and kept; includes consumed
    consumed: int  # kept groups the trainer has trained
    rejected: int  # finished but not kept (cumulative)
    discarded: int  # kept, then dropped before training (cumulative)
    started: int  # cumulative

    @property
    def pending(self) -> int:
        """Kept groups not trained yet: in the queue or in the trainer's hands."""
        return self.accepted - self.consumed


class StalenessManager:
    """Counts groups and answers one question: how many new rollouts may start now.

    capacity(v) = min(C − running, (η + v + 1)·B − (accepted + running)), C = max_concurrent (no limit if None).

    Not thread-safe by design: its one owner is the executor's event loop (or the simulator's loop). Every
    counter change is checked, and an impossible one (finishing more than are running, consuming more than are
    pending) raises and changes nothing, because a silent clamp would hide a bookkeeping bug and let the
    budget drift.
    """

    def __init__(
        self,
        groups_per_version: int,
        max_staleness: int,
        max_concurrent: int | None = None,
        version_provider: VersionProvider | None = None,
    ) -> None:
        if groups_per_version < 1:
            raise ValueError(f"groups_per_version must be >= 1, got {groups_per_version}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if max_concurrent is not None and max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1 or None, got {max_concurrent}")
        self.B = groups_per_version  # core/versions.groups_per_version
        # η's one owner in a rollout process: the admission budget reads it, the drop rule reads each group's bound.
        self.bounds = StalenessBounds(max_staleness)
        self.max_concurrent = max_concurrent
        self.version_provider = version_provider
        self._running = 0
        self._accepted = 0
        self._consumed = 0
        self._rejected = 0
        self._discarded = 0
        self._started = 0

    @property
    def eta(self) -> int:
        """η now (`bounds.current`): what the admission budget uses."""
        return self.bounds.current

    def set_max_staleness(self, max_staleness: int, version: int) -> None:
        """A new η from `version` on (adaptive staleness, core/adaptive_staleness.py): the budget of every version
        changes with it, and the groups started from now on are bounded by it (`bounds`). A lower η can leave capacity
        negative until the trainer has consumed what was admitted under the old one."""
        self.bounds.set(max_staleness, version)

    def budget(self, version: int) -> int:
        """(η + v + 1)·B: how many kept-or-running groups the rule allows at version v."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        return (self.eta + version + 1) * self.B

    def capacity(self, version: int | None = None) -> int:
        """How many groups may start now (can be negative when over budget, e.g. after a restore).

        `version` defaults to the VersionProvider's; one of the two must be given.
        """
        if version is None:
            if self.version_provider is None:
                raise ValueError("capacity() needs a version: pass one or give the manager a version_provider")
            version = self.version_provider.get_version()
        staleness_capacity = self.budget(version) - (self._accepted + self._running)
        if self.max_concurrent is None:
            return staleness_capacity
        return min(self.max_concurrent - self._running, staleness_capacity)

    def on_start(self, n: int = 1) -> None:
        """n groups started. The caller checks capacity() first; the manager only counts."""
        _check_positive(n)
        self._running += n
        self._started += n

    def on_finish(self, accepted: bool, n: int = 1) -> None:
        """n running groups finished: kept (queued for training) or rejected (failed, filtered by the workflow)."""
        _check_positive(n)
        if n > self._running:
            raise ValueError(f"on_finish({n}) but only {self._running} groups are running")
        self._running -= n
        if accepted:
            self._accepted += n
        else:
            self._rejected += n

    def on_consumed(self, n: int) -> None:
        """The trainer trained n kept groups. They stay in `accepted`: they used their slot in the budget."""
        _check_positive(n)
        if n > self._accepted - self._consumed:
            raise ValueError(f"on_consumed({n}) but only {self._accepted - self._consumed} kept groups are pending")
        self._consumed += n

    def on_discarded(self, n: int) -> None:
        """n kept, untrained groups were dropped (too stale, filtered at training time): their slots come back."""
        _check_positive(n)
        if n > self._accepted - self._consumed:
            raise ValueError(f"on_discarded({n}) but only {self._accepted - self._consumed} kept groups are pending")
        self._accepted -= n
        self._discarded += n

    def counts(self) -> RolloutCounts:
        return RolloutCounts(
            running=self._running,
            accepted=self._accepted,
            consumed=self._consumed,
            rejected=self._rejected,
            discarded=self._discarded,
            started=self._started,
        )

    def state_dict(self) -> dict[str, int]:
        """JSON-serialisable counters for a checkpoint (running is saved only to be ignored; see load_state_dict)."""
        return {
            "accepted": self._accepted,
            "consumed": self._consumed,
            "rejected": self._rejected,
            "discarded": self._discarded,
            "started": self._started,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore counters from a checkpoint, with `running` reset to 0.

        Why reset: the rollouts that were running when the checkpoint was taken did not survive the restart; the
        ledger re-issues them and the executor counts them again with on_start. Keeping them in `running` would
        count them twice and shrink the budget for good. The queue snapshot is assumed to be restored with the
        counters (its groups are the pending ones); if it is not, call on_discarded(number lost).
        """
        values = {key: int(state[key]) for key in ("accepted", "consumed", "rejected", "discarded", "started")}
        if any(v < 0 for v in values.values()) or values["consumed"] > values["accepted"]:
            raise ValueError(f"inconsistent staleness counters in checkpoint: {values}")
        self._accepted = values["accepted"]
        self._consumed = values["consumed"]
        self._rejected = values["rejected"]
        self._discarded = values["discarded"]
        self._started = values["started"]
        self._running = 0


def _check_positive(n: int) -> None:
    if n < 1:
        raise ValueError(f"count must be >= 1, got {n}")


# --- training-time check ----------------------------------------------------------------------------------------


def is_too_stale(min_token_version: int | None, trainer_version: int, max_staleness: int) -> bool:
    """True when trainer_version − min_token_version > max_staleness (docs/design.md#rule-versions-on-every-token);
    False if nothing was generated."""
    if min_token_version is None:
        return False
    return trainer_version - min_token_version > max_staleness


class StalenessSplit(NamedTuple):
    fresh: list[VersionedGroup]
    too_stale: list[VersionedGroup]


class StalenessBounds:
    """The training-time bound of each group: the larger of today's η and the η it was admitted under.

    Adaptive staleness (core/adaptive_staleness.py) moves η at weight syncs. Raising η lets every queued group live
    longer. Lowering it changes what may start from now on; a group that already started was admitted by the budget
    under the old η, whose rule (module docstring) has it trained by version v + η_old, so it keeps that bound.
    Dropping it instead threw away what the old budget had paid for: 14-17% of the tokens generated by the adaptive
    arms at η=8 and 16 (tests/bench/README.md).

        bound(g) = max(η_now, max{η in force during version g.min_version})

    Versions are the granularity: a group started during a version in which η changed keeps the larger η. A group
    with no token yet is bounded by η_now. The history starts with the configured η at version 0, so after a
    resume the groups restored from the checkpoint are bounded by the larger of it and η_now.
    """

    def __init__(self, max_staleness: int) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self._changes: list[tuple[int, int]] = [(0, max_staleness)]  # (from version, η), versions ascending

    @property
    def current(self) -> int:
        """η now: what the admission budget uses, and the bound of groups started from now on."""
        return self._changes[-1][1]

    def set(self, max_staleness: int, version: int) -> None:
        """η is `max_staleness` from `version` on (the version of the trainer request that carried it)."""
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if max_staleness != self.current:
            self._changes.append((max(version, self._changes[-1][0]), max_staleness))

    def bound(self, min_token_version: int | None) -> int:
        """The staleness a group whose oldest token has `min_token_version` may reach before it is dropped."""
        if min_token_version is None:
            return self.current
        during = [eta for start, eta in self._changes if start == min_token_version]
        before = [eta for start, eta in self._changes if start < min_token_version]
        return max([self.current, *during, *before[-1:]])

    def is_too_stale(self, min_token_version: int | None, trainer_version: int) -> bool:
        return is_too_stale(min_token_version, trainer_version, self.bound(min_token_version))

    def split(self, groups: Iterable[VersionedGroup], trainer_version: int) -> StalenessSplit:
        """(fresh, too_stale) by each group's oldest token and own bound, keeping the input order in each."""
        fresh: list[VersionedGroup] = []
        too_stale: list[VersionedGroup] = []
        for group in groups:
            (too_stale if self.is_too_stale(group.min_version, trainer_version) else fresh).append(group)
        return StalenessSplit(fresh, too_stale)
