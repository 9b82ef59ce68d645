"""Live progress of a training run on the console: a rich progress bar on a terminal, plain lines in logs.

On a terminal (`console.is_terminal`) one bar shows steps done, elapsed time, ETA, and the latest reward, held-out
accuracy, staleness, throughput and who waited; `message` prints above the bar. Anywhere else (CI logs, a file, a
pipe) each update is one plain line with the same figures and no ANSI escape codes. The driver calls `update` once
per trainer step with that step's metrics (the names of `metrics.jsonl`).

Before the first step: `phase(text)` prints each start-up phase as it begins, with the time since the progress
display was made (`[0:04] starting 2 embedded engines ...`), so start-up is never silent; `header(spec, run_dir)`
prints once what is about to run (mode, η, K, engines, trainer ranks, steps, batch, run dir).

Throughput and idle shares (gen and train tok/s, trainer and engine idle) are shown over the last `WINDOW_STEPS`
steps, each step weighted by its step time (`timing/step_s`): the same weighting the end-of-run summary uses, over a
moving window, so the shares stop swinging with the queue's step-to-step rhythm. A step's engine figures cover
the interval since the previous batch, and agree in every interval, not only over a window: generated tokens are
counted when each /generate call returns on its engine, on the clock and at the place its busy time is measured
(core/engine_activity.py), so an interval with tokens has busy time and one with "engines idle 100%" has no tokens.
(They used to count when the whole sample finished, which could be an interval after the engine did the work.)

`elapsed` is the run's wall time as `observe/wall_time.py` defines it (from the start of the first trainer step),
the same figure the end-of-run summary and the report print. Held-out accuracy is shown with the step whose weights
it measured (`val 76.6%@400`): validation runs beside training, and the driver hands its result to the first
`update` after it finished (runtime/run/driver.py), where it stays shown until the next one.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, ProgressColumn, Task, TextColumn
from rich.progress import Progress as RichProgress
from rich.text import Text

from rllm.experimental.fully_async.observe.wall_time import STEP_TIME_KEY

if TYPE_CHECKING:  # only its attributes are read: the report and simulate use this module without a run spec
    from rllm.experimental.fully_async.run_spec import RunSpec

# (metric, format) in display order; metrics a step lacks are left out. Held-out accuracy arrives only every
# test_freq steps, so the latest value (and the step it measured, `val/step`) is kept until the next one.
FIELDS: tuple[tuple[str, str], ...] = (
    ("reward/mean", "reward {:.3f}"),
    ("val/accuracy", "val {:.1%}"),
    ("staleness/mean", "stale {:.2f}"),
    ("staleness/max", "max {:.0f}"),
    ("staleness/eta", "η {:.0f}"),  # adaptive staleness: the bound in force (core/adaptive_staleness.py)
    ("rollout/tokens_per_s", "gen {:,.0f} tok/s"),
    ("trainer/tokens_per_s", "train {:,.0f} tok/s"),
    ("trainer/idle_frac", "trainer idle {:.0%}"),
    ("engines/idle_frac", "engines idle {:.0%}"),
)
_STICKY = frozenset({"val/accuracy", "val/step"})
WINDOW_STEPS = 10  # steps the rates and idle shares are averaged over (module docstring)
# Figures shown as their step-time-weighted mean over the window, not the last step's value.
WINDOWED = ("rollout/tokens_per_s", "trainer/tokens_per_s", "trainer/idle_frac", "engines/idle_frac")


def windowed(history: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The WINDOWED figures over `history` (the last steps' metrics, oldest first): each the mean of the steps
    that report it, weighted by their `timing/step_s` (1 where a step lacks it)."""
    out: dict[str, float] = {}
    for key in WINDOWED:
        pairs = [(float(m[key]), float(m.get("timing/step_s") or 1.0)) for m in history if key in m]
        weight = sum(w for _, w in pairs)
        if pairs and weight > 0:
            out[key] = sum(v * w for v, w in pairs) / weight
    return out


