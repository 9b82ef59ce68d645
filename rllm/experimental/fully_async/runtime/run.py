"""One training run from a validated config: prepare -> start Ray, engines, actors -> step loop -> clean stop.

The driver owns process lifetimes (Ray, engine subprocesses, actors) and the step loop; what it reports is
formatted and written by `observe/reporting.py`. The training logic lives in the actors.
While it waits for a step it watches the engines (`engines.supervisor`): a restarted engine gets the current
weights from the trainer and then rollouts from the executor.
Everything started here is stopped in `finally`, so a failed or interrupted run leaves no process behind.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rllm.experimental.fully_async.errors import FullyAsyncError
from rllm.experimental.fully_async.observe.reporting import (
    MetricsSink,
    RunSummary,
    prefixed,
    print_summary,
    progress_line,
)

logger = logging.getLogger(__name__)

QUIET_LIBRARIES_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TQDM_DISABLE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@contextmanager
def quiet_hf_progress_bars() -> Iterator[None]:
    """Hide transformers' own progress bars ("Writing model shards", "Loading weights") for the block, then restore.

    They flash by for sub-second saves and loads. The actors hide every tqdm bar through QUIET_LIBRARIES_ENV, but
    tqdm reads TQDM_DISABLE when it is imported, so the driver cannot do the same here. The one bar left is SmolLM2's
    first-run GGUF conversion (`tqdm.auto` inside transformers): 20-50 s of progress worth seeing.
    """
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def prepare_task(cfg: DictConfig) -> None:
    """Built-in tasks make their own data and warmed-up model; point the config at them."""
    with quiet_hf_progress_bars():
        _prepare_task(cfg)


def _prepare_task(cfg: DictConfig) -> None:
    if cfg.task.name == "smollm2":
        from rllm.experimental.fully_async.tasks.smollm2 import prepare_smollm2_assets

        started = time.monotonic()
        assets = prepare_smollm2_assets(Path(os.path.expanduser(cfg.task.cache_dir)), seed=int(cfg.task.seed))
        cfg.data.train_files = str(assets.train_parquet)
        cfg.data.val_files = str(assets.val_parquet)
        cfg.actor_rollout_ref.model.path = str(assets.model_dir)
        reward = cfg.reward.custom_reward_function
        if not reward.path:
            reward.path = "rllm.experimental.fully_async.tasks.smollm2"
            reward.name = "compute_score"
        print(
            f"task smollm2 ready in {time.monotonic() - started:.1f}s (model {assets.model_dir}, "
            f"held-out baseline {assets.baseline_val_accuracy:.1%})",
            flush=True,
        )
        return
    if cfg.task.name != "addition":
        return
    from rllm.experimental.fully_async.tasks.addition import prepare_addition_assets

    started = time.monotonic()
    assets = prepare_addition_assets(
        Path(os.path.expanduser(cfg.task.cache_dir)), seed=int(cfg.task.seed), warmup_steps=int(cfg.task.warmup_steps)
    )
    cfg.data.train_files = str(assets.train_parquet)
    cfg.data.val_files = str(assets.val_parquet)
    cfg.actor_rollout_ref.model.path = str(assets.model_dir)
    reward_path = cfg.reward.custom_reward_function
    if not reward_path.path:
        from rllm.experimental.fully_async.tasks import addition

        reward_path.path = addition.__name__
        reward_path.name = "compute_score"
    print(f"task addition ready in {time.monotonic() - started:.1f}s (model {assets.model_dir})", flush=True)


def check_data(cfg: DictConfig) -> int:
    """Read and validate the prompt data before any process starts, so a bad file or row is a one-line error
    (data.DataError) rather than an actor that dies during start-up. Returns the number of training prompts."""
    from transformers import AutoTokenizer

    from rllm.experimental.fully_async.runtime.actors import load_prompt_datasets

    tokenizer = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path)
    train, _ = load_prompt_datasets(cfg, tokenizer)
    if len(train) == 0:
        from rllm.experimental.fully_async.data import DataError

        raise DataError(f"{cfg.data.train_files}: no prompt left after filtering (data.max_prompt_length?)")
    return len(train)


def engine_launcher(cfg: DictConfig, log_dir: Path) -> Any:
    """An EngineLauncher for the configured backend (a context manager whose `.urls` are the engines)."""
    from rllm.experimental.fully_async.engines.launcher import EmbeddedEngineCommand, EngineLauncher

    e = cfg.engines
    model_path = str(cfg.actor_rollout_ref.model.path)
    if e.backend == "embedded":
        command: Any = EmbeddedEngineCommand(
            model_path=model_path,
            max_running_requests=int(e.max_running_requests),
            dtype=str(e.dtype),
            seed=int(cfg.run.seed),
            num_threads=int(e.torch_threads),
            log_level=str(cfg.run.log_level),
        )
    else:
        from rllm.experimental.fully_async.engines.sglang import SGLangEngineCommand

        command = SGLangEngineCommand(
            model_path=model_path,
            dtype=str(e.dtype),
            max_running_requests=int(e.max_running_requests),
            seed=int(cfg.run.seed),
            extra_args=tuple(f"--{k.replace('_', '-')}={v}" for k, v in e.extra_args.items()),
        )
    return EngineLauncher(command, int(e.num_engines), startup_timeout_s=float(e.startup_timeout_s), log_dir=log_dir)


def init_ray(num_cpus: int | None = None) -> None:
    """Loopback-only Ray with a small footprint (ENVIRONMENT.md)."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # gcs_server keeps an event record per actor call (~500 B) up to 100k calls, then remembers each evicted call
    # as "dropped" up to 1M more: a long run grew it by 38 MB in 30 min (tests/bench/README.md, Soak). 2k of each
    # bounds it to a few MB, reached within minutes (10k took 9 and 18 minutes of the default run to fill), and
    # still shows the latest calls in `ray list tasks`. Set before Ray starts, as gcs_server reads them from its
    # environment; an exported value wins.
    os.environ.setdefault("RAY_task_events_max_num_task_in_gcs", "2000")
    os.environ.setdefault("RAY_task_events_max_dropped_task_attempts_tracked_per_job_in_gcs", "2000")
    if not ray.is_initialized():
        ray.init(
            num_cpus=num_cpus or max(4, os.cpu_count() or 1),
            include_dashboard=False,
            object_store_memory=1_000_000_000,
            configure_logging=False,
            log_to_driver=True,
            # Library progress bars and notices in the actors would interleave with the progress line.
            runtime_env={"env_vars": QUIET_LIBRARIES_ENV},
        )


