"""How far a low-precision policy update is from an fp32 reference, by a criterion that survives near-zero gradients.

Used by tests/gpu/test_trainer_bf16.py (bf16 autocast on CUDA) and tests/backends/test_update_precision.py (the same
comparison on CPU, where it is proven). Two quantities, two criteria:

- The parameter update Δ = θ_after - θ_before is judged as a whole: ‖Δ_got - Δ_ref‖₂ / ‖Δ_ref‖₂ over every
  parameter together. Not per tensor: AdamW's first step is about lr·sign(g) per element, so an element whose
  gradient is below bf16's rounding (a bias whose gradient is nearly zero) gets a full-size step of random sign,
  and that tensor's own relative error is ~50-100% however right the update is.
- The gradients the optimizer received are judged per tensor with an absolute floor:
  rms(g_got - g_ref) ≤ rtol · rms(g_ref) + floor · rms(all of g_ref), so a tensor with a near-zero gradient
  passes on the floor, and a tensor that got no (or the wrong) gradient fails however small the rest of the
  error is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# The bars the bf16 tests use; the measured values are bf16 autocast on CPU against fp32 (tiny Qwen2, six seeds,
# tests/backends/test_update_precision.py): whole-update relative error 0.10-0.11, gradient per tensor at most 2.3%
# of its # own rms and 3.5% of the global rms (with rtol covering that one). The bars leave ~2x for CUDA's kernels.
UPDATE_WHOLE_RTOL = 0.25
GRAD_RTOL = 0.1
GRAD_FLOOR = 0.02


@dataclass(frozen=True)
class TensorError:
    """One tensor's error: root-mean-square of (got - ref) and of ref."""

    name: str
    error_rms: float
    ref_rms: float


@dataclass(frozen=True)
class Comparison:
    """`got` against `ref`, tensor by tensor and as a whole."""

    whole_relative_error: float  # ‖got - ref‖₂ / ‖ref‖₂ over every element of every tensor
    ref_rms: float  # rms of ref over every element
    tensors: tuple[TensorError, ...]

    def failing(self, rtol: float, floor: float) -> list[TensorError]:
        """Tensors whose error rms exceeds rtol · their own ref rms + floor · the global ref rms."""
        return [t for t in self.tensors if t.error_rms > rtol * t.ref_rms + floor * self.ref_rms]


def compare(got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]) -> Comparison:
    """Compare two tensor dicts with the same names and shapes (computed in float64)."""
    if set(got) != set(ref):
        raise ValueError(f"different tensors: {sorted(set(got) ^ set(ref))}")
    error_sq = ref_sq = 0.0
    count = 0
    tensors = []
    for name, r in ref.items():
        r64, g64 = r.detach().double().cpu(), got[name].detach().double().cpu()
        if g64.shape != r64.shape:
            raise ValueError(f"{name}: shape {tuple(g64.shape)} against {tuple(r64.shape)}")
        e_sq, r_sq = float((g64 - r64).pow(2).sum()), float(r64.pow(2).sum())
        tensors.append(TensorError(name, math.sqrt(e_sq / r64.numel()), math.sqrt(r_sq / r64.numel())))
        error_sq, ref_sq, count = error_sq + e_sq, ref_sq + r_sq, count + r64.numel()
    whole = math.sqrt(error_sq / ref_sq) if ref_sq > 0 else (0.0 if error_sq == 0 else math.inf)
    return Comparison(whole, math.sqrt(ref_sq / count), tuple(tensors))


def difference(after: Mapping[str, torch.Tensor], before: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """after - before, per name (an update Δ)."""
    return {name: after[name].double() - before[name].double() for name in before}


# --------------------------------------------------------------------------------------------------------------
# One step of the project's FSDP backend in two precisions
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One backend's update_policy call: parameters before and after, the gradients the optimizer got, metrics."""

    device: str  # where the backend computed ("cuda" or "cpu")
    autocast: torch.dtype  # the actor's autocast dtype (float32: none)
    before: dict[str, torch.Tensor]
    after: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    metrics: dict[str, float]

    @property
    def update(self) -> dict[str, torch.Tensor]:
        return difference(self.after, self.before)


def parameters(backend: Any) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().cpu().clone() for name, p in backend.model.named_parameters()}


def record_gradients(backend: Any) -> dict[str, torch.Tensor]:
    """A dict that fills, at each optimizer step, with the gradients the optimizer is about to apply (after verl's
    clipping). verl's actor zeroes them when update_policy returns, so they are read inside the step."""
    names = {id(p): name for name, p in backend.model.named_parameters()}
    seen: dict[str, torch.Tensor] = {}

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    seen[names[id(p)]] = p.grad.detach().float().cpu().clone()

    backend.optimizer.register_step_pre_hook(hook)
    return seen


def bf16_and_fp32_steps(model_dir: Path, seed: int) -> tuple[Step, Step]:
    """Two FSDPPolicyBackends (backends/fsdp.py) from the same weights on the device verl picks (CUDA when there is
    one) take one update_policy step on the same batch: one under bf16 autocast over fp32 parameters (verl's GPU
    default), one computing in fp32. Returns (bf16 step, fp32 step).

    old_log_probs are the fp32 model's own log-probs (ratio 1): with random old log-probs some tokens sit at the
    PPO clip edge, and bf16's rounding moving one across it switches its whole gradient on or off (measured: one
    seed in four, whole-update error 0.79), which is the loss's discontinuity, not precision.
    """
    from backend_helpers import actor_cfg
    from verl_helpers import make_batch, make_batch_copy

    from rllm.experimental.fully_async.backends.fsdp import FSDPPolicyBackend

    cfg = actor_cfg(fsdp_config={"dtype": "bfloat16"})
    bf16, fp32 = FSDPPolicyBackend(model_dir, cfg, seed=seed), FSDPPolicyBackend(model_dir, cfg, seed=seed)
    bf16.actor.param_dtype = torch.bfloat16  # on CPU the backend computes in fp32 unless told (CPU autocast works)
    fp32.actor.param_dtype = torch.float32  # the reference: autocast to fp32 is no autocast
    data = make_batch(seed)
    data.batch["response_mask"] = data.batch["response_mask"].float()
    data.batch["old_log_probs"] = fp32.compute_log_prob(data)
    steps = []
    for backend in (bf16, fp32):
        grads = record_gradients(backend)
        before = parameters(backend)
        metrics = backend.update_policy(make_batch_copy(data))
        step = Step(backend.device.type, backend.actor.param_dtype, before, parameters(backend), grads, metrics)
        steps.append(step)
    return steps[0], steps[1]
