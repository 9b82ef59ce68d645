"""GiGPO (arXiv 2505.10978) against an independent loop implementation, on hand-made and random step batches."""

from __future__ import annotations

import random
import statistics
from collections import defaultdict

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.trainer.ppo.core_algos import get_adv_estimator_fn

from rllm.experimental.fully_async.algorithms.advantages import compute_advantages
from rllm.experimental.fully_async.algorithms.gigpo import (
    GiGPOConfig,
    build_step_groups,
    compute_gigpo,
    compute_gigpo_advantage,
    step_rewards_from_trajectory,
)
from rllm.experimental.fully_async.api.trajectory import VersionedSequence, VersionedTrajectory

EPS = 1e-6


def normalise(x: float, xs: list[float], by_std: bool) -> float:
    """(x - mean) / (std + eps) or x - mean; 0 for groups of one or with no spread."""
    if len(xs) < 2 or max(xs) - min(xs) <= 1e-6:
        return 0.0
    mean = sum(xs) / len(xs)
    return (x - mean) / (statistics.stdev(xs) + EPS) if by_std else x - mean


def reference_gigpo(rows: list[dict], *, gamma: float, omega: float, episode_std: bool, step_std: bool) -> dict:
    """Plain-loop GiGPO: Eq. 5 returns, Eq. 3 over trajectories, Eq. 7 over (uid, state) groups, Eq. 8."""
    n = len(rows)
    reward = [0.0 if r["reward"] is None else r["reward"] for r in rows]
    by_traj: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        by_traj[r["traj"]].append(i)
    returns = [0.0] * n
    for members in by_traj.values():
        for i in members:
            later = [j for j in members if rows[j]["step"] >= rows[i]["step"]]
            returns[i] = sum(gamma ** (rows[j]["step"] - rows[i]["step"]) * reward[j] for j in later)
    total = {t: sum(reward[i] for i in members) for t, members in by_traj.items()}
    uid_of = {t: rows[members[0]]["uid"] for t, members in by_traj.items()}
    a_episode = {
        t: normalise(total[t], [total[u] for u in total if uid_of[u] == uid_of[t]], episode_std) for t in total
    }

    def key(i: int):
        return (rows[i]["uid"], rows[i]["state"]) if rows[i]["state"] is not None else ("solo", i)

    a_step = [normalise(returns[i], [returns[j] for j in range(n) if key(j) == key(i)], step_std) for i in range(n)]
    return {
        "returns": returns,
        "a_step": a_step,
        "a_episode": [a_episode[r["traj"]] for r in rows],
        "a": [a_episode[rows[i]["traj"]] + omega * a_step[i] for i in range(n)],
    }


def to_inputs(rows: list[dict], width: int = 4) -> dict:
    """Tensor/array inputs of compute_gigpo; row i has rows[i]['len'] response tokens (default `width`)."""
    mask = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        mask[i, : r.get("len", width)] = 1
    return {
        "token_level_rewards": torch.zeros(len(rows), width),
        "response_mask": mask,
        "index": np.array([r["uid"] for r in rows], dtype=object),
        "traj_index": np.array([r["traj"] for r in rows], dtype=object),
        "step_index": np.array([r["step"] for r in rows]),
        "state_hash": np.array([r["state"] for r in rows], dtype=object),
        "step_rewards": np.array([r["reward"] for r in rows], dtype=object),
    }


def row(uid, traj, step, state, reward, length=4) -> dict:
    return {"uid": uid, "traj": traj, "step": step, "state": state, "reward": reward, "len": length}


HAND_MADE = [
    row("p", "t1", 0, "s0", 0.0),
    row("p", "t1", 1, "sA", 0.0),
    row("p", "t1", 2, "sB", 1.0),
    row("p", "t2", 0, "s0", 0.0),
    row("p", "t2", 1, "sA", 0.5),
    row("p", "t2", 2, "sC", 0.0),
    row("p", "t3", 0, "s0", 0.0),
    row("p", "t3", 1, "sD", 1.0, length=2),
    row("q", "t4", 0, "s0", 0.0),
    row("q", "t4", 1, "sA", 1.0),
    row("q", "t5", 0, "s0", 0.0),
    row("q", "t5", 1, None, None),
]


