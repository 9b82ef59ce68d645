"""Adaptive staleness: η follows how off-policy the trained batches actually are (pure rule, no I/O).

Every public fully-async system fixes its staleness bound by hand. Here, with
`async_training.adaptive_staleness.enable`, the trainer measures each batch's off-policy statistics against the
behaviour policy that generated it, and at every weight sync this rule moves η (in policy versions,
core/versions.py) by one step:

    window   = the batches trained since the previous sync (their statistics averaged)
    outside  = ess < min_ess  or  kl > max_kl  or  cut > max_cut                (over the statistics measured)
    clear    = 1 − ess <= m (1 − min_ess)  and  kl <= m max_kl  and  cut <= m max_cut,   m = raise_margin
    waiting  = the trainer waited for its batches >= w of its step time,   w = raise_when_waiting (unmeasured: yes)
    η  <-  max(min, η − step)   if outside
    η  <-  min(max, η + step)   if clear and waiting for `raise_after` syncs in a row
    η  unchanged                 otherwise (the dead band; or clear while the trainer had its batches at once),
                                 or when nothing was measured

The statistics (`OffPolicySignals`), all between the policy that generated each token (pi_behav) and the trainer's
weights at the step (pi_theta, the proximal policy of decoupled PPO with prox_lag 0):
- ess: the effective sample size of the token importance weights w = pi_theta / pi_behav as a fraction of the tokens,
  (sum w)^2 / (N sum w^2) ~= 1 / (1 + chi^2) (Kong 1992; VCPO scales its updates by it). 1 = on-policy;
- kl: KL(pi_behav || pi_theta) per token, the k3 estimator E[w - 1 - log w] (Schulman 2020);
- cut: the share of tokens the trust region took out of the gradient: PPO's clipped fraction, or the masked
  fraction of a masking correction (m2po, decoupled cap_mode=mask), whichever is larger.
Why lower fast and raise slowly: a batch beyond the thresholds is already trained on; the data in flight was admitted
under the old η and reaches the trainer over the next η versions, so the rule lowers at once and raises only after
`raise_after` clear windows. Why a dead band: the statistics grow with the staleness η allows, so a rule that raised
as soon as they were inside would overshoot: the groups admitted under the higher η keep it (core/staleness.py,
`StalenessBounds`) and keep the statistics outside while they are trained, so η swings from its top to its floor
and back (simulated in tests/core/test_adaptive_staleness.py); with m = 0.5 η rises only while the statistics are at
most half their limits. Why per sync: η only changes what the rollout service admits, and the service learns the
new η with the trainer's next request (with the new version), so deciding more often than versions change is moot.
Why raise only while the trainer waits: a higher η lets more rollouts run ahead of the trainer, which buys
throughput only when the trainer waits for data; when its batches are there at once, a higher η adds staleness and
nothing else. On the embedded default the trainer waits 1-6% of its step at any η >= 1 (the wait after a sync),
against 46% when synchronous, and a fixed η=1 reached the accuracy threshold before every higher η and before the
rule without this condition (tests/bench/README.md); w = 0 raises on the statistics alone.

`StalenessController` applies the rule; the trainer owns one (its state is in the trainer's checkpoint) and sends
its η with every batch request; the simulator (simulate/engine.py) drives the same class with modelled statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AdaptiveStalenessRule:
    """The rule's settings (`async_training.adaptive_staleness`, documented field by field in settings/schema.py)."""

    min: int = 1  # η never goes below (versions)
    max: int = 16  # η never goes above (versions)
    step: int = 1  # versions added or removed per decision
    raise_after: int = 2  # syncs in a row clear of every threshold before η is raised
    raise_margin: float = 0.5  # m: η rises only with every statistic within this fraction of its limit
    min_ess: float = 0.8  # ESS of the token importance weights as a fraction of the tokens
    max_kl: float = 0.02  # KL(pi_behav || pi_theta) per token (k3)
    max_cut: float = 0.02  # share of tokens clipped or masked by the trust region
    raise_when_waiting: float = 0.1  # w: η rises only while the trainer waited at least this share of its steps

    def __post_init__(self) -> None:
        if not 0 <= self.min <= self.max:
            raise ValueError(f"adaptive_staleness needs 0 <= min <= max, got min={self.min} max={self.max}")
        if self.step < 1 or self.raise_after < 1:
            raise ValueError(
                f"adaptive_staleness.step and raise_after must be >= 1, got {self.step}, {self.raise_after}"
            )
        if not 0 < self.raise_margin <= 1:
            raise ValueError(f"adaptive_staleness.raise_margin must be in (0, 1], got {self.raise_margin}")
        if not 0 <= self.raise_when_waiting <= 1:
            raise ValueError(f"adaptive_staleness.raise_when_waiting must be in [0, 1], got {self.raise_when_waiting}")
        for name in ("min_ess", "max_kl", "max_cut"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"adaptive_staleness.{name} must be a finite number >= 0, got {value}")


