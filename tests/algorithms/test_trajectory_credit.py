"""The trajectory is the unit of credit (docs/design.md#rule-trajectory-unit-of-credit): multi-row trajectories under
every estimator.

References are written here in plain Python from the published semantics:
- rLLM's fully-async trainer (`compute_grpo_outcome_advantage` over `trajectory_uuids` in its utils.py): a
  trajectory's score enters its prompt group's mean and std once, however many rows (sequences) it has, and every
  row of the trajectory gets (s - mean) / (std + eps);
- verl-agent's GRPO, RLOO and REINFORCE++-baseline on multi-turn rows with `compute_mean_std_cross_all_data=False`,
  and the episode level of its GiGPO (`episode_norm_reward` keyed by `traj_index`): one score per (uid, traj_index)
  pair; RLOO's n/(n-1) over trajectories; REINFORCE++-baseline centres on the group's trajectory mean and whitens
  over the batch's trained tokens.
Batches are built the way the trainer builds them: trajectories through `core/batch.py`, or episodes played
by the real multi-turn workflow and number-line environment with a scripted client in both row layouts.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections import defaultdict
from typing import Any

import numpy as np
import pytest
import torch
from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, compute_grpo_outcome_advantage
from workflow_helpers import Datum, ScriptedClient

from rllm.experimental.fully_async.algorithms.advantages import (
    SUPPORTED_ESTIMATORS,
    compute_advantages,
    summarize_advantages,
)
from rllm.experimental.fully_async.algorithms.credit import chain_tokens, index_trajectories
from rllm.experimental.fully_async.algorithms.gigpo import GiGPOConfig
from rllm.experimental.fully_async.api.trajectory import VersionedGroup, VersionedSequence, VersionedTrajectory
from rllm.experimental.fully_async.core.batch import groups_to_dataproto
from rllm.experimental.fully_async.envs import EnvSpec
from rllm.experimental.fully_async.settings.loader import ConfigError, load_config
from rllm.experimental.fully_async.tasks.number_line import build_tokenizer
from rllm.experimental.fully_async.workflows.multi_turn import MultiTurnWorkflow

OUTCOME = ["grpo", "rloo", "reinforce_plus_plus_baseline"]


# --- trajectories the way the trainer batches them ---------------------------------------------------------------


def trajectory(uid: str, turn_lengths: list[int], step_rewards: list[float]) -> VersionedTrajectory:
    """A trajectory of len(turn_lengths) sequences (one row each), each turn's reward on its row."""
    sequences = [
        VersionedSequence(
            prompt_ids=[1, 2], response_ids=[3] * n, response_logprobs=[-0.1] * n, response_versions=[0] * n
        )
        for n in turn_lengths
    ]
    return VersionedTrajectory(
        uid=uid,
        prompt_uid=uid.split("/")[0],
        sequences=sequences,
        reward=sum(step_rewards),
        step_rewards=list(step_rewards),
    )


def batch(*groups: list[VersionedTrajectory]):
    return groups_to_dataproto(
        [VersionedGroup(g[0].prompt_uid, list(g)) for g in groups], pad_token_id=0, temperature=1.0
    )


def row_values(data) -> list[float]:
    """Each row's advantage, checked to be one value over its trained tokens."""
    out = []
    for adv, mask in zip(data.batch["advantages"], data.batch["response_mask"], strict=True):
        values = adv[mask.bool()]
        assert torch.allclose(values, values[0].expand_as(values)), "an outcome advantage varies within a row"
        out.append(float(values[0]))
    return out


# --- the reference -----------------------------------------------------------------------------------------------


