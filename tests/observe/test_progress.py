"""Live progress: plain lines without escape codes off a terminal, a rich bar with ETA and figures on one."""

from __future__ import annotations

import io
import re

from rich.console import Console

from rllm.experimental.fully_async.observe.progress import Progress, format_duration

STEP = {
    "reward/mean": 0.25,
    "staleness/mean": 0.5,
    "staleness/max": 1.0,
    "rollout/tokens_per_s": 12000.0,
    "batch/tokens": 2000.0,
    "timing/step_s": 0.5,
    "trainer/idle_frac": 0.1,
}


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _plain() -> tuple[Progress, io.StringIO, FakeClock]:
    out, clock = io.StringIO(), FakeClock()
    console = Console(file=out, force_terminal=False, width=200)
    return Progress(10, console, clock=clock), out, clock


def test_plain_mode_prints_one_line_per_step_with_eta_and_figures():
    progress, out, clock = _plain()
    progress.update(1, {**STEP, "val/accuracy": 0.434, "val/step": 0.0, "engines/idle_frac": 0.4})
    clock.now += 4.0
    progress.update(3, STEP)
    progress.message("checkpoint saved")
    progress.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    # elapsed counts from the first step's start (its timing/step_s before the first update), as the summary does
    assert lines[0].startswith("step    1/10  elapsed 0:00  reward 0.250  val 43.4%@0  stale 0.50  max 1")
    assert "trainer idle 10%  engines idle 40%" in lines[0]
    assert "ETA" not in lines[0]  # no pace yet
    # 3 steps in 4.5 s, 7 to go: 10.5 s. Held-out accuracy stays shown, with its step, until the next validation.
    assert lines[1].startswith("step    3/10  elapsed 0:04  ETA 0:10  reward 0.250  val 43.4%@0")
    assert "gen 12,000 tok/s  train 4,000 tok/s  trainer idle 10%" in lines[1]
    assert lines[2] == "checkpoint saved"
    assert "\x1b" not in out.getvalue()


def test_validation_is_shown_with_the_step_it_measured_not_the_step_it_arrived_at():
    progress, out, _ = _plain()
    progress.update(300, STEP)
    progress.update(500, {**STEP, "val/accuracy": 0.766, "val/step": 400.0})
    progress.update(501, STEP)
    lines = out.getvalue().splitlines()
    assert "val" not in lines[0]
    assert "val 76.6%@400" in lines[1] and "val 76.6%@400" in lines[2]


def test_elapsed_is_the_wall_time_the_summary_and_report_use():
    from rllm.experimental.fully_async.observe.wall_time import training_wall_s

    progress, _, clock = _plain()
    records = []
    for step in (1, 2, 3):
        clock.now += 2.0
        metrics = {"trainer/step": float(step), "timing/step_s": 1.5, "time": clock.now}
        progress.update(step, metrics)
        records.append(metrics)
    assert progress.elapsed_s() == training_wall_s(records) == 2.0 * 3 - 0.5


def test_adaptive_staleness_shows_the_eta_in_force():
    progress, out, _ = _plain()
    progress.update(1, {**STEP, "staleness/eta": 4.0})
    progress.update(2, {**STEP, "staleness/eta": 3.0})
    lines = out.getvalue().splitlines()
    assert "stale 0.50  max 1  η 4  gen" in lines[0] and "max 1  η 3" in lines[1]


def test_plain_mode_drops_figures_a_step_did_not_report():
    progress, out, _ = _plain()
    progress.update(1, {"reward/mean": 0.5, "staleness/mean": 1.0})
    progress.update(2, {"reward/mean": 0.4})
    assert "stale" not in out.getvalue().splitlines()[1]
    assert "tok/s" not in out.getvalue()


def test_plain_mode_without_a_total_shows_no_eta():
    out = io.StringIO()
    progress = Progress(None, Console(file=out, force_terminal=False), clock=FakeClock())
    progress.update(1, STEP)
    progress.update(2, STEP)
    assert out.getvalue().splitlines()[1].startswith("step    2/?  elapsed 0:00  reward")
    assert "ETA" not in out.getvalue()


