"""The weight transport seam: how new weights get from the trainer to the engines (`ParamSync` drives a transport).

Implementations: runtime/sync/disk.py (`DiskTransport`: HF safetensors folders on a filesystem every engine can
read) and runtime/sync/distributed.py (`DistributedTransport`: a broadcast through SGLang's weight-update group, a
`CollectiveTransport`). A transport with `load_all` loads every engine in one go, as a collective must; ParamSync
calls it instead of `load` per engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

# The engine client a transport is given: engines/client.py's `EngineClient` (its weight-update calls, by URL).
# Typed loosely here because api/ sits below engines/ (tests/project/test_layers.py); implementations name the class.
EngineClient = Any


@dataclass(frozen=True)
class StagedWeights:
    """Weights ready to be loaded by engines: where they are and how big (for the transfer-rate metrics)."""

    version: int
    location: str  # disk: the folder engines load; other transports: whatever their load step needs
    nbytes: int


class WeightTransport(Protocol):
    """How new weights get from the trainer to the engines (the seam for an NCCL transport)."""

    def stage(self, write_weights: Callable[[str], None], version: int) -> StagedWeights:
        """Trainer side, before engines pause: make `version` loadable (e.g. write it to disk)."""
        ...

    async def load(self, client: EngineClient, url: str, staged: StagedWeights, *, timeout_s: float) -> None:
        """Engine side, while paused: make engine `url` serve `staged` as weight_version str(version)."""
        ...

    def release(self, staged: StagedWeights, engine_versions: dict[str, int | None]) -> None:
        """After the sync: free what no engine needs any more (`engine_versions`: what each engine serves)."""
        ...


@runtime_checkable
class CollectiveTransport(WeightTransport, Protocol):
    """A transport whose load is one collective over all engines (the distributed broadcast)."""

    async def load_all(
        self, client: EngineClient, urls: list[str], staged: StagedWeights, *, timeout_s: float
    ) -> dict[str, BaseException]:
        """Engine side, while paused: load `staged` into every engine of `urls`; the failed ones and why."""
        ...
