"""Configuration: one YAML file plus `key=value` overrides, validated before any actor starts
(docs/design.md#rule-configuration-is-honest).

Composition, lowest priority first:
1. verl 0.7.1's full `ppo_trainer` defaults (`verl/trainer/config/_generated_ppo_trainer.yaml`), so every verl key
   a user knows (`actor_rollout_ref.actor.optim.lr`, `algorithm.adv_estimator`, `data.max_response_length`, ...)
   means what it means in verl; its `ppo_megatron_trainer` defaults instead when the actor strategy is megatron
   (in any file or override) or a file lists `ppo_megatron_trainer` in `defaults:`, so tensor/pipeline/context-
   parallel keys (`actor_rollout_ref.actor.megatron.*`) are valid;
2. this project's sections, typed dataclasses in `settings/schema.py` (`async_training`, `engines`, `param_sync`,
   `task`, `workflow`, `run`) and a few fully-async defaults for verl keys (`FULLY_ASYNC_VERL_DEFAULTS`);
3. the files named in the YAML's optional `defaults:` list (siblings, without `.yaml`), then the YAML itself;
4. command-line `key=value` overrides.

Then: rLLM's keys are mapped, verl keys nothing reads are refused, a built-in task's own keys set by the user are
refused (tasks/__init__.py), `~` is expanded in every path (settings/paths.py), derived values are filled.

Every merge is in struct mode, so an unknown key is an error; leaves of the verl part are type-checked against
verl's default values, the typed sections by OmegaConf; `validate()` then checks ranges and cross-field rules.
Any problem raises `ConfigError` whose message is one line naming the key and what would fix it.

This module loads and merges; `settings/derive.py` fills derived values, `settings/validate.py` checks them.
"""

from __future__ import annotations

import copy
import difflib
import functools
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from rllm.experimental.fully_async.errors import ConfigError
from rllm.experimental.fully_async.errors import first_line as _first_line
from rllm.experimental.fully_async.settings.derive import resolve_derived
from rllm.experimental.fully_async.settings.paths import expand_config_paths
from rllm.experimental.fully_async.settings.rllm_yaml import apply_rllm_keys, extract_rllm_keys

# The schema is re-exported so that this module stays the one import for configuration.
from rllm.experimental.fully_async.settings.schema import (
    FULLY_ASYNC_VERL_DEFAULTS,
    PROJECT_SECTIONS,
    AsyncTrainingConfig,
    EnginesConfig,
    ParamSyncConfig,
    RunConfig,
    TaskConfig,
    WorkflowConfig,
)
from rllm.experimental.fully_async.settings.validate import refuse_unusable_megatron, validate
from rllm.experimental.fully_async.settings.verl_keys import unread_verl_key_refusals
from rllm.experimental.fully_async.tasks import refuse_user_assets

__all__ = [
    "DEFAULT_CONFIG",
    "FULLY_ASYNC_VERL_DEFAULTS",
    "PROJECT_SECTIONS",
    "REPO_CONFIG_DIR",
    "AsyncTrainingConfig",
    "ConfigError",
    "EnginesConfig",
    "ParamSyncConfig",
    "RunConfig",
    "TaskConfig",
    "WorkflowConfig",
    "base_config",
    "load_config",
    "verl_base_config",
]

logger = logging.getLogger(__name__)

REPO_CONFIG_DIR = Path(__file__).resolve().parents[4] / "config"
DEFAULT_CONFIG = REPO_CONFIG_DIR / "tiny_cpu.yaml"


# --------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------


MEGATRON_BASE = "ppo_megatron_trainer"


def verl_base_config(megatron: bool = False) -> DictConfig:
    """verl 0.7.1's flattened ppo_trainer defaults (`_generated_ppo_trainer.yaml`, shipped in the wheel), or its
    ppo_megatron_trainer defaults (`_generated_ppo_megatron_trainer.yaml`)."""
    return OmegaConf.create(_verl_base_container(f"_generated_{MEGATRON_BASE if megatron else 'ppo_trainer'}.yaml"))


def verl_base_container() -> dict:
    """verl's ppo_trainer defaults as plain values (interpolations as strings); shared, so never change it."""
    return _verl_base_container("_generated_ppo_trainer.yaml")


