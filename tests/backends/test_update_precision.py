"""The bf16-against-fp32 update comparison (tests/helpers/update_precision.py), proven on CPU with CPU bf16 autocast.

tests/gpu/test_trainer_bf16.py runs the same two steps of the project's FSDPPolicyBackend on CUDA; here, with no
GPU, the bf16 one runs under CPU autocast, which rounds the same matmuls to bf16. Shown: such an update passes the
comparison while the old per-tensor bar (each tensor's update within 10% of fp32's) fails it on a bias whose
gradient is nearly zero; a step on another batch, a scaled gradient and a tensor left without gradient fail it.
"""

from __future__ import annotations

import pytest
import torch
from update_precision import (
    GRAD_FLOOR,
    GRAD_RTOL,
    UPDATE_WHOLE_RTOL,
    bf16_and_fp32_steps,
    compare,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def steps(tiny_model_dir):
    """(bf16 step, fp32 step) on seed 0's batch: two backends, two update_policy calls (~2-5 s on 2 cores)."""
    return bf16_and_fp32_steps(tiny_model_dir, seed=0)


def test_a_bf16_update_passes_though_a_near_zero_gradient_bias_moves_at_random(steps):
    bf16, fp32 = steps
    assert (bf16.device, bf16.autocast, fp32.autocast) == ("cpu", torch.bfloat16, torch.float32)
    assert bf16.metrics["actor/optimizer_step"] == fp32.metrics["actor/optimizer_step"] == 1.0
    update = compare(bf16.update, fp32.update)
    grads = compare(bf16.grads, fp32.grads)
    assert update.whole_relative_error < UPDATE_WHOLE_RTOL, update.whole_relative_error
    assert grads.failing(GRAD_RTOL, GRAD_FLOOR) == []
    assert 0 < grads.whole_relative_error < 0.05  # bf16 did round something
    # The old bar fails: the worst tensor's own update is off by far more than 10%, and it is a tensor whose
    # gradient is tiny beside the rest (a k_proj bias: the softmax is almost blind to it), which AdamW's first
    # step, ~lr * sign(g), still moves by a full step of bf16-noise sign.
    own = {t.name: t.error_rms / t.ref_rms for t in update.tensors}
    worst = max(own, key=own.__getitem__)
    assert own[worst] > 0.1 and worst.endswith("bias"), (worst, own[worst])
    worst_grad = next(t for t in grads.tensors if t.name == worst)
    assert worst_grad.ref_rms < 0.05 * grads.ref_rms


def test_a_step_on_another_batch_fails_the_comparison(steps, tiny_model_dir):
    _, fp32 = steps
    _, other = bf16_and_fp32_steps(tiny_model_dir, seed=1)  # same weights, another batch, fp32 both
    assert compare(other.update, fp32.update).whole_relative_error > UPDATE_WHOLE_RTOL
    assert len(compare(other.grads, fp32.grads).failing(GRAD_RTOL, GRAD_FLOOR)) > len(fp32.grads) // 2


def test_scaled_or_missing_gradients_fail_and_noise_on_a_near_zero_gradient_passes(steps):
    _, fp32 = steps
    ref = fp32.grads
    scaled = {name: 1.3 * g for name, g in ref.items()}  # a loss-scale bug
    failing = {t.name for t in compare(scaled, ref).failing(GRAD_RTOL, GRAD_FLOOR)}
    # every tensor but those whose gradient sits inside the floor: together they hold almost all of the gradient
    assert sum(ref[n].pow(2).sum() for n in failing) > 0.95 * sum(g.pow(2).sum() for g in ref.values())
    embed = next(name for name in ref if "embed_tokens" in name)
    frozen = {**ref, embed: torch.zeros_like(ref[embed])}  # one tensor never got a gradient
    assert [t.name for t in compare(frozen, ref).failing(GRAD_RTOL, GRAD_FLOOR)] == [embed]
    # ... which the whole-update error alone could miss, when the tensor is small beside the model:
    unmoved = {**fp32.update, embed: torch.zeros_like(fp32.update[embed])}
    share = ref[embed].numel() / sum(g.numel() for g in ref.values())
    assert compare(unmoved, fp32.update).whole_relative_error == pytest.approx(share**0.5, rel=0.2)
    # A near-zero gradient replaced by noise of 1% of the model's gradient rms: inside the floor.
    near_zero = min(compare(ref, ref).tensors, key=lambda t: t.ref_rms / compare(ref, ref).ref_rms).name
    rms = compare(ref, ref).ref_rms
    noisy = {**ref, near_zero: ref[near_zero] + 0.01 * rms * torch.randn(ref[near_zero].shape)}
    assert compare(noisy, ref).failing(GRAD_RTOL, GRAD_FLOOR) == []


def test_compare_refuses_mismatched_tensors():
    a = {"w": torch.ones(2, 2)}
    with pytest.raises(ValueError, match="different tensors"):
        compare(a, {"v": torch.ones(2, 2)})
    with pytest.raises(ValueError, match=r"w: shape \(2, 2\) against \(4,\)"):
        compare(a, {"w": torch.ones(4)})
    same = compare(a, a)
    assert same.whole_relative_error == 0.0 and same.ref_rms == 1.0
