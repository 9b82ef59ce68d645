"""A run's `metrics.jsonl`, config and dumps as report data, and what the report derives from them (no files, no
plotting).

`parse_metrics` turns the lines of one `RUN_DIR/metrics.jsonl` into records (one dict per step: `step`, `time`,
and every metric the run logged that step); `report.py` is the one place that reads the files. The functions here
derive what the report shows: series against step or wall time (and their smoothed form), trained tokens per
second, the staleness distribution per step range, validation and sync moments, the run's mode from its saved
config (`RunInfo`), sample generations from a trajectory dump, the summary (`observe/summary.py`, which the
end-of-run summary shares) and the engine set's changes (`parse_engine_events`, `engine_marks`: the lines of
`RUN_DIR/engine_events.jsonl`, which a run writes when engines join, leave, are lost, restart or hand samples on). A
metric a run did not record gives an empty series, never an error, so old runs and runs of other configurations
still draw; a run without engine events draws as before.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rllm.experimental.fully_async.errors import EXIT_BAD_INPUT, FullyAsyncError
from rllm.experimental.fully_async.observe.summary import LEDGER_PREFIX, RunTotals, fold

logger = logging.getLogger(__name__)

STALENESS_HIST_PREFIX = "staleness/hist/"


class ReportDataError(FullyAsyncError, ValueError):
    """A metrics file that cannot be read as a run's records (names the file and the line)."""

    exit_code = EXIT_BAD_INPUT


@dataclass(frozen=True)
class RunRecords:
    """One run's per-step records, in file order, labelled for legends (usually the run directory)."""

    label: str
    records: tuple[dict[str, Any], ...]
    columns: frozenset[str] = field(default=frozenset())

    @classmethod
    def of(cls, label: str, records: Iterable[dict[str, Any]]) -> RunRecords:
        rows = tuple(records)
        return cls(label=label, records=rows, columns=frozenset(k for r in rows for k in r))

    def has(self, key: str) -> bool:
        return key in self.columns

    def series(self, key: str, x: str = "step") -> tuple[list[float], list[float]]:
        """(x values, key values) over the records holding both; x is `step` or `wall` (seconds since start)."""
        start = self.start_time()
        xs: list[float] = []
        ys: list[float] = []
        for r in self.records:
            value, at = r.get(key), _x_of(r, x, start)
            if not _is_number(value) or at is None:
                continue
            xs.append(at)
            ys.append(float(value))
        return xs, ys

    def start_time(self) -> float | None:
        """Wall time 0: the first trainer step's start (observe/wall_time.py), else the first record's time."""
        for r in self.records:
            if _is_number(r.get("trainer/step")) and _is_number(r.get("time")) and _is_number(r.get("timing/step_s")):
                return float(r["time"]) - float(r["timing/step_s"])
        times = [float(r["time"]) for r in self.records if _is_number(r.get("time"))]
        return min(times) if times else None

    def last(self, key: str) -> float | None:
        for r in reversed(self.records):
            if _is_number(r.get(key)):
                return float(r[key])
        return None

    def first(self, key: str) -> float | None:
        for r in self.records:
            if _is_number(r.get(key)):
                return float(r[key])
        return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_metrics(lines: Iterable[str], source: str) -> list[dict[str, Any]]:
    """Records from the lines of a metrics.jsonl. Blank lines are skipped; a cut-off LAST line (a run killed while
    writing) is skipped with a warning; any other line that is not a JSON object raises ReportDataError."""
    return _json_lines(lines, source)