def reference(trajectories: list[VersionedTrajectory], estimator: str, norm_by_std: bool = True) -> list[float]:
    """Per-row advantage (rows in batch order): one score per trajectory in its group, the value on every row.

    Groups of one trajectory and groups whose scores tie get 0 (this project's rule for degenerate groups).
    """
    score = {t.uid: sum(t.step_rewards) for t in trajectories}
    members: dict[str, list[float]] = defaultdict(list)
    for t in trajectories:
        members[t.prompt_uid].append(score[t.uid])

    def centred(t: VersionedTrajectory) -> float | None:
        xs = members[t.prompt_uid]
        if len(xs) < 2 or max(xs) - min(xs) <= 1e-6:
            return None
        mean = sum(xs) / len(xs)
        if estimator == "grpo":
            return (score[t.uid] - mean) / (statistics.stdev(xs) + 1e-6 if norm_by_std else 1.0)
        if estimator == "rloo":
            return len(xs) / (len(xs) - 1) * (score[t.uid] - mean)
        return score[t.uid] - mean  # reinforce_plus_plus_baseline, before whitening

    per_traj = {t.uid: centred(t) for t in trajectories}
    rows = [(per_traj[t.uid], len(s.response_ids)) for t in trajectories for s in t.sequences]
    if estimator != "reinforce_plus_plus_baseline":
        return [0.0 if v is None else v for v, _ in rows]
    tokens = [v for v, n in rows if v is not None for _ in range(n)]  # whitening over the trained tokens
    mean = sum(tokens) / len(tokens)
    std = math.sqrt(sum((x - mean) ** 2 for x in tokens) / (len(tokens) - 1) + 1e-8)
    return [0.0 if v is None else (v - mean) / std for v, _ in rows]


# --- outcome estimators -------------------------------------------------------------------------------------------


def two_turn_group() -> list[VersionedTrajectory]:
    """The issue's case: four two-turn episodes, two winning (reward 1 on the last turn)."""
    return [trajectory(f"p/{i}", [3, 2], [0.0, 1.0 if i < 2 else 0.0]) for i in range(4)]


@pytest.mark.parametrize("estimator", OUTCOME)
def test_every_turn_of_a_winning_episode_gets_a_positive_advantage(estimator):
    group = two_turn_group()
    data = compute_advantages(batch(group), estimator)
    values = row_values(data)
    assert values == pytest.approx(reference(group, estimator), abs=1e-5)
    assert all(v > 0 for v in values[:4]) and all(v < 0 for v in values[4:])
    if estimator == "grpo":  # rLLM's number for this group: (1 - 0.5) / std([1, 1, 0, 0])
        assert values[0] == pytest.approx(0.5 / statistics.stdev([1, 1, 0, 0]), abs=1e-5)


def test_verl_on_turn_rows_would_punish_the_first_turn_of_a_win():
    """What the rows gave before trajectories were the unit: each turn a sample of its group."""
    data = batch(two_turn_group())
    per_row, _ = compute_grpo_outcome_advantage(
        data.batch["token_level_rewards"], data.batch["response_mask"], data.non_tensor_batch["uid"]
    )
    assert float(per_row[0, 0]) == pytest.approx(-0.54, abs=0.01)  # the winning episode's first turn
    assert row_values(compute_advantages(data, "grpo"))[0] == pytest.approx(0.866, abs=1e-3)


@pytest.mark.parametrize("estimator", OUTCOME)
def test_a_group_whose_episodes_tie_gives_zero_whatever_their_turn_counts(estimator):
    # Both win, in one turn and in three: their rows carry [1] and [0, 0, 1], which as rows would not tie.
    tied = [trajectory("t/0", [2], [1.0]), trajectory("t/1", [2, 2, 2], [0.0, 0.0, 1.0])]
    other = [trajectory("o/0", [2, 3], [0.0, 1.0]), trajectory("o/1", [4], [0.0])]
    data = compute_advantages(batch(tied, other), estimator)
    assert (data.batch["advantages"][:4] == 0).all()
    assert (data.batch["advantages"][4:].abs().sum(dim=-1) > 0).all()
    stats = summarize_advantages(data)
    assert (stats.num_trajectories, stats.num_zero_spread_groups, stats.num_rows) == (4, 1, 7)


