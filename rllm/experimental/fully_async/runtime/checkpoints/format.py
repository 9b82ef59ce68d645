"""A checkpoint's files: their names and format version, what may go into them (checked before anything is
written), the queue's groups as JSON, and the manifest's hashes. `store.py` commits, finds and loads checkpoints
made of these parts; each actor writes its own part with the writers here.

What goes into the files is checked before anything is written: a trainer part must come back from
torch.load(weights_only=True) (which cannot run code), a rollout/queue/meta part from JSON unchanged; either raises
TypeError naming the offending place (e.g. ``rollout['ledger'][3]``). The queue part is VersionedGroups as JSON
objects (dataclasses.asdict one way, the dataclasses rebuilt the other): a field the dataclass no longer has is an
error, a missing one takes its default. Each part's writer returns its manifest entry ({bytes, sha256}), hashing
what it writes rather than reading it back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from rllm.experimental.fully_async.api.trajectory import (
    TrajectoryStatus,
    VersionedGroup,
    VersionedSequence,
    VersionedTrajectory,
)

# Bump when the layout or a part's encoding changes; load refuses newer formats. 1: the trainer's full state in
# trainer.pt. 2: the FSDP policy as torch.distributed.checkpoint shards beside it (trainer_state.py).
FORMAT_VERSION = 2


COMPLETE_MARKER = "COMPLETE"


TRAINER_FILE = "trainer.pt"


ROLLOUT_FILE = "rollout.json"


QUEUE_FILE = "queue.json"


META_FILE = "meta.json"


PART_FILES = (TRAINER_FILE, ROLLOUT_FILE, QUEUE_FILE, META_FILE)


_HASH_CHUNK = 8 << 20  # bytes read at a time when hashing: the trainer part can be larger than spare memory


# What torch.load(weights_only=True) reads back (checked against torch 2.13); exact types, because a subclass
# (a numpy float, a str Enum) is pickled as its own class, which weights_only refuses.
_TORCH_SAFE_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def check_torch_safe(value: Any, where: str) -> None:
    """Raise TypeError, naming the place, for a value torch.load(weights_only=True) would refuse to read back."""
    kind = type(value)
    if kind in _TORCH_SAFE_LEAVES:
        return
    if isinstance(value, torch.Tensor):
        if kind not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"{where} is a {kind.__name__}; save plain tensors (e.g. a full, unsharded state dict)")
        return
    if kind in (dict, OrderedDict):
        for key, item in value.items():
            if type(key) not in _TORCH_SAFE_LEAVES:
                raise TypeError(f"{where} has a key of type {type(key).__name__}; use str or int keys")
            check_torch_safe(item, f"{where}[{key!r}]")
        return
    if kind in (list, tuple, set):
        for index, item in enumerate(value):
            check_torch_safe(item, f"{where}[{index}]")
        return
    raise TypeError(
        f"{where} is a {kind.__module__}.{kind.__qualname__}, which torch.load(weights_only=True) cannot read back; "
        "convert it to tensors or plain Python values"
    )


def check_json(value: Any, where: str) -> None:
    """Raise TypeError, naming the place, for a value that would not come back from JSON unchanged."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where} has the non-string key {key!r}; JSON would turn it into a string")
            check_json(item, f"{where}[{key!r}]")
        return
    if isinstance(value, list):
        for index, item in enumerate(value):
            check_json(item, f"{where}[{index}]")
        return
    raise TypeError(f"{where} is a {type(value).__qualname__}, which JSON cannot store unchanged; use lists/dicts/str")


def json_bytes(value: Any, where: str) -> bytes:
    """`value` as compact JSON, after `check_json` has made sure it comes back unchanged."""
    check_json(value, where)
    return json.dumps(value, separators=(",", ":")).encode()


def group_to_json(group: VersionedGroup) -> dict[str, Any]:
    """One queued group as a JSON object (dataclasses.asdict, with each status enum as its value)."""
    if not isinstance(group, VersionedGroup):
        raise TypeError(f"the queue part must hold VersionedGroup objects, got a {type(group).__qualname__}")
    doc = dataclasses.asdict(group)
    for trajectory in doc["trajectories"]:
        trajectory["status"] = TrajectoryStatus(trajectory["status"]).value
    return doc


