"""The distributed weight transport: trainer rank 0 (rank 0 of SGLang's weight-update group) broadcasts the
weights in buckets to every engine, which receive them through `/update_weights_from_distributed` (SGLang 0.5.6's
route, also served by the embedded engine: `engines/embedded/server.py`). See `DistributedTransport`.

This module is the engines' side of the exchange (HTTP calls, group membership, retries); the collective side
(gather, buckets, store, join, broadcast) is a `GroupSender` (`sender.py`): in this process with one
trainer process, in trainer rank 0's actor with several FSDP ranks (`RankZeroSender`).

Why buckets and not one broadcast per tensor (SGLang's default load format): one collective and one HTTP call per
bucket instead of per tensor (a Qwen2 layer has ~12 tensors) keeps the per-call overhead out of the pause window.

`master_address` is the address the engines reach rank 0's store and group at: `core/addresses.py` turns
`param_sync.master_address` (auto or an address) into it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Callable
from typing import Any

from rllm.experimental.fully_async.api.policy_backend import HFWeightStream
from rllm.experimental.fully_async.api.weight_transport import StagedWeights
from rllm.experimental.fully_async.engines.client import (
    EngineClient,
    EngineConnectionError,
    EngineError,
    EngineHTTPError,
    EngineTimeoutError,
)
from rllm.experimental.fully_async.engines.http import CONNECTION_ERRORS
from rllm.experimental.fully_async.engines.weight_group import FLATTENED_BUCKET
from rllm.experimental.fully_async.runtime.sync.sender import (
    BucketHeader,
    GroupSender,
    LocalSender,
    Tensors,
    backend_tensors,
    plan_buckets,
)

logger = logging.getLogger(__name__)

__all__ = ["DistributedTransport", "plan_buckets"]

LOOPBACK = "127.0.0.1"


class DistributedTransport:
    """Weights broadcast from trainer rank 0 to every engine through SGLang's weight-update group.

    stage:    the sender gathers the full tensors (a collective across trainer ranks), casts them to `dtype` (the
              engines' dtype) and packs them into buckets of `bucket_mb` BEFORE the pause, so the pause holds only
              the transfer. Rank 0 keeps the newest buckets (host or GPU memory: one model copy in `dtype`).
    load_all: while the engines are paused, per bucket: one `/update_weights_from_distributed` call to every
              engine (load_format=flattened_bucket) CONCURRENT with one broadcast from rank 0 (the calls block
              until the broadcast completes). `weight_version` rides on the last bucket only.
    The group (`/init_weights_update_group` on every engine, concurrent with rank 0 joining; a TCP store that
    rank 0 hosts, reached at `master_address`, port picked by the OS) is built at the first load and rebuilt,
    under a new name, whenever the set of engines changes. An engine that restarts therefore rejoins by a rebuild:
    `ParamSync.replace_engine` loads the kept buckets into it through a group of its own, and the next sync
    rebuilds the group over all engines. An engine that fails mid-sync (e.g. killed) is reported failed; the
    others, which may hold part of the version, get all buckets again through a group without it. That includes an
    engine whose load failed only because rank 0's broadcast failed first (gloo's root raises at a peer it knows is
    dead before it sends to the next one): rank 0 then leaves the group at once, so such an engine's receive fails
    at once too, and it is retried, not blamed.
    Backend: nccl when the sender's device is CUDA (buckets live on the GPU), else gloo: the same code on CPU.
    Every rendezvous and broadcast has `timeout_s` (the load's timeout), and errors name the engine and version.

    Give `state_fn` (the full tensors: a dict or a stream of pairs; a `LocalSender` in this process is built from
    it with `bucket_mb`, `dtype`, `backend`) or `sender` (rank 0 elsewhere, already configured).
    """

    def __init__(
        self,
        state_fn: Callable[[], Tensors] | None = None,
        *,
        bucket_mb: float = 256.0,
        dtype: str | None = None,
        backend: str = "auto",
        master_address: str = LOOPBACK,
        sender: GroupSender | None = None,
    ) -> None:
        if (state_fn is None) == (sender is None):
            raise ValueError("give exactly one of state_fn (weights in this process) and sender (rank 0 elsewhere)")
        if sender is None:
            sender = LocalSender(
                state_fn, bucket_mb=bucket_mb, dtype=dtype, backend=backend, master_address=master_address
            )
        self.sender = sender
        self.master_address = master_address
        self.group_name: str | None = None
        self.members: list[str] = []
        self._builds = 0
        self._staged: tuple[int, list[BucketHeader]] | None = None

    @classmethod
    def for_backend(
        cls, backend: Any, bucket_mb: float, dtype: str | None, master_address: str = LOOPBACK
    ) -> DistributedTransport:
        """The transport for a policy backend: several FSDP ranks (`weight_sender`): rank 0 of them sends, every
        rank gathers (sender.RankZeroSender); Megatron (`hf_weight_stream`): its HF-named export stream, in this
        process; otherwise this process's `backend.model`, gathered tensor by tensor."""
        if hasattr(backend, "weight_sender"):
            sender = backend.weight_sender(bucket_mb=bucket_mb, dtype=dtype, master_address=master_address)
            return cls(sender=sender, master_address=master_address)
        if isinstance(backend, HFWeightStream):
            state_fn: Callable[[], Tensors] = backend.hf_weight_stream
        else:
            state_fn = lambda: backend_tensors(backend)  # noqa: E731
        return cls(state_fn, bucket_mb=bucket_mb, dtype=dtype, master_address=master_address)

    @property
    def backend(self) -> str:
        return self.sender.backend

    def stage(self, write_weights: Callable[[str], None], version: int) -> StagedWeights:
        """Gather, cast and pack the weights (`write_weights` is not used: nothing goes to disk)."""
        headers = self.sender.stage(version)
        self._staged = (version, headers)
        nbytes = sum(h.nbytes for h in headers)
        return StagedWeights(version=version, location=f"broadcast: {len(headers)} bucket(s)", nbytes=nbytes)

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
        headers = self._staged[1]
        failures: dict[str, BaseException] = {}
        targets = list(urls)
        for attempt in range(2):  # a retry only over the engines that did not fail
            try:
                await self._ensure_group(client, targets, timeout_s)
                bad = await self._send(client, targets, headers, staged.version, timeout_s)
            except _GroupError as exc:
                bad = exc.failures
            if not bad:
                return failures
            # An engine that missed a bucket because rank 0's broadcast failed (on a dead peer) is not to blame:
            # it gets the retry. On the retry every failure counts.
            blamed = bad if attempt else {u: e for u, e in bad.items() if not isinstance(e, _BroadcastMissed)}
            self._drop_group(client, [u for u in targets if u not in blamed], timeout_s)
            failures.update(blamed)
            targets = [u for u in targets if u not in blamed]
            if not targets:
                break
            if attempt == 0:
                logger.warning("weights v%d: %s failed; resending to %s in a new group", staged.version, bad, targets)
        for url in targets:
            failures[url] = EngineError(f"{url}: weights v{staged.version} failed again after a group rebuild")
        return failures

    async def _ensure_group(self, client: EngineClient, urls: list[str], timeout_s: float) -> None:
        if self.group_name is not None and self.members == urls:
            return
        if self.group_name is not None:
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
        port = await asyncio.to_thread(self.sender.open_store, name, world_size, timeout_s)
        offsets = [1 + sum(tp[:i]) for i in range(len(urls))]
        calls = [
            self._post(
                client,
                url,
                "/init_weights_update_group",
                {
                    "master_address": self.master_address,
                    "master_port": port,
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
        join = asyncio.ensure_future(asyncio.to_thread(self.sender.join, name, world_size, timeout_s))
        answers = await asyncio.gather(*calls, return_exceptions=True)
        failures = {u: a for u, a in zip(urls, answers, strict=True) if isinstance(a, BaseException)}
        if failures:
            # Rank 0's join would wait for the missing ranks until the timeout: leave it to end on its own.
            join.add_done_callback(lambda f: f.cancelled() or f.exception())
            self.sender.leave(name)
            raise _GroupError(failures)
        try:
            await asyncio.wait_for(join, timeout=timeout_s)
        except Exception as exc:
            self.sender.leave(name)
            raise _GroupError({u: EngineError(f"{u}: group {name} did not form: {exc!r}") for u in urls}) from exc
        self.group_name, self.members = name, list(urls)
        logger.info(
            "weight-update group %s built over %d engine(s) (%s, world size %d, rank 0 at %s)",
            name,
            len(urls),
            self.backend,
            world_size,
            self.master_address,
        )

    async def _send(
        self, client: EngineClient, urls: list[str], headers: list[BucketHeader], version: int, timeout_s: float
    ) -> dict[str, BaseException]:
        name = self.group_name
        assert name is not None
        for i, header in enumerate(headers):
            last = i == len(headers) - 1
            payload = {
                "names": header.names,
                "dtypes": header.dtypes,
                "shapes": header.shapes,
                "group_name": name,
                "flush_cache": last,
                "abort_all_requests": False,
                "weight_version": str(version) if last else None,
                "load_format": FLATTENED_BUCKET,
            }
            what = f"weights v{version} bucket {i + 1}/{len(headers)}"
            calls = [self._post(client, u, "/update_weights_from_distributed", payload, timeout_s, what) for u in urls]
            broadcast = asyncio.ensure_future(asyncio.to_thread(self.sender.broadcast, name, version, i))
            # gloo's root raises at the first peer it knows is dead, so the engines after it never get the bucket
            # and would wait out the group's timeout: leaving the group at once makes their receive fail now.
            broadcast.add_done_callback(lambda f: self._leave_if_failed(f, name))
            answers = await asyncio.gather(*calls, return_exceptions=True)
            bad = {u: a for u, a in zip(urls, answers, strict=True) if isinstance(a, BaseException)}
            if bad and _failed(broadcast):
                cause = broadcast.exception()
                bad = {
                    u: a
                    if isinstance(a, EngineConnectionError)
                    else _BroadcastMissed(f"{u}: missed {what}: rank 0's broadcast failed ({cause!r}); {a}")
                    for u, a in bad.items()
                }
            if bad:
                # The broadcast may wait for a dead rank until the group's timeout: leave it (its error is read by
                # `_leave_if_failed`); the sender destroys the group once it ends (the group is dropped).
                return bad
            try:
                await asyncio.wait_for(broadcast, timeout=timeout_s)
            except Exception as exc:
                return {u: EngineError(f"{u}: broadcast of {what} failed: {exc!r}") for u in urls}
        return {}

    def _leave_if_failed(self, broadcast: asyncio.Future, name: str) -> None:
        if _failed(broadcast):
            self.sender.leave(name)

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
        name = self.group_name
        self.group_name, self.members = None, []
        if name is None:
            return
        self.sender.leave(name)  # never under a running broadcast: the sender waits for it to end
        for url in survivors:
            task = asyncio.ensure_future(
                self._post(client, url, "/destroy_weights_update_group", {"group_name": name}, timeout_s, "leave")
            )
            task.add_done_callback(lambda f: f.cancelled() or f.exception())

    def close(self) -> None:
        """Leave the group (trainer side) and drop the staged buckets."""
        self.group_name, self.members, self._staged = None, [], None
        self.sender.close()


def _failed(future: asyncio.Future) -> bool:
    """Done with an exception (reading it, so asyncio never logs it as unretrieved)."""
    return future.done() and not future.cancelled() and future.exception() is not None


class _BroadcastMissed(EngineError):
    """An engine's load failed because rank 0's broadcast failed before it reached it (retried, not blamed)."""


class _GroupError(Exception):
    def __init__(self, failures: dict[str, BaseException]) -> None:
        super().__init__("; ".join(f"{u}: {e}" for u, e in failures.items()))
        self.failures = failures
