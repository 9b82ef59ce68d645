"""Off-policy corrections for stale and mismatched rollouts, expressed in verl's terms
(docs/design.md#rule-verl-does-the-math).

Three policies meet in a fully-async step. pi_behav generated the tokens (the engines; a resumed response mixes
several versions, each token tagged with its version v_behav,t). pi_prox is the proximal policy the PPO trust region
is centred on: the trainer's weights at the start of the step (version V). pi_theta is the policy being optimised.

Decoupled PPO (Fu et al. 2025, AReaL, arXiv 2505.24298, the decoupled PPO objective of Sec. 5):

    J(theta) = E_{a ~ pi_behav} [ w * min( u * A, clip(u, 1 - eps, 1 + eps) * A ) ]
    u = pi_theta(a) / pi_prox(a),      w = pi_prox(a) / pi_behav(a)

verl's `compute_policy_loss_vanilla` computes exactly this when given ``old_log_prob = log pi_prox`` and
``rollout_is_weights = w`` (it multiplies the clipped per-token loss by the weights, then aggregates). So this module
only decides what goes into those two batch keys (and into ``response_mask`` when tokens are rejected):

    mode        old_log_probs        rollout_is_weights                 forward pass before the step
    none        log pi_trainer       -                                  yes
    bypass      log pi_behav         -                                  no
    tis         log pi_trainer       min(pi_trainer / pi_behav, C)      yes
    decoupled   log pi_prox          w, truncated or masked at C        yes, or none with "loglinear"
    m2po        log pi_behav         - (the loss weights by r itself)   no (`second_moment`: inside the update)

The weight, at token level (w_t) or sequence level (w = prod_t w_t, verl's sequence IS), is limited by C:

    truncate   w~ = min(w, C)                         truncated IS (Espeholt et al. 2018, IMPALA, arXiv 1802.01561)
    mask       keep iff 1/C <= w <= C, else the token (or sequence) leaves response_mask
               (masked IS / rejection; verl rollout_rs "token_k1" / "seq_sum_k1")

Decoupled with ``m2_threshold`` tau (AReaL's form of M2PO, `_apply_m2po_masking` in areal/trainer/ppo/actor.py):
before the weights, the tokens with the largest d_t^2, d_t = log pi_prox,t - log pi_behav,t, leave response_mask,
as few as needed for the kept tokens' mean d^2 to fall under tau (`second_moment.second_moment_mask`); the clip and
the capped weight then apply as above.

Both run through verl's `rollout_corr_helper` (`compute_rollout_correction_weights`,
`compute_rollout_rejection_mask`, `compute_offpolicy_metrics`). AReaL's own "mask" drops only w > C and its
sequence level uses the geometric mean of token ratios; here the bounds are two-sided and the sequence weight is
the product, as in verl.

TIS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
https://fengyao.notion.site/off-policy-rl) is the same formula with pi_prox = pi_trainer, named for its purpose:
correcting the numerical mismatch between inference engine and trainer, not staleness.

Proximal log-probs. "recompute" takes the trainer's log-probs under its weights before the step (the trainer
supplies them as ``old_log_probs``). "previous" takes them under the weights of the previous version V - 1 (the
trainer supplies those instead: with K = 1 its weights before its last optimizer step), so pi_prox is the policy one
version back, recomputed rather than interpolated; a token of the trainer's version V is newer than that, and keeps
pi_behav as its pi_prox (w = 1, clipped against pi_behav, as prox_lag does for tokens newer than v_prox). The
synchronous control (control_prox, `correction_config`) gives every token pi_{V-1} instead, so its clip (or its
second moment, m2po) binds at η = 0. "loglinear" avoids that forward pass
(A-3PO, Li, Wu & Shen 2025, arXiv 2512.06547; AReaL's docs/algorithms/prox_approx.md and
`compute_prox_logp_approximations` in areal/trainer/ppo/actor.py):

    alpha_t        = clamp((v_prox - v_behav,t) / (v_theta - v_behav,t), 0, 1)   if v_theta > v_behav,t >= 0, else 0
    log pi_prox,t ~= log pi_behav,t + alpha_t * (log pi_theta,t - log pi_behav,t)

where log pi_theta comes from a forward pass at version v_theta. AReaL sets v_prox = v_theta - 1. In this trainer
the natural source of log pi_theta is the update's own forward pass: for mini-batch k of K in a step that starts at
version V, v_theta = V + k/K and v_prox = V. With one mini-batch (k = 0) alpha = 1 and the "approximation" is exact:
pi_prox is then simply the detached log-probs of the update: `decoupled_loss` runs it that way, as a policy loss
registered with verl (the batch then carries log pi_behav as ``old_log_probs``). The approximation is exact
whenever every token has alpha in {0, 1}; in between it interpolates linearly in log space and its error is
reported (`prox_approx_*` statistics) whenever both it and the recomputed values exist.

Which mode to choose, and the config keys: see `correction_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from verl import DataProto

# The config side is re-exported: callers import CorrectionConfig and correction_config_from from here.
from rllm.experimental.fully_async.algorithms.correction_config import (
    CapMode,
    CorrectionConfig,
    WeightLevel,
    correction_config_from,
)
from rllm.experimental.fully_async.algorithms.importance_weights import (
    BehaviourWeights,
    approx_error_stats,
    behaviour_weights,
    gap_stats,
    loglinear_proximal_log_probs,
    staleness_stats,
    verl_diagnostics,
    weight_stats,
)

# The weight helpers are re-exported: callers (and tests) import them from here.
from rllm.experimental.fully_async.algorithms.second_moment import register_m2po_loss, second_moment_mask

__all__ = [
    "BehaviourWeights",
    "CapMode",
    "CorrectionConfig",
    "CorrectionStats",
    "OffPolicyCorrection",
    "OffPolicyCorrector",
    "WeightLevel",
    "apply_off_policy_correction",
    "apply_off_policy_correction_to_batch",
    "behaviour_weights",
    "build_correction",
    "correction_config_from",
    "loglinear_proximal_log_probs",
    "weight_stats",
]


@dataclass(frozen=True)
class CorrectionStats:
    """What the correction did, for logging. None marks a quantity that does not apply or could not be computed."""

    mode: str
    num_tokens: int  # response tokens before rejection
    num_sequences: int  # sequences with at least one response token
    weight_mean: float | None = None  # final weights over kept tokens
    weight_max: float | None = None
    weight_min: float | None = None
    raw_weight_max: float | None = None  # before truncation (exp clamped at e^20)
    capped_token_fraction: float | None = None  # truncate: tokens whose weight was lowered to C
    capped_seq_fraction: float | None = None
    masked_token_fraction: float | None = None  # mask: tokens removed from response_mask
    masked_seq_fraction: float | None = None  # sequences that lost at least one token
    m2_masked_token_fraction: float | None = None  # decoupled + m2_threshold: tokens the second-moment mask removed
    log_prob_gap_mean: float | None = None  # mean of log pi_trainer - log pi_behav over tokens
    log_prob_gap_abs_mean: float | None = None
    log_prob_gap_abs_max: float | None = None
    staleness_mean: float | None = None  # trainer_version - token version
    staleness_max: float | None = None
    prox_approx_abs_error_mean: float | None = None  # |loglinear - recomputed| over tokens
    prox_approx_abs_error_max: float | None = None
    prox_approx_weight_abs_error_mean: float | None = None  # same in weight space: |w_approx - w_recomputed|
    diagnostics: dict[str, float] = field(default_factory=dict)  # verl compute_offpolicy_metrics (kl, chi2, ppl)

    def to_metrics(self, prefix: str = "off_policy/") -> dict[str, float]:
        metrics: dict[str, float] = {}
        for name, value in self.__dict__.items():
            if name in ("mode", "diagnostics") or value is None:
                continue
            metrics[f"{prefix}{name}"] = float(value)
        metrics.update({f"{prefix}verl/{name}": float(value) for name, value in self.diagnostics.items()})
        return metrics


@dataclass(frozen=True)
class OffPolicyCorrection:
    """What to train with: the verl batch keys [B, R] and the statistics."""

    old_log_probs: torch.Tensor
    rollout_is_weights: torch.Tensor | None
    response_mask: torch.Tensor
    stats: CorrectionStats


def apply_off_policy_correction(
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    config: CorrectionConfig,
    *,
    recomputed_log_probs: torch.Tensor | None = None,
    theta_log_probs: torch.Tensor | None = None,
    rollout_versions: torch.Tensor | None = None,
    theta_version: float | None = None,
    prox_version: float | None = None,
    trainer_version: float | None = None,
) -> OffPolicyCorrection:
    """Choose old_log_probs and rollout_is_weights for verl's policy loss (table in the module docstring).

    Args:
        rollout_log_probs: [B, R] log pi_behav from the engines.
        response_mask: [B, R] trained tokens.
        recomputed_log_probs: [B, R] log pi under the trainer's weights before the step (decoupled+previous: before
            its last step). Needed by none, tis, decoupled+recompute and +previous; optional for bypass (then only
            the log-prob gap is reported).
        theta_log_probs, rollout_versions, theta_version, prox_version: inputs of `loglinear_proximal_log_probs`.
            Needed by decoupled+loglinear; if given together with `recomputed_log_probs`, the approximation's error
            is reported whatever the mode.
        trainer_version: for the staleness statistics (with `rollout_versions`).

    Returns:
        `OffPolicyCorrection`: old_log_probs [B, R], rollout_is_weights [B, R] or None, response_mask [B, R] (tokens
        rejected by cap_mode="mask" removed), stats. Weights are zero outside the returned mask; with no response
        token at all they are all zero and every statistic is 0 or None (never NaN).
    """
    mode = config.mode
    if rollout_log_probs.shape != response_mask.shape:
        raise ValueError(
            f"rollout_log_probs {tuple(rollout_log_probs.shape)} vs response_mask {tuple(response_mask.shape)}"
        )
    approx = None
    if theta_log_probs is not None and rollout_versions is not None:
        if theta_version is None or prox_version is None:
            raise ValueError("the log-linear approximation needs both theta_version and prox_version")
        approx = loglinear_proximal_log_probs(
            rollout_log_probs, theta_log_probs, rollout_versions, theta_version=theta_version, prox_version=prox_version
        )
    old_log_probs = _old_log_probs(config, rollout_log_probs, recomputed_log_probs, approx)
    if config.mode == "decoupled" and config.prox_log_probs == "previous" and config.control_prox is None:
        if rollout_versions is None or trainer_version is None:
            raise ValueError("prox_log_probs=previous needs the tokens' versions and the trainer version")
        # tokens of version V are newer than pi_prox (V - 1): their own policy is their proximal one. The control
        # (control_prox) keeps pi_{V-1} for them too: at η = 0 every token is of version V.
        old_log_probs = torch.where(rollout_versions >= trainer_version, rollout_log_probs, old_log_probs)

    valid = response_mask.bool()
    num_tokens = int(valid.sum())
    weights: torch.Tensor | None = None
    new_mask = response_mask
    weight_fields: dict[str, float | None] = {}
    if mode in ("tis", "decoupled"):
        cap_mode: CapMode = "truncate" if mode == "tis" else config.cap_mode
        weighted_mask = response_mask
        if mode == "decoupled" and config.m2_threshold is not None and num_tokens > 0:
            # AReaL's M2PO: drop the most stale outliers of log pi_prox - log pi_behav before weighting
            keep = second_moment_mask(old_log_probs - rollout_log_probs, response_mask, config.m2_threshold)
            weighted_mask = response_mask * keep.to(response_mask.dtype)
            weight_fields["m2_masked_token_fraction"] = 1.0 - float(keep.sum()) / num_tokens
        if not bool(weighted_mask.bool().any()):  # verl's helpers raise on an empty mask; there is nothing to weight
            weights, new_mask = torch.zeros_like(rollout_log_probs), weighted_mask
        else:
            computed = behaviour_weights(
                old_log_probs, rollout_log_probs, weighted_mask, level=config.level, cap_mode=cap_mode, cap=config.cap
            )
            weights, new_mask = computed.weights, computed.response_mask
            weight_fields |= weight_stats(computed, weighted_mask, cap_mode=cap_mode, cap=config.cap)

    stats = CorrectionStats(
        mode=mode,
        num_tokens=num_tokens,
        num_sequences=int(valid.any(dim=-1).sum()),
        **weight_fields,
        **gap_stats(recomputed_log_probs, rollout_log_probs, response_mask),
        **staleness_stats(rollout_versions, trainer_version, response_mask),
        **approx_error_stats(approx, recomputed_log_probs, rollout_log_probs, response_mask),
        diagnostics=verl_diagnostics(recomputed_log_probs, rollout_log_probs, response_mask),
    )
    return OffPolicyCorrection(
        old_log_probs=old_log_probs, rollout_is_weights=weights, response_mask=new_mask, stats=stats
    )


def _old_log_probs(
    config: CorrectionConfig,
    rollout_log_probs: torch.Tensor,
    recomputed_log_probs: torch.Tensor | None,
    approx: torch.Tensor | None,
) -> torch.Tensor:
    """log pi_old for verl's loss: the rollout's (bypass), the approximation (decoupled+loglinear), or recomputed."""
    if config.mode == "bypass":
        return rollout_log_probs
    if config.mode == "decoupled" and config.prox_log_probs == "loglinear":
        if approx is None:
            raise ValueError(
                "prox_log_probs=loglinear needs theta_log_probs and rollout_versions (log pi_theta exists only "
                "inside the actor update; apply it there)"
            )
        return approx
    if recomputed_log_probs is None:
        raise ValueError(
            f"off_policy_correction mode={config.mode!r} needs the trainer's recomputed log-probs (old_log_probs)"
        )
    return recomputed_log_probs


def apply_off_policy_correction_to_batch(
    data: DataProto, config: CorrectionConfig, *, trainer_version: float | None = None
) -> CorrectionStats:
    """Trainer-side correction on a `DataProto`, after the trainer recomputed ``old_log_probs`` (if it does).

    Reads ``rollout_log_probs``, ``response_mask``, ``old_log_probs`` (the trainer's recomputed log-probs; not needed
    for bypass) and, if present, ``response_versions`` [B, R] (per-token versions, -1 on padding; for staleness
    statistics).
    Writes ``old_log_probs`` (what verl's loss uses as log pi_old), ``rollout_is_weights`` (removed when the mode
    has none, so a stale tensor cannot leak into the loss) and ``response_mask`` (rejections applied).
    decoupled+loglinear computes pi_prox and w inside the update (`decoupled_loss`): here ``old_log_probs`` becomes
    log pi_behav and only the staleness statistics are reported.
    """
    batch = data.batch
    if "rollout_log_probs" not in batch:
        raise KeyError("off-policy correction needs batch key 'rollout_log_probs' (the engines' log-probs)")
    versions = batch.get("response_versions", None)
    if config.mode == "m2po":
        # The second-moment loss (`second_moment`) weights and masks inside the update against log pi_behav, or,
        # in the synchronous control, against log pi_{V-1} with every token weighted by pi_{V-1} / pi_behav.
        weight_fields: dict[str, float | None] = {}
        if config.control_prox is not None:
            weight_fields = _m2po_control_weights(batch)
        else:
            batch["old_log_probs"] = batch["rollout_log_probs"].clone()
            if "rollout_is_weights" in batch:
                del batch["rollout_is_weights"]
        valid = batch["response_mask"].bool()
        return CorrectionStats(
            mode=config.mode,
            num_tokens=int(valid.sum()),
            num_sequences=int(valid.any(dim=-1).sum()),
            **weight_fields,
            **staleness_stats(versions, trainer_version, batch["response_mask"]),
        )
    if config.mode == "decoupled" and config.prox_log_probs == "loglinear" and config.prox_lag == 0:
        recomputed = batch.get("old_log_probs", None)  # present when the trainer also recomputed pi_prox
        approx_error = {}
        if recomputed is not None and versions is not None and trainer_version is not None:
            # Both proximal log-probs exist: measure the log-linear formula at this step's versions (v_theta =
            # v_prox = V, alpha = 1 below V, 0 at V) against the recomputed pi_prox.
            approx = loglinear_proximal_log_probs(
                batch["rollout_log_probs"],
                recomputed,
                versions,
                theta_version=float(trainer_version),
                prox_version=float(trainer_version),
            )
            approx_error = approx_error_stats(approx, recomputed, batch["rollout_log_probs"], batch["response_mask"])
        batch["old_log_probs"] = batch["rollout_log_probs"].clone()
        if "rollout_is_weights" in batch:
            del batch["rollout_is_weights"]
        valid = batch["response_mask"].bool()
        return CorrectionStats(
            mode=config.mode,
            num_tokens=int(valid.sum()),
            num_sequences=int(valid.any(dim=-1).sum()),
            **staleness_stats(versions, trainer_version, batch["response_mask"]),
            **approx_error,
        )
    recomputed = batch.get("old_log_probs", None)
    interpolation = {}
    if config.prox_lag > 0:
        # pi_prox lags the trainer's weights: interpolate from the recomputed log-probs (version V = trainer_version)
        if versions is None or trainer_version is None or recomputed is None:
            raise ValueError(
                "prox_lag > 0 needs the recomputed log-probs, batch key 'response_versions' and the trainer version"
            )
        interpolation = {
            "theta_log_probs": recomputed,
            "theta_version": float(trainer_version),
            "prox_version": float(trainer_version) - config.prox_lag,
        }
        recomputed = None  # pi_theta is not pi_prox here: no approximation error to report against it
    result = apply_off_policy_correction(
        batch["rollout_log_probs"],
        batch["response_mask"],
        config,
        recomputed_log_probs=recomputed,
        rollout_versions=versions,
        trainer_version=trainer_version,
        **interpolation,
    )
    batch["old_log_probs"] = result.old_log_probs
    batch["response_mask"] = result.response_mask
    if result.rollout_is_weights is None:
        if "rollout_is_weights" in batch:
            del batch["rollout_is_weights"]
    else:
        batch["rollout_is_weights"] = result.rollout_is_weights
    return result.stats


# exp(20) ~ 5e8: keeps the control's weight finite for a token the last step moved that far (its (log r)^2 is far
# above tau, so the mask drops it anyway); the same bound as the M2PO loss's (`second_moment`)
_CONTROL_LOG_WEIGHT_BOUND = 20.0


def _m2po_control_weights(batch: Any) -> dict[str, float | None]:
    """The M2PO control's batch keys (control_prox=previous_step; formula in `correction_config`):
    ``old_log_probs`` = log pi_{V-1} (the trainer supplied it there), ``rollout_is_weights`` = pi_{V-1} / pi_behav
    on the response tokens, uncapped: r * w = pi_theta / pi_behav, the on-policy gradient, and the second moment of
    log r = log pi_theta - log pi_{V-1} is what the mask bounds. Returns the weights' statistics."""
    if "old_log_probs" not in batch:
        raise ValueError("the m2po control needs the trainer's log-probs under its previous weights (old_log_probs)")
    mask = batch["response_mask"]
    log_w = (batch["old_log_probs"] - batch["rollout_log_probs"]).clamp(
        -_CONTROL_LOG_WEIGHT_BOUND, _CONTROL_LOG_WEIGHT_BOUND
    )
    weights = torch.exp(log_w) * mask.to(log_w.dtype)
    batch["rollout_is_weights"] = weights
    valid = mask.bool()
    if not bool(valid.any()):
        return {}
    kept = weights[valid]
    return {"weight_mean": float(kept.mean()), "weight_max": float(kept.max()), "weight_min": float(kept.min())}


