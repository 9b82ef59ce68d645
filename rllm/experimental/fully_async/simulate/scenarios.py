"""Settings for a simulation from a project config or a scenario file; the modes; the rollout:trainer GPU sweep.

Two kinds of input (the CLI reads the file; everything here takes parsed mappings):
- a project config (loaded by `settings.load_config`): its pipeline keys are read by `pipeline_from_project`
  (async_training.*, actor_rollout_ref.rollout.n, engines.num_engines / max_running_requests,
  data.max_response_length, trainer.total_training_steps); timing models come from `simulate.*=` overrides;
- a scenario file (`config/simulate/*.yaml`), standalone, with these top-level keys and nothing else:
      description: free text
      simulate:    a SimConfig (model.py): pipeline, engine, lengths, trainer, sync, steps, seed, ...
      published:   optional: measured figures to compare with (see `published.py`)
  Unknown keys anywhere are refused with one line (OmegaConf structured merge).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rllm.experimental.fully_async.errors import EXIT_BAD_INPUT, FullyAsyncError
from rllm.experimental.fully_async.simulate.model import SimConfig, check

SCENARIO_KEYS = frozenset({"description", "simulate", "published"})


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
    """`simulate.a.b=v` items -> a nested mapping {a: {b: v}} (values parsed as YAML)."""
    try:
        dotlist = OmegaConf.from_dotlist([item.removeprefix("simulate.") for item in overrides])
    except OmegaConfBaseException as exc:
        raise ScenarioError(f"bad override: {_first_line(exc)}") from exc
    return OmegaConf.to_container(dotlist)  # type: ignore[return-value]


def read_scenario(raw: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(simulate block, published block) of a parsed scenario file; refuses unknown top-level keys."""
    unknown = sorted(set(raw) - SCENARIO_KEYS)
    if unknown:
        raise ScenarioError(f"unknown scenario key {unknown[0]!r} (allowed: {', '.join(sorted(SCENARIO_KEYS))})")
    return dict(raw.get("simulate") or {}), dict(raw.get("published") or {})


def pipeline_from_project(cfg: Any) -> dict[str, Any]:
    """A project config (DictConfig from load_config, or a run's saved config.yaml) -> simulate-block defaults."""
    at = cfg.async_training
    adaptive = OmegaConf.select(cfg, "async_training.adaptive_staleness", default=None)  # older runs lack it
    adaptive_block = {k: v for k, v in OmegaConf.to_container(adaptive).items()} if adaptive is not None else {}
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
        },
        "engine": {"max_running_requests": int(cfg.engines.max_running_requests)},
        "lengths": {"max_tokens": int(cfg.data.max_response_length)},
        "steps": int(cfg.trainer.total_training_steps or 20),
    }


def host_from_project(cfg: Any, cores: float | None) -> dict[str, Any]:
    """A CPU run (trainer.device=cpu, embedded engines) shares `cores` between engines and trainer: the simulate
    `host` block for it (engine_demand = engines.torch_threads; 0, torch's default, uses every core); else {}."""
    device = OmegaConf.select(cfg, "trainer.device", default=None)
    backend = OmegaConf.select(cfg, "engines.backend", default=None)
    if device != "cpu" or backend != "embedded" or cores is None:
        return {}
    threads = int(OmegaConf.select(cfg, "engines.torch_threads", default=1) or 0)
    return {"host": {"cores": float(cores), "engine_demand": float(threads if threads > 0 else cores)}}


def timing_models(cfg: SimConfig) -> str:
    """The timing models in one line, so a prediction from defaults says what it assumed."""
    e, n, t, s = cfg.engine, cfg.lengths, cfg.trainer, cfg.sync
    clip = f", max {n.max_tokens}" if n.max_tokens else ""
    return (
        f"engine {e.peak_tokens_per_s:,.0f} tokens/s saturated ({e.single_tokens_per_s:,.0f} for one request, "
        f"{e.gpus_per_engine} GPU(s) each); responses {n.mean_tokens:,.0f} tokens mean (log-normal sigma {n.sigma:g}"
        f"{clip}); trainer {t.fixed_s:g}s + {t.per_token_s * 1e3:g}ms/token; sync {s.total_s:g}s (pause {s.pause_s:g}s)"
    )


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
