"""Messages between the rollout side and the trainer: VersionedSequence, VersionedTrajectory, VersionedGroup.

These are the only things that cross the MessageQueue. They carry token ids (never text) so the trainer
trains on exactly what the engine produced, and every generated token carries the policy version that
produced it (docs/design.md#rule-versions-on-every-token), which is what staleness is measured from.

A VersionedTrajectory holds one or more Sequences so that a multi-turn agent (one model call per turn) fits
without a redesign; a single-turn RLVR sample is a VersionedTrajectory with one VersionedSequence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class TrajectoryStatus(str, Enum):
    """How a rollout ended. Only OK trajectories can be trained; the others land in the ledger."""

    OK = "ok"
    FAILED = "failed"  # reward function raised/timed out/returned a non-number, engine gave up, ...


@dataclass
class VersionedSequence:
    """One model call: a prompt and the response the engine generated for it.

    `response_logprobs`, `response_versions` and `loss_mask` have one entry per response token.
    `loss_mask[i] == 0` marks tokens the policy did not generate (tool or environment output spliced into a
    multi-turn response); they are conditioned on but never trained.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    response_versions: list[int]
    loss_mask: list[int] | None = None
    finish_reason: str = "stop"  # stop | length (abort never survives: the client resumes it)
    num_resumes: int = 0  # how many times a weight update interrupted this generation (partial rollout)
    # With LoRA: the adapter each model call behind these tokens named (its client's record; engines/lora.py names
    # version v `policy-v<v>`), one entry per call; None when the calls named none (the base model).
    lora_paths: list[str | None] | None = None

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = [1] * len(self.response_ids)
        n = len(self.response_ids)
        lengths = (len(self.response_logprobs), len(self.response_versions), len(self.loss_mask))
        if any(length != n for length in lengths):
            raise ValueError(
                f"VersionedSequence fields disagree in length: {n} response ids, "
                f"logprobs/versions/loss_mask = {lengths}"
            )

    @property
    def min_version(self) -> int | None:
        """Oldest policy version among trained tokens (None if there are none)."""
        versions = [v for v, m in zip(self.response_versions, self.loss_mask, strict=True) if m]
        return min(versions) if versions else None


@dataclass
class VersionedTrajectory:
    """One sample for one prompt: its sequences, its reward and how it ended."""

    uid: str  # unique per sample: f"{prompt_uid}/{sample_index}"
    prompt_uid: str
    sequences: list[VersionedSequence]
    reward: float = 0.0
    status: TrajectoryStatus = TrajectoryStatus.OK
    failure_reason: str | None = None
    step_rewards: list[float] | None = None  # multi-step agents (GiGPO): one reward per step
    step_state_hashes: list[str] | None = None  # multi-step agents (GiGPO): environment state before each step
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)

    @property
    def min_version(self) -> int | None:
        versions = [s.min_version for s in self.sequences if s.min_version is not None]
        return min(versions) if versions else None

    @property
    def num_resumes(self) -> int:
        return sum(s.num_resumes for s in self.sequences)


@dataclass
class VersionedGroup:
    """The n samples of one prompt; the unit the staleness budget and the queue count in."""

    prompt_uid: str
    trajectories: list[VersionedTrajectory]
    data_source: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)

    @property
    def min_version(self) -> int | None:
        versions = [t.min_version for t in self.trajectories if t.min_version is not None]
        return min(versions) if versions else None

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    def staleness(self, trainer_version: int) -> int:
        """Trainer version minus the oldest token version (docs/design.md#rule-versions-on-every-token); 0 when nothing
        was generated."""
        oldest = self.min_version
        return 0 if oldest is None else trainer_version - oldest
