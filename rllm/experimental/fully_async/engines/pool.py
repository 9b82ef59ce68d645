"""The engine pool: THE registry of which engines a process talks to, their health, load and weight versions.

- Membership: `urls`, `add_engine` (one joins, synced by the caller first), `replace_engine` (a restarted engine
  takes a dead one's place), `begin_drain` (a leaving engine gets no new request; `wait_drained` waits for its
  calls to come back), `remove_engine`. The pool may be left with no engine (the last one left): requests then
  wait up to `wait_for_engine_s` for one to join (docs/design.md#rule-engine-set-can-change).
- Health: consecutive connection failures past `dead_after_failures` mark an engine dead (routed around); a
  successful call or `/health` probe revives it. When every engine is dead a request waits up to
  `wait_for_engine_s` for one to come back or be replaced, then raises `NoHealthyEngineError`.
- Moves: a draining engine's pieces that come back aborted, or that a drain out of time cut off (`cut_off`), as
  `moved`, and requests re-sent elsewhere after a connection failure (`failed_over`), per engine: the samples that
  continue on another engine from their tokens; with what each move cost (`sample_moves`: the tokens an aborted
  piece was generated with but did not hand back, and the moved samples whose call got no answer).
- Routing: `post_generate` sends one `/generate` to the live engine with the fewest requests in flight from this
  pool, failing over to another engine on connection errors with bounded exponential back-off.
- Calls in flight: every `post_generate` takes a ticket in send order, so a checkpoint that pauses the engines can
  wait for the calls that were on the wire when it paused them to come back with their tokens
  (`generate_mark`, `generates_before`).
- LoRA adapters: what each engine serves, as this pool's calls left it (`lora_adapters`, set by the client's
  load/unload/list calls); a /generate naming an adapter goes to a live engine known to serve it when there is one.
- Versions: `read_weight_version` asks an engine (`/get_weight_version`) and records the answer; a version is
  never assumed (docs/design.md#rule-versions-on-every-token).
- Admin calls address one engine by URL and retry connection failures (`call`).
One long-lived pooled aiohttp session serves every engine; it belongs to the event loop of the first call.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from rllm.experimental.fully_async.core.elastic import SampleMoves
from rllm.experimental.fully_async.core.engine_activity import EngineActivity
from rllm.experimental.fully_async.engines.http import (
    CONNECTION_ERRORS,
    EngineConnectionError,
    EngineError,
    EngineHTTP,
    new_session,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


class NoHealthyEngineError(EngineError):
    """Every engine of the pool is marked dead."""


@dataclass
class EngineState:
    """What the pool knows about one engine."""

    http: EngineHTTP
    consecutive_failures: int = 0
    dead: bool = False
    last_error: str = ""
    weight_version: str | None = None  # as last read back from the engine (None: not read yet)
    # Busy time and output tokens on time.monotonic(), counted where each call starts and returns
    # (core/engine_activity.py: the two agree in every interval by construction).
    activity: EngineActivity = field(default_factory=EngineActivity)
    lora_adapters: frozenset[str] | None = None  # adapter names it serves, as last loaded/listed (None: not known)
    draining: bool = False  # leaving: routed around like a dead engine, its calls awaited (`wait_drained`)
    moved: int = 0  # pieces it returned aborted while draining, or cut off: each continues elsewhere from its tokens
    failed_over: int = 0  # requests re-sent elsewhere after a connection failure on it
    cut: int = 0  # of `moved`, the pieces cut off (no answer: what it made for them is not known)
    regenerated: int = 0  # tokens its aborted pieces were generated with but did not hand back (`_unreturned_tokens`)
    calls: dict[asyncio.Future[Any], int] = field(default_factory=dict)  # its /generate calls now: prompts in each

    @property
    def in_flight(self) -> int:
        """This pool's requests on it now (a batched /generate counts each of its prompts)."""
        return self.activity.in_flight

    def begin_request(self, n: int = 1) -> None:
        self.activity.begin(time.monotonic(), n)

    def end_request(self, n: int = 1, tokens: int = 0) -> None:
        """`n` requests came back with `tokens` output tokens between them (0 when the call failed)."""
        self.activity.end(time.monotonic(), n, tokens)

    @property
    def url(self) -> str:
        return self.http.url

    @property
    def usable(self) -> bool:
        """New requests may go to it."""
        return not self.dead and not self.draining


