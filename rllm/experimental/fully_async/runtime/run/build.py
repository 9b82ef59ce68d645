"""The driver's process wired from a checked config, in one place (docs/design.md#rule-one-wiring-place).

`prepare_run(cfg, rllm_functions)` makes the config final and freezes it: the built-in task's data and model, the
prompt data checked, the LR schedule's horizon, the run directory settled (finished? fresh? a resume whose config
may change? runtime/run/run_dir.py), then the frozen `RunSpec` every actor reads.
`start_processes(spec, ...)` starts what the run runs on, in order: the engines (on this host, or through engine
hosts on a Ray cluster), their supervisor, Ray, the batch record, the rollout service actor and the trainer actor
(each of which wires its own process: runtime/rollout/build.py, runtime/trainer/build.py). Every process it starts
is registered on the caller's ExitStack as it starts, so a failed or interrupted start stops what had started.
`Run` (driver.py) calls both, then resumes or validates, and steps.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from omegaconf import DictConfig

from rllm.experimental.fully_async.api.rollout_functions import RolloutFunctions, with_rllm_functions
from rllm.experimental.fully_async.backends.verl_patch import require_patched_verl
from rllm.experimental.fully_async.engines.from_config import engine_launcher
from rllm.experimental.fully_async.engines.launcher import interrupts_deferred
from rllm.experimental.fully_async.engines.supervisor import EngineSupervisor
from rllm.experimental.fully_async.run_spec import RunSpec, build_run_spec
from rllm.experimental.fully_async.runtime.checkpoints.store import Checkpoint
from rllm.experimental.fully_async.runtime.cluster.multi_node import start_on_cluster
from rllm.experimental.fully_async.runtime.cluster.one_host import (
    host_plan,
    ray_gpu_environment,
    ray_num_gpus,
    trainer_actor_gpus,
)
from rllm.experimental.fully_async.runtime.cluster.ray_session import init_ray, ray_lifetime
from rllm.experimental.fully_async.runtime.rollout.actor import RolloutServiceActor
from rllm.experimental.fully_async.runtime.run.prepare import check_data, prepare_task
from rllm.experimental.fully_async.runtime.run.run_dir import settle_run_dir
from rllm.experimental.fully_async.runtime.trainer.actor import FullyAsyncTrainerActor
from rllm.experimental.fully_async.runtime.trainer.record import open_record

logger = logging.getLogger(__name__)

Phase = Callable[[str], None]  # told the name of each start-up phase as it begins (the progress display)


def _no_phase(name: str) -> None:
    """The default Phase: nothing to show."""


@dataclass
class RunProcesses:
    """What `start_processes` started: the engines and their supervisor, the two actors."""

    engines: Any  # EngineLauncher or ClusterEngines: urls, api_key, processes
    supervisor: EngineSupervisor
    rollouts: Any  # RolloutServiceActor handle
    trainer: Any  # FullyAsyncTrainerActor handle


def prepare_run(cfg: DictConfig, rllm_functions: RolloutFunctions | None = None, phase: Phase = _no_phase) -> RunSpec:
    """Make `cfg` final (the task's paths filled in, the LR horizon set) and freeze it into the run spec; raises
    RunFinished for a run dir whose run already finished (run_dir.py). `rllm_functions`: AsyncAgentTrainer's."""
    require_patched_verl()
    phase(
        f"preparing the data and model of task {cfg.task.name}" if cfg.task.name else "checking the data and the model"
    )
    prepare_task(cfg)
    num_prompts = check_data(cfg)
    if cfg.trainer.total_training_steps is None:
        # Until the data runs out: the LR schedule's horizon is what verl derives, batches per epoch x epochs.
        steps = -(-num_prompts * int(cfg.trainer.total_epochs) // int(cfg.async_training.required_samples))
        for optim in (cfg.actor_rollout_ref.actor.optim, cfg.critic.optim):
            if optim.total_training_steps in (None, -1):
                optim.total_training_steps = steps
    settle_run_dir(cfg)  # already finished? a fresh start? a resume whose config may change? (run_dir.py)
    # Built once, here, after the task filled in its paths; the actors and the rest of this run read every setting
    # from it. The config itself is read after this only by start-up (the metrics sink, the engine launcher) and
    # hashed into each checkpoint (`config_hash`, which a resume compares).
    spec = with_rllm_functions(build_run_spec(cfg), rllm_functions)
    os.environ.setdefault("RLLM_LOG_LEVEL", spec.run.log_level)
    return spec


def runs_on_cluster(spec: RunSpec) -> bool:
    """Several nodes of a GPU run: the cluster's placement (runtime/cluster/multi_node.py); else this host's."""
    t = spec.trainer
    return t.nnodes > 1 and (spec.engines.backend == "sglang" or t.device == "cuda")


def start_processes(
    spec: RunSpec,
    stack: ExitStack,
    run_dir: Path,
    resumed: Checkpoint | None,
    config: dict[str, Any],
    phase: Phase = _no_phase,
) -> RunProcesses:
    """Start the engines, Ray and the two actors of a run (module docstring); `resumed` hands each actor its part of
    the checkpoint; `config` is the resolved config the batch record keeps."""
    on_cluster = runs_on_cluster(spec)
    gpu_plan = None if on_cluster else host_plan(spec)
    ranks = None  # where the trainer ranks go: their node's bundle and device, on a cluster
    e = spec.engines
    phase(f"starting {e.num_engines} {e.backend} engine{'s' if e.num_engines != 1 else ''} (each loads the model)")
    if on_cluster:  # Ray first there: engines start through actors on their nodes
        engines, ranks = start_on_cluster(spec, stack, run_dir / "engines")
    else:
        engines = stack.enter_context(engine_launcher(spec.engines, run_dir / "engines"))
    supervisor = EngineSupervisor(
        engines,
        spec.engines.on_engine_failure,
        max_restarts=spec.engines.max_restarts,
        startup_timeout_s=spec.engines.startup_timeout_s,
        # With none left the driver waits for one to join (engines.no_engine_timeout_s: runtime/run/elastic.py)
        stop_when_all_lost=False,
    )
    if not on_cluster:
        phase("starting Ray")
        # Ray sees only the plan's trainer GPUs, so no rank can land on an engine's GPU (runtime/cluster/one_host.py).
        with ray_gpu_environment(gpu_plan):
            start_ray = functools.partial(init_ray, num_gpus=ray_num_gpus(gpu_plan))
            stack.enter_context(ray_lifetime(start_ray))  # interrupts held while Ray starts (ray_session.py)
    record = None  # run.record_batches: a new segment of RUN_DIR/record/, cut at the step resumed from
    if spec.run.record_batches:
        record = open_record(
            run_dir,
            config,
            start_step=resumed.step if resumed is not None else 0,
            resumed_from=resumed.path.resolve() if resumed is not None else None,
            model_path=spec.trainer.model_path,
        )
    phase("starting the rollout service and the trainer (it loads the model)")
    # One rollout service (executor, queue, budget, ledger) and the trainer, which takes a batch from it with one
    # call per step; a resume hands each its own part of the checkpoint. An interrupt between creating an actor and
    # registering its cleanup would skip that actor's own shutdown (a multi-rank trainer's ranks): it is held until
    # both handles are registered.
    with interrupts_deferred():
        rollouts = RolloutServiceActor.remote(
            spec,
            engines.urls,
            resumed.rollout if resumed else None,
            resumed.queue if resumed else None,
            api_key=engines.api_key,
        )
        trainer = FullyAsyncTrainerActor.options(num_gpus=trainer_actor_gpus(spec)).remote(
            spec, engines.urls, rollouts, api_key=engines.api_key, ranks=ranks, record=record
        )
        stack.callback(stop_actors, rollouts, trainer)
        stack.callback(shutdown_trainer, trainer)  # first (LIFO): a multi-rank trainer's ranks
    return RunProcesses(engines, supervisor, rollouts, trainer)


def stop_actors(*handles: Any) -> None:
    for handle in handles:
        try:
            ray.kill(handle)
        except Exception:  # already gone
            logger.debug("actor already gone", exc_info=True)


def shutdown_trainer(trainer: Any) -> None:
    try:
        ray.get(trainer.shutdown.remote(), timeout=60)
    except Exception:  # the actor is gone or broken: killing it (next) also ends its rank actors' owner
        logger.debug("trainer shutdown failed", exc_info=True)
