"""Megatron policy backend (GPU only): verl's MegatronPPOActor with the fully-async flag switched on.

What this module does: builds verl's `McoreActorConfig` with `fully_async=True` and wraps verl's
`MegatronPPOActor` around Megatron modules and a distributed optimizer that the caller has built (the way verl's
megatron worker does: `get_model` + mbridge + `get_megatron_optimizer`), and runs one fully-async update. Under the
flag the patched actor sees the whole batch as one mini-batch (one optimizer step) and skips a batch without
response tokens on every data-parallel rank; `old_log_probs` always came from the batch on Megatron.

What it does not do (see patches/README.md): make "token-mean" independent of the micro-batch split, which on
Megatron needs a change to megatron-core's loss scaling; and it has never run here, since megatron-core's forward
needs CUDA. It imports without megatron installed; megatron is imported when an actor is built.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping
from typing import Any

from rllm.experimental.fully_async.backends import FULLY_ASYNC_FLAG, build_verl_actor_config

logger = logging.getLogger(__name__)

__all__ = ["FULLY_ASYNC_FLAG", "build_actor_config", "build_megatron_actor", "megatron_available", "update_policy"]

_SECTION_TARGETS = {
    "optim": "verl.workers.config.McoreOptimizerConfig",
    "megatron": "verl.workers.config.McoreEngineConfig",
    "policy_loss": "verl.workers.config.PolicyLossConfig",
}
INSTALL_HINT = "bash install/install_megatron_sglang.sh"


def megatron_available() -> bool:
    """True when megatron-core is installed (it still needs a GPU to run a forward pass)."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:  # no top-level `megatron` package at all
        return False


def build_actor_config(actor_cfg: Mapping[str, Any]) -> Any:
    """verl's McoreActorConfig from an `actor_rollout_ref.actor` section (as in _generated_ppo_megatron_trainer.yaml),
    with `fully_async` on."""
    return build_verl_actor_config(actor_cfg, "verl.workers.config.McoreActorConfig", _SECTION_TARGETS)


def build_megatron_actor(
    actor_cfg: Mapping[str, Any],
    *,
    model_config: Any,
    hf_config: Any,
    tf_config: Any,
    actor_module: Any,
    actor_optimizer: Any,
) -> Any:
    """verl's MegatronPPOActor in fully-async mode, around modules and optimizer the caller built.

    The arguments after `actor_cfg` are MegatronPPOActor's own: the model config (vocab_size, hidden_size), the HF
    config, megatron-core's TransformerConfig, the `nn.ModuleList` of this pipeline stage's (virtual) chunks, and
    megatron-core's DistributedOptimizer.
    """
    from rllm.experimental.fully_async.verl_patch import require_patched_verl

    require_patched_verl()
    if not megatron_available():
        raise RuntimeError(f"megatron-core is not installed (GPU hosts only); install it with: {INSTALL_HINT}")
    from verl.workers.actor.megatron_actor import MegatronPPOActor

    config = build_actor_config(actor_cfg)
    logger.info("building MegatronPPOActor in fully-async mode")
    return MegatronPPOActor(
        config=config,
        model_config=model_config,
        hf_config=hf_config,
        tf_config=tf_config,
        actor_module=actor_module,
        actor_optimizer=actor_optimizer,
    )


def update_policy(actor: Any, data: Any) -> dict[str, float]:
    """One fully-async step: the patched iterator yields the whole batch once; metrics reduced to floats.

    `data` is the DataProto described in backends/fsdp.py (FSDPPolicyBackend.update_policy). Metrics are only
    valid on the last pipeline stage, as verl documents for MegatronPPOActor.update_policy.
    """
    from verl.utils.metric import reduce_metrics

    metrics = actor.update_policy(actor.make_minibatch_iterator(data))
    return {key: float(value) for key, value in reduce_metrics(metrics).items()}
