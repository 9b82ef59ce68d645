"""Off-policy corrections: decoupled PPO through verl's loss, TIS/mask weights, the log-linear proximal policy."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla
from verl.workers.config import ActorConfig

from rllm.experimental.fully_async.algorithms.corrections import (
    CorrectionConfig,
    OffPolicyCorrector,
    apply_off_policy_correction,
    apply_off_policy_correction_to_batch,
    build_correction,
    correction_config_from,
    loglinear_proximal_log_probs,
)

CLIP, DUAL_CLIP = 0.2, 3.0


def actor_config() -> ActorConfig:
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_c=DUAL_CLIP)


def make_mask(lengths: list[int], width: int) -> torch.Tensor:
    mask = torch.zeros(len(lengths), width)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return mask


def random_log_probs(shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return -torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 3 * scale


def vanilla_loss(old, new, adv, mask, weights=None) -> float:
    loss, _ = compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", actor_config(), weights)
    return float(loss)


def reference_decoupled_loss(prox, behav, new, adv, mask, cap: float, mode: str) -> float:
    """AReaL's decoupled objective with verl's dual clip, token by token in plain Python (token-mean)."""
    total, count = 0.0, 0
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            w = math.exp(float(prox[i, t] - behav[i, t]))
            if mode == "truncate":
                w = min(w, cap)
            elif not 1 / cap <= w <= cap:
                continue  # rejected: out of the loss and of the token count
            u = math.exp(float(new[i, t] - prox[i, t]))
            a = float(adv[i, t])
            clipped = max(-a * u, -a * min(max(u, 1 - CLIP), 1 + CLIP))
            if a < 0:
                clipped = min(clipped, -a * DUAL_CLIP)
            total += w * clipped
            count += 1
    return total / count


# --- decoupled PPO through verl's loss ---------------------------------------------------------------------------


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("cap_mode", ["truncate", "mask"])
def test_decoupled_equals_plain_ppo_when_behaviour_and_proximal_policies_coincide(level, cap_mode):
    shape = (4, 6)
    mask = make_mask([6, 3, 1, 5], 6)
    behav = random_log_probs(shape, 0)
    new = behav + 0.3 * torch.randn(shape, generator=torch.Generator().manual_seed(1))
    adv = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    config = CorrectionConfig(mode="decoupled", level=level, cap_mode=cap_mode, cap=2.0)
    corrected = apply_off_policy_correction(behav, mask, config, recomputed_log_probs=behav.clone())
    assert torch.equal(corrected.response_mask, mask)
    assert torch.equal(corrected.rollout_is_weights, mask)  # w = 1 on every trained token
    decoupled = vanilla_loss(corrected.old_log_probs, new, adv, corrected.response_mask, corrected.rollout_is_weights)
    plain = vanilla_loss(behav, new, adv, mask)
    assert decoupled == pytest.approx(plain, rel=1e-6)


@pytest.mark.parametrize("cap_mode", ["truncate", "mask"])
def test_decoupled_loss_through_verl_matches_the_reference_objective(cap_mode):
    shape = (5, 7)
    mask = make_mask([7, 4, 0, 2, 6], 7)
    behav = random_log_probs(shape, 10)
    prox = behav + 0.8 * torch.randn(shape, generator=torch.Generator().manual_seed(11))
    new = prox + 0.3 * torch.randn(shape, generator=torch.Generator().manual_seed(12))
    adv = torch.randn(shape, generator=torch.Generator().manual_seed(13))
    config = CorrectionConfig(mode="decoupled", cap_mode=cap_mode, cap=1.5)
    out = apply_off_policy_correction(behav, mask, config, recomputed_log_probs=prox)
    got = vanilla_loss(out.old_log_probs, new, adv, out.response_mask, out.rollout_is_weights)
    expected = reference_decoupled_loss(prox, behav, new, adv, mask, cap=1.5, mode=cap_mode)
    assert got == pytest.approx(expected, rel=1e-5)
    # The correction must matter on this batch, or the test proves nothing.
    assert abs(got - vanilla_loss(prox, new, adv, mask)) > 1e-3


def reference_second_moment_keep(prox, behav, mask, tau: float) -> set[tuple[int, int]]:
    """AReaL's M2PO mask in plain Python: drop the token of largest (log pi_prox - log pi_behav)^2, one at a time,
    until the mean over the rest is under tau; the tokens kept."""
    kept = sorted(
        (float(prox[i, t] - behav[i, t]) ** 2, (i, t))
        for i in range(mask.shape[0])
        for t in range(mask.shape[1])
        if mask[i, t]
    )
    while kept and sum(m2 for m2, _ in kept) / len(kept) >= tau:
        kept.pop()
    return {index for _, index in kept}


@pytest.mark.parametrize("cap_mode", ["truncate", "mask"])
def test_decoupled_with_m2_threshold_is_areals_m2po_the_mask_then_the_clipped_weighted_loss(cap_mode):
    shape = (5, 7)
    mask = make_mask([7, 4, 0, 2, 6], 7)
    behav = random_log_probs(shape, 30)
    prox = behav + 0.4 * torch.randn(shape, generator=torch.Generator().manual_seed(31))
    new = prox + 0.3 * torch.randn(shape, generator=torch.Generator().manual_seed(32))
    adv = torch.randn(shape, generator=torch.Generator().manual_seed(33))
    tau = 0.05
    config = CorrectionConfig(mode="decoupled", cap_mode=cap_mode, cap=2.0, m2_threshold=tau)
    out = apply_off_policy_correction(behav, mask, config, recomputed_log_probs=prox)
    keep = reference_second_moment_keep(prox, behav, mask, tau)
    m2_mask = torch.zeros(shape)
    for i, t in keep:
        m2_mask[i, t] = 1.0
    got = vanilla_loss(out.old_log_probs, new, adv, out.response_mask, out.rollout_is_weights)
    expected = reference_decoupled_loss(prox, behav, new, adv, m2_mask, cap=2.0, mode=cap_mode)
    assert got == pytest.approx(expected, rel=1e-5)
    assert out.stats.m2_masked_token_fraction == pytest.approx(1 - len(keep) / int(mask.sum()))
    # The mask must bind on this batch (some tokens dropped, not all), or the test proves nothing.
    assert 0 < len(keep) < int(mask.sum())
    unmasked = apply_off_policy_correction(
        behav, mask, CorrectionConfig(mode="decoupled", cap_mode=cap_mode, cap=2.0), recomputed_log_probs=prox
    )
    without = vanilla_loss(unmasked.old_log_probs, new, adv, unmasked.response_mask, unmasked.rollout_is_weights)
    assert abs(got - without) > 1e-3


def test_update_time_decoupled_loss_with_m2_threshold_masks_on_the_proximal_to_behaviour_ratio():
    """prox_log_probs=loglinear at prox_lag 0 takes the mask inside the update, on log pi_theta (detached, = pi_prox
    there) - log pi_behav; masked tokens get no gradient and stay in the token mean's denominator."""
    from rllm.experimental.fully_async.algorithms.decoupled_loss import decoupled_update_time_loss

    log_prob = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -1.0]], requires_grad=True)
    behav = torch.tensor([[-1.0, -1.1, -0.9, -2.5, -1.05]])  # squared log-ratios 0, .01, .01, 2.25, .0025
    mask = torch.ones(1, 5)
    correction = CorrectionConfig(prox_log_probs="loglinear", cap=2.0, m2_threshold=0.04)
    loss, metrics = decoupled_update_time_loss(
        behav, log_prob, torch.ones(1, 5), mask, config=actor_config(), correction=correction
    )
    loss.backward()
    assert set(reference_second_moment_keep(log_prob.detach(), behav, mask, 0.04)) == {(0, 0), (0, 1), (0, 2), (0, 4)}
    gradient = log_prob.grad[0]
    assert gradient[3] == 0  # the outlier, masked
    weights = [math.exp(float(-1.0 - b)) for b in behav[0]]
    for t in (0, 1, 2, 4):
        assert gradient[t] == pytest.approx(-min(weights[t], 2.0) / 5)
    assert metrics["off_policy/m2_masked_token_fraction"] == pytest.approx(0.2)


