"""The actor section the backend tests build verl's actor from (shared by the FSDP, rank and CUDA tests)."""

from __future__ import annotations

LR = 1e-3


def actor_cfg(**overrides) -> dict:
    """The keys a user sets; everything else comes from verl's dataclass defaults."""
    cfg = {
        "ppo_micro_batch_size_per_gpu": 2,
        "use_torch_compile": False,
        "grad_clip": 1.0,
        "clip_ratio": 0.2,
        "optim": {"lr": LR, "weight_decay": 0.01, "betas": [0.9, 0.999]},
    }
    cfg.update(overrides)
    return cfg
