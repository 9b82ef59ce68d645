"""A YAML written for rLLM's fully-async module (`rllm/experimental/fully_async/config/*.yaml`) loads here.

rLLM's files hold keys that verl 0.7.1's tree lacks (its own `async_training` extras, a top-level `rollout`
section, `data.gen_batch_size`, ...). `extract_rllm_keys` takes them out of each layer before the strict merge (which
would call them unknown); `apply_rllm_keys` then maps each onto this project's key, or refuses it with one line
naming the nearest equivalent. The table (rLLM key -> here), with rLLM's defaults in brackets:

    async_training.require_batches [1]      verl's step size: required_samples = actor.ppo_mini_batch_size x it,
                                            used when async_training.required_samples is null; with
                                            required_samples set only 1 is accepted (required_samples wins, as
                                            in rLLM's trainer)
    async_training.use_trainer_do_validate  false: validation runs on the rollout engines, as here; true: refused
    async_training.checkpoint_engine.*      enable=false accepted; enable=true and its buffer options refused:
                                            weights move by param_sync.transport
    rollout.n [4]                           actor_rollout_ref.rollout.n (rLLM's executor reads that one; the
                                            shipped config links the two: ${actor_rollout_ref.rollout.n})
    rollout.nnodes [1], n_gpus_per_node [8] engines.num_engines = n_gpus_per_node / rollout.tensor_model_parallel_size
                                            (sglang; placed with the trainer over trainer.nnodes); null (the
                                            shipped config's): engines.num_engines decides
    rollout.total_rollout_steps [100]       trainer.total_training_steps = ceil(it / required_samples)
    rollout.total_epochs [10]               trainer.total_epochs
    rollout.test_freq [1] (per weight sync) trainer.test_freq = it x trigger_parameter_sync_step (optimizer steps)
    rollout.rejection_sample [false]        true: algorithm.group_filter.drop_zero_variance=true
    data.gen_batch_size [1]                 1 accepted (one prompt per group); other values refused
    data.train_dataset_name [null], train_split [train]
    async_training.dataset_name (rLLM's DAPO example: split "train")
                                            data.train_files = the registered split's file (rllm.data.DatasetRegistry,
                                            under $RLLM_HOME/datasets), or the name itself when it is a data file;
                                            workflow.rllm_rows = true (each row given to the rollout function as
                                            stored, as rLLM's executor does); without a val_dataset_name, and
                                            data.val_files unset, no validation (rLLM's rule)
    data.val_dataset_name [null], val_split [test]
                                            data.val_files likewise
    actor_rollout_ref.checkpoint_engine     rLLM's interpolation of async_training.checkpoint_engine: dropped
    actor_rollout_ref.actor.use_rollout_log_probs
                                            async_training.use_rollout_log_probs (rLLM's interpolation dropped)
    hydra.searchpath [pkg://verl.trainer.config]
                                            accepted: verl's ppo_trainer is always the base
verl keys rLLM's files set (`hybrid_engine: false`, `rollout.mode: async`, `rollout.calculate_log_probs: true`,
`actor.strategy: fsdp2`, `data.train_batch_size: 0`) are verl's and are checked in `settings/verl_keys.py`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from rllm.experimental.fully_async.errors import ConfigError

# (section, key) pairs rLLM's YAML may set that verl 0.7.1's tree lacks.
RLLM_ONLY_KEYS: dict[str, tuple[str, ...]] = {
    "async_training": ("require_batches", "use_trainer_do_validate", "checkpoint_engine", "dataset_name"),
    "rollout": (
        "n",
        "nnodes",
        "n_gpus_per_node",
        "total_rollout_steps",
        "total_epochs",
        "test_freq",
        "rejection_sample",
    ),
    "data": ("gen_batch_size", "train_dataset_name", "val_dataset_name", "train_split", "val_split"),
    "actor_rollout_ref": ("checkpoint_engine",),
    "actor_rollout_ref.actor": ("use_rollout_log_probs",),
    "hydra": ("searchpath",),
}
_VERL_SEARCHPATH = ["pkg://verl.trainer.config"]
_CHECKPOINT_ENGINE_DEFAULTS = {"enable": False, "device_buffer_size_M": 4096, "overlap_broadcast_and_consume": False}


def extract_rllm_keys(layer: DictConfig, found: dict[str, Any]) -> None:
    """Move rLLM-only keys out of `layer` (in place) into `found` ({dotted key: raw value}; later layers win)."""
    for section, keys in RLLM_ONLY_KEYS.items():
        node = OmegaConf.select(layer, section, default=None)
        if not isinstance(node, DictConfig):
            continue
        with open_dict(node):
            for key in keys:
                if key in node:
                    value = node._get_node(key)
                    if isinstance(value, (DictConfig, ListConfig)):
                        found[f"{section}.{key}"] = OmegaConf.to_container(value, resolve=False)
                    else:  # raw: rLLM's interpolations stay strings
                        found[f"{section}.{key}"] = value._value()
                    del node[key]  # no pop: it would resolve an interpolation the layer cannot
    for section in ("rollout", "hydra"):  # sections verl lacks: drop once emptied
        if section in layer and isinstance(layer[section], DictConfig):
            if len(layer[section]) == 0:
                with open_dict(layer):
                    layer.pop(section)
            else:
                extra = sorted(str(k) for k in layer[section])[0]
                raise ConfigError(
                    f"'{section}.{extra}' is not a key of rLLM's `{section}` section nor of this project's "
                    f"(rLLM's are: {', '.join(RLLM_ONLY_KEYS[section])})"
                )


def apply_rllm_keys(cfg: DictConfig, found: dict[str, Any], base: DictConfig) -> None:
    """Map the extracted rLLM keys onto `cfg` (merged, before derived values), or raise a one-line ConfigError.

    `base` holds the defaults before any user file, to tell a value the user set from a default.
    """
    # The engine is named twice (verl's rollout.name, this project's engines.backend): one set names both.
    name_set = _user_set(cfg, base, "actor_rollout_ref.rollout.name")
    backend_set = _user_set(cfg, base, "engines.backend")
    if name_set and not backend_set:
        cfg.engines.backend = cfg.actor_rollout_ref.rollout.name
    elif backend_set and not name_set:
        cfg.actor_rollout_ref.rollout.name = cfg.engines.backend
    for key, value in found.items():
        _APPLY[key](cfg, value, base)
    _apply_dataset_names(cfg, found, base)


def _user_set(cfg: DictConfig, base: DictConfig, key: str) -> bool:
    return OmegaConf.select(cfg, key) != OmegaConf.select(base, key)


def _map_to(cfg: DictConfig, base: DictConfig, rllm_key: str, key: str, value: Any) -> None:
    if _user_set(cfg, base, key) and OmegaConf.select(cfg, key) != value:
        raise ConfigError(
            f"'{rllm_key}' ({value!r}) is rLLM's name for '{key}', which is also set ({OmegaConf.select(cfg, key)!r}); "
            "keep one"
        )
    OmegaConf.update(cfg, key, value, merge=False)


def _require_batches(cfg: DictConfig, value: Any, base: DictConfig) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"'async_training.require_batches' must be an integer >= 1, got {value!r}")
    at = cfg.async_training
    if at.required_samples is None:
        at.required_samples = int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size) * value
    elif value != 1:
        raise ConfigError(
            f"'async_training.require_batches={value}' sizes a step as actor.ppo_mini_batch_size x require_batches, "
            f"but async_training.required_samples={at.required_samples} is set and wins; remove one"
        )


def _use_trainer_do_validate(cfg: DictConfig, value: Any, base: DictConfig) -> None:
    if value is True:
        raise ConfigError(
            "'async_training.use_trainer_do_validate=true': validation runs on the rollout engines here, every "
            "trainer.test_freq steps; remove it"
        )


def _checkpoint_engine(cfg: DictConfig, value: Any, base: DictConfig) -> None:
    value = value or {}
    if not isinstance(value, dict):
        raise ConfigError(f"'async_training.checkpoint_engine' must be a section, got {value!r}")
    if value.get("enable", False):
        raise ConfigError(
            "'async_training.checkpoint_engine.enable=true': rLLM's NCCL checkpoint engine is not built here; "
            "weights move by param_sync.transport=disk; set enable: false"
        )
    for key, current in value.items():
        if key not in _CHECKPOINT_ENGINE_DEFAULTS:
            raise ConfigError(f"'async_training.checkpoint_engine.{key}' is not a key of rLLM's checkpoint_engine")
        if current != _CHECKPOINT_ENGINE_DEFAULTS[key]:
            raise ConfigError(
                f"'async_training.checkpoint_engine.{key}' tunes rLLM's checkpoint engine, which is off and not "
                "built here; remove it"
            )


def _rollout_n(cfg: DictConfig, value: Any, base: DictConfig) -> None:
    if value == "${actor_rollout_ref.rollout.n}":
        return  # the shipped config's link: the same key, read there
    _map_to(cfg, base, "rollout.n", "actor_rollout_ref.rollout.n", value)


def _rollout_nnodes(cfg: DictConfig, value: Any, base: DictConfig) -> None:
    if value != 1:
        raise ConfigError(
            f"'rollout.nnodes={value}': engines and trainer ranks share one plan over trainer.nnodes nodes; set "
            "rollout.nnodes: 1 and rollout.n_gpus_per_node to all the engines' GPUs"
        )


def _rollout_gpus(cfg: DictConfig, value: Any, base: DictConfig) -> None:
    if value is None:
        return  # the shipped config's default: engines.num_engines decides
    if cfg.engines.backend != "sglang":
        raise ConfigError(
            "'rollout.n_gpus_per_node' sizes rLLM's SGLang rollout; with engines.backend=embedded set "
            "engines.num_engines instead"
        )
    tp = int(cfg.actor_rollout_ref.rollout.tensor_model_parallel_size)
    if not isinstance(value, int) or value < tp or value % tp:
        raise ConfigError(
            f"'rollout.n_gpus_per_node={value}' must be a multiple of actor_rollout_ref.rollout."
            f"tensor_model_parallel_size={tp} (one engine per {tp} GPUs)"
        )
    _map_to(cfg, base, "rollout.n_gpus_per_node", "engines.num_engines", value // tp)


def _total_rollout_steps(cfg: DictConfig, value: Any, base: DictConfig) -> None:
    at = cfg.async_training
    groups = at.required_samples or cfg.data.train_batch_size
    if not isinstance(value, int) or value < 1 or not groups:
        raise ConfigError(
            f"'rollout.total_rollout_steps' must be an integer >= 1 with required_samples set; got {value!r}"
        )
    _map_to(cfg, base, "rollout.total_rollout_steps", "trainer.total_training_steps", math.ceil(value / groups))


def _total_epochs(cfg: DictConfig, value: Any, base: DictConfig) -> None:
    _map_to(cfg, base, "rollout.total_epochs", "trainer.total_epochs", value)


def _test_freq(cfg: DictConfig, value: Any, base: DictConfig) -> None:
    if not isinstance(value, int):
        raise ConfigError(f"'rollout.test_freq' must be an integer (weight syncs between validations), got {value!r}")
    steps = value * int(cfg.async_training.trigger_parameter_sync_step) if value > 0 else value
    _map_to(cfg, base, "rollout.test_freq", "trainer.test_freq", steps)


def _rejection_sample(cfg: DictConfig, value: Any, base: DictConfig) -> None:
    if value is True:
        section = cfg.algorithm.group_filter
        current = {} if section is None else OmegaConf.to_container(section)
        cfg.algorithm.group_filter = {**current, "drop_zero_variance": True}


def _gen_batch_size(cfg: DictConfig, value: Any, base: DictConfig) -> None:
    if value != 1:
        raise ConfigError(
            f"'data.gen_batch_size={value}': each rollout request here is one prompt's group; set it to 1 or remove it "
            "(async_training.max_concurrent_rollouts sets how many run at once)"
        )


def _jointly(cfg: DictConfig, value: Any, base: DictConfig) -> None:
    """Dataset names and splits are read together, by `_apply_dataset_names`."""


def _apply_dataset_names(cfg: DictConfig, found: dict[str, Any], base: DictConfig) -> None:
    """rLLM's dataset names (module docstring): each resolved to its file, rows read as rLLM gives them."""
    train_name = found.get("data.train_dataset_name")
    legacy_name = found.get("async_training.dataset_name")
    if train_name is not None and legacy_name is not None and train_name != legacy_name:
        raise ConfigError(
            f"'async_training.dataset_name' ({legacy_name!r}) and 'data.train_dataset_name' ({train_name!r}) both "
            "name the training data; keep one"
        )
    names = {
        "train": (
            "data.train_dataset_name" if train_name is not None else "async_training.dataset_name",
            train_name if train_name is not None else legacy_name,
        ),
        "val": ("data.val_dataset_name", found.get("data.val_dataset_name")),
    }
    defaults = {"train": "train", "val": "test"}  # rLLM's split defaults
    for part, (key, name) in names.items():
        split_key = f"data.{part}_split"
        split = found.get(split_key, defaults[part])
        files_key = f"data.{part}_files"
        if name is None:
            if split != defaults[part]:
                raise ConfigError(f"'{split_key}' is read only with data.{part}_dataset_name; remove it or set both")
            continue
        if cfg.task.name is not None:
            raise ConfigError(
                f"'{key}' names the data, but task.name={cfg.task.name} makes its own; set task.name=null or remove it"
            )
        if _user_set(cfg, base, files_key) and OmegaConf.select(cfg, files_key) is not None:
            raise ConfigError(f"'{key}' ({name!r}) and '{files_key}' both name the {part} data; keep one")
        OmegaConf.update(cfg, files_key, [str(resolve_dataset(key, str(name), str(split)))], merge=False)
        cfg.workflow.rllm_rows = True
    if names["train"][1] is not None and names["val"][1] is None and not _user_set(cfg, base, "data.val_files"):
        cfg.data.val_files = None  # rLLM validates only a named val dataset


