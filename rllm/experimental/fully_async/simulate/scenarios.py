"""Settings for a simulation from a project config or a scenario file, and the timing models it assumes.

Two kinds of input (the CLI reads the file; everything here takes parsed mappings):
- a project config (loaded by `settings.load_config`): its pipeline keys are read by `pipeline_from_project`
  (async_training.*, actor_rollout_ref.rollout.n, engines.num_engines / max_running_requests,
  data.max_response_length, trainer.total_training_steps; with LoRA no sync pause, and the bytes a sync moves:
  `sync_from_project`), its hardware by layout.py; the timing models are
  `project_timing`'s defaults unless `simulate.*=` overrides (or `--timing FILE`) set them:
  - on GPUs, model.py's defaults (an SGLang engine at 20,000 tokens/s saturated, ...);
  - on CPU, `CPU_TIMING`: the embedded default's engines and trainer as fitted to the committed run of it
    (tests/fixtures/report_run, `simulate --from`): a tiny Qwen2 on a development machine, not another model;
  - response lengths: a mean of half data.max_response_length when that is below twice the default mean (512),
    so the mean never sits above the clip;
- a scenario file (`config/simulate/*.yaml`), standalone, with these top-level keys and nothing else:
      description: free text
      simulate:    a SimConfig (model.py): pipeline, engine, lengths, trainer, sync, steps, seed, ...
      published:   optional: measured figures to compare with (see `published.py`)
Unknown keys anywhere are refused with one line naming the nearest known one (`check_keys`, difflib), as the CLI
does for commands.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rllm.experimental.fully_async.errors import EXIT_BAD_INPUT, FullyAsyncError
from rllm.experimental.fully_async.simulate.model import SCHEDULE_EXAMPLE, LengthModel, ModelShape, SimConfig, check

SCENARIO_KEYS = frozenset({"description", "simulate", "published"})
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}  # param_sync.dtype's choices
# The embedded default on CPU, fitted to tests/fixtures/report_run (60 steps of config/tiny_cpu.yaml, 2 cores):
# uncontended engine and trainer speeds (the fit divides the other jobs' load out), the mean weight sync, as
# `simulate --from tests/fixtures/report_run` prints them (the single-request speed keeps the default curve's
# peak/single ratio of 100).
CPU_TIMING: dict[str, Any] = {
    "engine": {"peak_tokens_per_s": 6400.0, "single_tokens_per_s": 64.0},
    "trainer": {"fixed_s": 0.0, "per_token_s": 9.53e-5},
    "sync": {"total_s": 0.034, "pause_s": 0.024},
}


class ScenarioError(FullyAsyncError, ValueError):
    """A bad scenario or simulate key; `str()` is one line naming it."""

    exit_code = EXIT_BAD_INPUT


def build_config(base: SimConfig, layers: list[Mapping[str, Any]]) -> SimConfig:
    """Merge mappings onto a SimConfig strictly (unknown key or wrong type: ScenarioError) and check it."""
    merged = OmegaConf.structured(base)
    for layer in layers:
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as exc:
            raise ScenarioError(_first_line(exc)) from exc
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, SimConfig)
    try:
        check(cfg)
    except ValueError as exc:
        raise ScenarioError(f"simulate.{exc}") from exc
    return cfg


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`simulate.a.b=v` items -> a nested mapping {a: {b: v}} (values parsed as YAML); unknown keys refused."""
    try:
        dotlist = OmegaConf.from_dotlist([item.removeprefix("simulate.") for item in overrides])
    except OmegaConfBaseException as exc:
        raise ScenarioError(f"bad override: {_first_line(exc)}") from exc
    layer: dict[str, Any] = OmegaConf.to_container(dotlist)  # type: ignore[assignment]
    check_keys(layer)
    return layer