def test_gradient_flows_through_the_current_policy_only():
    shape = (2, 3)
    mask = torch.ones(shape)
    behav, prox = random_log_probs(shape, 20), random_log_probs(shape, 21)
    new = prox.clone().requires_grad_(True)
    out = apply_off_policy_correction(behav, mask, CorrectionConfig(), recomputed_log_probs=prox)
    loss, _ = compute_policy_loss_vanilla(
        out.old_log_probs, new, torch.ones(shape), mask, "token-mean", actor_config(), out.rollout_is_weights
    )
    loss.backward()
    # At new = prox the ratio is 1 (inside the clip), so d loss / d log pi_theta = -w * A / N per token.
    expected = -torch.exp(prox - behav).clamp(max=2.0) / mask.sum()
    torch.testing.assert_close(new.grad, expected)
    assert not out.rollout_is_weights.requires_grad


# --- weights -------------------------------------------------------------------------------------------------------


def test_tis_token_weights_are_truncated_at_the_cap():
    log_w = torch.tensor([[0.0, 1.0, -1.0, 0.5], [2.0, 0.3, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    behav = random_log_probs(log_w.shape, 30)
    out = apply_off_policy_correction(
        behav, mask, CorrectionConfig(mode="tis", cap=2.0), recomputed_log_probs=behav + log_w
    )
    expected = torch.zeros_like(log_w)
    for i in range(log_w.shape[0]):
        for t in range(log_w.shape[1]):
            expected[i, t] = min(math.exp(float(log_w[i, t])), 2.0) * float(mask[i, t])
    torch.testing.assert_close(out.rollout_is_weights, expected)
    assert torch.equal(out.old_log_probs, behav + log_w)
    stats = out.stats
    assert stats.capped_token_fraction == pytest.approx(2 / 5)  # e^1 and e^2 exceed 2
    assert stats.capped_seq_fraction == 1.0
    assert stats.weight_max == 2.0 and stats.weight_min == pytest.approx(math.exp(-1))
    assert stats.raw_weight_max == pytest.approx(math.exp(2))
    assert stats.masked_token_fraction is None


def test_sequence_weights_are_the_truncated_product_of_token_ratios():
    log_w = torch.tensor([[0.2, 0.3, -0.1], [0.5, 0.5, 9.0], [-0.4, 0.1, 0.0]])
    mask = make_mask([3, 2, 2], 3)
    behav = random_log_probs(log_w.shape, 31)
    config = CorrectionConfig(mode="decoupled", level="sequence", cap=2.0)
    out = apply_off_policy_correction(behav, mask, config, recomputed_log_probs=behav + log_w)
    seq = [math.exp(sum(float(log_w[i, t]) for t in range(3) if mask[i, t])) for i in range(3)]
    expected = torch.tensor([[min(s, 2.0)] * 3 for s in seq]) * mask
    torch.testing.assert_close(out.rollout_is_weights, expected)
    assert out.stats.capped_seq_fraction == pytest.approx(1 / 3)  # e^1.0 > 2; the 9.0 is outside the mask
    assert out.stats.raw_weight_max == pytest.approx(math.exp(1.0))
    assert out.stats.capped_token_fraction == pytest.approx(2 / 7)


@pytest.mark.parametrize(
    ("level", "kept_mask", "token_fraction", "seq_fraction"),
    [
        # per token, keep |log w| <= log 2 = 0.693: rejects 1.0, -1.0 (row 0) and 0.8 (row 1)
        ("token", [[1, 0, 0, 1, 0], [0, 1, 0, 0, 0], [0, 0, 0, 0, 0]], 3 / 6, 2 / 2),
        # per sequence: sums 0.0 + 1.0 - 1.0 + 0.1 = 0.1 and 0.8 - 0.2 = 0.6, both kept (5.0, 3.0 are padding)
        ("sequence", [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], 0.0, 0.0),
    ],
)
def test_mask_mode_rejects_outside_the_band_and_counts_right(level, kept_mask, token_fraction, seq_fraction):
    log_w = torch.tensor([[0.0, 1.0, -1.0, 0.1, 5.0], [0.8, -0.2, 0.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0, 0.0]])
    mask = make_mask([4, 2, 0], 5)
    behav = random_log_probs(log_w.shape, 32)
    config = CorrectionConfig(mode="decoupled", level=level, cap_mode="mask", cap=2.0)
    out = apply_off_policy_correction(behav, mask, config, recomputed_log_probs=behav + log_w)
    kept = torch.tensor(kept_mask, dtype=torch.float32)
    assert torch.equal(out.response_mask, kept)
    assert out.stats.masked_token_fraction == pytest.approx(token_fraction)
    assert out.stats.masked_seq_fraction == pytest.approx(seq_fraction)
    assert (out.rollout_is_weights[kept == 0] == 0).all()
    kept_w = out.rollout_is_weights[kept == 1]
    assert ((kept_w >= 0.5 - 1e-6) & (kept_w <= 2.0 + 1e-6)).all()


def test_mask_fractions_against_a_hand_count():
    torch.manual_seed(0)
    shape = (6, 8)
    mask = make_mask([8, 5, 0, 3, 8, 1], 8)
    log_w = torch.randn(shape)
    behav = random_log_probs(shape, 33)
    out = apply_off_policy_correction(
        behav, mask, CorrectionConfig(cap_mode="mask", cap=1.5), recomputed_log_probs=behav + log_w
    )
    bound = math.log(1.5)
    valid = [(i, t) for i in range(6) for t in range(8) if mask[i, t]]
    removed = [(i, t) for i, t in valid if abs(float(log_w[i, t])) > bound]
    seqs = {i for i, _ in valid}
    assert out.stats.num_tokens == len(valid) and out.stats.num_sequences == len(seqs)
    assert out.stats.masked_token_fraction == pytest.approx(len(removed) / len(valid))
    assert out.stats.masked_seq_fraction == pytest.approx(len({i for i, _ in removed}) / len(seqs))
    assert int(out.response_mask.sum()) == len(valid) - len(removed)


# --- the other modes -----------------------------------------------------------------------------------------------


def test_bypass_trains_against_the_rollout_log_probs_without_weights():
    shape = (2, 4)
    behav, trainer = random_log_probs(shape, 40), random_log_probs(shape, 41)
    mask = make_mask([4, 2], 4)
    out = apply_off_policy_correction(behav, mask, CorrectionConfig(mode="bypass"), recomputed_log_probs=trainer)
    assert out.old_log_probs is behav and out.rollout_is_weights is None
    gap = [float(trainer[i, t] - behav[i, t]) for i in range(2) for t in range(4) if mask[i, t]]
    assert out.stats.log_prob_gap_mean == pytest.approx(sum(gap) / len(gap))
    assert out.stats.log_prob_gap_abs_max == pytest.approx(max(abs(g) for g in gap))
    # Without recomputed log-probs bypass still works; the gap is simply unknown.
    alone = apply_off_policy_correction(behav, mask, CorrectionConfig(mode="bypass"))
    assert alone.stats.log_prob_gap_mean is None and alone.stats.diagnostics == {}


def test_none_mode_uses_the_trainer_log_probs_and_no_weights():
    behav, trainer = random_log_probs((2, 3), 42), random_log_probs((2, 3), 43)
    out = apply_off_policy_correction(
        behav, torch.ones(2, 3), CorrectionConfig(mode="none"), recomputed_log_probs=trainer
    )
    assert out.old_log_probs is trainer and out.rollout_is_weights is None
    with pytest.raises(ValueError, match="recomputed log-probs"):
        apply_off_policy_correction(behav, torch.ones(2, 3), CorrectionConfig(mode="tis"))


@pytest.mark.parametrize(
    "config",
    [
        CorrectionConfig(),
        CorrectionConfig(cap_mode="mask"),
        CorrectionConfig(level="sequence"),
        CorrectionConfig(mode="tis"),
        CorrectionConfig(mode="bypass"),
        CorrectionConfig(mode="none"),
    ],
)
@pytest.mark.parametrize("batch_size", [0, 3])
def test_empty_masks_give_no_nan(config, batch_size):
    shape = (batch_size, 4)
    behav = random_log_probs(shape, 50)
    out = apply_off_policy_correction(
        behav,
        torch.zeros(shape),
        config,
        recomputed_log_probs=behav + 1.0,
        rollout_versions=torch.zeros(shape),
        trainer_version=2,
    )
    if out.rollout_is_weights is not None:
        assert (out.rollout_is_weights == 0).all()
    metrics = out.stats.to_metrics()
    assert metrics["off_policy/num_tokens"] == 0.0
    assert all(math.isfinite(v) for v in metrics.values())


# --- the log-linear proximal policy --------------------------------------------------------------------------------


class ToyPolicy:
    """A context-free policy per position whose logits move with the version: logits_v = L0 + v * D."""

    def __init__(self, length: int = 6, vocab: int = 5, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.base = torch.randn(length, vocab, generator=g)
        self.drift = 0.4 * torch.randn(length, vocab, generator=g)

    def log_probs(self, tokens: torch.Tensor, version: torch.Tensor | float) -> torch.Tensor:
        """[B, R] log pi_v(token) with a per-token (tensor) or shared (float) version."""
        v = torch.as_tensor(version, dtype=torch.float32).expand(tokens.shape).unsqueeze(-1)
        table = torch.log_softmax(self.base + v * self.drift, dim=-1)  # [B, R, vocab]
        return table.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize(
    ("v_behav", "v_prox", "v_theta"),
    [
        (4, 4, 5),  # AReaL's convention v_prox = v_theta - 1, tokens from the proximal version: alpha = 0
        (2, 5, 5),  # this trainer's convention v_prox = v_theta (update's own forward pass): alpha = 1
        (0, 3, 3),
        (5, 5, 5),  # fresh tokens: alpha = 0, behaviour = theta = proximal
        (2.0, 2.0, 2.25),  # mini-batch 1 of 4 inside a step that started at version 2, fresh tokens
    ],
)
def test_loglinear_equals_recomputation_when_all_tokens_share_a_version(v_behav, v_prox, v_theta):
    policy = ToyPolicy()
    tokens = torch.randint(0, 5, (3, 6), generator=torch.Generator().manual_seed(1))
    versions = torch.full(tokens.shape, float(v_behav))
    approx = loglinear_proximal_log_probs(
        policy.log_probs(tokens, versions),
        policy.log_probs(tokens, v_theta),
        versions,
        theta_version=v_theta,
        prox_version=v_prox,
    )
    torch.testing.assert_close(approx, policy.log_probs(tokens, v_prox))


def test_loglinear_interpolates_per_token_versions_like_a_hand_computation():
    policy = ToyPolicy(seed=3)
    tokens = torch.randint(0, 5, (2, 6), generator=torch.Generator().manual_seed(2))
    versions = torch.tensor([[0, 1, 2, 3, 4, -1], [2, 2, 4, 4, 1, 0]])  # -1: a token no policy generated
    behav, theta = policy.log_probs(tokens, versions.clamp(min=0).float()), policy.log_probs(tokens, 4.0)
    for prox_version in (3, 1.5):  # with 1.5, tokens of versions 2 and 3 are newer than pi_prox: alpha clamps to 0
        approx = loglinear_proximal_log_probs(behav, theta, versions, theta_version=4, prox_version=prox_version)
        for i in range(2):
            for t in range(6):
                v = int(versions[i, t])
                alpha = 0.0 if v < 0 or v >= 4 else min(max((prox_version - v) / (4 - v), 0.0), 1.0)
                expected = float(behav[i, t]) + alpha * (float(theta[i, t]) - float(behav[i, t]))
                assert float(approx[i, t]) == pytest.approx(expected, abs=1e-6), (i, t, v, alpha)
    approx = loglinear_proximal_log_probs(behav, theta, versions, theta_version=4, prox_version=3)
    # Tokens two or more versions old are only approximated: the error is real but smaller than behaviour's.
    truth = policy.log_probs(tokens, 3.0)
    old = versions <= 1
    assert (approx - truth)[old].abs().mean() < (behav - truth)[old].abs().mean()


def test_decoupled_with_loglinear_reports_its_error_against_recomputation():
    policy = ToyPolicy(seed=4)
    tokens = torch.randint(0, 5, (3, 6), generator=torch.Generator().manual_seed(5))
    versions = torch.tensor([[1, 1, 1, 2, 2, 2], [3, 3, 3, 3, 3, 3], [0, 0, 1, 1, 2, 3]]).float()
    behav = policy.log_probs(tokens, versions)
    theta, recomputed = policy.log_probs(tokens, 4.0), policy.log_probs(tokens, 3.0)
    mask = make_mask([6, 6, 4], 6)
    out = apply_off_policy_correction(
        behav,
        mask,
        CorrectionConfig(prox_log_probs="loglinear"),
        recomputed_log_probs=recomputed,
        theta_log_probs=theta,
        rollout_versions=versions,
        theta_version=4,
        prox_version=3,
        trainer_version=3,
    )
    approx = loglinear_proximal_log_probs(behav, theta, versions, theta_version=4, prox_version=3)
    assert torch.equal(out.old_log_probs, approx)
    errors = [abs(float(approx[i, t] - recomputed[i, t])) for i in range(3) for t in range(6) if mask[i, t]]
    assert out.stats.prox_approx_abs_error_mean == pytest.approx(sum(errors) / len(errors), rel=1e-5)
    assert out.stats.prox_approx_abs_error_max == pytest.approx(max(errors), rel=1e-5)
    assert out.stats.prox_approx_abs_error_max > 0
    lags = [3 - float(versions[i, t]) for i in range(3) for t in range(6) if mask[i, t]]
    assert out.stats.staleness_mean == pytest.approx(sum(lags) / len(lags))
    assert out.stats.staleness_max == 3.0
    with pytest.raises(ValueError, match="theta_log_probs"):
        apply_off_policy_correction(behav, mask, CorrectionConfig(prox_log_probs="loglinear"))


# --- the DataProto entry point and config ----------------------------------------------------------------------------


def test_batch_function_writes_the_verl_keys_and_drops_stale_weights():
    shape = (3, 5)
    behav, trainer = random_log_probs(shape, 60), random_log_probs(shape, 61)
    mask = make_mask([5, 2, 4], 5)
    data = DataProto.from_dict(
        tensors={
            "rollout_log_probs": behav,
            "old_log_probs": trainer,
            "response_mask": mask,
            "response_versions": torch.ones(shape, dtype=torch.long),
        }
    )
    stats = apply_off_policy_correction_to_batch(data, CorrectionConfig(cap_mode="mask", cap=1.5), trainer_version=4)
    expected = apply_off_policy_correction(
        behav, mask, CorrectionConfig(cap_mode="mask", cap=1.5), recomputed_log_probs=trainer
    )
    assert torch.equal(data.batch["old_log_probs"], trainer)
    assert torch.equal(data.batch["rollout_is_weights"], expected.rollout_is_weights)
    assert torch.equal(data.batch["response_mask"], expected.response_mask)
    assert stats.staleness_mean == 3.0 and stats.masked_token_fraction == expected.stats.masked_token_fraction
    assert stats.to_metrics()["off_policy/verl/kl"] == pytest.approx(stats.diagnostics["kl"])

    apply_off_policy_correction_to_batch(data, CorrectionConfig(mode="bypass"))
    assert "rollout_is_weights" not in data.batch
    assert torch.equal(data.batch["old_log_probs"], behav)


def test_loglinear_leaves_the_behaviour_log_probs_to_the_update():
    behav = torch.tensor([[-1.0, -2.0, -3.0]])
    data = DataProto.from_dict(
        tensors={
            "rollout_log_probs": behav,
            "response_mask": torch.tensor([[1.0, 1.0, 0.0]]),
            "old_log_probs": torch.zeros(1, 3),  # whatever was there: the update computes pi_prox itself
            "rollout_is_weights": torch.full((1, 3), 7.0),
            "response_versions": torch.tensor([[1, 2, -1]]),
        }
    )
    stats = apply_off_policy_correction_to_batch(data, CorrectionConfig(prox_log_probs="loglinear"), trainer_version=3)
    assert torch.equal(data.batch["old_log_probs"], behav)
    assert "rollout_is_weights" not in data.batch  # a stale weight must not reach the registered loss
    assert stats.num_tokens == 2 and stats.staleness_mean == 1.5 and stats.weight_mean is None


def _lagged_batch(versions: torch.Tensor, seed: int) -> tuple[DataProto, torch.Tensor, torch.Tensor]:
    behav, theta = random_log_probs(versions.shape, seed), random_log_probs(versions.shape, seed + 1)
    mask = (versions >= 0).float()
    data = DataProto.from_dict(
        tensors={"rollout_log_probs": behav, "response_mask": mask, "response_versions": versions}
    )
    return data, behav, theta


def _assert_proximal_and_weights(
    data: DataProto, versions: torch.Tensor, behav: torch.Tensor, expected_prox, cap: float
) -> None:
    """Token by token: old_log_probs = expected_prox(row, column, version) and w = min(pi_prox / pi_behav, cap)."""
    for i in range(versions.shape[0]):
        for t in range(versions.shape[1]):
            v = int(versions[i, t])
            if v < 0:
                continue
            prox = expected_prox(i, t, v)
            assert float(data.batch["old_log_probs"][i, t]) == pytest.approx(prox, abs=1e-6), (i, t)
            weight = float(data.batch["rollout_is_weights"][i, t])
            assert weight == pytest.approx(min(math.exp(prox - float(behav[i, t])), cap), rel=1e-5), (i, t)


def test_a_lagged_proximal_policy_interpolates_older_tokens_like_a_hand_computation():
    # V = 5, L = 1: pi_prox is version 4. Tokens of versions 4 and 5 are no older than it (alpha 0: w = 1, clip
    # against pi_behav); a token of version v < 4 gets alpha = (4 - v) / (5 - v) of the way to pi_theta.
    versions = torch.tensor([[5, 4, 3, 1], [2, 0, 4, -1]])
    data, behav, theta = _lagged_batch(versions, seed=80)
    config = CorrectionConfig(prox_log_probs="loglinear", prox_lag=1, cap=10.0)
    corrector = OffPolicyCorrector(config)
    assert corrector.needs_recompute and corrector.policy_loss_mode is None  # verl's vanilla loss, recomputed theta
    corrector.apply(data, proximal_log_probs=theta, trainer_version=5)

    def interpolated(i: int, t: int, v: int) -> float:
        alpha = 0.0 if v >= 4 else (4 - v) / (5 - v)
        return float(behav[i, t]) + alpha * (float(theta[i, t]) - float(behav[i, t]))

    _assert_proximal_and_weights(data, versions, behav, interpolated, cap=10.0)


def test_a_proximal_lag_covering_every_token_is_naive_ppo_against_the_behaviour_policy():
    versions = torch.tensor([[3, 2, 2, 3], [1, 1, 3, -1]])  # at most 2 versions behind V = 3
    data, behav, theta = _lagged_batch(versions, seed=90)
    OffPolicyCorrector(CorrectionConfig(prox_log_probs="loglinear", prox_lag=2)).apply(
        data, proximal_log_probs=theta, trainer_version=3
    )
    mask = data.batch["response_mask"]
    assert torch.equal(data.batch["old_log_probs"] * mask, behav * mask)
    assert torch.equal(data.batch["rollout_is_weights"], mask)


def test_the_previous_weights_proximal_policy_is_taken_as_given_except_for_tokens_of_the_trainers_version():
    # V = 5: pi_prox is the policy before the trainer's last step (the log-probs given). A token of version 5 is newer
    # than that: its own policy is its proximal one (w = 1, clipped against pi_behav).
    versions = torch.tensor([[5, 4, 3, 1], [2, 0, 5, -1]])
    data, behav, previous = _lagged_batch(versions, seed=95)
    corrector = OffPolicyCorrector(CorrectionConfig(prox_log_probs="previous", cap=10.0))
    assert corrector.needs_recompute and corrector.uses_previous_weights and corrector.policy_loss_mode is None
    corrector.apply(data, proximal_log_probs=previous, trainer_version=5)
    _assert_proximal_and_weights(
        data, versions, behav, lambda i, t, v: float(behav[i, t] if v == 5 else previous[i, t]), cap=10.0
    )
    assert not OffPolicyCorrector(CorrectionConfig(prox_log_probs="loglinear", prox_lag=1)).uses_previous_weights


def test_the_decoupled_control_takes_the_previous_policy_for_every_token_even_of_the_trainers_version():
    """control_prox=previous_step (η = 0): tokens of the trainer's version V get pi_{V-1} as their proximal policy
    too, where prox_log_probs=previous alone keeps pi_behav for them (so nothing would clip at η = 0)."""
    versions = torch.full((3, 5), 5)
    versions[2, 3:] = -1
    data, behav, previous = _lagged_batch(versions, seed=97)
    control = OffPolicyCorrector(CorrectionConfig(prox_log_probs="previous", cap=10.0, control_prox="previous_step"))
    assert control.uses_previous_weights and control.needs_recompute
    control.apply(data, proximal_log_probs=previous, trainer_version=5)
    _assert_proximal_and_weights(data, versions, behav, lambda i, t, v: float(previous[i, t]), cap=10.0)


def test_the_m2po_control_keeps_the_on_policy_gradient_and_masks_on_the_step_back():
    """mode=m2po with control_prox: old_log_probs = log pi_{V-1}, weights pi_{V-1} / pi_behav, so M2PO's loss has
    the gradient of -A * M * pi_theta / pi_behav, M masking on (log pi_theta - log pi_{V-1})^2, against a
    hand-written reference."""
    from rllm.experimental.fully_async.algorithms.second_moment import m2po_policy_loss, second_moment_mask

    versions = torch.full((4, 6), 3)
    versions[3, 4:] = -1
    data, behav, previous = _lagged_batch(versions, seed=98)
    mask = data.batch["response_mask"]
    corrector = OffPolicyCorrector(CorrectionConfig(mode="m2po", tau=0.5, control_prox="previous_step"))
    metrics = corrector.apply(data, proximal_log_probs=previous, trainer_version=3)
    torch.testing.assert_close(data.batch["old_log_probs"], previous)
    torch.testing.assert_close(data.batch["rollout_is_weights"], torch.exp(previous - behav) * mask)
    assert metrics["off_policy/weight_max"] > 1.0

    theta = (previous + 0.6 * random_log_probs(versions.shape, seed=99)).requires_grad_(True)
    advantages = random_log_probs(versions.shape, seed=100)
    loss, _ = m2po_policy_loss(
        data.batch["old_log_probs"],
        theta,
        advantages,
        mask,
        "token-mean",
        None,
        data.batch["rollout_is_weights"],
        tau=0.5,
    )
    loss.backward()
    keep = second_moment_mask(theta.detach() - previous, mask, 0.5)
    assert 0 < int(keep.sum()) < int(mask.sum()), "the mask binds: not vacuous"
    reference_theta = theta.detach().clone().requires_grad_(True)
    reference = (-advantages * keep * torch.exp(reference_theta - behav) * mask).sum() / mask.sum()
    reference.backward()
    torch.testing.assert_close(theta.grad, reference_theta.grad, rtol=1e-5, atol=1e-6)


def test_batch_function_needs_the_recomputed_and_rollout_log_probs():
    data = DataProto.from_dict(tensors={"rollout_log_probs": torch.zeros(1, 2), "response_mask": torch.ones(1, 2)})
    with pytest.raises(ValueError, match="recomputed log-probs"):
        apply_off_policy_correction_to_batch(data, CorrectionConfig())
    with pytest.raises(KeyError, match="rollout_log_probs"):
        apply_off_policy_correction_to_batch(
            DataProto.from_dict(tensors={"response_mask": torch.ones(1, 2)}), CorrectionConfig()
        )


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"mode": "ppo"}, "mode"),
        ({"level": "batch"}, "level"),
        ({"cap": 1.0}, "cap"),
        ({"cap": float("inf")}, "cap"),
        ({"mode": "tis", "cap_mode": "mask"}, "cap_mode"),
        ({"mode": "bypass", "prox_log_probs": "loglinear"}, "prox_log_probs"),
        ({"prox_log_probs": "loglinear", "prox_lag": -1}, "prox_lag"),
        ({"prox_log_probs": "loglinear", "prox_lag": True}, "prox_lag"),
        ({"prox_lag": 1}, "prox_lag"),  # recompute: only the weights before the step exist
        ({"prox_log_probs": "previous", "prox_lag": 1}, "prox_lag"),  # its lag is one step, built in
        ({"mode": "tis", "prox_log_probs": "previous"}, "prox_log_probs"),
        ({"mode": "tis", "prox_lag": 1}, "prox_lag"),
        ({"mode": "m2po", "tau": 0.0}, "tau"),
        ({"mode": "m2po", "tau": float("nan")}, "tau"),
        ({"mode": "decoupled", "tau": 0.1}, "tau"),  # tau is m2po's alone
        ({"mode": "m2po", "cap": 3.0}, "cap"),
        ({"mode": "m2po", "cap_mode": "mask"}, "cap_mode"),
        ({"mode": "m2po", "level": "sequence"}, "level"),
        ({"mode": "m2po", "m2_threshold": 0.04}, "m2_threshold"),  # m2po bounds its second moment with tau
        ({"mode": "tis", "m2_threshold": 0.04}, "m2_threshold"),
        ({"m2_threshold": 0.0}, "m2_threshold"),
        ({"m2_threshold": float("inf")}, "m2_threshold"),
        ({"m2_threshold": True}, "m2_threshold"),
        ({"prox_log_probs": "previous", "control_prox": "one_back"}, "control_prox"),
        ({"prox_log_probs": "loglinear", "prox_lag": 1, "control_prox": "previous_step"}, "control_prox"),
        ({"mode": "tis", "control_prox": "previous_step"}, "control_prox"),
        ({"mode": "bypass", "control_prox": "previous_step"}, "control_prox"),
    ],
)
def test_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=rf"algorithm\.off_policy_correction\.{key}"):
        CorrectionConfig(**kwargs)