@dataclass(frozen=True)
class OffPolicySignals:
    """One batch's off-policy statistics (module docstring); None where the run did not measure one."""

    ess: float | None = None
    kl: float | None = None
    cut: float | None = None


@dataclass(frozen=True)
class StalenessDecision:
    """What one decision saw and did."""

    before: int
    after: int
    signals: OffPolicySignals  # the window's means
    outside: tuple[str, ...]  # the statistics outside their thresholds ("ess", "kl", "cut")
    trainer_wait: float | None = None  # the window's mean share of step time the trainer waited for its batch

    @property
    def changed(self) -> bool:
        return self.after != self.before

    def describe(self) -> str:
        """One line: η before -> after and the statistics that decided, e.g. `η 4 -> 3 (ess 0.62 < 0.80)`."""
        s = self.signals
        parts = [
            f"{name} {value:.3g}" for name, value in (("ess", s.ess), ("kl", s.kl), ("cut", s.cut)) if value is not None
        ]
        if self.trainer_wait is not None:
            parts.append(f"trainer waited {self.trainer_wait:.0%}")
        why = "outside: " + ", ".join(self.outside) if self.outside else "inside"
        return f"η {self.before} -> {self.after} ({', '.join(parts) or 'no statistics'}; {why})"


class StalenessController:
    """The rule of the module docstring over a window of batches. Not thread-safe: its owner is the trainer loop.

    `observe(signals, trainer_wait)` after each trained batch; `decide()` at each weight sync returns the decision
    and starts a new window; `eta` is the η in force.
    """

    def __init__(self, rule: AdaptiveStalenessRule, eta: int) -> None:
        if not rule.min <= eta <= rule.max:
            raise ValueError(
                f"the starting max_staleness {eta} must be within adaptive_staleness [min, max] = "
                f"[{rule.min}, {rule.max}]"
            )
        self.rule = rule
        self.eta = eta
        self._clear_streak = 0
        self._sums = {"ess": 0.0, "kl": 0.0, "cut": 0.0}
        self._counts = {"ess": 0, "kl": 0, "cut": 0}
        self._waits: list[float] = []

    def observe(self, signals: OffPolicySignals, trainer_wait: float | None = None) -> None:
        """One trained batch: its statistics, and the share of its step the trainer waited for it (None: unknown)."""
        for name in self._sums:
            value = getattr(signals, name)
            if value is not None and math.isfinite(value):
                self._sums[name] += float(value)
                self._counts[name] += 1
        if trainer_wait is not None and math.isfinite(trainer_wait):
            self._waits.append(float(trainer_wait))

    def window(self) -> OffPolicySignals:
        """The means of the statistics observed since the last decision (None where none was)."""
        means = {k: (self._sums[k] / self._counts[k] if self._counts[k] else None) for k in self._sums}
        return OffPolicySignals(**means)

    def decide(self) -> StalenessDecision:
        r, seen, before = self.rule, self.window(), self.eta
        outside = tuple(
            name
            for name, bad in (
                ("ess", seen.ess is not None and seen.ess < r.min_ess),
                ("kl", seen.kl is not None and seen.kl > r.max_kl),
                ("cut", seen.cut is not None and seen.cut > r.max_cut),
            )
            if bad
        )
        m = r.raise_margin
        measured = any(v is not None for v in (seen.ess, seen.kl, seen.cut))
        clear = measured and not any(
            (
                seen.ess is not None and 1 - seen.ess > m * (1 - r.min_ess),
                seen.kl is not None and seen.kl > m * r.max_kl,
                seen.cut is not None and seen.cut > m * r.max_cut,
            )
        )
        trainer_wait = sum(self._waits) / len(self._waits) if self._waits else None
        waiting = trainer_wait is None or trainer_wait >= r.raise_when_waiting
        if outside:
            self.eta = max(r.min, self.eta - r.step)
            self._clear_streak = 0
        elif clear and waiting:
            self._clear_streak += 1
            if self._clear_streak >= r.raise_after:
                self.eta = min(r.max, self.eta + r.step)
                self._clear_streak = 0
        elif measured:
            # In the dead band, or clear while the trainer had its batches at once: hold, and count clear windows
            # again from the next.
            self._clear_streak = 0
        self._sums = dict.fromkeys(self._sums, 0.0)
        self._counts = dict.fromkeys(self._counts, 0)
        self._waits = []
        return StalenessDecision(before, self.eta, seen, outside, trainer_wait)

    def state_dict(self) -> dict[str, Any]:
        """η and the streak, for the trainer's checkpoint (the window restarts empty on resume)."""
        return {"eta": self.eta, "clear_streak": self._clear_streak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        eta = int(state["eta"])
        if not self.rule.min <= eta <= self.rule.max:
            raise ValueError(f"checkpointed η {eta} is outside adaptive_staleness [{self.rule.min}, {self.rule.max}]")
        self.eta = eta
        self._clear_streak = int(state["clear_streak"])
