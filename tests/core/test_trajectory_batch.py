"""Batch assembly: groups of trajectories become verl's padded layout with rewards, versions and group ids."""

from __future__ import annotations

import pytest
import torch

from rllm.experimental.fully_async.api.trajectory import (
    TrajectoryStatus,
    VersionedGroup,
    VersionedSequence,
    VersionedTrajectory,
)
from rllm.experimental.fully_async.core.batch import PAD_VERSION, groups_to_dataproto

PAD = 0


def _traj(uid: str, prompt: list[int], response: list[int], versions: list[int], reward: float) -> VersionedTrajectory:
    seq = VersionedSequence(
        prompt_ids=prompt,
        response_ids=response,
        response_logprobs=[-0.5 - 0.1 * i for i in range(len(response))],
        response_versions=versions,
    )
    return VersionedTrajectory(uid=uid, prompt_uid=uid.split("/")[0], sequences=[seq], reward=reward)


def test_prompts_are_left_padded_and_responses_right_padded():
    group_a = VersionedGroup(
        "a", [_traj("a/0", [5, 6, 7], [8, 9], [3, 4], 1.0), _traj("a/1", [5, 6, 7], [8], [4], 0.0)]
    )
    group_b = VersionedGroup("b", [_traj("b/0", [5], [9, 9, 9], [2, 2, 3], 0.5)])
    data = groups_to_dataproto([group_a, group_b], pad_token_id=PAD, temperature=0.7)
    b = data.batch
    assert b["input_ids"].shape == (3, 3 + 3)
    assert b["input_ids"][2].tolist() == [PAD, PAD, 5, 9, 9, 9]
    assert b["attention_mask"][2].tolist() == [0, 0, 1, 1, 1, 1]
    assert b["responses"][1].tolist() == [8, PAD, PAD]
    assert b["response_mask"][1].tolist() == [1.0, 0.0, 0.0]
    # positions count real tokens only, so a left-padded row starts at 0 where its prompt starts
    assert b["position_ids"][2].tolist() == [0, 0, 0, 1, 2, 3]
    # the reward sits on the last real response token
    assert b["token_level_scores"][0].tolist() == [0.0, 1.0, 0.0]
    assert b["token_level_scores"][2].tolist() == [0.0, 0.0, 0.5]
    assert b["response_versions"][1].tolist() == [4, PAD_VERSION, PAD_VERSION]
    assert torch.allclose(b["rollout_log_probs"][0, :2], torch.tensor([-0.5, -0.6]))
    assert list(data.non_tensor_batch["uid"]) == ["a", "a", "b"]
    assert list(data.non_tensor_batch["sample_uid"]) == ["a/0", "a/1", "b/0"]
    assert data.meta_info["temperature"] == 0.7


def test_failed_trajectories_are_left_out_and_an_all_failed_batch_is_an_error():
    ok = _traj("a/0", [1], [2], [0], 1.0)
    failed = VersionedTrajectory(
        "a/1", "a", sequences=[], status=TrajectoryStatus.FAILED, failure_reason="reward_error"
    )
    data = groups_to_dataproto([VersionedGroup("a", [ok, failed])], pad_token_id=PAD, temperature=1.0)
    assert len(data) == 1
    with pytest.raises(ValueError, match="no trainable"):
        groups_to_dataproto([VersionedGroup("a", [failed])], pad_token_id=PAD, temperature=1.0)


def test_empty_response_trains_nothing_but_keeps_its_row():
    empty = _traj("a/0", [1, 2], [], [], 1.0)
    other = _traj("a/1", [1, 2], [3], [0], 0.0)
    data = groups_to_dataproto([VersionedGroup("a", [empty, other])], pad_token_id=PAD, temperature=1.0)
    assert data.batch["response_mask"][0].sum().item() == 0
    assert data.batch["token_level_scores"][0].sum().item() == 1.0  # its reward counts in its group's statistics


def test_multi_step_trajectory_gives_one_row_per_step_with_step_rewards_and_state_hashes():
    steps = [
        VersionedSequence([1], [2], [-0.1], [0]),
        VersionedSequence([1, 2, 3], [4, 5], [-0.2, -0.3], [1, 1], loss_mask=[1, 0]),
    ]
    traj = VersionedTrajectory("g/0", "g", steps, reward=1.0, step_rewards=[0.2, 0.8], step_state_hashes=["s0", "s1"])
    data = groups_to_dataproto([VersionedGroup("g", [traj])], pad_token_id=PAD, temperature=1.0)
    assert len(data) == 2
    assert list(data.non_tensor_batch["step_index"]) == [0, 1]
    assert list(data.non_tensor_batch["state_hash"]) == ["s0", "s1"]
    assert data.batch["token_level_scores"][0, 0].item() == pytest.approx(0.2)
    assert data.batch["token_level_scores"][1, 1].item() == pytest.approx(0.8)
    # tool/environment tokens (loss_mask 0) are conditioned on but not trained
    assert data.batch["response_mask"][1].tolist() == [1.0, 0.0]


def test_the_configured_response_length_travels_in_meta_info_for_a_constant_normaliser():
    # R is the batch's longest response (2 here); Dr.GRPO divides by the configured maximum, which must reach the
    # loss unchanged whatever the batch holds.
    group = VersionedGroup("a", [_traj("a/0", [5], [8, 9], [0, 0], 1.0), _traj("a/1", [5], [8], [0], 0.0)])
    data = groups_to_dataproto([group], pad_token_id=PAD, temperature=1.0, max_response_length=48)
    assert data.batch["responses"].shape[1] == 2
    assert data.meta_info == {"temperature": 1.0, "max_response_length": 48}
    assert "max_response_length" not in groups_to_dataproto([group], pad_token_id=PAD, temperature=1.0).meta_info
