"""What a run reports: `RUN_DIR/metrics.jsonl` and verl `Tracking` backends, and the summary (progress: progress.py).

The driver (`runtime/run/driver.py`) calls these from its step loop; they hold no process or Ray state. The sink
folds every record it logs into a `RunTotals` (observe/summary.py), so the end-of-run summary prints the figures the
report prints (the same wall time, idle and validation definitions), and its last lines say where the run's files
are and which command draws them.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rllm.experimental.fully_async.api.progress import CONTINUED
from rllm.experimental.fully_async.observe.progress import format_duration
from rllm.experimental.fully_async.observe.summary import RunTotals

PROG = "python -m rllm.experimental.fully_async"


@dataclass
class RunSummary:
    """What `train` returns and prints at the end. `wall_s` is the training wall time (observe/wall_time.py);
    `process_s` the whole command (start-up, initial and final validation, the last checkpoint included)."""

    steps: int
    initial_val_accuracy: float | None
    final_val_accuracy: float | None
    wall_s: float | None
    ledger: dict[str, Any]
    run_dir: str
    process_s: float | None = None
    totals: RunTotals | None = None
    outputs: list[tuple[str, str]] = field(default_factory=list)  # (what, where), printed as the last lines


class MetricsSink:
    """metrics.jsonl plus verl's Tracking for any logger other than console."""

    def __init__(self, cfg: DictConfig, run_dir: Path) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.file = self.path.open("a", encoding="utf-8")
        self.totals = RunTotals()
        backends = [b for b in cfg.trainer.logger if b != "console"]
        self.tracking = None
        if backends:
            from verl.utils.tracking import Tracking

            self.tracking = Tracking(
                project_name=cfg.trainer.project_name,
                experiment_name=cfg.trainer.experiment_name,
                default_backend=backends,
                config=OmegaConf.to_container(cfg, resolve=True),
            )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        self.totals.observe(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tracking is not None:
            self.tracking.log(data=metrics, step=step)

    def summary(
        self,
        steps: int,
        initial_acc: float | None,
        final_acc: float | None,
        ledger: dict[str, Any],
        started_monotonic: float,
        outputs: list[tuple[str, str]],
    ) -> RunSummary:
        """The end-of-run summary from what this sink logged (its wall time: observe/wall_time.py)."""
        process_s = time.monotonic() - started_monotonic
        run_dir = str(self.path.parent)
        return RunSummary(steps, initial_acc, final_acc, self.totals.wall_s, ledger, run_dir, process_s, self.totals,
                          outputs)  # fmt: skip

    def close(self) -> None:
        self.file.close()
        if self.tracking is not None:
            # verl's Tracking finishes its backends (flushes TensorBoard's event file, ends a wandb run) in __del__:
            # drop the one reference so that happens now, once, rather than whenever the interpreter collects it.
            tracking, self.tracking = self.tracking, None
            del tracking


def prefixed(prefix: str, values: dict[str, Any]) -> dict[str, float]:
    """Numeric entries of `values` as metrics named prefix/key (Ray stats and ledger counts hold other types too)."""
    return {
        f"{prefix}/{k}": float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def tensorboard_dir(cfg: DictConfig) -> str:
    """Where verl's Tracking writes TensorBoard: $TENSORBOARD_DIR, else tensorboard_log/<project>/<experiment>."""
    return os.environ.get(
        "TENSORBOARD_DIR", f"tensorboard_log/{cfg.trainer.project_name}/{cfg.trainer.experiment_name}"
    )


def run_outputs(cfg: DictConfig, run_dir: Path, checkpoints: Path) -> list[tuple[str, str]]:
    """(what, where) for each file or folder the run wrote, and the command that draws it."""
    outputs = [("metrics", str(run_dir / "metrics.jsonl")), ("checkpoints", str(checkpoints))]
    dumps = cfg.trainer.get("rollout_data_dir")
    outputs.append(
        (
            "trajectory dumps",
            f"{dumps}  (view: {PROG} view {dumps})"
            if dumps
            else "off (trainer.rollout_data_dir=DIR writes each step's trajectories)",
        )
    )
    if cfg.trainer.get("validation_data_dir"):
        outputs.append(("validation dumps", str(cfg.trainer.validation_data_dir)))
    if "tensorboard" in cfg.trainer.logger:
        outputs.append(("tensorboard", tensorboard_dir(cfg)))
    outputs.append(("report", f"{PROG} report {run_dir}  (writes {run_dir / 'report.html'})"))
    return outputs


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def summary_lines(summary: RunSummary) -> list[str]:
    """The end-of-run block (without its rules), one figure per line."""
    t = summary.totals or RunTotals()
    wall = "-" if summary.wall_s is None else format_duration(summary.wall_s)
    lines = [f"run finished: {summary.steps} steps, wall time {wall} (first step's start to last step's end)"]
    if summary.process_s is not None:
        lines[0] += f"; the whole command {format_duration(summary.process_s)}"
    if summary.initial_val_accuracy is not None and summary.final_val_accuracy is not None:
        delta = (summary.final_val_accuracy - summary.initial_val_accuracy) * 100
        line = (
            f"validation accuracy: {summary.initial_val_accuracy:.1%} before -> "
            f"{summary.final_val_accuracy:.1%} after ({delta:+.1f} points)"
        )
        if t.best_val is not None:
            line += f"; best {t.best_val[1]:.1%}@{t.best_val[0]}"
        lines.append(line)
    if t.trainer_idle is not None:
        lines.append(f"idle (mean share of wall time): trainer {_pct(t.trainer_idle)}, engines {_pct(t.engines_idle)}")
    ledger = [f"{k} {v:,.0f}" + (f" ({share:.1%})" if share is not None else "") for k, v, share in t.ledger_shares()]
    if ledger:
        lines.append("ledger: " + ", ".join(ledger))
    elif summary.ledger:
        lines.append("ledger: " + ", ".join(f"{k}={v}" for k, v in summary.ledger.items()))
    resumed = t.resumed()
    if resumed:
        restarted = ", ".join(f"{n:,.0f} {why}" for why, n in resumed.items() if why != CONTINUED) or "none"
        lines.append(
            f"resumed (samples in flight at a checkpoint resumed from): {resumed.get(CONTINUED, 0):,.0f} continued "
            f"from their saved tokens; generated again from the prompt: {restarted}"
        )
    width = max((len(what) for what, _ in summary.outputs), default=0) + 1
    lines += [f"{what + ':':<{width}} {where}" for what, where in summary.outputs]
    return lines


def print_summary(summary: RunSummary) -> None:
    print("=" * 72)
    print("\n".join(summary_lines(summary)))
    print("=" * 72, flush=True)
