"""The config an rLLM program composed, turned into this project's validated config.

An rLLM fully-async program composes its config with hydra from rLLM's config package
(`pkg://rllm.experimental.fully_async.config`, `fully_async_ppo_trainer`: verl's ppo_trainer plus rLLM's keys,
shipped here at rLLM's path), applies its command line, and hands the tree to `runner.AsyncAgentTrainer`. That tree
holds every default, so what the program chose is what differs from them:

1. the baseline is what composing the package alone gives: verl's ppo_trainer defaults (`_generated_ppo_trainer.yaml`,
   which verl generates from the same composition) plus the package's YAML;
2. the program's layer is every leaf that differs from the baseline, every key its hydra command line named (a value
   set equal to a default is still a choice: `HydraConfig` lists them when the program runs under `@hydra.main`), and
   every key it added (`+key=value`) that this project knows;
3. `load_config(the package's YAML, program_layer=...)` composes that on this project's defaults, maps rLLM's keys
   and refuses what cannot be honoured, one line each, exactly as for a YAML file (settings/rllm_yaml.py).

A key the program leaves at verl's default therefore gets this project's default (`trainer.device=cpu`, the embedded
engine, `actor.strategy=fsdp2`, ...: settings/schema.py FULLY_ASYNC_VERL_DEFAULTS), as in any config here.

Keys the program added that no tree knows are the program's own: rLLM's DAPO example passes
`+reward_model.reward_kwargs.overlong_buffer_cfg.*` and reads them itself in `main`. Neither rLLM's trainer nor this
one reads them; one warning line names them. `model_engine` is verl's defaults-list choice (`dp`: its FSDP actor):
`dp` is what this trainer composes on, another choice is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from rllm.experimental.fully_async.api.rollout_functions import RUNNER_WORKFLOW
from rllm.experimental.fully_async.errors import ConfigError
from rllm.experimental.fully_async.settings.loader import load_config, verl_base_container
from rllm.experimental.fully_async.settings.rllm_yaml import RLLM_ONLY_KEYS
from rllm.experimental.fully_async.settings.schema import FULLY_ASYNC_VERL_DEFAULTS, PROJECT_SECTIONS

logger = logging.getLogger(__name__)

SHIPPED_CONFIG = Path(__file__).resolve().parents[1] / "config" / "fully_async_ppo_trainer.yaml"


def program_config(
    composed: DictConfig,
    *,
    dataset_name: str | None = None,
    batched_datum: bool = False,
    check_host: bool = True,
) -> DictConfig:
    """This project's validated config for `composed` (module docstring), run by the rollout function the runner
    holds (workflow.name=rllm_runner). `dataset_name`: AsyncAgentTrainer's argument (rLLM's DAPO example), the same
    as async_training.dataset_name. `batched_datum`: the program uses rLLM's older signature whose datum was verl's
    collated batch of one (workflow.rllm_batched, unless the program sets it)."""
    if not isinstance(composed, DictConfig):
        raise ConfigError(
            f"AsyncAgentTrainer's config must be the DictConfig hydra composed, got {type(composed).__name__}"
        )
    layer, own = program_layer(composed, explicit_command_line_keys())
    if own:
        logger.warning("left to the program, not read by the trainer (keys it added): %s", ", ".join(own))
    _check_model_engine(layer)
    for key in ("workflow.name", "workflow.path"):
        if key in layer:
            raise ConfigError(f"'{key}': AsyncAgentTrainer's rollout_fn is the workflow; remove it")
    layer["workflow.name"] = RUNNER_WORKFLOW
    if dataset_name is not None:
        named = layer.get("async_training.dataset_name", layer.get("data.train_dataset_name"))
        if named is not None and named != dataset_name:
            raise ConfigError(
                f"AsyncAgentTrainer(dataset_name={dataset_name!r}) and the config's dataset name ({named!r}) differ; "
                "keep one"
            )
        layer["async_training.dataset_name"] = dataset_name
    if batched_datum:
        layer.setdefault("workflow.rllm_batched", True)
    named_data = any(layer.get(k) is not None for k in ("async_training.dataset_name", "data.train_dataset_name"))
    if not named_data and "data.train_files" not in layer:
        raise ConfigError(
            "no training data: set data.train_dataset_name=NAME (registered with rllm.data.DatasetRegistry, or a "
            "parquet path) or data.train_files (verl RL-format parquet)"
        )
    tree = OmegaConf.create()
    for key, value in layer.items():
        OmegaConf.update(tree, key, value, force_add=True)
    return load_config(SHIPPED_CONFIG, program_layer=tree, check_host=check_host)


def program_layer(composed: DictConfig, explicit: set[str] = frozenset()) -> tuple[dict[str, Any], list[str]]:
    """({dotted key: raw value} the program chose, [keys it added that no tree knows]) (module docstring)."""
    baseline, project = _baseline_leaves(), _project_tree()
    layer: dict[str, Any] = {}
    own: list[str] = []
    for key, value in _leaves(composed, ""):
        named = any(key == e or key.startswith(e + ".") for e in explicit)
        if key not in baseline:
            if _known(key, project):
                layer[key] = value
            else:
                own.append(key)
        elif value != baseline[key] or named:
            layer[key] = value
    return layer, own


def explicit_command_line_keys() -> set[str]:
    """The keys named on a hydra command line (`key=v`, `+key=v`, `++key=v`), when running under `@hydra.main`."""
    try:
        # optional: hydra comes with verl, not with this package
        from hydra.core.hydra_config import HydraConfig
    except ImportError:  # without hydra there is no hydra command line to read
        return set()
    if not HydraConfig.initialized():
        return set()
    return {item.split("=", 1)[0].lstrip("+~") for item in HydraConfig.get().overrides.task}


@functools.cache
def _baseline_leaves() -> dict[str, Any]:
    """{dotted key: raw value} of what composing the package alone gives: verl's generated ppo_trainer defaults
    and the package's YAML (plain values: comparing against OmegaConf trees costs seconds per call)."""
    body = OmegaConf.to_container(OmegaConf.load(SHIPPED_CONFIG), resolve=False)
    for key in ("defaults", "hydra"):
        body.pop(key, None)
    return dict(_flatten(_deep_merge(verl_base_container(), body), ""))


