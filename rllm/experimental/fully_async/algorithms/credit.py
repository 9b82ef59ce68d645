"""Credit per trajectory: verl's estimators run over trajectories, not over training rows
(docs/design.md#rule-trajectory-unit-of-credit).

`core/batch.py` makes one training row per `Sequence`, so one trajectory may be several rows: one per turn with
``workflow.layout=per_step``, one per Sequence of an rLLM trajectory. The credit a token gets must not depend on
that layout, so the estimators see the batch through this module, in one of two views:

- **One entry per trajectory** (outcome estimators: grpo, rloo, reinforce_plus_plus_baseline; GiGPO's episode
  level). A trajectory's score s_tau is the sum of its rows' ``token_level_rewards`` (its step rewards summed); it
  enters its group's statistics once, however many rows it has, and its advantage goes to every row of it
  (`outcome_advantages`). verl's function sees one row per trajectory holding s_tau and a mask of n_tau ones (its
  trained tokens), so reinforce_plus_plus_baseline's batch whitening still weighs a trajectory by its tokens. This
  is rLLM's rule (its fully-async `compute_grpo_outcome_advantage` counts each trajectory uuid once and gives every
  row the trajectory's value) and verl-agent's with ``compute_mean_std_cross_all_data=False`` (one score per
  (uid, traj_index) pair).
- **One token sequence per trajectory** (token-level estimators: gae, reinforce_plus_plus; `token_advantages`). The
  trajectory's trained tokens (``response_mask`` = 1), rows in step order and columns in order, form one row
  (`TokenChain`): what the ``concat`` layout's single row holds once its masked observation tokens are skipped, as
  verl's GAE skips them inside a row (it carries V and the running advantage over mask-0 tokens). So a turn's last
  token bootstraps from the value of the next turn's first token instead of ending the episode there, and a
  discounted return reaches the earlier turns. A reward on an untrained token (an empty turn, a masked tail) moves
  to the latest trained token at or before it in the chain: verl's GAE drops a reward on a mask-0 token and its
  REINFORCE++ resets the running return there. A reward with no trained token before it in its trajectory has no
  action to credit and is left out of the token-level estimators (the outcome estimators still count it).

Rows are matched to trajectories by ``traj_uid`` and ordered by ``step_index``; without ``traj_uid`` every row is
its own trajectory (single-turn batches, batches built by hand), without ``step_index`` rows keep batch order.
Groups without signal (`degenerate_rows`: one trajectory, or scores that tie) get exactly 0 from the outcome
estimators; the rules are in `advantages.py`'s docstring.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo.core_algos import get_adv_estimator_fn

from rllm.experimental.fully_async.algorithms.filters import REWARD_EQUAL_TOL

SingletonRule = Literal["zero", "verl"]
_WHITENING_ESTIMATORS = frozenset({"gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"})


def _trajectory_table(index: np.ndarray, traj_index: np.ndarray) -> tuple[list[Any], np.ndarray, np.ndarray]:
    """Unique trajectory ids, the prompt group of each, and each row's position in that list."""
    trajs: dict[Any, int] = {}
    group_of: list[Any] = []
    row_to_traj = np.empty(len(traj_index), dtype=np.int64)
    for row, (uid, traj) in enumerate(zip(index, traj_index, strict=True)):
        if traj not in trajs:
            trajs[traj] = len(trajs)
            group_of.append(uid)
        elif group_of[trajs[traj]] != uid:
            raise ValueError(f"trajectory {traj!r} appears under two prompt groups: {group_of[trajs[traj]]!r}, {uid!r}")
        row_to_traj[row] = trajs[traj]
    return list(trajs), np.array(group_of, dtype=object), row_to_traj