def resolve_dataset(key: str, name: str, split: str) -> Path:
    """The file of `name`'s `split` in rLLM's DatasetRegistry, else `name` itself when it is a data file; else a
    ConfigError naming what is registered."""
    # lazy: rLLM's dataset registry pulls pandas (~0.7 s), read only for a config that names an rLLM dataset
    from rllm.data.dataset import DatasetRegistry

    path = DatasetRegistry.split_path(name, split)
    if path is not None:
        if not path.is_file():
            raise ConfigError(
                f"'{key}={name}': its split '{split}' is registered at {path}, which is missing; register it again"
            )
        return path
    candidate = Path(name).expanduser()
    if candidate.suffix.lower() in _ROW_FILE_SUFFIXES:
        if not candidate.is_file():
            raise ConfigError(f"'{key}={name}': no such file")
        return candidate.resolve()
    if DatasetRegistry.dataset_exists(name):
        splits = ", ".join(DatasetRegistry.get_dataset_splits(name))
        raise ConfigError(f"'{key}={name}': the dataset has no split '{split}' (it has: {splits}); set the split key")
    registered = ", ".join(DatasetRegistry.get_dataset_names()) or "none"
    raise ConfigError(
        f"'{key}={name}': no such dataset in the DatasetRegistry at {DatasetRegistry.datasets_dir()} (registered: "
        f"{registered}) and not a data file; register it (DatasetRegistry.register_dataset) or give a .parquet path"
    )


