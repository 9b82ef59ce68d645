"""Configuration: one YAML file plus `key=value` overrides, validated before any actor starts (DESIGN rule 9).

Composition, lowest priority first:
1. verl 0.7.1's full `ppo_trainer` defaults (`verl/trainer/config/_generated_ppo_trainer.yaml`), so every verl key
   a user knows (`actor_rollout_ref.actor.optim.lr`, `algorithm.adv_estimator`, `data.max_response_length`, ...)
   means what it means in verl;
2. this project's sections, typed dataclasses in `settings/schema.py` (`async_training`, `engines`, `param_sync`,
   `task`, `workflow`, `run`) and a few fully-async defaults for verl keys (`FULLY_ASYNC_VERL_DEFAULTS`);
3. the files named in the YAML's optional `defaults:` list (siblings, without `.yaml`), then the YAML itself;
4. command-line `key=value` overrides.

Every merge is in struct mode, so an unknown key is an error; leaves of the verl part are type-checked against
verl's default values, the typed sections by OmegaConf; `validate()` then checks ranges and cross-field rules.
Any problem raises `ConfigError` whose message is one line naming the key and what would fix it.
"""

from __future__ import annotations

import difflib
import functools
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

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
from rllm.experimental.fully_async.tasks import task_names, unknown_task_message

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
    "resolve_derived",
    "validate",
    "verl_base_config",
]

logger = logging.getLogger(__name__)

REPO_CONFIG_DIR = Path(__file__).resolve().parents[4] / "config"
DEFAULT_CONFIG = REPO_CONFIG_DIR / "tiny_cpu.yaml"


class ConfigError(ValueError):
    """A configuration problem; `str(error)` is one line that names the key and how to fix it."""


# --------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------


def verl_base_config() -> DictConfig:
    """verl 0.7.1's flattened ppo_trainer defaults (`_generated_ppo_trainer.yaml`, shipped in the wheel)."""
    return OmegaConf.create(_verl_base_container())


@functools.cache
def _verl_base_container() -> dict:
    # Parsing the 700-line YAML takes ~0.3 s; every load_config needs it twice.
    import verl

    path = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def base_config() -> DictConfig:
    """verl's defaults plus this project's sections and fully-async defaults, before any user file."""
    cfg = verl_base_config()
    cfg = OmegaConf.merge(cfg, FULLY_ASYNC_VERL_DEFAULTS)
    for name, schema in PROJECT_SECTIONS.items():
        cfg[name] = OmegaConf.structured(schema)
    return cfg


def load_config(config_file: str | Path | None = None, overrides: list[str] | None = None) -> DictConfig:
    """Compose, merge and validate. Raises ConfigError (one line) on any problem."""
    cfg = base_config()
    path = Path(config_file) if config_file is not None else DEFAULT_CONFIG
    for layer_path in _file_chain(path):
        layer = _read_yaml(layer_path)
        _merge_strict(cfg, layer, origin=str(layer_path))
    if overrides:
        _merge_strict(cfg, _parse_overrides(overrides), origin="the command line")
    resolve_derived(cfg)
    validate(cfg)
    return cfg


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
        if parent in ("ppo_trainer", "_self_"):  # verl's defaults are always the base
            continue
        chain.extend(_file_chain(path.parent / f"{parent}.yaml", (*seen, path)))
    return [*chain, path]


def _read_yaml(path: Path, keep_defaults: bool = False) -> DictConfig:
    try:
        layer = OmegaConf.load(path)
    except Exception as exc:  # yaml.YAMLError and OSError come through here
        raise ConfigError(f"config file {path} could not be read: {str(exc).splitlines()[0]}") from exc
    if not isinstance(layer, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping of keys, not a {type(layer).__name__}")
    if not keep_defaults and "defaults" in layer:
        layer.pop("defaults")
    return layer


def _parse_overrides(overrides: list[str]) -> DictConfig:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. trainer.total_training_steps=5)")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"overrides could not be parsed: {str(exc).splitlines()[0]}") from exc