@dataclass(frozen=True)
class TrajectoryIndex:
    """Which trajectory each of B rows belongs to, and the rows of each trajectory in step order.

    traj_ids: [T] the trajectory ids, in order of first appearance.
    group: [T] the prompt group (``uid``) of each trajectory.
    row_to_traj: [B] int, the position in `traj_ids` of each row's trajectory.
    order: [B] int, the rows sorted by (trajectory, step): each trajectory's rows are contiguous, in step order.
    """

    traj_ids: list[Any]
    group: np.ndarray
    row_to_traj: np.ndarray
    order: np.ndarray

    @property
    def num_trajectories(self) -> int:
        return len(self.traj_ids)

    def per_trajectory(self, per_row: torch.Tensor) -> torch.Tensor:
        """[B] -> [T]: the sum over each trajectory's rows (float64 sums, returned in `per_row`'s dtype)."""
        out = torch.zeros(self.num_trajectories, dtype=torch.float64)
        out.index_add_(0, torch.from_numpy(self.row_to_traj), per_row.detach().double().cpu())
        return out.to(per_row.dtype)

    def to_rows(self, per_traj: torch.Tensor) -> torch.Tensor:
        """[T] -> [B]: each row gets its trajectory's value."""
        return per_traj[torch.from_numpy(self.row_to_traj)]


def index_trajectories(
    index: np.ndarray | list[Any], traj_index: np.ndarray | list[Any] | None = None, step_index: Any = None
) -> TrajectoryIndex:
    """Build the `TrajectoryIndex` of a batch from its ``uid``, ``traj_uid`` and ``step_index`` columns.

    Args:
        index: [B] prompt group per row.
        traj_index: [B] trajectory per row, or None: every row is its own trajectory.
        step_index: [B] integer step number per row, unique within a trajectory, or None: batch order.

    Raises:
        ValueError: a trajectory under two prompt groups, repeated step numbers within a trajectory, or columns of
            different lengths.
    """
    index = np.asarray(index, dtype=object)
    rows = len(index)
    traj_index = np.arange(rows).astype(object) if traj_index is None else np.asarray(traj_index, dtype=object)
    if len(traj_index) != rows:
        raise ValueError(f"traj_uid has {len(traj_index)} rows, uid {rows}")
    traj_ids, group, row_to_traj = _trajectory_table(index, traj_index)
    if step_index is None:
        steps = np.arange(rows, dtype=np.int64)
    else:
        steps = np.asarray(step_index).astype(np.int64)
        if len(steps) != rows:
            raise ValueError(f"step_index has {len(steps)} rows, uid {rows}")
    order = np.lexsort((steps, row_to_traj)) if rows else np.zeros(0, dtype=np.int64)
    sorted_traj, sorted_steps = row_to_traj[order], steps[order]
    repeated = (sorted_traj[1:] == sorted_traj[:-1]) & (sorted_steps[1:] == sorted_steps[:-1])
    if repeated.any():
        traj = traj_ids[int(sorted_traj[1:][repeated][0])]
        raise ValueError(f"trajectory {traj!r} has repeated step_index {int(sorted_steps[1:][repeated][0])}")
    return TrajectoryIndex(traj_ids=traj_ids, group=group, row_to_traj=row_to_traj, order=order.astype(np.int64))


