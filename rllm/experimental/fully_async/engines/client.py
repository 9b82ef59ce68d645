"""`EngineClient`: the facade rollout workflows and ParamSync use over the three engine modules.

- `http.py`: one engine's HTTP calls (every SGLang route, typed errors, timeouts naming engine and call);
- `pool.py`: the registry of engines (membership, health, dead marking, least-loaded routing, weight versions);
- `resumable.py`: generation resumed across weight updates, as a plain async function.

`EngineClient.generate` routes, fails over and resumes (see those modules). The admin calls
(`pause_generation`, `continue_generation`, `update_weights_from_disk`, ...) address one engine by URL, retrying
connection failures; `param_sync.ParamSync` uses them.

LoRA: `load_lora_adapter` / `unload_lora_adapter` / `lora_adapters` (SGLang's /load_lora_adapter,
/unload_lora_adapter, /v1/models) address one engine and keep the pool's record of what it serves, so that
`generate(..., lora_path=name)` goes to an engine serving `name`. The result records the adapter named
(`GenerationResult.lora_path`) and, for a versioned name (`engines/lora.py`), its tokens carry that version.
A client built with `lora_keep=N` (a LoRA run's rollout client) names the adapter of the policy version it was last
told (`use_policy_version`) in every request that names none: each new request starts on the newest version, and
keeps its name to its last token (docs/design.md#rule-one-version-per-lora-sample). It counts its calls per adapter,
and unloads from every engine each version older than the N newest once none of its calls uses it (at once when
none does): an engine's unload holds its LoRA update lock until the adapter's requests end, so unloading earlier
would hold up the trainer's next load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

from rllm.experimental.fully_async.api.progress import GenerationProgress
from rllm.experimental.fully_async.core.elastic import SampleMoves
from rllm.experimental.fully_async.engines.http import (
    EngineConnectionError,
    EngineError,
    EngineHTTPError,
    EngineTimeoutError,
)
from rllm.experimental.fully_async.engines.lora import adapter_name
from rllm.experimental.fully_async.engines.pool import EnginePool, NoHealthyEngineError
from rllm.experimental.fully_async.engines.resumable import (
    SGLANG_DEFAULT_MAX_NEW_TOKENS,
    GenerationResult,
    generate_resumable,
    generate_resumable_batch,
)

__all__ = [
    "SGLANG_DEFAULT_MAX_NEW_TOKENS",
    "EngineClient",
    "EngineConnectionError",
    "EngineError",
    "EngineHTTPError",
    "EngineTimeoutError",
    "GenerationResult",
    "NoHealthyEngineError",
]

logger = logging.getLogger(__name__)
# While collecting the tokens in flight for a checkpoint: how long calls may stay out before the paused engines are
# asked to abort the calls they hold (`EngineClient._calls_before_returned`).
HELD_RECHECK_S = 1.0


class EngineClient:
    """Pooled async client over `urls` (e.g. ["http://127.0.0.1:30000"]).

    Timeouts: `request_timeout_s` bounds one /generate piece (including time held while an engine is paused),
    `admin_timeout_s` every other call unless the call takes its own, `connect_timeout_s` the TCP connect.
    Retries: a connection failure is retried after `backoff_base_s * 2**k` (capped at `backoff_max_s`), up to
    `connect_retries` times per engine per call. `wait_for_engine_s`: how long a request waits for a replacement
    when every engine is dead (0: fail at once; the run's engine supervisor restarts engines within its start-up
    timeout, so the executor waits that long when `engines.on_engine_failure=restart`).
    `api_key`: sent as `Authorization: Bearer` (engines started with `--api-key`). `partial_rollout`: continue
    generations interrupted by a weight sync (True) or regenerate them from the prompt (False; `resumable.py`).
    `sampling_seed` (engines.sampling_seed): every generation that sets no `sampling_seed` of its own gets
    `core.ids.sampling_seed_for(sampling_seed, rid)`, kept across its resumed pieces; None: none is added.
    """

    def __init__(
        self,
        urls: list[str],
        *,
        request_timeout_s: float = 600.0,
        admin_timeout_s: float = 60.0,
        connect_timeout_s: float = 5.0,
        connect_retries: int = 3,
        dead_after_failures: int = 3,
        backoff_base_s: float = 0.05,
        backoff_max_s: float = 2.0,
        max_resumes: int = 64,
        max_connections: int = 1024,
        wait_for_engine_s: float = 0.0,
        api_key: str | None = None,
        partial_rollout: bool = True,
        sampling_seed: int | None = None,
        lora_keep: int | None = None,
    ) -> None:
        if not urls:
            raise ValueError("EngineClient needs at least one engine URL")
        self.pool = EnginePool(
            urls,
            api_key=api_key,
            connect_timeout_s=connect_timeout_s,
            connect_retries=connect_retries,
            dead_after_failures=dead_after_failures,
            backoff_base_s=backoff_base_s,
            backoff_max_s=backoff_max_s,
            max_connections=max_connections,
            wait_for_engine_s=wait_for_engine_s,
        )
        self.request_timeout_s = request_timeout_s
        self.admin_timeout_s = admin_timeout_s
        self.max_resumes = max_resumes
        self.partial_rollout = partial_rollout
        self.sampling_seed = sampling_seed
        # LoRA: the policy version whose adapter new requests name (None: requests name none unless they say)
        self.lora_version: int | None = 0 if lora_keep is not None else None
        self.lora_keep = lora_keep
        self.adapter_calls: Counter[str] = Counter()  # calls in flight per adapter name
        self.retired: set[int] = set()  # versions older than the kept ones, unloaded or to unload when unused
        self.unloaded: list[str] = []  # adapter names unloaded from every engine, in order
        self._retire_from = 0  # the oldest version not yet retired
        self._unloads: set[asyncio.Future[None]] = set()

    def use_policy_version(self, version: int) -> None:
        """The trainer's version (its adapter is on every engine by then: loaded before the version was bumped):
        requests sent from now on name `policy-v<version>`; those in flight keep theirs. Versions older than the
        `lora_keep` newest are unloaded once unused (the module docstring). No-op without LoRA."""
        if self.lora_version is None or self.lora_keep is None:
            return
        self.lora_version = int(version)
        # ParamSync loaded it on every engine before the version was bumped: engines whose adapters are known serve it
        name = adapter_name(self.lora_version)
        for url, known in self.pool.lora_adapters().items():
            if known is not None:
                self.pool.set_lora_adapters(url, known | {name})
        oldest_kept = self.lora_version - self.lora_keep + 1
        self.retired.update(range(self._retire_from, oldest_kept))
        self._retire_from = max(self._retire_from, oldest_kept)
        self._unload_unused()

    def _adapter(self, lora_path: str | None) -> str | None:
        if lora_path is not None or self.lora_version is None:
            return lora_path
        return adapter_name(self.lora_version)

    @contextlib.contextmanager
    def _calls_on(self, lora_path: str | None) -> Iterator[None]:
        if lora_path is None:
            yield
            return
        self.adapter_calls[lora_path] += 1
        try:
            yield
        finally:
            self.adapter_calls[lora_path] -= 1
            if not self.adapter_calls[lora_path]:
                del self.adapter_calls[lora_path]
                self._unload_unused()

    def _unload_unused(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # told outside the event loop (a service restoring its state): the next call sends them
        for version in sorted(self.retired):
            name = adapter_name(version)
            if not self.adapter_calls.get(name):
                self.retired.discard(version)
                task = asyncio.ensure_future(self._unload_everywhere(name))
                self._unloads.add(task)
                task.add_done_callback(self._unloads.discard)

    async def _unload_everywhere(self, name: str) -> None:
        results = await asyncio.gather(
            *(self.unload_lora_adapter(url, name) for url in self.pool.alive_urls), return_exceptions=True
        )
        for url, result in zip(self.pool.alive_urls, results, strict=False):
            if isinstance(result, BaseException):  # not loaded there (a restarted engine), or the engine is gone
                logger.debug("unloading adapter %s from %s: %s", name, url, result)
        self.unloaded.append(name)
        logger.debug("adapter %s unloaded: no request uses it and the staleness bound admits it no more", name)

    async def adapters_retired(self, timeout_s: float) -> None:
        """Wait for the unloads sent so far to be answered (tests; the end of a run)."""
        if self._unloads:
            await asyncio.wait_for(asyncio.gather(*self._unloads, return_exceptions=True), timeout_s)

    # ---------------------------------------------------------------- pool state
    @property
    def urls(self) -> list[str]:
        return self.pool.urls

    @property
    def alive_urls(self) -> list[str]:
        return self.pool.alive_urls

    def in_flight(self) -> dict[str, int]:
        """Requests this client has in flight, per engine."""
        return self.pool.in_flight()

    def replace_engine(self, old_url: str, new_url: str) -> None:
        """Route to `new_url` (a restarted engine) instead of `old_url`; see `EnginePool.replace_engine`."""
        self.pool.replace_engine(old_url, new_url)

    def add_engine(self, url: str, api_key: str | None = None) -> None:
        """Route to `url` (a joining engine, already at the trainer's weights) too; see `EnginePool.add_engine`."""
        self.pool.add_engine(url, api_key)

    async def drain_engine(self, url: str, timeout_s: float) -> int:
        """Take `url` out of routing once none of this client's calls is on it; returns the samples moved.

        No new request goes to it; what it is generating is aborted there (`/abort_request abort_all`), and each
        aborted piece comes back with its tokens and is re-sent to another engine from them (resumable.py), exactly
        as after a weight sync's pause. A call that reached the engine after the abort is aborted at the next
        HELD_RECHECK_S. An engine that no longer answers is left to the failover (its calls fail and are re-sent).
        Calls still on it after `timeout_s` (it hangs, or ignores the abort) are cut off (`EnginePool.cut_off`): each
        is sent again elsewhere from the tokens its sample had when it was sent, and the engine leaves all the same.
        """
        engine = self.pool.begin_drain(url)
        deadline = time.monotonic() + timeout_s
        while engine.in_flight > 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                cut = self.pool.cut_off(engine.url)
                logger.warning(
                    "engine %s: %d request(s) still on it %gs after it was asked to abort them; cut off and sent "
                    "to other engines from their tokens",
                    engine.url,
                    cut,
                    timeout_s,
                )
                await self.pool.wait_drained(engine.url, HELD_RECHECK_S)  # the cancelled calls end in a loop turn
                break
            # Dead or hung: its calls fail over by themselves, or are cut off at the deadline.
            with contextlib.suppress(EngineConnectionError, EngineTimeoutError):
                await self.abort_request(engine.url, abort_all=True, timeout_s=max(0.5, min(remaining, 5.0)))
            remaining = deadline - time.monotonic()
            if await self.pool.wait_drained(engine.url, max(0.0, min(HELD_RECHECK_S, remaining))):
                break
        self.pool.remove_engine(engine.url)
        logger.info("engine %s drained: %d sample(s) moved to other engines", engine.url, engine.moved)
        return engine.moved

    def moves(self, url: str) -> int:
        """Samples that left `url` for another engine (see `EnginePool.moves`)."""
        return self.pool.moves(url)

    def sample_moves(self, url: str) -> SampleMoves:
        """Those samples with what their move cost (see `EnginePool.sample_moves`)."""
        return self.pool.sample_moves(url)

    async def read_lora_adapters(self, *, timeout_s: float | None = None) -> dict[str, frozenset[str] | None]:
        """Read back what every live engine serves (/v1/models) and route by it: after a restart (LoRA), where the
        restarted engine holds only the newest adapter (`ParamSync.replace_engine`) while the others still hold the
        older versions their requests name. A request naming an older version then goes to an engine that serves
        it, never to the restarted one, which would refuse it (SGLang: "never been loaded") and fail its sample.
        An engine that does not answer stays unknown (requests may still go there). Returns the records."""
        urls = self.alive_urls
        listed = await asyncio.gather(
            *(self.lora_adapters(u, timeout_s=timeout_s) for u in urls), return_exceptions=True
        )
        for url, result in zip(urls, listed, strict=True):
            if isinstance(result, BaseException):
                logger.warning("could not read the LoRA adapters %s serves: %s", url, result)
        return self.pool.lora_adapters()

    async def aclose(self) -> None:
        """Close the pooled session (idempotent)."""
        await self.pool.aclose()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ---------------------------------------------------------------- generation
    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any] | None = None,
        *,
        rid: str | None = None,
        progress: GenerationProgress | None = None,
        lora_path: str | None = None,
    ) -> GenerationResult:
        """Generate from `input_ids`, resuming across weight updates (`resumable.generate_resumable`); `progress`
        keeps the tokens so far where a checkpoint reads them, and continues from the ones it was restored with.
        `lora_path`: the LoRA adapter (its name, e.g. `engines.lora.adapter_name(v)`) to generate with."""
        lora_path = self._adapter(lora_path)
        with self._calls_on(lora_path):
            return await generate_resumable(
                self.pool,
                input_ids,
                sampling_params,
                rid=rid,
                progress=progress,
                lora_path=lora_path,
                **self._resume_options(),
            )

    def _resume_options(self) -> dict[str, Any]:
        """How a generation is resumed across weight updates: the same for one prompt and for a batch."""
        return {
            "request_timeout_s": self.request_timeout_s,
            "max_resumes": self.max_resumes,
            "partial_rollout": self.partial_rollout,
            "run_seed": self.sampling_seed,
        }

    async def generate_batch(
        self,
        prompts: list[list[int]],
        sampling_params: dict[str, Any] | None = None,
        *,
        rids: list[str],
        progress: list[GenerationProgress] | None = None,
        lora_path: str | None = None,
    ) -> list[GenerationResult]:
        """Generate from several prompts as SGLang batched requests (`resumable.generate_resumable_batch`): for
        samples consumed together, such as one prompt's GRPO group; `progress`: one record per prompt;
        `lora_path`: the LoRA adapter every prompt is generated with."""
        lora_path = self._adapter(lora_path)
        with self._calls_on(lora_path):
            return await generate_resumable_batch(
                self.pool,
                prompts,
                sampling_params,
                rids=rids,
                progress=progress,
                lora_path=lora_path,
                **self._resume_options(),
            )

    @contextlib.asynccontextmanager
    async def tokens_collected(self, timeout_s: float) -> AsyncIterator[bool]:
        """While inside, every generation that was in flight has come back with its tokens (each
        `GenerationProgress` holds everything generated so far) and waits, re-sent, in a paused engine.

        On entry every live engine is paused with mode abort (as for a weight sync, but the weights stay) and the
        calls that were out are awaited; on exit the engines paused are continued. Yields False if some call did
        not come back within `timeout_s` (an engine that died or does not answer a pause): what did come back is
        kept all the same. Weight syncs must be kept out meanwhile (the rollout service's SyncGate)."""
        mark = self.pool.generate_mark()
        urls = self.alive_urls
        outcomes = await asyncio.gather(
            *(self.pause_generation(url, "abort", timeout_s=timeout_s) for url in urls), return_exceptions=True
        )
        paused = []
        for url, outcome in zip(urls, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                logger.warning("could not pause %s to collect the tokens in flight: %s", url, outcome)
            else:
                paused.append(url)
        try:
            yield await self._calls_before_returned(mark, paused, timeout_s)
        finally:
            resumed = await asyncio.gather(
                *(self.continue_generation(url, timeout_s=timeout_s) for url in paused), return_exceptions=True
            )
            for url, outcome in zip(paused, resumed, strict=True):
                if isinstance(outcome, BaseException):
                    logger.warning("could not continue %s after collecting the tokens in flight: %s", url, outcome)

    async def _calls_before_returned(self, mark: int, paused: list[str], timeout_s: float) -> bool:
        """Wait for every /generate call sent before `mark`. A call that reaches its engine after the pause is held
        there, not aborted (SGLang holds new arrivals while paused; so does the embedded engine): it has generated
        nothing since it was sent, so its record is already complete, but it would only come back at the continue,
        after this wait. So each time calls are still out after HELD_RECHECK_S, the paused engines abort what they
        hold: those calls come back and are re-sent, held again under later tickets."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if await self.pool.generates_before(mark, max(0.0, min(HELD_RECHECK_S, remaining))):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.gather(
                *(self.abort_request(url, abort_all=True, timeout_s=timeout_s) for url in paused),
                return_exceptions=True,
            )

    # ---------------------------------------------------------------- health and admin (one engine each)
    async def health(self) -> dict[str, bool]:
        """Probe /health of every engine; a healthy answer revives an engine marked dead, a failure kills it."""
        return await self.pool.health(self.admin_timeout_s)

    def _t(self, timeout_s: float | None) -> float:
        return self.admin_timeout_s if timeout_s is None else timeout_s

    async def pause_generation(self, url: str, mode: str = "abort", *, timeout_s: float | None = None) -> None:
        """Pause one engine; with mode abort its in-flight requests return at once (clients resume them)."""
        t = self._t(timeout_s)
        await self.pool.call(url, "/pause_generation", lambda h: h.pause_generation(mode, t))

    async def continue_generation(self, url: str, *, timeout_s: float | None = None) -> None:
        t = self._t(timeout_s)
        await self.pool.call(url, "/continue_generation", lambda h: h.continue_generation(t))

    async def update_weights_from_disk(
        self,
        url: str,
        model_path: str,
        weight_version: str,
        *,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Make one engine load an HF safetensors folder (see ParamSync for how its version is then set)."""
        t = self._t(timeout_s)
        return await self.pool.call(
            url,
            "/update_weights_from_disk",
            lambda h: h.update_weights_from_disk(
                model_path, weight_version, flush_cache=flush_cache, abort_all_requests=abort_all_requests, timeout_s=t
            ),
        )

    async def update_weight_version(self, url: str, new_version: str, *, timeout_s: float | None = None) -> None:
        t = self._t(timeout_s)
        await self.pool.call(url, "/update_weight_version", lambda h: h.update_weight_version(new_version, t))

    async def get_weight_version(self, url: str, *, timeout_s: float | None = None) -> str:
        return await self.pool.read_weight_version(url, self._t(timeout_s))

    async def flush_cache(self, url: str, *, timeout_s: float | None = None) -> None:
        t = self._t(timeout_s)
        await self.pool.call(url, "/flush_cache", lambda h: h.flush_cache(t))

    async def abort_request(
        self, url: str, rid: str | None = None, *, abort_all: bool = False, timeout_s: float | None = None
    ) -> None:
        if rid is None and not abort_all:
            raise ValueError("abort_request needs rid or abort_all=True")
        t = self._t(timeout_s)
        await self.pool.call(url, "/abort_request", lambda h: h.abort_request(rid, abort_all, t))

    async def get_model_info(self, url: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        t = self._t(timeout_s)
        return await self.pool.call(url, "/get_model_info", lambda h: h.get_model_info(t))

    async def get_server_info(self, url: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        t = self._t(timeout_s)
        return await self.pool.call(url, "/get_server_info", lambda h: h.get_server_info(t))

    # ---------------------------------------------------------------- LoRA adapters (one engine each)
    async def load_lora_adapter(
        self, url: str, name: str, path: str, *, pinned: bool = False, timeout_s: float | None = None
    ) -> dict[str, str | None]:
        """Load the peft folder `path` as adapter `name` on one engine (SGLang's /load_lora_adapter; generation goes
        on). Returns the adapters the engine holds (name -> path); raises EngineHTTPError with SGLang's message
        when refused (a name already loaded, a rank above --max-lora-rank, ...). With --max-loaded-loras reached,
        SGLang evicts its least recently used adapter first and answers once that adapter's requests are done."""
        t = self._t(timeout_s)
        body = await self.pool.call(url, "/load_lora_adapter", lambda h: h.load_lora_adapter(name, path, pinned, t))
        return self._after_load(url, name, body)

    def _after_load(self, url: str, name: str, body: dict[str, Any]) -> dict[str, str | None]:
        """Record what engine `url` serves after loading `name`: what it served plus `name`, minus what the load
        evicted. (Its answer also lists adapters still draining for an unload; those are not served any more.)"""
        loaded = dict(body.get("loaded_adapters") or {})
        known = self.pool.engine(url).lora_adapters
        self.pool.set_lora_adapters(url, ((known if known is not None else set(loaded)) | {name}) & set(loaded))
        return loaded

    async def unload_lora_adapter(
        self, url: str, name: str, *, timeout_s: float | None = None
    ) -> dict[str, str | None]:
        """Unload adapter `name` from one engine. The engine stops admitting requests naming it at once, but answers
        only when those already using it have finished (SGLang holds its LoRA update lock meanwhile: a load sent
        to that engine waits too), so give a timeout that covers them. Returns the adapters still held."""
        t = self._t(timeout_s)
        self.pool.drop_lora_adapter(url, name)  # route away now: SGLang unregisters the name at once
        body = await self.pool.call(url, "/unload_lora_adapter", lambda h: h.unload_lora_adapter(name, t))
        return dict(body.get("loaded_adapters") or {})

    async def lora_adapters(self, url: str, *, timeout_s: float | None = None) -> dict[str, str | None]:
        """The adapters one engine serves now, name -> path (its /v1/models cards with a parent), as recorded."""
        t = self._t(timeout_s)
        cards = await self.pool.call(url, "/v1/models", lambda h: h.list_models(t))
        adapters = {str(c["id"]): c.get("root") for c in cards if c.get("parent") is not None}
        self.pool.set_lora_adapters(url, set(adapters))
        return adapters

    async def load_lora_adapter_from_distributed(
        self,
        url: str,
        name: str,
        config: dict[str, Any],
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        load_format: str | None = None,
        pinned: bool = False,
        timeout_s: float | None = None,
    ) -> dict[str, str | None]:
        """The embedded engine's extension (SGLang 0.5.6 has no such route): receive adapter `name` (`config` =
        its adapter_config.json, `names` = peft's tensor names) over the weight-update group `group_name`; call it
        concurrently with rank 0's broadcast of those tensors. Returns the adapters the engine holds."""
        t = self._t(timeout_s)
        body = await self.pool.call(
            url,
            "/load_lora_adapter_from_distributed",
            lambda h: h.load_lora_adapter_from_distributed(
                name=name,
                config=config,
                names=names,
                dtypes=dtypes,
                shapes=shapes,
                group_name=group_name,
                load_format=load_format,
                pinned=pinned,
                timeout_s=t,
            ),
        )
        return self._after_load(url, name, body)
