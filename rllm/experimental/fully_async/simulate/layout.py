"""The hardware a simulation models and the synchronous baseline it is compared with; the rollout:trainer sweep.

One layout gives one answer, however it was described: `--config` with its engines.num_engines, tensor-parallel
size (actor_rollout_ref.rollout.tensor_model_parallel_size) and trainer.n_gpus_per_node x trainer.nnodes, or a row
of the `--gpus N` sweep. Both simulate the configured mode with `with_gpus` and compare it with `baseline`:

- GPU (engines.backend=sglang, trainer.device=cuda): E engines of tp GPUs each and T trainer GPUs, never sharing a
  GPU (the placement rule, core/placement.py). The trainer's step time scales from the timing models' reference
  GPU count to T (TrainerModel.step_s). The synchronous baseline is verl's: colocated, engines and trainer taking
  turns on all E·tp + T GPUs (η = 0, K = 1), the best a synchronous run does with the same GPUs; it keeps them
  throughout (an engine schedule is the configured mode's).
- CPU (engines.backend=embedded, trainer.device=cpu): E engine processes and W = n_gpus_per_node x nnodes trainer
  ranks sharing the machine's cores (HostModel): each rank keeps one core busy and does 1/W of the step (the ranks'
  all-reduce is not modelled). The baseline is the same processes at η = 0, K = 1 (with the engine schedule too).
- A scenario file (no project config): its own settings; the baseline is the same settings at η = 0, K = 1.
GPU engines beside a CPU trainer, or the reverse, are refused in one line: not modelled.

Pure: takes config mappings and SimConfigs, returns settings and results (the CLI prints `Layout.describe()`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from omegaconf import OmegaConf

from rllm.experimental.fully_async.simulate.engine import simulate
from rllm.experimental.fully_async.simulate.model import SimConfig
from rllm.experimental.fully_async.simulate.result import SimResult
from rllm.experimental.fully_async.simulate.scenarios import ScenarioError

Run = Callable[[SimConfig], SimResult]  # simulate, or a memo of it (calibrate.Simulations)
SCENARIO_BASELINE = "the same engines and trainer"


@dataclasses.dataclass(frozen=True)
class Layout:
    """Engines and trainer: on GPUs of their own each, or sharing a CPU host's cores."""

    device: Literal["gpu", "cpu"]
    engines: int
    gpus_per_engine: int  # tensor-parallel size (GPU); 1 on CPU
    trainer: int  # trainer GPUs (GPU) or ranks (CPU)
    engine_threads: int = 1  # CPU: cores one engine keeps busy (engines.torch_threads; 0 = all of them)
    cores: float | None = None  # CPU: the cores everything shares

    @property
    def rollout_gpus(self) -> int:
        return self.engines * self.gpus_per_engine

    @property
    def total_gpus(self) -> int:
        return self.rollout_gpus + self.trainer

    def describe(self) -> str:
        if self.device == "gpu":
            return (
                f"{self.engines} engine(s) x tp {self.gpus_per_engine} ({self.rollout_gpus} rollout GPUs) + "
                f"{self.trainer} trainer GPU(s) (trainer.n_gpus_per_node x nnodes), separate: engines and trainer "
                "never share a GPU"
            )
        cores = "this machine's cores" if self.cores is None else f"{self.cores:g} cores"
        return (
            f"{self.engines} embedded engine(s) + {self.trainer} trainer rank(s) (trainer.n_gpus_per_node x nnodes) "
            f"on CPU, sharing {cores}; the ranks' all-reduce is not modelled"
        )

    @property
    def baseline_name(self) -> str:
        """What the synchronous baseline is (module docstring)."""
        if self.device == "gpu":
            return f"colocated on all {self.total_gpus} GPUs, as verl's synchronous trainer runs"
        return "the same engines and trainer on the same cores"


def layout_from_project(cfg: Any, cores: float | None) -> Layout:
    """The layout a project config describes (a DictConfig from load_config, or a run's saved config.yaml)."""
    cfg = OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg
    backend = OmegaConf.select(cfg, "engines.backend", default="embedded")
    device = OmegaConf.select(cfg, "trainer.device", default="cpu")
    engines = int(OmegaConf.select(cfg, "engines.num_engines", default=1) or 1)
    tp = int(OmegaConf.select(cfg, "actor_rollout_ref.rollout.tensor_model_parallel_size", default=1) or 1)
    per_node = int(OmegaConf.select(cfg, "trainer.n_gpus_per_node", default=1) or 0)
    nodes = int(OmegaConf.select(cfg, "trainer.nnodes", default=1) or 0)
    if per_node < 1 or nodes < 1:
        raise ScenarioError(
            f"trainer.n_gpus_per_node x trainer.nnodes = {per_node} x {nodes}: the trainer needs at least one GPU "
            "(one rank on CPU); set both to 1 or more"
        )
    if backend == "sglang" and device == "cuda":
        return Layout("gpu", engines, tp, per_node * nodes)
    if backend == "embedded" and device == "cpu":
        threads = int(OmegaConf.select(cfg, "engines.torch_threads", default=1) or 0)
        return Layout("cpu", engines, 1, per_node * nodes, threads, cores)
    raise ScenarioError(
        f"engines.backend={backend} with trainer.device={device} is not modelled: simulate models GPU runs "
        "(engines.backend=sglang, trainer.device=cuda) and CPU runs (engines.backend=embedded, trainer.device=cpu)"
    )