@functools.cache
def _project_tree() -> dict[str, Any]:
    """This project's defaults as plain values: verl's, its fully-async defaults and its sections."""
    sections = {name: dataclasses.asdict(schema()) for name, schema in PROJECT_SECTIONS.items()}
    return _deep_merge(_deep_merge(verl_base_container(), FULLY_ASYNC_VERL_DEFAULTS), sections)


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and value:
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _flatten(tree: dict[str, Any], prefix: str):
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _leaves(node: DictConfig, prefix: str):
    """(dotted key, raw value) for every leaf of `node` (an empty section is a leaf); interpolations stay strings."""
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig) and len(child):
            yield from _leaves(child, f"{prefix}{key}.")
        elif isinstance(child, (DictConfig, ListConfig)):
            yield f"{prefix}{key}", OmegaConf.to_container(child, resolve=False)
        else:
            yield f"{prefix}{key}", child._value()


def _known(key: str, project: dict[str, Any]) -> bool:
    """A key this project or rLLM's config defines: present in this project's defaults, one of rLLM's, or under a
    free-form (empty) or null section of the defaults (verl's engine_kwargs, this project's engines.extra_args)."""
    section, _, leaf = key.rpartition(".")
    if leaf in RLLM_ONLY_KEYS.get(section, ()) or key == "model_engine":
        return True
    node: Any = project
    for part in key.split("."):
        if node is None or node == {}:
            return True
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _check_model_engine(layer: dict[str, Any]) -> None:
    choice = layer.pop("model_engine", "dp")
    if choice != "dp":
        raise ConfigError(
            f"'model_engine={choice}': this trainer composes verl's dp (FSDP) actor; for Megatron set "
            "actor_rollout_ref.actor.strategy=megatron"
        )
