"""Policy backends: the trainer's one door to the model, its optimizer and verl's (patched) PPO update.

`fsdp.FSDPPolicyBackend` wraps verl's `DataParallelPPOActor` (CPU and GPU, world size 1 as a plain module or N with
FSDP2); `megatron.MegatronPolicyBackend` builds verl's Megatron worker and `MegatronPPOActor` (GPU only). The
interface the trainer calls is `api/policy_backend.py`'s `PolicyBackend`. Both switch on the
`fully_async` flag that `patches/verl_dp_actor.patch` adds to verl's actor config (see patches/README.md), through
`build_verl_actor_config` below. Import the submodule you need: importing this package costs nothing and needs
neither torch nor megatron.
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

# The actor-config key patches/verl_dp_actor.patch adds; every backend sets it to True.
FULLY_ASYNC_FLAG = "fully_async"

# What an HF folder of exported weights needs from the model's own folder to be a complete model for an engine that
# loads from disk: the tokenizer, the chat template and the generation defaults.
MODEL_FOLDER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def copy_model_folder_files(source_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> list[str]:
    """Copy the `MODEL_FOLDER_FILES` that `source_dir` has into `out_dir`, except those the export already wrote
    (FSDP's `save_pretrained` writes generation_config.json from the model, a Megatron export does not); returns
    the names copied."""
    source, out = Path(source_dir), Path(out_dir)
    copied = []
    for name in MODEL_FOLDER_FILES:
        if (source / name).is_file() and not (out / name).exists():
            shutil.copy2(source / name, out / name)
            copied.append(name)
    return copied


def build_verl_actor_config(actor_cfg: Mapping[str, Any], actor_target: str, section_targets: Mapping[str, str]) -> Any:
    """verl's actor-config dataclass from an `actor_rollout_ref.actor` section, with the fully-async flag on.

    `actor_cfg` is an omegaconf DictConfig or a plain mapping shaped like verl's generated trainer YAML. Missing
    `_target_`s default to `actor_target` and, per section, to `section_targets` (a hand-written dict usually has
    none, and verl then leaves the section a dict where it needs a dataclass); `rollout_n`, which the actor does
    not use, defaults to 1.
    """
    # lazy: this package imports neither verl nor torch (~3 s): the doctor imports backends.verl_patch without them
    from verl.utils.config import omega_conf_to_dataclass

    if isinstance(actor_cfg, DictConfig):
        raw = OmegaConf.to_container(actor_cfg, resolve=True)
    else:
        raw = copy.deepcopy(dict(actor_cfg))
    raw.setdefault("_target_", actor_target)
    raw.setdefault("rollout_n", 1)
    for section, target in section_targets.items():
        raw[section] = dict(raw.get(section) or {})
        raw[section].setdefault("_target_", target)
    raw[FULLY_ASYNC_FLAG] = True
    config = omega_conf_to_dataclass(OmegaConf.create(raw))
    if not getattr(config, FULLY_ASYNC_FLAG, False):
        raise TypeError(f"{type(config).__name__} has no '{FULLY_ASYNC_FLAG}' field: is verl patched?")
    if getattr(config, "loss_scale_factor", None) is not None:
        # verl's policy losses call agg_loss(**config.global_batch_info); only its new-worker path copies
        # loss_scale_factor there, so DataParallelPPOActor would divide by the padded width instead (Dr.GRPO).
        config.global_batch_info["loss_scale_factor"] = config.loss_scale_factor
    return config


def build_lr_scheduler(optimizer: Any, optim: Any, key: str) -> Any:
    """verl's schedule (fsdp_workers._build_model_optimizer): constant or cosine, each after a linear warmup.

    `optim` is an actor's or critic's optim config; `key` names its section in errors.
    """
    # lazy: this package imports neither verl nor torch (see build_verl_actor_config)
    from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    total_steps = int(optim.get("total_training_steps", -1) or -1)
    warmup_steps = optim.get("lr_warmup_steps", -1)
    warmup_steps = -1 if warmup_steps is None else int(warmup_steps)
    if warmup_steps < 0:
        warmup_steps = int(float(optim.get("lr_warmup_steps_ratio", 0.0)) * max(total_steps, 0))
    kind = optim.get("lr_scheduler_type", "constant")
    if kind == "constant":
        return get_constant_schedule_with_warmup(optimizer=optimizer, num_warmup_steps=warmup_steps)
    if kind == "cosine":
        if total_steps <= 0:
            raise ValueError(f"{key}.lr_scheduler_type=cosine needs {key}.total_training_steps > 0")
        return get_cosine_schedule_with_warmup(
            optimizer=optimizer,
            num_warmup_steps=warmup_steps,
            num_training_steps=total_steps,
            min_lr_ratio=float(optim.get("min_lr_ratio", 0.0) or 0.0),
            num_cycles=float(optim.get("num_cycles", 0.5)),
        )
    raise ValueError(f"{key}.lr_scheduler_type must be constant or cosine, got {kind!r}")


def require_batch_keys(data: Any, keys: tuple[str, ...], caller: str) -> None:
    """KeyError naming what `caller` needs when the DataProto lacks a batch key or the sampling temperature."""
    present = set(data.batch.keys())
    missing = [k for k in keys if k not in present]
    if missing:
        raise KeyError(f"{caller} needs batch keys {missing} (has {sorted(present)})")
    if "temperature" not in data.meta_info:
        raise KeyError(f"{caller} needs meta_info['temperature'] (the sampling temperature of the rollouts)")


def to_cpu(value: Any) -> Any:
    """Tensors (also inside dicts and lists) detached onto the CPU, for a checkpoint's state dicts."""
    # lazy: this package imports neither verl nor torch (see build_verl_actor_config)
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_cpu(v) for v in value]
    return value
