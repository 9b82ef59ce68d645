"""Derived settings: the `null` values whose value follows from others, filled once after merging.

Each rule is documented on its field in `settings/schema.py`; rLLM's staleness keys are mapped by `settings/compat.py`.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from rllm.experimental.fully_async.errors import ConfigError
from rllm.experimental.fully_async.settings.compat import map_rllm_async_keys


def resolve_derived(cfg: DictConfig) -> None:
    """Fill the `null` settings whose value follows from others (documented on each field)."""
    at = cfg.async_training
    if at.required_samples is None:
        at.required_samples = int(cfg.data.train_batch_size)
    if at.max_staleness is None:
        rllm_keys = {
            "staleness_threshold": at.staleness_threshold if at.staleness_threshold is not None else 0.1,
            "trigger_parameter_sync_step": at.trigger_parameter_sync_step,
            "required_samples": at.required_samples,
        }
        try:
            mapped = map_rllm_async_keys(rllm_keys)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        # map_rllm_async_keys counts staleness in optimizer steps; this project's versions advance once per
        # sync (every K steps), so eta_versions = floor((eta_steps + 1) / K) - 1 = floor(M / (R K)) - 1.
        k = at.trigger_parameter_sync_step
        at.max_staleness = max(0, (mapped.max_staleness + 1) // k - 1)
    if at.compute_prox_log_prob and cfg.algorithm.off_policy_correction is None:
        # rLLM's compute_prox_log_prob means decoupled PPO with recomputed proximal log-probs (AReaL).
        cfg.algorithm.off_policy_correction = {"mode": "decoupled", "prox_log_probs": "recompute"}
    n = int(cfg.actor_rollout_ref.rollout.n)
    if at.max_concurrent_rollouts is None:
        at.max_concurrent_rollouts = 2 * at.required_samples * n
    if at.queue_max_groups is None:
        at.queue_max_groups = (at.max_staleness + 2) * at.required_samples
    for optim in (cfg.actor_rollout_ref.actor.optim, cfg.critic.optim):
        if optim.total_training_steps in (None, -1) and cfg.trainer.total_training_steps is not None:
            # As verl's workers do at start-up: the LR schedule (cosine) spans the run's optimizer steps.
            optim.total_training_steps = int(cfg.trainer.total_training_steps)
    if cfg.run.dir is None:
        cfg.run.dir = str(Path("runs") / str(cfg.trainer.experiment_name))
    if cfg.param_sync.weights_dir is None:
        cfg.param_sync.weights_dir = str(Path(cfg.run.dir) / "weights")