# --- building from the run config ------------------------------------------------------------------------------------


def test_own_section_wins_and_verl_keys_map_when_it_is_absent():
    own = OmegaConf.create({"algorithm": {"off_policy_correction": {"cap_mode": "mask", "cap": 3.0}}})
    assert correction_config_from(own) == CorrectionConfig(cap_mode="mask", cap=3.0)
    verl_tis = OmegaConf.create(
        {"algorithm": {"rollout_correction": {"rollout_is": "sequence", "rollout_is_threshold": 4}}}
    )
    assert correction_config_from(verl_tis) == CorrectionConfig(mode="tis", level="sequence", cap=4.0)
    verl_bypass = OmegaConf.create({"algorithm": {"rollout_correction": {"bypass_mode": True}}})
    assert correction_config_from(verl_bypass) == CorrectionConfig(mode="bypass")
    assert correction_config_from(OmegaConf.create({"algorithm": {"rollout_correction": {"rollout_is": None}}})) is None
    assert build_correction(OmegaConf.create({"algorithm": {"adv_estimator": "grpo"}})) is None
    with pytest.raises(ValueError, match=r"cap_mode=mask"):
        correction_config_from(OmegaConf.create({"algorithm": {"rollout_correction": {"rollout_rs": "token_k1"}}}))
    with pytest.raises(ValueError, match=r"unknown key algorithm\.off_policy_correction\.threshold"):
        correction_config_from(OmegaConf.create({"algorithm": {"off_policy_correction": {"threshold": 2}}}))
    loglinear = build_correction(
        OmegaConf.create({"algorithm": {"off_policy_correction": {"prox_log_probs": "loglinear", "cap": 3}}})
    )
    assert loglinear.policy_loss_mode == "fully_async_decoupled_loglinear/token/truncate/3"
    assert build_correction(own).policy_loss_mode is None  # recompute: verl's vanilla loss does the work
    m2po = build_correction(OmegaConf.create({"algorithm": {"off_policy_correction": {"mode": "m2po", "tau": 0.02}}}))
    assert m2po.policy_loss_mode == "fully_async_m2po/0.02"