@dataclass(frozen=True)
class TokenChain:
    """Each trajectory's trained tokens as one row [T, L] (L = the longest trajectory's trained-token count, >= 1).

    rows, cols: [N] where chained token k sits in the batch; traj, rank: [N] where it sits in the chain.
    mask: [T, L] 1 on the chained tokens (each trajectory's first n_tau columns).
    """

    rows: torch.Tensor
    cols: torch.Tensor
    traj: torch.Tensor
    rank: torch.Tensor
    mask: torch.Tensor
    batch_shape: tuple[int, int]
    _sort_key: torch.Tensor  # [N] (position of the row in `order`) * R + column: increasing along the chain
    _row_position: torch.Tensor  # [B] position of each row in `order`
    _row_to_traj: torch.Tensor  # [B]

    def gather(self, per_token: torch.Tensor) -> torch.Tensor:
        """[B, R] -> [T, L]: the values at the chained tokens (0 past each trajectory's end)."""
        out = torch.zeros(self.mask.shape, dtype=per_token.dtype)
        out[self.traj, self.rank] = per_token[self.rows, self.cols]
        return out

    def scatter(self, chained: torch.Tensor) -> torch.Tensor:
        """[T, L] -> [B, R]: each chained value back at its token; 0 on untrained tokens."""
        out = torch.zeros(self.batch_shape, dtype=chained.dtype)
        out[self.rows, self.cols] = chained[self.traj, self.rank]
        return out

    def rewards(self, token_level_rewards: torch.Tensor) -> torch.Tensor:
        """[B, R] -> [T, L]: rewards on trained tokens stay there; a reward on an untrained token moves to the latest
        trained token at or before it in its trajectory (left out if there is none; module docstring)."""
        out = self.gather(token_level_rewards)
        trained = torch.zeros(self.batch_shape, dtype=torch.bool)
        trained[self.rows, self.cols] = True
        stray_rows, stray_cols = torch.nonzero((token_level_rewards != 0) & ~trained, as_tuple=True)
        if len(stray_rows) == 0 or len(self.rows) == 0:
            return out
        key = self._row_position[stray_rows] * self.batch_shape[1] + stray_cols
        latest = torch.searchsorted(self._sort_key, key, right=True) - 1
        same_traj = (latest >= 0) & (self.traj[latest.clamp(min=0)] == self._row_to_traj[stray_rows])
        target = latest[same_traj]
        out.index_put_(
            (self.traj[target], self.rank[target]),
            token_level_rewards[stray_rows[same_traj], stray_cols[same_traj]].to(out.dtype),
            accumulate=True,
        )
        return out


def chain_tokens(trajectories: TrajectoryIndex, response_mask: torch.Tensor) -> TokenChain:
    """The `TokenChain` of a batch: trained tokens (``response_mask`` [B, R] nonzero) of each trajectory in order."""
    num_rows, width = response_mask.shape
    order = torch.from_numpy(trajectories.order)
    row_to_traj = torch.from_numpy(trajectories.row_to_traj)
    position = torch.empty(num_rows, dtype=torch.long)
    position[order] = torch.arange(num_rows)
    # Row-major nonzero over the rows in (trajectory, step) order lists each trajectory's tokens contiguously, in order.
    sorted_rows, cols = torch.nonzero(response_mask[order] != 0, as_tuple=True)
    rows = order[sorted_rows]
    traj = row_to_traj[rows]
    counts = torch.bincount(traj, minlength=trajectories.num_trajectories)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(len(rows)) - starts[traj]
    length = max(1, int(counts.max())) if len(counts) else 1
    mask = (torch.arange(length).unsqueeze(0) < counts.unsqueeze(1)).float()
    return TokenChain(
        rows=rows,
        cols=cols,
        traj=traj,
        rank=rank,
        mask=mask,
        batch_shape=(num_rows, width),
        _sort_key=sorted_rows * width + cols,
        _row_position=position,
        _row_to_traj=row_to_traj,
    )


def degenerate_rows(
    scores: torch.Tensor, index: np.ndarray, tol: float = REWARD_EQUAL_TOL
) -> tuple[np.ndarray, np.ndarray]:
    """Rows whose group carries no relative signal.

    Args:
        scores: [N] one scalar per row.
        index: [N] group id per row.
        tol: scores within `tol` of each other count as equal.

    Returns:
        (singleton [N] bool: the row's group has one row, zero_spread [N] bool: the group has two or more rows and
        max - min <= tol). verl's GRPO divides (score - mean) by (std + 1e-6); for a zero-spread group the float
        error of the mean becomes an advantage of up to ~0.2 (seven rewards of 2.7), so callers zero these rows.
    """
    values = scores.detach().double().cpu().numpy()
    members: dict[Any, list[int]] = defaultdict(list)
    for row, key in enumerate(index):
        members[key].append(row)
    singleton = np.zeros(len(values), dtype=bool)
    zero_spread = np.zeros(len(values), dtype=bool)
    for rows in members.values():
        if len(rows) == 1:
            singleton[rows] = True
        elif values[rows].max() - values[rows].min() <= tol:
            zero_spread[rows] = True
    return singleton, zero_spread