def assert_matches_reference(rows, config: GiGPOConfig, episode_std: bool = True) -> None:
    inputs = to_inputs(rows)
    out = compute_gigpo(**inputs, config=config, norm_adv_by_std_in_grpo=episode_std)
    ref = reference_gigpo(
        rows, gamma=config.step_gamma, omega=config.omega, episode_std=episode_std, step_std=config.step_norm_by_std
    )
    close = {"rtol": 1e-5, "atol": 1e-5}  # float32 result against a float64 reference
    torch.testing.assert_close(out.step_returns.double(), torch.tensor(ref["returns"], dtype=torch.float64), **close)
    torch.testing.assert_close(out.step_advantages.double(), torch.tensor(ref["a_step"], dtype=torch.float64), **close)
    torch.testing.assert_close(
        out.episode_advantages.double(), torch.tensor(ref["a_episode"], dtype=torch.float64), **close
    )
    expected = torch.tensor(ref["a"]).float().unsqueeze(-1) * inputs["response_mask"]
    torch.testing.assert_close(out.advantages, expected, **close)


# --- step groups -------------------------------------------------------------------------------------------------


def test_step_groups_join_identical_states_of_the_same_prompt_only():
    inputs = to_inputs(HAND_MADE)
    ids = build_step_groups(inputs["index"], inputs["state_hash"])
    same = lambda i, j: ids[i] == ids[j]  # noqa: E731
    assert same(0, 3) and same(0, 6)  # ("p", "s0") in t1, t2, t3
    assert same(1, 4)  # ("p", "sA") in t1, t2
    assert not same(0, 8)  # "s0" under prompt q is a different group
    assert not same(1, 9)  # "sA" under prompt q likewise
    assert not same(2, 5) and not same(2, 7)  # different states
    assert same(8, 10)  # ("q", "s0")
    assert len({ids[11], *np.delete(ids, 11)}) == len(set(ids.tolist()))  # the None state matches nothing
    assert len(set(ids.tolist())) == 8


def test_empty_state_hash_means_unknown_and_matches_nothing():
    rows = [row("p", "t1", 0, "", 0.0), row("p", "t2", 0, "", 1.0), row("p", "t3", 0, None, 1.0)]
    inputs = to_inputs(rows)
    assert len(set(build_step_groups(inputs["index"], inputs["state_hash"]).tolist())) == 3
    assert (compute_gigpo(**inputs).step_advantages == 0).all()


def test_revisited_state_within_a_trajectory_joins_its_group():
    rows = [row("p", "t1", 0, "s0", 0.0), row("p", "t1", 1, "s0", 1.0), row("p", "t2", 0, "s1", 0.0)]
    ids = build_step_groups(to_inputs(rows)["index"], to_inputs(rows)["state_hash"])
    assert ids[0] == ids[1] != ids[2]


# --- against the reference ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("step_std", [True, False])
@pytest.mark.parametrize("episode_std", [True, False])
@pytest.mark.parametrize(("gamma", "omega"), [(0.95, 1.0), (0.5, 0.3), (1.0, 2.0), (0.0, 1.0)])
def test_hand_made_batch_matches_the_loop_reference(gamma, omega, episode_std, step_std):
    config = GiGPOConfig(omega=omega, step_gamma=gamma, step_norm_by_std=step_std)
    assert_matches_reference(HAND_MADE, config, episode_std=episode_std)


def random_batch(rng: random.Random) -> list[dict]:
    rows = []
    for p in range(rng.randint(1, 3)):
        for t in range(rng.randint(1, 4)):
            steps = rng.sample(range(6), rng.randint(1, 4))  # step indices with gaps, in shuffled order
            for s in steps:
                state = rng.choice(["a", "b", "c", None])
                reward = rng.choice([0.0, 0.0, 1.0, -0.5, 2.0, None])
                rows.append(row(f"p{p}", f"p{p}-t{t}", s, state, reward, length=rng.randint(0, 4)))
    rng.shuffle(rows)
    return rows


@pytest.mark.parametrize("seed", range(25))
def test_random_batches_match_the_loop_reference(seed):
    rng = random.Random(seed)
    config = GiGPOConfig(
        omega=rng.choice([0.5, 1.0]), step_gamma=rng.choice([0.9, 1.0]), step_norm_by_std=seed % 2 == 0
    )
    assert_matches_reference(random_batch(rng), config, episode_std=seed % 3 != 0)


# --- gamma, omega ------------------------------------------------------------------------------------------------


def test_gamma_discounts_later_step_rewards():
    rows = [row("p", "t", 0, "x", 1.0), row("p", "t", 1, "y", 0.0), row("p", "t", 2, "z", 2.0)]
    out = compute_gigpo(**to_inputs(rows), config=GiGPOConfig(step_gamma=0.5))
    assert out.step_returns.tolist() == [1.0 + 0.25 * 2.0, 0.5 * 2.0, 2.0]
    out = compute_gigpo(**to_inputs(rows), config=GiGPOConfig(step_gamma=0.0))
    assert out.step_returns.tolist() == [1.0, 0.0, 2.0]