def read_scenario(raw: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(simulate block, published block) of a parsed scenario file; refuses unknown keys."""
    unknown = sorted(set(raw) - SCENARIO_KEYS)
    if unknown:
        raise ScenarioError(f"unknown scenario key {unknown[0]!r} (allowed: {', '.join(sorted(SCENARIO_KEYS))})")
    sim = dict(raw.get("simulate") or {})
    check_keys(sim)
    return sim, dict(raw.get("published") or {})


def check_keys(layer: Mapping[str, Any], schema: type = SimConfig, prefix: str = "simulate") -> None:
    """Refuse the first key of `layer` that `schema` (a dataclass, nested ones for sections) lacks, naming the
    nearest known key at that level (difflib, as the CLI does for commands)."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key, value in layer.items():
        path = f"{prefix}.{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean {prefix}.{close[0]}?" if close else f" (known: {', '.join(fields)})"
            raise ScenarioError(f"unknown key {path}{hint}")
        section = fields[key].default_factory  # a nested dataclass section (its default factory is the class)
        if section is list and not isinstance(value, list):  # OmegaConf's own message names no key
            raise ScenarioError(f"{path} = {value!r}: expected a list, {SCHEDULE_EXAMPLE.removeprefix('e.g. ')}")
        if isinstance(value, Mapping) and dataclasses.is_dataclass(section):
            check_keys(value, section, path)  # type: ignore[arg-type]


def pipeline_from_project(cfg: Any) -> dict[str, Any]:
    """A project config (DictConfig from load_config, or a run's saved config.yaml) -> simulate-block defaults."""
    at = cfg.async_training
    adaptive = OmegaConf.select(cfg, "async_training.adaptive_staleness", default=None)  # older runs lack it
    adaptive_block = {k: v for k, v in OmegaConf.to_container(adaptive).items()} if adaptive is not None else {}
    # The runtime's pause with no engine left (engines.no_engine_timeout_s); runs saved before it existed wait (null).
    no_engine_timeout = OmegaConf.select(cfg, "engines.no_engine_timeout_s", default=None)
    return {
        "adaptive": adaptive_block,
        "pipeline": {
            "required_samples": int(at.required_samples),
            "samples_per_prompt": int(cfg.actor_rollout_ref.rollout.n),
            "max_staleness": int(at.max_staleness),
            "trigger_parameter_sync_step": int(at.trigger_parameter_sync_step),
            "partial_rollout": bool(at.partial_rollout),
            "max_concurrent_rollouts": int(at.max_concurrent_rollouts),
            "queue_max_groups": int(at.queue_max_groups),
            "num_engines": int(cfg.engines.num_engines),
            "no_engine_timeout_s": None if no_engine_timeout is None else float(no_engine_timeout),
        },
        "engine": {"max_running_requests": int(cfg.engines.max_running_requests)},
        "lengths": {"max_tokens": int(cfg.data.max_response_length)},
        "steps": int(cfg.trainer.total_training_steps or 20),
        "sync": sync_from_project(cfg),
    }


def sync_from_project(cfg: Any) -> dict[str, Any]:
    """What a project config says of its weight syncs: with LoRA (actor_rollout_ref.model.lora_rank > 0) no pause
    (an adapter loads beside the versions before it, docs/design.md#rule-one-version-per-lora-sample), and, when
    the model's config.json can be read here, the bytes one sync moves (`ModelShape.sync_bytes`, in the dtype the
    weights travel in: param_sync.dtype, auto = bfloat16 on CUDA, else the trainer's fp32)."""
    rank = int(OmegaConf.select(cfg, "actor_rollout_ref.model.lora_rank", default=0) or 0)
    layer: dict[str, Any] = {"pause_s": 0.0} if rank > 0 else {}
    path = OmegaConf.select(cfg, "actor_rollout_ref.model.path", default=None)
    config_file = Path(str(path)) / "config.json" if path else None
    if config_file is None or not config_file.is_file():
        return layer  # a built-in task's model is made at start; a GPU host's folder may not be here
    try:
        shape = ModelShape.from_hf_config(json.loads(config_file.read_text()))
    except (ValueError, KeyError) as exc:
        raise ScenarioError(f"{config_file}: not a decoder's config.json the sync-bytes model reads ({exc})") from exc
    dtype = str(OmegaConf.select(cfg, "param_sync.dtype", default="auto"))
    if dtype == "auto":
        device = str(OmegaConf.select(cfg, "trainer.device", default="cpu"))
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    targets = tuple(OmegaConf.select(cfg, "engines.lora.target_modules", default=None) or ("all",))
    layer["nbytes"] = float(shape.sync_bytes(DTYPE_BYTES[dtype], rank, targets))
    return layer


def project_timing(device: str, max_response_length: int | None) -> dict[str, Any]:
    """The timing models a project config gets unless simulate.* or --timing set them (module docstring)."""
    layer: dict[str, Any] = copy.deepcopy(CPU_TIMING) if device == "cpu" else {}
    default_mean = LengthModel().mean_tokens
    if max_response_length is not None and max_response_length < 2 * default_mean:
        layer["lengths"] = {"mean_tokens": max(1.0, max_response_length / 2)}
    return layer


def timing_models(cfg: SimConfig) -> str:
    """The timing models in one line, so a prediction from defaults says what it assumed."""
    e, n, t, s = cfg.engine, cfg.lengths, cfg.trainer, cfg.sync
    clip = f", clipped at {n.max_tokens}: {n.mean_after_clip():,.3g} mean after the clip" if n.max_tokens else ""
    hardware = "CPU process" if cfg.host.cores is not None else f"{e.gpus_per_engine} GPU(s)"
    reference = f" at {t.reference_gpus} trainer GPU(s)" if cfg.host.cores is None else ""
    return (
        f"engine {e.peak_tokens_per_s:,.0f} tokens/s saturated ({e.single_tokens_per_s:,.0f} for one request, "
        f"{hardware} each); responses {n.mean_tokens:,.3g} tokens mean (log-normal sigma {n.sigma:g}{clip}); "
        f"trainer {t.fixed_s:g}s + {t.per_token_s * 1e3:g}ms/token{reference}; sync {s.total_s:g}s "
        f"(pause {s.pause_s:g}s{f', {s.nbytes / 1e6:,.4g} MB' if s.nbytes else ''})"
    )


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
