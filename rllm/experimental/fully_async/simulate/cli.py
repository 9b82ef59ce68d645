"""`python -m rllm.experimental.fully_async simulate [--config FILE] [--timing FILE] [--from RUN_DIR] [--gpus N]
[--json FILE] [k=v]`.

Inputs (one of):
- `--config FILE` a project config (loaded with `settings.load_config` as for another machine, so a GPU config
  loads here without a GPU; overrides without the `simulate.` prefix go to it) or a scenario file (top-level keys
  only `description`, `simulate`, `published`: see scenarios.py);
- `--from RUN_DIR` a finished run: its config.yaml gives the pipeline and the layout, its metrics.jsonl the timing
  models (calibrate.py, from_run.py); prints the measured wall time beside the prediction, and a line per
  simulation of the fit on stderr while it runs;
- neither: the project's default config.
The header names the modelled layout (layout.py): engines x tensor-parallel size and trainer GPUs (separate) from a
GPU config, engine processes and trainer ranks sharing the cores from a CPU one; `simulate.*` keys that would
contradict it (pipeline.num_engines, engine.gpus_per_engine, trainer_gpus, separated) are refused with the project
key to set instead. A project config's timing models (engine throughput, response lengths, trainer step, sync) are
`scenarios.project_timing`'s defaults (on CPU the embedded default's, fitted), printed on a `timing models:` line,
unless `--timing FILE` names a scenario file whose `simulate` block supplies them (its pipeline is replaced by the
config's) or `simulate.KEY=VALUE` overrides set them, e.g. `simulate.engine.peak_tokens_per_s=5000`,
`simulate.steps=100`; an unknown key is refused naming the nearest one. Prints the synchronous baseline (η = 0,
K = 1; on GPUs colocated on all the layout's GPUs, as verl runs it; on CPU the same processes) and the configured
(fully-async) mode side by side with one speedup (a synchronous config: against fully async at η =
`simulate.async_staleness`), so `--from` one mode's run predicts the other mode's wall time too; with `--gpus N`
every rollout:trainer split of N GPUs against the same baseline (the config's own split, when N is its GPU count,
is the same simulation as its modes' row, marked) and the split that minimises wall time; with a `published:`
block, predicted vs published for the scenario as written and for each of its `published.variants`; with
`simulate.engine_schedule=[[t, n], ...]` (engines joining and leaving, model.py) a row per stretch of one engine
count and a line per change with throughput and staleness before and after it (`--gpus` and published rows are
fixed splits: refused with a schedule); `--json FILE` also writes both modes' results, segments included.
Arguments are checked before anything is simulated. Exit 0, or 2 with one line on a bad key, file or value.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rllm.experimental.fully_async.observe.progress import status_printer
from rllm.experimental.fully_async.settings.loader import ConfigError, load_config
from rllm.experimental.fully_async.simulate.calibrate import CalibrationError, Simulations
from rllm.experimental.fully_async.simulate.from_run import predict_from_run
from rllm.experimental.fully_async.simulate.layout import (
    Layout,
    apply_layout,
    baseline_name,
    best_split,
    check_gpus,
    layout_from_project,
    layout_layer,
    modes,
    sweep_splits,
)
from rllm.experimental.fully_async.simulate.model import SimConfig, schedule_entries
from rllm.experimental.fully_async.simulate.published import predict_published
from rllm.experimental.fully_async.simulate.result import Segment, SimResult
from rllm.experimental.fully_async.simulate.scenarios import (
    SCENARIO_KEYS,
    ScenarioError,
    build_config,
    parse_overrides,
    pipeline_from_project,
    project_timing,
    read_scenario,
    timing_models,
)

EXIT_BAD_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rllm.experimental.fully_async simulate", description=__doc__)
    parser.add_argument("--config", default=None, help="project config or scenario YAML")
    parser.add_argument("--timing", default=None, help="scenario file whose simulate block gives the timing models")
    parser.add_argument("--from", dest="run_dir", default=None, help="fit the timing models to this run directory")
    parser.add_argument("--gpus", type=int, default=None, help="total GPUs: find the best rollout:trainer split")
    parser.add_argument("--json", dest="json_out", default=None, help="also write both modes' results to this file")
    parser.add_argument("overrides", nargs="*", help="simulate.KEY=VALUE (timing models) or project KEY=VALUE")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_intermixed_args(argv)  # key=value overrides may come before and after --gpus N
    try:
        return _run(args)
    except (ScenarioError, CalibrationError, ValueError) as exc:
        print(f"simulate: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG


LAYOUT_KEYS = {  # simulate.* keys a project config's layout sets, and the project key that sets them
    "pipeline.num_engines": "engines.num_engines",
    "engine.gpus_per_engine": "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "trainer_gpus": "trainer.n_gpus_per_node and trainer.nnodes",
    "separated": "nothing (engines and trainer never share a GPU; the baseline is colocated)",
}


@dataclass(frozen=True)
class Inputs:
    """What a simulation starts from: SimConfig layers, the published block, a description, the layout."""

    layers: list[dict[str, Any]]
    published: dict[str, Any]
    source: str
    layout: Layout | None  # None: a scenario file's own settings


def _run(args: argparse.Namespace) -> int:
    for item in args.overrides:
        if "=" not in item:
            raise ScenarioError(f"unexpected argument {item!r}: overrides are key=value")
    if args.gpus is not None and args.gpus < 2:
        raise ScenarioError(f"--gpus {args.gpus}: at least 2 GPUs are needed (one engine and one trainer GPU)")
    sim_overrides = [o for o in args.overrides if o.startswith("simulate.")]
    project_overrides = [o for o in args.overrides if not o.startswith("simulate.")]
    sim_layer = parse_overrides(sim_overrides)  # a bad simulate key fails here, before any config file is read
    _check_early(sim_layer)
    if args.gpus is not None and "engine_schedule" in sim_layer:
        raise ScenarioError(
            f"--gpus {args.gpus} sweeps fixed rollout:trainer splits: leave out simulate.engine_schedule"
        )
    if args.run_dir is not None:
        if args.config or args.timing:
            raise ScenarioError("--from takes the run's own config and fits its timing: leave out --config/--timing")
        _refuse_layout_keys(sim_layer, "--from RUN_DIR models the run's own layout")
        return _run_from(Path(args.run_dir), project_overrides, sim_layer, args.gpus, args.json_out)
    inputs = _inputs(args, project_overrides, sim_layer)
    cfg = apply_layout(build_config(SimConfig(), [*inputs.layers, sim_layer]), inputs.layout)
    if cfg.engine_schedule and (inputs.published or args.gpus is not None):
        what = "a published block's rows" if inputs.published else f"--gpus {args.gpus}'s rows"
        raise ScenarioError(f"simulate.engine_schedule: {what} are fixed GPU splits; leave out the schedule")
    if args.gpus is not None:
        check_gpus(args.gpus, cfg.engine.gpus_per_engine)
    _print_header(inputs.source, cfg, inputs.layout)
    if inputs.published:
        _print_published(cfg, inputs.published)
        return 0
    print(f"  timing models: {timing_models(cfg)}")
    sims = Simulations()  # the sweep's row for the config's own split is the modes' simulation again
    results = modes(cfg, inputs.layout, run=sims)
    _print_modes(results, 0.0, baseline_name(inputs.layout))
    _print_schedule(cfg, results, inputs.layout)
    _write_json(args.json_out, results, 0.0)
    _print_host(cfg)
    if args.gpus is not None:
        _print_sweep(cfg, args.gpus, inputs.layout, sims)
    return 0


def _check_early(sim_layer: dict[str, Any]) -> None:
    """The simulate.* overrides on their own, before any file is read. The engine schedule's entries only: its
    count at 0 s and its timeout are checked with the whole config (model.check_schedule)."""
    layer = dict(sim_layer)
    schedule = layer.pop("engine_schedule", None)
    build_config(SimConfig(), [layer])
    if schedule is not None:
        try:
            schedule_entries(schedule)
        except ValueError as exc:
            raise ScenarioError(f"simulate.{exc}") from exc


def _refuse_layout_keys(sim_layer: dict[str, Any], why: str) -> None:
    for dotted, project_key in LAYOUT_KEYS.items():
        if OmegaConf.select(OmegaConf.create(sim_layer), dotted) is not None:
            raise ScenarioError(f"simulate.{dotted}: {why}; set {project_key} instead")


def _run_from(
    run: Path, project_overrides: list[str], sim_layer: dict[str, Any], gpus: int | None, json_out: str | None
) -> int:
    """`--from RUN_DIR`: fit to the run (progress on stderr), print both modes and the measured wall time."""
    config, metrics = run / "config.yaml", run / "metrics.jsonl"
    for path in (config, metrics):
        if not path.is_file():
            raise ScenarioError(f"--from {run}: {path.name} not found (is it a run directory?)")
    if project_overrides:
        raise ScenarioError(f"--from takes only simulate.* overrides, got {project_overrides[0]!r}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    status = status_printer(sys.stderr)
    status(f"fitting the timing models to {run} ({sum('trainer/step' in r for r in records)} steps)")
    try:
        result = predict_from_run(
            OmegaConf.load(config), records, cores=os.cpu_count(), sim_layer=sim_layer, progress=status
        )
    finally:
        status.close()
    cfg, fit = result.cfg, result.fit
    if gpus is not None:
        check_gpus(gpus, cfg.engine.gpus_per_engine)
    note = ""
    if cfg.host.cores is not None:
        where = "recorded by the run" if result.cores_recorded else "of this machine"
        note = f" (CPU run: {cfg.host.cores:g} cores {where})"
    _print_header(f"fitted to {run}{note}", cfg, result.layout)
    _print_modes(result.results, result.startup_s, baseline_name(result.layout))
    _print_schedule(cfg, result.results, result.layout)
    _write_json(json_out, result.results, result.startup_s)
    _print_host(cfg)
    m, predicted = fit.measured, result.predicted_self_s
    print(
        f"  measured run: wall {m.wall_s:.1f}s, trainer idle {m.idle_frac:.1%}; predicted for it {predicted:.1f}s "
        f"({predicted / m.wall_s - 1:+.1%}); fitted engine peak {cfg.engine.peak_tokens_per_s:.0f} tokens/s, "
        f"trainer {cfg.trainer.fixed_s:.3f}s + {cfg.trainer.per_token_s * 1e3:.4f}ms/token, "
        f"sync {cfg.sync.total_s:.3f}s (pause {cfg.sync.pause_s:.3f}s), start-up {result.startup_s:.2f}s"
    )
    if fit.simulated_share is not None:
        measured_share = "not logged" if fit.cpu_share is None else f"{fit.cpu_share:.0%}"
        print(f"  trainer CPU share: measured {measured_share}, simulated {fit.simulated_share:.0%}")
    mode = "synchronous" if result.own == "synchronous" else "fully-async"
    print(
        f"  cross-mode: this {mode} run predicts {result.wall_s(result.other):.1f}s for the {result.other} mode "
        "(compare with a run of that mode)"
    )
    if gpus is not None:
        if cfg.host.cores is not None:
            print(f"  --gpus {gpus}: a what-if: the speeds fitted to this CPU run, on devices of their own")
        _print_sweep(cfg, gpus, result.layout, Simulations())
    return 0


def _print_header(source: str, cfg: SimConfig, layout: Layout | None) -> None:
    print(f"simulate: {source}")
    print(f"  layout: {layout.describe() if layout is not None else _scenario_layout(cfg)}")
    p = cfg.pipeline
    print(
        f"  {cfg.steps} steps of {p.required_samples} groups x {p.samples_per_prompt} samples; eta={p.max_staleness} "
        f"K={p.trigger_parameter_sync_step} partial_rollout={p.partial_rollout} seed={cfg.seed}"
    )


def _scenario_layout(cfg: SimConfig) -> str:
    trainer = f"{cfg.trainer_gpus} trainer GPU(s)" if cfg.trainer_gpus else "the trainer at its reference GPU count"
    where = ", separate" if cfg.separated else ""
    shared = f", sharing {cfg.host.cores:g} cores" if cfg.host.cores is not None else ""
    return (
        f"as the scenario sets it: {cfg.pipeline.num_engines} engine(s) x {cfg.engine.gpus_per_engine} GPU(s), "
        f"{trainer}{where}{shared}"
    )


def _write_json(path: str | None, results: dict[str, SimResult], startup_s: float) -> None:
    """`--json FILE`: both modes' results (SimResult.as_dict: the printed figures and each engine-count segment);
    `wall_s` is the simulated time, `startup_s` the measured start-up the printed wall time adds (`--from`)."""
    if path is not None:
        body = {"startup_s": startup_s, "modes": {name: r.as_dict() for name, r in results.items()}}
        Path(path).write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")


def _print_schedule(cfg: SimConfig, results: dict[str, SimResult], layout: Layout | None) -> None:
    """With an engine schedule: the configured mode's segments (one row per engine count the run reached), then a
    line per change with the throughput and staleness before and after it."""
    if not cfg.engine_schedule:
        return
    name, result = list(results.items())[-1]
    where = "; the synchronous row keeps its GPUs" if layout is not None and layout.device == "gpu" else ""
    print(
        f"  engine schedule ({name}): {_schedule_text(cfg.schedule())}, engines join after {cfg.engine.join_s:g}s"
        f"{where}"
    )
    for line in segment_table(result.segments):
        print(f"    {line}")
    for before, after in itertools.pairwise(result.segments):
        print(f"  at {after.start_s:g}s {change_label(after)}: {_before_after(before, after)}")
    missed = [(at, n) for at, n in cfg.schedule() if at >= result.wall_s]
    if missed:
        print(f"  not reached (the run ended at {result.wall_s:.1f}s): {_schedule_text(missed)}")
    if result.stopped:
        print(f"  the run stopped after {result.steps} of {cfg.steps} steps: {result.stopped}")


def _schedule_text(entries: list[tuple[float, int]]) -> str:
    return ", ".join(f"{n} engine(s) at {at:g}s" for at, n in entries)


def change_label(segment: Segment) -> str:
    """'+4 engines', '-1 engine, 3 samples moved' (the report's labels for the run's own events read alike)."""
    plural = "s" if abs(segment.change) != 1 else ""
    label = f"{segment.change:+d} engine{plural}"
    if segment.samples_moved:
        label += f", {segment.samples_moved} samples moved"
        if segment.tokens_regenerated:
            label += f" ({segment.tokens_regenerated} tokens regenerated)"
    return label


def _before_after(before: Segment, after: Segment) -> str:
    def rate(a: float, b: float) -> str:
        return f"{a:,.0f} -> {b:,.0f}" + (f" ({b / a - 1:+.0%})" if a > 0 else "")

    def stale(segment: Segment) -> str:
        mean = segment.mean_staleness
        return "-" if mean is None else f"{mean:.2f}/{segment.max_staleness}"

    return (
        f"generated tokens/s {rate(before.generated_tokens_per_s, after.generated_tokens_per_s)}, trained "
        f"{rate(before.trained_tokens_per_s, after.trained_tokens_per_s)}, staleness mean/max {stale(before)} -> "
        f"{stale(after)} (eta {after.eta})"
    )


def segment_table(segments: list[Segment]) -> list[str]:
    """The segments as aligned text rows, a header first."""
    rows = [
        f"{'from s':>9}{'to s':>9}{'engines':>9}{'change':>8}{'moved':>7}{'regen tok':>11}{'steps':>7}"
        f"{'gen tok/s':>11}{'train tok/s':>13}{'stale mean':>12}{'stale max':>11}{'eta':>5}"
    ]
    for seg in segments:
        mean, top = seg.mean_staleness, seg.max_staleness
        rows.append(
            f"{seg.start_s:>9.1f}{seg.end_s:>9.1f}{seg.engines:>9}{seg.change:>+8d}{seg.samples_moved:>7}"
            f"{seg.tokens_regenerated:>11}{seg.steps:>7}{seg.generated_tokens_per_s:>11,.0f}"
            f"{seg.trained_tokens_per_s:>13,.0f}{'-' if mean is None else f'{mean:.2f}':>12}"
            f"{'-' if top is None else top:>11}{seg.eta:>5}"
        )
    return rows


def _print_host(cfg: SimConfig) -> None:
    h = cfg.host
    if h.cores is not None:
        print(
            f"  host sharing: {h.cores:g} cores for engines (demand {h.engine_demand:g} each) and trainer (demand "
            f"{h.trainer_demand:g}), background {h.background or 0.0:.2f} cores; the timing models are uncontended"
        )


def _inputs(args: argparse.Namespace, project_overrides: list[str], sim_layer: dict[str, Any]) -> Inputs:
    """The layers, published block, description and layout of a scenario file or a project config."""
    raw = OmegaConf.load(args.config) if args.config else None
    if raw is not None and set(raw) <= SCENARIO_KEYS and "simulate" in raw:
        if project_overrides or args.timing:
            extra = project_overrides[0] if project_overrides else "--timing"
            raise ScenarioError(f"a scenario file takes only simulate.* overrides, got {extra!r}")
        sim, published = read_scenario(OmegaConf.to_container(raw))
        return Inputs([sim], published, str(raw.get("description", args.config)), None)

    try:
        # Planned for another machine: a GPU config loads without a GPU here (nothing of this host is checked).
        project = load_config(args.config, project_overrides, check_host=False)
    except ConfigError as exc:
        raise ScenarioError(str(exc)) from exc
    _refuse_layout_keys(sim_layer, "with a project config the layout comes from its keys")
    cores = OmegaConf.select(OmegaConf.create(sim_layer), "host.cores", default=os.cpu_count())
    layout = layout_from_project(project, cores)
    layers = [project_timing(layout.device, OmegaConf.select(project, "data.max_response_length"))]
    if layout.device == "cpu":
        note = " (timing models: the embedded default's, fitted to tests/fixtures/report_run"
    else:
        note = " (default timing models"
    note += ": fit them with --from RUN_DIR, or give --timing FILE or simulate.*)"
    if args.timing:
        timing = OmegaConf.load(args.timing)
        sim, _ = read_scenario(OmegaConf.to_container(timing))
        sim.pop("pipeline", None)  # the config's pipeline, the scenario's timing
        layers.append(sim)
        note = f" (timing models from {args.timing})"
    layers += [pipeline_from_project(project), layout_layer(layout)]
    return Inputs(layers, {}, f"{args.config or 'default config'}{note}", layout)


def _print_modes(results: dict[str, SimResult], startup: float, baseline: str) -> None:
    print(
        f"  {'mode':<13}{'wall s':>10}{'s/step':>9}{'trainer idle':>14}{'engine idle':>13}{'stale mean':>12}"
        f"{'dropped':>9}{'gen tok/s':>12}{'train tok/s':>13}"
    )
    for name, r in results.items():
        print(
            f"  {name:<13}{r.wall_s + startup:>10.1f}{r.wall_s / r.steps:>9.3f}{r.trainer_idle_frac:>14.1%}"
            f"{r.engine_idle_frac:>13.1%}{r.mean_staleness:>12.2f}{r.dropped_stale_groups:>9}"
            f"{r.generated_tokens_per_s:>12.0f}{r.trained_tokens_per_s:>13.0f}"
        )
    (_, sync), (name, conf) = results.items()
    print(f"  synchronous: eta=0, K=1, {baseline}")
    print(f"  speedup (synchronous / {name} wall): {sync.wall_s / conf.wall_s:.2f}x")
    total = sum(conf.staleness.values())
    dist = ", ".join(f"{k}: {v / total:.0%}" for k, v in sorted(conf.staleness.items()))
    print(f"  staleness of trained groups ({name}): {dist}; mixed-version samples {conf.mixed_version_samples}")
    if conf.final_eta is not None:
        moves = ", ".join(f"step {s}: {a}->{b}" for s, a, b in conf.eta_changes[:8])
        more = f", ... ({len(conf.eta_changes)} changes)" if len(conf.eta_changes) > 8 else ""
        print(f"  adaptive staleness ({name}): final eta {conf.final_eta}; {moves or 'no change'}{more}")


def _print_sweep(cfg: SimConfig, gpus: int, layout: Layout | None, sims: Simulations) -> None:
    colocated, splits = sweep_splits(cfg, gpus, run=sims)
    print(
        f"  --gpus {gpus}: synchronous (eta=0, K=1), colocated on all {gpus} GPUs: {colocated.wall_s:.1f}s; "
        "fully async by rollout:trainer split:"
    )
    own = None
    if layout is not None and layout.device == "gpu" and layout.total_gpus == gpus:
        own = (layout.rollout_gpus, layout.trainer)
    for s in splits:
        r = s.result
        mark = "  <- this config's layout" if own == (s.rollout_gpus, s.trainer_gpus) else ""
        print(
            f"    {s.rollout_gpus:>4}:{s.trainer_gpus:<4} wall {r.wall_s:>10.1f}s"
            f"  trainer idle {r.trainer_idle_frac:>6.1%}"
            f"  engine idle {r.engine_idle_frac:>6.1%}  speedup {colocated.wall_s / r.wall_s:.2f}x{mark}"
        )
    best = best_split(splits)
    print(f"  best split: {best.rollout_gpus} rollout : {best.trainer_gpus} trainer GPUs ({best.result.wall_s:.1f}s)")


def _print_published(cfg: SimConfig, published: dict) -> None:
    """The README's table: per row the published speedup, the prediction from the colocated components as the
    scenario states them, and one from each of `published.variants` (published.py)."""
    predictions = predict_published(cfg, published)
    names = [name for name, _ in predictions[0].variants] if predictions else []
    print(f"  published: {published.get('source', '')}")
    print("  predicted A: the colocated components only (the scenario as written)")
    for letter, name in zip("BCDEFG", names, strict=False):
        print(f"  predicted {letter}: with {name}")
    columns = ["A", *"BCDEFG"[: len(names)]]
    head = "".join(f"{'predicted ' + c:>14}{'error':>8}" for c in columns)
    print(f"  {'GPUs':>6}{'split':>9}{'published':>11}{head}{'trainer idle A':>16}{'engine idle A':>15}")
    for p in predictions:
        r = p.async_result
        cells = [(p.predicted, p.error), *((v, v / p.published - 1) for _, v in p.variants)]
        body = "".join(f"{value:>13.2f}x{error:>+8.0%}" for value, error in cells)
        print(
            f"  {p.gpus:>6}{f'{p.rollout_gpus}:{p.trainer_gpus}':>9}{p.published:>10.2f}x{body}"
            f"{r.trainer_idle_frac:>16.1%}{r.engine_idle_frac:>15.1%}"
        )