@pytest.mark.parametrize("estimator", OUTCOME)
def test_turn_counts_do_not_weigh_a_trajectory_in_its_group(estimator):
    """The same rewards as one-row and as many-row trajectories give each trajectory the same advantage."""
    rewards = [1.0, 0.0, 0.0, 0.5]
    one_row = [trajectory(f"p/{i}", [6], [r]) for i, r in enumerate(rewards)]
    # Split into 1..4 turns of 6 tokens in all, the reward spread over the turns (step rewards summed).
    splits = [[6], [3, 3], [2, 2, 2], [1, 2, 1, 2]]
    many_rows = [
        trajectory(f"p/{i}", split, [r / len(split)] * len(split))
        for i, (r, split) in enumerate(zip(rewards, splits, strict=True))
    ]
    flat = row_values(compute_advantages(batch(one_row), estimator))
    split = row_values(compute_advantages(batch(many_rows), estimator))
    assert split == pytest.approx(reference(many_rows, estimator), abs=1e-5)
    expanded = [flat[i] for i, s in enumerate(splits) for _ in s]
    assert split == pytest.approx(expanded, abs=1e-5)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_random_multi_row_groups_match_the_reference(norm_by_std):
    rng = np.random.default_rng(3)
    groups = []
    for g in range(5):
        group = []
        for i in range(int(rng.integers(2, 6))):
            turns = [int(n) for n in rng.integers(1, 5, size=int(rng.integers(1, 5)))]
            group.append(trajectory(f"g{g}/{i}", turns, [float(x) for x in rng.integers(0, 3, size=len(turns))]))
        groups.append(group)
    trajectories = [t for g in groups for t in g]
    for estimator in OUTCOME:
        data = compute_advantages(batch(*groups), estimator, norm_adv_by_std_in_grpo=norm_by_std)
        expected = reference(trajectories, estimator, norm_by_std)
        assert row_values(data) == pytest.approx(expected, abs=1e-5), estimator


def test_gigpo_episode_level_is_grpo_over_the_same_trajectories():
    group = [*two_turn_group(), trajectory("p/4", [2, 2, 2], [0.0, 0.5, 0.5])]
    grpo = compute_advantages(batch(group), "grpo").batch["advantages"]
    gigpo = compute_advantages(batch(group), "gigpo", gigpo=GiGPOConfig(omega=0.0)).batch["advantages"]
    torch.testing.assert_close(gigpo, grpo, rtol=1e-5, atol=1e-6)


# --- the same episodes in both layouts ----------------------------------------------------------------------------


# From 4 to 7 on the number line: two wins (in two turns and in one), two misses (four turns each, max_turns).
SCRIPTS = [["+2", "+1"], ["+3"], ["-1", "+1", "-1", "+1"], ["+1", "-1", "+1", "-1"]]


def play(layout: str) -> tuple[list[VersionedTrajectory], Any]:
    tokenizer = build_tokenizer()
    workflow = MultiTurnWorkflow(EnvSpec(name="number_line", max_turns=4), {"max_new_tokens": 3}, layout=layout)
    datum = Datum("p0", tokenizer.encode("N", add_special_tokens=False), {"start": 4, "target": 7})
    episodes = [
        asyncio.run(workflow.run(ScriptedClient(tokenizer, moves), tokenizer, datum, i))
        for i, moves in enumerate(SCRIPTS)
    ]
    return episodes, batch(episodes)


def token_positions(episodes: list[VersionedTrajectory], layout: str) -> list[list[tuple[int, int]]]:
    """For each episode, the (row, column) of each generated token, in conversation order."""
    out, row = [], 0
    for episode in episodes:
        spans = [(step["start"], step["end"]) for step in episode.metadata["steps"]]
        if layout == "per_step":
            out.append([(row + t, j) for t, (a, b) in enumerate(spans) for j in range(b - a)])
            row += len(spans)
        else:
            begin = episode.metadata["prompt_end"]
            out.append([(row, k - begin) for a, b in spans for k in range(a, b)])
            row += 1
    return out


def critic_values(episodes, positions, shape) -> torch.Tensor:
    """A critic's V at each generated token, a function of (episode, token) only, as a real critic's would be for
    the same prefix whichever row holds it."""
    values = torch.zeros(shape)
    for e, tokens in enumerate(positions):
        for k, (row, col) in enumerate(tokens):
            values[row, col] = math.sin(1.0 + 3 * e + 0.7 * k)
    return values