@dataclass(frozen=True)
class OffPolicyCorrector:
    """The trainer's handle on the configured correction (what `build_correction` returns)."""

    config: CorrectionConfig
    # verl loss_mode the actor must use, when the correction lives inside the update (m2po, decoupled + loglinear)
    policy_loss_mode: str | None = None
    # decoupled + loglinear with async_training.compute_prox_log_prob: also recompute pi_prox, to report the
    # approximation's error (prox_approx_*) in the step's metrics. Costs the forward pass loglinear saves.
    measure_approximation: bool = False

    @property
    def needs_recompute(self) -> bool:
        """Whether the trainer must compute log-probs under its current weights before `apply`."""
        c = self.config
        return (
            c.mode in ("none", "tis")
            or (c.mode == "decoupled" and (c.prox_log_probs in ("recompute", "previous") or c.prox_lag > 0))
            or c.uses_previous_weights
            or self.measure_approximation
        )

    @property
    def uses_previous_weights(self) -> bool:
        """Whether the log-probs `apply` needs are the trainer's under its weights of the previous version
        (prox_log_probs=previous, or the synchronous control control_prox), not its current ones."""
        return self.config.uses_previous_weights

    def apply(
        self, data: DataProto, *, proximal_log_probs: torch.Tensor | None, trainer_version: float | None = None
    ) -> dict[str, float]:
        """Correct `data` in place (see `apply_off_policy_correction_to_batch`); returns the metrics to log.

        `proximal_log_probs` [B, R]: the trainer's log-probs under its weights before the step, when
        `needs_recompute` (stored as ``old_log_probs`` first); None otherwise.
        """
        if proximal_log_probs is not None:
            data.batch["old_log_probs"] = proximal_log_probs
        return apply_off_policy_correction_to_batch(data, self.config, trainer_version=trainer_version).to_metrics()


