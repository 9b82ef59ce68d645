"""Predict from a finished run: fit the timing models to its metrics (calibrate.py), then simulate both modes.

`simulate --from RUN_DIR` prints it; the report's summary block quotes its synchronous wall time ("a synchronous
run of the same config would take X"), so the saving of an async run is a number. Pure: takes the run's saved
config (a mapping or DictConfig) and its parsed metrics records; the callers read the files.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from rllm.experimental.fully_async.simulate.calibrate import Fit, Simulations, calibrate
from rllm.experimental.fully_async.simulate.layout import (
    Layout,
    apply_layout,
    baseline_name,
    layout_from_project,
    layout_layer,
    modes,
)
from rllm.experimental.fully_async.simulate.model import SimConfig
from rllm.experimental.fully_async.simulate.result import SimResult
from rllm.experimental.fully_async.simulate.scenarios import build_config, pipeline_from_project

Progress = Callable[[str], None]


@dataclass(frozen=True)
class FromRun:
    """The fit, the fitted config (with any what-if pipeline applied), both modes' results, and the run's own mode."""

    fit: Fit
    cfg: SimConfig
    results: dict[str, SimResult]  # "synchronous" (the layout's baseline) and the other mode (layout.modes)
    own: str  # the mode the run itself ran, a key of `results`
    cores_recorded: bool  # host sharing from the run's logged `host/cpus` (else the caller's count)
    simulations: int  # how many whole-run simulations the fit and the predictions took
    layout: Layout  # the run's engines and trainer (layout.py)

    @property
    def baseline(self) -> str:
        """What "synchronous" is for this run's layout (colocated on its GPUs, or the same processes on CPU)."""
        return baseline_name(self.layout)

    @property
    def startup_s(self) -> float:
        return self.fit.startup_s

    def wall_s(self, mode: str) -> float:
        """Predicted wall time of `mode` for this run's steps, start-up included as measured."""
        return self.results[mode].wall_s + self.startup_s

    @property
    def other(self) -> str:
        return next(name for name in self.results if name != self.own)

    @property
    def predicted_self_s(self) -> float:
        """The fitted simulation of the run itself (its own pipeline, before any what-if)."""
        assert self.fit.result is not None  # calibrate() always sets it
        return self.fit.result.wall_s + self.startup_s


def run_layers(
    project: Any, records: Sequence[Mapping[str, Any]], cores: float | None
) -> tuple[list[dict], Layout, bool]:
    """SimConfig layers for a run: its pipeline and its layout, a CPU run's cores from its logged `host/cpus`
    (else `cores`); the layout; whether the cores were recorded."""
    cfg = OmegaConf.create(project) if isinstance(project, Mapping) else project
    recorded = [r["host/cpus"] for r in records if r.get("host/cpus") is not None]
    layout = layout_from_project(cfg, float(recorded[-1]) if recorded else cores)
    return [pipeline_from_project(cfg), layout_layer(layout)], layout, bool(recorded)


def predict_from_run(
    project: Any,
    records: Sequence[Mapping[str, Any]],
    *,
    cores: float | None,
    sim_layer: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> FromRun:
    """Fit to the run with its own pipeline (model overrides in `sim_layer`, such as lengths.sigma, take part in
    the fit), then apply `sim_layer`'s pipeline part and engine schedule as a what-if ("had this run used eta=2",
    "had it added 2 engines at 60 s") and simulate both modes. `progress` gets a line per simulation of the fit
    (10-20 of the whole run)."""
    layer = dict(sim_layer or {})
    what_if = {key: layer.pop(key) for key in ("pipeline", "engine_schedule") if key in layer}
    layers, layout, recorded = run_layers(project, records, cores)
    sims = Simulations()  # the fitted run is simulated once, for the fit and for its own mode's row
    base = apply_layout(build_config(SimConfig(), [*layers, layer]), layout)
    fit = calibrate(base, records, progress=progress, sims=sims)
    cfg = build_config(fit.cfg, [what_if])
    if progress is not None:
        progress("simulating the synchronous and the fully-async mode with the fitted models")
    results = modes(cfg, layout, run=sims)
    own = "synchronous" if fit.cfg.pipeline.max_staleness == 0 else next(n for n in results if n != "synchronous")
    return FromRun(fit, cfg, results, own, recorded, sims.count, layout)
