"""Batch assembly: trajectory groups -> one verl `DataProto` (pure tensors; no Ray, no I/O).

Every Sequence of every OK trajectory becomes one row, laid out the way verl's actor expects:

    input_ids      [B, P + R]  prompt left-padded to P, response right-padded to R
    attention_mask [B, P + R]  1 on real tokens
    position_ids   [B, P + R]  cumsum(attention_mask) - 1, clipped at 0
    responses      [B, R]
    response_mask  [B, R]      1 on tokens the policy generated and is trained on (Sequence.loss_mask)
    rollout_log_probs [B, R]   the engine's log-probs of the sampled tokens (behaviour policy)
    response_versions [B, R]   policy version that produced each token (-1 on padding)
    token_level_scores / token_level_rewards [B, R]  the trajectory reward on its last response token

non_tensor_batch: `uid` (prompt group, what group-relative estimators normalise over), `traj_uid`,
`step_index` and `state_hash` (multi-step GiGPO), `sample_uid` (the ledger's key).
P and R are the batch's longest prompt and response (not the configured maxima) so padding costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from verl import DataProto

from rllm.experimental.fully_async.core.protocol import TrajectoryGroup, TrajectoryStatus

PAD_VERSION = -1


def trainable_trajectories(groups: Iterable[TrajectoryGroup]):
    """The OK trajectories of the groups, in order (failed ones are accounted for by the caller)."""
    for group in groups:
        for trajectory in group.trajectories:
            if trajectory.status == TrajectoryStatus.OK:
                yield group, trajectory


def groups_to_dataproto(groups: list[TrajectoryGroup], *, pad_token_id: int, temperature: float) -> DataProto:
    """Assemble the rows described in the module docstring. Raises ValueError if there is nothing to train."""
    rows = []
    for group, trajectory in trainable_trajectories(groups):
        num_steps = len(trajectory.sequences)
        for step_index, sequence in enumerate(trajectory.sequences):
            is_last = step_index == num_steps - 1
            if trajectory.step_rewards is not None:
                reward = float(trajectory.step_rewards[step_index] or 0.0)
            else:
                reward = float(trajectory.reward) if is_last else 0.0
            state_hash = trajectory.step_state_hashes[step_index] if trajectory.step_state_hashes is not None else ""
            rows.append((group.prompt_uid, trajectory.uid, step_index, state_hash, reward, sequence))
    if not rows:
        raise ValueError("no trainable trajectory in the batch (all failed)")

    prompt_len = max(len(r[5].prompt_ids) for r in rows)
    response_len = max(1, max(len(r[5].response_ids) for r in rows))
    batch_size = len(rows)

    input_ids = torch.full((batch_size, prompt_len + response_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, prompt_len + response_len), dtype=torch.long)
    response_mask = torch.zeros((batch_size, response_len), dtype=torch.float32)
    rollout_log_probs = torch.zeros((batch_size, response_len), dtype=torch.float32)
    versions = torch.full((batch_size, response_len), PAD_VERSION, dtype=torch.long)
    scores = torch.zeros((batch_size, response_len), dtype=torch.float32)

    for i, (_, _, _, _, reward, seq) in enumerate(rows):
        p, r = len(seq.prompt_ids), len(seq.response_ids)
        input_ids[i, prompt_len - p : prompt_len] = torch.tensor(seq.prompt_ids, dtype=torch.long)
        attention_mask[i, prompt_len - p : prompt_len] = 1
        if r:
            input_ids[i, prompt_len : prompt_len + r] = torch.tensor(seq.response_ids, dtype=torch.long)
            attention_mask[i, prompt_len : prompt_len + r] = 1
            response_mask[i, :r] = torch.tensor(seq.loss_mask, dtype=torch.float32)
            rollout_log_probs[i, :r] = torch.tensor(seq.response_logprobs, dtype=torch.float32)
            versions[i, :r] = torch.tensor(seq.response_versions, dtype=torch.long)
        # The reward sits on the last response token; an empty response has none, so it sits at position 0. Its
        # mask is all zero, so it trains nothing (the patched actor's empty-mask guard), but its reward counts in
        # its group's statistics (estimators score a row by the sum of its token_level_rewards).
        scores[i, max(r, 1) - 1] = reward

    position_ids = torch.clamp(torch.cumsum(attention_mask, dim=-1) - 1, min=0)
    tensors = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": input_ids[:, prompt_len:].clone(),
        "prompts": input_ids[:, :prompt_len].clone(),
        "response_mask": response_mask,
        "rollout_log_probs": rollout_log_probs,
        "response_versions": versions,
        "token_level_scores": scores,
        "token_level_rewards": scores.clone(),
    }
    non_tensors = {
        "uid": np.array([r[0] for r in rows], dtype=object),
        "sample_uid": np.array([r[1] for r in rows], dtype=object),
        "traj_uid": np.array([r[1] for r in rows], dtype=object),
        "step_index": np.array([r[2] for r in rows], dtype=object),
        "state_hash": np.array([r[3] for r in rows], dtype=object),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info={"temperature": temperature})