def run_header(spec: RunSpec, run_dir: str | Path) -> str:
    """One line saying what is about to run: mode, η, K, estimator, engines, trainer ranks, steps, batch, run dir."""
    s, e, t = spec.schedule, spec.engines, spec.trainer
    synchronous = s.max_staleness == 0 and s.trigger_parameter_sync_step == 1 and s.adaptive is None
    mode = "synchronous (on-policy)" if synchronous else "fully-async"
    eta = f"η={s.max_staleness}" + (f" (adaptive {s.adaptive.min}..{s.adaptive.max})" if s.adaptive else "")
    steps = spec.run.total_training_steps
    steps_text = f"{steps} steps" if steps is not None else "steps until the data runs out"
    engines = f"{e.num_engines} {e.backend} engine{'s' if e.num_engines != 1 else ''}"
    ranks = f"{t.world_size} trainer rank{'s' if t.world_size != 1 else ''} ({t.device})"
    batch = f"{s.required_samples} groups x {spec.executor.samples_per_prompt} samples"
    return (
        f"{mode} {t.advantages.adv_estimator}: {eta}, K={s.trigger_parameter_sync_step}, {engines}, {ranks}; "
        f"{steps_text} of {batch}; run dir {run_dir}  (tok/s and idle: last {WINDOW_STEPS} steps)"
    )


def with_trained_throughput(metrics: Mapping[str, float]) -> dict[str, float]:
    """The metrics plus `trainer/tokens_per_s` = batch/tokens / timing/step_s, unless the trainer reported it."""
    out = dict(metrics)
    tokens, seconds = metrics.get("batch/tokens"), metrics.get("timing/step_s")
    if tokens is not None and seconds:
        out.setdefault("trainer/tokens_per_s", float(tokens) / float(seconds))
    return out


