"""The trainer process wired from the run spec (docs/design.md#rule-one-wiring-place): the policy backend, its
ParamSync, the critic, the correction, the adaptive staleness controller, the dump and the batch recorder, assembled
into a FullyAsyncTrainer.

The trainer actor (actor.py) and `replay` (replay.py) both build the trainer here, so a replay runs the training code
the run ran.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import ray
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from rllm.experimental.fully_async.algorithms.corrections import corrector_for
from rllm.experimental.fully_async.backends.critic import FSDPCriticBackend
from rllm.experimental.fully_async.backends.fsdp import FSDPPolicyBackend, build_actor_config, model_dtype
from rllm.experimental.fully_async.backends.megatron import build_megatron_backend
from rllm.experimental.fully_async.backends.verl_patch import require_patched_verl
from rllm.experimental.fully_async.core.adaptive_staleness import StalenessController
from rllm.experimental.fully_async.core.addresses import resolve_master_address
from rllm.experimental.fully_async.observe.dumps import write_training_batch
from rllm.experimental.fully_async.run_spec import RunSpec, thaw
from rllm.experimental.fully_async.runtime.rollout.build import lora_keep as rollout_lora_keep
from rllm.experimental.fully_async.runtime.sync.param_sync import (
    DiskTransport,
    ParamSync,
    resolve_sync_dtype,
    transport_from_config,
)
from rllm.experimental.fully_async.runtime.trainer.fully_async_trainer import FullyAsyncTrainer, TrainerSettings
from rllm.experimental.fully_async.runtime.trainer.ranks import DistributedPolicyBackend
from rllm.experimental.fully_async.runtime.trainer.record import BatchRecorder

logger = logging.getLogger(__name__)


def build_policy_backend(t: Any, correction: Any = None, ranks: dict | None = None) -> tuple[Any, str]:
    """The policy backend a trainer spec (RunSpec.trainer) asks for, and its parameters' dtype (for param_sync).

    Megatron (CUDA only), N FSDP2 rank actors (`trainer.n_gpus_per_node x nnodes` > 1), or one in-process
    FSDPPolicyBackend; every kind gets the whole actor section and `model.enable_gradient_checkpointing`.
    `correction` (algorithms.corrections) may replace verl's loss with the decoupled one; `ranks`: a cluster
    placement's Ray options and devices for the rank actors.
    """

    actor_cfg = OmegaConf.create(thaw(t.actor))  # verl builds its own dataclasses from a mutable copy
    # prox_log_probs=previous (or its synchronous control): the backend keeps the weights of the previous version
    keep_previous = correction is not None and correction.uses_previous_weights
    lora = t.lora.peft_kwargs() if getattr(t, "lora", None) is not None else None
    if correction is not None and correction.policy_loss_mode is not None:
        # decoupled PPO with the proximal policy from the update itself: its loss replaces verl's vanilla one
        actor_cfg.policy_loss.loss_mode = correction.policy_loss_mode
    if t.strategy == "megatron":  # verl's Megatron worker, CUDA only (backends/megatron.py)
        rollout_ref = OmegaConf.create(thaw(t.actor_rollout_ref))
        rollout_ref.actor = actor_cfg  # with the decoupled loss, if any
        backend = build_megatron_backend(rollout_ref, seed=t.seed)
        return backend, backend.param_dtype
    if t.world_size > 1:
        # N rank actors in one torch.distributed group (gloo on CPU, NCCL on GPU), each with its FSDP2 shard;
        # one optimizer step per batch across them (runtime/trainer/ranks.py). verl counts trainer devices as
        # n_gpus_per_node x nnodes: one rank per device.

        backend: Any = DistributedPolicyBackend(
            t.model_path,
            actor_cfg,
            world=t.world_size,
            device=t.device,
            nnodes=t.nnodes,
            seed=t.seed,
            enable_gradient_checkpointing=t.enable_gradient_checkpointing,
            keep_previous_weights=keep_previous,
            lora=lora,
            rank_options=ranks["options"] if ranks else None,
            rank_devices=ranks["devices"] if ranks else None,
        )
        # the ranks hold parameters in fsdp_config.model_dtype (verl's actor autocasts on GPU)
        return backend, str(model_dtype(build_actor_config(actor_cfg)))
    backend = FSDPPolicyBackend(
        t.model_path,
        actor_cfg,
        seed=t.seed,
        enable_gradient_checkpointing=t.enable_gradient_checkpointing,
        keep_previous_weights=keep_previous,
        lora=lora,
    )
    return backend, str(next(backend.model.parameters()).dtype)


def build_critic_backend(t: Any) -> Any:
    """The value model a trainer spec asks for (algorithm.adv_estimator=gae): verl's critic on the policy's folder."""

    return FSDPCriticBackend(t.model_path, OmegaConf.create(thaw(t.critic)), seed=t.seed)


def _master_address(sync: Any, backend: Any, engine_urls: list[str]) -> str:
    """param_sync.master_address resolved (core/addresses.py): rank 0 is this process, or the worker group's
    rank 0 actor, which may run on another node."""

    if sync.transport == "disk":
        return "127.0.0.1"  # unused
    here = ray.util.get_node_ip_address()
    rank0 = backend.rank_zero_address() if hasattr(backend, "rank_zero_address") else here
    address = resolve_master_address(sync.master_address, rank0, engine_urls, here)
    logger.info("weight-update group: engines reach trainer rank 0 (node %s) at %s", rank0, address)
    return address


def build_trainer(
    spec: Any, rollouts: Any, param_sync_for: Any = None, *, ranks: dict | None = None, record: Any = None
) -> Any:
    """The run's FullyAsyncTrainer from its frozen RunSpec: the policy backend (`build_policy_backend`), the
    correction, the critic (GAE), the adaptive staleness controller, the trajectory dump and the batch recorder. The
    trainer actor and `replay` both build it here, so a replay runs the training code the run ran.

    `rollouts`: an api.step_messages.RolloutSource; `param_sync_for(backend, param_dtype)`: the ParamSync of a run
    (None: no engines; a sync then only bumps the version, as in replay); `record`: a RecordTarget
    (runtime/trainer/record.py) or None.
    """

    require_patched_verl()
    t = spec.trainer
    tokenizer = AutoTokenizer.from_pretrained(t.model_path)
    correction = corrector_for(t.correction, compute_prox_log_prob=t.compute_prox_log_prob)
    backend, param_dtype = build_policy_backend(t, correction, ranks)
    param_sync = param_sync_for(backend, param_dtype) if param_sync_for is not None else None
    settings = TrainerSettings(
        required_samples=spec.schedule.required_samples,
        trigger_parameter_sync_step=spec.schedule.trigger_parameter_sync_step,
        use_rollout_log_probs=t.use_rollout_log_probs,
        compute_prox_log_prob=t.compute_prox_log_prob,
        temperature=t.temperature,
        pad_token_id=int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0),
        queue_get_timeout_s=t.queue_get_timeout_s,
        on_engine_failure=spec.engines.on_engine_failure,
        max_response_length=t.max_response_length,
        max_prompt_length=spec.executor.data.max_prompt_length,
        world_size=t.world_size,
        lora=t.lora is not None,
    )
    critic = build_critic_backend(t) if t.critic is not None else None  # algorithm.adv_estimator=gae
    adaptive = spec.schedule.adaptive
    recorder = None
    if record is not None:
        recorder = BatchRecorder(record, backend)
    return FullyAsyncTrainer(
        settings,
        backend,
        rollouts,
        param_sync,
        advantages=t.advantages,
        correction=correction,
        critic=critic,
        dump=_training_dump(spec.run.rollout_data_dir, tokenizer),
        staleness=StalenessController(adaptive, spec.schedule.max_staleness) if adaptive is not None else None,
        recorder=recorder,
    )


def _training_dump(directory: str | None, tokenizer: Any) -> Any:
    """trainer.rollout_data_dir: each step's trained trajectories as {step}.jsonl (observe/dumps.py); None: off."""
    if not directory:
        return None

    return lambda step, groups, data: write_training_batch(Path(directory), step, groups, data, tokenizer)


