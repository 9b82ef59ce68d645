"""compute_advantages over verl's estimators, against plain-loop references, with degenerate groups and rows."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

from rllm.experimental.fully_async.algorithms.advantages import (
    DR_GRPO_KEYS,
    SUPPORTED_ESTIMATORS,
    AdvantageConfig,
    compute_advantages,
    summarize_advantages,
)
from rllm.experimental.fully_async.algorithms.gigpo import GiGPOConfig

WIDTH = 4
# (group, reward, response length). g2 is all-equal with a non-dyadic reward, g3 a singleton, row 2 zero-length.
ROWS = [
    ("g1", 1.0, 4),
    ("g1", 0.0, 2),
    ("g1", 0.5, 0),
    ("g1", 1.0, 3),
    ("g2", 2.7, 4),
    ("g2", 2.7, 1),
    ("g2", 2.7, 3),
    ("g3", 1.0, 2),
    ("g4", 0.0, 4),
    ("g4", 1.0, 4),
]
DEGENERATE = {4, 5, 6, 7}  # rows of g2 (no spread) and g3 (singleton)


def make_batch(rows=ROWS, seed: int = 0) -> DataProto:
    """Reward on the last response token (position 0 for an empty response); random critic values."""
    n = len(rows)
    mask = torch.zeros(n, WIDTH)
    rewards = torch.zeros(n, WIDTH)
    for i, (_, reward, length) in enumerate(rows):
        mask[i, :length] = 1
        rewards[i, max(length - 1, 0)] = reward
    values = torch.randn(n, WIDTH, generator=torch.Generator().manual_seed(seed))
    return DataProto.from_dict(
        tensors={"token_level_rewards": rewards, "response_mask": mask, "values": values, "responses": mask.long()},
        non_tensors={"uid": np.array([g for g, _, _ in rows], dtype=object)},
    )


def ref_group_scores(rows, kind: str) -> list[float]:
    """Per-row outcome advantage; 0 for singletons and groups without spread."""
    out = []
    for g, reward, _ in rows:
        scores = [r for h, r, _ in rows if h == g]
        if len(scores) < 2 or max(scores) - min(scores) <= 1e-6:
            out.append(0.0)
            continue
        mean = sum(scores) / len(scores)
        if kind == "grpo":
            out.append((reward - mean) / (statistics.stdev(scores) + 1e-6))
        elif kind == "drgrpo":
            out.append(reward - mean)
        elif kind == "rloo":
            out.append(len(scores) / (len(scores) - 1) * (reward - mean))
        elif kind == "baseline":
            out.append(reward - mean)
    return out


def broadcast(per_row: list[float], rows) -> torch.Tensor:
    out = torch.zeros(len(rows), WIDTH)
    for i, (_, _, length) in enumerate(rows):
        out[i, :length] = per_row[i]
    return out


def whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's masked_whiten written out: unbiased variance over masked entries, 1e-8 inside the rsqrt."""
    vals = [float(x[i, j]) for i in range(x.shape[0]) for j in range(x.shape[1]) if mask[i, j]]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return (x - mean) / math.sqrt(var + 1e-8) * mask


def assert_clean(data: DataProto) -> None:
    mask = data.batch["response_mask"]
    for key in ("advantages", "returns"):
        assert torch.isfinite(data.batch[key]).all(), key
        assert (data.batch[key][mask == 0] == 0).all(), f"{key} nonzero outside response_mask"


