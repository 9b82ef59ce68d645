"""Fit the timing models to a finished run's metrics.jsonl rows, then predict its wall time.

Pure: takes the parsed step rows (the CLI reads the file). What each model is fitted from:
- weight sync: `sync/total_s` and `sync/pause_s`, means over the steps that synced (means, not medians: the wall
  time is a sum, and on a busy machine these times are heavy-tailed);
- trainer: per step, work = interval − `timing/wait_batch_s` − `sync/total_s`, where the interval is the time
  between this step's log line and the previous one (`time`; `timing/step_s` when there is no `time`), so the
  driver's own time between steps (metrics, progress, checkpoints) counts as trainer work, as it delays the next
  batch request the same way; regressed on `batch/tokens` by least squares (work = fixed_s + per_token_s · tokens);
  when the token counts hardly vary (or the slope comes out negative) the slope is not identifiable and the fit is
  per_token_s = Σ work / Σ tokens, fixed_s = 0;
- response lengths: mean = mean of `response_length/mean`; max = the run's data.max_response_length; the log-space
  sigma is not in the metrics and stays as configured (simulate.lengths.sigma);
- generation throughput is not logged: it is inferred from the trainer's waits. The engines' peak tokens/s is the
  value at which the simulated trainer, fed by simulated engines, waits as long in total (steps 2..N) as the real
  one did. The simulated wait is decreasing in the peak, so the root is bracketed (from a starting guess, stepping
  out by 4x) and closed by regula falsi with the Illinois modification, interpolating in 1/peak (the wait is about
  linear in it while generation bounds the run), each point at least half the tolerance inside the bracket,
  until the bracket on log(peak) is narrower than the tolerance (0.3%): 3-6 simulations where a bisection of the
  whole range took 16. Step 1 is left out of the fit because it also holds one-off start-up costs
  (first forward passes, caches); its excess over the simulated step-1 wait is added to predictions as
  `startup_s`. A run where the trainer hardly ever waited (trainer-bound) only bounds the throughput from below;
  the fit then returns the smallest peak that reproduces the small wait.
- host sharing (`host.cores` set: a CPU run, engines and trainer on the same cores): the measured trainer work and
  waits are contended, the models must be uncontended (so that a prediction for the other mode, with another
  overlap, slows them by its own sharing). Fixed point over rounds (at most `SHARED_ITERATIONS`): the trainer's
  times are the measured ones times a factor κ; the peak is fitted as above with the simulator's sharing on; then
  κ ← κ · (measured mean trainer work per step) / (simulated busy time per step), steps 2..N, so the simulated
  trainer, slowed where it overlaps the engines, takes as long as the measured one did. When the run logged
  `timing/compute_cpu_s` (the trainer's CPU seconds over its compute) and `host.background` is null, the share
  of a core the trainer got, s = Σ compute_cpu_s / Σ compute wall, also fits the other jobs' load: the background
  moves by cores/s − cores/s_sim each round (s_sim: the simulated trainer's mean speed, work / busy), so the
  simulated trainer is slowed as much as the measured one was; κ's update then also carries the speed that move
  will give (s_new / s_sim, s_new = cores / (cores/s_sim + Δbackground)), else the two updates overshoot each
  other. κ starts at s (or 1), the background at what makes a trainer beside every engine run at s. A synchronous
  run's trainer trains alone, so its share only shows a background above cores − trainer_demand (below that it
  reads 100% and the background fits as 0); an async run's trainer overlaps the engines and shows it all.
  Each round's peak search starts from the previous round's peak and the slope it measured there (a Newton step,
  overshot by a quarter so it brackets the root), and is only as tight as the last round's movement asks (2%
  while κ or the background still move by 5% or more); the fit stops when a round at full tolerance would move κ
  and the background (in cores) by less than `FIT_TOLERANCE`. On the default 500-step run: 3 rounds, 14
  simulations, where 6 rounds of 16 took 97, and the predictions within 0.2% (tests/bench/bench_report_fit.py).
- simulations are memoised by their config (`Simulations`): the fit's last trial is the fitted run itself, and the
  caller's own-mode prediction is the same simulation again.
"""

