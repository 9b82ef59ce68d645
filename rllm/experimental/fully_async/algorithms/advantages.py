"""Advantages: the one entry point the trainer calls, over verl 0.7.1's estimator registry plus GiGPO.

`compute_advantages(data, adv_estimator, ...)` writes ``advantages`` and ``returns`` [B, R] into a `DataProto`.
The math is verl's (`verl.trainer.ppo.core_algos`, looked up through `get_adv_estimator_fn`); GiGPO is ours
(`gigpo.py`, registered as "gigpo"). verl's own dispatcher, `ray_trainer.compute_advantage`, is not used: it cannot
pass GiGPO's step fields, needs an `AlgoConfig` even for GAE, and its module does not import in this environment
(verl.trainer.ppo.ray_trainer pulls in `datasets` -> pyarrow 26, which needs numpy 2; verl 0.7.1 pins numpy < 2).

The trajectory is the unit of credit (docs/design.md#rule-trajectory-unit-of-credit; `credit.py`). A trajectory may be
several rows (one per turn with ``workflow.layout=per_step``); rows belong to trajectories by
``non_tensor_batch["traj_uid"]`` (absent: each row is one). Outcome estimators (grpo, rloo,
reinforce_plus_plus_baseline) score each trajectory once, s_i = the sum of its rows' rewards, in the group statistics,
and give every row of trajectory i its A_i; verl's functions do the math on one row per trajectory, whose mask holds the
trajectory's trained-token count (so the batch whitening of reinforce_plus_plus_baseline weighs tokens as before).
Token-level estimators (gae, reinforce_plus_plus) run over each trajectory's trained tokens chained in step order. So
the ``per_step`` and ``concat`` layouts give a token the same advantage. GiGPO's episode level is GRPO over
trajectories; its step level stays per step.

Estimators (``algorithm.adv_estimator``), with s_i = sum_t r_{i,t} the outcome score of trajectory i in group g:

- ``grpo``  A_i = (s_i - mean_g s) / (std_g s + eps)     (Shao et al. 2024, arXiv 2402.03300, Sec. 4.1.2)
- Dr.GRPO   A_i = s_i - mean_g s                         (Liu et al. 2025, arXiv 2503.20783, Sec. 3.2)
            Not an estimator of its own but this combination of keys:
                algorithm.adv_estimator = grpo
                algorithm.norm_adv_by_std_in_grpo = false
                actor_rollout_ref.actor.loss_agg_mode = seq-mean-token-sum-norm
            (the last removes the per-response length normalisation; see `DR_GRPO_KEYS`).
- ``rloo``  A_i = n/(n-1) * (s_i - mean_g s) = s_i - mean_{j != i} s_j        (Ahmadian et al. 2024, arXiv 2402.14740)
- ``reinforce_plus_plus``  G_{i,t} = sum_{k>=t} gamma^(k-t) r_{i,k} over trajectory i's trained tokens;
            A = whiten_batch(G)                                        (Hu 2025, arXiv 2501.03262)
- ``reinforce_plus_plus_baseline``  A = whiten_batch(s_i - mean_g s) broadcast over tokens     (same paper)
- ``gae``   delta_t = r_t + gamma V_{t+1} - V_t, A_t = sum_l (gamma lam)^l delta_{t+l} over the trajectory's trained
            tokens (t+1: its next trained token, in the next turn's row at a turn's end), whitened over the batch;
            returns = A (before whitening) + V                         (Schulman et al. 2016, arXiv 1506.02438)
            The critic itself (verl DataParallelPPOCritic) is trained in the loop; this only needs ``values``.
- ``gigpo`` see `gigpo.py`                                            (Feng et al. 2025, arXiv 2505.10978)

Degenerate inputs (verl's behaviour checked against its 0.7.1 source, and what we do instead):

- Groups of one trajectory. verl's grpo uses mean 0, std 1 (A = s: the raw reward becomes the advantage); rloo uses
  no baseline (A = s); reinforce_plus_plus_baseline whitens the raw s with the rest of the batch. With
  ``singleton_group_advantage="zero"`` (default) such rows get A = 0: a lone response has no baseline, and its raw
  reward is on a different scale from the normalised advantages around it. In a fully-async run singleton groups
  appear when filtering or staleness drops removed the rest of a group. "verl" keeps verl's rule.
- Groups whose trajectory scores are all equal (within 1e-6). Mathematically A = 0, but verl's grpo divides the
  float error of the group mean by (0 + 1e-6): seven rewards of 2.7 give |A| up to 0.19. Such rows are set to exactly
  0 and are left out of the batch whitening of reinforce_plus_plus_baseline. (reinforce_plus_plus and gae have no
  groups.)
- Zero-length responses (all-zero ``response_mask`` row). Their reward still counts in their trajectory's score (it
  is a real sample with a real reward, which the trainer must place at position 0 since there is no last token);
  their advantages are zero because every output is multiplied by ``response_mask``. For gae and
  reinforce_plus_plus such a reward moves to the trajectory's latest trained token before it (`credit.py`).
- Batches whose un-whitened values (reinforce_plus_plus returns, gae's raw advantages) are all equal: whitening a
  constant gives 0, but verl scales the float error of the mean by up to 1e4 (0.0012 for three rewards of 0.7);
  we return exactly 0.
- Batches with fewer than two response tokens. verl's batch whitening (gae, reinforce_plus_plus[_baseline])
  raises there; we return A = 0 and, for gae, returns = values (a critic target equal to its own prediction).
- Non-finite rewards raise a ValueError naming the rows; nothing NaN is written.

Postcondition for every estimator: ``advantages`` and ``returns`` are finite and zero wherever ``response_mask``
is zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from verl import DataProto

from rllm.experimental.fully_async.algorithms.credit import (
    SingletonRule,
    TrajectoryIndex,
    degenerate_rows,
    index_trajectories,
    outcome_advantages,
    token_advantages,
)
from rllm.experimental.fully_async.algorithms.filters import REWARD_EQUAL_TOL
from rllm.experimental.fully_async.algorithms.gigpo import GiGPOConfig, GiGPOStats, compute_gigpo
from rllm.experimental.fully_async.api.config import dataclass_from_config

SUPPORTED_ESTIMATORS: tuple[str, ...] = (
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "gae",
    "gigpo",
)
_OUTCOME_ESTIMATORS = frozenset({"grpo", "rloo", "reinforce_plus_plus_baseline"})
# Estimators whose advantage is relative to the other trajectories of a prompt group: they need groups of >= 2.
GROUP_ESTIMATORS: frozenset[str] = _OUTCOME_ESTIMATORS | {"gigpo"}
_BASE_TENSORS = ("response_mask", "token_level_rewards")
_REQUIRED_TENSORS: dict[str, tuple[str, ...]] = {
    name: (*_BASE_TENSORS, "values") if name == "gae" else _BASE_TENSORS for name in SUPPORTED_ESTIMATORS
}
_REQUIRED_NON_TENSORS: dict[str, tuple[str, ...]] = {
    "grpo": ("uid",),
    "rloo": ("uid",),
    "reinforce_plus_plus": (),
    "reinforce_plus_plus_baseline": ("uid",),
    "gae": (),
    "gigpo": ("uid", "traj_uid", "step_index", "state_hash"),
}

# The keys that make verl's "grpo" into Dr.GRPO (Liu et al. 2025): no std division, no per-response length
# normalisation of the loss (seq-mean-token-sum-norm divides token sums by a constant, the max response length).
DR_GRPO_KEYS: dict[str, object] = {
    "algorithm.adv_estimator": "grpo",
    "algorithm.norm_adv_by_std_in_grpo": False,
    "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-sum-norm",
}


@dataclass(frozen=True)
class AdvantageConfig:
    """Advantage settings. Proposed config keys: ``algorithm.*`` (same names, verl's where verl has them).

    adv_estimator: one of `SUPPORTED_ESTIMATORS`.
    gamma: token-level discount for gae and reinforce_plus_plus (verl default 1.0).
    lam: GAE lambda (verl default 1.0; 0.95 is the usual choice with a learned critic).
    norm_adv_by_std_in_grpo: divide by the group std (GRPO) or not (Dr.GRPO); also GiGPO's episode level.
    singleton_group_advantage: "zero" (default) or "verl"; see the module docstring.
    gigpo: GiGPO's settings (``algorithm.gigpo.*``).
    """

    adv_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    singleton_group_advantage: SingletonRule = "zero"
    gigpo: GiGPOConfig = field(default_factory=GiGPOConfig)

    def __post_init__(self) -> None:
        if self.adv_estimator not in SUPPORTED_ESTIMATORS:
            raise ValueError(
                f"algorithm.adv_estimator must be one of {list(SUPPORTED_ESTIMATORS)}, got {self.adv_estimator!r}"
            )
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"algorithm.gamma must be in [0, 1], got {self.gamma}")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"algorithm.lam must be in [0, 1], got {self.lam}")
        if self.singleton_group_advantage not in ("zero", "verl"):
            raise ValueError(
                f"algorithm.singleton_group_advantage must be 'zero' or 'verl', got {self.singleton_group_advantage!r}"
            )

    @classmethod
    def from_config(cls, cfg: Any) -> AdvantageConfig:
        """From the ``algorithm`` section of the run config; keys this class does not know are ignored there
        (``algorithm`` also holds verl's other settings), missing ones take the defaults above."""
        section = _select_algorithm(cfg)
        values = {name: section[name] for name in _ALGORITHM_KEYS if name in section}
        gigpo = dataclass_from_config({"gigpo": section.get("gigpo")}, "gigpo", GiGPOConfig)
        return cls(**values, gigpo=gigpo or GiGPOConfig())

    def compute(self, data: DataProto) -> DataProto:
        """`compute_advantages` with these settings."""
        return self.compute_with_stats(data).data

    def compute_with_stats(self, data: DataProto) -> AdvantageResult:
        """`compute_advantages_with_stats` with these settings: the batch and what to log about it."""
        return compute_advantages_with_stats(
            data,
            self.adv_estimator,
            gamma=self.gamma,
            lam=self.lam,
            norm_adv_by_std_in_grpo=self.norm_adv_by_std_in_grpo,
            singleton_group_advantage=self.singleton_group_advantage,
            gigpo=self.gigpo,
        )


_ALGORITHM_KEYS = ("adv_estimator", "gamma", "lam", "norm_adv_by_std_in_grpo", "singleton_group_advantage")


def _select_algorithm(cfg: Any) -> dict[str, Any]:

    section = cfg.get("algorithm", {})
    return OmegaConf.to_container(section, resolve=True) if isinstance(section, DictConfig) else dict(section)


def _require(data: DataProto, tensors: tuple[str, ...], non_tensors: tuple[str, ...], estimator: str) -> None:
    missing = [k for k in tensors if k not in data.batch]
    missing += [f"non_tensor_batch[{k!r}]" for k in non_tensors if k not in data.non_tensor_batch]
    if missing:
        raise KeyError(f"adv_estimator={estimator!r} needs batch keys {missing}, which the batch lacks")


def compute_advantages(data: DataProto, adv_estimator: str, **settings: Any) -> DataProto:
    """Write ``advantages`` and ``returns`` [B, R] into `data` (in place; `data` is returned).

    Settings and inputs as `compute_advantages_with_stats`, which also returns the statistics.
    """
    return compute_advantages_with_stats(data, adv_estimator, **settings).data


@dataclass(frozen=True)
class AdvantageResult:
    """A batch with its advantages written, and the statistics the trainer puts into the step's metrics."""

    data: DataProto
    stats: AdvantageStats
    gigpo: GiGPOStats | None = None  # with adv_estimator=gigpo

    def to_metrics(self) -> dict[str, float]:
        """``advantages/*`` and, for GiGPO, ``gigpo/*``."""
        return self.stats.to_metrics() | (self.gigpo.to_metrics() if self.gigpo is not None else {})


def compute_advantages_with_stats(
    data: DataProto,
    adv_estimator: str,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    singleton_group_advantage: SingletonRule = "zero",
    gigpo: GiGPOConfig | None = None,
) -> AdvantageResult:
    """Write ``advantages`` and ``returns`` [B, R] into `data` (in place) and summarise them.

    Reads ``response_mask`` [B, R] and ``token_level_rewards`` [B, R] (reward on the last response token) always;
    ``values`` [B, R] for gae; ``non_tensor_batch["uid"]`` [B] (prompt group) for grpo, rloo,
    reinforce_plus_plus_baseline and gigpo; for gigpo also ``traj_uid``, ``step_index``, ``state_hash`` and,
    optionally, ``step_rewards`` from ``non_tensor_batch``. Estimator formulas and the rules for degenerate groups
    are in the module docstring.
    """
    if adv_estimator not in SUPPORTED_ESTIMATORS:
        raise ValueError(f"adv_estimator must be one of {list(SUPPORTED_ESTIMATORS)}, got {adv_estimator!r}")
    _require(data, _REQUIRED_TENSORS[adv_estimator], _REQUIRED_NON_TENSORS[adv_estimator], adv_estimator)
    token_level_rewards = data.batch["token_level_rewards"].float()
    response_mask = data.batch["response_mask"].float()
    if token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} differ in shape"
        )
    finite = torch.isfinite(token_level_rewards).all(dim=-1)
    if not bool(finite.all()):
        raise ValueError(f"token_level_rewards are not finite in rows {torch.nonzero(~finite).flatten().tolist()}")

    nt = data.non_tensor_batch
    gigpo_stats: GiGPOStats | None = None
    if adv_estimator in _OUTCOME_ESTIMATORS:
        advantages = outcome_advantages(
            adv_estimator,
            token_level_rewards,
            response_mask,
            _trajectories(data),
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
            singleton_group_advantage=singleton_group_advantage,
        )
        returns = advantages
    elif adv_estimator == "gigpo":
        out = compute_gigpo(
            token_level_rewards,
            response_mask,
            nt["uid"],
            nt["traj_uid"],
            nt["step_index"],
            nt["state_hash"],
            nt.get("step_rewards"),
            config=gigpo,
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
            singleton_group_advantage=singleton_group_advantage,
        )
        advantages, returns, gigpo_stats = out.advantages, out.advantages, out.stats
    elif response_mask.sum() < 2:  # gae / reinforce_plus_plus: verl's batch whitening is undefined here
        advantages = torch.zeros_like(token_level_rewards)
        returns = data.batch["values"].float().clone() if adv_estimator == "gae" else torch.zeros_like(advantages)
    else:
        advantages, returns = token_advantages(
            adv_estimator,
            token_level_rewards,
            response_mask,
            _trajectories(data),
            data.batch["values"].float() if adv_estimator == "gae" else None,
            gamma=gamma,
            lam=lam,
        )

    if adv_estimator in ("gae", "reinforce_plus_plus"):
        advantages = _zero_if_constant_before_whitening(advantages, returns, data, adv_estimator, response_mask)
    data.batch["advantages"] = advantages.float() * response_mask
    data.batch["returns"] = returns.float() * response_mask
    return AdvantageResult(data, summarize_advantages(data), gigpo_stats)


