"""bench_elastic.py's pure parts: which step rows make a throughput window, and the join's timeline (no timing is
asserted: the rows are written here)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_elastic as bench


def rows(times: list[float], samples: int = 8) -> list[dict]:
    return [{"step": i + 1, "time": t, "batch/samples": samples, "rollout/tokens_per_s": 10.0 * (i + 1)} for i, t in
            enumerate(times)]  # fmt: skip


def test_a_window_spans_from_the_step_before_it_to_its_last_step():
    steps = rows([10.0, 12.0, 13.0, 15.0, 19.0])
    after = bench.throughput(steps, after=12.5, count=2)  # steps at 13 and 15; the span starts at 12 (step 2's end)
    assert after == {"steps": 2, "span_s": 3.0, "samples_per_s": 16 / 3.0, "tokens_per_s": 35.0}
    assert bench.throughput(steps, after=19.0, count=3)["steps"] == 0, "no step after the window's start"


def test_the_window_before_the_add_is_the_last_steps_before_it():
    steps = [{"step": 0, "time": 1.0, "val/accuracy": 0.5}, *rows([10.0, 12.0, 13.0, 15.0, 19.0])]
    start = bench._window_start(steps, t_add=16.0, count=2)
    assert start == 12.0, "validation rows are not steps; the window is the steps at 13 and 15"
    assert bench.throughput(steps, after=start, count=2)["span_s"] == 3.0


def test_the_timeline_is_seconds_since_the_add_and_says_what_was_not_seen():
    timeline = bench.join_timeline(100.0, {"healthy": 104.5, "first_token": 107.0}, join_time=106.0)
    assert timeline == {
        "add_to_healthy_s": 4.5,
        "add_to_weights_s": None,
        "add_to_join_event_s": 6.0,
        "add_to_first_token_s": 7.0,
    }
