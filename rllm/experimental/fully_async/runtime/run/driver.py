"""One training run from a validated config: `Run` (start -> step ... -> stop) and `train(cfg)`, which drives it.

The driver owns process lifetimes (Ray, engine subprocesses, actors) and the step loop; what it reports is
formatted and written by `observe/metrics_sink.py`. The training logic lives in the actors.
While it waits for a step it watches the engines (`engines.supervisor`) and applies the requests of its engines
control endpoint (`runtime/run/elastic.py`): a restarted or joining engine gets the current weights from the trainer
and then rollouts from the executor; a leaving one's samples move to the others.
Everything started here is stopped in `finally`, so a failed or interrupted run leaves no process behind.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf

from rllm.experimental.fully_async.api.rollout_functions import RolloutFunctions
from rllm.experimental.fully_async.errors import FullyAsyncError
from rllm.experimental.fully_async.observe.metrics_sink import (
    MetricsSink,
    RunSummary,
    prefixed,
    print_summary,
    run_outputs,
)
from rllm.experimental.fully_async.observe.progress import Progress, format_stats
from rllm.experimental.fully_async.runtime.checkpoints.store import (
    CheckpointManager,
    config_hash,
    find_resume_checkpoint,
    load_checkpoint,
)
from rllm.experimental.fully_async.runtime.run.build import prepare_run, start_processes
from rllm.experimental.fully_async.runtime.run.elastic import ElasticContext, ElasticEngines
from rllm.experimental.fully_async.runtime.run.run_dir import mark_finished
from rllm.experimental.fully_async.settings.derive import synchronous_notice

__all__ = ["Run", "RunFailedError", "log_step", "train"]

logger = logging.getLogger(__name__)


class Run:
    """One training run's lifecycle: `start()`, then `step()` until it returns None, `checkpoint()` whenever, and
    `stop()` (always, from `close()` on every exit path). The actors hold the training state; this object holds the
    processes (engines, Ray, actors), the metrics sink and the step count.

    `start()` prepares the task and data, settles the run directory (finished? fresh? resume with a compatible
    config?), launches the engines, Ray, the rollout service and the trainer, resumes from a checkpoint, and measures
    the initial validation accuracy. `stop()` pushes the last weights, saves a final checkpoint, stops the rollouts
    and measures the final accuracy; `close()` then ends every process this run started, however it got there.
    """

    def __init__(self, cfg: DictConfig, rllm_functions: RolloutFunctions | None = None) -> None:
        self.cfg, self.rllm_functions = cfg, rllm_functions  # the functions: runner.AsyncAgentTrainer's
        self.step_count = 0
        self.total: int | None = None
        self.initial_acc: float | None = None
        self.final_acc: float | None = None
        self.ledger: dict[str, Any] = {}
        self._started = time.monotonic()
        self._stack = ExitStack()
        self._run_ref: Any = None

    # ---- start ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.cfg
        self.run_dir = Path(cfg.run.dir)
        # A rich bar on a terminal, plain lines in logs (observe/progress.py): start-up phases, a header, the steps.
        self.progress = Progress(cfg.trainer.total_training_steps)
        self._stack.callback(self.progress.close)
        self.spec = prepare_run(cfg, self.rllm_functions, phase=self._phase)
        self.total = cfg.trainer.total_training_steps  # None: until the data (trainer.total_epochs) is exhausted
        self.container = OmegaConf.to_container(cfg, resolve=True)
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", keep_last=2)
        resume_path = find_resume_checkpoint(
            self.checkpoints.root, self.spec.run.resume_mode, self.spec.run.resume_from_path
        )
        resumed = load_checkpoint(resume_path) if resume_path is not None else None
        self.sink = MetricsSink(cfg, self.run_dir)
        self._stack.callback(self.sink.close)
        self._stack.callback(self.progress.close)  # again: closed (idempotent) before the sink, whose wandb prints
        self.progress.header(self.spec, self.run_dir)
        notice = synchronous_notice(cfg)
        if notice is not None:  # an rLLM script's default staleness_threshold: said at start, not left to find
            self.progress.message(notice)  # once: also logging it printed the same line twice on a terminal
        self.step_count = resumed.step if resumed is not None else 0
        processes = start_processes(self.spec, self._stack, self.run_dir, resumed, self.container, phase=self._phase)
        self.supervisor, self.rollouts, self.trainer = processes.supervisor, processes.rollouts, processes.trainer
        self.sync_timeout_s = self.spec.param_sync.timeout_s * 4
        self.validate_timeout_s = self.spec.engines.request_timeout_s
        # Engines join and leave while the run goes on: `engines add/remove/register` reach this process through
        # its loopback control endpoint (RUN_DIR/control.json), applied where the engines are watched.
        self.elastic = ElasticEngines(
            ElasticContext(
                run_dir=self.run_dir,
                supervisor=self.supervisor,
                trainer=self.trainer,
                rollouts=self.rollouts,
                model_path=self.spec.engines.model_path,
                weights_dir=str(Path(self.spec.param_sync.weights_dir).resolve()),
                no_engine_timeout_s=self.spec.engines.no_engine_timeout_s,
                sync_timeout_s=self.sync_timeout_s,
                step=lambda: self.step_count,
                message=self.progress.message,
            ),
            processes.engines.urls,
        )
        self._stack.callback(self.elastic.close)
        self.elastic.start()
        if resumed is not None:
            ray.get(self.trainer.load_checkpoint.remote(str(resumed.path.resolve()), resumed.trainer), timeout=300)
            # Fresh engines hold the initial weights: give them the checkpoint's, under its version.
            ray.get(self.trainer.sync_weights.remote(False), timeout=self.sync_timeout_s)
            version = resumed.meta.get("version")
            self.progress.message(f"resumed from {resume_path} at step {self.step_count} (version {version})")
        elif self.spec.trainer.lora is not None:
            # LoRA: version 0 is an adapter too (peft's initial one, the base model's outputs); every request names
            # one, so it is on every engine before the first request (docs/design.md#rule-one-version-per-lora-sample)
            ray.get(self.trainer.sync_weights.remote(False), timeout=self.sync_timeout_s)
        if resumed is None and self.spec.run.val_before_train:
            self._phase("initial validation (the engines' first requests)")
            val = ray.get(self.rollouts.validate.remote(), timeout=self.validate_timeout_s)
            self.initial_acc = val.get("val/accuracy")
            self.sink.log_validation(0, val)
            if self.initial_acc is not None:  # None: no validation files (data.val_files=null)
                self.progress.message(f"initial validation accuracy {self.initial_acc:.1%} (version 0)")
        self._run_ref = self.rollouts.run.remote()
        self._phase("generating the first batch, then step 1")

    def _phase(self, name: str) -> None:
        """A start-up phase begins (runtime/run/build.py): logged and shown on the progress display."""
        logger.info("starting: %s", name)
        self.progress.phase(name)

    # ---- step ----------------------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.total is not None and self.step_count >= self.total

    def step(self) -> dict[str, float] | None:
        """One optimizer step (and a weight sync when due); None when the prompt data is exhausted."""
        step_timeout = self.spec.trainer.queue_get_timeout_s + 120
        self._watch_engines()  # between steps too: a short step never leaves the wait below to watch
        metrics = _step(self.trainer, self._run_ref, timeout_s=step_timeout, while_waiting=self._watch_engines)
        if metrics is None:
            self.progress.message(f"prompt data exhausted after {self.step_count} steps")
            return None
        self.step_count += 1
        step = self.step_count
        # queue/*, ledger/* and rollout/* came with the batch (as of when the step took it): one Ray call per
        # step. The ledger's `trained` therefore counts up to the previous step.
        metrics.update(self.supervisor.metrics())
        metrics.update(self.elastic.metrics())
        test_freq, save_freq = self.spec.run.test_freq, self.spec.run.save_freq
        due = test_freq > 0 and step % test_freq == 0 and step != self.total
        # Validation runs beside training, pinned to the weights the engines hold now (runtime/rollout/validation.py).
        # One Ray call after every step collects the validations finished since the previous one (and starts one
        # when due), so each result is logged at the first step after it finished. The call waits on nothing (1.4 ms
        # measured on a loaded 2-core machine, beside steps of seconds); carrying results in the trainer's batch instead
        # would add a step of delay (the batch is taken when a step begins) and route validation through the
        # trainer.
        started, finished = ray.get(self.rollouts.poll_validations.remote(step if due else None), timeout=60)
        if due and not started:
            logger.warning("step %d: the previous validation is still running; this one is skipped", step)
        self.progress.update(step, log_step(self.sink, step, metrics, finished))
        if save_freq > 0 and step % save_freq == 0:
            self.checkpoint()
        return metrics

    def _watch_engines(self) -> None:
        """Engine deaths and restarts, and the queued engines requests (runtime/run/elastic.py)."""
        self.elastic.watch()

    # ---- checkpoint ----------------------------------------------------------------------------------------

    def checkpoint(self) -> Path:
        """Save the current step. Each actor writes its own part into the step's temporary directory (the weights
        never pass through this process); the trainer first acknowledges its last batch, so the rollout part's
        ledger has every trained sample trained. The commit then makes the checkpoint visible in one rename."""
        tmp = self.checkpoints.begin(self.step_count)
        try:
            where = str(tmp.resolve())  # the actors' working directory need not be this process's
            trainer_part = ray.get(self.trainer.write_checkpoint.remote(where), timeout=300)
            files = trainer_part["files"] | ray.get(self.rollouts.write_checkpoint.remote(where), timeout=120)
        except BaseException:
            self.checkpoints.abort(tmp)
            raise
        meta = {"version": int(trainer_part["version"]), "config_hash": config_hash(self.container)}
        path = self.checkpoints.commit(tmp, self.step_count, files, meta)
        self._last_checkpoint_step = self.step_count
        logger.info("checkpoint %s", path)
        return path

    def try_checkpoint(self) -> str:
        """Checkpoint on the way out of a failure or an interrupt; a description of what was saved (the previous
        stays usable). The trainer may be waiting for a batch that will not come (no engine left, rollouts
        stalled), and its checkpoint call would queue behind that wait: the rollout service first answers it
        with nothing (RolloutService.interrupt), so the trainer takes no step and writes its part at once."""
        try:
            ray.get(self.rollouts.interrupt.remote(), timeout=30)
            self.checkpoint()
            return f"checkpoint at step {self.step_count} saved in {self.checkpoints.root}"
        except Exception as exc:
            cause = root_cause(exc)
            return f"no new checkpoint ({type(cause).__name__}: {cause})"

    # ---- stop ----------------------------------------------------------------------------------------------

    def stop(self) -> RunSummary:
        """The end of a run that finished: last weights to the engines, a final checkpoint, rollouts stopped, the
        final validation, and the run marked finished."""
        step = self.step_count
        ray.get(self.trainer.push_last_weights.remote(), timeout=self.sync_timeout_s)  # the trainer decides
        if getattr(self, "_last_checkpoint_step", None) != step:
            self.checkpoint()
        for result in ray.get(self.rollouts.finished_validations.remote(), timeout=self.validate_timeout_s):
            shown = self.sink.log_validation(step, result)
            if "val/accuracy" in shown:  # no step line follows to show it
                self.progress.message(f"validation finished after the last step: {format_stats(shown)}")
        ray.get(self.rollouts.stop.remote(), timeout=60)
        ray.get(self._run_ref, timeout=120)
        val = ray.get(self.rollouts.validate.remote(), timeout=self.validate_timeout_s)
        self.final_acc = val.get("val/accuracy")
        self.ledger = ray.get(self.rollouts.ledger_counts.remote(), timeout=60)
        self.sink.log_validation(step, val, extra=prefixed("ledger", self.ledger))
        self.close()
        mark_finished(self.run_dir, step, self.spec)
        outputs = run_outputs(self.cfg, self.run_dir, self.checkpoints.root)
        return self.sink.summary(step, self.initial_acc, self.final_acc, self.ledger, self._started, outputs)

    def close(self) -> None:
        """End every process this run started (engines, Ray, actors) and close the sink; safe to call twice."""
        self._stack.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def train(cfg: DictConfig, rllm_functions: RolloutFunctions | None = None) -> RunSummary:
    """Train to trainer.total_training_steps (or until the data is exhausted); rllm_functions: AsyncAgentTrainer's."""
    # First: a SIGTERM while Ray, the engines or the actors are starting must unwind through the same cleanup.
    _install_signal_handlers()
    with Run(cfg, rllm_functions) as run:
        run.start()
        try:
            while not run.done and run.step() is not None:
                pass
            summary = run.stop()
        except KeyboardInterrupt:
            # Ctrl-C / SIGTERM: keep what was learned if the actors still answer, then unwind (stop everything).
            step = run.step_count
            print(f"interrupted at step {step}: saving a checkpoint, then stopping", file=sys.stderr, flush=True)
            print(run.try_checkpoint(), file=sys.stderr, flush=True)
            raise
        except Exception as exc:
            cause = root_cause(exc)
            # The one-line cause reaches the console from __main__; the traceback only at run.log_level=DEBUG.
            logger.debug("run failed at step %d", run.step_count, exc_info=exc)
            saved = run.try_checkpoint()
            raise RunFailedError(f"step {run.step_count + 1}: {type(cause).__name__}: {cause} [{saved}]") from exc
    print_summary(summary)
    return summary