def _merge_strict(cfg: DictConfig, layer: DictConfig, origin: str) -> None:
    """Merge `layer` into `cfg` in place, refusing keys `cfg` does not have and values of the wrong type.

    The types come from `cfg` as it stands: verl's YAML values (untyped, so checked here by their default's
    type) and this project's dataclass sections (checked by OmegaConf).
    """
    _check_keys_and_types(cfg, layer, cfg, prefix="", origin=origin)
    OmegaConf.set_struct(cfg, True)
    try:
        cfg.merge_with(layer)  # in place: OmegaConf.merge deep-copies the 700-key tree (~0.2 s) per layer
    except ValidationError as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(f"{key}: {_first_line(exc)} (set in {origin})") from exc
    except ConfigKeyError as exc:  # kept as a safety net: _check_keys_and_types should have caught it
        raise ConfigError(f"unknown key in {origin}: {_first_line(exc)}") from exc
    finally:
        OmegaConf.set_struct(cfg, False)


def _check_keys_and_types(cfg: Any, layer: Any, verl_defaults: Any, prefix: str, origin: str) -> None:
    for key, value in layer.items_ex(resolve=False) if isinstance(layer, DictConfig) else []:
        full = f"{prefix}{key}"
        if key not in cfg:
            # Free-form dicts in verl (e.g. engine_kwargs, override_config) accept any key.
            if isinstance(cfg, DictConfig) and len(cfg) == 0:
                continue
            raise ConfigError(f"unknown key '{full}' in {origin}{_suggest(str(key), cfg, prefix)}")
        current = cfg[key] if not OmegaConf.is_missing(cfg, key) else None
        default = _lookup(verl_defaults, full)
        if isinstance(value, DictConfig):
            if current is not None and not isinstance(current, DictConfig):
                raise ConfigError(f"'{full}' is a single value, not a section (set in {origin})")
            if isinstance(current, DictConfig):
                _check_keys_and_types(current, value, verl_defaults, prefix=f"{full}.", origin=origin)
            continue
        if default is not _ABSENT:
            _check_verl_leaf_type(full, default, value, origin)


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


def _check_verl_leaf_type(key: str, default: Any, value: Any, origin: str) -> None:
    """verl's YAML is untyped; use its default value's type as the schema (None or ??? accepts anything)."""
    if default is None or default == "???" or value is None:
        return
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
        expected = (str,)
    elif isinstance(default, (list, ListConfig)):
        expected = (list, ListConfig)
    else:
        return
    ok = isinstance(value, expected) and not (isinstance(value, bool) and bool not in expected)
    if not ok:
        raise ConfigError(f"'{key}' must be {_type_name(expected)}, got {value!r} ({type(value).__name__}) in {origin}")


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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# --------------------------------------------------------------------------------------------------------------
# Derived values and validation
# --------------------------------------------------------------------------------------------------------------