def test_gamma_exponent_follows_step_index_gaps():
    rows = [row("p", "t", 0, "x", 0.0), row("p", "t", 3, "y", 8.0)]
    out = compute_gigpo(**to_inputs(rows), config=GiGPOConfig(step_gamma=0.5))
    assert out.step_returns.tolist() == [1.0, 8.0]


def test_omega_scales_the_step_advantage_and_zero_gives_episode_grpo():
    inputs = to_inputs(HAND_MADE)
    base = compute_gigpo(**inputs, config=GiGPOConfig(omega=1.0))
    double = compute_gigpo(**inputs, config=GiGPOConfig(omega=2.0))
    episode_only = compute_gigpo(**inputs, config=GiGPOConfig(omega=0.0))
    mask = inputs["response_mask"]
    torch.testing.assert_close(double.advantages - base.advantages, base.step_advantages.unsqueeze(-1) * mask)
    torch.testing.assert_close(episode_only.advantages, base.episode_advantages.unsqueeze(-1) * mask)
    assert base.step_advantages.abs().sum() > 0  # the step component is not trivially zero here
    # Episode level by hand: prompt p totals t1 = 1, t2 = 0.5, t3 = 1; std = stdev([1, .5, 1]).
    sd = statistics.stdev([1.0, 0.5, 1.0])
    assert episode_only.episode_advantages[0].item() == pytest.approx((1 - 2.5 / 3) / (sd + EPS), rel=1e-5)
    assert episode_only.episode_advantages[3].item() == pytest.approx((0.5 - 2.5 / 3) / (sd + EPS), rel=1e-5)


def test_episode_advantage_counts_each_trajectory_once_whatever_its_length():
    rows = [row("p", "long", s, f"x{s}", 0.0) for s in range(3)] + [row("p", "short", 0, "y", 0.0)]
    rows[2]["reward"] = 1.0  # totals: long = 1, short = 0 -> +-1/sqrt(2) whatever the step counts
    out = compute_gigpo(**to_inputs(rows))
    expected = 0.5 / (statistics.stdev([1.0, 0.0]) + EPS)
    assert out.episode_advantages.tolist() == pytest.approx([expected] * 3 + [-expected], rel=1e-5)


# --- edge cases --------------------------------------------------------------------------------------------------


def test_singleton_step_groups_and_equal_returns_get_zero_step_advantage():
    rows = [
        row("p", "t1", 0, "s", 1.0),
        row("p", "t2", 0, "s", 1.0),  # same state, same return: zero spread
        row("p", "t3", 0, "only-here", 3.0),  # singleton
    ]
    out = compute_gigpo(**to_inputs(rows), config=GiGPOConfig(step_gamma=1.0))
    assert out.step_advantages.tolist() == [0.0, 0.0, 0.0]
    assert out.stats.num_step_groups == 2
    assert out.stats.singleton_step_fraction == pytest.approx(1 / 3)


def test_equal_returns_give_exactly_zero_even_where_verls_mean_is_inexact():
    # Seven equal returns of 2.7: verl's float32 group mean is off by ~1e-7, which /(std + 1e-6) would amplify.
    rows = [row("p", f"t{i}", 0, "s", 2.7) for i in range(7)]
    out = compute_gigpo(**to_inputs(rows), config=GiGPOConfig(step_gamma=0.95))
    assert (out.step_advantages == 0).all() and (out.episode_advantages == 0).all()


def test_missing_step_rewards_count_as_zero():
    with_none = [dict(r) for r in HAND_MADE]
    with_zero = [dict(r, reward=0.0 if r["reward"] is None else r["reward"]) for r in HAND_MADE]
    a = compute_gigpo(**to_inputs(with_none))
    b = compute_gigpo(**to_inputs(with_zero))
    torch.testing.assert_close(a.advantages, b.advantages)


def test_token_level_rewards_are_used_without_step_rewards():
    inputs = to_inputs(HAND_MADE)
    tlr = inputs["token_level_rewards"]
    for i, r in enumerate(HAND_MADE):
        tlr[i, max(r["len"] - 1, 0)] = 0.0 if r["reward"] is None else r["reward"]
    from_tokens = compute_gigpo(**{**inputs, "step_rewards": None})
    from_steps = compute_gigpo(**inputs)
    torch.testing.assert_close(from_tokens.advantages, from_steps.advantages)