from __future__ import annotations

import copy
import itertools
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rllm.experimental.fully_async.errors import EXIT_BAD_INPUT, FullyAsyncError
from rllm.experimental.fully_async.observe.wall_time import training_wall_s
from rllm.experimental.fully_async.simulate.engine import simulate
from rllm.experimental.fully_async.simulate.model import SimConfig
from rllm.experimental.fully_async.simulate.result import SimResult

SHARED_ITERATIONS = 8  # host sharing: at most this many rounds of the fixed point
FIT_TOLERANCE = 5e-3  # a round moving κ and the background (per core) less than this ends the fit (predictions: <0.1%)
PEAK_TOLERANCE = 3e-3  # width of the final bracket on log(peak): the fitted peak is within 0.3%
COARSE_PEAK_TOLERANCE = 0.02  # the first round's bracket (κ and the background are still guesses then)
Progress = Callable[[str], None]  # gets one line per simulation of the fit (a long run's fit takes a while)
COMPUTE_COLUMNS = ("timing/assemble_s", "timing/advantages_s", "timing/update_s", "timing/bookkeeping_s")


class Simulations:
    """`simulate` with a memo keyed by the whole config (a dataclass repr is exact: floats round-trip), counting
    the simulations it ran. A fit asks for some configs twice (its last trial is the fitted run itself; the
    caller's own-mode row is that run again); the results are shared, so callers must not change them."""

    def __init__(self) -> None:
        self._memo: dict[str, SimResult] = {}
        self.count = 0

    def __call__(self, cfg: SimConfig) -> SimResult:
        key = repr(cfg)
        if key not in self._memo:
            self._memo[key] = simulate(cfg)
            self.count += 1
        return self._memo[key]


class CalibrationError(FullyAsyncError, ValueError):
    """The metrics cannot support a fit (too few steps, missing columns)."""

    exit_code = EXIT_BAD_INPUT


@dataclass(frozen=True)
class RunFigures:
    """What was measured in the run."""

    steps: int
    wall_s: float  # first step's start to the last step's end (observe/wall_time.py)
    wait_s: float  # total trainer wait, steps 2..N
    first_wait_s: float
    idle_frac: float  # total wait / wall


@dataclass(frozen=True)
class Fit:
    cfg: SimConfig
    measured: RunFigures
    startup_s: float  # measured step-1 wait beyond the simulated one
    cpu_share: float | None = None  # the trainer's measured CPU share over its compute (host sharing), if logged
    simulated_share: float | None = None  # the fitted simulation's trainer mean speed (work / busy)
    result: SimResult | None = None  # the simulation of `cfg` (the fitted run itself)


def step_rows(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in records if "trainer/step" in r and "timing/step_s" in r]


def measure(rows: Sequence[Mapping[str, Any]]) -> RunFigures:
    if len(rows) < 3:
        raise CalibrationError(f"metrics.jsonl has {len(rows)} training steps; at least 3 are needed to fit")
    wall = training_wall_s(rows)  # the report's and the summary's definition (observe/wall_time.py)
    if wall is None:  # records without `time` (hand-written or old): the steps' own durations
        wall = sum(float(r["timing/step_s"]) for r in rows)
    waits = [float(r.get("timing/wait_batch_s", 0.0)) for r in rows]
    return RunFigures(len(rows), wall, sum(waits[1:]), waits[0], sum(waits) / wall if wall > 0 else 0.0)


def fit_trainer_sync_lengths(base: SimConfig, rows: Sequence[Mapping[str, Any]]) -> SimConfig:
    """The models measured directly (see the module docstring), on a copy of `base`."""
    cfg = copy.deepcopy(base)
    synced = [r for r in rows if "sync/total_s" in r]
    if synced:
        cfg.sync.total_s = statistics.fmean(float(r["sync/total_s"]) for r in synced)
        cfg.sync.pause_s = min(cfg.sync.total_s, statistics.fmean(float(r.get("sync/pause_s", 0.0)) for r in synced))
    tokens = [float(r["batch/tokens"]) for r in rows]
    work = trainer_work(rows)
    cfg.trainer.fixed_s, cfg.trainer.per_token_s = _linear_fit(tokens[1:], work[1:])
    cfg.trainer.reference_gpus = cfg.trainer_gpus or 1  # measured at the run's own trainer GPUs (or CPU ranks)
    lengths = [float(r["response_length/mean"]) for r in rows if "response_length/mean" in r]
    if lengths:
        cfg.lengths.mean_tokens = max(1.0, statistics.fmean(lengths))
    cfg.steps = len(rows)
    return cfg


