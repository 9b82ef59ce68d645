"""Derived settings: the `null` values whose value follows from others, filled once after merging.

Each rule is documented on its field in `settings/schema.py`; rLLM's staleness keys are mapped by `settings/compat.py`.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from rllm.experimental.fully_async.core.versions import lora_versions_kept
from rllm.experimental.fully_async.errors import ConfigError
from rllm.experimental.fully_async.settings.compat import max_staleness_from_rllm


def resolve_derived(cfg: DictConfig) -> None:
    """Fill the `null` settings whose value follows from others (documented on each field)."""
    at = cfg.async_training
    if at.max_staleness is not None and at.staleness_threshold is not None:
        raise ConfigError(
            "'async_training.staleness_threshold' (rLLM's) only derives max_staleness when that is null, and "
            f"async_training.max_staleness={at.max_staleness} is set; remove one"
        )
    # The inputs of the derivations below are checked first, so a bad value is named by the key the user set, not by
    # the derived key it would make out of range (rollout.n=-3 gave "max_concurrent_rollouts must be >= 1, got -384").
    _at_least("actor_rollout_ref.rollout.n", cfg.actor_rollout_ref.rollout.n, 1)
    _at_least("async_training.required_samples", at.required_samples, 1)
    _at_least("async_training.max_staleness", at.max_staleness, 0)
    _at_least("data.train_batch_size", cfg.data.train_batch_size, 0)  # 0: rLLM's "batches come from the queue"
    if at.required_samples is None:
        if int(cfg.data.train_batch_size) < 1:
            raise ConfigError(
                "'async_training.required_samples' must be set when data.train_batch_size is 0 (rLLM's convention)"
            )
        at.required_samples = int(cfg.data.train_batch_size)
    if at.max_staleness is None:
        threshold = at.staleness_threshold if at.staleness_threshold is not None else 0.1  # rLLM's default
        try:
            at.max_staleness = max_staleness_from_rllm(
                threshold, int(at.required_samples), int(at.trigger_parameter_sync_step)
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    if at.compute_prox_log_prob and cfg.algorithm.off_policy_correction is None:
        # rLLM's compute_prox_log_prob means decoupled PPO with recomputed proximal log-probs (AReaL). rLLM's scripts
        # pair it with verl's rollout_correction.rollout_is (level) and rollout_is_threshold (cap): the importance
        # weight between those proximal log-probs and the rollout's, which is decoupled PPO's w at that level and
        # cap. They are folded in here (and reset), so the correction is stated once.
        correction = {"mode": "decoupled", "prox_log_probs": "recompute"}
        verl_section = cfg.algorithm.get("rollout_correction")
        if verl_section is not None and verl_section.get("rollout_is") is not None:
            correction |= {"level": str(verl_section.rollout_is), "cap": float(verl_section.rollout_is_threshold)}
            verl_section.rollout_is, verl_section.rollout_is_threshold = None, 2.0
        cfg.algorithm.off_policy_correction = correction
    actor = cfg.actor_rollout_ref.actor
    if actor.loss_agg_mode == "seq-mean-token-sum-norm" and actor.loss_scale_factor is None:
        # Dr.GRPO divides each sequence's token sum by a constant; verl's fallback is the padded width, which here
        # is the widest response of each batch (core/batch.py pads to it), so the normaliser would vary per step.
        actor.loss_scale_factor = int(cfg.data.max_response_length)
    n = int(cfg.actor_rollout_ref.rollout.n)
    if at.max_concurrent_rollouts is None:
        at.max_concurrent_rollouts = 2 * at.required_samples * n
    if at.queue_max_groups is None:
        # Room for every group the staleness rule can admit ahead of the trainer (at the largest η it may reach).
        at.queue_max_groups = (largest_staleness(at) + 2) * at.required_samples
    _derive_engine_lora(cfg)
    for optim in (cfg.actor_rollout_ref.actor.optim, cfg.critic.optim):
        if optim.total_training_steps in (None, -1) and cfg.trainer.total_training_steps is not None:
            # As verl's workers do at start-up: the LR schedule (cosine) spans the run's optimizer steps.
            optim.total_training_steps = int(cfg.trainer.total_training_steps)
    if cfg.run.dir is None:
        cfg.run.dir = str(Path("runs") / str(cfg.trainer.experiment_name))
    if cfg.param_sync.weights_dir is None:
        cfg.param_sync.weights_dir = str(Path(cfg.run.dir) / "weights")


def _at_least(key: str, value: object, minimum: int) -> None:
    """A user's integer input to a derivation: null (derived itself) or an integer >= minimum."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"'{key}' must be an integer >= {minimum}, got {value!r}", key=key)


def synchronous_notice(cfg: DictConfig) -> str | None:
    """One line for a run that trains synchronously without saying so: η = 0 with K = 1 (and no adaptive staleness)
    is on-policy training, every rollout waiting for the last weights. rLLM's default staleness_threshold 0.1
    derives η = 0 (settings/compat.py), so an rLLM script run unchanged gets it; s = 1.0 derives η = 1."""
    at = cfg.async_training
    if at.max_staleness != 0 or int(at.trigger_parameter_sync_step) != 1 or at.adaptive_staleness.enable:
        return None
    if at.staleness_threshold is not None:
        cause = f"async_training.staleness_threshold={at.staleness_threshold} derives max_staleness η=0"
        fix = "set async_training.staleness_threshold=1.0 (η=1) or async_training.max_staleness=1"
    else:
        cause = "async_training.max_staleness=0 (set, or derived from rLLM's default staleness_threshold 0.1)"
        fix = "set async_training.max_staleness=1 (or staleness_threshold=1.0) for η=1"
    return (
        f"training synchronously (on-policy, no overlap of generation and training): {cause} with "
        f"trigger_parameter_sync_step=1; {fix}"
    )


def largest_staleness(at: DictConfig) -> int:
    """η_max: the largest η the run may reach (adaptive staleness: its max; else async_training.max_staleness)."""
    eta_max = at.adaptive_staleness.max if at.adaptive_staleness.enable else at.max_staleness
    return int(max(at.max_staleness, eta_max))


def _derive_engine_lora(cfg: DictConfig) -> None:
    """engines.lora.* left null, for a policy trained as LoRA (schema.EnginesLoRAConfig): each engine keeps the
    η_max + 1 adapter versions the staleness bound admits, plus the one being retired while its requests finish."""
    model, lora = cfg.actor_rollout_ref.model, cfg.engines.lora
    if int(model.lora_rank or 0) <= 0:
        return  # engines.lora.* are then refused if set (settings/validate.py)
    versions = lora_versions_kept(largest_staleness(cfg.async_training)) + 1  # and one retiring
    if lora.max_loaded_loras is None:
        lora.max_loaded_loras = versions
    if lora.max_loras_per_batch is None:
        lora.max_loras_per_batch = versions
    if lora.max_lora_rank is None:
        lora.max_lora_rank = int(model.lora_rank)
    if lora.target_modules is None:
        lora.target_modules = sglang_target_modules(model.target_modules)


def sglang_target_modules(target_modules: object) -> list[str]:
    """verl's actor_rollout_ref.model.target_modules as SGLang's --lora-target-modules: all-linear -> [all]; a list
    of module names -> their last dotted parts. Names SGLang cannot serve LoRA on are refused by validate."""
    if isinstance(target_modules, str):
        return ["all"] if target_modules == "all-linear" else [target_modules.split(".")[-1]]
    return sorted({str(name).split(".")[-1] for name in target_modules})