# --- group estimators --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("estimator", "norm_by_std", "kind"),
    [("grpo", True, "grpo"), ("grpo", False, "drgrpo"), ("rloo", True, "rloo")],
)
def test_group_estimators_match_the_loop_reference(estimator, norm_by_std, kind):
    data = compute_advantages(make_batch(), estimator, norm_adv_by_std_in_grpo=norm_by_std)
    expected = broadcast(ref_group_scores(ROWS, kind), ROWS)
    torch.testing.assert_close(data.batch["advantages"], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(data.batch["returns"], expected, rtol=1e-5, atol=1e-6)
    assert_clean(data)


def test_reinforce_plus_plus_baseline_whitens_only_rows_with_signal():
    data = compute_advantages(make_batch(), "reinforce_plus_plus_baseline")
    centred = broadcast(ref_group_scores(ROWS, "baseline"), ROWS)
    active_mask = make_batch().batch["response_mask"].clone()
    active_mask[sorted(DEGENERATE)] = 0
    expected = whiten(centred, active_mask)
    torch.testing.assert_close(data.batch["advantages"], expected, rtol=1e-5, atol=1e-5)
    assert_clean(data)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_degenerate_groups_get_exactly_zero(estimator):
    data = compute_advantages(make_batch(), estimator)
    for i in DEGENERATE:
        assert (data.batch["advantages"][i] == 0).all()


def test_verl_alone_turns_equal_rewards_into_nonzero_grpo_advantages():
    """Why equal-reward groups are special-cased: verl divides the mean's float error by 1e-6."""
    rows = [("g", 2.7, 3)] * 7
    batch = make_batch(rows)
    raw, _ = compute_grpo_outcome_advantage(
        batch.batch["token_level_rewards"], batch.batch["response_mask"], np.array(["g"] * 7, dtype=object)
    )
    assert raw.abs().max() > 0.1
    assert (compute_advantages(batch, "grpo").batch["advantages"] == 0).all()


def test_singleton_groups_can_keep_verls_rule():
    grpo = compute_advantages(make_batch(), "grpo", singleton_group_advantage="verl")
    rloo = compute_advantages(make_batch(), "rloo", singleton_group_advantage="verl")
    assert grpo.batch["advantages"][7, :2].tolist() == pytest.approx([1.0 / (1.0 + 1e-6)] * 2)
    assert rloo.batch["advantages"][7, :2].tolist() == [1.0, 1.0]
    # The other groups are unaffected by the rule.
    default = compute_advantages(make_batch(), "grpo")
    rows = [i for i in range(len(ROWS)) if i != 7]
    torch.testing.assert_close(grpo.batch["advantages"][rows], default.batch["advantages"][rows])


def test_zero_length_response_counts_in_its_group_but_gets_no_advantage():
    data = compute_advantages(make_batch(), "grpo")
    assert (data.batch["advantages"][2] == 0).all()
    without = [r for i, r in enumerate(ROWS) if i != 2]
    other = compute_advantages(make_batch(without), "grpo")
    # Removing the empty response's reward (0.5) changes the group statistics of g1.
    assert not torch.allclose(data.batch["advantages"][0], other.batch["advantages"][0])


# --- token-level estimators --------------------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_discounted_whitened_returns(gamma):
    batch = make_batch()
    rewards, mask = batch.batch["token_level_rewards"], batch.batch["response_mask"]
    returns = torch.zeros_like(rewards)
    for i, (_, _, length) in enumerate(ROWS):
        for t in range(length):
            returns[i, t] = sum(gamma ** (k - t) * float(rewards[i, k]) for k in range(t, length))
    data = compute_advantages(batch, "reinforce_plus_plus", gamma=gamma)
    torch.testing.assert_close(data.batch["advantages"], whiten(returns, mask), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(data.batch["returns"], returns * mask, rtol=1e-5, atol=1e-6)
    assert_clean(data)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_matches_the_loop_reference(gamma, lam):
    batch = make_batch(seed=3)
    rewards, mask, values = (batch.batch[k] for k in ("token_level_rewards", "response_mask", "values"))
    raw = torch.zeros_like(rewards)
    for i, (_, _, length) in enumerate(ROWS):
        last = 0.0
        for t in reversed(range(length)):
            next_value = float(values[i, t + 1]) if t + 1 < length else 0.0
            delta = float(rewards[i, t]) + gamma * next_value - float(values[i, t])
            last = delta + gamma * lam * last
            raw[i, t] = last
    data = compute_advantages(batch, "gae", gamma=gamma, lam=lam)
    torch.testing.assert_close(data.batch["advantages"], whiten(raw, mask), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(data.batch["returns"], (raw + values) * mask, rtol=1e-5, atol=1e-5)
    assert_clean(data)


# --- degenerate batches ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", [e for e in SUPPORTED_ESTIMATORS if e != "gigpo"])
def test_empty_and_tokenless_batches_give_zeros_not_nan(estimator):
    for rows in ([], [("g", 1.0, 0), ("g", 0.0, 0)], [("g", 1.0, 1)]):
        data = compute_advantages(make_batch(rows), estimator)
        assert data.batch["advantages"].shape == (len(rows), WIDTH)
        assert (data.batch["advantages"] == 0).all(), rows
        assert_clean(data)
    # One trained token: the group estimators still compare it with its empty sibling; whitening has no spread.
    data = compute_advantages(make_batch([("g", 1.0, 1), ("g", 0.0, 0)]), estimator)
    assert_clean(data)
    if estimator in ("grpo", "rloo"):
        assert data.batch["advantages"][0, 0] > 0
    else:
        assert (data.batch["advantages"] == 0).all()


def test_gae_with_one_token_keeps_the_critic_target_at_its_prediction():
    batch = make_batch([("g", 1.0, 1)])
    data = compute_advantages(batch, "gae")
    assert data.batch["returns"][0, 0] == batch.batch["values"][0, 0]


def test_all_equal_rewards_give_no_reinforce_plus_plus_signal():
    rows = [("a", 0.7, 4), ("b", 0.7, 4), ("c", 0.7, 4)]
    data = compute_advantages(make_batch(rows), "reinforce_plus_plus", gamma=1.0)
    assert (data.batch["advantages"] == 0).all()  # verl alone whitens the float noise of the mean to ~1e-3
    assert_clean(data)
    batch = make_batch(rows)
    batch.batch["values"] = torch.full((3, WIDTH), 0.7)  # the exact return-to-go: every TD error is 0
    assert (compute_advantages(batch, "gae").batch["advantages"] == 0).all()


def test_bad_inputs_are_rejected_with_the_key_named():
    batch = make_batch()
    del batch.batch["values"]
    with pytest.raises(KeyError, match="values"):
        compute_advantages(batch, "gae")
    batch = make_batch()
    batch.non_tensor_batch.pop("uid")
    with pytest.raises(KeyError, match="uid"):
        compute_advantages(batch, "grpo")
    with pytest.raises(KeyError, match="traj_uid"):
        compute_advantages(make_batch(), "gigpo")
    batch = make_batch()
    batch.batch["token_level_rewards"][3, 0] = float("nan")
    with pytest.raises(ValueError, match=r"rows \[3\]"):
        compute_advantages(batch, "grpo")
    with pytest.raises(ValueError, match="adv_estimator"):
        compute_advantages(make_batch(), "remax")


# --- config and stats --------------------------------------------------------------------------------------------


def test_config_validates_and_computes_like_the_function():
    with pytest.raises(ValueError, match=r"algorithm\.adv_estimator"):
        AdvantageConfig(adv_estimator="ppo")
    with pytest.raises(ValueError, match=r"algorithm\.singleton_group_advantage"):
        AdvantageConfig(singleton_group_advantage="keep")
    with pytest.raises(ValueError, match=r"algorithm\.lam"):
        AdvantageConfig(lam=1.5)
    via_config = AdvantageConfig(adv_estimator="rloo").compute(make_batch())
    direct = compute_advantages(make_batch(), "rloo")
    torch.testing.assert_close(via_config.batch["advantages"], direct.batch["advantages"])


def test_config_reads_the_algorithm_section_including_gigpo():
    cfg = OmegaConf.create(
        {
            "algorithm": {
                "adv_estimator": "gigpo",
                "gamma": 0.9,
                "norm_adv_by_std_in_grpo": False,
                "kl_ctrl": {"kl_coef": 0.001},  # verl's other algorithm keys are not ours and are left alone
                "gigpo": {"omega": 0.5, "step_gamma": 0.8},
            }
        }
    )
    config = AdvantageConfig.from_config(cfg)
    assert config == AdvantageConfig(
        adv_estimator="gigpo", gamma=0.9, norm_adv_by_std_in_grpo=False, gigpo=GiGPOConfig(omega=0.5, step_gamma=0.8)
    )
    assert (
        AdvantageConfig.from_config(OmegaConf.create({"algorithm": {"adv_estimator": "rloo"}})).gigpo == GiGPOConfig()
    )
    with pytest.raises(ValueError, match=r"unknown key gigpo\.weight"):
        AdvantageConfig.from_config(OmegaConf.create({"algorithm": {"gigpo": {"weight": 1.0}}}))


def test_dr_grpo_is_grpo_without_std_and_with_constant_length_normalisation():
    assert DR_GRPO_KEYS["algorithm.adv_estimator"] == "grpo"
    assert DR_GRPO_KEYS["algorithm.norm_adv_by_std_in_grpo"] is False
    assert DR_GRPO_KEYS["actor_rollout_ref.actor.loss_agg_mode"] == "seq-mean-token-sum-norm"


def test_summary_counts_groups_and_advantages():
    data = compute_advantages(make_batch(), "grpo")
    stats = summarize_advantages(data)
    assert (stats.num_rows, stats.num_groups, stats.num_singleton_groups, stats.num_zero_spread_groups) == (10, 4, 1, 1)
    tokens = sum(length for _, _, length in ROWS)
    zero_tokens = sum(length for i, (_, _, length) in enumerate(ROWS) if i in DEGENERATE)
    assert stats.zero_adv_token_fraction == pytest.approx(zero_tokens / tokens)
    metrics = stats.to_metrics("adv/")
    assert metrics["adv/num_groups"] == 4.0 and all(math.isfinite(v) for v in metrics.values())


# --- correctness found by reading the code (issue 11, section 5) -------------------------------------------------


def _policy_loss(actor_config, advantages: torch.Tensor, mask: torch.Tensor) -> float:
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    zeros = torch.zeros_like(advantages)  # ratio 1: the loss is -A aggregated
    loss, _ = compute_policy_loss_vanilla(
        old_log_prob=zeros,
        log_prob=zeros,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode=actor_config.loss_agg_mode,
        config=actor_config,
    )
    return float(loss)


def test_dr_grpo_normaliser_is_the_configured_response_length_not_the_batch_width():
    from rllm.experimental.fully_async.backends.fsdp import build_actor_config
    from rllm.experimental.fully_async.settings.loader import load_config

    cfg = load_config(None, [*(f"{k}={v}" for k, v in DR_GRPO_KEYS.items()), "data.max_response_length=6"])
    actor_config = build_actor_config(cfg.actor_rollout_ref.actor)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, 0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # core/batch.py pads to the batch's widest response: the same responses can arrive 3 or 5 tokens wide
    wide_adv = torch.cat([adv, torch.zeros(2, 2)], dim=1)
    wide_mask = torch.cat([mask, torch.zeros(2, 2)], dim=1)
    narrow, wide = _policy_loss(actor_config, adv, mask), _policy_loss(actor_config, wide_adv, wide_mask)
    expected = -((3.0) + (-1.0 + 0.5)) / 2 / 6  # seq-mean of token sums, divided by data.max_response_length
    assert narrow == pytest.approx(expected) and wide == pytest.approx(expected)


def test_empty_response_keeps_its_reward_in_its_groups_statistics():
    from rllm.experimental.fully_async.api.trajectory import VersionedGroup, VersionedSequence, VersionedTrajectory
    from rllm.experimental.fully_async.core.batch import groups_to_dataproto

    def traj(i: int, response: list[int], reward: float) -> VersionedTrajectory:
        n = len(response)
        seq = VersionedSequence([1, 2], response, response_logprobs=[-0.5] * n, response_versions=[0] * n)
        return VersionedTrajectory(uid=f"g/{i}", prompt_uid="g", sequences=[seq], reward=reward)

    group = VersionedGroup("g", [traj(0, [], 1.0), traj(1, [5, 6], 0.0), traj(2, [5], 0.0), traj(3, [7], 0.0)])
    data = groups_to_dataproto([group], pad_token_id=0, temperature=1.0)
    result = AdvantageConfig(adv_estimator="grpo").compute_with_stats(data)
    scores = [1.0, 0.0, 0.0, 0.0]
    mean, std = statistics.mean(scores), statistics.stdev(scores)
    for row in (1, 2, 3):  # the empty response's reward lowers the others' advantage below zero
        assert data.batch["advantages"][row, 0].item() == pytest.approx((0.0 - mean) / (std + 1e-6), rel=1e-5)
    assert data.batch["advantages"][0].abs().sum().item() == 0.0  # it trains nothing itself
    assert result.stats.num_zero_spread_groups == 0


def test_advantage_and_gigpo_statistics_come_back_as_a_named_structure():
    grpo = AdvantageConfig(adv_estimator="grpo").compute_with_stats(make_batch())
    assert grpo.stats.num_groups == 4 and grpo.gigpo is None
    metrics = grpo.to_metrics()
    assert metrics["advantages/num_singleton_groups"] == 1.0 and "advantages/adv_abs_max" in metrics

    from test_gigpo import HAND_MADE, to_inputs  # the same folder is on sys.path (pytest's rootdir-less import)

    inputs = to_inputs(HAND_MADE)
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
    gigpo = AdvantageConfig(adv_estimator="gigpo").compute_with_stats(data)
    assert gigpo.gigpo is not None and gigpo.gigpo.num_trajectories == 5
    assert gigpo.to_metrics()["gigpo/num_trajectories"] == 5.0