def train(cfg: DictConfig) -> RunSummary:
    """Run the configured training to `trainer.total_training_steps` (or until the data is exhausted)."""
    import ray

    from rllm.experimental.fully_async.engines.supervisor import EngineReplaced, EngineSupervisor
    from rllm.experimental.fully_async.runtime.actors import FullyAsyncTrainerActor, RolloutExecutorActor
    from rllm.experimental.fully_async.runtime.checkpoint import (
        CheckpointManager,
        config_hash,
        find_resume_checkpoint,
        load_checkpoint,
    )
    from rllm.experimental.fully_async.runtime.message_queue import MessageQueue
    from rllm.experimental.fully_async.verl_patch import require_patched_verl

    require_patched_verl()
    started = time.monotonic()
    prepare_task(cfg)
    num_prompts = check_data(cfg)
    if cfg.trainer.total_training_steps is None:
        # Until the data runs out: the LR schedule's horizon is what verl derives, batches per epoch x epochs.
        steps = -(-num_prompts * int(cfg.trainer.total_epochs) // int(cfg.async_training.required_samples))
        for optim in (cfg.actor_rollout_ref.actor.optim, cfg.critic.optim):
            if optim.total_training_steps in (None, -1):
                optim.total_training_steps = steps
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / "config.yaml")
    total = cfg.trainer.total_training_steps  # None: until the data (trainer.total_epochs) is exhausted
    container = OmegaConf.to_container(cfg, resolve=True)
    os.environ.setdefault("RLLM_LOG_LEVEL", str(cfg.run.log_level))
    checkpoints = CheckpointManager(run_dir / "checkpoints", keep_last=2)
    resume_path = find_resume_checkpoint(checkpoints.root, str(cfg.trainer.resume_mode), cfg.trainer.resume_from_path)
    resumed = load_checkpoint(resume_path) if resume_path is not None else None
    sink = MetricsSink(cfg, run_dir)
    ledger: dict[str, Any] = {}
    initial_acc = final_acc = None
    step = resumed.step if resumed is not None else 0
    at = cfg.async_training

    with ExitStack() as stack:
        stack.callback(sink.close)
        engines = stack.enter_context(engine_launcher(cfg, run_dir / "engines"))
        supervisor = EngineSupervisor(
            engines,
            str(cfg.engines.on_engine_failure),
            max_restarts=int(cfg.engines.max_restarts),
            startup_timeout_s=float(cfg.engines.startup_timeout_s),
        )
        init_ray()
        stack.callback(ray.shutdown)
        queued = resumed.queue if resumed is not None else []
        queue = MessageQueue.remote(max_groups=max(int(at.queue_max_groups), len(queued)))
        if queued:
            ray.get(queue.put_batch.remote(queued, 60.0), timeout=120)
        executor = RolloutExecutorActor.remote(
            container, engines.urls, queue, resumed.rollout if resumed else None, queued
        )
        trainer = FullyAsyncTrainerActor.remote(container, engines.urls, queue, executor)
        stack.callback(_stop_actors, queue, executor, trainer)
        _install_signal_handlers()
        sync_timeout = float(cfg.param_sync.timeout_s) * 4
        if resumed is not None:
            ray.get(trainer.load_state_dict.remote(resumed.trainer), timeout=300)
            # Fresh engines hold the initial weights: give them the checkpoint's, under its version.
            ray.get(trainer.sync_weights.remote(False), timeout=sync_timeout)
            print(f"resumed from {resume_path} at step {step} (version {resumed.meta.get('version')})", flush=True)

        def watch_engines() -> None:
            for event in supervisor.poll():
                if isinstance(event, EngineReplaced):
                    # Weights first, then traffic: the executor must not send rollouts to an engine that is not
                    # yet at the trainer's version.
                    version = ray.get(trainer.replace_engine.remote(event.old_url, event.new_url), timeout=sync_timeout)
                    ray.get(executor.replace_engine.remote(event.old_url, event.new_url), timeout=60)
                    print(f"engine {event.index} restarted at {event.new_url} (weight version {version})", flush=True)
                else:
                    print(
                        f"engine {event.index} lost ({event.url}: {event.reason}); "
                        f"continuing with {supervisor.num_alive} engine(s)",
                        flush=True,
                    )

        def checkpoint(at_step: int) -> None:
            rollout_state, groups = ray.get(executor.checkpoint_state.remote(), timeout=120)
            trainer_state = ray.get(trainer.state_dict.remote(), timeout=300)
            meta = {"version": int(trainer_state["version"]), "config_hash": config_hash(container)}
            path = checkpoints.save(at_step, trainer=trainer_state, rollout=rollout_state, queue=groups, meta=meta)
            logger.info("checkpoint %s", path)

        try:
            if cfg.trainer.val_before_train and resumed is None:
                val = ray.get(executor.validate.remote(), timeout=float(cfg.engines.request_timeout_s))
                initial_acc = val.get("val/accuracy")
                sink.log(0, val)
                print(f"initial validation accuracy {initial_acc:.1%} (version 0)", flush=True)
            run_ref = executor.run.remote()
            test_freq, save_freq = int(cfg.trainer.test_freq), int(cfg.trainer.save_freq)
            step_timeout = float(at.queue_get_timeout_s) + 120
            while total is None or step < total:
                watch_engines()  # between steps too: a short step never leaves the wait below to watch
                metrics = _step(trainer, run_ref, timeout_s=step_timeout, while_waiting=watch_engines)
                if metrics is None:
                    print(f"prompt data exhausted after {step} steps", flush=True)
                    break
                step += 1
                queue_stats = ray.get(queue.stats.remote(), timeout=60)
                metrics.update(prefixed("queue", queue_stats))
                metrics.update(supervisor.metrics())
                if test_freq > 0 and step % test_freq == 0 and step != total:
                    metrics.update(ray.get(executor.validate.remote(), timeout=float(cfg.engines.request_timeout_s)))
                ledger = ray.get(executor.ledger_counts.remote(), timeout=60)
                metrics.update(prefixed("ledger", ledger))
                sink.log(step, metrics)
                print(progress_line(step, total, metrics), flush=True)
                if save_freq > 0 and step % save_freq == 0:
                    checkpoint(step)
            # The last step's weights reach the engines before the final measurement.
            if step % int(at.trigger_parameter_sync_step):
                ray.get(trainer.sync_weights.remote(), timeout=sync_timeout)
            if not (save_freq > 0 and step % save_freq == 0):  # not just saved
                checkpoint(step)
        except KeyboardInterrupt:
            # Ctrl-C / SIGTERM: keep what was learned if the actors still answer, then unwind (stop everything).
            print(f"interrupted at step {step}: saving a checkpoint, then stopping", file=sys.stderr, flush=True)
            try:
                checkpoint(step)
            except Exception as exc:  # best effort: the previous checkpoint stays usable
                print(f"checkpoint on interrupt failed: {exc}", file=sys.stderr, flush=True)
            raise
        except Exception as exc:
            cause = root_cause(exc)
            logger.error("run failed at step %d", step, exc_info=exc)
            try:
                checkpoint(step)
                saved = f"checkpoint at step {step} saved in {checkpoints.root}"
            except Exception as ckpt_exc:  # the previous checkpoint stays usable
                saved = f"no new checkpoint ({type(root_cause(ckpt_exc)).__name__}: {root_cause(ckpt_exc)})"
            raise RunFailedError(f"step {step + 1}: {type(cause).__name__}: {cause} [{saved}]") from exc
        ray.get(executor.stop.remote(), timeout=60)
        _wait_run(run_ref)
        val = ray.get(executor.validate.remote(), timeout=float(cfg.engines.request_timeout_s))
        final_acc = val.get("val/accuracy")
        ledger = ray.get(executor.ledger_counts.remote(), timeout=60)
        sink.log(step, val | prefixed("ledger", ledger))

    summary = RunSummary(step, initial_acc, final_acc, time.monotonic() - started, ledger, str(run_dir))
    print_summary(summary)
    return summary


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
    import ray

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


def _wait_run(run_ref: Any) -> None:
    import ray

    ray.get(run_ref, timeout=120)


def _stop_actors(*handles: Any) -> None:
    import ray

    for handle in handles:
        try:
            ray.kill(handle)
        except Exception:  # already gone
            logger.debug("actor already gone", exc_info=True)


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
