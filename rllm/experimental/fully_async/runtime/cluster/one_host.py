"""The placement plan (core/placement.py) made true on one GPU host: every process sees only its own GPUs.

Engines are subprocesses: the launcher gives engine i `CUDA_VISIBLE_DEVICES` = its tp block (engines/sglang.py),
which is exactly the plan's engine block, since both count engine GPUs up from device 0. Trainer ranks are Ray
actors asking for `num_gpus=1`: Ray hands out GPU ids from the devices it was started with, so Ray is started seeing
only the plan's trainer GPUs (`ray_gpu_environment`), and can never give a rank a GPU an engine holds. Without GPUs
(embedded engines, trainer.device=cpu) there is no plan and nothing changes.

A multi-node cluster's Ray is started by its operator, not by this driver: a `trainer.nnodes > 1` run joins it and
enforces the plan through a placement group instead (runtime/cluster/multi_node.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from rllm.experimental.fully_async.core.placement import PlacementError, PlacementPlan, plan_placement
from rllm.experimental.fully_async.errors import ConfigError


def host_gpu_plan(spec: Any, gpus_on_host: int) -> PlacementPlan | None:
    """The plan for this host (one node) from the run spec, or None when the run uses no GPU."""
    uses_gpu_engines = spec.engines.backend == "sglang"
    uses_gpu_trainer = spec.trainer.device == "cuda"
    if not (uses_gpu_engines or uses_gpu_trainer):
        return None
    return plan_placement(
        [gpus_on_host],
        num_engines=spec.engines.num_engines if uses_gpu_engines else 0,
        tp_size=spec.engines.tensor_model_parallel_size if uses_gpu_engines else 1,
        trainer_ranks=spec.trainer.world_size if uses_gpu_trainer else 0,
    )


@contextlib.contextmanager
def ray_gpu_environment(plan: PlacementPlan | None) -> Iterator[dict[str, str]]:
    """While Ray starts: `CUDA_VISIBLE_DEVICES` = the plan's trainer GPUs, so Ray's GPU ids are exactly those.
    Yields the variables set (empty without a plan); the driver's own environment is restored afterwards."""
    if plan is None:
        yield {}
        return
    trainer_gpus = ",".join(str(slot.gpus[0]) for slot in plan.trainer)
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = trainer_gpus
    try:
        yield {"CUDA_VISIBLE_DEVICES": trainer_gpus}
    finally:
        if previous is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous


def ray_num_gpus(plan: PlacementPlan | None) -> int | None:
    """The GPUs to declare to Ray: the trainer's share of the plan (None: let Ray detect, i.e. none on CPU)."""
    return None if plan is None else len(plan.trainer)


def trainer_actor_gpus(spec: Any) -> int:
    """GPUs the trainer actor itself asks for: one when it is the only rank on CUDA; none when it coordinates
    rank actors (they ask for theirs) or runs on CPU."""
    return 1 if spec.trainer.device == "cuda" and spec.trainer.world_size == 1 else 0


def host_plan(spec: Any) -> PlacementPlan | None:
    """This host's GPU placement plan, or None when the run uses no GPU or the host has none (SGLang then fails
    on its own; the test stand-in needs none). Too few GPUs is a one-line configuration error."""

    gpus = torch.cuda.device_count()
    if gpus == 0:
        return None
    try:
        return host_gpu_plan(spec, gpus)
    except PlacementError as exc:
        raise ConfigError(f"GPU placement on this host: {exc}") from exc