def build_correction(cfg: Any) -> OffPolicyCorrector | None:
    """`OffPolicyCorrector` for the run config, or None when no correction is configured.

    m2po and decoupled + ``prox_log_probs=loglinear`` also register their policy loss in verl's registry (in this
    process);
    the corrector's `policy_loss_mode` names it, for the actor config.
    """
    return corrector_for(correction_config_from(cfg), compute_prox_log_prob=_compute_prox_log_prob(cfg))


def corrector_for(config: CorrectionConfig | None, *, compute_prox_log_prob: bool) -> OffPolicyCorrector | None:
    """`OffPolicyCorrector` for a correction config (the run spec's), or None; see `build_correction`."""
    if config is None:
        return None
    policy_loss_mode = None
    if config.mode == "m2po":
        policy_loss_mode = register_m2po_loss(config.tau)
    if config.mode == "decoupled" and config.prox_log_probs == "loglinear" and config.prox_lag == 0:
        # Imported here: it registers a loss in verl's registry, which only the trainer process needs.
        from rllm.experimental.fully_async.algorithms.decoupled_loss import register_update_time_decoupled_loss

        policy_loss_mode = register_update_time_decoupled_loss(config)
    measure = config.mode == "decoupled" and config.prox_log_probs == "loglinear" and compute_prox_log_prob
    return OffPolicyCorrector(config, policy_loss_mode=policy_loss_mode, measure_approximation=measure)


def _compute_prox_log_prob(cfg: Any) -> bool:
    section = cfg.get("async_training") if hasattr(cfg, "get") else None
    return bool(section.get("compute_prox_log_prob", False)) if section is not None else False