def resolve_derived(cfg: DictConfig) -> None:
    """Fill the `null` settings whose value follows from others (documented on each field)."""
    from rllm.experimental.fully_async.core.staleness import map_rllm_async_keys

    at = cfg.async_training
    if at.required_samples is None:
        at.required_samples = int(cfg.data.train_batch_size)
    if at.max_staleness is None:
        rllm_keys = {
            "staleness_threshold": at.staleness_threshold if at.staleness_threshold is not None else 0.1,
            "trigger_parameter_sync_step": at.trigger_parameter_sync_step,
            "required_samples": at.required_samples,
        }
        try:
            mapped = map_rllm_async_keys(rllm_keys)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        # map_rllm_async_keys counts staleness in optimizer steps; this project's versions advance once per
        # sync (every K steps), so eta_versions = floor((eta_steps + 1) / K) - 1 = floor(M / (R K)) - 1.
        k = at.trigger_parameter_sync_step
        at.max_staleness = max(0, (mapped.max_staleness + 1) // k - 1)
    if at.compute_prox_log_prob and cfg.algorithm.off_policy_correction is None:
        # rLLM's compute_prox_log_prob means decoupled PPO with recomputed proximal log-probs (AReaL).
        cfg.algorithm.off_policy_correction = {"mode": "decoupled", "prox_log_probs": "recompute"}
    n = int(cfg.actor_rollout_ref.rollout.n)
    if at.max_concurrent_rollouts is None:
        at.max_concurrent_rollouts = 2 * at.required_samples * n
    if at.queue_max_groups is None:
        at.queue_max_groups = (at.max_staleness + 2) * at.required_samples
    for optim in (cfg.actor_rollout_ref.actor.optim, cfg.critic.optim):
        if optim.total_training_steps in (None, -1) and cfg.trainer.total_training_steps is not None:
            # As verl's workers do at start-up: the LR schedule (cosine) spans the run's optimizer steps.
            optim.total_training_steps = int(cfg.trainer.total_training_steps)
    if cfg.run.dir is None:
        cfg.run.dir = str(Path("runs") / str(cfg.trainer.experiment_name))
    if cfg.param_sync.weights_dir is None:
        cfg.param_sync.weights_dir = str(Path(cfg.run.dir) / "weights")


_CHOICES: dict[str, tuple[str, ...]] = {
    "engines.backend": ("embedded", "sglang"),
    "engines.dtype": ("float32", "bfloat16"),
    "engines.on_engine_failure": ("restart", "continue", "stop"),
    "param_sync.transport": ("disk", "nccl"),
    "param_sync.dtype": ("auto", "float32", "bfloat16"),
    "actor_rollout_ref.rollout.name": ("embedded", "sglang"),
    "actor_rollout_ref.actor.loss_agg_mode": (
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ),
    "data.truncation": ("error", "left", "right"),
    "trainer.resume_mode": ("auto", "disable", "resume_path"),
}

# key -> (minimum, strict): value must be > minimum (strict) or >= minimum.
_LOWER_BOUNDS: dict[str, tuple[float, bool]] = {
    "async_training.max_staleness": (0, False),
    "async_training.trigger_parameter_sync_step": (1, False),
    "async_training.required_samples": (1, False),
    "async_training.max_concurrent_rollouts": (1, False),
    "async_training.queue_max_groups": (1, False),
    "async_training.queue_get_timeout_s": (0, True),
    "engines.num_engines": (1, False),
    "engines.max_running_requests": (1, False),
    "engines.startup_timeout_s": (0, True),
    "engines.request_timeout_s": (0, True),
    "engines.torch_threads": (1, False),
    "engines.max_restarts": (0, False),
    "param_sync.timeout_s": (0, True),
    "workflow.reward_timeout_s": (0, True),
    "task.warmup_steps": (0, False),
    "task.val_size": (1, False),
    "actor_rollout_ref.rollout.n": (1, False),
    "actor_rollout_ref.rollout.temperature": (0, False),
    "actor_rollout_ref.actor.optim.lr": (0, True),
    "actor_rollout_ref.actor.clip_ratio": (0, True),
    "actor_rollout_ref.actor.grad_clip": (0, True),
    "data.max_prompt_length": (1, False),
    "data.max_response_length": (1, False),
    "data.train_batch_size": (1, False),
}


def validate(cfg: DictConfig) -> None:
    """Ranges, choices and cross-field rules, each failure one line naming the key."""
    for key, choices in _CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in choices:
            raise ConfigError(f"'{key}' must be one of {', '.join(choices)}; got {value!r}")
    for key, (minimum, strict) in _LOWER_BOUNDS.items():
        value = OmegaConf.select(cfg, key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"'{key}' must be a number, got {value!r}")
        if value < minimum or (strict and value == minimum):
            relation = ">" if strict else ">="
            raise ConfigError(f"'{key}' must be {relation} {minimum}, got {value!r}")
    top_p = OmegaConf.select(cfg, "actor_rollout_ref.rollout.top_p")
    if not 0 < float(top_p) <= 1:
        raise ConfigError(f"'actor_rollout_ref.rollout.top_p' must be in (0, 1], got {top_p!r}")

    _validate_algorithm(cfg)
    _validate_cross_fields(cfg)


def _validate_algorithm(cfg: DictConfig) -> None:
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    from rllm.experimental.fully_async.algorithms.advantages import SUPPORTED_ESTIMATORS, AdvantageConfig
    from rllm.experimental.fully_async.algorithms.corrections import build_correction
    from rllm.experimental.fully_async.algorithms.filters import build_group_filter

    estimator = cfg.algorithm.adv_estimator
    if estimator not in SUPPORTED_ESTIMATORS:
        raise ConfigError(
            f"'algorithm.adv_estimator' must be one of {', '.join(sorted(SUPPORTED_ESTIMATORS))}; got {estimator!r}"
        )
    if estimator == "gae":
        from rllm.experimental.fully_async.backends.critic import validate_critic_section

        try:
            validate_critic_section(cfg.critic)
        except ValueError as exc:
            raise ConfigError(_first_line(exc)) from exc
        if int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes) != 1:
            raise ConfigError(
                "'trainer.n_gpus_per_node' x 'trainer.nnodes' must be 1 with algorithm.adv_estimator=gae "
                "(verl's critic is unpatched: its loss is not proven correct across ranks)"
            )
    # The algorithm sections validate themselves when built; their errors name the key.
    built = {}
    for build in (AdvantageConfig.from_config, build_correction, build_group_filter):
        try:
            built[build] = build(cfg)
        except (ValueError, TypeError) as exc:
            raise ConfigError(_first_line(exc)) from exc
    loss_mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    correction = built[build_correction]
    if correction is not None and correction.policy_loss_mode is not None and loss_mode != "vanilla":
        raise ConfigError(
            "'actor_rollout_ref.actor.policy_loss.loss_mode' must be 'vanilla' with algorithm.off_policy_correction"
            f".prox_log_probs=loglinear (its decoupled loss replaces it); got {loss_mode!r}"
        )
    if loss_mode not in POLICY_LOSS_REGISTRY:
        raise ConfigError(
            "'actor_rollout_ref.actor.policy_loss.loss_mode' must be one of "
            f"{', '.join(sorted(POLICY_LOSS_REGISTRY))}; got {loss_mode!r}"
        )
    group_estimators = {"grpo", "rloo", "reinforce_plus_plus_baseline", "gigpo", "grpo_passk", "opo"}
    if estimator in group_estimators and cfg.actor_rollout_ref.rollout.n < 2:
        raise ConfigError(
            f"'actor_rollout_ref.rollout.n' must be >= 2 for the group-relative estimator '{estimator}' "
            "(set actor_rollout_ref.rollout.n=8, or algorithm.adv_estimator=reinforce_plus_plus)"
        )


