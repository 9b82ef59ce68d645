"""Importance weights and their statistics for off-policy corrections: pure tensor functions.

The formulas (behaviour weight w = pi_prox / pi_behav, truncation or masking at C, the log-linear proximal
approximation) are written in `corrections.py`'s docstring; this module computes them through verl's
`rollout_corr_helper` and summarises them. `corrections` (the batch-level policy) and `decoupled_loss` (the
update-time loss) both build on it, so neither imports the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from verl.trainer.ppo.rollout_corr_helper import (
    SAFETY_BOUND,
    compute_offpolicy_metrics,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
)

from rllm.experimental.fully_async.algorithms.correction_config import CapMode, WeightLevel


def loglinear_proximal_log_probs(
    behav_log_probs: torch.Tensor,
    theta_log_probs: torch.Tensor,
    behav_versions: torch.Tensor,
    *,
    theta_version: float,
    prox_version: float,
) -> torch.Tensor:
    """Log-linear approximation of log pi_prox (formula in the module docstring; AReaL prox_approx).

    Args:
        behav_log_probs: [B, R] log pi_behav of the sampled tokens.
        theta_log_probs: [B, R] log pi_theta of the same tokens, from weights of version `theta_version`.
        behav_versions: [B, R] version that generated each token; negative marks tokens nobody generated.
        theta_version: v_theta (may be fractional, e.g. V + k/K inside a step of K mini-batches).
        prox_version: v_prox (AReaL: v_theta - 1; this trainer: the version at the start of the step).

    Returns:
        [B, R] approximate log pi_prox (detached).
    """
    v_behav = behav_versions.to(torch.float64)
    version_diff = theta_version - v_behav
    safe_diff = torch.where(version_diff > 0, version_diff, torch.ones_like(version_diff))
    alpha = torch.where((version_diff > 0) & (v_behav >= 0), (prox_version - v_behav) / safe_diff, 0.0)
    alpha = alpha.clamp(0.0, 1.0).to(behav_log_probs.dtype)
    behav, theta = behav_log_probs.detach(), theta_log_probs.detach()
    return behav + alpha * (theta - behav)


@dataclass(frozen=True)
class BehaviourWeights:
    weights: torch.Tensor  # [B, R], zero outside the (possibly reduced) mask
    response_mask: torch.Tensor  # [B, R]
    raw_log_weights: torch.Tensor  # [B, R], token log w_t, or the sequence sum broadcast


def behaviour_weights(
    prox_log_probs: torch.Tensor,
    behav_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: WeightLevel,
    cap_mode: CapMode,
    cap: float,
) -> BehaviourWeights:
    """w = pi_prox / pi_behav, truncated or masked at C, through verl's rollout_corr_helper. Needs a valid token."""
    log_ratio = prox_log_probs.detach() - behav_log_probs.detach()
    weights, _ = compute_rollout_correction_weights(
        log_ratio, response_mask, rollout_is=level, rollout_is_threshold=cap
    )
    mask = response_mask
    if cap_mode == "mask":
        option = "token_k1" if level == "token" else "seq_sum_k1"
        mask, _ = compute_rollout_rejection_mask(log_ratio, response_mask, rollout_rs=option, rollout_rs_threshold=cap)
        weights = weights * mask
    if level == "token":
        raw = log_ratio * response_mask
    else:
        raw = (log_ratio * response_mask).sum(dim=-1, keepdim=True).expand_as(log_ratio)
    return BehaviourWeights(weights=weights.to(prox_log_probs.dtype), response_mask=mask, raw_log_weights=raw)


def masked_values(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return values.detach()[mask.bool()].double()


def weight_stats(
    computed: BehaviourWeights, response_mask: torch.Tensor, *, cap_mode: CapMode, cap: float
) -> dict[str, float | None]:
    valid = response_mask.bool()
    kept = computed.response_mask.bool() & valid
    seq_valid = valid.any(dim=-1)
    final = masked_values(computed.weights, kept)
    raw = masked_values(computed.raw_log_weights, valid)
    out: dict[str, float | None] = {
        "weight_mean": float(final.mean()) if final.numel() else None,
        "weight_max": float(final.max()) if final.numel() else None,
        "weight_min": float(final.min()) if final.numel() else None,
        "raw_weight_max": math.exp(min(float(raw.max()), SAFETY_BOUND)),
    }
    over = (computed.raw_log_weights > math.log(cap)) & valid
    if cap_mode == "truncate":
        out["capped_token_fraction"] = float(over.sum()) / float(valid.sum())
        out["capped_seq_fraction"] = float(over.any(dim=-1).sum()) / float(seq_valid.sum())
    else:
        removed = valid & ~kept
        out["masked_token_fraction"] = float(removed.sum()) / float(valid.sum())
        out["masked_seq_fraction"] = float(removed.any(dim=-1).sum()) / float(seq_valid.sum())
    return out


def gap_stats(
    recomputed: torch.Tensor | None, behav: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float | None]:
    if recomputed is None or not bool(response_mask.bool().any()):
        return {}
    gap = masked_values(recomputed - behav, response_mask)
    return {
        "log_prob_gap_mean": float(gap.mean()),
        "log_prob_gap_abs_mean": float(gap.abs().mean()),
        "log_prob_gap_abs_max": float(gap.abs().max()),
    }


def staleness_stats(
    versions: torch.Tensor | None, trainer_version: float | None, response_mask: torch.Tensor
) -> dict[str, float | None]:
    if versions is None or trainer_version is None or not bool(response_mask.bool().any()):
        return {}
    lag = trainer_version - masked_values(versions, response_mask)
    return {"staleness_mean": float(lag.mean()), "staleness_max": float(lag.max())}


def approx_error_stats(
    approx: torch.Tensor | None, recomputed: torch.Tensor | None, behav: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float | None]:
    if approx is None or recomputed is None or not bool(response_mask.bool().any()):
        return {}
    error = masked_values(approx - recomputed, response_mask).abs()
    w_approx = torch.exp(masked_values(approx - behav, response_mask).clamp(-SAFETY_BOUND, SAFETY_BOUND))
    w_exact = torch.exp(masked_values(recomputed - behav, response_mask).clamp(-SAFETY_BOUND, SAFETY_BOUND))
    return {
        "prox_approx_abs_error_mean": float(error.mean()),
        "prox_approx_abs_error_max": float(error.max()),
        "prox_approx_weight_abs_error_mean": float((w_approx - w_exact).abs().mean()),
    }


def verl_diagnostics(
    recomputed: torch.Tensor | None, behav: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """verl's KL / perplexity / chi^2 diagnostics over the sequences that have response tokens."""
    rows = response_mask.bool().any(dim=-1)
    if recomputed is None or not bool(rows.any()):
        return {}
    metrics = compute_offpolicy_metrics(
        old_log_prob=recomputed.detach()[rows], rollout_log_prob=behav.detach()[rows], response_mask=response_mask[rows]
    )
    return {k: float(v) for k, v in metrics.items()}
