"""Rank 0's end of the weight-update group: the trainer process that holds full parameters gathers them, casts
them to the engines' dtype, packs them into buckets and broadcasts bucket by bucket (`LocalSender`).

`DistributedTransport` (distributed.py) drives the engines over HTTP and asks a `GroupSender` for the
collective side. With one trainer process the sender is a `LocalSender` in that process. With several FSDP ranks it
is a `RankZeroSender`, a proxy to the `LocalSender` inside trainer rank 0's actor: trainer rank 0 is rank 0 of the
weight-update group, the other ranks only take part in gathering the full parameters.

- `stage` runs on EVERY rank actor (`_PolicyRank.stage_weights`, in the ranks' default call queue, so it is ordered
  with training calls like any other FSDP collective): each rank walks its module's tensors in the same order and
  `full_tensor()`-gathers them one at a time; rank 0 casts and packs them into buckets and keeps them, the others
  drop each tensor at once. Rank 0 answers with the buckets' headers.
- `open_store`, `join`, `broadcast`, `leave` run on rank 0 only (`_PolicyRank.weights_call`, a concurrency group
  of its own: a join or broadcast left running after an engine failed must not block the next group's calls, and
  an engine restarted during a training step can catch up without waiting for the step). The other ranks are not
  in the weight-update group, so they never wait for it. Every call has a timeout naming trainer rank 0 and the
  call; a rank that died fails the call with one line.

Memory while staging: tensors are gathered ONE AT A TIME (`DTensor.full_tensor()`, a per-tensor all-gather) and
packed as they come, so a rank other than 0 holds at most one full tensor beyond its shard, and rank 0 the staged
buckets (one model copy in the sync dtype: kept for an engine that restarts) plus one full tensor and one bucket
being packed. A whole full state dict (FSDP2 `full_state_dict`) would hold a full fp32 copy at once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import ray
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rllm.experimental.fully_async.engines.weight_group import (
    destroy_group,
    flatten_bucket,
    init_custom_process_group,
    parse_dtype,
)

logger = logging.getLogger(__name__)

__all__ = [
    "BucketHeader",
    "GroupSender",
    "LocalSender",
    "RankZeroSender",
    "backend_tensors",
    "module_state",
    "module_tensors",
    "plan_buckets",
]

Tensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class BucketHeader:
    """What one `/update_weights_from_distributed` call says about its bucket (the bytes travel by broadcast)."""

    names: list[str]
    dtypes: list[str]  # "float32", not "torch.float32": SGLang resolves them with getattr(torch, dtype)
    shapes: list[list[int]]
    nbytes: int


@dataclass(frozen=True)
class _Bucket:
    """A bucket's header and its bytes as one flat tensor."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    flat: torch.Tensor  # uint8, SGLang's FlattenedTensorBucket layout

    @property
    def header(self) -> BucketHeader:
        return BucketHeader(self.names, self.dtypes, self.shapes, int(self.flat.numel()))


def plan_buckets(state: Tensors, bucket_bytes: int, dtype: str | None, *, keep: bool = True) -> list[_Bucket]:
    """Cast floating tensors to `dtype` and pack them in order into buckets of at most `bucket_bytes`; a tensor
    larger than a bucket travels alone in an oversized one (a call carries whole tensors only). Each bucket is
    flattened as soon as it is full, so only one bucket's cast tensors exist besides the flat buckets.
    `keep=False` drains `state` (its collectives run) and keeps nothing: a trainer rank other than 0."""
    target = parse_dtype(dtype) if dtype is not None else None
    buckets: list[_Bucket] = []
    group: list[tuple[str, torch.Tensor]] = []
    size = 0

    def close() -> None:
        if group and keep:
            tensors = [t for _, t in group]
            buckets.append(
                _Bucket(
                    names=[n for n, _ in group],
                    dtypes=[str(t.dtype).removeprefix("torch.") for t in tensors],
                    shapes=[list(t.shape) for t in tensors],
                    flat=flatten_bucket(tensors),
                )
            )
        group.clear()

    items = state.items() if isinstance(state, Mapping) else state
    for name, tensor in items:
        if not keep:
            continue
        t = tensor.detach()
        if target is not None and t.is_floating_point():
            t = t.to(target)
        nbytes = t.numel() * t.element_size()
        if group and size + nbytes > bucket_bytes:
            close()
            size = 0
        group.append((name, t))
        size += nbytes
    close()
    return buckets


