"""The weight-update process group that the trainer (rank 0) and the engines (ranks rank_offset..) share, built
and used exactly as SGLang 0.5.6 builds and uses it, so the trainer side talks to real SGLang and to the embedded
engine alike:

- `init_custom_process_group` is SGLang's (`sglang/srt/utils/common.py`): a NEW group, separate from any default
  group of the process (the trainer's FSDP group, SGLang's TP group), rendezvoused through a TCP store that rank 0
  hosts at `master_address:master_port`, keys prefixed with the group name. Gloo on CPU, NCCL on GPU.
- `flatten_bucket` / `unflatten_bucket` are SGLang's `FlattenedTensorBucket` layout (`weight_sync/tensor_bucket.py`):
  the tensors of one `/update_weights_from_distributed` call with `load_format=flattened_bucket` travel as ONE
  uint8 tensor, each tensor's bytes in `names` order, so a bucket is one broadcast.
- `WeightUpdateGroups` is the engine side (`model_runner.init_weights_update_group`,
  `update_weights_from_distributed`): join a group, receive one call's tensors (blocking until the trainer's
  broadcast completes), leave a group.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

logger = logging.getLogger(__name__)

# SGLang's default group name (io_struct.InitWeightsUpdateGroupReqInput.group_name).
DEFAULT_GROUP_NAME = "weight_update_group"
FLATTENED_BUCKET = "flattened_bucket"


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16 (SGLang: getattr(torch, dtype)); ValueError otherwise."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def init_custom_process_group(
    *,
    backend: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float,
    init_method: str | None = None,
    store: dist.Store | None = None,
) -> dist.ProcessGroup:
    """A process group of `world_size` ranks that is not the default group (SGLang's function, same store keys).

    Give `init_method` ("tcp://host:port", SGLang's engines) or `store` (the trainer, which hosts the TCP store
    itself so that it can pick a free port). Blocks until every rank has joined, at most `timeout_s`; the same
    timeout bounds every collective of the group, so a rank that dies mid-broadcast is an error, not a hang.
    """
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        # Rank 0 hosts the store (is_master); the others connect, retrying until `timeout`.
        store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name, timeout=timeout
    )
    # Group rank == global rank inside this group: torch.distributed.broadcast(src=0, group=pg) needs the map.
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_group(pg: dist.ProcessGroup) -> None:
    """Leave a group for good; peers blocked in a collective of it then fail instead of waiting out the timeout."""
    try:
        dist.destroy_process_group(pg)
    except Exception as exc:  # already gone or half-built: nothing more to release
        logger.debug("destroying a weight-update group: %r", exc)


def flatten_bucket(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One uint8 tensor holding every tensor's bytes, in order (SGLang's FlattenedTensorBucket)."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unflatten_bucket(
    flat: torch.Tensor, names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a flattened bucket (views into `flat`, no copy)."""
    out, start = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        nbytes = bucket_nbytes([dtype], [shape])
        out.append((name, flat[start : start + nbytes].view(dtype).reshape(list(shape))))
        start += nbytes
    if start != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} bytes, the names describe {start}")
    return out


def bucket_nbytes(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> int:
    """Bytes of the tensors described by `dtypes` and `shapes`."""
    total = 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        numel = 1
        for dim in shape:
            numel *= int(dim)
        total += numel * torch.empty((), dtype=dtype).element_size()
    return total


class WeightUpdateGroups:
    """Engine side: the weight-update groups this engine has joined, by name (SGLang's `_model_update_group`).

    Every method blocks (rendezvous, broadcast): the HTTP layer runs them in a worker thread.
    """

    def __init__(self, device: str = "cpu", rank_in_engine: int = 0) -> None:
        self.device = torch.device(device)
        self.rank_in_engine = rank_in_engine  # SGLang: rank = rank_offset + tp_rank
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._lock = threading.Lock()
        # Receive buffers by size, handed back with `recycle` once their tensors are applied. Fresh memory costs
        # a page fault per 4 KiB at first touch: 0.6 s for 133 MB on the 2-core dev machine, against 0.05 s to
        # copy it, and the same bucket sizes come back at every sync.
        self._buffers: dict[int, torch.Tensor] = {}

    @property
    def names(self) -> list[str]:
        return sorted(self._groups)

    def init_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ) -> tuple[bool, str]:
        """Join group `group_name` (SGLang's init_weights_update_group); (success, message) as SGLang answers."""
        if not group_name:
            return False, "Group name cannot be empty"
        rank = rank_offset + self.rank_in_engine
        logger.info(
            "init custom process group: master_address=%s, master_port=%s, rank_offset=%s, rank=%s, world_size=%s, "
            "group_name=%s, backend=%s",
            master_address,
            master_port,
            rank_offset,
            rank,
            world_size,
            group_name,
            backend,
        )
        self.destroy(group_name)  # a rebuild under the same name replaces the old group
        try:
            pg = init_custom_process_group(
                backend=backend,
                init_method=f"tcp://{master_address}:{master_port}",
                world_size=world_size,
                rank=rank,
                group_name=group_name,
                timeout_s=timeout_s,
            )
        except Exception as exc:
            message = f"Failed to initialize custom process group: {exc}."
            logger.error(message)
            return False, message
        with self._lock:
            self._groups[group_name] = pg
        return True, "Succeeded to initialize custom process group."

    def destroy(self, group_name: str) -> tuple[bool, str]:
        """Leave group `group_name` (SGLang's destroy_weights_update_group)."""
        with self._lock:
            pg = self._groups.pop(group_name, None)
        if pg is None:
            return False, "The group to be destroyed does not exist."
        destroy_group(pg)
        return True, "Succeeded to destroy custom process group."

    def destroy_all(self) -> None:
        for name in self.names:
            self.destroy(name)

    def receive(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        load_format: str | None,
    ) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor | None]:
        """Receive one call's tensors from rank 0 of `group_name`: one broadcast per tensor, or one for the whole
        call with load_format=flattened_bucket (SGLang's two paths). Returns them and, for a bucket, the buffer
        they view (hand it to `recycle` once they are applied). Raises on any failure."""
        pg = self._groups.get(group_name)
        if pg is None:
            raise KeyError(f"Group {group_name} not in {self.names}. Please call `init_weights_update_group` first.")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
        torch_dtypes = [parse_dtype(d) for d in dtypes]
        if load_format == FLATTENED_BUCKET:
            nbytes = bucket_nbytes(torch_dtypes, shapes)
            with self._lock:
                flat = self._buffers.pop(nbytes, None)
            if flat is None:
                flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            dist.broadcast(flat, src=0, group=pg)
            return unflatten_bucket(flat, names, torch_dtypes, shapes), flat
        if load_format not in (None, "auto"):
            raise ValueError(f"load_format {load_format!r} is not supported (auto | {FLATTENED_BUCKET})")
        weights = [torch.empty(list(s), dtype=d, device=self.device) for d, s in zip(torch_dtypes, shapes, strict=True)]
        handles = [dist.broadcast(w, src=0, group=pg, async_op=True) for w in weights]  # SGLang's per-tensor path
        for handle in handles:
            handle.wait()
        return list(zip(names, weights, strict=True)), None

    def recycle(self, buffer: torch.Tensor | None) -> None:
        """Keep a bucket's buffer (its tensors no longer used) for the next call of that size."""
        if buffer is not None:
            with self._lock:
                self._buffers[buffer.numel()] = buffer