def format_stats(metrics: Mapping[str, float]) -> str:
    parts = []
    for key, fmt in FIELDS:
        if key not in metrics:
            continue
        text = fmt.format(metrics[key])
        if key == "val/accuracy" and "val/step" in metrics:
            text += f"@{metrics['val/step']:.0f}"
        parts.append(text)
    return "  ".join(parts)


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """Progress of `total_steps` trainer steps on `console` (default: a rich Console on stdout).

    `phase(text)` for each start-up phase, `header(spec, run_dir)` once before the first step, `update(step,
    metrics)` after each step, `message(text)` for any other line, `close()` at the end (also on failure: it stops
    the bar's refresh thread and leaves the cursor on a fresh line).
    """

    def __init__(
        self, total_steps: int | None, console: Console | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.total_steps = total_steps
        self.console = console if console is not None else Console()
        self.clock = clock
        self.latest: dict[str, float] = {}
        self._made_at = clock()
        self._history: deque[dict[str, float]] = deque(maxlen=WINDOW_STEPS)
        self._started_at: float | None = None
        self._first_step: int | None = None
        self._last_step = 0
        self._bar: RichProgress | None = None
        if self.console.is_terminal:
            self._bar = RichProgress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(),
                _ClockColumn(self, "elapsed"),
                _ClockColumn(self, "eta"),
                TextColumn("{task.fields[stats]}"),
                console=self.console,
                refresh_per_second=2,  # the elapsed time ticks between steps (a SmolLM2 step takes ~40 s)
            )
            self._task = self._bar.add_task("train", total=total_steps, stats="")
            self._bar.start()

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        now = self.clock()
        if self._started_at is None:
            # The wall time starts when the first step started (observe/wall_time.py), not when it was reported.
            self._started_at, self._first_step = now - float(metrics.get(STEP_TIME_KEY, 0.0)), step - 1
        self._last_step = step
        current = with_trained_throughput(metrics)
        self._history.append(current)
        self.latest = {k: v for k, v in self.latest.items() if k in _STICKY} | current | windowed(self._history)
        stats = format_stats(self.latest)
        if self._bar is not None:
            self._bar.update(self._task, completed=step, stats=stats)
            self._bar.refresh()
            return
        total = self.total_steps if self.total_steps is not None else "?"
        parts = [f"step {step:>4}/{total}", f"elapsed {format_duration(self.elapsed_s(now) or 0.0)}"]
        eta = self.eta_s(step, now)
        if eta is not None:
            parts.append(f"ETA {format_duration(eta)}")
        self._print("  ".join([*parts, stats]) if stats else "  ".join(parts))

    def elapsed_s(self, now: float | None = None) -> float | None:
        """The run's wall time so far (module docstring); None before the first step."""
        if self._started_at is None:
            return None
        return (self.clock() if now is None else now) - self._started_at

    def eta_s(self, step: int, now: float) -> float | None:
        """Seconds left at the mean pace since the first step started; None before two steps or without a total."""
        if self.total_steps is None or self._started_at is None or self._first_step is None:
            return None
        done = step - self._first_step
        if done <= 1:  # the first step alone holds one-off costs (first forward passes): no pace yet
            return None
        return (now - self._started_at) / done * max(0, self.total_steps - step)

    def phase(self, text: str) -> None:
        """A start-up phase begins: one line with the time since this display was made."""
        self._print(f"[{format_duration(self.clock() - self._made_at)}] {text}")

    def header(self, spec: RunSpec, run_dir: str | Path) -> None:
        """What is about to run (`run_header`), once, before the first step; sets the step total from the spec."""
        self.total_steps = spec.run.total_training_steps
        if self._bar is not None:
            self._bar.update(self._task, total=self.total_steps)
        self._print(run_header(spec, run_dir))

    def message(self, text: str) -> None:
        self._print(text)

    def _print(self, text: str) -> None:
        # markup/highlight off: metric text is not rich markup, and highlighting would colour numbers on a terminal
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class _ClockColumn(ProgressColumn):
    """`elapsed M:SS` or `ETA M:SS` from the Progress's own clock, so the bar and the plain lines agree."""

    def __init__(self, progress: Progress, what: str) -> None:
        super().__init__()
        self.progress, self.what = progress, what

    def render(self, task: Task) -> Text:
        now = self.progress.clock()
        if self.what == "elapsed":
            value = self.progress.elapsed_s(now)
            return Text(f"elapsed {format_duration(value)}" if value is not None else "elapsed -:--")
        eta = self.progress.eta_s(self.progress._last_step, now)
        return Text(f"ETA {format_duration(eta)}" if eta is not None else "ETA -:--")


class StatusPrinter:
    """Lines saying what a long computation is doing (`simulate --from`'s fit, the report's prediction), on a
    stream, usually stderr: on a terminal each line replaces the previous one; elsewhere (a log, a pipe) a line is
    printed at most every `every_s` seconds, with the time so far, so a log shows progress without a flood."""

    def __init__(self, stream: TextIO, every_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.stream, self.every_s, self.clock = stream, every_s, clock
        self.started = clock()
        self._last_printed: float | None = None
        self._width = 0
        self.terminal = bool(getattr(stream, "isatty", lambda: False)())

    def __call__(self, line: str) -> None:
        now = self.clock()
        text = f"[{format_duration(now - self.started)}] {line}"
        if self.terminal:
            self.stream.write("\r" + text.ljust(self._width))
            self._width = len(text)
        elif self._last_printed is None or now - self._last_printed >= self.every_s:
            self.stream.write(text + "\n")
            self._last_printed = now
        else:
            return
        self.stream.flush()

    def close(self) -> None:
        """End the status line (a terminal's cursor back on a fresh line)."""
        if self.terminal and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()


def status_printer(stream: TextIO) -> StatusPrinter:
    return StatusPrinter(stream)
