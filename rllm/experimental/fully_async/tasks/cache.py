"""The task cache every built-in task shares: an entry built once per key, in a temporary folder renamed into place.

An entry is `cache_dir/NAME-KEY`, KEY a hash of everything that changes what is built (`cache_key`). It is built
in a temporary sibling and renamed into place, with a small JSON marker written last, so a crash never leaves a
half-written entry that a later call would trust; if another process wins the race, its entry is used and ours is
discarded. A second call with the same key only reads the marker.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def cache_key(spec: Mapping[str, Any]) -> str:
    """16 hex digits naming everything in `spec` (JSON, keys sorted)."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def entry_path(cache_dir: str | Path, name: str, key: str) -> Path:
    """The folder `cached_entry` keeps entry `name` under `key` in, whether or not it is built yet."""
    return Path(cache_dir) / f"{name}-{key}"


def cached_entry(
    cache_dir: str | Path,
    name: str,
    key: str,
    build: Callable[[Path], dict[str, Any]],
    *,
    marker: str = "assets.json",
) -> tuple[Path, dict[str, Any]]:
    """The entry folder and its marker's contents; `build(folder)` fills a fresh folder and returns the marker's
    contents, called only when no complete entry exists."""
    cache_dir = Path(cache_dir)
    entry = entry_path(cache_dir, name, key)
    if not (entry / marker).is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cache_dir / f".tmp-{name}-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            meta = build(tmp)
            (tmp / marker).write_text(json.dumps(meta, indent=2))  # last: marks a complete entry
            try:
                os.rename(tmp, entry)
            except OSError:
                if not (entry / marker).is_file():
                    raise
                logger.info("%s was built concurrently by another process; using theirs", entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return entry, json.loads((entry / marker).read_text())
