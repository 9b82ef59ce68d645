"""rLLM / verl fully-async key compatibility: their `async_training` keys mapped onto this project's settings.

Pure code (no I/O): `settings/derive.py` calls `map_rllm_async_keys` to turn rLLM's `staleness_threshold` into
`max_staleness`; the mapping is written once in its docstring.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any


class OldLogProbSource(str, Enum):
    """Where the PPO ratio's denominator (old log-prob) comes from."""

    ROLLOUT = "rollout"  # the engine's log-probs (behaviour policy): no extra forward pass
    PROXIMAL = "proximal"  # recomputed by the trainer before the update; rollout log-probs give the behaviour IS
    RECOMPUTE = "recompute"  # recomputed by the trainer; rollout log-probs unused


@dataclass(frozen=True)
class AsyncSettings:
    """This project's names for what rLLM's `async_training` section sets."""

    max_staleness: int  # η, in versions (weight syncs; core/versions.py)
    sync_every_steps: int  # K: push weights to the engines every K optimizer steps
    batch_groups: int  # groups (prompts) per optimizer step (rLLM's R; B per version = R · K, core/versions.py)
    resume_on_abort: bool  # a generation interrupted by a weight push resumes with the new weights
    old_log_prob_source: OldLogProbSource


RLLM_ASYNC_KEYS = frozenset(
    {
        "staleness_threshold",
        "trigger_parameter_sync_step",
        "required_samples",
        "require_batches",
        "partial_rollout",
        "use_rollout_log_probs",
        "compute_prox_log_prob",
    }
)
# Present in rLLM/verl configs but about their deployment (validation placement, NCCL buffers), not scheduling.
RLLM_IGNORED_KEYS = frozenset({"use_trainer_do_validate", "checkpoint_engine"})


def map_rllm_async_keys(async_training: Mapping[str, Any], ppo_mini_batch_size: int | None = None) -> AsyncSettings:
    """Map rLLM's / verl's `async_training` keys (defaults as in their fully-async config) onto AsyncSettings.

    verl (`recipe/fully_async_policy`, rollouter `set_max_required_samples`) and rLLM (`RolloutExecutor`) define,
    with s = staleness_threshold, K = trigger_parameter_sync_step, R = required_samples (prompts per trainer step;
    verl: ppo_mini_batch_size · require_batches):

        max_required_samples M = int(R · (1 + s) · K)   # queued + running samples allowed in one sync period

    Mapping:

        batch_groups      R (a verl/rLLM "sample" is one prompt with its n responses, i.e. one group); the budget's
                          B per version is R · K (core/versions.py)
        sync_every_steps  K = trigger_parameter_sync_step
        max_staleness     η = floor(M / B) − 1
                            AReaL's rule keeps started − consumed ≤ (η + 1)·B outstanding groups, verl keeps ≤ M;
                            η is the largest value whose bound does not exceed verl's. M ≥ B·K gives η ≥ K − 1,
                            the least that does not deadlock (check_sync_interval). s = 0 → η = K − 1;
                            s = 0.1, K = 4 → M = 4.4·B → η = 3; s = 1, K = 2 → η = 3.
        resume_on_abort   = partial_rollout (True: a weight push aborts running generations and the client resumes
                            them with the new weights, so a trajectory mixes versions; False: an interrupted
                            generation's tokens are discarded and it is generated again from its prompt with the new
                            weights, so each sequence has one version: engines/resumable.py)
        old_log_prob_source
                          compute_prox_log_prob=True             → "proximal" (decoupled PPO: trainer recomputes,
                                                                   rollout log-probs correct for the behaviour policy)
                          use_rollout_log_probs=True, prox=False → "rollout"
                          both False                             → "recompute"

    Raises ValueError (one line naming the key) on an unknown key, a bad value, or no way to get R.
    """
    unknown = sorted(set(async_training) - RLLM_ASYNC_KEYS - RLLM_IGNORED_KEYS)
    if unknown:
        raise ValueError(f"async_training.{unknown[0]} is not a known rLLM async_training key")
    s = float(async_training.get("staleness_threshold", 0.1))
    if not math.isfinite(s) or s < 0:
        raise ValueError(f"async_training.staleness_threshold must be a finite number >= 0, got {s}")
    K = _positive_int(async_training, "trigger_parameter_sync_step", 4)
    if async_training.get("required_samples") is not None:
        R = _positive_int(async_training, "required_samples", None)
    elif ppo_mini_batch_size is not None:
        R = ppo_mini_batch_size * _positive_int(async_training, "require_batches", 1)
        if R < 1:
            raise ValueError(f"ppo_mini_batch_size must be >= 1, got {ppo_mini_batch_size}")
    else:
        raise ValueError("async_training.required_samples is missing (or give ppo_mini_batch_size × require_batches)")
    M = int(R * (1 + s) * K)
    eta = M // R - 1
    use_rollout = _bool(async_training, "use_rollout_log_probs", True)
    prox = _bool(async_training, "compute_prox_log_prob", False)
    if prox:
        source = OldLogProbSource.PROXIMAL
    elif use_rollout:
        source = OldLogProbSource.ROLLOUT
    else:
        source = OldLogProbSource.RECOMPUTE
    return AsyncSettings(
        max_staleness=eta,
        sync_every_steps=K,
        batch_groups=R,
        resume_on_abort=_bool(async_training, "partial_rollout", True),
        old_log_prob_source=source,
    )


def _positive_int(section: Mapping[str, Any], key: str, default: int | None) -> int:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"async_training.{key} must be an integer >= 1, got {value!r}")
    return value


def _bool(section: Mapping[str, Any], key: str, default: bool) -> bool:
    value = section.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"async_training.{key} must be true or false, got {value!r}")
    return value