class EnginePool:
    """Engines at `urls` (e.g. ["http://127.0.0.1:30000"]); see the module docstring for the policies.

    `api_key`: sent as `Authorization: Bearer` to every engine (engines started with SGLang's `--api-key`).
    """

    def __init__(
        self,
        urls: list[str],
        *,
        api_key: str | None = None,
        connect_timeout_s: float = 5.0,
        connect_retries: int = 3,
        dead_after_failures: int = 3,
        backoff_base_s: float = 0.05,
        backoff_max_s: float = 2.0,
        max_connections: int = 1024,
        wait_for_engine_s: float = 0.0,
    ) -> None:
        if not urls:
            raise ValueError("an engine pool needs at least one engine URL")
        self.api_key = api_key
        self.connect_timeout_s = connect_timeout_s
        self.connect_retries = connect_retries
        self.dead_after_failures = dead_after_failures
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.max_connections = max_connections
        self.wait_for_engine_s = wait_for_engine_s
        self._engines: dict[str, EngineState] = {}
        for url in urls:
            self._add(url)
        # Set whenever an engine becomes usable (replaced, or found alive again): wakes requests waiting for one.
        # Created lazily, in the event loop that uses the pool.
        self._engine_usable: asyncio.Event | None = None
        # An outage is reported once, by the first request that finds no live engine: with hundreds of requests in
        # flight (or the engines stopped under them by Ctrl-C) one line per request buried the log.
        self._outage_reported = False
        self._session: aiohttp.ClientSession | None = None
        self._tie_breaker = itertools.count()
        self._tickets = itertools.count()  # post_generate calls in send order
        self._open_tickets: dict[int, None] = {}  # calls not yet returned (insertion order = send order)
        self._ticket_closed: asyncio.Event | None = None  # set while someone waits in generates_before
        self._request_ended: asyncio.Event | None = None  # set whenever a /generate call returns (wait_drained)
        self.removed: dict[str, EngineState] = {}  # engines removed from routing, their counters kept (by URL)
        self._retired: list[EngineState] = []  # removed or replaced engines (`_retire`)

    # ---------------------------------------------------------------- calls in flight
    def generate_mark(self) -> int:
        """A mark in the send order: `generates_before(mark)` waits for the calls sent before this moment."""
        return next(self._tickets)

    async def generates_before(self, mark: int, timeout_s: float) -> bool:
        """Wait until every /generate call sent before `mark` has returned (its caller has the answer); False if
        some are still out after `timeout_s` (an engine that does not answer a pause)."""
        deadline = time.monotonic() + timeout_s
        while self._open_tickets and next(iter(self._open_tickets)) < mark:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._ticket_closed = self._ticket_closed or asyncio.Event()
            self._ticket_closed.clear()
            try:
                await asyncio.wait_for(self._ticket_closed.wait(), remaining)
            except TimeoutError:
                return False
        return True

    # ---------------------------------------------------------------- membership and state
    def _add(self, url: str, api_key: str | None = None) -> EngineState:
        """`api_key`: this engine's own (a server registered with its key); None: the pool's."""
        key = api_key if api_key is not None else self.api_key
        http = EngineHTTP(url, self._get_session, api_key=key, connect_timeout_s=self.connect_timeout_s)
        state = self._engines[http.url] = EngineState(http)
        return state

    @property
    def urls(self) -> list[str]:
        return list(self._engines)

    @property
    def alive_urls(self) -> list[str]:
        """Engines requests may go to: neither dead nor draining."""
        return [e.url for e in self._engines.values() if e.usable]

    def in_flight(self) -> dict[str, int]:
        """Requests this pool has in flight, per engine."""
        return {e.url: e.in_flight for e in self._engines.values()}

    def busy_seconds(self) -> dict[str, float]:
        """Per engine, the wall seconds during which this pool had at least one request in flight on it.

        An engine is idle, from the rollout side's view, whenever no request of ours is on it: the same definition
        as the trainer's idle time (waiting for a batch), so the two fractions compare. Requests held by an engine
        paused for a weight sync count as busy.
        """
        now = time.monotonic()
        return {e.url: e.activity.busy_time(now) for e in self._engines.values()}

    def activities(self) -> tuple[list[EngineActivity], list[EngineActivity]]:
        """(serving, retired): each engine's busy time and output tokens, for `core.engine_activity.IntervalMeter`.
        Retired: engines removed or replaced, whose calls may still have been returning tokens."""
        return [e.activity for e in self._engines.values()], [e.activity for e in self._retired]

    def weight_versions(self) -> dict[str, str | None]:
        """Each engine's weight version as last read back from it (None: not read yet)."""
        return {e.url: e.weight_version for e in self._engines.values()}

    def lora_adapters(self) -> dict[str, frozenset[str] | None]:
        """Each engine's LoRA adapters as this pool's calls left them (None: never loaded or listed)."""
        return {e.url: e.lora_adapters for e in self._engines.values()}

    def set_lora_adapters(self, url: str, names: set[str] | frozenset[str]) -> None:
        """Record the adapters engine `url` serves (after a load or a listing)."""
        self.engine(url).lora_adapters = frozenset(names)

    def drop_lora_adapter(self, url: str, name: str) -> None:
        """Stop routing requests naming `name` to `url` (called as its unload starts: SGLang unregisters at once)."""
        engine = self.engine(url)
        if engine.lora_adapters is not None:
            engine.lora_adapters = engine.lora_adapters - {name}

    def engine(self, url: str) -> EngineState:
        state = self._engines.get(url.rstrip("/"))
        if state is None:
            raise ValueError(f"{url} is not one of this pool's engines {self.urls}")
        return state

    def replace_engine(self, old_url: str, new_url: str) -> None:
        """Route to `new_url` (a restarted engine) instead of `old_url` from now on. Requests still running on the
        old one keep their bookkeeping and fail over as usual; requests waiting for an engine wake up.

        Call it from the event loop that uses the pool.
        """
        old_url, new_url = old_url.rstrip("/"), new_url.rstrip("/")
        if new_url in self._engines and new_url != old_url:
            raise ValueError(f"{new_url} is already one of this pool's engines")
        old = self._engines.pop(old_url, None)
        if old is not None:
            self._retire(old)
        self._add(new_url)
        logger.info("engine %s replaced by %s; %d engine(s) alive", old_url, new_url, len(self.alive_urls))
        self._signal_engine_usable()

    def add_engine(self, url: str, api_key: str | None = None) -> None:
        """Route to `url` from now on (a joining engine, already at the trainer's weights; `api_key`: its own, else
        the pool's); requests waiting for an engine wake up. Call it from the event loop that uses the pool."""
        url = url.rstrip("/")
        if url in self._engines:
            raise ValueError(f"{url} is already one of this pool's engines")
        self.removed.pop(url, None)
        self._add(url, api_key)
        logger.info("engine %s joined; %d engine(s) alive", url, len(self.alive_urls))
        self._signal_engine_usable()

    def begin_drain(self, url: str) -> EngineState:
        """`url` leaves: no new request goes to it from now on (the calls it has keep their bookkeeping)."""
        engine = self.engine(url)
        engine.draining = True
        logger.info("engine %s draining: %d request(s) of this pool on it", engine.url, engine.in_flight)
        return engine

    async def wait_drained(self, url: str, timeout_s: float) -> bool:
        """Wait until none of this pool's calls is on `url`; False if some still are after `timeout_s`."""
        engine = self.engine(url)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while engine.in_flight > 0:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            self._request_ended = self._request_ended or asyncio.Event()
            self._request_ended.clear()
            try:
                await asyncio.wait_for(self._request_ended.wait(), remaining)
            except TimeoutError:
                return engine.in_flight == 0
        return True

    def cut_off(self, url: str) -> int:
        """Cancel the /generate calls still on `url`, a leaving engine that did not hand them back in time (it hangs,
        or ignores the abort): each is sent again to another engine with the input it was sent with, so its sample
        continues from the tokens it had then (what the engine made since never came back). Returns the prompts."""
        engine = self.engine(url)
        calls = {call: n for call, n in engine.calls.items() if not call.done()}
        for call in calls:
            call.cancel()
        return sum(calls.values())

    def remove_engine(self, url: str) -> None:
        """Stop routing to `url` (idempotent); its counters stay readable in `removed`."""
        engine = self._engines.pop(url.rstrip("/"), None)
        if engine is not None:
            self.removed[engine.url] = engine
            self._retire(engine)

    def _retire(self, engine: EngineState) -> None:
        """Keep a leaving engine's activity readable (`activities`): its calls may still return tokens, after the
        last read too. Kept for the run (one small record per engine that ever left); the meter averages only
        those active in an interval."""
        self._retired.append(engine)

    def moves(self, url: str) -> int:
        """Samples that left `url` and continue elsewhere from their tokens: aborted while it drained, or re-sent
        after a connection failure on it."""
        return self.sample_moves(url).samples

    def sample_moves(self, url: str) -> SampleMoves:
        """`moves(url)` with what they cost (core/elastic.py's `SampleMoves`)."""
        url = url.rstrip("/")
        engine = self._engines.get(url) or self.removed.get(url)
        if engine is None:
            return SampleMoves()
        return SampleMoves(
            samples=engine.moved + engine.failed_over,
            tokens_regenerated=engine.regenerated,
            samples_unanswered=engine.cut + engine.failed_over,
        )

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = new_session(self.max_connections)
        return self._session

    async def aclose(self) -> None:
        """Close the pooled session (idempotent)."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    # ---------------------------------------------------------------- health bookkeeping
    def _signal_engine_usable(self) -> None:
        self._outage_reported = False
        if self._engine_usable is not None:
            self._engine_usable.set()

    def record_failure(self, engine: EngineState, exc: BaseException) -> None:
        engine.consecutive_failures += 1
        engine.last_error = f"{type(exc).__name__}: {exc}"
        if not engine.dead and engine.consecutive_failures >= self.dead_after_failures:
            engine.dead = True
            logger.warning(
                "engine %s marked dead after %d consecutive connection failures (%s); %d engine(s) left",
                engine.url,
                engine.consecutive_failures,
                engine.last_error,
                len(self.alive_urls),
            )

    def record_success(self, engine: EngineState) -> None:
        engine.consecutive_failures = 0
        if engine.dead:
            logger.info("engine %s is reachable again", engine.url)
            engine.dead = False
            self._signal_engine_usable()

    def backoff(self, attempt: int) -> float:
        return min(self.backoff_base_s * (2**attempt), self.backoff_max_s)

    async def health(self, timeout_s: float) -> dict[str, bool]:
        """Probe /health of every engine; a healthy answer revives an engine marked dead, a failure kills it."""

        async def probe(engine: EngineState) -> bool:
            try:
                await engine.http.health(timeout_s)
            except (*CONNECTION_ERRORS, EngineError) as exc:
                engine.dead = True
                engine.last_error = f"health check failed: {exc}"
                return False
            self.record_success(engine)
            return True

        engines = list(self._engines.values())
        results = await asyncio.gather(*(probe(e) for e in engines))
        return {e.url: ok for e, ok in zip(engines, results, strict=True)}

    # ---------------------------------------------------------------- routing
    async def _wait_for_live_engine(self) -> list[EngineState]:
        """The live engines; when there is none, wait up to `wait_for_engine_s` for one to be replaced."""
        alive = [e for e in self._engines.values() if e.usable]
        if alive or self.wait_for_engine_s <= 0:
            return alive
        if self._engine_usable is None:
            self._engine_usable = asyncio.Event()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_for_engine_s
        if not self._outage_reported:
            self._outage_reported = True
            logger.warning(
                "no live inference engine; waiting up to %.0fs for one to restart or join", self.wait_for_engine_s
            )
        while not alive and (remaining := deadline - loop.time()) > 0:
            self._engine_usable.clear()
            try:
                await asyncio.wait_for(self._engine_usable.wait(), timeout=remaining)
            except TimeoutError:
                break
            alive = [e for e in self._engines.values() if e.usable]
        return alive

    async def pick(self, avoid: set[str], lora_path: Any = None) -> EngineState:
        """The least-loaded live engine, preferring ones that have not failed this call and, for a request naming
        LoRA adapters (`lora_path`: a name or a list), ones known to serve them all."""
        alive = await self._wait_for_live_engine()
        if not alive:
            details = "; ".join(f"{e.url}: {e.last_error or 'dead'}" for e in self._engines.values())
            wait_s = self.wait_for_engine_s
            waited = f", none restarted or joined within {wait_s:g}s" if wait_s > 0 else ""
            raise NoHealthyEngineError(f"no healthy inference engine left{waited} ({details})")
        wanted = {lora_path} if isinstance(lora_path, str) else {n for n in (lora_path or []) if n is not None}
        if wanted:
            # An engine that does not serve them would fail the request (a name never loaded there) or reload it
            # (SGLang reloads a name it unloaded); when none is known to serve them, the engine answers for itself.
            alive = [e for e in alive if e.lora_adapters is not None and wanted <= e.lora_adapters] or alive
        candidates = [e for e in alive if e.url not in avoid] or alive
        low = min(e.in_flight for e in candidates)
        tied = [e for e in candidates if e.in_flight == low]
        return tied[next(self._tie_breaker) % len(tied)]

    async def post_generate(
        self, payload: dict[str, Any], rid: str | list[str], timeout_s: float
    ) -> tuple[str, Any, int]:
        """POST one /generate to the least-loaded engine, retrying connection failures elsewhere.

        `rid` is one request id, or one per prompt for a batch (`payload["input_ids"]` a list of prompts, as
        SGLang's batched GenerateReqInput); each attempt suffixes them, so a retry never reuses a live rid.
        Returns (engine URL, response body, connection failures survived).
        """
        ticket = next(self._tickets)
        self._open_tickets[ticket] = None
        try:
            return await self._post_generate(payload, rid, timeout_s)
        finally:
            # The caller takes the answer in this same step of the event loop, so a waiter woken by this sees it.
            del self._open_tickets[ticket]
            if self._ticket_closed is not None:
                self._ticket_closed.set()
            if self._request_ended is not None:
                self._request_ended.set()

    async def _post_generate(
        self, payload: dict[str, Any], rid: str | list[str], timeout_s: float
    ) -> tuple[str, Any, int]:
        n = len(rid) if isinstance(rid, list) else 1
        failed_on: set[str] = set()
        max_attempts = self.connect_retries * max(1, len(self._engines)) + 1
        backoff_s = 0.0
        for attempt in range(max_attempts):
            if backoff_s:  # after a connection failure; slept outside the call, so its engine is not busy meanwhile
                await asyncio.sleep(backoff_s)
                backoff_s = 0.0
            engine = await self.pick(failed_on, payload.get("lora_path"))
            engine.begin_request(n)
            rids = [f"{r}-{attempt}" for r in rid] if isinstance(rid, list) else f"{rid}-{attempt}"
            # A task of its own, so that `cut_off` can cancel this call without cancelling the caller.
            call = asyncio.ensure_future(engine.http.generate({**payload, "rid": rids}, timeout_s))
            engine.calls[call] = n
            tokens = 0
            try:
                data = await call
                tokens = _output_tokens(data)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if not call.cancelled() or (current is not None and current.cancelling()):
                    raise  # the caller was cancelled, not this call
                engine.moved += n  # cut off (a drain ran out of time): sent again elsewhere, from the same tokens
                engine.cut += n
                failed_on.add(engine.url)
                continue
            except CONNECTION_ERRORS as exc:
                self.record_failure(engine, exc)
                engine.failed_over += n
                failed_on.add(engine.url)
                # Every request on a dead engine passes here: the one warning is the engine's "marked dead".
                logger.info("generate on %s failed (%s); retrying", engine.url, engine.last_error)
                backoff_s = self.backoff(min(attempt, 10))
                continue
            finally:
                engine.calls.pop(call, None)
                # The tokens are credited where the call ends, on the clock of its busy time
                # (core/engine_activity.py); a call that failed or was cut off took none.
                engine.end_request(n, tokens)
                if engine.draining and self._request_ended is not None:
                    self._request_ended.set()  # `wait_drained` watches this engine's calls, not the whole request
            self.record_success(engine)
            if engine.draining:
                engine.moved += _aborted_pieces(data)
                engine.regenerated += _unreturned_tokens(data)
            return engine.url, data, attempt
        raise EngineConnectionError(
            f"/generate failed {max_attempts} times on engines {sorted(failed_on)}; last errors: "
            + "; ".join(f"{u}: {self._engines[u].last_error}" for u in sorted(failed_on) if u in self._engines)
        )

    # ---------------------------------------------------------------- admin calls (one engine each)
    async def call(self, url: str, what: str, fn: Callable[[EngineHTTP], Awaitable[T]]) -> T:
        """`fn(engine.http)` on engine `url`, retrying connection failures with back-off; `what` names the call."""
        engine = self.engine(url)
        for attempt in range(self.connect_retries + 1):
            try:
                result = await fn(engine.http)
            except CONNECTION_ERRORS as exc:
                self.record_failure(engine, exc)
                if attempt == self.connect_retries:
                    raise EngineConnectionError(
                        f"{engine.url}{what}: engine unreachable after {attempt + 1} attempts ({engine.last_error})"
                    ) from exc
                await asyncio.sleep(self.backoff(attempt))
            else:
                self.record_success(engine)
                return result
        raise AssertionError("unreachable")

    async def read_weight_version(self, url: str, timeout_s: float) -> str:
        """Ask engine `url` which weight version it serves, and remember the answer."""
        version = await self.call(url, "/get_weight_version", lambda h: h.get_weight_version(timeout_s))
        self.engine(url).weight_version = version
        return version


def _output_tokens(data: Any) -> int:
    """Output tokens in a /generate answer (one, or a batch's list): every piece, aborted ones included, since an
    aborted piece's tokens were generated and are continued from (engines/resumable.py)."""
    items = data if isinstance(data, list) else [data]
    return sum(len(item.get("output_ids") or ()) for item in items if isinstance(item, dict))


def _aborted_outputs(data: Any) -> list[dict[str, Any]]:
    """The outputs of a /generate answer (one, or a batch's list) that ended aborted, with tokens to continue from
    or none (either way the caller re-sends them: engines/resumable.py)."""
    items = data if isinstance(data, list) else [data]
    aborted = []
    for item in items:
        finish = item.get("meta_info", {}).get("finish_reason") if isinstance(item, dict) else None
        if (finish.get("type") if isinstance(finish, dict) else finish) == "abort":
            aborted.append(item)
    return aborted


def _aborted_pieces(data: Any) -> int:
    return len(_aborted_outputs(data))


def _unreturned_tokens(data: Any) -> int:
    """Tokens the aborted outputs of a /generate answer were generated with (SGLang's `completion_tokens`) beyond
    those they hand back with a log-prob each, the tokens `resumable.parse_piece` keeps and the sample continues
    from: its next engine generates these again (an abort can cut the log-prob stream one token short)."""
    unreturned = 0
    for item in _aborted_outputs(data):
        meta, output_ids = item["meta_info"], item.get("output_ids") or ()
        kept = min(len(output_ids), len(meta.get("output_token_logprobs") or ()))
        unreturned += max(0, int(meta.get("completion_tokens", len(output_ids))) - kept)
    return unreturned