def _group_estimator(
    estimator: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    *,
    norm_adv_by_std_in_grpo: bool,
    singleton_group_advantage: SingletonRule,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a verl group estimator on the rows of groups that carry signal; the other rows get 0."""
    singleton, zero_spread = degenerate_rows(token_level_rewards.sum(dim=-1), index)
    inactive = zero_spread | (singleton if singleton_group_advantage == "zero" else np.zeros_like(singleton))
    active = np.nonzero(~inactive)[0]
    advantages = torch.zeros_like(token_level_rewards)
    returns = torch.zeros_like(token_level_rewards)
    rows = torch.from_numpy(active)
    if len(active) == 0:
        return advantages, returns
    if estimator in _WHITENING_ESTIMATORS and response_mask[rows].sum() < 2:
        return advantages, returns
    kwargs: dict[str, object] = {
        "token_level_rewards": token_level_rewards[rows],
        "response_mask": response_mask[rows],
        "index": index[active],
    }
    if estimator == "grpo":
        kwargs["norm_adv_by_std_in_grpo"] = norm_adv_by_std_in_grpo
    adv, ret = get_adv_estimator_fn(estimator)(**kwargs)
    advantages[rows] = adv.to(advantages.dtype)
    returns[rows] = ret.to(returns.dtype)
    return advantages, returns


def outcome_advantages(
    estimator: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    trajectories: TrajectoryIndex,
    **settings: Any,
) -> torch.Tensor:
    """An outcome estimator over trajectories: verl sees one row per trajectory, every row gets its value back.

    The trajectory row holds the score s_i (the sum of its rows' rewards) and a mask of n_i ones, n_i its trained
    tokens, so verl's per-row arithmetic sees each trajectory once and its batch whitening (reinforce_plus_plus_
    baseline) weighs each trajectory by its tokens, as the concat layout's single row would. `settings` are
    `_group_estimator`'s (norm_adv_by_std_in_grpo, singleton_group_advantage).

    Returns advantages [B, R] (the estimator's returns equal them), zero on untrained tokens.
    """
    scores = trajectories.per_trajectory(token_level_rewards.sum(dim=-1))
    counts = trajectories.per_trajectory(response_mask.sum(dim=-1)).round().long()
    width = max(1, int(counts.max())) if len(counts) else 1
    traj_mask = (torch.arange(width).unsqueeze(0) < counts.unsqueeze(1)).float()
    traj_rewards = torch.zeros(len(scores), width)
    traj_rewards[:, 0] = scores
    advantages, _ = _group_estimator(estimator, traj_rewards, traj_mask, trajectories.group, **settings)
    # Every token of trajectory i carries A_i (verl multiplies by the mask, so column 0 holds it when n_i >= 1).
    return trajectories.to_rows(advantages[:, 0]).unsqueeze(-1) * response_mask


def token_advantages(
    estimator: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    trajectories: TrajectoryIndex,
    values: torch.Tensor | None,
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """gae (`values` [B, R] given) or reinforce_plus_plus over each trajectory's trained tokens in step order.

    Returns (advantages, returns) [B, R], zero on untrained tokens.
    """
    chain = chain_tokens(trajectories, response_mask)
    rewards = chain.rewards(token_level_rewards)
    if values is not None:  # gae
        advantages, returns = get_adv_estimator_fn("gae")(
            token_level_rewards=rewards, values=chain.gather(values), response_mask=chain.mask, gamma=gamma, lam=lam
        )
    else:  # reinforce_plus_plus reads gamma from an AlgoConfig
        advantages, returns = get_adv_estimator_fn(estimator)(
            token_level_rewards=rewards,
            response_mask=chain.mask,
            config=AlgoConfig(gamma=gamma, lam=lam, adv_estimator=estimator),
        )
    return chain.scatter(advantages.float()), chain.scatter(returns.float())