@pytest.mark.parametrize(
    ("estimator", "settings"),
    [
        ("grpo", {}),
        ("grpo", {"norm_adv_by_std_in_grpo": False}),
        ("rloo", {}),
        ("reinforce_plus_plus_baseline", {}),
        ("reinforce_plus_plus", {"gamma": 1.0}),
        ("reinforce_plus_plus", {"gamma": 0.9}),
        ("gae", {"gamma": 1.0, "lam": 1.0}),
        ("gae", {"gamma": 0.95, "lam": 0.9}),
    ],
)
def test_concat_and_per_step_give_every_token_the_same_advantage(estimator, settings):
    advantages = {}
    for layout in ("per_step", "concat"):
        episodes, data = play(layout)
        positions = token_positions(episodes, layout)
        if estimator == "gae":
            data.batch["values"] = critic_values(episodes, positions, data.batch["response_mask"].shape)
        data = compute_advantages(data, estimator, **settings)
        adv = data.batch["advantages"]
        advantages[layout] = [[float(adv[r, c]) for r, c in tokens] for tokens in positions]
        if estimator == "gae":
            returns = data.batch["returns"]
            advantages[layout + "/returns"] = [[float(returns[r, c]) for r, c in tokens] for tokens in positions]
    assert [len(e) for e in advantages["per_step"]] == [6, 3, 12, 12]  # every generated token is compared
    for key in [k for k in advantages if k.startswith("per_step")]:
        other = advantages[key.replace("per_step", "concat")]
        for mine, theirs in zip(advantages[key], other, strict=True):
            assert mine == pytest.approx(theirs, abs=1e-5), key
    if estimator in OUTCOME:  # wins positive on every token, misses negative
        signs = [{math.copysign(1, a) for a in e} for e in advantages["per_step"]]
        assert signs == [{1.0}, {1.0}, {-1.0}, {-1.0}]


@pytest.mark.parametrize("layout", ["per_step", "concat"])
@pytest.mark.parametrize("estimator", ["gae", "reinforce_plus_plus"])
def test_token_level_returns_reach_every_turn_of_the_episode(estimator, layout):
    """gamma = lam = 1 and a zero critic: every generated token's return is its episode's outcome, earlier turns
    included. (verl alone ends a per_step row's return at the row, and its REINFORCE++ resets at the concat row's
    masked observation tokens: the earlier turns of a win got return 0 in both layouts.)"""
    episodes, data = play(layout)
    data.batch["values"] = torch.zeros_like(data.batch["response_mask"])
    data = compute_advantages(data, estimator, gamma=1.0, lam=1.0)
    returns = data.batch["returns"]
    for episode, tokens in zip(episodes, token_positions(episodes, layout), strict=True):
        assert [float(returns[r, c]) for r, c in tokens] == pytest.approx([episode.reward] * len(tokens))


# --- the index and the chain ----------------------------------------------------------------------------------------


def test_rows_are_chained_in_step_order_and_stray_rewards_move_to_the_latest_trained_token():
    # Trajectory "a": rows 2 (step 0) and 0 (step 1); trajectory "b": row 1. Row 0's reward sits on a masked tail.
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    rewards = torch.tensor([[0.0, 0.0, 2.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    index = index_trajectories(["g", "g", "g"], ["a", "b", "a"], [1, 0, 0])
    chain = chain_tokens(index, mask)
    assert chain.mask.tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]
    marks = torch.tensor([[10.0, 11.0, 12.0], [20.0, 21.0, 22.0], [30.0, 31.0, 32.0]])
    assert chain.gather(marks).tolist() == [[31.0, 32.0, 10.0, 11.0], [20.0, 0.0, 0.0, 0.0]]
    assert chain.rewards(rewards).tolist() == [[0.0, 0.0, 0.0, 2.0], [0.5, 0.0, 0.0, 0.0]]
    assert torch.equal(chain.scatter(chain.gather(marks)), marks * mask)


def test_trajectory_index_refuses_inconsistent_rows():
    with pytest.raises(ValueError, match="two prompt groups"):
        index_trajectories(["g", "h"], ["a", "a"])
    with pytest.raises(ValueError, match="repeated step_index 1"):
        index_trajectories(["g", "g"], ["a", "a"], [1, 1])


def test_verls_other_estimators_are_refused_in_one_line():
    """verl 0.7.1 registers more outcome estimators (grpo_passk, opo, gpg, ...) that score rows, not trajectories;
    the trainer accepts none of them, for any layout."""
    others = sorted(set(ADV_ESTIMATOR_REGISTRY) - set(SUPPORTED_ESTIMATORS))
    assert {"grpo_passk", "opo", "gpg", "remax", "rloo_vectorized", "grpo_vectorized"} <= set(others)
    for name in others:
        with pytest.raises(ConfigError, match=r"^'algorithm\.adv_estimator' must be one of [^\n]*got") as info:
            load_config(None, [f"algorithm.adv_estimator={name}"])
        assert name in str(info.value)
