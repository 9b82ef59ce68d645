"""An rLLM trajectory trains here as rLLM trains it: the rows, masks, log-probs and advantages of a batch of
multi-turn trajectories, against a reference written in this file from rLLM's published code (rllm-org/rllm,
`rllm/experimental/fully_async/protocol.py` `Sequence.merge`, `Sequence.resize_prompt_length`, `Trajectory.merge`;
`utils.py` `assemble_batch_from_trajectory_group_ls` and `compute_grpo_outcome_advantage`).

The rollout function is written the way rLLM's are: `client.generate`, `output.to_sequence()` per turn, the next
turn's prompt the conversation so far (`all_tokens()` plus an observation), no `merge()` of its own (rLLM's trainer
merges). The engine is scripted, the tokenizer the tool world's real one.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from rllm_tool_world import build_tokenizer
from workflow_helpers import Datum

from rllm.experimental.fully_async.algorithms.advantages import compute_advantages
from rllm.experimental.fully_async.api.trajectory import TrajectoryStatus, VersionedGroup
from rllm.experimental.fully_async.core.batch import groups_to_dataproto
from rllm.experimental.fully_async.engines.client import GenerationResult
from rllm.experimental.fully_async.protocol import Trajectory
from rllm.experimental.fully_async.workflows.rllm_compat import RllmRolloutWorkflow


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@dataclass
class Engine:
    """Answers request i with the tokens of `replies[i]` + EOS, log-prob -0.1 * (i + 1) per token, version 0."""

    tokenizer: Any
    replies: list[str]
    requests: list[list[int]] = field(default_factory=list)

    async def generate(self, input_ids, sampling_params, *, rid=None) -> GenerationResult:
        turn = len(self.requests)
        self.requests.append(list(input_ids))
        ids = [*self.tokenizer.encode(self.replies[turn], add_special_tokens=False), self.tokenizer.eos_token_id]
        return GenerationResult(ids, [-0.1 * (turn + 1)] * len(ids), [0] * len(ids), "stop", 0, len(input_ids))


async def rollout_fn(client, tokenizer, **kwargs):
    """Three turns: the second extends the first (merged by rLLM), the third starts a re-rendered conversation
    that drops a token of the history (not a prefix: a row of its own)."""
    obs = tokenizer.encode(" ok", add_special_tokens=False)
    first = await client.generate(kwargs["prompt_ids"], {"max_new_tokens": 8})
    second = await client.generate(first.all_tokens() + obs, {"max_new_tokens": 8})
    third = await client.generate(second.all_tokens()[1:] + obs, {"max_new_tokens": 8})
    sequences = [first.to_sequence(), second.to_sequence(), third.to_sequence()]
    reward = float(len(third.all_response_ids()) % 3)  # differs between the group's samples
    return Trajectory(sequences=sequences, reward=reward, metadata={"turns": 3})


# ---- the reference: rLLM's assembly, written from its source ---------------------------------------------------


@dataclass
class Row:
    prompt: list[int]
    response: list[int]
    logprobs: list[float]
    masks: list[int]


def rllm_merge(rows: list[Row]) -> list[Row]:
    """Trajectory.merge with Sequence.merge: a sequence that is a prefix of the next absorbs it; the next one's
    prompt tokens beyond it pad the response with log-prob 0.0 and mask 0."""
    out: list[Row] = []
    for row in rows:
        if out and row.prompt[: len(out[-1].prompt) + len(out[-1].response)] == out[-1].prompt + out[-1].response:
            cur = out[-1]
            total = len(cur.prompt) + len(cur.response)
            pad = max(len(row.prompt) - total, 0)
            start = max(total - len(row.prompt), 0)
            out[-1] = Row(
                cur.prompt,
                (row.prompt + row.response)[len(cur.prompt) :],
                cur.logprobs + [0.0] * pad + row.logprobs[start:],
                cur.masks + [0] * pad + row.masks[start:],
            )
        else:
            out.append(row)
    return out


def rllm_resize(row: Row, max_prompt: int) -> Row:
    """Sequence.resize_prompt_length."""
    if len(row.prompt) <= max_prompt:
        return row
    cut = len(row.prompt) - max_prompt
    return Row(
        row.prompt[:max_prompt],
        row.prompt[max_prompt:] + row.response,
        [0.0] * cut + row.logprobs,
        [0] * cut + row.masks,
    )


def rllm_batch(trajectories: list[tuple[str, Trajectory]], max_prompt: int, max_response: int, pad: int) -> dict:
    """assemble_batch_from_trajectory_group_ls and compute_grpo_outcome_advantage, for one prompt group."""
    data = []
    for traj_uid, trajectory in trajectories:
        rows = [Row(s.prompt_ids, s.response_ids, s.response_logprobs, s.response_masks) for s in trajectory.sequences]
        for row in rllm_merge(rows):
            data.append((traj_uid, trajectory.reward, rllm_resize(row, max_prompt)))
    width_p = max(len(r.prompt) for _, _, r in data)
    width_r = min(max(len(r.response) for _, _, r in data), max_response)
    n = len(data)
    prompts = torch.full((n, width_p), pad)
    responses = torch.full((n, width_r), pad)
    attention = torch.zeros((n, width_p + width_r), dtype=torch.long)
    masks = torch.zeros((n, width_r), dtype=torch.long)
    logprobs = torch.zeros((n, width_r))
    scores = torch.zeros((n, width_r))
    for i, (_, reward, row) in enumerate(data):
        p, r = len(row.prompt), min(len(row.response), width_r)
        prompts[i, width_p - p :] = torch.tensor(row.prompt)
        attention[i, width_p - p : width_p] = 1
        responses[i, :r] = torch.tensor(row.response[:r])
        attention[i, width_p : width_p + r] = 1
        masks[i, :r] = torch.tensor(row.masks[:r])
        logprobs[i, :r] = torch.tensor(row.logprobs[:r])
        scores[i, max(min(len(row.response), width_r) - 1, 0)] = reward
    masks = masks * attention[:, width_p:]
    # GRPO over trajectories: each trajectory uuid's score once in its group, every row gets its trajectory's value
    per_traj: dict[str, torch.Tensor] = {}
    for i, (traj_uid, _, _) in enumerate(data):
        per_traj.setdefault(traj_uid, scores[i].sum())
    group = torch.stack(list(per_traj.values()))
    mean, std = group.mean(), group.std()
    advantages = torch.stack([(per_traj[t] - mean) / (std + 1e-6) for t, _, _ in data]).unsqueeze(-1) * masks
    return {"prompts": prompts, "responses": responses, "attention_mask": attention, "response_mask": masks,
            "rollout_log_probs": logprobs, "advantages": advantages}  # fmt: skip


# ---- the test ----------------------------------------------------------------------------------------------------


def play(tok, replies: list[str], samples: int, max_prompt: int, max_response: int) -> tuple[list, list]:
    """The group's trajectories as rLLM's function returned them, and as the adapter made them."""
    engine = Engine(tok, replies)
    returned: list[Trajectory] = []

    async def recording(client, tokenizer, **kwargs):
        returned.append(await rollout_fn(client, tokenizer, **kwargs))
        return returned[-1]

    workflow = RllmRolloutWorkflow(recording, max_tokens=512, max_prompt_length=max_prompt,
                                   max_response_length=max_response)  # fmt: skip
    datum = Datum("p0", tok.encode("12*34=", add_special_tokens=False), {})

    async def group():
        return [await workflow.run(engine, tok, datum, i) for i in range(samples)]

    return returned, asyncio.run(group())


@pytest.mark.parametrize(
    ("max_prompt", "max_response"),
    [(64, 64), (4, 64), (64, 9)],
    ids=["within-limits", "prompt-beyond-max_prompt_length", "response-beyond-max_response_length"],
)
def test_rows_masks_and_advantages_are_rllms(tok, max_prompt, max_response):
    replies = ["6", "8 x", "408", "1", "2 y z", "44", "7", "3", "4080 1"]
    returned, ours = play(tok, replies, 3, max_prompt, max_response)
    assert all(t.status == TrajectoryStatus.OK for t in ours) and len({t.reward for t in ours}) > 1
    # merged as rLLM merges: three sequences, two rows (turns 1-2 in one, turn 3 alone)
    assert [len(t.sequences) for t in ours] == [2, 2, 2]
    assert all(t.metadata["rllm_rows"]["sequences"] == 3 for t in ours)
    group = VersionedGroup(prompt_uid="p0", trajectories=ours)
    batch = groups_to_dataproto([group], pad_token_id=tok.pad_token_id, temperature=1.0)
    compute_advantages(batch, "grpo")
    reference = rllm_batch([(t.uid, r) for t, r in zip(ours, returned, strict=True)], max_prompt, max_response,
                           tok.pad_token_id)  # fmt: skip
    for key, expected in reference.items():
        got = batch.batch[key]
        assert got.shape == expected.shape, key
        torch.testing.assert_close(got.to(expected.dtype), expected, msg=key)


def test_the_limits_hold_the_trainers_rows_where_rllm_holds_them(tok, caplog):
    """Without the merge a conversation's rows repeat its history; now a row's prompt is at most
    data.max_prompt_length and its response at most data.max_response_length, and the cut is said once."""
    replies = ["6", "8 x", "408", "1", "2 y z", "44", "7", "3", "4080 1"]
    with caplog.at_level(logging.WARNING):
        _, ours = play(tok, replies, 3, 4, 9)
    for t in ours:
        assert all(len(s.prompt_ids) <= 4 and len(s.response_ids) <= 9 for s in t.sequences)
        assert t.metadata["rllm_rows"]["prompt_tokens_moved"] > 0
    assert sum(t.metadata["rllm_rows"]["response_tokens_cut"] for t in ours) > 0
    cut = [r for r in caplog.records if "max_response_length=9" in r.getMessage()]
    assert len(cut) == 1 and "dropped" in cut[0].getMessage()


def test_per_step_credit_keeps_one_row_per_sequence(tok):
    """With metadata["step_rewards"] (GiGPO's per-step fields) each sequence stays a row: the step fields are per
    sequence."""

    async def stepwise(client, tokenizer, **kwargs):
        trajectory = await rollout_fn(client, tokenizer, **kwargs)
        trajectory.metadata = {"step_rewards": [0.0, 0.0, 1.0]}
        return trajectory

    engine = Engine(tok, ["6", "8", "4"])
    workflow = RllmRolloutWorkflow(stepwise, max_prompt_length=64, max_response_length=64)
    datum = Datum("p0", tok.encode("12*34=", add_special_tokens=False), {})
    t = asyncio.run(workflow.run(engine, tok, datum, 0))
    assert t.status == TrajectoryStatus.OK and len(t.sequences) == 3 and t.step_rewards == [0.0, 0.0, 1.0]