def group_from_json(doc: Any, where: str) -> VersionedGroup:
    """Rebuild a group from `group_to_json`'s object; a malformed one raises TypeError or ValueError."""
    fields = _known_fields(VersionedGroup, doc, where)
    fields["trajectories"] = [
        _trajectory_from_json(item, f"{where}.trajectories[{index}]")
        for index, item in enumerate(fields.get("trajectories", []))
    ]
    return VersionedGroup(**fields)


def _trajectory_from_json(doc: Any, where: str) -> VersionedTrajectory:
    fields = _known_fields(VersionedTrajectory, doc, where)
    fields["sequences"] = [
        VersionedSequence(**_known_fields(VersionedSequence, item, f"{where}.sequences[{index}]"))
        for index, item in enumerate(fields.get("sequences", []))
    ]
    if "status" in fields:
        fields["status"] = TrajectoryStatus(fields["status"])
    return VersionedTrajectory(**fields)


def _known_fields(cls: type, doc: Any, where: str) -> dict[str, Any]:
    """The JSON object as constructor kwargs: a field the class no longer has is an error, a missing one a default."""
    if not isinstance(doc, dict):
        raise TypeError(f"{where} must be an object, got {type(doc).__name__}")
    unknown = sorted(set(doc) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(f"{where} has fields {cls.__name__} does not know: {unknown}")
    return dict(doc)


class HashingWriter:
    """A write-only file wrapper that hashes and counts what torch.save writes, so the file is not read back."""

    def __init__(self, file: io.BufferedWriter) -> None:
        self.file = file
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

    def entry(self) -> dict[str, Any]:
        """The manifest entry of what was written so far."""
        return {"bytes": self.size, "sha256": self.sha256.hexdigest()}


def manifest_entry(data: bytes) -> dict[str, Any]:
    """The manifest entry ({bytes, sha256}) of a part written from memory."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def file_sha256(path: Path) -> str:
    """The sha256 hex digest of a file, read in chunks; OSError propagates."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_entries(directory: str | Path, *, rank: int = 0, world: int = 1) -> dict[str, dict[str, Any]]:
    """The manifest entries ({bytes, sha256}, by file name) of the files in `directory`: all of them, or with
    `world` > 1 rank `rank`'s share (every world-th name in sorted order from `rank`), so that the ranks of a
    trainer hash their shards in parallel and together cover every file."""
    directory = Path(directory)
    names = sorted(entry.name for entry in directory.iterdir() if entry.is_file())
    return {
        name: {"bytes": (directory / name).stat().st_size, "sha256": file_sha256(directory / name)}
        for name in names[rank::world]
    }


def encode_rollout_part(rollout: dict[str, Any], queue: list[VersionedGroup]) -> dict[str, bytes]:
    """The rollout part's files as bytes, checked (TypeError names a value JSON would not return unchanged)."""
    return {
        ROLLOUT_FILE: json_bytes(rollout, "rollout"),
        QUEUE_FILE: json_bytes([group_to_json(group) for group in queue], "queue"),
    }


def write_rollout_part(directory: Path, rollout: dict[str, Any], queue: list[VersionedGroup]) -> dict[str, Any]:
    """Write rollout.json and queue.json (fsynced) into `directory`; returns their manifest entries."""
    return {
        name: write_bytes(Path(directory) / name, data) for name, data in encode_rollout_part(rollout, queue).items()
    }


def write_trainer_part(directory: Path, trainer: dict[str, Any]) -> dict[str, Any]:
    """Write trainer.pt (fsynced) into `directory` from the trainer's own process; returns its manifest entry."""
    check_torch_safe(trainer, "trainer")
    return {TRAINER_FILE: write_torch(Path(directory) / TRAINER_FILE, trainer)}


def write_torch(path: Path, value: dict[str, Any]) -> dict[str, Any]:
    with open(path, "wb") as file:
        writer = HashingWriter(file)
        torch.save(value, writer)
        file.flush()
        os.fsync(file.fileno())
    return writer.entry()


def write_bytes(path: Path, data: bytes) -> dict[str, Any]:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    return manifest_entry(data)