def log_step(
    sink: MetricsSink, step: int, metrics: dict[str, float], validations: list[dict[str, float]]
) -> dict[str, float]:
    """Log step `step`'s metrics, then each validation that finished since the previous step (at the step whose
    weights it measured, `val/step`: MetricsSink.log_validation). Returns what the progress line shows for the
    step: its metrics and the newest validation."""
    sink.log(step, metrics)
    shown = dict(metrics)
    for result in validations:
        shown |= sink.log_validation(step, result)
    return shown


class RunFailedError(FullyAsyncError, RuntimeError):
    """The run stopped on an error; the message names the step, the cause and what was checkpointed."""


def root_cause(exc: BaseException) -> BaseException:
    """The user's exception inside Ray's wrapper (RayTaskError keeps it as `.cause`)."""
    while getattr(exc, "cause", None) is not None and exc.cause is not exc:
        exc = exc.cause
    return exc


WATCH_INTERVAL_S = 1.0  # how often the driver checks the engine processes while a step runs


def _step(trainer: Any, run_ref: Any, timeout_s: float, while_waiting: Any = None) -> dict[str, float] | None:
    """One train_step, failing fast if the executor died meanwhile (its error is the real cause).
    `while_waiting()` runs about every WATCH_INTERVAL_S until the step is done."""
    step_ref = trainer.train_step.remote()
    deadline = time.monotonic() + timeout_s
    while True:
        wait_s = max(0.0, min(WATCH_INTERVAL_S, deadline - time.monotonic()))
        ready, _ = ray.wait([step_ref, run_ref], num_returns=1, timeout=wait_s)
        if ready or time.monotonic() >= deadline:
            break
        if while_waiting is not None:
            while_waiting()
    if not ready:
        raise TimeoutError(f"train_step gave no result within {timeout_s:g}s")
    if ready[0] == run_ref and step_ref not in ready:
        ray.get(run_ref)  # raises the executor's error
        ready, _ = ray.wait([step_ref], timeout=timeout_s)  # data exhausted: the step may still finish
        if not ready:
            raise TimeoutError(f"train_step gave no result within {timeout_s:g}s after rollouts ended")
    return ray.get(step_ref)


def _install_signal_handlers() -> None:
    """SIGTERM behaves like Ctrl-C: unwind through `finally`, stopping engines and Ray."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # A non-interactive shell starts background commands (`nohup ... &`) with SIGINT ignored, and Python then
        # leaves it so: say how to stop this run in order instead of letting `kill -INT` do nothing.
        logger.warning(
            "SIGINT is ignored in this process (started in the background?): stop the run with SIGTERM "
            "(kill %d), which checkpoints and stops the same way",
            os.getpid(),
        )