@pytest.mark.parametrize(
    ("config", "needs"),
    [
        (CorrectionConfig(), True),
        (CorrectionConfig(mode="tis"), True),
        (CorrectionConfig(mode="none"), True),
        (CorrectionConfig(mode="bypass"), False),
        (CorrectionConfig(prox_log_probs="loglinear"), False),
        (CorrectionConfig(mode="m2po"), False),
    ],
)
def test_corrector_says_when_the_trainer_must_recompute(config, needs):
    assert OffPolicyCorrector(config).needs_recompute is needs


def test_corrector_applies_the_trainers_log_probs_and_returns_metrics():
    shape = (2, 4)
    behav, trainer = random_log_probs(shape, 70), random_log_probs(shape, 71)
    versions = torch.tensor([[2, 2, 3, -1], [1, 1, -1, -1]])
    mask = make_mask([3, 2], 4)
    data = DataProto.from_dict(
        tensors={"rollout_log_probs": behav, "response_mask": mask, "response_versions": versions}
    )
    metrics = OffPolicyCorrector(CorrectionConfig()).apply(data, proximal_log_probs=trainer, trainer_version=3)
    assert torch.equal(data.batch["old_log_probs"], trainer)
    expected = torch.exp(trainer - behav).clamp(max=2.0) * mask
    torch.testing.assert_close(data.batch["rollout_is_weights"], expected)
    assert metrics["off_policy/staleness_max"] == 2.0
    assert metrics["off_policy/staleness_mean"] == pytest.approx((1 + 1 + 0 + 2 + 2) / 5)