@functools.cache
def _verl_base_container(name: str) -> dict:
    # Parsing the 700-line YAML takes ~0.3 s; every load_config needs it twice.
    import verl

    path = Path(verl.__file__).parent / "trainer" / "config" / name
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def _fully_async_verl_defaults(megatron: bool) -> dict[str, Any]:
    """FULLY_ASYNC_VERL_DEFAULTS; on the Megatron base the actor is megatron's (no fsdp_config) and the critic's
    FSDP defaults are left out (gae is refused with megatron)."""
    if not megatron:
        return FULLY_ASYNC_VERL_DEFAULTS
    defaults = copy.deepcopy(FULLY_ASYNC_VERL_DEFAULTS)
    actor = defaults["actor_rollout_ref"]["actor"]
    actor["strategy"] = "megatron"
    actor.pop("fsdp_config", None)
    defaults.pop("critic", None)
    return defaults


def base_config(megatron: bool = False) -> DictConfig:
    """verl's defaults (its Megatron ones if `megatron`) plus this project's sections and fully-async defaults,
    before any user file."""
    cfg = verl_base_config(megatron)
    cfg = OmegaConf.merge(cfg, _fully_async_verl_defaults(megatron))
    for name, schema in PROJECT_SECTIONS.items():
        cfg[name] = OmegaConf.structured(schema)
    return cfg


def load_config(
    config_file: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    check_host: bool = True,
    program_layer: DictConfig | None = None,
) -> DictConfig:
    """Compose, merge and validate. Raises ConfigError (one line) on any problem. `check_host=False`: the config
    is for another machine (a GPU cluster being planned), so what this one lacks (CUDA) is not refused.
    `program_layer`: what an rLLM program changed in the config it composed (settings/rllm_program.py), merged
    after the files and before the overrides."""
    path = Path(config_file) if config_file is not None else DEFAULT_CONFIG
    chain = _file_chain(path)
    megatron = _wants_megatron(chain, overrides or [], program_layer)
    if megatron and check_host:
        refuse_unusable_megatron()  # first: on this machine nothing else about the config matters
    cfg = base_config(megatron)
    rllm_keys: dict[str, Any] = {}  # keys of rLLM's fully-async YAML that verl's tree lacks (settings/rllm_yaml.py)
    # Every refused key of the config, named at once: an rLLM launch script sets ~10 (one edit-and-run per key else).
    refused: list[ConfigError] = []
    for layer_path in chain:
        layer = _read_yaml(layer_path)
        extract_rllm_keys(layer, rllm_keys)
        _merge_strict(cfg, layer, origin=str(layer_path), refused=refused)
    if program_layer is not None:
        layer = program_layer.copy()
        extract_rllm_keys(layer, rllm_keys)
        _merge_strict(cfg, layer, origin="the program's config", refused=refused)
    if overrides:
        layer = _parse_overrides(overrides)
        extract_rllm_keys(layer, rllm_keys)
        _merge_strict(cfg, layer, origin="the command line", refused=refused)
    base = base_config(megatron)
    # rLLM's require_batches sizes the step from actor.ppo_mini_batch_size only when required_samples is null
    step_from_mini_batch = "async_training.require_batches" in rllm_keys and cfg.async_training.required_samples is None
    try:
        apply_rllm_keys(cfg, rllm_keys, base)
    except ConfigError as error:  # the mapping stops at its first refusal: the checks below would read half of it
        raise ConfigError.combined([*refused, error]) from error
    # Before derived values: those write verl keys (optim.total_training_steps) the user did not set.
    refused += unread_verl_key_refusals(cfg, base, step_from_mini_batch=step_from_mini_batch)
    try:
        refuse_user_assets(cfg, base)  # a task would replace the user's data or model: refused, never replaced
    except ConfigError as error:
        refused.append(error)
    if refused:
        raise ConfigError.combined(refused)
    expand_config_paths(cfg)  # `~` once, here, so the launcher, the trainer and `plan` read one path
    resolve_derived(cfg)
    validate(cfg, check_host=check_host)
    return cfg


def config_layers(config_file: str | Path | None, overrides: list[str] | None) -> list[tuple[str, DictConfig]]:
    """(origin, layer) in merge order, as `load_config` reads them: the files of the `defaults:` chain, then the
    command line. For `config`, which says where each setting came from."""
    path = Path(config_file) if config_file is not None else DEFAULT_CONFIG
    layers = [(_shown(p), _read_yaml(p)) for p in _file_chain(path)]
    if overrides:
        layers.append(("the command line", _parse_overrides(overrides)))
    return layers