def _trajectories(data: DataProto) -> TrajectoryIndex:
    """The batch's rows grouped into trajectories (``uid``, and ``traj_uid`` / ``step_index`` when present)."""
    nt = data.non_tensor_batch
    index = nt["uid"] if "uid" in nt else np.zeros(len(data), dtype=object)
    return index_trajectories(index, nt.get("traj_uid"), nt.get("step_index") if "traj_uid" in nt else None)


def _zero_if_constant_before_whitening(
    advantages: torch.Tensor, returns: torch.Tensor, data: DataProto, adv_estimator: str, response_mask: torch.Tensor
) -> torch.Tensor:
    """Whitening a constant gives 0; verl's masked_whiten instead scales the mean's float error by up to 1e4."""
    valid = response_mask.bool()
    if int(valid.sum()) < 2:
        return advantages
    raw = returns - data.batch["values"].float() if adv_estimator == "gae" else returns  # the un-whitened values
    raw = raw[valid]
    if float(raw.max() - raw.min()) <= REWARD_EQUAL_TOL:
        return torch.zeros_like(advantages)
    return advantages


@dataclass(frozen=True)
class AdvantageStats:
    """Summary of a batch's advantages and of its groups, for logging."""

    num_rows: int
    num_trajectories: int  # rows of one trajectory (its turns with layout per_step) count once
    num_groups: int
    num_singleton_groups: int  # groups of one trajectory
    num_zero_spread_groups: int  # groups of two or more trajectories with equal scores: advantage 0
    adv_mean: float  # over response tokens
    adv_std: float
    adv_abs_max: float
    zero_adv_token_fraction: float  # response tokens whose advantage is exactly 0

    def to_metrics(self, prefix: str = "advantages/") -> dict[str, float]:
        return {f"{prefix}{name}": float(value) for name, value in self.__dict__.items()}


