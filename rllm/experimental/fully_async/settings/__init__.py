"""Configuration: YAML plus `key=value` overrides, validated once when loaded.

loader.py reads and merges; schema.py holds the typed sections; derive.py fills derived values; validate.py checks
rules; compat.py maps rLLM's keys; spec.py builds the frozen run spec the components receive.
"""

from rllm.experimental.fully_async.settings.derive import resolve_derived
from rllm.experimental.fully_async.settings.loader import (
    DEFAULT_CONFIG,
    REPO_CONFIG_DIR,
    ConfigError,
    base_config,
    load_config,
    verl_base_config,
)
from rllm.experimental.fully_async.settings.validate import validate

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
