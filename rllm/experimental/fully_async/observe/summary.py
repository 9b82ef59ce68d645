"""The figures a run is summed up by, folded over its metrics records: the end-of-run summary and the report's.

`RunTotals.observe(record)` takes the records in the order `metrics.jsonl` holds them; the metrics sink feeds it as
it logs (the end-of-run summary), the report folds a finished file through it (the report's summary block), so
both print the same numbers. Definitions, each written once here:
- wall time: `observe/wall_time.py` (first step's start to the last step's end);
- held-out accuracy: every record with `val/accuracy`, at the step whose weights it measured (`val/step`, else the
  record's `step`): the initial validation (step 0), those beside training, the final one (the last step);
  first, best (and its step), last;
- idle: trainer = Σ `timing/wait_batch_s` / Σ `timing/step_s` (the share of its wall time the trainer waited for a
  batch); engines = the mean of `engines/idle_frac` weighted by step time (each value covers the interval since
  the previous batch);
- throughput: generated = the mean of `rollout/tokens_per_s` weighted by step time (the engines' output tokens,
  counted as each call returns: core/engine_activity.py); trained = Σ `batch/tokens` / wall time;
- staleness: the mean of `staleness/mean` weighted by the step's samples, the max of `staleness/max`; the share
  of trained rows whose tokens come from several policy versions = Σ `partial/mixed_version_samples` / Σ rows;
- ledger: the last record's `ledger/*` counts, each with its share of `ledger/issued`; after a resume, its
  `ledger/resumed/<outcome>` counts (samples in flight at the checkpoint: continued from their tokens, or why not).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rllm.experimental.fully_async.core.ledger_format import RESUMED
from rllm.experimental.fully_async.observe.wall_time import STEP_KEY, WallClock

LEDGER_PREFIX = "ledger/"
# The ledger's states in display order; `ledger/<state>/<reason>` columns split filtered and failed by reason.
LEDGER_STATES = ("issued", "trained", "filtered", "dropped_stale", "failed", "in_flight")


def number(value: Any) -> float | None:
    """`value` as a float when it is a finite number (not a bool), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


@dataclass
class _Weighted:
    total: float = 0.0
    weight: float = 0.0

    def add(self, value: float | None, weight: float | None) -> None:
        if value is not None and weight is not None and weight > 0:
            self.total += value * weight
            self.weight += weight

    @property
    def mean(self) -> float | None:
        return self.total / self.weight if self.weight > 0 else None


@dataclass
class RunTotals:
    """The running summary of one run's records (module docstring for every definition)."""

    clock: WallClock = field(default_factory=WallClock)
    steps: int = 0  # the last trainer step seen
    validations: list[tuple[int, float]] = field(default_factory=list)  # (step measured, accuracy), in file order
    _wait_s: float = 0.0
    _step_s: float = 0.0
    _engine_idle: _Weighted = field(default_factory=_Weighted)
    _generated: _Weighted = field(default_factory=_Weighted)
    _staleness: _Weighted = field(default_factory=_Weighted)
    staleness_max: float | None = None
    _trained_tokens: float = 0.0
    _rows: float = 0.0
    _mixed_rows: float = 0.0
    ledger: dict[str, float] = field(default_factory=dict)

    def observe(self, record: Mapping[str, Any]) -> None:
        self.clock.observe(record)
        accuracy = number(record.get("val/accuracy"))
        if accuracy is not None:
            at = number(record.get("val/step"))
            at = at if at is not None else number(record.get("step"))
            self.validations.append((int(at or 0), accuracy))
        ledger = {
            k[len(LEDGER_PREFIX) :]: v
            for k, raw in record.items()
            if k.startswith(LEDGER_PREFIX)
            if (v := number(raw)) is not None
        }
        if ledger:
            self.ledger = ledger
        step = number(record.get(STEP_KEY))
        if step is None:
            return
        self.steps = max(self.steps, int(step))
        step_s = number(record.get("timing/step_s"))
        wait_s = number(record.get("timing/wait_batch_s"))
        if step_s is not None and wait_s is not None:
            self._wait_s += wait_s
            self._step_s += step_s
        self._engine_idle.add(number(record.get("engines/idle_frac")), step_s)
        self._generated.add(number(record.get("rollout/tokens_per_s")), step_s)
        self._staleness.add(number(record.get("staleness/mean")), number(record.get("batch/samples")))
        worst = number(record.get("staleness/max"))
        if worst is not None:
            self.staleness_max = worst if self.staleness_max is None else max(self.staleness_max, worst)
        self._trained_tokens += number(record.get("batch/tokens")) or 0.0
        rows = number(record.get("advantages/num_rows"))
        rows = rows if rows is not None else number(record.get("batch/samples"))
        mixed = number(record.get("partial/mixed_version_samples"))
        if rows is not None and mixed is not None:
            self._rows += rows
            self._mixed_rows += mixed

    # ---- the figures ----

    @property
    def wall_s(self) -> float | None:
        return self.clock.wall_s

    @property
    def first_val(self) -> tuple[int, float] | None:
        return self.validations[0] if self.validations else None

    @property
    def last_val(self) -> tuple[int, float] | None:
        return max(self.validations, key=lambda v: v[0]) if self.validations else None

    @property
    def best_val(self) -> tuple[int, float] | None:
        return max(self.validations, key=lambda v: (v[1], -v[0])) if self.validations else None

    @property
    def trainer_idle(self) -> float | None:
        return self._wait_s / self._step_s if self._step_s > 0 else None

    @property
    def engines_idle(self) -> float | None:
        return self._engine_idle.mean

    @property
    def generated_tokens_per_s(self) -> float | None:
        return self._generated.mean

    @property
    def trained_tokens_per_s(self) -> float | None:
        wall = self.wall_s
        return self._trained_tokens / wall if wall and self._trained_tokens else None

    @property
    def staleness_mean(self) -> float | None:
        return self._staleness.mean

    @property
    def mixed_version_share(self) -> float | None:
        return self._mixed_rows / self._rows if self._rows > 0 else None

    def resumed(self) -> dict[str, float]:
        """outcome -> samples resumed from a checkpoint (the ledger's `resumed/<outcome>` counts), by outcome."""
        prefix = f"{RESUMED}/"
        return {k[len(prefix) :]: v for k, v in sorted(self.ledger.items()) if k.startswith(prefix)}

    def ledger_shares(self) -> list[tuple[str, float, float | None]]:
        """(state, count, share of issued) for the ledger's states in LEDGER_STATES order, then any other."""
        issued = self.ledger.get("issued")
        keys = [k for k in LEDGER_STATES if k in self.ledger]
        keys += sorted(k for k in self.ledger if k not in LEDGER_STATES and "/" not in k)
        return [(k, self.ledger[k], self.ledger[k] / issued if issued else None) for k in keys if k != "issued"]


def fold(records: Iterable[Mapping[str, Any]]) -> RunTotals:
    totals = RunTotals()
    for record in records:
        totals.observe(record)
    return totals
