"""Policy backends: the trainer's one door to the model, its optimizer and verl's (patched) PPO update.

`fsdp.FSDPPolicyBackend` wraps verl's `DataParallelPPOActor` (CPU and GPU, world size 1 as a plain module or N with
FSDP2); `megatron.build_megatron_actor` builds verl's `MegatronPPOActor` (GPU only). Both switch on the
`fully_async` flag that `patches/verl_dp_actor.patch` adds to verl's actor config (see patches/README.md), through
`build_verl_actor_config` below. Import the submodule you need: importing this package costs nothing and needs
neither torch nor megatron.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

# The actor-config key patches/verl_dp_actor.patch adds; every backend sets it to True.
FULLY_ASYNC_FLAG = "fully_async"


def build_verl_actor_config(actor_cfg: Mapping[str, Any], actor_target: str, section_targets: Mapping[str, str]) -> Any:
    """verl's actor-config dataclass from an `actor_rollout_ref.actor` section, with the fully-async flag on.

    `actor_cfg` is an omegaconf DictConfig or a plain mapping shaped like verl's generated trainer YAML. Missing
    `_target_`s default to `actor_target` and, per section, to `section_targets` (a hand-written dict usually has
    none, and verl then leaves the section a dict where it needs a dataclass); `rollout_n`, which the actor does
    not use, defaults to 1.
    """
    from omegaconf import DictConfig, OmegaConf
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
    return config