def layout_layer(layout: Layout) -> dict[str, Any]:
    """SimConfig settings of a layout, a layer under the user's simulate.* overrides. On GPUs only the engines'
    size: `apply_layout` places them (as the sweep does); on CPU the processes and the cores they share."""
    if layout.device == "gpu":
        return {"engine": {"gpus_per_engine": layout.gpus_per_engine}}
    layer: dict[str, Any] = {"pipeline": {"num_engines": layout.engines}, "trainer_gpus": layout.trainer}
    if layout.cores is not None:
        demand = float(layout.engine_threads if layout.engine_threads > 0 else layout.cores)
        layer["host"] = {"cores": float(layout.cores), "engine_demand": demand, "trainer_demand": float(layout.trainer)}
    return layer


def apply_layout(cfg: SimConfig, layout: Layout | None) -> SimConfig:
    """The configured mode on the layout: on GPUs, `with_gpus` as a row of the `--gpus` sweep computes it."""
    if layout is None or layout.device == "cpu":
        return cfg
    return with_gpus(cfg, layout.rollout_gpus, layout.trainer, separated=True)


def baseline_name(layout: Layout | None) -> str:
    return SCENARIO_BASELINE if layout is None else layout.baseline_name


def synchronous(cfg: SimConfig) -> SimConfig:
    """The same run made synchronous: η = 0, K = 1 (the trainer waits for each batch, engines for each update)."""
    out = copy.deepcopy(cfg)
    out.pipeline.max_staleness, out.pipeline.trigger_parameter_sync_step = 0, 1
    out.adaptive.enable = False  # η fixed at 0
    return out


def baseline(cfg: SimConfig, layout: Layout | None) -> SimConfig:
    """The synchronous baseline of the configured mode `cfg` on `layout` (module docstring)."""
    if layout is None or layout.device == "cpu":
        return synchronous(cfg)  # the same processes: an engine schedule too (this trainer's η = 0)
    out = synchronous(cfg)
    out.engine_schedule = []  # verl's colocated trainer keeps its GPUs: no engine schedule
    return with_gpus(out, layout.total_gpus, layout.total_gpus, separated=False)


def asynchronous(cfg: SimConfig) -> tuple[str, SimConfig]:
    """The fully-async mode compared: the config's own, or at η = async_staleness when the config is synchronous."""
    if cfg.pipeline.max_staleness > 0:
        return "configured", cfg
    other = copy.deepcopy(cfg)
    other.pipeline.max_staleness = cfg.async_staleness
    return f"async eta={cfg.async_staleness}", other


def modes(cfg: SimConfig, layout: Layout | None = None, run: Run = simulate) -> dict[str, SimResult]:
    """{"synchronous": the layout's baseline, name: the fully-async mode} for the configured mode `cfg`."""
    name, fully_async = asynchronous(cfg)
    return {"synchronous": run(baseline(cfg, layout)), name: run(fully_async)}


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


def check_gpus(gpus: int, gpus_per_engine: int) -> None:
    """`--gpus N` must hold one engine and one trainer GPU; checked before anything is simulated."""
    if gpus < gpus_per_engine + 1:
        raise ScenarioError(
            f"--gpus {gpus}: at least {gpus_per_engine + 1} GPUs are needed, one engine of tp {gpus_per_engine} "
            "(engine.gpus_per_engine) and one trainer GPU"
        )


@dataclasses.dataclass(frozen=True)
class SplitResult:
    rollout_gpus: int
    trainer_gpus: int
    result: SimResult


def sweep_splits(cfg: SimConfig, gpus: int, run: Run = simulate) -> tuple[SimResult, list[SplitResult]]:
    """Colocated synchronous on all `gpus` (a GPU layout's baseline), and the fully-async mode at every
    rollout:trainer split in whole engines (each a GPU layout's configured mode)."""
    step = cfg.engine.gpus_per_engine
    check_gpus(gpus, step)
    colocated = run(with_gpus(synchronous(cfg), gpus, gpus, separated=False))
    _, fully_async = asynchronous(cfg)
    splits = [
        SplitResult(r, gpus - r, run(with_gpus(fully_async, r, gpus - r, separated=True)))
        for r in range(step, gpus, step)
    ]
    return colocated, splits


def best_split(splits: list[SplitResult]) -> SplitResult:
    return min(splits, key=lambda s: (s.result.wall_s, s.rollout_gpus))
