"""The second-moment trust region (M2PO) against a reference written in plain torch: its mask, loss and gradient."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
from verl.workers.config import ActorConfig

from rllm.experimental.fully_async.algorithms.second_moment import (
    m2po_policy_loss,
    register_m2po_loss,
    second_moment_mask,
)


def reference_mask(log_ratio: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """Mask the token with the largest squared log-ratio, one at a time, until the mean of the rest is below tau."""
    kept = [
        (float(log_ratio[i, t]) ** 2, (i, t)) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]
    ]
    kept.sort(key=lambda item: item[0])
    while kept and sum(m2 for m2, _ in kept) / len(kept) >= tau:
        kept.pop()  # the largest
    out = torch.zeros(mask.shape, dtype=torch.bool)
    for _, (i, t) in kept:
        out[i, t] = True
    return out


def reference_loss(behav, log_prob, advantages, mask, tau) -> torch.Tensor:
    """-(1/N) sum_t M_t r_t A_t, N = every response token (masked ones included), in plain torch."""
    keep = reference_mask((log_prob - behav).detach(), mask, tau).to(log_prob.dtype)
    ratio = torch.exp(log_prob - behav)
    return -(keep * ratio * advantages * mask).sum() / mask.sum()


def batch(seed: int, rows: int = 4, width: int = 6, spread: float = 0.5):
    gen = torch.Generator().manual_seed(seed)
    behav = -torch.rand(rows, width, generator=gen) * 3
    log_prob = behav + torch.randn(rows, width, generator=gen) * spread
    advantages = torch.randn(rows, width, generator=gen)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    return behav, log_prob, advantages, mask


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), tau=st.sampled_from([0.001, 0.04, 0.2, 1.0, 100.0]))
def test_mask_is_the_one_that_drops_the_largest_squared_log_ratios_until_the_mean_is_under_tau(seed, tau):
    behav, log_prob, _, mask = batch(seed, spread=0.6)
    expected = reference_mask(log_prob - behav, mask, tau)
    got = second_moment_mask(log_prob - behav, mask, tau)
    assert torch.equal(got, expected)
    kept = (log_prob - behav)[got].square()
    assert kept.numel() == 0 or float(kept.mean()) < tau
    assert not bool((got & ~mask.bool()).any())  # padding is never kept


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("tau", [0.02, 0.2])
def test_loss_and_gradient_equal_the_plain_torch_objective(seed, tau):
    behav, log_prob, advantages, mask = batch(seed, spread=0.8)  # mean (log r)^2 ~ 0.64: the rule binds
    ours = log_prob.clone().requires_grad_(True)
    ref = log_prob.clone().requires_grad_(True)
    loss, metrics = m2po_policy_loss(
        behav,
        ours,
        advantages,
        mask,
        "token-mean",
        ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1),
        tau=tau,
    )
    expected = reference_loss(behav, ref, advantages, mask, tau)
    loss.backward()
    expected.backward()
    assert float(loss) == pytest.approx(float(expected), rel=1e-5, abs=1e-7)
    assert torch.allclose(ours.grad, ref.grad, atol=1e-6)
    masked = 1 - reference_mask(log_prob - behav, mask, tau).sum() / mask.sum()
    assert metrics["off_policy/masked_token_fraction"] == pytest.approx(float(masked))
    assert 0 < metrics["off_policy/masked_token_fraction"] < 1  # the rule bound here: not a vacuous comparison
    assert metrics["off_policy/m2_kept"] < tau <= metrics["off_policy/m2"]


def test_near_on_policy_tokens_are_all_kept_and_the_gradient_is_the_importance_weighted_one():
    behav, log_prob, advantages, mask = batch(5, spread=0.01)  # (log r)^2 ~ 1e-4, far under tau
    theta = log_prob.clone().requires_grad_(True)
    loss, metrics = m2po_policy_loss(behav, theta, advantages, mask, tau=0.04)
    loss.backward()
    # d/dlogpi of -(1/N) r A = -(r A)/N on every response token, zero on padding: no clip, no mask
    assert torch.allclose(theta.grad, -(torch.exp(log_prob - behav) * advantages * mask) / mask.sum(), atol=1e-7)
    assert metrics["off_policy/masked_token_fraction"] == 0.0


def test_every_token_far_off_policy_masks_all_and_an_empty_mask_gives_no_nan():
    behav = torch.zeros(2, 3)
    theta = torch.full((2, 3), -1.0, requires_grad=True)  # (log r)^2 = 1 for every token
    loss, metrics = m2po_policy_loss(behav, theta, torch.ones(2, 3), torch.ones(2, 3), tau=0.5)
    loss.backward()
    assert float(loss) == 0.0 and metrics["off_policy/masked_token_fraction"] == 1.0
    assert torch.equal(theta.grad, torch.zeros(2, 3))
    empty, empty_metrics = m2po_policy_loss(behav, theta, torch.ones(2, 3), torch.zeros(2, 3), tau=0.5)
    assert torch.isfinite(empty) and empty_metrics == {}


def test_registration_names_one_loss_per_tau_in_verls_registry():
    name = register_m2po_loss(0.03)
    assert name == "fully_async_m2po/0.03" and name in POLICY_LOSS_REGISTRY
    with pytest.raises(ValueError, match="tau must be > 0"):
        register_m2po_loss(0.0)
