"""Read back what wandb wrote in offline mode (`WANDB_MODE=offline`): a run's history rows and metric definitions.

wandb 0.31 writes the run's records from wandb-core (Go) and ships no Python reader (the former
`wandb.sdk.internal.datastore` is gone, and `wandb sync` has no `--view`). The `.wandb` file is LevelDB's log
format: a 7-byte header (`:W&B`, magic, version), then 32 KiB blocks of chunks, each `crc32 (4) | length (2) | type
(1) | data`, with type full (1) or first (2) / middle (3) / last (4) of a record split over blocks. Each record is
wandb's own protobuf `Record` (`wandb.proto.wandb_internal_pb2`), decoded here with that class; every chunk's
checksum (zlib's crc32 of the type byte then the data, as wandb-core writes it) is verified.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def offline_run_file(wandb_dir: Path) -> Path:
    """The one offline run's `.wandb` file under `wandb_dir` (`$WANDB_DIR`); AssertionError unless exactly one."""
    files = sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"expected one offline run under {wandb_dir}, found {files}"
    return files[0]


def records(path: Path) -> Iterator[Any]:
    """Every `Record` in a `.wandb` file, in the order written."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a .wandb file (header {data[:7]!r})"
    pos, pending = 7, b""
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # a block's tail too short for a chunk header is zero padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        chunk = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind == 0 and length == 0:  # preallocated, unwritten space
            continue
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad checksum at byte {pos}"
        pending += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def history(path: Path) -> list[dict[str, Any]]:
    """The run's history rows as wandb keeps them (`_step` is the row; values JSON-decoded), in order."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in items})
    return rows


def step_metrics(path: Path) -> dict[str, str]:
    """{metric name or glob: its x-axis} from the run's `define_metric` records that name a step metric."""
    out = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "metric" and record.metric.step_metric:
            out[record.metric.name or record.metric.glob_name] = record.metric.step_metric
    return out
