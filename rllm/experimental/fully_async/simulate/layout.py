"""The hardware a simulation models and the synchronous baseline it is compared with; the rollout:trainer sweep.

Pure: takes and returns SimConfigs (scenarios.py builds them from files and overrides).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

from rllm.experimental.fully_async.simulate.engine import simulate
from rllm.experimental.fully_async.simulate.model import SimConfig
from rllm.experimental.fully_async.simulate.result import SimResult
from rllm.experimental.fully_async.simulate.scenarios import ScenarioError


def synchronous(cfg: SimConfig) -> SimConfig:
    """The same run made synchronous: η = 0, K = 1 (the trainer waits for each batch, engines for each update)."""
    out = copy.deepcopy(cfg)
    out.pipeline.max_staleness, out.pipeline.trigger_parameter_sync_step = 0, 1
    out.adaptive.enable = False  # η fixed at 0
    return out


def modes(cfg: SimConfig, run: Callable[[SimConfig], SimResult] = simulate) -> dict[str, SimResult]:
    """Synchronous, and the configured mode; a synchronous config against fully async at η = async_staleness.
    `run` simulates (a caller with a memo, calibrate.Simulations, passes it)."""
    if cfg.pipeline.max_staleness > 0:
        return {"synchronous": run(synchronous(cfg)), "configured": run(cfg)}
    other = copy.deepcopy(cfg)
    other.pipeline.max_staleness = cfg.async_staleness
    return {"synchronous": run(synchronous(cfg)), f"async eta={cfg.async_staleness}": run(other)}


def with_gpus(cfg: SimConfig, rollout_gpus: int, trainer_gpus: int, *, separated: bool) -> SimConfig:
    """Engines = rollout_gpus / gpus_per_engine; trainer step times scaled to trainer_gpus; no host sharing."""
    out = copy.deepcopy(cfg)
    out.pipeline.num_engines = max(1, rollout_gpus // cfg.engine.gpus_per_engine)
    out.trainer_gpus, out.separated = trainer_gpus, separated
    out.host.cores = None  # on GPUs engines and trainer do not share cores (host sharing models a CPU run)
    if out.pipeline.max_concurrent_rollouts is not None:
        # The concurrency cap is per deployment: keep it per engine.
        per_engine = cfg.pipeline.max_concurrent_rollouts / cfg.pipeline.num_engines
        out.pipeline.max_concurrent_rollouts = max(
            cfg.pipeline.samples_per_prompt, round(per_engine * out.pipeline.num_engines)
        )
    return out


@dataclasses.dataclass(frozen=True)
class SplitResult:
    rollout_gpus: int
    trainer_gpus: int
    result: SimResult


def sweep_splits(cfg: SimConfig, gpus: int) -> tuple[SimResult, list[SplitResult]]:
    """Colocated synchronous on all `gpus`, and fully-async at every rollout:trainer split (in whole engines)."""
    step = cfg.engine.gpus_per_engine
    if gpus < step + 1:
        raise ScenarioError(f"--gpus {gpus} leaves no GPU for the trainer (engine.gpus_per_engine={step})")
    colocated = simulate(with_gpus(synchronous(cfg), gpus, gpus, separated=False))
    splits = [
        SplitResult(r, gpus - r, simulate(with_gpus(cfg, r, gpus - r, separated=True))) for r in range(step, gpus, step)
    ]
    return colocated, splits


def best_split(splits: list[SplitResult]) -> SplitResult:
    return min(splits, key=lambda s: (s.result.wall_s, s.rollout_gpus))