def param_sync_factory(spec: RunSpec, engine_urls: list[str], api_key: str | None) -> Any:
    """`param_sync_for(backend, param_dtype)`: the run's ParamSync over `engine_urls`, once the backend exists.

    disk: an HF folder per version; distributed (or nccl): buckets broadcast by the process that holds full parameters
    (this one, or trainer rank 0 with several ranks), reached by the engines at param_sync.master_address.
    """
    sync = spec.param_sync

    # LoRA: each engine keeps the η_max + 1 adapter versions the staleness bound admits (settings/derive.py)
    lora_keep = rollout_lora_keep(spec)

    def param_sync_for(backend: Any, param_dtype: str) -> ParamSync:
        dtype = resolve_sync_dtype(sync.dtype, spec.trainer.device, param_dtype)
        transport = transport_from_config(
            sync, backend, dtype, master_address=_master_address(sync, backend, engine_urls)
        )
        if lora_keep is not None:
            # the folders of every version an engine may still load (SGLang reloads an evicted adapter by its path)
            transport = DiskTransport(Path(sync.weights_dir), keep=lora_keep + 1)
        return ParamSync(
            engine_urls,
            transport,
            pause_timeout_s=sync.timeout_s,
            update_timeout_s=sync.timeout_s,
            continue_timeout_s=sync.timeout_s,
            weights_dtype=dtype,
            api_key=api_key,
            lora_keep=lora_keep,
        )

    return param_sync_for