def trainer_work(rows: Sequence[Mapping[str, Any]]) -> list[float]:
    """Per step: the interval between log lines minus the wait and the sync (see the module docstring)."""
    missing = [k for k in ("batch/tokens", "timing/wait_batch_s") if k not in rows[-1]]
    if missing:
        raise CalibrationError(f"metrics.jsonl lacks the column {missing[0]!r} needed to fit the trainer")
    intervals = [float(r["timing/step_s"]) for r in rows]
    if all("time" in r for r in rows):
        intervals[1:] = [float(b["time"]) - float(a["time"]) for a, b in itertools.pairwise(rows)]
    return [
        max(interval - float(r["timing/wait_batch_s"]) - float(r.get("sync/total_s", 0.0)), 0.0)
        for interval, r in zip(intervals, rows, strict=True)
    ]


def cpu_share(rows: Sequence[Mapping[str, Any]]) -> float | None:
    """Σ timing/compute_cpu_s / Σ compute wall over steps 2..N (capped at 1: one torch thread), or None."""
    later = [r for r in rows[1:] if "timing/compute_cpu_s" in r]
    wall = sum(float(r.get(k, 0.0)) for r in later for k in COMPUTE_COLUMNS)
    cpu = sum(float(r["timing/compute_cpu_s"]) for r in later)
    if not later or wall <= 0 or cpu <= 0:
        return None
    return min(1.0, cpu / wall)


