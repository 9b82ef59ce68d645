"""What a config does, observed: the trainer's policy and critic backends built from a loaded config the way the
trainer builds them, and what they then do on one fixed batch.

Used by tests/settings/test_config_keys.py (each verl key the trainer hands to verl must change one of these
observations,
or be refused) and tests/gpu/test_config_keys_gpu.py (the keys only CUDA can show). An observation is a plain
dict, so two of them compare with `==` and a test failure prints what differed.

- `policy(cfg)`: what `FSDPPolicyBackend.describe()` reports (parameter dtype and device, gradient checkpointing,
  FSDP2 options, optimizer class, autocast dtype, entropy function), the optimizer's hyperparameters, the LR over
  the first steps of its schedule, and one `update_policy` on a fixed batch: the parameter change, verl's metrics,
  how many times the first decoder layer ran forward (micro-batches, and recomputation under gradient
  checkpointing) and how many checkpointed calls verl made (entropy checkpointing).
- `critic(cfg)`: the same for `FSDPCriticBackend` and one `update_critic`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl_helpers import RESPONSE_LEN, make_batch

from rllm.experimental.fully_async.backends.fsdp import gradient_checkpointing_on

# ln(3.3): old log-probs this far on either side of the current ones give ratios of 3.3 and 0.3, outside every clip
# range tested (1 +- 0.2, dual-clip c = 3, and the smaller values the walk tries), so each clip bound bites.
LOG_RATIO = 1.2
SCHEDULE_STEPS = 6


def _rounded(value: Any) -> Any:
    """Numbers to 6 significant digits, so two observations compare without float noise (but do see 1e-6 shifts)."""
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def fixed_batch(old_log_probs: torch.Tensor) -> DataProto:
    """make_batch(0) (6 rows of uneven lengths, advantages of both signs) with the given old log-probs."""
    data = make_batch(0)
    data.batch["response_mask"] = data.batch["response_mask"].float()
    data.batch["old_log_probs"] = old_log_probs
    return data


def shifted(log_probs: torch.Tensor) -> torch.Tensor:
    """Old log-probs LOG_RATIO above and below the current ones, alternating token by token."""
    signs = torch.ones(RESPONSE_LEN)
    signs[1::2] = -1
    return log_probs + LOG_RATIO * signs


@contextlib.contextmanager
def counting_layer_forwards(model: torch.nn.Module) -> Iterator[list[int]]:
    """Count the forward calls of the first decoder layer's MLP: micro-batches x (1 + recomputation). (The MLP, not
    the layer: transformers checkpoints a layer's `forward`, so the layer's own hooks run once either way.)"""
    layers = [m for name, m in model.named_modules() if name.endswith("layers.0.mlp")]
    calls = [0]
    handle = layers[0].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        yield calls
    finally:
        handle.remove()


@contextlib.contextmanager
def counting_checkpoint_calls() -> Iterator[list[int]]:
    """Count calls of torch.utils.checkpoint.checkpoint made through the module attribute (verl's dp_actor calls
    it that way for entropy_checkpointing; HF's gradient checkpointing holds its own reference)."""
    import torch.utils.checkpoint as checkpoint_module

    original = checkpoint_module.checkpoint
    calls = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    checkpoint_module.checkpoint = counted
    try:
        yield calls
    finally:
        checkpoint_module.checkpoint = original


def _optimizer_facts(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    group = optimizer.param_groups[0]
    return {k: v for k, v in group.items() if k != "params" and isinstance(v, (int, float, bool, tuple, str))}


def _schedule(optimizer: torch.optim.Optimizer, scheduler: Any) -> list[float]:
    """The LR of the first SCHEDULE_STEPS steps (the scheduler is stepped: build a fresh backend afterwards)."""
    lrs = []
    for _ in range(SCHEDULE_STEPS):
        lrs.append(float(scheduler.get_last_lr()[0]))
        optimizer.step()  # no gradients: nothing moves, but torch wants a step before the scheduler's
        scheduler.step()
    return lrs


def _parameters(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten().clone() for p in model.parameters()])


def policy(cfg: Any, *, update: bool = True) -> dict[str, Any]:
    """Build the policy as the trainer does (runtime/trainer/actor.py build_policy_backend) and observe it."""
    from rllm.experimental.fully_async.run_spec import build_run_spec
    from rllm.experimental.fully_async.runtime.trainer.build import build_policy_backend

    spec = build_run_spec(cfg)
    backend, param_dtype = build_policy_backend(spec.trainer)
    seen: dict[str, Any] = {
        "describe": backend.describe(),
        "param_dtype": param_dtype,
        "optimizer": _optimizer_facts(backend.optimizer),
    }
    if update:
        data = fixed_batch(shifted(backend.compute_log_prob(make_batch(0))))
        before = _parameters(backend.model)
        with counting_layer_forwards(backend.model) as forwards, counting_checkpoint_calls() as checkpointed:
            metrics = backend.update_policy(data)
        change = _parameters(backend.model) - before
        seen |= {
            "metrics": {k: v for k, v in metrics.items() if k != "actor/lr"},
            "change_norm": float(change.norm()),
            "change_head": change[:8].tolist(),
            "layer_forwards": forwards[0],
            "checkpoint_calls": checkpointed[0],
        }
    seen["lr_schedule"] = _schedule(backend.optimizer, backend.lr_scheduler)
    return _rounded(seen)


def critic_batch(backend: Any) -> DataProto:
    """make_batch(0) with old values LOG_RATIO off the critic's current ones (alternating), so the value clip bites
    (cliprange_value 0.5 and smaller), and returns spread around them."""
    data = make_batch(0)
    mask = data.batch["response_mask"].float()
    data.batch["response_mask"] = mask
    current = backend.compute_values(data)
    data.batch["values"] = shifted(current) * mask
    data.batch["returns"] = (current + 1.5 * torch.linspace(-1, 1, RESPONSE_LEN)) * mask
    return data


def critic(cfg: Any) -> dict[str, Any]:
    """Build the critic as the trainer does (build_critic_backend) and observe one update_critic."""
    from rllm.experimental.fully_async.run_spec import build_run_spec
    from rllm.experimental.fully_async.runtime.trainer.build import build_critic_backend

    backend = build_critic_backend(build_run_spec(cfg).trainer)
    seen: dict[str, Any] = {
        "gradient_checkpointing": gradient_checkpointing_on(backend.model),
        "optimizer": _optimizer_facts(backend.optimizer),
        "optimizer_class": f"{type(backend.optimizer).__module__}.{type(backend.optimizer).__name__}",
    }
    data = critic_batch(backend)
    before = _parameters(backend.model)
    with counting_layer_forwards(backend.model) as forwards:
        values = backend.compute_values(data)
        metrics = backend.update_critic(data)
    change = _parameters(backend.model) - before
    seen |= {
        "values_head": values[0].tolist(),
        "metrics": {k: v for k, v in metrics.items() if k != "critic/lr"},
        "change_norm": float(change.norm()),
        "layer_forwards": forwards[0],
        "lr_schedule": _schedule(backend.optimizer, backend.lr_scheduler),
    }
    return _rounded(seen)


def section(cfg: Any, key: str) -> Any:
    """A config value as a plain object (for messages)."""
    node = OmegaConf.select(cfg, key)
    return OmegaConf.to_container(node) if OmegaConf.is_config(node) else node