def _shown(path: Path) -> str:
    """A file as the user would write it: relative to the working directory when it is below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _file_chain(path: Path, seen: tuple[Path, ...] = ()) -> list[Path]:
    """The files a YAML composes on (its `defaults:` list, siblings without .yaml), then itself."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (pass --config with an existing YAML file)")
    if path in seen:
        raise ConfigError(f"config file {path} includes itself through `defaults:`")
    layer = _read_yaml(path, keep_defaults=True)
    chain: list[Path] = []
    for parent in layer.get("defaults", []) or []:
        if not isinstance(parent, str):
            raise ConfigError(f"{path}: `defaults:` entries must be sibling config names, got {parent!r}")
        if parent in ("ppo_trainer", MEGATRON_BASE, "_self_"):  # verl's defaults are always the base
            continue
        chain.extend(_file_chain(path.parent / f"{parent}.yaml", (*seen, path)))
    return [*chain, path]


def _wants_megatron(chain: list[Path], overrides: list[str], program_layer: DictConfig | None = None) -> bool:
    """Compose on verl's Megatron defaults? Yes when a file lists ppo_megatron_trainer in `defaults:`, or when the
    last file, program layer or override that sets actor_rollout_ref.actor.strategy sets megatron."""
    strategy = None
    for layer_path in chain:
        layer = _read_yaml(layer_path, keep_defaults=True)
        if MEGATRON_BASE in (layer.get("defaults", []) or []):
            return True  # settings/validate.py then refuses any strategy but megatron on this base
        strategy = OmegaConf.select(layer, "actor_rollout_ref.actor.strategy", default=strategy)
    if program_layer is not None:
        strategy = OmegaConf.select(program_layer, "actor_rollout_ref.actor.strategy", default=strategy)
    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip() == "actor_rollout_ref.actor.strategy":
            strategy = value.strip()
    return strategy == "megatron"


def _read_yaml(path: Path, keep_defaults: bool = False) -> DictConfig:
    try:
        layer = OmegaConf.load(path)
    except Exception as exc:  # yaml.YAMLError and OSError come through here
        raise ConfigError(yaml_error_line(path, exc)) from exc
    if not isinstance(layer, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping of keys, not a {type(layer).__name__}")
    if not keep_defaults and "defaults" in layer:
        layer.pop("defaults")
    return layer


def yaml_error_line(path: Path, exc: BaseException) -> str:
    """One line for a file that did not parse: `FILE:LINE:COLUMN: what` where YAML marks the place (its problem
    mark, else where the construct it was reading started), as compilers write it, so editors can jump there."""
    problem_mark, context_mark = getattr(exc, "problem_mark", None), getattr(exc, "context_mark", None)
    mark = problem_mark or context_mark
    if mark is None:
        return f"config file {path} could not be read: {_first_line(exc)}"
    what = getattr(exc, "problem", None) or _first_line(exc)
    context = getattr(exc, "context", None)
    if context and context_mark is not None and context_mark is not mark:
        what += f" ({context} that starts at {context_mark.line + 1}:{context_mark.column + 1})"
    elif context:
        what += f" ({context})"
    return f"{path}:{mark.line + 1}:{mark.column + 1}: YAML syntax error: {what}"


def _parse_overrides(overrides: list[str]) -> DictConfig:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. trainer.total_training_steps=5)")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"overrides could not be parsed: {str(exc).splitlines()[0]}") from exc


def _merge_strict(cfg: DictConfig, layer: DictConfig, origin: str, refused: list[ConfigError] | None = None) -> None:
    """Merge `layer` into `cfg` in place, refusing keys `cfg` does not have and values of the wrong type.

    The types come from `cfg` as it stands: verl's YAML values (untyped, so checked here by their default's
    type) and this project's dataclass sections (checked by OmegaConf). With `refused`, every refused key is
    appended there and left out of the merge, so the caller names them all at once; else the first one raises.
    """
    # Unknown keys are refused by the walk; struct mode is not used for that because it also refuses keys in the
    # free-form sections (engines.extra_args, verl's engine_kwargs), which the walk admits.
    found: list[tuple[DictConfig, str, ConfigError]] = []
    _check_keys_and_types(cfg, layer, cfg, prefix="", origin=origin, found=found)
    if found and refused is None:
        raise found[0][2]
    for node, key, error in found:
        node.pop(key)
        refused.append(error)  # type: ignore[union-attr]  # None raised above
    try:
        cfg.merge_with(layer)  # in place: OmegaConf.merge deep-copies the 700-key tree (~0.2 s) per layer
    except ValidationError as exc:
        key = getattr(exc, "full_key", None) or "?"
        error = ConfigError(f"{key}: {_first_line(exc)} (set in {origin})")
        raise ConfigError.combined([*(refused or []), error]) from exc
    except ConfigKeyError as exc:  # kept as a safety net: _check_keys_and_types should have caught it
        raise ConfigError(f"unknown key in {origin}: {_first_line(exc)}") from exc


