"""Megatron policy backend: verl 0.7.1's Megatron worker and its patched MegatronPPOActor behind the trainer's backend
interface (`api/policy_backend.py`).

`actor_rollout_ref.actor.strategy: megatron` trains through verl's own Megatron code. `MegatronPolicyBackend` builds
verl's `ActorRolloutRefWorker(config, role="actor")` in this process and calls its `init_model()`, so
torch.distributed (gloo for CPU tensors + NCCL), megatron-core's parallel state (tensor/pipeline/context/expert
sizes from `actor.megatron`), the model (mbridge or verl's loader, HF weights from `model.path`), the
DistributedOptimizer, its LR schedule and the `MegatronPPOActor` are exactly verl's. verl's worker is a Ray
single-controller worker: it reads WORLD_SIZE/RANK/MASTER_ADDR/MASTER_PORT/LOCAL_RANK, which are filled in for a
world of one when absent (a multi-GPU trainer is started by torchrun, which sets them). It then trains through the
patched actor (`fully_async` on: one mini-batch, one optimizer step, a batch without response tokens skipped on
every data-parallel rank). Interface, as `FSDPPolicyBackend` (backends/fsdp.py): `compute_log_prob`,
`update_policy`, `save_hf` (HF safetensors folder for the disk transport; `hf_weight_stream` is the same
`(name, tensor)` stream for the distributed one), and `state_dict`/`load_state_dict` (this rank's shard: resume
needs the same parallel layout). The backend needs CUDA and has not run in this project's CI (no GPU): see
tests/gpu/test_megatron_gpu.py.

What runs anywhere: importing this module imports neither megatron nor CUDA code (they are imported where used).
`build_worker_config` (the `actor_rollout_ref` section verl's worker reads, with the flag on) and
`build_actor_config` (verl's McoreActorConfig) are tested on CPU; `megatron_unusable_reason` says in one line why
the Megatron path cannot run here (no CUDA, megatron-core or mbridge missing, TransformerEngine's PyTorch extension
missing); the doctor, the installer's last line and the Megatron GPU test print it, and `require_megatron_stack`
raises it (`build_megatron_backend` calls it before touching megatron).

Megatron -> Hugging Face weights (`write_hf_folder` and the name mapping) are in `megatron_weights.py`.

TransformerEngine: verl 0.7.1 builds Megatron's layers with TransformerEngine's (`transformer_engine.pytorch`,
whose compiled part is the top-level module `transformer_engine_torch`). megatron-core 0.16.1 accepts 2.9-2.11;
for none of them does PyPI carry a binary wheel of `transformer-engine-torch` (source only, checked 2026-11-25;
`transformer-engine` and `transformer-engine-cu12` do have wheels), so an install from binary wheels has no
Megatron path: install/install_megatron_sglang.sh then says so, and TE_WHEEL=<wheel> or BUILD_TE=1 fix it.

Not done (see patches/README.md): "token-mean" independent of the micro-batch split, which on Megatron needs a
change to megatron-core's loss scaling; on Megatron it stays verl's mean of micro-batch token means.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import socket
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rllm.experimental.fully_async.backends import (
    FULLY_ASYNC_FLAG,
    build_verl_actor_config,
    require_batch_keys,
    to_cpu,
)
from rllm.experimental.fully_async.backends.megatron_weights import write_hf_folder
from rllm.experimental.fully_async.backends.verl_patch import require_patched_verl

logger = logging.getLogger(__name__)

__all__ = [
    "FULLY_ASYNC_FLAG",
    "INSTALL_HINT",
    "MegatronPolicyBackend",
    "build_actor_config",
    "build_megatron_backend",
    "build_worker_config",
    "megatron_available",
    "megatron_unusable_reason",
    "require_megatron_stack",
    "transformer_engine_available",
]

_SECTION_TARGETS = {
    "optim": "verl.workers.config.McoreOptimizerConfig",
    "megatron": "verl.workers.config.McoreEngineConfig",
    "policy_loss": "verl.workers.config.PolicyLossConfig",
}
INSTALL_HINT = "bash install/install_megatron_sglang.sh"
CUDA_REFUSAL = (
    "'actor_rollout_ref.actor.strategy=megatron' needs CUDA (megatron-core's forward runs on GPUs only) and none "
    "is available here; use strategy: fsdp2 on this machine"
)


TE_MISSING = (
    "TransformerEngine's PyTorch extension (transformer_engine_torch) is not installed, and verl builds Megatron's "
    "layers with it: PyPI has no binary wheel of transformer-engine-torch 2.9-2.11 (the versions megatron-core "
    f"0.16.1 accepts), only source; run TE_WHEEL=<a wheel for this torch and CUDA> {INSTALL_HINT}, or BUILD_TE=1 "
    "(compiles, about an hour)"
)


def _installed(module: str) -> bool:
    """Is `module` importable? Located with find_spec, never imported (TransformerEngine loads CUDA libraries)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return False


