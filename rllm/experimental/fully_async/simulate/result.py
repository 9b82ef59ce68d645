"""What one simulation measured (engine.py fills it in): the whole run, and each stretch of one engine count."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Segment:
    """One stretch of the run at one engine count (model.py's `engine_schedule`: a run without one is one segment),
    from the change that began it to the next one or the end of the run. Tokens decoded count the work the engines
    did in the stretch (regenerated tokens included); trained tokens and staleness count the steps that ended in it."""

    start_s: float
    engines: int  # the engine count in the stretch (joining ones included)
    change: int = 0  # engines added (+) or removed (-) at its start; 0 for the first
    end_s: float = 0.0
    samples_moved: int = 0  # samples in flight on the removed engines, moved to the others at its start
    tokens_regenerated: int = 0  # of those, tokens generated again (partial rollout off: they restart)
    tokens_decoded: float = 0.0
    tokens_trained: int = 0
    steps: int = 0
    staleness: dict[int, int] = field(default_factory=dict)  # trained groups by staleness
    eta: int = 0  # η at its end

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def generated_tokens_per_s(self) -> float:
        return self.tokens_decoded / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def trained_tokens_per_s(self) -> float:
        return self.tokens_trained / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def mean_staleness(self) -> float | None:
        n = sum(self.staleness.values())
        return sum(k * v for k, v in self.staleness.items()) / n if n else None

    @property
    def max_staleness(self) -> int | None:
        return max(self.staleness) if self.staleness else None

    def as_dict(self) -> dict[str, Any]:
        """The segment and its rates, as plain JSON-able values."""
        out = dataclasses.asdict(self)
        out["staleness"] = {str(k): v for k, v in sorted(self.staleness.items())}
        for name in ("duration_s", "generated_tokens_per_s", "trained_tokens_per_s", "mean_staleness", "max_staleness"):
            out[name] = getattr(self, name)
        return out


@dataclass
class SimResult:
    """What one simulation measured. Times in simulated seconds."""

    wall_s: float
    steps: int
    syncs: int
    trainer_wait_s: float  # blocked waiting for a batch
    trainer_sync_s: float  # in weight syncs
    engine_busy_s: float  # sum over engines of time with >= 1 request decoding
    engine_paused_s: float  # sum over engines of time paused for a sync
    num_engines: int
    tokens_generated: int  # tokens of finished samples (kept, rejected or dropped)
    tokens_trained: int
    staleness: dict[int, int]  # trained groups by staleness (trainer version - oldest token version)
    dropped_stale_groups: int
    mixed_version_samples: int  # trained samples whose tokens span more than one version
    trainer_busy_s: float = 0.0  # training (not waiting or syncing), slowed by host sharing
    trainer_work_s: float = 0.0  # the same steps' uncontended time (TrainerModel.step_s); = busy_s without sharing
    step_end_s: list[float] = field(default_factory=list)
    step_wait_s: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    step_busy_s: list[float] = field(default_factory=list)  # each step's training time (trainer_busy_s per step)
    trace: list[tuple[Any, ...]] = field(default_factory=list)  # policy inputs and outputs, when asked for
    eta_changes: list[tuple[int, int, int]] = field(default_factory=list)  # adaptive: (step, η before, η after)
    final_eta: int | None = None  # adaptive: η at the end
    segments: list[Segment] = field(default_factory=list)  # one per engine count the run reached (engine_schedule)
    engine_s: float | None = None  # engine-seconds provisioned (engines x time, joins and leaves counted)
    samples_moved: int = 0  # samples moved off removed engines
    tokens_regenerated: int = 0  # tokens generated again after a move (0 with token-level resume)
    stopped: str | None = None  # why the run ended before its steps (no engine for no_engine_timeout_s)
    # Tokens the engines decoded, every piece counted (ones later moved, discarded or still in flight at the end
    # included): what a run's rollout/tokens_per_s counts (runtime/rollout/service.py), so the two compare.
    tokens_decoded: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """The figures the CLI prints and every segment, as plain JSON-able values (`simulate --json FILE`)."""
        return {
            "wall_s": self.wall_s,
            "steps": self.steps,
            "syncs": self.syncs,
            "trainer_idle_frac": self.trainer_idle_frac,
            "engine_idle_frac": self.engine_idle_frac,
            "generated_tokens_per_s": self.generated_tokens_per_s,
            "trained_tokens_per_s": self.trained_tokens_per_s,
            "mean_staleness": self.mean_staleness,
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
            "dropped_stale_groups": self.dropped_stale_groups,
            "samples_moved": self.samples_moved,
            "tokens_regenerated": self.tokens_regenerated,
            "stopped": self.stopped,
            "segments": [segment.as_dict() for segment in self.segments],
        }

    @property
    def trainer_idle_frac(self) -> float:
        return self.trainer_wait_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def engine_idle_frac(self) -> float:
        """Share of engine time with nothing decoding (sync pauses count as idle)."""
        total = self.engine_s if self.engine_s is not None else self.wall_s * self.num_engines
        return 1.0 - self.engine_busy_s / total if total > 0 else 0.0

    @property
    def generated_tokens_per_s(self) -> float:
        """Tokens decoded per second of the run (`tokens_decoded`), as a run's rollout/tokens_per_s counts them."""
        return self.tokens_decoded / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def trained_tokens_per_s(self) -> float:
        return self.tokens_trained / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_staleness(self) -> float:
        n = sum(self.staleness.values())
        return sum(k * v for k, v in self.staleness.items()) / n if n else 0.0
