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
P and R are the batch's longest prompt and response (not the configured maxima) so padding costs nothing;
meta_info carries `temperature` and, when given, the configured `max_response_length` (Dr.GRPO's constant).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from verl import DataProto

from rllm.experimental.fully_async.api.trajectory import TrajectoryStatus, VersionedGroup

PAD_VERSION = -1


def trainable_trajectories(groups: Iterable[VersionedGroup]):
    """The OK trajectories of the groups, in order (failed ones are accounted for by the caller)."""
    for group in groups:
        for trajectory in group.trajectories:
            if trajectory.status == TrajectoryStatus.OK:
                yield group, trajectory


def groups_to_dataproto(
    groups: list[VersionedGroup], *, pad_token_id: int, temperature: float, max_response_length: int | None = None
) -> DataProto:
    """Assemble the rows described in the module docstring. Raises ValueError if there is nothing to train.

    `max_response_length` (data.max_response_length) goes into `meta_info["max_response_length"]`: the constant
    a loss normaliser such as Dr.GRPO's needs, since R here is the batch's longest response, not the configured one.
    """
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

    # Rows are padded as Python lists and each tensor is built with one torch.tensor call: per-row tensor slices
    # cost ~5 small tensor constructions a row, which made assembly the largest piece of the step's machinery.
    ids_rows, attention_rows, mask_rows, logprob_rows, version_rows, score_rows = [], [], [], [], [], []
    for _, _, _, _, reward, seq in rows:
        p, r = len(seq.prompt_ids), len(seq.response_ids)
        pad_p, pad_r = prompt_len - p, response_len - r
        ids_rows.append([pad_token_id] * pad_p + list(seq.prompt_ids) + list(seq.response_ids) + [pad_token_id] * pad_r)
        attention_rows.append([0] * pad_p + [1] * (p + r) + [0] * pad_r)
        mask_rows.append(list(seq.loss_mask) + [0] * pad_r)
        logprob_rows.append(list(seq.response_logprobs) + [0.0] * pad_r)
        version_rows.append(list(seq.response_versions) + [PAD_VERSION] * pad_r)
        # The reward sits on the last response token; an empty response has none, so it sits at position 0. Its
        # mask is all zero, so it trains nothing (the patched actor's empty-mask guard), but its reward counts in
        # its group's statistics (estimators score a row by the sum of its token_level_rewards).
        score_row = [0.0] * response_len
        score_row[max(r, 1) - 1] = reward
        score_rows.append(score_row)
    input_ids = torch.tensor(ids_rows, dtype=torch.long)
    attention_mask = torch.tensor(attention_rows, dtype=torch.long)
    response_mask = torch.tensor(mask_rows, dtype=torch.float32)
    rollout_log_probs = torch.tensor(logprob_rows, dtype=torch.float32)
    versions = torch.tensor(version_rows, dtype=torch.long)
    scores = torch.tensor(score_rows, dtype=torch.float32)

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
    meta_info: dict[str, float | int] = {"temperature": temperature}
    if max_response_length is not None:
        meta_info["max_response_length"] = int(max_response_length)
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info)