def _check_keys_and_types(
    cfg: Any, layer: Any, verl_defaults: Any, prefix: str, origin: str, found: list[tuple[DictConfig, str, ConfigError]]
) -> None:
    """Append (the layer's node, its key, the refusal) to `found` for each key of `layer` that `cfg` lacks or whose
    value has the wrong type."""
    for key, value in layer.items_ex(resolve=False) if isinstance(layer, DictConfig) else []:
        full = f"{prefix}{key}"
        if key not in cfg:
            # Free-form dicts in verl (e.g. engine_kwargs, override_config) accept any key.
            if isinstance(cfg, DictConfig) and len(cfg) == 0:
                continue
            message = f"unknown key '{full}' in {origin}{_suggest(str(key), cfg, prefix)}"
            found.append((layer, str(key), ConfigError(message, key=full)))
            continue
        current = cfg[key] if not OmegaConf.is_missing(cfg, key) else None
        default = _lookup(verl_defaults, full)
        if isinstance(value, DictConfig):
            if current is not None and not isinstance(current, DictConfig):
                message = f"'{full}' is a single value, not a section (set in {origin})"
                found.append((layer, str(key), ConfigError(message, key=full)))
            elif isinstance(current, DictConfig):
                _check_keys_and_types(current, value, verl_defaults, f"{full}.", origin, found)
            continue
        if default is not _ABSENT:
            try:
                _check_verl_leaf_type(full, default, value, origin)
            except ConfigError as error:
                found.append((layer, str(key), error))


_ABSENT = object()


def _lookup(cfg: DictConfig, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return _ABSENT
        child = node._get_node(part)
        node = child if isinstance(child, DictConfig) else child._value()  # raw: interpolations stay strings
        if isinstance(node, str) and node.startswith("${"):
            return _ABSENT  # interpolated default: any type the target has
    return node


# verl defaults written as integers for settings that are fractions.
_FLOAT_KEYS_WITH_INT_DEFAULTS = frozenset(
    {
        "actor_rollout_ref.rollout.top_p",
        "actor_rollout_ref.actor.entropy_coeff",  # verl writes 0; its dataclass field is a float
        "actor_rollout_ref.rollout.val_kwargs.top_p",
        "actor_rollout_ref.rollout.val_kwargs.temperature",
        "actor_rollout_ref.model.lora_alpha",  # peft's LoraConfig takes any number
    }
)
# verl defaults written as a string for settings that are a string or a list (peft's LoraConfig target_modules:
# "all-linear" or module names).
_STR_OR_LIST_KEYS = frozenset({"actor_rollout_ref.model.target_modules"})


def _check_verl_leaf_type(key: str, default: Any, value: Any, origin: str) -> None:
    """verl's YAML is untyped; use its default value's type as the schema (None or ??? accepts anything)."""
    if default is None or default == "???" or value is None:
        return
    if key in _FLOAT_KEYS_WITH_INT_DEFAULTS:
        default = float(default)
    if isinstance(value, str) and value.startswith("${"):
        return
    expected: tuple[type, ...]
    if isinstance(default, bool):
        expected = (bool,)
    elif isinstance(default, int):
        expected = (int,)
    elif isinstance(default, float):
        expected = (int, float)
    elif isinstance(default, str):
        expected = (str, list, ListConfig) if key in _STR_OR_LIST_KEYS else (str,)
    elif isinstance(default, (list, ListConfig)):
        expected = (list, ListConfig)
    else:
        return
    ok = isinstance(value, expected) and not (isinstance(value, bool) and bool not in expected)
    if not ok:
        raise ConfigError(
            f"'{key}' must be {_type_name(expected)}, got {value!r} ({type(value).__name__}) in {origin}", key=key
        )


def _type_name(expected: tuple[type, ...]) -> str:
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string", list: "a list"}
    return " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in expected if t is not ListConfig))


def _suggest(key: str, cfg: Any, prefix: str) -> str:
    if not isinstance(cfg, DictConfig):
        return ""
    close = difflib.get_close_matches(key, [str(k) for k in cfg], n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{prefix}{close[0]}'?)"
    return f" (keys here: {', '.join(sorted(str(k) for k in cfg)[:12])})"
