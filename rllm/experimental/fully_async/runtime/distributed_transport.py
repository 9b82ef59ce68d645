"""The distributed weight transport: the trainer (rank 0 of SGLang's weight-update group) broadcasts the weights
in buckets to every engine, which receive them through `/update_weights_from_distributed` (SGLang 0.5.6's route,
also served by the embedded engine: `engines/weight_routes.py`). See `DistributedTransport`.

Why buckets and not one broadcast per tensor (SGLang's default load format): one collective and one HTTP call per
bucket instead of per tensor (a Qwen2 layer has ~12 tensors) keeps the per-call overhead out of the pause window.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rllm.experimental.fully_async.engines.client import (
    EngineClient,
    EngineConnectionError,
    EngineError,
    EngineHTTPError,
    EngineTimeoutError,
)
from rllm.experimental.fully_async.engines.http import CONNECTION_ERRORS
from rllm.experimental.fully_async.engines.weight_group import (
    FLATTENED_BUCKET,
    destroy_group,
    flatten_bucket,
    init_custom_process_group,
    parse_dtype,
)
from rllm.experimental.fully_async.runtime.weight_transport import StagedWeights

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Bucket:
    """One `/update_weights_from_distributed` call: its tensors' metadata and their bytes as one flat tensor."""

    names: list[str]
    dtypes: list[str]  # "float32", not "torch.float32": SGLang resolves them with getattr(torch, dtype)
    shapes: list[list[int]]
    flat: torch.Tensor  # uint8, SGLang's FlattenedTensorBucket layout


def plan_buckets(state: Mapping[str, torch.Tensor], bucket_bytes: int, dtype: str | None) -> list[_Bucket]:
    """Cast floating tensors to `dtype` and pack them in order into buckets of at most `bucket_bytes`; a tensor
    larger than a bucket travels alone in an oversized one (a call carries whole tensors only)."""
    target = parse_dtype(dtype) if dtype is not None else None
    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in state.items():
        t = tensor.detach()
        if target is not None and t.is_floating_point():
            t = t.to(target)
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, t))
        size += nbytes
    return [
        _Bucket(
            names=[n for n, _ in group],
            dtypes=[str(t.dtype).removeprefix("torch.") for _, t in group],
            shapes=[list(t.shape) for _, t in group],
            flat=flatten_bucket([t for _, t in group]),
        )
        for group in groups
        if group
    ]


def module_state(module: torch.nn.Module) -> Callable[[], dict[str, torch.Tensor]]:
    """A `state_fn` for `DistributedTransport`: the module's full tensors by name. FSDP2-sharded tensors (DTensor)
    are gathered with `full_tensor()`, a collective: at world size > 1 every trainer rank must call it, and rank 0
    (the one in the weight-update group) sends. Tied weights are sent once, under their first name."""

    def gather() -> dict[str, torch.Tensor]:
        from torch.distributed.tensor import DTensor

        out: dict[str, torch.Tensor] = {}
        seen: set[tuple[int, int]] = set()
        for name, tensor in module.state_dict().items():
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
            if key in seen:
                continue
            seen.add(key)
            out[name] = tensor
        return out

    return gather