_ROW_FILE_SUFFIXES = (".parquet", ".arrow", ".json", ".jsonl", ".csv")  # what rllm.data.dataset.read_rows reads


def _interpolation_only(key: str, target: str) -> Any:
    def apply(cfg: DictConfig, value: Any, base: DictConfig) -> None:
        if isinstance(value, str) and value.startswith("${") and target in value:
            return  # rLLM's own link to `target`, which is read there
        raise ConfigError(f"'{key}' is rLLM's copy of '{target}'; set '{target}' instead")

    return apply


def _actor_rollout_log_probs(cfg: DictConfig, value: Any, base: DictConfig) -> None:
    if isinstance(value, str) and value.startswith("${"):
        return  # rLLM's interpolation of async_training.use_rollout_log_probs: the same key, read there
    _map_to(
        cfg,
        base,
        "actor_rollout_ref.actor.use_rollout_log_probs",
        "async_training.use_rollout_log_probs",
        value,
    )


def _searchpath(cfg: DictConfig, value: Any, base: DictConfig) -> None:
    if value != _VERL_SEARCHPATH:
        raise ConfigError(
            f"'hydra.searchpath={value}': configs compose on verl's ppo_trainer only (and sibling files named in "
            "`defaults:`); remove it"
        )


_APPLY = {
    "async_training.require_batches": _require_batches,
    "async_training.use_trainer_do_validate": _use_trainer_do_validate,
    "async_training.checkpoint_engine": _checkpoint_engine,
    "rollout.n": _rollout_n,
    "rollout.nnodes": _rollout_nnodes,
    "rollout.n_gpus_per_node": _rollout_gpus,
    "rollout.total_rollout_steps": _total_rollout_steps,
    "rollout.total_epochs": _total_epochs,
    "rollout.test_freq": _test_freq,
    "rollout.rejection_sample": _rejection_sample,
    "data.gen_batch_size": _gen_batch_size,
    "async_training.dataset_name": _jointly,
    "data.train_dataset_name": _jointly,
    "data.val_dataset_name": _jointly,
    "data.train_split": _jointly,
    "data.val_split": _jointly,
    "actor_rollout_ref.checkpoint_engine": _interpolation_only(
        "actor_rollout_ref.checkpoint_engine", "async_training.checkpoint_engine"
    ),
    "actor_rollout_ref.actor.use_rollout_log_probs": _actor_rollout_log_probs,
    "hydra.searchpath": _searchpath,
}
assert set(_APPLY) == {f"{s}.{k}" for s, keys in RLLM_ONLY_KEYS.items() for k in keys}