def test_loglinear_approximation_error_reaches_the_metrics_when_both_proximal_log_probs_are_computed():
    """decoupled + loglinear with async_training.compute_prox_log_prob: the trainer recomputes pi_prox too, and the
    formula's error against it (prox_approx_*) is in the step's metrics; without it, no forward pass and no metric."""
    section = {"off_policy_correction": {"mode": "decoupled", "prox_log_probs": "loglinear"}}
    plain = build_correction({"algorithm": section, "async_training": {"compute_prox_log_prob": False}})
    measured = build_correction({"algorithm": section, "async_training": {"compute_prox_log_prob": True}})
    assert not plain.needs_recompute and measured.needs_recompute

    behav = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]])
    recomputed = torch.tensor([[-1.1, -1.8, -0.5], [-0.2, -0.9, 0.0]])
    versions = torch.tensor([[3, 4, 4], [4, 4, -1]])  # trainer at version 4: two tokens are one version old
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])

    def batch() -> DataProto:
        return DataProto.from_dict(
            tensors={"rollout_log_probs": behav.clone(), "response_mask": mask.clone(), "response_versions": versions}
        )

    data = batch()
    metrics = measured.apply(data, proximal_log_probs=recomputed.clone(), trainer_version=4)
    # alpha = 1 for the version-3 token (exact), 0 for version-4 tokens (pi_prox ~ pi_behav): error |behav - recomp|
    errors = [0.0, 0.2, 0.0, 0.1, 0.2]
    assert metrics["off_policy/prox_approx_abs_error_mean"] == pytest.approx(sum(errors) / 5, abs=1e-6)
    assert metrics["off_policy/prox_approx_abs_error_max"] == pytest.approx(0.2, abs=1e-6)
    assert torch.equal(data.batch["old_log_probs"], behav)  # the update-time loss still gets log pi_behav
    assert not any(k.startswith("off_policy/prox_approx") for k in plain.apply(batch(), proximal_log_probs=None))