def test_zero_length_step_has_zero_advantage_but_its_reward_still_counts():
    rows = [
        row("p", "t1", 0, "s", 0.0),
        row("p", "t1", 1, "x", 1.0, length=0),
        row("p", "t2", 0, "s", 0.0),
        row("p", "t2", 1, "y", 0.0),
    ]
    out = compute_gigpo(**to_inputs(rows), config=GiGPOConfig(step_gamma=0.5))
    assert out.advantages[1].abs().sum() == 0
    assert out.step_returns[0].item() == 0.5  # t1 step 0 sees the zero-length step's reward
    assert out.advantages[0, 0].item() > 0 > out.advantages[2, 0].item()
    assert torch.isfinite(out.advantages).all()


def test_singleton_prompt_group_episode_rule():
    rows = [row("p", "t1", 0, "s", 2.0)]
    assert compute_gigpo(**to_inputs(rows)).advantages.abs().sum() == 0
    verl_rule = compute_gigpo(**to_inputs(rows), singleton_group_advantage="verl")
    assert verl_rule.episode_advantages.tolist() == pytest.approx([2.0 / (1.0 + EPS)])


def test_empty_batch_gives_empty_advantages():
    out = compute_gigpo(**to_inputs([]))
    assert out.advantages.shape == (0, 4) and out.stats.num_steps == 0


def test_inconsistent_inputs_are_rejected():
    with pytest.raises(ValueError, match="repeated step_index"):
        compute_gigpo(**to_inputs([row("p", "t", 0, "s", 1.0), row("p", "t", 0, "r", 0.0)]))
    with pytest.raises(ValueError, match="two prompt groups"):
        compute_gigpo(**to_inputs([row("p", "t", 0, "s", 1.0), row("q", "t", 1, "r", 0.0)]))
    with pytest.raises(ValueError, match="not finite"):
        compute_gigpo(**to_inputs([row("p", "t", 0, "s", float("nan"))]))
    with pytest.raises(ValueError, match="step_gamma"):
        GiGPOConfig(step_gamma=1.5)


# --- wiring --------------------------------------------------------------------------------------------------------


def test_registered_in_verl_and_reachable_through_compute_advantages():
    assert get_adv_estimator_fn("gigpo") is compute_gigpo_advantage
    inputs = to_inputs(HAND_MADE)
    config = GiGPOConfig(omega=0.7, step_gamma=0.9, step_norm_by_std=False)
    expected = compute_gigpo(**inputs, config=config).advantages
    adv, ret = get_adv_estimator_fn("gigpo")(**inputs, omega=0.7, step_gamma=0.9, step_norm_by_std=False)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)
    data = DataProto.from_dict(
        tensors={"token_level_rewards": inputs["token_level_rewards"], "response_mask": inputs["response_mask"]},
        non_tensors={
            "uid": inputs["index"],
            "traj_uid": inputs["traj_index"],
            "step_index": inputs["step_index"],
            "state_hash": inputs["state_hash"],
            "step_rewards": inputs["step_rewards"],
        },
    )
    compute_advantages(data, "gigpo", gigpo=config)
    torch.testing.assert_close(data.batch["advantages"], expected)
    torch.testing.assert_close(data.batch["returns"], expected)


def make_trajectory(n_steps: int, reward: float, step_rewards=None) -> VersionedTrajectory:
    seqs = [VersionedSequence([1], [2, 3], [-0.1, -0.2], [0, 0]) for _ in range(n_steps)]
    return VersionedTrajectory(uid="p/0", prompt_uid="p", sequences=seqs, reward=reward, step_rewards=step_rewards)


def test_step_rewards_from_trajectory_rule():
    assert step_rewards_from_trajectory(make_trajectory(3, 1.0)) == [0.0, 0.0, 1.0]
    assert step_rewards_from_trajectory(make_trajectory(3, 1.0, [0.5, None, 2.0])) == [0.5, 0.0, 2.0]
    assert step_rewards_from_trajectory(make_trajectory(0, 1.0)) == []
    with pytest.raises(ValueError, match="2 step_rewards for 3 steps"):
        step_rewards_from_trajectory(make_trajectory(3, 1.0, [0.5, 1.0]))


def test_stats_report_group_structure():
    stats = compute_gigpo(**to_inputs(HAND_MADE)).stats
    assert (stats.num_steps, stats.num_trajectories, stats.num_episode_groups, stats.num_step_groups) == (12, 5, 2, 8)
    metrics = stats.to_metrics()
    assert metrics["gigpo/mean_step_group_size"] == pytest.approx(12 / 8)
    assert metrics["gigpo/singleton_step_fraction"] == pytest.approx(5 / 12)