def _linear_fit(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of y on x, falling back to a pure slope through 0 when x hardly varies."""
    mean_x, mean_y = statistics.fmean(x), statistics.fmean(y)
    var_x = statistics.pvariance(x)
    if mean_x > 0 and math.sqrt(var_x) / mean_x > 0.05:
        slope = sum((a - mean_x) * (b - mean_y) for a, b in zip(x, y, strict=True)) / (var_x * len(x))
        intercept = mean_y - slope * mean_x
        if slope > 0 and intercept >= 0:
            return intercept, slope
    return 0.0, sum(y) / max(sum(x), 1e-12)


@dataclass(frozen=True)
class GenerationFit:
    """A fitted engine peak: the config, its simulation, and d(wait)/d(log peak) there (negative), which the next
    round's search starts from."""

    cfg: SimConfig
    result: SimResult
    slope: float | None


def _with_peak(cfg: SimConfig, log_peak: float, ratio: float) -> SimConfig:
    trial = copy.deepcopy(cfg)
    trial.engine.peak_tokens_per_s = math.exp(log_peak)
    trial.engine.single_tokens_per_s = trial.engine.peak_tokens_per_s / ratio  # the curve's shape is kept
    return trial


def fit_generation(
    cfg: SimConfig,
    target_wait_s: float,
    *,
    start: float | None = None,
    slope: float | None = None,
    tolerance: float = PEAK_TOLERANCE,
    bracket: tuple[float, float] = (1e-2, 1e10),
    sims: Simulations | None = None,
    progress: Progress | None = None,
) -> GenerationFit:
    """Set engine.peak_tokens_per_s (tokens/s per engine, within `bracket`) so the simulated trainer waits
    `target_wait_s` over steps 2..N, to `tolerance` in log(peak). The search starts at `start` (default: the
    config's peak); `slope` (d wait / d log peak from an earlier fit) sizes its first step, else a factor of 4."""
    sims = sims if sims is not None else Simulations()
    ratio = cfg.engine.peak_tokens_per_s / cfg.engine.single_tokens_per_s
    floor, ceiling = math.log(bracket[0]), math.log(bracket[1])
    tried: dict[float, tuple[float, SimResult]] = {}

    def excess(x: float) -> float:
        """Simulated wait minus the target at log peak x: decreasing in x."""
        if progress is not None:
            progress(f"engine throughput: simulation {len(tried) + 1} (trying {math.exp(x):,.0f} tokens/s)")
        result = sims(_with_peak(cfg, x, ratio))
        tried[x] = (sum(result.step_wait_s[1:]) - target_wait_s, result)
        return tried[x][0]

    x0 = min(max(math.log(start or cfg.engine.peak_tokens_per_s), floor), ceiling)
    g0 = excess(x0)
    step = abs(g0 / slope) * 1.25 + tolerance if slope else math.log(4.0)
    lo, hi = _bracket(excess, x0, g0, step, floor, ceiling)
    if lo is None or hi is None:  # the target is out of reach: the bracket's end
        x = ceiling if lo is not None else floor
        return GenerationFit(_with_peak(cfg, x, ratio), tried[x][1], None)
    hi = _illinois(excess, lo, hi, tried[lo][0], tried[hi][0], tolerance)
    lo = max(x for x in tried if x < hi and tried[x][0] > 0)
    measured_slope = (tried[hi][0] - tried[lo][0]) / (hi - lo)
    return GenerationFit(_with_peak(cfg, hi, ratio), tried[hi][1], measured_slope if measured_slope < 0 else None)


def _bracket(
    excess: Callable[[float], float], x0: float, g0: float, step: float, floor: float, ceiling: float
) -> tuple[float | None, float | None]:
    """(lo, hi) with excess(lo) > 0 >= excess(hi), stepping out from x0 by `step`, 4 times further each time; None
    on the side that reached the bracket's end without a sign change."""
    up = g0 > 0  # engines too slow at x0: the root is above
    inner, x = x0, x0
    while True:
        x = min(x + step, ceiling) if up else max(x - step, floor)
        if x == inner:
            return (x, None) if up else (None, x)
        g = excess(x)
        if (g <= 0) == up:
            return (inner, x) if up else (x, inner)
        inner, step = x, step * 4


def _illinois(
    excess: Callable[[float], float], lo: float, hi: float, g_lo: float, g_hi: float, tolerance: float
) -> float:
    """Narrow [lo, hi] (excess(lo) > 0 >= excess(hi)) below `tolerance` and return hi, the smallest x found whose
    excess is <= 0. Regula falsi with the Illinois rule (the end kept twice in a row has its value halved), each
    point at least tolerance/2 inside the bracket, so a point next to the root closes the bracket on the next.
    The interpolation is in u = 1/peak = exp(-x): while generation bounds the run the wait is about linear in it
    (each batch waits its generation time, ∝ 1/peak, less the training it overlaps)."""
    kept = 0  # +1: lo was kept last time, -1: hi was
    while hi - lo > tolerance:
        u_lo, u_hi = math.exp(-lo), math.exp(-hi)
        u = u_hi + g_hi * (u_hi - u_lo) / (g_lo - g_hi) if g_hi != g_lo else math.exp(-(lo + hi) / 2)
        x = min(max(-math.log(u), lo + tolerance / 2), hi - tolerance / 2)
        g = excess(x)
        if g > 0:
            lo, g_lo = x, g
            if kept == -1:
                g_hi /= 2
            kept = -1
        else:
            hi, g_hi = x, g
            if kept == 1:
                g_lo /= 2
            kept = 1
    return hi


@dataclass(frozen=True)
class _Round:
    """One round of the host-sharing fixed point: the factors it tried and what its fitted simulation says."""

    kappa: float
    background: float
    fit: GenerationFit


def fit_shared(
    raw: SimConfig,
    rows: Sequence[Mapping[str, Any]],
    wait_s: float,
    *,
    sims: Simulations | None = None,
    progress: Progress | None = None,
) -> tuple[GenerationFit, float | None]:
    """Host sharing: the uncontended trainer and engines (and the background, when fitted); see the docstring."""
    cores = raw.host.cores
    assert cores is not None
    sims = sims if sims is not None else Simulations()
    target = statistics.fmean(trainer_work(rows)[1:])
    share = cpu_share(rows)
    fit_background = share is not None and raw.host.background is None
    kappa = share or 1.0
    if fit_background and share:  # a trainer beside every engine at speed `share`: cores/share = demand
        busy_demand = raw.host.trainer_demand + raw.host.engine_demand * raw.pipeline.num_engines
        background = max(0.0, cores / share - busy_demand)
    else:
        background = raw.host.background or 0.0
    tolerance, previous = COARSE_PEAK_TOLERANCE, None
    for round_ in range(SHARED_ITERATIONS):
        trial = copy.deepcopy(raw)
        trial.trainer.fixed_s *= kappa
        trial.trainer.per_token_s *= kappa
        trial.host.background = background
        stage = None
        if progress is not None:
            prefix = f"host sharing round {round_ + 1} (at most {SHARED_ITERATIONS}): "
            stage = lambda line, prefix=prefix: progress(prefix + line)  # noqa: E731
        start = previous.fit.cfg.engine.peak_tokens_per_s if previous else _peak_guess(raw, rows)
        slope = previous.fit.slope if previous else None
        fit = fit_generation(trial, wait_s, start=start, slope=slope, tolerance=tolerance, sims=sims, progress=stage)
        result = fit.result
        busy = statistics.fmean(result.step_busy_s[1:])  # steps 2..N, as the target
        moved_kappa = abs(target / busy - 1) if busy > 0 else 0.0
        new_kappa, new_background = kappa * (target / busy if busy > 0 else 1.0), background
        if fit_background and share and result.trainer_busy_s > 0:
            simulated = result.trainer_work_s / result.trainer_busy_s
            new_background = max(0.0, background + cores / share - cores / simulated)
            # the speed the background's move will give the trainer, so κ does not also make up for it
            new_kappa *= cores / (cores / simulated + new_background - background) / simulated
            moved_kappa = abs(new_kappa / kappa - 1)
        moved = max(moved_kappa, abs(new_background - background) / cores)  # the inputs; the peak follows them
        previous = _Round(kappa, background, fit)
        if moved < FIT_TOLERANCE and tolerance <= PEAK_TOLERANCE:
            break
        kappa, background = new_kappa, new_background
        # near the fixed point a round moves about the square of the last one's: go to full tolerance there
        tolerance = PEAK_TOLERANCE if moved < 10 * FIT_TOLERANCE else min(COARSE_PEAK_TOLERANCE, moved / 4)
    assert previous is not None
    return previous.fit, share


def _peak_guess(cfg: SimConfig, rows: Sequence[Mapping[str, Any]]) -> float:
    """Where the peak search starts: a few times the tokens/s per engine the run trained (the engines generated
    at least that, below their saturated rate)."""
    wall = training_wall_s(rows) or sum(float(r["timing/step_s"]) for r in rows)
    tokens = sum(float(r["batch/tokens"]) for r in rows)
    per_engine = tokens / max(wall, 1e-9) / cfg.pipeline.num_engines
    return per_engine * 4 if per_engine > 0 else cfg.engine.peak_tokens_per_s


def calibrate(
    base: SimConfig,
    records: Sequence[Mapping[str, Any]],
    progress: Progress | None = None,
    sims: Simulations | None = None,
) -> Fit:
    """Fit every model to the run (base carries the run's pipeline) and return the fitted config. `progress` gets
    a line before each simulation the fit runs; `sims` memoises them (pass the caller's to share the memo)."""
    sims = sims if sims is not None else Simulations()
    rows = step_rows(records)
    measured = measure(rows)
    raw = fit_trainer_sync_lengths(base, rows)
    share = None
    if raw.host.cores is None:
        fit = fit_generation(raw, measured.wait_s, start=_peak_guess(raw, rows), sims=sims, progress=progress)
    else:
        fit, share = fit_shared(raw, rows, measured.wait_s, sims=sims, progress=progress)
    cfg, result = fit.cfg, fit.result
    simulated_share = result.trainer_work_s / result.trainer_busy_s if result.trainer_busy_s > 0 else None
    startup = max(0.0, measured.first_wait_s - result.step_wait_s[0])
    return Fit(cfg, measured, startup, share, simulated_share if cfg.host.cores is not None else None, result)
