"""Configuration: YAML plus `key=value` overrides, validated once when loaded (see `loader.py`, `schema.py`)."""

from rllm.experimental.fully_async.settings.loader import (
    DEFAULT_CONFIG,
    REPO_CONFIG_DIR,
    ConfigError,
    base_config,
    load_config,
    resolve_derived,
    validate,
    verl_base_config,
)

__all__ = [
    "DEFAULT_CONFIG",
    "REPO_CONFIG_DIR",
    "ConfigError",
    "base_config",
    "load_config",
    "resolve_derived",
    "validate",
    "verl_base_config",
]
