"""The project's FSDP update in bf16 against an fp32 reference, on the `device` parameter (tests/gpu/conftest.py):
CUDA's bf16 kernels where there is a GPU, CPU's bf16 autocast everywhere.

Two FSDPPolicyBackends (backends/fsdp.py, through the patched verl actor) on one device from the same weights take
one update_policy step on the same batch, one under verl's bf16 autocast over fp32 parameters, one in fp32. The
comparison is tests/helpers/update_precision.py's: the whole update's relative error, and each tensor's gradient with
an absolute floor, so a bias whose gradient is nearly zero (which AdamW's first step still moves by ~lr with a noisy
sign) does not fail on rounding noise. Its bars were measured with CPU bf16 autocast (tests/backends/
test_update_precision.py) and leave ~2x for CUDA's kernels.
"""

from __future__ import annotations

import pytest
import torch
from update_precision import GRAD_FLOOR, GRAD_RTOL, UPDATE_WHOLE_RTOL, bf16_and_fp32_steps, compare

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # six backends, bf16 matmuls slow on CPU


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fsdp_backends_bf16_update_matches_fp32(device, tiny_model_dir, seed):
    bf16, fp32 = bf16_and_fp32_steps(tiny_model_dir, seed)
    assert (bf16.device, fp32.device) == (device, device)
    assert (bf16.autocast, fp32.autocast) == (torch.bfloat16, torch.float32)
    assert bf16.metrics["actor/optimizer_step"] == fp32.metrics["actor/optimizer_step"] == 1.0
    assert bf16.metrics["actor/grad_norm"] == pytest.approx(fp32.metrics["actor/grad_norm"], rel=5e-2)
    assert bf16.metrics["actor/pg_loss"] == pytest.approx(fp32.metrics["actor/pg_loss"], rel=5e-2, abs=1e-3)
    update = compare(bf16.update, fp32.update)
    assert update.whole_relative_error < UPDATE_WHOLE_RTOL, f"whole update off by {update.whole_relative_error:.3f}"
    grads = compare(bf16.grads, fp32.grads)
    assert grads.whole_relative_error > 0, "the bf16 step computed exactly what fp32 did: autocast did not apply"
    assert grads.failing(GRAD_RTOL, GRAD_FLOOR) == []
