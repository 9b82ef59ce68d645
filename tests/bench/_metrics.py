"""Summaries of one training run's metrics.jsonl, for the experiment scripts in tests/bench: pure functions over
the parsed records (`summarize_metrics`), so they can be checked on a hand-written list of dicts, and the mean and
sample standard deviation the tables report (`mean_std`).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MetricsSummary:
    """What the experiment scripts compare, from one run's metrics.jsonl. None: the run did not report it."""

    steps: int  # optimizer steps logged
    train_wall_s: float | None  # first step's start to the last step's log line (excludes start-up, final val)
    step_s_mean: float | None  # mean of timing/step_s (batch wait + update + weight sync)
    wait_batch_s_mean: float | None  # mean of timing/wait_batch_s (trainer blocked on the queue)
    idle_frac_mean: float | None  # mean over steps of trainer/idle_frac (= wait_batch_s / step_s per step)
    idle_frac_total: float | None  # sum(wait_batch_s) / sum(step_s): the fraction of trainer time spent idle
    staleness_mean: float | None  # mean over steps of staleness/mean (versions behind, trained groups)
    staleness_max: float | None  # max over steps of staleness/max
    dropped_stale_groups: float  # groups dropped by the trainer as too stale, summed over steps
    reward_mean_last: float | None  # reward/mean of the last step
    initial_val_accuracy: float | None  # the step-0 validation (trainer.val_before_train)
    final_val_accuracy: float | None  # the validation after the last step's weights reached the engines
    ledger: dict[str, float] = field(default_factory=dict)  # the last ledger/* counts, prefix removed
    # (step, training seconds to that step, held-out accuracy): the step-0 validation, every `trainer.test_freq`
    # one (its weights are the step's: the time is that step's log line, since training began) and the final one
    val_curve: tuple[tuple[int, float, float], ...] = ()
    tokens_generated: float | None = None  # rollout/tokens_generated at the last step (cumulative)
    tokens_trained: float = 0.0  # sum of batch/tokens over the steps
    eta_final: float | None = None  # adaptive staleness: staleness/eta at the last step
    eta_changes: int = 0  # adaptive staleness: steps with staleness/eta_change
    # adaptive staleness: (step, η in force after it) at the first step and at every change
    eta_trajectory: tuple[tuple[int, float], ...] = ()
    eta_mean: float | None = None  # mean over steps of staleness/eta
    first_step_started_at: float | None = None  # wall clock (time.time()) when the first step began waiting
    # trainer time waiting for rollouts without the take_batch call's own overhead, Σ(wait - overhead) / Σ step_s:
    # what adaptive staleness's raise_when_waiting gate reads
    wait_share: float | None = None
    # the trust region's bite: mean over steps of actor/pg_clipfrac (all steps; steps 1-50), of the masked token
    # fractions (m2po, cap_mode=mask: off_policy/masked_token_fraction; decoupled's m2_threshold: its own)
    pg_clipfrac_mean: float | None = None
    pg_clipfrac_early: float | None = None
    masked_token_fraction_mean: float | None = None
    m2_masked_token_fraction_mean: float | None = None
    # per-step off-policy statistics the adaptive rule reads (core/adaptive_staleness.py), as quantiles over steps:
    # {name: {"p10", "p50", "p90", "early_p50" (steps 1-50), "late_p50" (after)}}: ess, kl, cut, wait
    signals: dict[str, dict[str, float]] = field(default_factory=dict)

    def time_to_accuracy(self, threshold: float) -> float | None:
        """Training seconds until the first held-out validation after step 0 at or above `threshold`; None if none
        was (a threshold at or below the starting accuracy says nothing: the experiment refuses one)."""
        return next((seconds for step, seconds, acc in self.val_curve if step > 0 and acc >= threshold), None)

    @property
    def generated_per_trained_token(self) -> float | None:
        if self.tokens_generated is None or not self.tokens_trained:
            return None
        return self.tokens_generated / self.tokens_trained


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Parse metrics.jsonl; a truncated last line (a run killed mid-write) is skipped, not fatal."""
    records: list[dict[str, Any]] = []
    if not path.is_file():
        return records
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("%s:%d is not JSON (run killed mid-write?); skipped", path, number)
    return records


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


EARLY_STEPS = 50  # "early" in the summaries: the task's first dip (tests/bench/README.md) sits in steps 1-50


def _step_mean(steps: Sequence[dict[str, Any]], key: str, last_step: int | None = None) -> float | None:
    values = [float(r[key]) for r in steps if key in r and (last_step is None or int(r["trainer/step"]) <= last_step)]
    return _mean(values)


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def step_signals(record: dict[str, Any]) -> dict[str, float]:
    """One step's statistics as the adaptive rule reads them (runtime/trainer/fully_async_trainer.offpolicy_signals):
    ess = 1 / (1 + chi2_token), kl = k3 KL(pi_behav || pi_theta), cut = the larger of the clipped and masked token
    fractions, wait = (wait_batch_s - take_overhead_s) / step_s. A statistic the step lacks is left out."""
    out: dict[str, float] = {}
    if "rollout_corr/chi2_token" in record:
        out["ess"] = 1.0 / (1.0 + max(0.0, float(record["rollout_corr/chi2_token"])))
    if "rollout_corr/k3_kl" in record:
        out["kl"] = float(record["rollout_corr/k3_kl"])
    cuts = [
        float(record[k])
        for k in ("actor/pg_clipfrac", "off_policy/masked_token_fraction", "off_policy/m2_masked_token_fraction")
        if k in record
    ]
    if cuts:
        out["cut"] = max(cuts)
    if "timing/wait_batch_s" in record and record.get("timing/step_s"):
        waited = float(record["timing/wait_batch_s"]) - float(record.get("timing/take_overhead_s", 0.0))
        out["wait"] = max(0.0, waited) / float(record["timing/step_s"])
    return out


def _signals(steps: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    per_step = [(int(r["trainer/step"]), step_signals(r)) for r in steps]
    out: dict[str, dict[str, float]] = {}
    for name in ("ess", "kl", "cut", "wait"):
        values = [s[name] for _, s in per_step if name in s]
        if not values:
            continue
        early = [s[name] for step, s in per_step if name in s and step <= EARLY_STEPS]
        late = [s[name] for step, s in per_step if name in s and step > EARLY_STEPS]
        out[name] = {"p10": _quantile(values, 0.1), "p50": _quantile(values, 0.5), "p90": _quantile(values, 0.9)}
        if early:
            out[name]["early_p50"] = _quantile(early, 0.5)
        if late:
            out[name]["late_p50"] = _quantile(late, 0.5)
    return out


def _eta_trajectory(steps: Sequence[dict[str, Any]]) -> tuple[tuple[int, float], ...]:
    trajectory: list[tuple[int, float]] = []
    for r in steps:
        if "staleness/eta" in r and (not trajectory or float(r["staleness/eta"]) != trajectory[-1][1]):
            trajectory.append((int(r["trainer/step"]), float(r["staleness/eta"])))
    return tuple(trajectory)


def summarize_metrics(records: Sequence[dict[str, Any]]) -> MetricsSummary:
    """Summarise the records the driver writes.

    The driver writes three kinds of line, told apart by their keys:
    - step lines: have `trainer/step` (and may carry `val/*` at test_freq steps);
    - the initial validation: `step` 0, `val/accuracy`, no `trainer/step`;
    - the final validation: after the last step, `val/accuracy` and `ledger/*`, no `trainer/step`.
    """
    steps = [r for r in records if "trainer/step" in r]
    extra_vals = [r for r in records if "trainer/step" not in r and "val/accuracy" in r]
    initial = next((r["val/accuracy"] for r in extra_vals if r.get("step") == 0), None)
    finals = [r for r in extra_vals if r.get("step", 0) > 0]
    final = finals[-1]["val/accuracy"] if finals else None

    step_s = [float(r["timing/step_s"]) for r in steps if "timing/step_s" in r]
    first_start = None
    if steps and "time" in steps[0]:
        first_start = float(steps[0]["time"]) - float(steps[0].get("timing/step_s", 0.0))
    waits = [float(r["timing/wait_batch_s"]) for r in steps if "timing/wait_batch_s" in r]
    train_wall_s = None
    if first_start is not None and "time" in steps[-1]:
        # The first step's clock starts when the trainer begins waiting for its first batch, i.e. when the
        # executor starts rolling out; its log line comes step_s later. So the span is measured from there.
        train_wall_s = float(steps[-1]["time"]) - first_start
    ledger_lines = [r for r in records if any(k.startswith("ledger/") for k in r)]
    ledger = (
        {k.removeprefix("ledger/"): float(v) for k, v in ledger_lines[-1].items() if k.startswith("ledger/")}
        if ledger_lines
        else {}
    )
    return MetricsSummary(
        steps=len(steps),
        train_wall_s=train_wall_s,
        step_s_mean=_mean(step_s),
        wait_batch_s_mean=_mean(waits),
        idle_frac_mean=_mean([float(r["trainer/idle_frac"]) for r in steps if "trainer/idle_frac" in r]),
        idle_frac_total=(sum(waits) / sum(step_s)) if step_s and len(waits) == len(step_s) and sum(step_s) else None,
        staleness_mean=_mean([float(r["staleness/mean"]) for r in steps if "staleness/mean" in r]),
        staleness_max=max((float(r["staleness/max"]) for r in steps if "staleness/max" in r), default=None),
        dropped_stale_groups=sum(float(r.get("staleness/dropped_groups", 0.0)) for r in steps),
        reward_mean_last=float(steps[-1]["reward/mean"]) if steps and "reward/mean" in steps[-1] else None,
        initial_val_accuracy=float(initial) if initial is not None else None,
        final_val_accuracy=float(final) if final is not None else None,
        ledger=ledger,
        val_curve=_val_curve(records, steps, first_start, final, train_wall_s),
        tokens_generated=next(
            (float(r["rollout/tokens_generated"]) for r in reversed(steps) if "rollout/tokens_generated" in r), None
        ),
        tokens_trained=sum(float(r.get("batch/tokens", 0.0)) for r in steps),
        eta_final=float(steps[-1]["staleness/eta"]) if steps and "staleness/eta" in steps[-1] else None,
        eta_changes=sum(1 for r in steps if "staleness/eta_change" in r),
        eta_trajectory=_eta_trajectory(steps),
        eta_mean=_mean([float(r["staleness/eta"]) for r in steps if "staleness/eta" in r]),
        first_step_started_at=first_start,
        wait_share=_wait_share(steps),
        pg_clipfrac_mean=_step_mean(steps, "actor/pg_clipfrac"),
        pg_clipfrac_early=_step_mean(steps, "actor/pg_clipfrac", EARLY_STEPS),
        masked_token_fraction_mean=_step_mean(steps, "off_policy/masked_token_fraction"),
        m2_masked_token_fraction_mean=_step_mean(steps, "off_policy/m2_masked_token_fraction"),
        signals=_signals(steps),
    )


def _wait_share(steps: Sequence[dict[str, Any]]) -> float | None:
    total = sum(float(r.get("timing/step_s", 0.0)) for r in steps)
    if not total or not all("timing/wait_batch_s" in r for r in steps):
        return None
    waited = sum(max(0.0, float(r["timing/wait_batch_s"]) - float(r.get("timing/take_overhead_s", 0.0))) for r in steps)
    return waited / total


def _val_curve(
    records: Sequence[dict[str, Any]],
    steps: Sequence[dict[str, Any]],
    first_start: float | None,
    final: float | None,
    train_wall_s: float | None,
) -> tuple[tuple[int, float, float], ...]:
    """(step, training seconds, accuracy) of every validation: step 0 at 0 s, the in-training ones (logged with
    `val/step`, measured on that step's weights) at that step's log time, the final one at the end of training."""
    if first_start is None:
        return ()
    step_time = {int(r["trainer/step"]): float(r["time"]) - first_start for r in steps if "time" in r}
    curve = [(0, 0.0, float(r["val/accuracy"])) for r in records if r.get("step") == 0 and "val/accuracy" in r][:1]
    for r in records:
        if "val/step" in r and "val/accuracy" in r and int(r["val/step"]) in step_time:
            curve.append((int(r["val/step"]), step_time[int(r["val/step"])], float(r["val/accuracy"])))
    if final is not None and train_wall_s is not None:
        curve.append((len(steps), train_wall_s, float(final)))
    return tuple(sorted(set(curve)))


def mean_std(values: Iterable[float | None]) -> tuple[float | None, float | None, int]:
    """Mean and sample standard deviation (n-1) of the values that exist; std is None below two values."""
    present = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not present:
        return None, None, 0
    std = statistics.stdev(present) if len(present) >= 2 else None
    return statistics.fmean(present), std, len(present)
