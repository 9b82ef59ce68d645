"""What a run reports: `RUN_DIR/metrics.jsonl` and verl `Tracking` backends, and the summary (progress: progress.py).

The driver (`runtime/run/driver.py`) calls these from its step loop; they hold no process or Ray state. The sink
folds every record it logs into a `RunTotals` (observe/summary.py), so the end-of-run summary prints the figures the
report prints (the same wall time, idle and validation definitions), and its last lines say where the run's files
are and which command draws them.

Validations (`log_validation`) are measured on one step's weights (`val/step`) and finish some steps later, while
training goes on. metrics.jsonl records each at the step it measured, with the step it was logged at
(`val/logged_at_step`). A tracking backend that takes any step (`ANY_STEP_BACKENDS`: TensorBoard, MLflow, ClearML,
verl's file logger) gets it at the step it measured too. wandb refuses a step below its current one ("Tried to log to
step 100 that is less than the current step 200 ... this data will be ignored"), so wandb (and any backend not known
to take earlier steps) gets it at the step it was logged, with `val/step` in the same row; for wandb `val/*` is
plotted against `val/step` (`define_metric`), so its charts show every validation at the step it measured.
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

# verl Tracking backends whose log(data, step) takes a step below one already logged (TensorBoard's add_scalar,
# mlflow.log_metrics, ClearML's report_scalar iteration, verl's FileLogger line): a validation goes there at the step
# it measured. Every other backend gets it at the current step.
ANY_STEP_BACKENDS = frozenset({"tensorboard", "mlflow", "clearml", "file"})


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
            # lazy: verl's Tracking pulls verl, torch and wandb (~3 s), needed only for a logger other than console
            from verl.utils.tracking import Tracking

            self.tracking = Tracking(
                project_name=cfg.trainer.project_name,
                experiment_name=cfg.trainer.experiment_name,
                default_backend=backends,
                config=OmegaConf.to_container(cfg, resolve=True),
            )
            wandb = self.tracking.logger.get("wandb")  # verl keeps the wandb module itself, after wandb.init
            if wandb is not None:
                # wandb's own x-axis for validations: each is logged in the current row and drawn at `val/step`.
                wandb.define_metric("val/step")
                wandb.define_metric("val/*", step_metric="val/step")
        self._last_val_row = -1  # the row the last validation went to in the current-step backends

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._write(step, metrics)
        if self.tracking is not None:
            self.tracking.log(data=metrics, step=step)

    def log_validation(
        self, step: int, result: dict[str, float], extra: dict[str, float] | None = None
    ) -> dict[str, float]:
        """A validation's `result` (and `extra` figures for the same line), logged now, at step `step`, for the
        weights of step `result["val/step"]` (default: `step`). Returns the figures as logged (for the progress
        line). Two validations logged at one step (the end of a run) take two rows in the current-step backends."""
        measured = int(result.get("val/step", step))
        figures = dict(result)
        if measured != step:
            figures["val/logged_at_step"] = float(step)
        self._write(measured, figures | (extra or {}))
        if self.tracking is not None and result:
            data = figures | {"val/step": float(measured)} | (extra or {})
            any_step = [b for b in self.tracking.logger if b in ANY_STEP_BACKENDS]
            current = [b for b in self.tracking.logger if b not in ANY_STEP_BACKENDS]
            if any_step:
                self.tracking.log(data=data, step=measured, backend=any_step)
            if current:
                row = max(step, self._last_val_row + 1)
                self.tracking.log(data=data, step=row, backend=current)
                self._last_val_row = row
        elif self.tracking is not None and extra:
            self.tracking.log(data=extra, step=step)
        return figures

    def _write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        self.totals.observe(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

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
            # verl's Tracking finishes its backends (flushes TensorBoard's event file, ends a wandb run) only in
            # __del__. Dropping our reference runs it only if nothing else holds the object (a traceback, a cycle),
            # so call it now and empty its backends: the interpreter's later __del__ then finds nothing to finish.
            tracking, self.tracking = self.tracking, None
            tracking.__del__()
            tracking.logger.clear()


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
    weights_dir = cfg.get("param_sync", {}).get("weights_dir")
    model = trained_model_folder(Path(weights_dir)) if weights_dir else None
    if model is not None:
        kind = (
            "a peft LoRA adapter over actor_rollout_ref.model.path"
            if (model / "adapter_config.json").exists()
            else "Hugging Face format: from_pretrained() loads it"
        )
        outputs.append(("trained model", f"{model}  ({kind})"))
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


def trained_model_folder(weights_dir: Path) -> Path | None:
    """The newest `vN` folder the disk transport wrote (runtime/sync/disk.py), the weights the run ended with; None
    when it wrote none (the distributed transport moves weights without a folder)."""
    versions = [(int(p.name[1:]), p) for p in weights_dir.glob("v*") if p.name[1:].isdigit() and p.is_dir()]
    return max(versions)[1] if versions else None


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