def test_terminal_mode_draws_a_bar_with_eta_and_figures_and_messages_above_it():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160, color_system="standard")
    progress = Progress(10, console)
    progress.update(1, {**STEP, "val/accuracy": 0.5})
    progress.message("validation at version 1")
    progress.update(5, STEP)
    progress.close()
    raw = out.getvalue()
    assert "\x1b[" in raw  # a live display: cursor control and colour
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw)
    assert "validation at version 1" in text
    final = text.rstrip().splitlines()[-1]
    assert "5/10" in final and "ETA" in final and "━" in final
    assert "reward 0.250  val 50.0%  stale 0.50  max 1  gen 12,000 tok/s  train 4,000 tok/s" in final
    assert "elapsed 0:" in final and "trainer idle 10%" in final
    assert progress._bar is None


def test_duration_format():
    assert format_duration(0) == "0:00"
    assert format_duration(75.4) == "1:15"
    assert format_duration(3725) == "1:02:05"


def test_the_header_says_what_is_about_to_run_and_sets_the_total():
    from rllm.experimental.fully_async.run_spec import build_run_spec
    from rllm.experimental.fully_async.settings.loader import load_config

    out = io.StringIO()
    progress = Progress(None, Console(file=out, force_terminal=False, width=300), clock=FakeClock())
    spec = build_run_spec(load_config(None, ["trainer.total_training_steps=40", "async_training.max_staleness=2"]))
    progress.header(spec, "runs/x")
    sync = build_run_spec(load_config(None, ["async_training.max_staleness=0", "engines.num_engines=1"]))
    progress.header(sync, "runs/y")
    progress.update(1, STEP)
    first, second, step = out.getvalue().splitlines()
    assert first == (
        "fully-async grpo: η=2, K=1, 2 embedded engines, 1 trainer rank (cpu); 40 steps of 64 groups x 8 samples; "
        "run dir runs/x  (tok/s and idle: last 10 steps)"
    )
    assert second.startswith("synchronous (on-policy) grpo: η=0, K=1, 1 embedded engine, ") and "500 steps" in second
    assert step.startswith("step    1/500  ")  # the total comes from the (last) header's spec


def test_start_up_phases_are_lines_with_the_time_since_the_display_was_made():
    progress, out, clock = _plain()
    progress.phase("starting Ray")
    clock.now += 12.4
    progress.phase("starting 2 embedded engines (each loads the model)")
    assert out.getvalue().splitlines() == [
        "[0:00] starting Ray",
        "[0:12] starting 2 embedded engines (each loads the model)",
    ]


def test_rates_and_idle_shares_are_step_time_weighted_over_the_last_steps():
    from rllm.experimental.fully_async.observe.progress import WINDOW_STEPS

    progress, out, _ = _plain()
    # An interval credited with tokens that finished in it while its requests ran in the interval before (idle 100%
    # beside 1,000 tok/s, as step 2 of the report fixture logged it before it was recorded again on 2026-12-08): the
    # window keeps the two together.
    busy = {"timing/step_s": 3.0, "rollout/tokens_per_s": 600.0, "engines/idle_frac": 0.0, "trainer/idle_frac": 0.7}
    credited = {
        "timing/step_s": 1.0,
        "rollout/tokens_per_s": 1000.0,
        "engines/idle_frac": 1.0,
        "trainer/idle_frac": 0.1,
    }
    progress.update(1, busy)
    progress.update(2, credited)
    line = out.getvalue().splitlines()[1]
    # (600 x 3 + 1000 x 1) / 4 = 700 tok/s; idle (0 x 3 + 1 x 1) / 4 = 25%; trainer (0.7 x 3 + 0.1) / 4 = 55%
    assert "gen 700 tok/s  trainer idle 55%  engines idle 25%" in line, line
    steady = {"timing/step_s": 1.0, "rollout/tokens_per_s": 2000.0, "engines/idle_frac": 0.3, "trainer/idle_frac": 0.2}
    for step in range(3, 3 + WINDOW_STEPS):
        progress.update(step, steady)
    # the first two steps have left the window
    assert "gen 2,000 tok/s  trainer idle 20%  engines idle 30%" in out.getvalue().splitlines()[-1]
