"""The off-policy correction a run asks for: `CorrectionConfig`, its checks, and how config keys map onto it.

The keys are ``algorithm.off_policy_correction.*``; when that section is absent, verl's own
``algorithm.rollout_correction`` keys are mapped (`correction_config_from`). What each mode computes, with the
formulas, is in `corrections`, which applies the correction to tensors. This module is pure Python (no torch), so
a config can be checked without loading the tensor code.

When to use which (``algorithm.off_policy_correction.mode``):

- decoupled (default for fully-async, max_staleness >= 1): the trust region stays around the recent policy while w
  corrects for whatever the behaviour policy was, however stale. truncate keeps every token (biased towards the
  behaviour policy where w > C, lower variance); mask drops tokens whose version gap is too large (the weights it
  keeps are exact, the dropped tail is its bias, and fewer tokens train: watch ``masked_token_fraction``). Token
  level is the default; sequence level weights whole responses and has much higher variance, use it with mask.
  prox "loglinear" takes pi_prox from the update's own forward pass and saves the "recompute" pass (about a third
  of a step): with one mini-batch per step the two are the same policy (proven in tests/test_decoupled_loss.py),
  except that a rejected token (cap_mode=mask) still counts in the token mean's denominator, and tokens of the
  current version are weighted against the engine's numerics as TIS would (see `decoupled_loss`).
  prox_lag L >= 1 (with loglinear, recomputed pi_theta) centres the trust region L versions back. Why: with one
  optimizer step per batch and pi_prox = the policy before the step, pi_theta / pi_prox is 1 at the step, so the
  clip never binds and nothing bounds a step on old data. With a lagged pi_prox (interpolated in log space, A-3PO)
  tokens older than V - L are clipped against it and weighted by pi_prox / pi_behav, while newer tokens have
  w = 1 and are clipped against pi_behav as under bypass; L >= max_staleness is exactly bypass.
  prox "previous" recomputes pi_prox with the trainer's weights of the previous version, before its last weight sync
  (the trainer keeps a copy of them; with K = 1 the weights before its last optimizer step): the policy one version
  back that loglinear at prox_lag 1 interpolates, exactly. The clip then binds on what the last step moved,
  whatever the staleness, as it does on one-version-old data. At a fixed η of 8 and 16, where almost every token
  is η versions old, it ended ahead of sync where prox_lag 1 ended 3-7 points behind (tests/bench/README.md), an
  experiment whose synchronous arm trained another objective (no binding clip; control_prox below is its control).
  Cost: one forward pass per step and one more copy of the weights (FSDP only; tests/bench/bench_previous_weights.py).
  With K > 1 (several optimizer steps per weight sync) "previous" is the weights of the previous *version*: those
  the engines served before the last sync, pi_{V-1}, whatever steps the trainer took since (lag1's v_prox = V - 1).
- control_prox "previous_step" (a control for experiments, synchronous runs only: max_staleness 0, K = 1): every
  token's proximal policy is the trainer's policy one step back, pi_{V-1}, recomputed, so the trust region of the
  async arms binds at η = 0 too (without it a synchronous run's ratio is 1 at its only step and nothing clips).
  decoupled (with prox_log_probs previous; cap, level, cap_mode, m2_threshold as the async arm's): u = pi_theta /
  pi_{V-1}, w = pi_{V-1} / pi_behav, so w * u = pi_theta / pi_behav: only the clip (and the cap on w) differ
  from plain PG.
  m2po: the second moment is taken of log pi_theta - log pi_{V-1} and every token is weighted by
  pi_{V-1} / pi_behav, so the unmasked gradient is still pi_theta / pi_behav's. The async arms never use it.
- m2po: the second-moment trust region (`second_moment`; M2PO, arXiv 2510.01161): no clip; the policy gradient
  weighted by r = pi_theta / pi_behav, with the tokens of largest (log r)^2 masked until the batch's mean (log r)^2
  is under ``tau`` (0.04: AReaL's example). Runs inside the update (no forward pass before the step); watch
  ``off_policy/masked_token_fraction`` (the paper reports 0.06% at 256 stale updates of 1.7-32B models). On the
  tiny default task, whose policy moves ~0.3 nats per token over 8 versions, it masked 15-26% early and collapsed
  at η=2 and η=8 (tests/bench/README.md): prefer decoupled with prox_lag there.
- decoupled with ``m2_threshold``: AReaL's form of M2PO (its ``actor.m2_threshold``): the second-moment mask is
  taken on the behaviour-to-proximal log-ratio, (log pi_prox - log pi_behav)^2, before the decoupled loss, whose
  clip and capped weight stay. The mask removes the most stale outliers; the clip still bounds the step.
- tis: synchronous or near-synchronous runs (staleness 0) whose rollout engine differs numerically from the trainer
  (bf16 SGLang vs fp32 FSDP, other kernels). C = 2 (verl's default).
- bypass: the cheapest; no forward pass before the step, the PPO clip is centred on pi_behav. Fine at staleness
  <= 1 with matching numerics; at higher staleness the clip range is spent on the version gap and most tokens get
  clipped to zero gradient. With unpatched verl 0.7.1 and one mini-batch it needs actor.use_rollout_log_probs=True
  (otherwise old_log_prob is replaced by the update's own log-probs).
- none: plain PPO against the trainer's recomputed log-probs, no behaviour correction: a synchronous baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from rllm.experimental.fully_async.api.config import dataclass_from_config

CorrectionMode = Literal["none", "bypass", "tis", "decoupled", "m2po"]
ProxMethod = Literal["recompute", "loglinear", "previous"]
WeightLevel = Literal["token", "sequence"]
CapMode = Literal["truncate", "mask"]
ControlProx = Literal["previous_step"]


@dataclass(frozen=True)
class CorrectionConfig:
    """Proposed config keys: ``algorithm.off_policy_correction.*`` (same names). See `correction_config_from` for how
    verl's own ``algorithm.rollout_correction`` keys map onto this when that section is absent.

    mode: how the loss treats tokens an older policy (pi_behav) generated: "decoupled" (the clip is centred on a
        proximal policy pi_prox and each token weighted by w = pi_prox / pi_behav), "m2po" (no clip; the tokens of
        largest squared log-ratio are masked), "tis" (truncated importance sampling, verl's), "bypass" (the PPO clip
        centred on pi_behav, no weight) or "none" (plain PPO on recomputed log-probs). The module docstring says
        when to use which.
    prox_log_probs: "recompute" | "loglinear" | "previous", decoupled only. "loglinear" needs log pi_theta, which
        only exists inside the actor's update: it runs as a verl policy loss (`decoupled_loss`), so the actor's
        ``policy_loss.loss_mode`` must be left at "vanilla" (the trainer replaces it). "previous": recomputed with
        the weights of the version before the trainer's, V - 1 (those the engines served before the last weight
        sync: with K = 1 the weights before the last optimizer step, with K > 1 those of K or more steps back);
        tokens of the trainer's own version keep pi_behav as pi_prox (w = 1). Needs prox_lag 0 and the FSDP
        backend.
    level: "token" | "sequence", the granularity of w: one weight per token, or one per response for all its
        tokens.
    cap_mode: "truncate" | "mask", how w is limited (decoupled only; tis always truncates).
    cap: C > 1, the limit on w: truncate cuts w to at most C, mask drops the tokens whose w is outside [1/C, C].
        verl's default 2.0; AReaL uses 2.0 to 5.0. Larger C = less bias, more variance.
    prox_lag: L >= 0, versions between pi_prox and the trainer's weights V (v_prox = V - L). 0: pi_prox is the
        policy before the step. L >= 1 needs prox_log_probs=loglinear (no older weights are kept to recompute
        from): pi_prox is interpolated in log space between each token's behaviour version and V, from the
        trainer's recomputed log-probs, as AReaL's A-3PO does with L = 1. With one optimizer step per batch the
        clip of pi_theta / pi_prox binds only when L >= 1 (at L = 0 that ratio is 1 at the step).
    tau: m2po only: the bound on the mean squared log-ratio log(pi_theta / pi_behav)^2 of the tokens kept (M2PO's
        tau_M2; > 0). Smaller masks more tokens; AReaL's example uses 0.04.
    m2_threshold: decoupled only, off (None) by default: mask the tokens with the largest
        (log pi_prox - log pi_behav)^2 until the kept tokens' mean is under it, before the decoupled loss (AReaL's
        ``actor.m2_threshold``; > 0). Masked tokens leave the token mean's denominator, except with
        prox_log_probs=loglinear at prox_lag 0, where the mask is taken inside the update (as cap_mode=mask).
    control_prox: null (default) | "previous_step". A control for experiments, valid only in synchronous runs
        (max_staleness 0, trigger_parameter_sync_step 1; settings/validate.py refuses it elsewhere): every token's
        proximal policy is the policy one step back, recomputed (decoupled: needs prox_log_probs=previous; m2po:
        the second moment is taken against it). See the module docstring.
    """

    mode: CorrectionMode = "decoupled"
    prox_log_probs: ProxMethod = "recompute"
    level: WeightLevel = "token"
    cap_mode: CapMode = "truncate"
    cap: float = 2.0
    prox_lag: int = 0
    tau: float = 0.04
    m2_threshold: float | None = None
    control_prox: ControlProx | None = None

    def __post_init__(self) -> None:
        key = "algorithm.off_policy_correction"
        allowed = {
            "mode": ("none", "bypass", "tis", "decoupled", "m2po"),
            "prox_log_probs": ("recompute", "loglinear", "previous"),
            "level": ("token", "sequence"),
            "cap_mode": ("truncate", "mask"),
        }
        for name, values in allowed.items():
            if getattr(self, name) not in values:
                raise ValueError(f"{key}.{name} must be one of {list(values)}, got {getattr(self, name)!r}")
        if not (math.isfinite(self.cap) and self.cap > 1.0):
            raise ValueError(f"{key}.cap must be a finite number > 1, got {self.cap}")
        if self.mode != "decoupled" and self.prox_log_probs != "recompute":
            raise ValueError(f"{key}.prox_log_probs={self.prox_log_probs!r} only applies to mode=decoupled")
        if isinstance(self.prox_lag, bool) or not isinstance(self.prox_lag, int) or self.prox_lag < 0:
            raise ValueError(f"{key}.prox_lag must be an integer >= 0, got {self.prox_lag!r}")
        if self.prox_log_probs == "previous" and self.prox_lag != 0:
            raise ValueError(
                f"{key}.prox_lag={self.prox_lag} does not apply to prox_log_probs=previous (its proximal policy is "
                "the weights before the last optimizer step); remove it"
            )
        if self.prox_lag > 0 and (self.mode != "decoupled" or self.prox_log_probs != "loglinear"):
            raise ValueError(
                f"{key}.prox_lag={self.prox_lag} needs mode=decoupled and prox_log_probs=loglinear (an older "
                "proximal policy is interpolated; prox_log_probs=previous recomputes the one before the last step)"
            )
        if not (math.isfinite(self.tau) and self.tau > 0):
            raise ValueError(f"{key}.tau must be a finite number > 0, got {self.tau}")
        if self.m2_threshold is not None:
            if self.mode != "decoupled":
                raise ValueError(
                    f"{key}.m2_threshold applies only to mode=decoupled (mode=m2po bounds the second moment with "
                    f"tau), got mode={self.mode!r}; remove it"
                )
            if isinstance(self.m2_threshold, bool) or not (
                isinstance(self.m2_threshold, int | float)
                and math.isfinite(self.m2_threshold)
                and self.m2_threshold > 0
            ):
                raise ValueError(f"{key}.m2_threshold must be a finite number > 0 or null, got {self.m2_threshold!r}")
        defaults = CorrectionConfig.__dataclass_fields__
        if self.mode == "m2po":
            for name in ("level", "cap_mode", "cap", "prox_lag"):
                if getattr(self, name) != defaults[name].default:
                    raise ValueError(
                        f"{key}.{name} does not apply to mode=m2po (its trust region is the second moment, tau); "
                        "remove it"
                    )
        elif self.tau != defaults["tau"].default:
            raise ValueError(f"{key}.tau applies only to mode=m2po, got mode={self.mode!r}; remove it")
        if self.mode == "tis" and self.cap_mode != "truncate":
            raise ValueError(f"{key}.cap_mode must be 'truncate' with mode=tis (use mode=decoupled to mask)")
        if self.control_prox is not None:
            if self.control_prox != "previous_step":
                raise ValueError(f"{key}.control_prox must be 'previous_step' or null, got {self.control_prox!r}")
            if self.mode not in ("decoupled", "m2po"):
                raise ValueError(f"{key}.control_prox applies to mode=decoupled or m2po, got mode={self.mode!r}")
            if self.mode == "decoupled" and self.prox_log_probs != "previous":
                raise ValueError(
                    f"{key}.control_prox=previous_step recomputes the policy one step back: set prox_log_probs: "
                    f"previous (got {self.prox_log_probs!r}; at η=0 there is nothing to interpolate)"
                )

    @property
    def uses_previous_weights(self) -> bool:
        """Whether the proximal log-probs are the trainer's under its weights of the previous version (decoupled
        with prox_log_probs=previous, or the control)."""
        return self.control_prox is not None or (self.mode == "decoupled" and self.prox_log_probs == "previous")


def correction_config_from(cfg: Any) -> CorrectionConfig | None:
    """The correction a run asks for, or None (then the trainer keeps verl's plain old-log-prob handling).

    ``algorithm.off_policy_correction`` wins when present. Otherwise verl's ``algorithm.rollout_correction`` maps:
    ``bypass_mode: true`` -> mode=bypass; ``rollout_is: token|sequence`` with ``rollout_is_threshold`` -> mode=tis
    at that level and cap. verl's ``rollout_rs`` (rejection) has no exact counterpart and is refused with the key
    to use instead.
    """
    config = dataclass_from_config(cfg, "algorithm.off_policy_correction", CorrectionConfig)
    verl_section = dataclass_from_config(cfg, "algorithm.rollout_correction", _VerlRolloutCorrection)
    if config is not None:
        if verl_section is not None and verl_section != _VerlRolloutCorrection():
            raise ValueError(
                "algorithm.rollout_correction is set and algorithm.off_policy_correction wins over it; remove one"
            )
        return config
    if verl_section is None:
        return None
    unmapped = {"loss_type": "ppo_clip", "rollout_is_batch_normalize": False, "rollout_rs_threshold": None}
    for key, default in unmapped.items():
        if getattr(verl_section, key) != default:
            raise ValueError(
                f"algorithm.rollout_correction.{key} has no counterpart here; remove it "
                "(algorithm.off_policy_correction sets the correction: mode, level, cap_mode, cap)"
            )
    if (
        verl_section.rollout_is is None
        and verl_section.rollout_is_threshold != _VerlRolloutCorrection.rollout_is_threshold
    ):
        raise ValueError("algorithm.rollout_correction.rollout_is_threshold is used only with rollout_is; set both")
    if verl_section.rollout_rs is not None:
        raise ValueError(
            "algorithm.rollout_correction.rollout_rs is not supported here: use "
            "algorithm.off_policy_correction.cap_mode=mask (rejects tokens with w outside [1/cap, cap])"
        )
    if verl_section.bypass_mode:
        return CorrectionConfig(mode="bypass")
    if verl_section.rollout_is is not None:
        return CorrectionConfig(mode="tis", level=verl_section.rollout_is, cap=float(verl_section.rollout_is_threshold))
    return None


@dataclass(frozen=True)
class _VerlRolloutCorrection:
    """verl 0.7.1's ``algorithm.rollout_correction`` keys (RolloutCorrectionConfig), as far as they are mapped."""

    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_rs: str | None = None
    rollout_rs_threshold: Any = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"
    rollout_is_batch_normalize: bool = False