class DistributedTransport:
    """Weights broadcast from the trainer (rank 0) to every engine through SGLang's weight-update group.

    stage:    `state_fn()` gives the full tensors (collective across trainer ranks); they are cast to `dtype` (the
              engines' dtype) and packed into buckets of `bucket_mb` BEFORE the pause, so the pause holds only
              the transfer. The newest staged buckets are kept (host or GPU memory: one model copy in `dtype`).
    load_all: while the engines are paused, per bucket: one `/update_weights_from_distributed` call to every
              engine (load_format=flattened_bucket) CONCURRENT with one broadcast from rank 0 (the calls block
              until the broadcast completes). `weight_version` rides on the last bucket only.
    The group (`/init_weights_update_group` on every engine, concurrent with rank 0 joining; a TCP store that
    rank 0 hosts on `master_address`, port picked by the OS) is built at the first load and rebuilt, under a
    new name, whenever the set of engines changes. An engine that restarts therefore rejoins by a rebuild:
    `ParamSync.replace_engine` loads the kept buckets into it through a group of its own, and the next sync
    rebuilds the group over all engines. An engine that fails mid-sync (e.g. killed) is reported failed; the
    others, which may hold part of the version, get all buckets again through a group without it.
    Backend: nccl when CUDA is available (buckets live on the GPU), else gloo: the same code on CPU.
    Every rendezvous and broadcast has `timeout_s` (the load's timeout), and errors name the engine and version.
    """

    def __init__(
        self,
        state_fn: Callable[[], Mapping[str, torch.Tensor]],
        *,
        bucket_mb: float = 256.0,
        dtype: str | None = None,
        backend: str = "auto",
        master_address: str = "127.0.0.1",
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
        self.group_name: str | None = None
        self.members: list[str] = []
        self._pg: dist.ProcessGroup | None = None
        self._store: dist.TCPStore | None = None
        self._builds = 0
        self._staged: tuple[int, list[_Bucket]] | None = None
        self._in_flight: asyncio.Future[Any] | None = None  # a broadcast left running when its group failed

    def stage(self, write_weights: Callable[[str], None], version: int) -> StagedWeights:
        """Gather, cast and pack the weights (`write_weights` is not used: nothing goes to disk)."""
        buckets = plan_buckets(self.state_fn(), self.bucket_bytes, self.dtype)
        if self.backend == "nccl":
            buckets = [dataclasses.replace(b, flat=b.flat.to("cuda", non_blocking=True)) for b in buckets]
        self._staged = (version, buckets)
        nbytes = sum(b.flat.numel() for b in buckets)
        return StagedWeights(version=version, location=f"broadcast: {len(buckets)} bucket(s)", nbytes=nbytes)

    async def load(self, client: EngineClient, url: str, staged: StagedWeights, *, timeout_s: float) -> None:
        failures = await self.load_all(client, [url], staged, timeout_s=timeout_s)
        if url in failures:
            raise failures[url]

    def release(self, staged: StagedWeights, engine_versions: dict[str, int | None]) -> None:
        """Nothing to free: the newest buckets are kept for an engine that restarts."""

    async def load_all(
        self, client: EngineClient, urls: list[str], staged: StagedWeights, *, timeout_s: float
    ) -> dict[str, BaseException]:
        """Send `staged` to every engine in `urls`; returns the engines that failed and why (the others hold it)."""
        if self._staged is None or self._staged[0] != staged.version:
            raise ValueError(f"version {staged.version} is not the one staged last; stage it again")
        buckets = self._staged[1]
        failures: dict[str, BaseException] = {}
        targets = list(urls)
        for attempt in range(2):  # a retry only over the engines that did not fail
            try:
                await self._ensure_group(client, targets, timeout_s)
                bad = await self._send(client, targets, buckets, staged.version, timeout_s)
            except _GroupError as exc:
                bad = exc.failures
            if not bad:
                return failures
            self._drop_group(client, [u for u in targets if u not in bad], timeout_s)
            failures.update(bad)
            targets = [u for u in targets if u not in bad]
            if not targets:
                break
            if attempt == 0:
                logger.warning("weights v%d: %s failed; resending to %s in a new group", staged.version, bad, targets)
        for url in targets:
            failures[url] = EngineError(f"{url}: weights v{staged.version} failed again after a group rebuild")
        return failures

    async def _ensure_group(self, client: EngineClient, urls: list[str], timeout_s: float) -> None:
        if self._pg is not None and self.members == urls:
            return
        if self._pg is not None:
            self._drop_group(client, urls, timeout_s)
        self._builds += 1
        # Unique per build: an engine may still hold an earlier group (other transports, failed rebuilds).
        name = f"rllm_weights_{os.getpid()}_{self._builds}_{uuid.uuid4().hex[:6]}"
        # An engine of tp_size T holds T ranks of the group (SGLang: rank = rank_offset + tp_rank).
        infos = await asyncio.gather(
            *(client.get_server_info(u, timeout_s=timeout_s) for u in urls), return_exceptions=True
        )
        failed = {u: i for u, i in zip(urls, infos, strict=True) if isinstance(i, BaseException)}
        if failed:
            raise _GroupError(failed)
        tp = [int(info.get("tp_size") or 1) for info in infos]  # type: ignore[union-attr]
        world_size = 1 + sum(tp)
        store = dist.TCPStore(
            self.master_address, 0, world_size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
        offsets = [1 + sum(tp[:i]) for i in range(len(urls))]
        calls = [
            self._post(
                client,
                url,
                "/init_weights_update_group",
                {
                    "master_address": self.master_address,
                    "master_port": store.port,
                    "rank_offset": offset,
                    "world_size": world_size,
                    "group_name": name,
                    "backend": self.backend,
                },
                timeout_s,
                f"joining weight-update group {name}",
            )
            for url, offset in zip(urls, offsets, strict=True)
        ]
        join = asyncio.ensure_future(
            asyncio.to_thread(
                init_custom_process_group,
                backend=self.backend,
                store=store,
                world_size=world_size,
                rank=0,
                group_name=name,
                timeout_s=timeout_s,
            )
        )
        answers = await asyncio.gather(*calls, return_exceptions=True)
        failures = {u: a for u, a in zip(urls, answers, strict=True) if isinstance(a, BaseException)}
        if failures:
            # Rank 0's join would wait for the missing ranks until the timeout: leave it to fail on its own.
            join.add_done_callback(lambda f: f.cancelled() or (f.exception() is None and destroy_group(f.result())))
            raise _GroupError(failures)
        try:
            pg = await asyncio.wait_for(join, timeout=timeout_s)
        except Exception as exc:
            raise _GroupError({u: EngineError(f"{u}: group {name} did not form: {exc!r}") for u in urls}) from exc
        self._pg, self._store, self.group_name, self.members = pg, store, name, list(urls)
        logger.info(
            "weight-update group %s built over %d engine(s) (%s, world size %d)",
            name,
            len(urls),
            self.backend,
            world_size,
        )

    async def _send(
        self, client: EngineClient, urls: list[str], buckets: list[_Bucket], version: int, timeout_s: float
    ) -> dict[str, BaseException]:
        pg = self._pg
        assert pg is not None
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            payload = {
                "names": bucket.names,
                "dtypes": bucket.dtypes,
                "shapes": bucket.shapes,
                "group_name": self.group_name,
                "flush_cache": last,
                "abort_all_requests": False,
                "weight_version": str(version) if last else None,
                "load_format": FLATTENED_BUCKET,
            }
            what = f"weights v{version} bucket {i + 1}/{len(buckets)}"
            calls = [self._post(client, u, "/update_weights_from_distributed", payload, timeout_s, what) for u in urls]
            broadcast = asyncio.ensure_future(asyncio.to_thread(dist.broadcast, bucket.flat, 0, pg))
            answers = await asyncio.gather(*calls, return_exceptions=True)
            bad = {u: a for u, a in zip(urls, answers, strict=True) if isinstance(a, BaseException)}
            if bad:
                # The broadcast may wait for a dead rank until the group's timeout: leave it, the group is dropped.
                self._in_flight = broadcast
                broadcast.add_done_callback(lambda f: f.cancelled() or f.exception())
                return bad
            try:
                await asyncio.wait_for(broadcast, timeout=timeout_s)
            except Exception as exc:
                return {u: EngineError(f"{u}: broadcast of {what} failed: {exc!r}") for u in urls}
        return {}

    async def _post(
        self, client: EngineClient, url: str, path: str, payload: dict[str, Any], timeout_s: float, what: str
    ) -> None:
        """One call, no retry (a re-sent call would wait for a broadcast that already happened)."""
        try:
            body = await client.pool.engine(url).http.request("POST", path, payload, timeout_s)
        except CONNECTION_ERRORS as exc:
            raise EngineConnectionError(f"{url}{path} ({what}): engine unreachable: {exc!r}") from exc
        except EngineTimeoutError as exc:
            raise EngineTimeoutError(f"{exc} ({what})") from exc
        if not isinstance(body, dict) or not body.get("success", False):
            raise EngineHTTPError(url, path, 200, f"{body} ({what})")

    def _drop_group(self, client: EngineClient, survivors: list[str], timeout_s: float) -> None:
        """Forget the current group. Engines keep their end until told (best effort, in the background)."""
        pg, name = self._pg, self.group_name
        self._pg, self.group_name, self.members = None, None, []
        if pg is not None:
            in_flight = self._in_flight
            if in_flight is not None and not in_flight.done():
                in_flight.add_done_callback(lambda _f: destroy_group(pg))  # never destroy under a running broadcast
            else:
                destroy_group(pg)
            self._in_flight = None
        for url in survivors if name else []:
            task = asyncio.ensure_future(
                self._post(client, url, "/destroy_weights_update_group", {"group_name": name}, timeout_s, "leave")
            )
            task.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._store = None

    def close(self) -> None:
        """Leave the group (trainer side)."""
        if self._pg is not None and (self._in_flight is None or self._in_flight.done()):
            destroy_group(self._pg)
        self._pg, self._store, self._staged = None, None, None


class _GroupError(Exception):
    def __init__(self, failures: dict[str, BaseException]) -> None:
        super().__init__("; ".join(f"{u}: {e}" for u, e in failures.items()))
        self.failures = failures
