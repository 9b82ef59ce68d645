"""core/engine_activity.py over scripted timelines: in every interval tokens > 0 implies busy > 0 and idle 100%
implies no tokens, and the intervals' tokens add up to every token the engines returned."""

from __future__ import annotations

import random

import pytest

from rllm.experimental.fully_async.core.engine_activity import EngineActivity, Interval, IntervalMeter


def _check(intervals: list[Interval], generated: int) -> None:
    for i, interval in enumerate(intervals):
        busy = sum(interval.busy_fractions)
        if interval.tokens > 0:
            assert busy > 0 and interval.idle_frac < 1.0, f"interval {i}: {interval}"
        if interval.idle_frac == 1.0:
            assert interval.tokens == 0, f"interval {i}: {interval}"
    assert sum(i.tokens for i in intervals) == generated


def test_scripted_timeline_across_interval_boundaries():
    a, b = EngineActivity(), EngineActivity()
    meter = IntervalMeter(now=0.0)
    intervals = []
    # A long sample on engine a: its first piece runs 2..9 and is aborted by a weight sync with 100 tokens, its
    # second runs 9.5..14 (after the boundary at 10) with 50 more; the sample finishes at 14. Counting at the
    # sample's end would put all 150 tokens in the second interval and none beside the first one's busy time.
    a.begin(2.0)
    a.end(9.0, tokens=100)
    a.begin(9.5)
    # Engine b: one call 5..10 that returns exactly at the boundary, before the read at 10.
    b.begin(5.0)
    b.end(10.0, tokens=40)
    intervals.append(meter.read(10.0, [a, b]))
    a.end(14.0, tokens=50)
    # A failed call on b (connection error): busy, no tokens.
    b.begin(15.0)
    b.end(16.0)
    intervals.append(meter.read(20.0, [a, b]))
    # Nothing in flight over 20..30.
    intervals.append(meter.read(30.0, [a, b]))
    # A call on b that straddles the read at 40 and returns at 45.
    b.begin(35.0)
    intervals.append(meter.read(40.0, [a, b]))
    b.end(45.0, tokens=7)
    intervals.append(meter.read(50.0, [a, b]))

    first, second, quiet, open_call, last = intervals
    assert first.tokens == 140 and first.idle_frac == pytest.approx(1 - (7.5 / 10 + 5 / 10) / 2)
    assert second.tokens == 50 and second.idle_frac == pytest.approx(1 - (4 / 10 + 1 / 10) / 2)
    assert quiet.tokens == 0 and quiet.idle_frac == 1.0
    assert open_call.tokens == 0 and open_call.idle_frac == pytest.approx(1 - (5 / 10) / 2)
    assert last.tokens == 7 and last.tokens_per_s == pytest.approx(0.7)
    _check(intervals, generated=197)


def test_an_engine_that_leaves_mid_interval_keeps_its_tokens_and_busy_time():
    staying, leaving = EngineActivity(), EngineActivity()
    meter = IntervalMeter(now=0.0)
    leaving.begin(1.0)
    first = meter.read(5.0, [staying, leaving])
    # `leaving` is removed at 6; its call returns at 8 and is counted (as busy and as tokens) in this interval.
    leaving.end(8.0, tokens=30)
    second = meter.read(10.0, [staying], retired=[leaving])
    third = meter.read(20.0, [staying], retired=[leaving])  # long gone: neither idle nor busy in the average
    assert first.tokens == 0 and first.idle_frac == pytest.approx(1 - (4 / 5) / 2)
    assert second.tokens == 30 and second.idle_frac == pytest.approx(1 - (3 / 5) / 2)
    assert third.busy_fractions == (0.0,) and third.idle_frac == 1.0
    _check([first, second, third], generated=30)


@pytest.mark.parametrize("seed", range(20))
def test_random_timelines_keep_the_invariant(seed: int):
    """Overlapping calls on three engines, batched calls, failures, reads at random times."""
    rng = random.Random(seed)
    engines = [EngineActivity() for _ in range(3)]
    events: list[tuple[float, int, int, int]] = []  # (time, engine, +n begin / -n end, tokens)
    for _ in range(60):
        start = rng.uniform(0, 100)
        length = rng.expovariate(1 / 5) + 1e-3
        e, n = rng.randrange(3), rng.choice([1, 1, 4])
        tokens = 0 if rng.random() < 0.1 else rng.randrange(1, 500)
        events += [(start, e, n, 0), (start + length, e, -n, tokens)]
    reads = [*sorted(rng.uniform(0, 130) for _ in range(25)), 200.0]
    meter, intervals, generated = IntervalMeter(now=0.0), [], 0
    for t, e, n, tokens in sorted(events, key=lambda ev: (ev[0], ev[2] < 0)):
        while reads and reads[0] < t:
            intervals.append(meter.read(reads.pop(0), engines))
        if n > 0:
            engines[e].begin(t, n)
        else:
            engines[e].end(t, -n, tokens)
            generated += tokens
    intervals += [meter.read(r, engines) for r in reads]
    assert all(e.in_flight == 0 for e in engines)
    _check(intervals, generated)


def test_bad_calls_are_refused():
    activity = EngineActivity()
    with pytest.raises(ValueError, match="in flight"):
        activity.end(1.0)
    activity.begin(0.0)
    with pytest.raises(ValueError, match="tokens"):
        activity.end(1.0, tokens=-1)
    meter = IntervalMeter(now=5.0)
    with pytest.raises(ValueError, match="before the previous read"):
        meter.read(4.0, [activity])
