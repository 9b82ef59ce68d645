"""ParamSync: push the trainer's new weights to every engine - write, pause(abort), load, continue.

    sync(write_weights, v):  stage (trainer writes weights; engines keep generating)
                             -> pause(mode=abort) all engines   (in-flight requests return; clients re-send,
                                                                 engines hold the re-sent requests)
                             -> each engine loads the staged weights,
                                then /update_weight_version str(v), then /get_weight_version must read str(v)
                             -> continue all engines             (held requests start on version v)

Why the version is set separately and read back: SGLang 0.5.6's `/update_weights_from_disk` returns early when
the engine is paused, WITHOUT applying its `weight_version` (`tokenizer_manager.update_weights_from_disk`), so a
version passed with the load alone never reaches a real engine. An engine that does not read back the pushed
version fails the sync with a SyncError naming it (read back, never assumed:
docs/design.md#rule-versions-on-every-token).

The paused window (`SyncReport.pause_s`) is only the load, because writing happens before the pause. Engines are
always continued, also when a load fails or an engine is dead, so nothing stays paused; the failure is then
raised as `SyncError`, naming each failing engine URL and the version being pushed. Every engine call has a
timeout, and the whole sync has an overall guard.

How weights travel is a `WeightTransport`: `DiskTransport` (a shared directory of HF safetensors folders, via
SGLang's `/update_weights_from_disk`) or `DistributedTransport` (the trainer broadcasts buckets while the engines
receive through `/init_weights_update_group` + `/update_weights_from_distributed`; gloo on CPU, NCCL on GPU; with
several FSDP trainer ranks, rank 0 broadcasts and every rank gathers: `sender.py`). The latter is a
`CollectiveTransport`: its load is one call over all paused engines (`load_all`), after which each
engine's version is set and read back as for disk.

Engines come and go between syncs: `remove_engine` drops one whose process died (or that left), `replace_engine`
adds its restarted successor after loading the weights the others were last given, so it joins at the trainer's
version (LoRA: the adapter versions still kept, the newest last, so a request re-sent from the dead engine keeps its
own), and `add_engine` does the same for an engine that joins with no predecessor (`engines add`/`register`:
docs/design.md#rule-engine-set-can-change). All take the sync lock, so a membership change never interleaves with a
sync and versions reach engines in order. With the distributed transport a joiner receives the kept buckets through
a group of its own, and the next sync rebuilds the group over every engine (runtime/sync/distributed.py).

LoRA (`lora_keep` set; docs/design.md#rule-one-version-per-lora-sample): the trainer writes only the adapter, a peft
folder per version (`DiskTransport`), and every engine loads it with `/load_lora_adapter` as `policy-v<v>`
(engines/lora.py) while it goes on generating: no pause, no abort, no `/update_weight_version` (SGLang's aborts
every request by default), and the base weights never move. A request names its adapter when it is sent (the
rollout client names the newest version, engines/client.py) and the engine holds that adapter until the request
ends, so a sample's tokens come from one version. Old versions are unloaded by the side that knows when no
request uses them any more: the rollout client (engines/client.py, `lora_keep`), not here: an engine's unload holds
its LoRA update lock until the adapter's requests end, so one sent while they run would hold up the next load.
`engine_versions` then holds each engine's newest adapter version.

The trainer's code is synchronous (a Ray actor), so `ParamSync` runs its `EngineClient` on a private event
loop in a daemon thread and `sync()` blocks. It knows nothing of Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rllm.experimental.fully_async.api.weight_transport import CollectiveTransport, StagedWeights, WeightTransport
from rllm.experimental.fully_async.engines.client import EngineClient, EngineConnectionError, EngineError
from rllm.experimental.fully_async.engines.lora import adapter_name
from rllm.experimental.fully_async.errors import FullyAsyncError
from rllm.experimental.fully_async.runtime.sync.disk import DiskTransport
from rllm.experimental.fully_async.runtime.sync.distributed import DistributedTransport
from rllm.experimental.fully_async.runtime.sync.sender import module_state, module_tensors  # re-exported

__all__ = [
    "CollectiveTransport",
    "DiskTransport",
    "DistributedTransport",
    "ParamSync",
    "StagedWeights",
    "SyncError",
    "SyncReport",
    "WeightTransport",
    "module_state",
    "module_tensors",
    "transport_from_config",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class SyncReport:
    """What one sync did and how long each part took (seconds)."""

    version: int
    write_s: float  # staging (trainer writes weights); engines still generating
    pause_s: float  # engines paused: first pause sent .. last continue acknowledged
    update_s: float  # loading on all engines (inside the paused window)
    total_s: float
    num_engines: int
    nbytes: int
    location: str


class SyncError(FullyAsyncError, RuntimeError):
    """A sync failed on some engines; live engines were resumed. `failures` maps engine URL -> reason."""

    def __init__(
        self, version: int, failures: dict[str, str], updated: list[str], unreachable: list[str] | None = None
    ) -> None:
        lines = "; ".join(f"{url}: {reason}" for url, reason in failures.items())
        super().__init__(
            f"weight sync to version {version} failed on {len(failures)} engine(s): {lines}. "
            f"Updated: {updated or 'none'}; every reachable engine was resumed."
        )
        self.version, self.failures, self.updated = version, failures, updated
        # Engines that refused connections (process gone), as opposed to ones that answered with an error.
        self.unreachable = unreachable or []

    def __reduce__(self) -> tuple:
        # Rebuilt from the constructor's arguments: a Ray actor's exception crosses processes by pickle, and the
        # default (the message as the only argument) would not fit this __init__.
        return (type(self), (self.version, self.failures, self.updated, self.unreachable))


SYNC_DTYPES = ("float32", "bfloat16")
TRANSPORTS = ("disk", "distributed", "nccl")  # nccl: alias of distributed (verl/rLLM spelling; gloo on CPU)


def transport_from_config(
    param_sync: Any, backend: Any, dtype: str | None, *, master_address: str = "127.0.0.1"
) -> WeightTransport:
    """The transport `param_sync.transport` names: disk -> `DiskTransport(param_sync.weights_dir)`; distributed or
    nccl -> `DistributedTransport.for_backend` in buckets of `param_sync.bucket_mb`, cast to `dtype`, reached by the
    engines at `master_address` (`resolve_master_address`)."""
    kind = str(param_sync.transport)
    if kind == "disk":
        return DiskTransport(Path(param_sync.weights_dir))
    if kind in ("distributed", "nccl"):
        return DistributedTransport.for_backend(backend, float(param_sync.bucket_mb), dtype, master_address)
    raise ValueError(f"param_sync.transport={kind!r}: use one of {', '.join(TRANSPORTS)}")


def resolve_sync_dtype(setting: str, trainer_device: str, param_dtype: str) -> str:
    """The dtype weights travel in (`param_sync.dtype`): auto is bfloat16 when the trainer runs on CUDA (the
    engines serve bf16; fp32 would double every sync's bytes), else the trainer's parameter dtype."""
    if setting == "auto":
        return "bfloat16" if trainer_device.startswith(("cuda", "gpu")) else param_dtype.removeprefix("torch.")
    if setting not in SYNC_DTYPES:
        raise ValueError(f"param_sync.dtype={setting!r}: use auto, float32 or bfloat16")
    return setting


@dataclass
class _Outcome:
    failures: dict[str, str] = field(default_factory=dict)
    unreachable: set[str] = field(default_factory=set)
    updated: list[str] = field(default_factory=list)
    paused_at: float = 0.0
    resumed_at: float = 0.0
    update_s: float = 0.0


class ParamSync:
    """Blocking pause-push-resume weight sync to a fixed set of engines (see the module docstring).

    Timeouts: `pause_timeout_s` per pause call, `update_timeout_s` per engine load, `continue_timeout_s` per
    continue call; `sync()` additionally gives up after their sum plus a margin.
    """

    def __init__(
        self,
        engine_urls: list[str],
        transport: WeightTransport,
        *,
        pause_timeout_s: float = 60.0,
        update_timeout_s: float = 600.0,
        continue_timeout_s: float = 60.0,
        connect_retries: int = 2,
        api_key: str | None = None,
        weights_dtype: str | None = None,
        lora_keep: int | None = None,
    ) -> None:
        if not engine_urls:
            raise ValueError("ParamSync needs at least one engine URL")
        if lora_keep is not None and (lora_keep < 1 or not isinstance(transport, DiskTransport)):
            raise ValueError("LoRA adapters sync by disk (a DiskTransport), keeping at least one version loaded")
        # LoRA: adapter versions each engine keeps loaded (η_max + 1); None: full weights, paused per sync
        self.lora_keep = lora_keep
        self.adapters: dict[str, list[int]] = {u.rstrip("/"): [] for u in engine_urls}  # versions loaded, oldest first
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self.transport = transport
        # Passed to write_weights(path, dtype=...) when set (`resolve_sync_dtype`); None: the writer's own dtype.
        self.weights_dtype = weights_dtype
        self.pause_timeout_s = pause_timeout_s
        self.update_timeout_s = update_timeout_s
        self.continue_timeout_s = continue_timeout_s
        # What each engine serves, as far as this object knows (None: unknown, e.g. after a failed update).
        self.engine_versions: dict[str, int | None] = dict.fromkeys(self.engine_urls)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="param-sync-loop", daemon=True)
        self._thread.start()
        self._client = EngineClient(
            self.engine_urls,
            admin_timeout_s=max(pause_timeout_s, continue_timeout_s),
            connect_retries=connect_retries,
            # ParamSync addresses each engine itself; dead-marking is the rollout client's business.
            dead_after_failures=1 << 30,
            api_key=api_key,
        )
        self._closed = False
        self._sync_lock = threading.Lock()  # one sync or replacement at a time: versions reach engines in order
        self._last_staged: StagedWeights | None = None  # what a restarted engine must load to catch up

    def __enter__(self) -> ParamSync:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def remove_engine(self, url: str, *, allow_none_left: bool = False) -> None:
        """Stop syncing to an engine that is gone (its process died); later syncs address the others.

        `allow_none_left`: the last engine may go too (a restart is on its way: syncs until then only stage the
        weights, and `replace_engine` loads the newest into the restarted engine).
        """
        url = url.rstrip("/")
        with self._sync_lock:
            if url not in self.engine_urls:
                return
            if len(self.engine_urls) == 1 and not allow_none_left:
                raise ValueError(f"cannot remove {url}: it is the last engine")
            self.engine_urls = [u for u in self.engine_urls if u != url]
            self.engine_versions.pop(url, None)
            self.adapters.pop(url, None)
            self._client.pool.remove_engine(url)  # a dict entry: no call is in flight outside a sync (the lock)
        logger.warning("engine %s removed from weight syncs; %d engine(s) left", url, len(self.engine_urls))

    def replace_engine(self, old_url: str, new_url: str) -> int:
        """Sync to `new_url` (a restarted engine) instead of `old_url`, after loading into it the weights the other
        engines were last given. Returns the version it serves. Raises SyncError naming it if the load fails.

        Before any sync the engines serve their launch weights, so nothing is loaded and the engine's own version
        is taken. The lock waits for a sync in progress: the new engine then gets that sync's weights.
        """
        old_url, new_url = old_url.rstrip("/"), new_url.rstrip("/")
        with self._sync_lock:
            if self._closed:
                raise RuntimeError("ParamSync is closed")
            staged = self._last_staged
            target = staged.version if staged is not None else 0
            timeout_s = self.update_timeout_s + self.pause_timeout_s + 30.0
            try:
                version = self._run(
                    self._load_into(old_url, new_url, staged),
                    timeout_s=timeout_s,
                    what=f"loading weights version {target} into restarted engine {new_url}",
                )
            except Exception as exc:
                raise SyncError(target, {new_url: f"{type(exc).__name__}: {exc}"}, []) from exc
            if staged is not None and version != staged.version:
                raise SyncError(target, {new_url: f"reports weight_version {version} after loading {target}"}, [])
            if old_url in self.engine_urls:
                self.engine_urls[self.engine_urls.index(old_url)] = new_url
            else:
                self.engine_urls.append(new_url)
            self.engine_versions.pop(old_url, None)
            self.engine_versions[new_url] = version
        logger.info("engine %s replaced by %s at weight version %d", old_url, new_url, version)
        return version

    def add_engine(self, url: str, api_key: str | None = None) -> int:
        """Sync to `url` too (an engine that joins the run), after loading into it the weights the other engines
        were last given; returns the version it serves. Raises SyncError naming it if the load fails (it is then
        not synced to). Before any sync, its weight version is set to 0 and read back: it serves the model the run
        started from (the caller checked which model it serves), whatever version it was launched with. `api_key`: the
        engine's own (a registered server's), else the run's."""
        url = url.rstrip("/")
        with self._sync_lock:
            if self._closed:
                raise RuntimeError("ParamSync is closed")
            if url in self.engine_urls:
                raise ValueError(f"{url} is already synced to")
            staged = self._last_staged
            target = staged.version if staged is not None else 0
            try:
                version = self._run(
                    self._load_into(None, url, staged, api_key),
                    timeout_s=self.update_timeout_s + self.pause_timeout_s + 30.0,
                    what=f"loading weights version {target} into joining engine {url}",
                )
                if version != target:
                    raise EngineError(f"{url} reports weight_version {version} after loading {target}")
            except Exception as exc:
                self._client.pool.remove_engine(url)
                raise SyncError(target, {url: f"{type(exc).__name__}: {exc}"}, []) from exc
            self.engine_urls.append(url)
            self.engine_versions[url] = version
        logger.info("engine %s joined weight syncs at version %d", url, version)
        return version

    async def _load_into(
        self, old_url: str | None, new_url: str, staged: StagedWeights | None, api_key: str | None = None
    ) -> int:
        """Load `staged` into `new_url`, which takes `old_url`'s place (None: it joins with no predecessor, and
        with nothing staged yet its version is set to 0)."""
        if old_url is None:
            self._client.add_engine(new_url, api_key)
            if staged is None and self.lora_keep is None:
                await self._client.update_weight_version(new_url, "0", timeout_s=self.pause_timeout_s)
        else:
            self._client.replace_engine(old_url, new_url)
            self.adapters.pop(old_url, None)
        if self.lora_keep is not None:
            self.adapters[new_url] = []
            if staged is None:
                return int(await self._client.get_weight_version(new_url, timeout_s=self.pause_timeout_s))
            for kept in self._kept_adapters(staged):  # oldest first, the newest last: requests name it from now on
                await self._load_adapter(new_url, kept)
            return staged.version
        if staged is not None and isinstance(self.transport, CollectiveTransport):
            # Several calls (buckets) are atomic for requests only while paused; a disk load is atomic by itself.
            await self._client.pause_generation(new_url, "abort", timeout_s=self.pause_timeout_s)
            try:
                await self._load_and_verify(new_url, staged)
            finally:
                await self._client.continue_generation(new_url, timeout_s=self.continue_timeout_s)
        elif staged is not None:
            await self._load_and_verify(new_url, staged)
        return int(await self._client.get_weight_version(new_url, timeout_s=self.pause_timeout_s))

    def _kept_adapters(self, newest: StagedWeights) -> list[StagedWeights]:
        """LoRA: the adapter versions a restarted engine loads, oldest first: the `lora_keep` newest (η_max + 1, the
        versions the staleness bound admits) whose folders are still staged. A request re-sent from the dead engine
        names the version it started with and keeps it (docs/design.md#rule-one-version-per-lora-sample); with the
        newest alone, one naming an older kept version would fail where no other engine serves it. Older versions
        are not loaded: the rollout client may have unloaded them everywhere, and a sample of one would be dropped
        as stale."""
        if not isinstance(self.transport, DiskTransport) or self.lora_keep is None:
            return [newest]  # not a LoRA sync (__init__ allows LoRA by disk only)
        older = []
        for version in range(max(0, newest.version - self.lora_keep + 1), newest.version):
            folder = self.transport.path_for(version)
            if (folder / "adapter_config.json").is_file():
                older.append(StagedWeights(version=version, location=str(folder), nbytes=0))
        return [*older, newest]

    async def _load_and_verify(self, url: str, staged: StagedWeights) -> None:
        """Load `staged` into engine `url`, set its weight version, and read it back (see the module docstring)."""
        await self.transport.load(self._client, url, staged, timeout_s=self.update_timeout_s)
        await self._set_and_verify(url, staged)

    async def _set_and_verify(self, url: str, staged: StagedWeights) -> None:
        expected = str(staged.version)
        await self._client.update_weight_version(url, expected, timeout_s=self.pause_timeout_s)
        reported = await self._client.get_weight_version(url, timeout_s=self.pause_timeout_s)
        if reported != expected:
            raise EngineError(f"{url} reports weight_version {reported!r} after being set to {expected!r}")

    def close(self) -> None:
        """Close the HTTP session and stop the private event loop (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._run(self._client.aclose(), timeout_s=10.0, what="closing the HTTP session")
        if hasattr(self.transport, "close"):
            self.transport.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10.0)
        self._loop.close()

    def _run(self, coro: Coroutine[Any, Any, T], *, timeout_s: float, what: str) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError as exc:
            future.cancel()
            raise TimeoutError(f"timed out after {timeout_s:.0f}s {what}") from exc

    def sync(self, write_weights: Callable[[str], None], new_version: int) -> SyncReport:
        """Write the weights with `write_weights(path)`, then pause, load as `new_version`, and resume all engines.

        Raises SyncError (engines resumed) if any engine fails; the error names the engines and the version.
        """
        with self._sync_lock:
            return self._sync(write_weights, new_version)

    def _sync(self, write_weights: Callable[[str], None], new_version: int) -> SyncReport:
        if self._closed:
            raise RuntimeError("ParamSync is closed")
        start = time.perf_counter()
        if self.weights_dtype is not None:
            dtype, write = self.weights_dtype, write_weights
            write_weights = lambda path: write(path, dtype=dtype)  # noqa: E731
        staged = self.transport.stage(write_weights, new_version)
        self._last_staged = staged
        write_s = time.perf_counter() - start
        if self.lora_keep is not None:
            return self._sync_adapter(staged, start, write_s)
        # Twice the update: a collective load resends once to the engines left when one fails mid-broadcast.
        guard_s = self.pause_timeout_s + 2 * self.update_timeout_s + self.continue_timeout_s + 30.0
        outcome = self._run(self._push(staged), timeout_s=guard_s, what=f"syncing weights version {new_version}")
        self.transport.release(staged, self.engine_versions)
        if outcome.failures:
            raise SyncError(new_version, outcome.failures, outcome.updated, sorted(outcome.unreachable))
        report = SyncReport(
            version=new_version,
            write_s=write_s,
            pause_s=outcome.resumed_at - outcome.paused_at,
            update_s=outcome.update_s,
            total_s=time.perf_counter() - start,
            num_engines=len(self.engine_urls),
            nbytes=staged.nbytes,
            location=staged.location,
        )
        logger.info(
            "weights v%d synced to %d engine(s): write %.3fs, paused %.3fs (load %.3fs), total %.3fs, %.1f MB",
            new_version,
            report.num_engines,
            report.write_s,
            report.pause_s,
            report.update_s,
            report.total_s,
            report.nbytes / 1e6,
        )
        return report

    def _sync_adapter(self, staged: StagedWeights, start: float, write_s: float) -> SyncReport:
        """LoRA: load the staged adapter on every engine as `policy-v<version>`, no pause (module docstring)."""
        out = _Outcome()
        guard_s = self.update_timeout_s + 30.0
        out.updated = self._run(
            self._on_all(self.engine_urls, lambda u: self._load_adapter(u, staged), out),
            timeout_s=guard_s,
            what=f"loading LoRA adapter version {staged.version}",
        )
        for url in self.engine_urls:
            self.engine_versions[url] = staged.version if url in out.updated else None
        self.transport.release(staged, self.engine_versions)
        if out.failures:
            raise SyncError(staged.version, out.failures, out.updated, sorted(out.unreachable))
        report = SyncReport(
            version=staged.version,
            write_s=write_s,
            pause_s=0.0,  # never paused
            update_s=time.perf_counter() - start - write_s,
            total_s=time.perf_counter() - start,
            num_engines=len(self.engine_urls),
            nbytes=staged.nbytes,
            location=staged.location,
        )
        logger.info(
            "adapter %s loaded on %d engine(s) without a pause: write %.3fs, load %.3fs, %.2f MB",
            adapter_name(staged.version),
            report.num_engines,
            report.write_s,
            report.update_s,
            report.nbytes / 1e6,
        )
        return report

    async def _load_adapter(self, url: str, staged: StagedWeights) -> None:
        loaded = self.adapters.setdefault(url, [])
        if staged.version in loaded:
            return  # this engine has it already (a sync repeated after another engine failed)
        await self._client.load_lora_adapter(
            url, adapter_name(staged.version), staged.location, timeout_s=self.update_timeout_s
        )
        loaded.append(staged.version)

    async def _push(self, staged: StagedWeights) -> _Outcome:
        out = _Outcome()
        client = self._client
        out.paused_at = time.perf_counter()
        if not self.engine_urls:  # every engine left: the weights are staged for the next one to join
            out.resumed_at = out.paused_at
            return out
        try:
            paused = await self._on_all(
                self.engine_urls, lambda u: client.pause_generation(u, "abort", timeout_s=self.pause_timeout_s), out
            )
            load_start = time.perf_counter()
            if isinstance(self.transport, CollectiveTransport):
                failed = await self.transport.load_all(client, paused, staged, timeout_s=self.update_timeout_s)
                for url, exc in failed.items():
                    out.failures.setdefault(url, f"{type(exc).__name__}: {exc}")
                    if isinstance(exc, EngineConnectionError):
                        out.unreachable.add(url)
                loaded = [u for u in paused if u not in failed]
                out.updated = await self._on_all(loaded, lambda u: self._set_and_verify(u, staged), out)
            else:
                out.updated = await self._on_all(paused, lambda u: self._load_and_verify(u, staged), out)
            out.update_s = time.perf_counter() - load_start
            for url in out.updated:
                self.engine_versions[url] = staged.version
            for url in set(paused) - set(out.updated):
                self.engine_versions[url] = None
        finally:
            # Continue every engine, not only those whose pause answered: a pause may have landed even if its
            # answer was lost. Shielded so a cancelled sync still resumes them.
            await asyncio.shield(
                self._on_all(
                    self.engine_urls,
                    lambda u: client.continue_generation(u, timeout_s=self.continue_timeout_s),
                    out,
                )
            )
            out.resumed_at = time.perf_counter()
        return out

    @staticmethod
    async def _on_all(urls: list[str], call: Callable[[str], Coroutine[Any, Any, Any]], out: _Outcome) -> list[str]:
        """Run `call` on every URL concurrently; record failures in `out`, return the URLs that succeeded."""
        results = await asyncio.gather(*(call(u) for u in urls), return_exceptions=True)
        ok = []
        for url, res in zip(urls, results, strict=True):
            if isinstance(res, asyncio.CancelledError):
                raise res
            if isinstance(res, BaseException):
                out.failures.setdefault(url, f"{type(res).__name__}: {res}")
                if isinstance(res, EngineConnectionError):
                    out.unreachable.add(url)
            else:
                ok.append(url)
        return ok