def megatron_available() -> bool:
    """True when megatron-core is installed (it still needs a GPU to run a forward pass)."""
    return _installed("megatron.core")


def transformer_engine_available() -> bool:
    """True when TransformerEngine and its compiled PyTorch extension are both installed."""
    return _installed("transformer_engine") and _installed("transformer_engine_torch")


def megatron_unusable_reason(cuda_available: bool | None = None) -> str | None:
    """One line saying why the Megatron path cannot run on this host, or None when it can.

    `cuda_available` defaults to `torch.cuda.is_available()`; everything else is looked up without importing it.
    """
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    problems = []
    if not cuda_available:
        problems.append("no CUDA device (megatron-core's forward runs on GPUs only)")
    packages = (("megatron-core", "megatron.core"), ("mbridge", "mbridge"))
    missing = [name for name, module in packages if not _installed(module)]
    if missing:
        problems.append(f"{' and '.join(missing)} not installed ({INSTALL_HINT})")
    if not transformer_engine_available():
        problems.append(TE_MISSING)
    return f"Megatron path unusable: {'; '.join(problems)}" if problems else None


def require_megatron_stack() -> None:
    """Raise RuntimeError (one line) unless CUDA, megatron-core, mbridge and TransformerEngine are all here.

    Without CUDA the message is CUDA_REFUSAL, the one the config loader gives.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(CUDA_REFUSAL)
    reason = megatron_unusable_reason(cuda_available=True)
    if reason is not None:
        raise RuntimeError(reason)


def build_actor_config(actor_cfg: Mapping[str, Any]) -> Any:
    """verl's McoreActorConfig from an `actor_rollout_ref.actor` section (as in _generated_ppo_megatron_trainer.yaml),
    with `fully_async` on."""
    return build_verl_actor_config(actor_cfg, "verl.workers.config.McoreActorConfig", _SECTION_TARGETS)


def build_worker_config(actor_rollout_ref: Mapping[str, Any]) -> Any:
    """The `actor_rollout_ref` DictConfig verl's Megatron `ActorRolloutRefWorker` reads, for role "actor".

    `actor_rollout_ref` is the loaded config's section (composed on `ppo_megatron_trainer`, so every Megatron key
    is there). The actor gets `fully_async: true` (the patched MegatronPPOActor's switch); the worker multiplies
    `ppo_mini_batch_size` by `rollout.n` and divides it by the data-parallel size, which under the flag decides
    nothing (the whole batch is the mini-batch), so it is left as configured. The config is checked by building
    verl's McoreActorConfig from it, as the worker will.
    """
    if isinstance(actor_rollout_ref, DictConfig):
        raw = OmegaConf.to_container(actor_rollout_ref, resolve=True)
    else:
        raw = OmegaConf.to_container(OmegaConf.create(dict(actor_rollout_ref)), resolve=True)
    actor = raw["actor"]
    if actor.get("strategy") != "megatron":
        raise ValueError(f"actor_rollout_ref.actor.strategy must be megatron, got {actor.get('strategy')!r}")
    actor[FULLY_ASYNC_FLAG] = True
    build_actor_config(actor)  # fails here, on any machine, where the worker would fail on the GPU
    return OmegaConf.create(raw)


LOG_PROB_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
UPDATE_KEYS = (*LOG_PROB_KEYS, "response_mask", "old_log_probs", "advantages")
OPTIONAL_UPDATE_KEYS = ("rollout_log_probs", "rollout_is_weights")


def build_megatron_backend(actor_rollout_ref: Mapping[str, Any], *, seed: int = 0) -> MegatronPolicyBackend:
    """The backend for a config's `actor_rollout_ref` section; refuses in one line without CUDA, megatron-core,
    mbridge or TransformerEngine."""
    require_megatron_stack()
    return MegatronPolicyBackend(actor_rollout_ref, seed=seed)


def _single_process_env() -> None:
    """What torchrun would set, for a world of one (verl's Worker reads these)."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    for key, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)


class MegatronPolicyBackend:
    """verl's Megatron actor worker (model, DistributedOptimizer, LR schedule, patched MegatronPPOActor)."""

    def __init__(self, actor_rollout_ref: Mapping[str, Any], *, seed: int = 0) -> None:
        # lazy: Megatron is an optional GPU dependency (verl's Megatron worker imports megatron-core)
        from verl.workers.megatron_workers import ActorRolloutRefWorker

        require_megatron_stack()
        require_patched_verl()  # unpatched verl would take several optimizer steps per batch
        config = build_worker_config(actor_rollout_ref)
        config.actor.megatron.seed = int(seed)
        _single_process_env()
        self.worker = ActorRolloutRefWorker(config, role="actor")
        self.worker.init_model()
        self.actor = self.worker.actor
        self.config = config
        # lazy: Megatron is an optional GPU dependency
        from megatron.core import parallel_state as mpu

        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()
        self._last_stage = mpu.is_pipeline_last_stage(ignore_virtual=True)
        self.param_dtype = str(self.worker.dtype).removeprefix("torch.")
        self.optimizer_steps = 0
        logger.info(
            "megatron backend: %s, world %d (tp %d, pp %d, cp %d, dp %d)",
            config.model.path,
            self.world_size,
            mpu.get_tensor_model_parallel_world_size(),
            mpu.get_pipeline_model_parallel_world_size(),
            mpu.get_context_parallel_world_size(),
            mpu.get_data_parallel_world_size(),
        )

    # ------------------------------------------------------------------------------------------------------------
    # PPO
    # ------------------------------------------------------------------------------------------------------------

    def compute_log_prob(self, data: Any, weights: str = "current") -> torch.Tensor:
        """log pi(response token | prefix) at meta_info['temperature'], float32 [B, R] on CPU (last PP stage;
        broadcast by verl to every stage). Only the current weights: this backend keeps no earlier ones."""
        # lazy: verl (~3 s) stays out of megatron_unusable_reason's import by settings/validate and the doctor
        from verl import DataProto

        if weights != "current":
            raise ValueError(f"the Megatron backend computes log-probs under its current weights only, not {weights!r}")

        require_batch_keys(data, LOG_PROB_KEYS, "compute_log_prob")
        rollout = self.config.rollout
        actor = self.config.actor
        meta = {
            "micro_batch_size": rollout.get("log_prob_micro_batch_size_per_gpu") or actor.ppo_micro_batch_size_per_gpu,
            "max_token_len": rollout.get("log_prob_max_token_len_per_gpu") or actor.ppo_max_token_len_per_gpu,
            "use_dynamic_bsz": bool(rollout.get("log_prob_use_dynamic_bsz", actor.use_dynamic_bsz)),
            **data.meta_info,
        }
        view = DataProto(batch=data.batch.select(*LOG_PROB_KEYS).clone(), meta_info=meta)
        log_probs, _, _ = self.actor.compute_log_prob(data=view, calculate_entropy=False)
        return log_probs.float().cpu()

    def update_policy(self, data: Any) -> dict[str, float]:
        """One optimizer step on the whole batch (none without response tokens), as FSDPPolicyBackend's.

        Metrics are verl's (valid on the last pipeline stage) plus `actor/lr` and `actor/optimizer_step`.
        """
        # lazy: verl (~3 s) stays out of megatron_unusable_reason's import by settings/validate and the doctor
        from verl import DataProto
        from verl.utils.megatron.optimizer import get_megatron_last_lr
        from verl.utils.metric import reduce_metrics

        require_batch_keys(data, UPDATE_KEYS, "update_policy")
        present = set(data.batch.keys())
        keys = [*UPDATE_KEYS, *(k for k in OPTIONAL_UPDATE_KEYS if k in present)]
        meta = {"micro_batch_size": self.config.actor.ppo_micro_batch_size_per_gpu, **data.meta_info}
        view = DataProto(batch=data.batch.select(*keys).clone(), meta_info=meta)
        lr = float(get_megatron_last_lr(self.worker.actor_optimizer))
        # the patched make_minibatch_iterator yields the whole batch once; update_policy skips it without tokens
        raw = self.actor.update_policy(self.actor.make_minibatch_iterator(view))
        metrics = {key: float(value) for key, value in reduce_metrics(raw).items()}
        stepped = "actor/grad_norm" in raw and math.isfinite(metrics.get("actor/grad_norm", math.nan))
        if stepped:
            self.worker.actor_optimizer_scheduler.step(1)
            self.optimizer_steps += 1
        metrics["actor/lr"] = lr
        metrics["actor/optimizer_step"] = float(stepped)
        return metrics

    # ------------------------------------------------------------------------------------------------------------
    # Weights out
    # ------------------------------------------------------------------------------------------------------------

    def hf_weight_stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors, one at a time, as verl's rollout_mode hands them to its engines (collective:
        every rank must drain it; TP/PP gathering happens inside)."""
        worker = self.worker
        if worker.bridge is not None:
            if worker.vanilla_bridge:
                return worker.bridge.export_weights(self.actor.actor_module)
            return worker.bridge.export_hf_weights(self.actor.actor_module)
        # lazy: Megatron is an optional GPU dependency (verl's megatron_utils imports megatron-core)
        from verl.utils.megatron_utils import per_tensor_generator

        return per_tensor_generator(
            self.actor.actor_module,
            worker.actor_model_config,
            worker.weight_converter,
            worker.tf_config,
            worker.layer_name_mapping,
        )

    def save_hf(self, path: str | os.PathLike[str], dtype: str | None = None) -> None:
        """Write the current weights as an HF safetensors folder (collective; rank 0 writes)."""
        stream = ((name, tensor.detach().cpu()) for name, tensor in self.hf_weight_stream())
        if self.rank == 0:
            write_hf_folder(
                stream, path, hf_config=self.worker.hf_config, source_dir=self.worker.local_path, dtype=dtype
            )
        else:
            for _ in stream:  # the generator's collectives must run on every rank
                pass
        if self.world_size > 1:
            torch.distributed.barrier()

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints: this rank's shard
    # ------------------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's model chunks, DistributedOptimizer state and LR schedule (tensors on CPU)."""
        return {
            "model": [to_cpu(chunk.state_dict()) for chunk in self.actor.actor_module],
            "optimizer": to_cpu(self.worker.actor_optimizer.state_dict()),
            "lr_scheduler": self.worker.actor_optimizer_scheduler.state_dict(),
            "optimizer_steps": self.optimizer_steps,
            "layout": {"rank": self.rank, "world_size": self.world_size},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned on the same rank of the same parallel layout."""
        layout = {"rank": self.rank, "world_size": self.world_size}
        if state.get("layout") != layout:
            raise ValueError(f"checkpoint shard is for {state.get('layout')}, this rank is {layout}")
        for chunk, chunk_state in zip(self.actor.actor_module, state["model"], strict=True):
            chunk.load_state_dict(chunk_state)
        self.worker.actor_optimizer.load_state_dict(state["optimizer"])
        self.worker.actor_optimizer_scheduler.load_state_dict(state["lr_scheduler"])
        self.optimizer_steps = int(state["optimizer_steps"])
