"""Messages between the trainer and the rollout service: one request per step, one batch back (frozen dataclasses).

The trainer makes one call per step, `take_batch(BatchRequest) -> Batch`, which also acknowledges the previous
step's batch (`Ack`) and tells the service the trainer's policy version (unit: core/versions.py). The service
drops groups too stale for that version itself, so stale groups never cross the wire, and returns with the batch
what the driver reports each step (queue, ledger and rollout statistics), so no other call is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from rllm.experimental.fully_async.api.trajectory import TrajectoryStatus, VersionedGroup


@dataclass(frozen=True)
class Ack:
    """What the trainer trained since its last request: the samples (ledger: trained) and how many groups (budget)."""

    sample_ids: tuple[str, ...] = ()
    groups: int = 0

    @classmethod
    def of(cls, groups: list[VersionedGroup]) -> Ack:
        """The acknowledgement of a trained batch: its OK samples and its group count."""
        ids = tuple(t.uid for g in groups for t in g.trajectories if t.status == TrajectoryStatus.OK)
        return cls(ids, len(groups))

    def __bool__(self) -> bool:
        return bool(self.sample_ids) or self.groups > 0


@dataclass(frozen=True)
class BatchRequest:
    """Ask for `n_groups` groups no staler than max_staleness at `version`, acknowledging `ack` first."""

    n_groups: int
    version: int  # the trainer's policy version (core/versions.py)
    ack: Ack = field(default_factory=Ack)
    timeout_s: float = 60.0  # how long the service waits for enough groups before answering "timeout"
    # η the service applies from this request on (adaptive staleness: it changes at a sync, so it arrives with the
    # new version); None: the service keeps the η it has (the run spec's)
    max_staleness: int | None = None


@dataclass(frozen=True)
class Batch:
    """The service's answer.

    status "ok": `groups` holds n_groups groups, or fewer when the rollouts have ended and this is what is left;
    "timeout": no groups (nothing was taken; the trainer decides whether to fail); "closed": the rollouts have
    ended and nothing is left; "interrupted": no groups (nothing was taken) because the run is stopping on an
    interrupt or a failure, so the trainer takes no step and its checkpoint need not wait for a batch.
    """

    groups: list[VersionedGroup]
    status: Literal["ok", "timeout", "closed", "interrupted"]
    stale_groups: int  # groups dropped as too stale while serving this request (ledger: dropped_stale)
    wait_s: float  # time the service spent waiting for groups
    metrics: dict[str, float] = field(default_factory=dict)  # queue/*, ledger/*, rollout/*: for the step's report
    # A validation is running (or about to) and pins the engines' weights: this step's sync must wait for it.
    # None can start before the step ends: the driver starts them between steps (runtime/rollout/validation.py).
    validating: bool = False


class RolloutSource(Protocol):
    """What the trainer needs from the rollout side (the RolloutService actor, or a local one in tests)."""

    def take_batch(self, request: BatchRequest) -> Batch: ...

    def acknowledge(self, ack: Ack) -> None:
        """Deliver an acknowledgement without taking a batch (before a checkpoint or at the end of a run)."""

    def begin_weight_sync(self) -> float:
        """Before the engines' weights change: wait for a running validation (it is pinned to one version);
        returns the seconds waited (runtime/rollout/validation.py)."""

    def end_weight_sync(self) -> None:
        """After the weight sync: validations may start again."""
