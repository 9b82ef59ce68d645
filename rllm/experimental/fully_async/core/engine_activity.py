"""Engine activity: busy time and generated tokens on one clock, read per interval (pure, no I/O).

The rollout side reports, per interval between two batches, how idle the engines were (`engines/idle_frac`) and
how many tokens they generated (`rollout/tokens_per_s`). Both come from one `EngineActivity` per engine, fed by the
engine pool where each /generate call starts and returns (`engines/pool.py`):

- busy: an engine is busy while at least one of our requests is on it: from the `begin` that takes its in-flight
  count from 0 to 1 to the `end` that takes it back to 0;
- tokens: the output tokens a call returned are credited at that call's `end`, at the same instant, so a token is
  counted in the interval in which its request was last in flight.

An `IntervalMeter` reads the cumulative figures at each interval's end and reports the differences. For every
engine e and interval (t0, t1]: Δtokens_e > 0 means some call on e ended at some t in (t0, t1] after running over
[s, t] with s < t, so Δbusy_e ≥ t - max(s, t0) > 0. Summed over the same engines, tokens > 0 ⇒ busy > 0, and
idle 100% ⇒ 0 tokens, by construction. (The old count credited a sample's tokens when the whole sample finished,
which can be an interval after the engine did the work.) Over any run of intervals the tokens add up to every
output token the engines returned. A call that fails (connection error) returns no tokens and credits none.

    idle_frac = 1 - mean_e min(1, Δbusy_e / Δt)        tokens_per_s = Σ_e Δtokens_e / Δt

The engines averaged are those serving at the interval's end plus any that left during it with activity in it
(`retired`), so an engine that leaves mid-interval still carries its tokens and its busy time, and one that left
long ago does not count as idle forever.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(eq=False)  # identity-hashed: the meter keys its snapshots by the object, not by URL (URLs get reused)
class EngineActivity:
    """One engine's in-flight count, busy seconds and output tokens, on the caller's clock (`now` arguments)."""

    in_flight: int = 0
    busy_s: float = 0.0  # finished busy spans only; `busy_time(now)` adds the current one
    busy_since: float | None = None  # start of the current busy span (in_flight > 0)
    tokens: int = 0  # output tokens of every call that has ended

    def begin(self, now: float, n: int = 1) -> None:
        """`n` requests start (a batched /generate counts each of its prompts)."""
        if self.in_flight == 0:
            self.busy_since = now
        self.in_flight += n

    def end(self, now: float, n: int = 1, tokens: int = 0) -> None:
        """`n` requests end, having returned `tokens` output tokens between them (0 for a failed call)."""
        if n > self.in_flight:
            raise ValueError(f"EngineActivity.end(n={n}) with only {self.in_flight} request(s) in flight")
        if tokens < 0:
            raise ValueError(f"EngineActivity.end(tokens={tokens}): a call returns 0 or more tokens")
        self.in_flight -= n
        self.tokens += tokens
        if self.in_flight == 0 and self.busy_since is not None:
            self.busy_s += now - self.busy_since
            self.busy_since = None

    def busy_time(self, now: float) -> float:
        """Busy seconds so far, the current span included."""
        return self.busy_s + (now - self.busy_since if self.busy_since is not None else 0.0)


@dataclass(frozen=True)
class Interval:
    """What the engines did over one interval of `elapsed_s` seconds."""

    elapsed_s: float
    tokens: int  # output tokens returned in the interval, all engines
    busy_fractions: tuple[float, ...]  # per engine averaged, Δbusy / Δt capped at 1

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def idle_frac(self) -> float | None:
        """1 - the mean busy fraction; None with no engine to average."""
        if not self.busy_fractions:
            return None
        return max(0.0, 1.0 - sum(self.busy_fractions) / len(self.busy_fractions))


class IntervalMeter:
    """Reads engine activities at the end of each interval and reports the interval (module docstring)."""

    def __init__(self, now: float) -> None:
        self._last_at = now
        self._seen: dict[EngineActivity, tuple[float, int]] = {}  # (busy_time, tokens) at the last read

    def read(self, now: float, current: Iterable[EngineActivity], retired: Iterable[EngineActivity] = ()) -> Interval:
        """The interval since the previous read (or construction) up to `now`. `current`: the engines serving now;
        `retired`: engines that left (counted in this interval only if busy in it)."""
        elapsed = now - self._last_at
        if elapsed < 0:
            raise ValueError(f"IntervalMeter.read(now={now}) is before the previous read at {self._last_at}")
        current = list(current)
        serving = set(current)
        seen: dict[EngineActivity, tuple[float, int]] = {}
        tokens, fractions = 0, []
        for activity in [*current, *(a for a in retired if a not in serving)]:
            busy_now = activity.busy_time(now)
            busy_before, tokens_before = self._seen.get(activity, (0.0, 0))
            d_busy, d_tokens = busy_now - busy_before, activity.tokens - tokens_before
            seen[activity] = (busy_now, activity.tokens)
            if activity in serving or d_busy > 0 or d_tokens > 0:
                tokens += d_tokens
                fractions.append(min(1.0, d_busy / elapsed) if elapsed > 0 else (1.0 if d_busy > 0 else 0.0))
        self._last_at, self._seen = now, seen
        return Interval(elapsed, tokens, tuple(fractions))
