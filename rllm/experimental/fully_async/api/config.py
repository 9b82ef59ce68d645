"""Reading a typed section out of a run's config: the one helper every section's dataclass is built with.

The sections' dataclasses live with what they configure (algorithms/, settings/); this reads any of them from an
OmegaConf config (or a plain nested dict) the same way, refusing unknown fields in one line.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

_Config = TypeVar("_Config")


def dataclass_from_config(cfg: Any, path: str, cls: type[_Config]) -> _Config | None:
    """Build `cls` from the mapping at dotted `path` of an OmegaConf config; None when the section is absent or null.

    Missing fields take the dataclass defaults; an unknown field raises a ValueError naming ``path.field``. `cfg` may
    also be a plain nested dict.
    """

    section = OmegaConf.select(cfg, path, default=None) if isinstance(cfg, DictConfig) else _select(cfg, path)
    if section is None:
        return None
    values = OmegaConf.to_container(section, resolve=True) if isinstance(section, DictConfig) else dict(section)
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown key {path}.{unknown[0]} (known: {', '.join(sorted(known))})")
    return cls(**values)


def _select(cfg: Any, path: str) -> Any:
    node = cfg
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node