def _validate_cross_fields(cfg: DictConfig) -> None:
    at = cfg.async_training
    actor = cfg.actor_rollout_ref.actor
    if actor.use_kl_loss:
        raise ConfigError(
            "'actor_rollout_ref.actor.use_kl_loss' needs a reference model, which the fully-async trainer "
            "does not run; set it to false"
        )
    if actor.ppo_epochs != 1:
        raise ConfigError(
            "'actor_rollout_ref.actor.ppo_epochs' must be 1: the fully-async trainer makes exactly one optimizer "
            "step per batch (raise async_training.required_samples for larger steps)"
        )
    if cfg.engines.backend != cfg.actor_rollout_ref.rollout.name:
        raise ConfigError(
            f"'engines.backend' ({cfg.engines.backend}) and 'actor_rollout_ref.rollout.name' "
            f"({cfg.actor_rollout_ref.rollout.name}) disagree; set both to the same engine"
        )
    if cfg.param_sync.transport == "nccl" and cfg.engines.backend != "sglang":
        raise ConfigError("'param_sync.transport=nccl' needs engines.backend=sglang on GPUs; use transport=disk")
    micro = actor.ppo_micro_batch_size_per_gpu
    if not actor.use_dynamic_bsz and (micro is None or micro < 1):
        raise ConfigError(
            "'actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu' must be >= 1 "
            "(or set actor_rollout_ref.actor.use_dynamic_bsz=true)"
        )
    world = int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes)
    samples = at.required_samples * int(cfg.actor_rollout_ref.rollout.n)
    if samples % world:
        raise ConfigError(
            f"'async_training.required_samples' x 'actor_rollout_ref.rollout.n' = {samples} samples per step "
            f"cannot be split across {world} trainer ranks (trainer.n_gpus_per_node x trainer.nnodes); "
            "choose sizes that divide"
        )
    if at.max_concurrent_rollouts < int(cfg.actor_rollout_ref.rollout.n):
        raise ConfigError(
            "'async_training.max_concurrent_rollouts' must be >= actor_rollout_ref.rollout.n "
            f"({cfg.actor_rollout_ref.rollout.n}) so one prompt group can run"
        )
    if at.queue_max_groups < at.required_samples:
        raise ConfigError(
            f"'async_training.queue_max_groups' ({at.queue_max_groups}) must be >= "
            f"async_training.required_samples ({at.required_samples}) or the trainer can never get a batch"
        )
    if at.use_rollout_log_probs and at.compute_prox_log_prob and at.max_staleness == 0:
        logger.info("compute_prox_log_prob with max_staleness=0: proximal and behaviour policies coincide")
    if cfg.task.name is None:
        for key in ("data.train_files", "actor_rollout_ref.model.path"):
            if not OmegaConf.select(cfg, key):
                raise ConfigError(f"'{key}' must be set when task.name is null (or set task.name=addition)")
    elif cfg.task.name not in task_names():
        raise ConfigError(unknown_task_message(cfg.task.name))
    total = cfg.trainer.total_training_steps
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 1):
        raise ConfigError(f"'trainer.total_training_steps' must be a positive integer or null, got {total!r}")