def summarize_advantages(data: DataProto) -> AdvantageStats:
    """`AdvantageStats` of a batch after `compute_advantages`: groups from ``non_tensor_batch["uid"]`` if present,
    trajectories from ``traj_uid`` (scored by their summed rewards, as the outcome estimators score them)."""
    mask = data.batch["response_mask"].bool()
    adv = data.batch["advantages"][mask].double()
    num_rows = len(data)
    trajectories = _trajectories(data)
    if "uid" in data.non_tensor_batch and num_rows:
        scores = trajectories.per_trajectory(data.batch["token_level_rewards"].double().sum(dim=-1))
        singleton, zero_spread = degenerate_rows(scores, trajectories.group)
        num_groups = len(set(trajectories.group.tolist()))
        num_zero_spread = len(set(trajectories.group[zero_spread].tolist()))
        num_singleton = int(singleton.sum())
    else:
        num_groups = num_zero_spread = num_singleton = 0
    return AdvantageStats(
        num_rows=num_rows,
        num_trajectories=trajectories.num_trajectories,
        num_groups=num_groups,
        num_singleton_groups=num_singleton,
        num_zero_spread_groups=num_zero_spread,
        adv_mean=float(adv.mean()) if adv.numel() else 0.0,
        adv_std=float(adv.std(unbiased=False)) if adv.numel() else 0.0,
        adv_abs_max=float(adv.abs().max()) if adv.numel() else 0.0,
        zero_adv_token_fraction=float((adv == 0).double().mean()) if adv.numel() else 0.0,
    )
