"""The user's paths as the run uses them: `~` expanded once, when the config is loaded, for every reader.

verl 0.7.1 expands nothing in a model or data path (`verl.utils.fs.copy_to_local` passes `~/models/x` on, and
transformers then takes it for a hub id); its own default `actor_rollout_ref.model.path` is `~/models/...` all the
same, and this project's GPU YAMLs write `~/data/...`. Here `load_config` expands `~` in each key of `PATH_KEYS`
with `expand_path`, so the engine launcher (`engines/from_config.py`), the trainer (`RunSpec.trainer.model_path`),
`plan`'s engine command lines, the tokenizer at start-up and verl's Megatron worker all read one absolute path.

Environment variables are not expanded, as in verl: a path that still holds `$NAME` after OmegaConf's own
interpolation is refused in one line that names `${oc.env:NAME}` (OmegaConf's resolver) as the way to write it.
"""

from __future__ import annotations

import os
import re
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from rllm.experimental.fully_async.errors import ConfigError

# Keys that name a file or folder on this machine (a value may be a list, as data.train_files).
PATH_KEYS: tuple[str, ...] = (
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.lora_adapter_path",
    "data.train_files",
    "data.val_files",
    "reward.custom_reward_function.path",
    "custom_reward_function.path",
    "workflow.path",
    "env.path",
    "run.dir",
    "param_sync.weights_dir",
    "trainer.resume_from_path",
    "trainer.rollout_data_dir",
    "trainer.validation_data_dir",
    "task.cache_dir",
)

_VARIABLE = re.compile(r"\$(\{[^}]*\}|[A-Za-z_][A-Za-z0-9_]*)")


def expand_path(path: str, key: str = "path") -> str:
    """`path` with a leading `~` (or `~user`) expanded; ConfigError (one line naming `key`) if it holds `$VAR`."""
    variable = _VARIABLE.search(path)
    if variable:
        name = variable.group(1).strip("{}")
        raise ConfigError(
            f"'{key}' is {path!r}: environment variables are not expanded in paths (verl does not either); "
            f"write ${{oc.env:{name}}} or the path itself",
            key=key,
        )
    return os.path.expanduser(path)


def expand_config_paths(cfg: DictConfig) -> None:
    """Expand `~` in every key of PATH_KEYS that `cfg` holds (in place; lists element by element)."""
    for key in PATH_KEYS:
        node = OmegaConf.select(cfg, key, default=None)
        if node is None:
            continue
        OmegaConf.update(cfg, key, _expanded(node, key), merge=False)


def home_expanded(cfg: DictConfig) -> None:
    """`~` expanded in every key of PATH_KEYS that `cfg` holds, nothing refused (for a config saved by an earlier
    version, read back to be compared with one load_config built)."""
    for key in PATH_KEYS:
        node = OmegaConf.select(cfg, key, default=None)
        if isinstance(node, str):
            OmegaConf.update(cfg, key, os.path.expanduser(node), merge=False)
        elif isinstance(node, ListConfig):
            OmegaConf.update(cfg, key, [os.path.expanduser(str(item)) for item in node], merge=False)


def _expanded(value: Any, key: str) -> Any:
    if isinstance(value, (ListConfig, list, tuple)):
        return [expand_path(str(item), key) for item in value]
    return expand_path(str(value), key)