def module_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The module's full tensors by name, gathered one at a time. FSDP2-sharded tensors (DTensor) are gathered
    with `full_tensor()`, a collective: at world size > 1 every trainer rank must drain this in the same order
    (`state_dict()` order is the same on every rank). Tied weights are sent once, under their first name."""

    seen: set[tuple[int, int]] = set()
    for name, tensor in module.state_dict().items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        # Keyed on the local storage: two names of one tied parameter share it, sharded or not.
        key = (local.untyped_storage().data_ptr(), local.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def backend_tensors(backend: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """`module_tensors(backend.model)` with the backend's parameters on the device while they are read (a policy
    backend with fsdp_config.param_offload keeps them on the CPU between calls: FSDPPolicyBackend.resident)."""
    resident = getattr(backend, "resident", None)
    with resident() if resident is not None else contextlib.nullcontext():
        yield from module_tensors(backend.model)


def module_state(module: torch.nn.Module) -> Callable[[], dict[str, torch.Tensor]]:
    """A `state_fn` giving `module_tensors(module)` as one dict (tests and benchmarks; the trainer streams)."""
    return lambda: dict(module_tensors(module))


class GroupSender(Protocol):
    """Rank 0 of the weight-update group: stages buckets, hosts the group's store, joins, broadcasts, leaves.

    Groups are addressed by name: a join left running after a failed build never touches a newer group.
    """

    backend: str  # gloo | nccl: what the engines are told to join with

    def stage(self, version: int) -> list[BucketHeader]:
        """Gather, cast and pack the weights as `version` (collective across trainer ranks)."""
        ...

    def open_store(self, name: str, world_size: int, timeout_s: float) -> int:
        """Host the TCP store group `name` rendezvous through; returns its port."""
        ...

    def join(self, name: str, world_size: int, timeout_s: float) -> None:
        """Join group `name` as rank 0; blocks until every engine rank has joined, at most `timeout_s`."""
        ...

    def broadcast(self, name: str, version: int, index: int) -> None:
        """Broadcast bucket `index` of the staged `version` to group `name` (blocks until it completes)."""
        ...

    def leave(self, name: str) -> None:
        """Leave group `name` (once a broadcast still running on it ends); never blocks."""
        ...

    def close(self) -> None:
        """Leave every group and drop the staged buckets."""
        ...


class LocalSender:
    """`GroupSender` in this process: `state_fn()` gives the full tensors (a dict or a stream of pairs).

    Backend: nccl when CUDA is available (buckets then live on the GPU), else gloo. `keep=False` for a trainer rank
    other than 0: `stage` only takes part in the gather.
    """

    def __init__(
        self,
        state_fn: Callable[[], Tensors],
        *,
        bucket_mb: float = 256.0,
        dtype: str | None = None,
        backend: str = "auto",
        master_address: str = "127.0.0.1",
        keep: bool = True,
    ) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be auto, gloo or nccl, got {backend!r}")
        self.state_fn = state_fn
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.dtype = dtype
        self.backend = ("nccl" if torch.cuda.is_available() else "gloo") if backend == "auto" else backend
        self.master_address = master_address
        self.keep = keep
        self._staged: tuple[int, list[_Bucket]] | None = None
        self._lock = threading.Lock()
        self._stores: dict[str, dist.TCPStore] = {}
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._busy: dict[str, int] = {}  # broadcasts running per group: a group is destroyed only when none is
        self._joining: set[str] = set()
        self._doomed: set[str] = set()  # left while joining or broadcasting

    def stage(self, version: int) -> list[BucketHeader]:
        buckets = plan_buckets(self.state_fn(), self.bucket_bytes, self.dtype, keep=self.keep)
        if self.backend == "nccl":
            buckets = [_Bucket(b.names, b.dtypes, b.shapes, b.flat.to("cuda", non_blocking=True)) for b in buckets]
        self._staged = (version, buckets) if self.keep else None
        return [b.header for b in buckets]

    def open_store(self, name: str, world_size: int, timeout_s: float) -> int:
        # Port 0: the OS picks a free one. The master's store listens on every interface of this node.
        store = dist.TCPStore(
            self.master_address, 0, world_size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
        with self._lock:
            self._stores[name] = store
        return int(store.port)

    def join(self, name: str, world_size: int, timeout_s: float) -> None:
        with self._lock:
            store = self._stores.pop(name)
            self._joining.add(name)
        try:
            pg = init_custom_process_group(
                backend=self.backend, store=store, world_size=world_size, rank=0, group_name=name, timeout_s=timeout_s
            )
        finally:
            with self._lock:
                self._joining.discard(name)
                left = name in self._doomed
                self._doomed.discard(name)
        if left:  # left while it was forming (the engines' calls failed)
            destroy_group(pg)
            raise RuntimeError(f"weight-update group {name} was left before it formed")
        with self._lock:
            self._groups[name] = pg

    def broadcast(self, name: str, version: int, index: int) -> None:
        staged = self._staged
        if staged is None or staged[0] != version:
            have = None if staged is None else staged[0]
            raise ValueError(f"weights v{version} are not staged on this trainer rank (staged: v{have})")
        with self._lock:
            pg = self._groups.get(name)
            if pg is None:
                raise KeyError(f"weight-update group {name} is not joined (or was left)")
            self._busy[name] = self._busy.get(name, 0) + 1
        try:
            dist.broadcast(staged[1][index].flat, 0, pg)
        except Exception as exc:
            # The traceback's frames would keep the group alive, and with it its connections: freed, leaving the
            # group closes them, so the engines still waiting in this broadcast fail now, not at its timeout.
            traceback.clear_frames(exc.__traceback__)
            del pg
            raise
        finally:
            with self._lock:
                self._busy[name] -= 1
                release = self._busy[name] == 0 and name in self._doomed
                if release:
                    self._busy.pop(name)
                    self._doomed.discard(name)
                    pg = self._groups.pop(name)
            if release:
                destroy_group(pg)

    def leave(self, name: str) -> None:
        with self._lock:
            self._stores.pop(name, None)
            if name in self._joining or self._busy.get(name):
                self._doomed.add(name)  # the join or broadcast still running ends it
                return
            pg = self._groups.pop(name, None)
        if pg is not None:
            destroy_group(pg)

    def close(self) -> None:
        with self._lock:
            names = list(self._groups)
        for name in names:
            self.leave(name)
        self._staged = None

    @property
    def group_names(self) -> list[str]:
        with self._lock:
            return sorted(self._groups)


# ---- several FSDP ranks: the sender inside rank 0's actor, driven from the trainer actor -----------------------------

SLACK_S = 30.0  # on top of a collective's own timeout: the Ray call around it
STORE_TIMEOUT_S = 60.0  # opening a TCP store: no peer involved


class RankZeroSender:
    """`GroupSender` over a `DistributedPolicyBackend`'s rank actors (see the module docstring)."""

    def __init__(self, group: Any, *, bucket_mb: float, dtype: str | None, master_address: str) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.group = group
        self.bucket_mb, self.dtype, self.master_address = float(bucket_mb), dtype, master_address
        self.backend = "nccl" if group.device == "cuda" else "gloo"

    def stage(self, version: int) -> list[BucketHeader]:
        args = (self.bucket_mb, self.dtype, self.backend, self.master_address, version)
        headers = self.group.on_every_rank("stage_weights", args)
        return headers[0]

    def open_store(self, name: str, world_size: int, timeout_s: float) -> int:
        return int(self._on_rank0("open_store", (name, world_size, timeout_s), STORE_TIMEOUT_S))

    def join(self, name: str, world_size: int, timeout_s: float) -> None:
        self._on_rank0("join", (name, world_size, timeout_s), timeout_s + SLACK_S)

    def broadcast(self, name: str, version: int, index: int) -> None:
        self._on_rank0("broadcast", (name, version, index), self.group.call_timeout_s + SLACK_S)

    def leave(self, name: str) -> None:
        self.group.rank_zero.weights_call.remote("leave", name)  # never blocks: rank 0 ends it in its own time

    def close(self) -> None:
        try:
            self._on_rank0("close", (), STORE_TIMEOUT_S)
        except Exception as exc:  # the ranks may be gone already (shutdown, a failed rank)
            logger.debug("closing rank 0's weight-update groups: %r", exc)

    def _on_rank0(self, method: str, args: tuple, timeout_s: float) -> Any:
        ref = self.group.rank_zero.weights_call.remote(method, *args)
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(f"trainer rank 0 gave no answer to weights {method} within {timeout_s:.0f} s") from exc
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(f"trainer rank 0 died during weights {method}") from exc
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause or exc
            raise RuntimeError(f"trainer rank 0 raised in weights {method}: {type(cause).__name__}: {cause}") from exc
