"""rLLM / verl fully-async staleness keys: η in policy versions from their `staleness_threshold`.

Pure code (no I/O). `settings/derive.py` calls `max_staleness_from_rllm` when `async_training.max_staleness` is
null; it is the one place η is derived from another key (docs/design.md#rule-one-quantity-one-name), and its formula is
written once, there. The other rLLM keys map one to one (`trigger_parameter_sync_step`, `required_samples`,
`partial_rollout`, `use_rollout_log_probs`) or in `settings/rllm_yaml.py` (`require_batches`, rLLM's top-level `rollout`
section).
"""

from __future__ import annotations

import math


def max_staleness_from_rllm(staleness_threshold: float, required_samples: int, trigger_parameter_sync_step: int) -> int:
    """η, in policy versions (core/versions.py), from rLLM's / verl's `staleness_threshold`.

    verl (`recipe/fully_async_policy`, the rollouter's `set_max_required_samples`) and rLLM (`RolloutExecutor`)
    let at most

        M = int(R · (1 + s) · K)        prompt groups be queued or running in one sync period,

    with s = staleness_threshold, R = required_samples (groups per optimizer step; a verl/rLLM "sample" is one
    prompt with its n responses, i.e. one group) and K = trigger_parameter_sync_step. This project's rule
    (AReaL's, core/staleness.py) lets at most (η + 1) · B groups be outstanding, with B = R · K groups per version.
    η is the largest value whose bound does not exceed verl's:

        η = floor(M / (R · K)) − 1

    s ≥ 0 gives M ≥ R · K, so η ≥ 0 (and η ≥ 0 never deadlocks: a version's B groups are always allowed).
    Examples: s = 0.1 (rLLM's default) → η = 0; s = 1 → η = 1; s = 2.5, K = 2 → M = 7R → η = 2.

    Raises ValueError (one line naming the key) on s < 0 or not finite, or R, K not integers >= 1.
    """
    s = staleness_threshold
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0:
        raise ValueError(f"async_training.staleness_threshold must be a finite number >= 0, got {s!r}")
    for key, value in (
        ("required_samples", required_samples),
        ("trigger_parameter_sync_step", trigger_parameter_sync_step),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"async_training.{key} must be an integer >= 1, got {value!r}")
    R, K = required_samples, trigger_parameter_sync_step
    M = int(R * (1 + s) * K)
    return M // (R * K) - 1