def _json_lines(lines: Iterable[str], source: str) -> list[dict[str, Any]]:
    """One JSON object per line (parse_metrics' rules: blank lines skipped, a cut-off last line skipped)."""
    records: list[dict[str, Any]] = []
    pending_error: str | None = None
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line:
            continue
        if pending_error is not None:
            raise ReportDataError(pending_error)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            pending_error = f"{source}:{number}: not JSON ({exc.msg})"
            continue
        if not isinstance(record, dict):
            raise ReportDataError(f"{source}:{number}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    if pending_error is not None:
        logger.warning("%s (last line, skipped: the run was probably stopped while writing it)", pending_error)
    return records


def _x_of(record: dict[str, Any], x: str, start: float | None) -> float | None:
    """A record's x coordinate: its step, or with x="wall" its seconds since `start`; None when it has none."""
    if x == "wall":
        return float(record["time"]) - start if start is not None and _is_number(record.get("time")) else None
    return float(record["step"]) if _is_number(record.get("step")) else None


def trained_tokens_per_s(run: RunRecords, x: str = "step") -> tuple[list[float], list[float]]:
    """Tokens trained per second of trainer step: `batch/tokens / timing/step_s`, per step."""
    start = run.start_time()
    xs: list[float] = []
    ys: list[float] = []
    for r in run.records:
        tokens, seconds, at = r.get("batch/tokens"), r.get("timing/step_s"), _x_of(r, x, start)
        if not (_is_number(tokens) and _is_number(seconds) and seconds > 0) or at is None:
            continue
        xs.append(at)
        ys.append(float(tokens) / float(seconds))
    return xs, ys


@dataclass(frozen=True)
class StalenessBucket:
    """Trained samples by staleness (policy versions behind, see core/staleness.py) over steps [first, last]."""

    first_step: int
    last_step: int
    counts: dict[int, float]

    @property
    def label(self) -> str:
        return f"steps {self.first_step}-{self.last_step}"


def staleness_histograms(run: RunRecords, ranges: int = 4) -> list[StalenessBucket]:
    """The staleness distribution per step range, from `staleness/hist/<k>` counts summed over each range.
    Empty when the run did not record histograms (then draw `staleness/mean` and `staleness/max` instead)."""
    rows = [r for r in run.records if any(k.startswith(STALENESS_HIST_PREFIX) for k in r) and _is_number(r.get("step"))]
    if not rows:
        return []
    # `ranges` near-equal consecutive slices (fewer when there are fewer steps than ranges).
    bounds = sorted({round(i * len(rows) / ranges) for i in range(ranges + 1)})
    buckets = []
    for start, stop in itertools.pairwise(bounds):
        chunk = rows[start:stop]
        counts: dict[int, float] = {}
        for r in chunk:
            for key, value in r.items():
                if key.startswith(STALENESS_HIST_PREFIX) and _is_number(value):
                    k = int(key[len(STALENESS_HIST_PREFIX) :])
                    counts[k] = counts.get(k, 0.0) + float(value)
        buckets.append(StalenessBucket(int(chunk[0]["step"]), int(chunk[-1]["step"]), counts))
    return buckets


def ledger_drops(run: RunRecords) -> dict[str, float]:
    """Samples not trained, by reason, at the last record: `filtered/<reason>`, `failed/<reason>`, `dropped_stale`.
    A state with no per-reason column counts under its own name."""
    drops: dict[str, float] = {}
    for state in ("filtered", "failed"):
        prefix = f"{LEDGER_PREFIX}{state}/"
        reasons = sorted(k for k in run.columns if k.startswith(prefix))
        if reasons:
            for key in reasons:
                value = run.last(key)
                if value:
                    drops[key[len(LEDGER_PREFIX) :]] = value
        elif value := run.last(LEDGER_PREFIX + state):
            drops[state] = value
    if stale := run.last(LEDGER_PREFIX + "dropped_stale"):
        drops["dropped_stale"] = stale
    return drops


def smooth(values: list[float], points: int | None = None) -> list[float]:
    """An exponential moving average, debiased at the start (as TensorBoard's smoothing): the weight of the newest
    value is 1 / span with span = `points` (default: a fiftieth of the series, at least 1, so 500 steps smooth
    over ~10)."""
    span = max(1, points if points is not None else len(values) // 50)
    alpha = 1.0 / span
    out: list[float] = []
    average, weight = 0.0, 0.0
    for value in values:
        average = (1 - alpha) * average + alpha * value
        weight = (1 - alpha) * weight + alpha
        out.append(average / weight)
    return out


def validation_points(run: RunRecords) -> list[tuple[int, float]]:
    """(step measured, held-out accuracy) in step order (observe/summary.py: the step is `val/step` when logged)."""
    return sorted(fold(run.records).validations)


def step_times(run: RunRecords) -> dict[int, float]:
    """Trainer step -> seconds since the run's first record, at which the step's record was logged."""
    start = run.start_time()
    out: dict[int, float] = {}
    for r in run.records:
        if _is_number(r.get("trainer/step")) and _is_number(r.get("time")) and start is not None:
            out[int(r["trainer/step"])] = float(r["time"]) - start
    return out


def sync_steps(run: RunRecords) -> list[int]:
    """The steps that ended with a weight sync (their record holds `sync/total_s`)."""
    return [
        int(r["trainer/step"])
        for r in run.records
        if _is_number(r.get("sync/total_s")) and _is_number(r.get("trainer/step"))
    ]


@dataclass(frozen=True)
class RunInfo:
    """The run's mode and model from its saved config (`RUN_DIR/config.yaml`), for the summary block and limits."""

    max_staleness: int | None  # η
    sync_every: int | None  # K
    partial_rollout: bool | None
    correction: str  # off-policy correction mode, or how old log-probs are taken
    model: str
    lr: float | None
    estimator: str
    required_samples: int | None
    samples_per_prompt: int | None
    queue_capacity: int | None  # groups (async_training.queue_max_groups)
    engines: str

    @property
    def mode(self) -> str:
        if self.max_staleness is None:
            return "-"
        kind = "synchronous" if self.max_staleness == 0 and self.sync_every == 1 else "fully async"
        partial = {True: "partial rollouts", False: "no partial rollouts", None: "partial rollouts ?"}
        return f"{kind}: η={self.max_staleness}, K={self.sync_every}, {partial[self.partial_rollout]}"


def _get(mapping: Any, dotted: str) -> Any:
    node = mapping
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def run_info(config: dict[str, Any]) -> RunInfo:
    """RunInfo from a run's saved config (a plain mapping, interpolations resolved)."""
    correction = _get(config, "algorithm.off_policy_correction")
    if isinstance(correction, dict) and correction.get("mode"):
        lag = f", prox_lag {correction['prox_lag']}" if correction.get("prox_lag") is not None else ""
        how = f"{correction['mode']}" + (
            f" ({correction['prox_log_probs']}{lag})" if correction.get("prox_log_probs") else ""
        )
    elif _get(config, "async_training.compute_prox_log_prob"):
        how = "decoupled PPO (recomputed proximal log-probs)"
    elif _get(config, "async_training.use_rollout_log_probs") is False:
        how = "none (old log-probs recomputed by the trainer)"
    else:
        how = "none (old log-probs = the engines' rollout log-probs)"
    task = _get(config, "task.name")
    model = str(_get(config, "actor_rollout_ref.model.path") or "-")
    if task:
        model = f"{model} (task {task})"
    backend, count = _get(config, "engines.backend"), _get(config, "engines.num_engines")
    return RunInfo(
        max_staleness=_int(_get(config, "async_training.max_staleness")),
        sync_every=_int(_get(config, "async_training.trigger_parameter_sync_step")),
        partial_rollout=_get(config, "async_training.partial_rollout"),
        correction=how,
        model=model,
        lr=_get(config, "actor_rollout_ref.actor.optim.lr"),
        estimator=str(_get(config, "algorithm.adv_estimator") or "-"),
        required_samples=_int(_get(config, "async_training.required_samples")),
        samples_per_prompt=_int(_get(config, "actor_rollout_ref.rollout.n")),
        queue_capacity=_int(_get(config, "async_training.queue_max_groups")),
        engines=f"{count} x {backend}" if count is not None else "-",
    )


def _int(value: Any) -> int | None:
    return int(value) if _is_number(value) else None


@dataclass(frozen=True)
class Sample:
    """One trained generation from a trajectory dump: its prompt, its response in runs of one policy version."""

    reward: float
    prompt: str
    pieces: tuple[tuple[str, int | None], ...]  # (text, version; None: not generated by the policy)
    versions: tuple[int, ...]


def sample_generations(records: list[dict[str, Any]], limit: int = 4) -> list[Sample]:
    """Up to `limit` trajectories of a dump (observe/dumps.py), the best and worst rewards first so both show; the
    response as text runs of one version (ids when the dump has no token texts)."""
    ok = [r for r in records if r.get("status") == "ok" and r.get("sequences")] or list(records)
    one_per_prompt = {r.get("prompt_uid", r.get("uid")): r for r in reversed(ok)}  # a group's samples share a prompt
    ranked = sorted(one_per_prompt.values(), key=lambda r: -float(r.get("reward", 0.0)))
    chosen = ranked[: (limit + 1) // 2] + ranked[::-1][: limit // 2] if len(ranked) > limit else ranked
    out = []
    for record in chosen:
        seq = record["sequences"][-1]
        tokens = seq.get("response_tokens") or [f"<{t}>" for t in seq.get("response_ids", [])]
        versions, mask = seq.get("versions", []), seq.get("loss_mask", [])
        pieces: list[tuple[str, int | None]] = []
        for i, text in enumerate(tokens):
            version = versions[i] if i < len(versions) and (i >= len(mask) or mask[i]) else None
            if pieces and pieces[-1][1] == version:
                pieces[-1] = (pieces[-1][0] + text, version)
            else:
                pieces.append((text, version))
        prompt = seq.get("prompt_text") or " ".join(f"<{t}>" for t in seq.get("prompt_ids", []))
        seen = tuple(sorted({v for _, v in pieces if v is not None}))
        out.append(Sample(float(record.get("reward", 0.0)), prompt, tuple(pieces), seen))
    return out


@dataclass(frozen=True)
class SyncPrediction:
    """`simulate --from` on this run: its measured wall time, the fitted simulation of it, the other mode's."""

    measured_s: float
    predicted_self_s: float
    synchronous_s: float | None  # None when the run itself was synchronous
    other_mode: str
    other_s: float
    # what the synchronous mode is on the run's layout (simulate/layout.py); a cache written before it: CPU runs'
    baseline: str = "the same engines and trainer on the same cores"


@dataclass(frozen=True)
class RunReport:
    """Everything the page shows of one run."""

    run: RunRecords
    totals: RunTotals
    info: RunInfo | None = None
    samples: tuple[Sample, ...] = ()
    samples_step: int | None = None
    prediction: SyncPrediction | None = None
    prediction_note: str = "not predicted"  # why there is no prediction, or how it was made
    engine_events: tuple[EngineEvent, ...] = ()  # RUN_DIR/engine_events.jsonl; empty: the engine set never changed

    @property
    def label(self) -> str:
        return self.run.label


@dataclass(frozen=True)
class EtaChange:
    """One move of adaptive staleness (core/adaptive_staleness.py): at `step`'s sync, η before -> after, and the
    window's statistics that decided it (None: not measured)."""

    step: int
    before: int
    after: int
    ess: float | None
    kl: float | None
    cut: float | None

    def line(self) -> str:
        stats = [
            f"{name} {value:{fmt}}"
            for name, value, fmt in (("ess", self.ess, ".3f"), ("kl", self.kl, ".4f"), ("cut", self.cut, ".1%"))
            if value is not None
        ]
        return f"step {self.step}: η {self.before} → {self.after}" + (f" ({', '.join(stats)})" if stats else "")


def eta_changes(run: RunRecords) -> list[EtaChange]:
    """Every η change the run logged (`staleness/eta_change` with `staleness/eta` and `adaptive/*`), in order."""
    changes = []
    for r in run.records:
        change, eta = r.get("staleness/eta_change"), r.get("staleness/eta")
        if not (_is_number(change) and _is_number(eta) and _is_number(r.get("step"))):
            continue
        stats = {
            k: float(r[f"adaptive/{k}"]) if _is_number(r.get(f"adaptive/{k}")) else None for k in ("ess", "kl", "cut")
        }
        changes.append(EtaChange(int(r["step"]), int(eta - change), int(eta), **stats))
    return changes


ENGINE_EVENT_KINDS = ("join", "leave", "lost", "restart", "move")


@dataclass(frozen=True)
class EngineEvent:
    """One change of the engine set, a line of `RUN_DIR/engine_events.jsonl`: when (unix time, trainer step), what
    (`ENGINE_EVENT_KINDS`), which engine (its id and URL), the samples it handed on and the tokens their move made
    generate again, the engines active after it, and whether the run launched the engine or a user registered it by
    URL."""

    event: str
    engine: str
    step: int | None = None
    time: float | None = None
    url: str = ""
    samples_moved: int = 0
    tokens_regenerated: int = 0
    engines_active: int | None = None
    source: str = ""

    def detail(self) -> str:
        """One line for the hover: '<event> <engine> (<url>, <source>), N samples moved (T tokens regenerated),
        M active'."""
        where = ", ".join(part for part in (self.url, self.source) if part)
        moved = (
            f", {self.samples_moved} samples moved ({regenerated_text(self.tokens_regenerated)})"
            if self.samples_moved
            else ""
        )
        active = f", {self.engines_active} active" if self.engines_active is not None else ""
        return f"{self.event} {self.engine}" + (f" ({where})" if where else "") + moved + active


def regenerated_text(tokens: int) -> str:
    """'1 token regenerated', 'N tokens regenerated': what moving samples made an engine generate again."""
    return f"{tokens} token{'' if tokens == 1 else 's'} regenerated"


def parse_engine_events(lines: Iterable[str], source: str) -> list[EngineEvent]:
    """The events of an engine_events.jsonl (parse_metrics' rules for its lines); a line without `event` and
    `engine`, or with neither `step` nor `time`, raises ReportDataError naming it. A kind this report does not know
    is kept and drawn under its own name (a newer run's events still draw)."""
    events = []
    for number, record in enumerate(_json_lines(lines, source), start=1):
        if not isinstance(record.get("event"), str) or "engine" not in record:
            raise ReportDataError(f"{source}: event {number} lacks `event` or `engine`: {json.dumps(record)[:120]}")
        step, time = record.get("step"), record.get("time")
        if not (_is_number(step) or _is_number(time)):
            raise ReportDataError(f"{source}: event {number} has neither `step` nor `time`: placed nowhere")
        moved, active = record.get("samples_moved"), record.get("engines_active")
        regenerated = record.get("tokens_regenerated")
        events.append(
            EngineEvent(
                event=record["event"],
                engine=str(record["engine"]),
                step=int(step) if _is_number(step) else None,
                time=float(time) if _is_number(time) else None,
                url=str(record.get("url") or ""),
                samples_moved=int(moved) if _is_number(moved) else 0,
                tokens_regenerated=int(regenerated) if _is_number(regenerated) else 0,
                engines_active=int(active) if _is_number(active) else None,
                source=str(record.get("source") or ""),
            )
        )
    return events


@dataclass(frozen=True)
class EngineMark:
    """The engine events at one step of the timeline: the step, their label
    ('+1 engine (registered)', '-1 engine, 3 samples moved') and one hover line per event."""

    x: float
    label: str
    details: tuple[str, ...]


def engine_marks(run: RunRecords, events: Iterable[EngineEvent]) -> list[EngineMark]:
    """The events grouped by the trainer step they happened at, in step order. An event without a step is placed at
    the first step logged at or after its time; one that cannot be placed (no step, a time after the last step's)
    is left out."""
    start = run.start_time()
    times = sorted(step_times(run).items())
    grouped: dict[float, list[EngineEvent]] = {}
    for event in events:
        at: float | None = float(event.step) if event.step is not None else None
        if at is None and event.time is not None and start is not None:
            later = [step for step, t in times if t >= event.time - start]
            at = float(later[0]) if later else None
        if at is not None:
            grouped.setdefault(at, []).append(event)
    return [
        EngineMark(x, _events_label(group), tuple(e.detail() for e in group)) for x, group in sorted(grouped.items())
    ]


def _events_label(events: list[EngineEvent]) -> str:
    def engines(n: int) -> str:
        return f"{n} engine{'s' if n != 1 else ''}"

    parts = []
    joins: dict[str, int] = {}
    for event in events:
        if event.event == "join":
            joins[event.source] = joins.get(event.source, 0) + 1
    parts += [f"+{engines(n)}" + (f" ({source})" if source else "") for source, n in joins.items()]
    counts = {kind: sum(e.event == kind for e in events) for kind in ENGINE_EVENT_KINDS}
    removed, lost = counts["leave"] + counts["lost"], counts["lost"]
    if removed:
        parts.append(f"-{engines(removed)}" + ((f" ({lost} lost)" if counts["leave"] else " lost") if lost else ""))
    if counts["restart"]:
        parts.append(f"{engines(counts['restart'])} restarted")
    parts += sorted({e.event for e in events} - set(ENGINE_EVENT_KINDS))
    moved = sum(e.samples_moved for e in events)
    if moved:
        parts.append(f"{moved} samples moved")
    if regenerated := sum(e.tokens_regenerated for e in events):
        parts.append(regenerated_text(regenerated))
    return ", ".join(parts)


def run_report(run: RunRecords, **parts: Any) -> RunReport:
    return RunReport(run=run, totals=fold(run.records), **parts)
