"""Megatron policy backend, the part that runs without CUDA: configs and the CUDA check (GPU part: megatron_backend.py).

`actor_rollout_ref.actor.strategy: megatron` trains through verl 0.7.1's own Megatron code. The GPU part,
`backends/megatron_backend.py` (`MegatronPolicyBackend`), builds verl's `ActorRolloutRefWorker` in role "actor"
inside the trainer process, so parallel state (`mpu.initialize_model_parallel` with the tensor/pipeline/context
sizes of `actor.megatron`), the model (`make_megatron_module`, weights through mbridge or verl's loader) and the
distributed optimizer with its LR schedule are exactly what verl's Megatron worker builds; it then trains through
the patched `MegatronPPOActor` (`fully_async` on: one mini-batch, one optimizer step, a batch without response
tokens skipped on every data-parallel rank) and exports weights in HF layout (`backends/megatron_weights.py`).

This module imports neither megatron nor CUDA code: `build_worker_config` (the `actor_rollout_ref` section verl's
worker reads, with the flag on) and `build_actor_config` (verl's McoreActorConfig) are tested on CPU;
`require_cuda` is the one-line refusal a machine without CUDA gets (`megatron_backend.build_megatron_backend` calls
it before touching megatron).

Not done (see patches/README.md): "token-mean" independent of the micro-batch split, which on Megatron needs a
change to megatron-core's loss scaling; on Megatron it stays verl's mean of micro-batch token means.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping
from typing import Any

from rllm.experimental.fully_async.backends import FULLY_ASYNC_FLAG, build_verl_actor_config

logger = logging.getLogger(__name__)

__all__ = [
    "FULLY_ASYNC_FLAG",
    "INSTALL_HINT",
    "build_actor_config",
    "build_worker_config",
    "megatron_available",
    "require_cuda",
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


def megatron_available() -> bool:
    """True when megatron-core is installed (it still needs a GPU to run a forward pass)."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:  # no top-level `megatron` package at all
        return False


def require_cuda() -> None:
    """Raise RuntimeError (one line) unless CUDA and megatron-core are both here."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(CUDA_REFUSAL)
    if not megatron_available():
        raise RuntimeError(f"megatron-core is not installed (GPU hosts only); install it with: {INSTALL_HINT}")


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
    from omegaconf import DictConfig, OmegaConf

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
