"""Async client for one or more inference engines speaking the SGLang native API (DESIGN rule 2).

`EngineClient.generate` is what rollout workflows call. It:
- routes each request to the healthy engine with the fewest requests in flight from this client;
- retries connection failures with bounded exponential back-off, on another engine when there is one, and
  marks an engine dead after `dead_after_failures` consecutive connection failures (routing around it);
  when no engine is left it waits up to `wait_for_engine_s` for one (`replace_engine`: a restarted engine),
  then raises `NoHealthyEngineError`;
- resumes partial rollouts: when a piece comes back with finish reason `abort` (a weight sync paused the engine),
  it re-sends prompt + tokens so far with the remaining token budget - the engine holds it until
  `/continue_generation` - and stitches the pieces. Every token carries the policy version the engine reported
  for its piece (`meta_info.weight_version`, as int), so a resumed sequence holds segments of several versions.
The same retry path covers an engine that dies mid-request: tokens already received are kept and the rest is
generated elsewhere. To stop a generation, cancel the task that awaits it; the closed connection makes the
engine drop the request.

The admin calls (`pause_generation`, `continue_generation`, `update_weights_from_disk`, ...) address one engine
by URL; `param_sync.ParamSync` uses them. Every call has a timeout whose error names the engine and the call.
One long-lived pooled `aiohttp` session serves everything; it belongs to the event loop of the first call.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp

from rllm.experimental.fully_async.core.protocol import Sequence

logger = logging.getLogger(__name__)

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # what SGLang uses when sampling_params has no max_new_tokens


class EngineError(RuntimeError):
    """Base class of every error an engine call raises; the message names the engine URL."""


class EngineHTTPError(EngineError):
    """The engine answered with a non-success status or body."""

    def __init__(self, url: str, path: str, status: int, body: str) -> None:
        super().__init__(f"{url}{path} answered HTTP {status}: {body[:500]}")
        self.url, self.path, self.status, self.body = url, path, status, body


class EngineTimeoutError(EngineError):
    """An engine did not answer within the call's timeout."""


class EngineConnectionError(EngineError):
    """An engine could not be reached (after retries, for admin calls)."""


class NoHealthyEngineError(EngineError):
    """Every engine of the client is marked dead."""


@dataclass(frozen=True)
class GenerationResult:
    """One generation, stitched across resumes; the three per-token lists have equal length."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]  # policy version (engine weight_version) that produced each token
    finish_reason: str  # stop | length (abort never survives: the client resumes it)
    num_resumes: int  # pieces that ended in abort (weight updates) and were continued
    prompt_tokens: int
    num_retries: int = 0  # connection failures survived (engine down, request re-sent)

    def to_sequence(self, prompt_ids: list[int]) -> Sequence:
        """The protocol message the trainer consumes."""
        return Sequence(
            prompt_ids=list(prompt_ids),
            response_ids=list(self.output_ids),
            response_logprobs=list(self.logprobs),
            response_versions=list(self.versions),
            finish_reason=self.finish_reason,
            num_resumes=self.num_resumes,
        )


@dataclass
class _Engine:
    url: str
    in_flight: int = 0
    consecutive_failures: int = 0
    dead: bool = False
    last_error: str = ""


@dataclass(frozen=True)
class _Piece:
    output_ids: list[int]
    logprobs: list[float]
    version: int
    finish_type: str
    prompt_tokens: int


class EngineClient:
    """Pooled async HTTP client over `urls` (e.g. ["http://127.0.0.1:30000"]).

    Timeouts: `request_timeout_s` bounds one /generate piece (including time held while an engine is paused),
    `admin_timeout_s` every other call unless the call takes its own, `connect_timeout_s` the TCP connect.
    Retries: a connection failure is retried after `backoff_base_s * 2**k` (capped at `backoff_max_s`), up to
    `connect_retries` times per engine per call. `wait_for_engine_s`: how long a request waits for a replacement
    when every engine is dead (0: fail at once; the run's engine supervisor restarts engines within its start-up
    timeout, so the executor waits that long when `engines.on_engine_failure=restart`).
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
    ) -> None:
        if not urls:
            raise ValueError("EngineClient needs at least one engine URL")
        self._engines = {url.rstrip("/"): _Engine(url.rstrip("/")) for url in urls}
        self.request_timeout_s = request_timeout_s
        self.admin_timeout_s = admin_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.connect_retries = connect_retries
        self.dead_after_failures = dead_after_failures
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.max_resumes = max_resumes
        self.max_connections = max_connections
        self.wait_for_engine_s = wait_for_engine_s
        # Set whenever an engine becomes usable (replaced, or found alive again): wakes requests waiting for one.
        # Created lazily, in the event loop that uses the client.
        self._engine_usable: asyncio.Event | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tie_breaker = itertools.count()

    # ---------------------------------------------------------------- session and state
    @property
    def urls(self) -> list[str]:
        return list(self._engines)

    @property
    def alive_urls(self) -> list[str]:
        return [e.url for e in self._engines.values() if not e.dead]

    def in_flight(self) -> dict[str, int]:
        """Requests this client has in flight, per engine."""
        return {e.url: e.in_flight for e in self._engines.values()}

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=30)
            self._session = aiohttp.ClientSession(connector=connector, json_serialize=json.dumps)
        return self._session

    async def aclose(self) -> None:
        """Close the pooled session (idempotent)."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def replace_engine(self, old_url: str, new_url: str) -> None:
        """Route to `new_url` (a restarted engine) instead of `old_url` from now on. Requests still running on the
        old one keep their bookkeeping and fail over as usual; requests waiting for an engine wake up.

        Call it from the event loop that uses the client.
        """
        old_url, new_url = old_url.rstrip("/"), new_url.rstrip("/")
        if new_url in self._engines and new_url != old_url:
            raise ValueError(f"{new_url} is already one of this client's engines")
        self._engines.pop(old_url, None)
        self._engines[new_url] = _Engine(new_url)
        logger.info("engine %s replaced by %s; %d engine(s) alive", old_url, new_url, len(self.alive_urls))
        self._signal_engine_usable()

    def _signal_engine_usable(self) -> None:
        if self._engine_usable is not None:
            self._engine_usable.set()

    def _engine(self, url: str) -> _Engine:
        engine = self._engines.get(url.rstrip("/"))
        if engine is None:
            raise ValueError(f"{url} is not one of this client's engines {self.urls}")
        return engine

    def _record_failure(self, engine: _Engine, exc: BaseException) -> None:
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

    def _record_success(self, engine: _Engine) -> None:
        engine.consecutive_failures = 0
        if engine.dead:
            logger.info("engine %s is reachable again", engine.url)
            engine.dead = False
            self._signal_engine_usable()

    def _backoff(self, attempt: int) -> float:
        return min(self.backoff_base_s * (2**attempt), self.backoff_max_s)

    async def _wait_for_live_engine(self) -> list[_Engine]:
        """The live engines; when there is none, wait up to `wait_for_engine_s` for one to be replaced."""
        alive = [e for e in self._engines.values() if not e.dead]
        if alive or self.wait_for_engine_s <= 0:
            return alive
        if self._engine_usable is None:
            self._engine_usable = asyncio.Event()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_for_engine_s
        logger.warning("no live inference engine; waiting up to %.0fs for a restarted one", self.wait_for_engine_s)
        while not alive and (remaining := deadline - loop.time()) > 0:
            self._engine_usable.clear()
            try:
                await asyncio.wait_for(self._engine_usable.wait(), timeout=remaining)
            except TimeoutError:
                break
            alive = [e for e in self._engines.values() if not e.dead]
        return alive

    async def _pick(self, avoid: set[str]) -> _Engine:
        """The least-loaded live engine, preferring ones that have not failed this call."""
        alive = await self._wait_for_live_engine()
        if not alive:
            details = "; ".join(f"{e.url}: {e.last_error or 'dead'}" for e in self._engines.values())
            waited = f", none restarted within {self.wait_for_engine_s:g}s" if self.wait_for_engine_s > 0 else ""
            raise NoHealthyEngineError(f"no healthy inference engine left{waited} ({details})")
        candidates = [e for e in alive if e.url not in avoid] or alive
        low = min(e.in_flight for e in candidates)
        tied = [e for e in candidates if e.in_flight == low]
        return tied[next(self._tie_breaker) % len(tied)]

    # ---------------------------------------------------------------- HTTP core
    async def _request(
        self, engine: _Engine, method: str, path: str, payload: dict[str, Any] | None, timeout_s: float
    ) -> Any:
        """One HTTP call to one engine. Raises aiohttp connection errors as-is (callers retry them)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.connect_timeout_s)
        try:
            async with self._get_session().request(
                method, f"{engine.url}{path}", json=payload, timeout=timeout
            ) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise EngineHTTPError(engine.url, path, resp.status, text)
        except aiohttp.ConnectionTimeoutError:
            raise  # connect phase: a connection failure, retried by the caller
        except TimeoutError as exc:
            raise EngineTimeoutError(f"{engine.url}{path} did not answer within {timeout_s:.1f}s") from exc
        if not text:
            return None
        try:
            return json.loads(text)
        except ValueError:
            return text

    async def _call_with_retries(
        self, engine: _Engine, method: str, path: str, payload: dict[str, Any] | None, timeout_s: float
    ) -> Any:
        """An admin call to one specific engine, retrying connection failures with back-off."""
        for attempt in range(self.connect_retries + 1):
            try:
                result = await self._request(engine, method, path, payload, timeout_s)
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                self._record_failure(engine, exc)
                if attempt == self.connect_retries:
                    raise EngineConnectionError(
                        f"{engine.url}{path}: engine unreachable after {attempt + 1} attempts ({engine.last_error})"
                    ) from exc
                await asyncio.sleep(self._backoff(attempt))
            else:
                self._record_success(engine)
                return result
        raise AssertionError("unreachable")

    # ---------------------------------------------------------------- generation
    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any] | None = None, *, rid: str | None = None
    ) -> GenerationResult:
        """Generate from `input_ids`, resuming across weight updates; see the module docstring."""
        params = dict(sampling_params or {})
        max_new = int(params.get("max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS))
        rid = rid or uuid.uuid4().hex
        prompt = list(input_ids)
        out_ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        num_resumes = retries = 0
        for piece_index in itertools.count():
            payload = {
                "input_ids": prompt + out_ids,
                "sampling_params": {**params, "max_new_tokens": max_new - len(out_ids)},
                "return_logprob": True,
            }
            piece, failures = await self._generate_piece(payload, f"{rid}-{piece_index}")
            retries += failures
            out_ids += piece.output_ids
            logprobs += piece.logprobs
            versions += [piece.version] * len(piece.output_ids)
            if piece.finish_type != "abort":
                finish = piece.finish_type
                break
            if len(out_ids) >= max_new:
                finish = "length"  # the budget ran out exactly as the pause came
                break
            num_resumes += 1
            if num_resumes > self.max_resumes:
                raise EngineError(
                    f"request {rid} was aborted {num_resumes} times without finishing; an engine is aborting it "
                    "repeatedly (is someone calling /abort_request?)"
                )
            logger.debug("request %s aborted after %d tokens; resuming", rid, len(out_ids))
        return GenerationResult(
            output_ids=out_ids,
            logprobs=logprobs,
            versions=versions,
            finish_reason=finish,
            num_resumes=num_resumes,
            prompt_tokens=len(prompt),
            num_retries=retries,
        )

    async def _generate_piece(self, payload: dict[str, Any], rid: str) -> tuple[_Piece, int]:
        """POST one /generate to the least-loaded engine, retrying connection failures elsewhere."""
        failed_on: set[str] = set()
        max_attempts = self.connect_retries * len(self._engines) + 1
        for attempt in range(max_attempts):
            engine = await self._pick(failed_on)
            engine.in_flight += 1
            try:
                data = await self._request(
                    engine, "POST", "/generate", {**payload, "rid": f"{rid}-{attempt}"}, self.request_timeout_s
                )
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                self._record_failure(engine, exc)
                failed_on.add(engine.url)
                # Every request on a dead engine passes here: the one warning is the engine's "marked dead".
                logger.info("generate on %s failed (%s); retrying", engine.url, engine.last_error)
                await asyncio.sleep(self._backoff(min(attempt, 10)))
                continue
            finally:
                engine.in_flight -= 1
            self._record_success(engine)
            return self._parse_piece(engine.url, data), attempt
        raise EngineConnectionError(
            f"/generate failed {max_attempts} times on engines {sorted(failed_on)}; last errors: "
            + "; ".join(f"{self._engines[u].url}: {self._engines[u].last_error}" for u in sorted(failed_on))
        )

    @staticmethod
    def _parse_piece(url: str, data: Any) -> _Piece:
        try:
            output_ids = [int(t) for t in data["output_ids"]]
            meta = data["meta_info"]
            finish = meta["finish_reason"]
            finish_type = finish["type"] if isinstance(finish, dict) else str(finish)
            entries = meta["output_token_logprobs"]
            raw_version = meta["weight_version"]
        except (KeyError, TypeError) as exc:
            raise EngineError(f"{url}/generate returned an unexpected body ({exc!r}): {str(data)[:300]}") from exc
        try:
            version = int(raw_version)
        except (TypeError, ValueError) as exc:
            raise EngineError(
                f"{url} reports weight_version {raw_version!r}, which is not an integer policy version; "
                "launch it with --weight-version 0 and update weights with integer versions"
            ) from exc
        logprobs = [float(e[0]) for e in entries]
        token_ids = [int(e[1]) for e in entries]
        if finish_type == "abort" and len(token_ids) != len(output_ids):
            # An abort can cut the logprob stream one token short; keep only tokens that have a log-prob.
            n = min(len(token_ids), len(output_ids))
            output_ids, token_ids, logprobs = output_ids[:n], token_ids[:n], logprobs[:n]
        if token_ids != output_ids:
            raise EngineError(f"{url}/generate: output_token_logprobs do not match output_ids")
        return _Piece(output_ids, logprobs, version, finish_type, int(meta.get("prompt_tokens", 0)))

    # ---------------------------------------------------------------- health and admin (one engine each)
    async def health(self) -> dict[str, bool]:
        """Probe /health of every engine; a healthy answer revives an engine marked dead, a failure kills it."""

        async def probe(engine: _Engine) -> bool:
            try:
                await self._request(engine, "GET", "/health", None, self.admin_timeout_s)
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, EngineError) as exc:
                engine.dead = True
                engine.last_error = f"health check failed: {exc}"
                return False
            self._record_success(engine)
            return True

        engines = list(self._engines.values())
        results = await asyncio.gather(*(probe(e) for e in engines))
        return {e.url: ok for e, ok in zip(engines, results, strict=True)}

    async def pause_generation(self, url: str, mode: str = "abort", *, timeout_s: float | None = None) -> None:
        """Pause one engine; with mode abort its in-flight requests return at once (clients resume them)."""
        await self._admin(url, "POST", "/pause_generation", {"mode": mode}, timeout_s)

    async def continue_generation(self, url: str, *, timeout_s: float | None = None) -> None:
        await self._admin(url, "POST", "/continue_generation", {}, timeout_s)

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
        """Make one engine load an HF safetensors folder and report `weight_version` from then on."""
        payload = {
            "model_path": model_path,
            "weight_version": str(weight_version),
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        body = await self._admin(url, "POST", "/update_weights_from_disk", payload, timeout_s)
        if not isinstance(body, dict) or not body.get("success", False):
            raise EngineHTTPError(url, "/update_weights_from_disk", 200, str(body))
        return body

    async def get_weight_version(self, url: str, *, timeout_s: float | None = None) -> str:
        body = await self._admin(url, "GET", "/get_weight_version", None, timeout_s)
        return str(body["weight_version"])

    async def flush_cache(self, url: str, *, timeout_s: float | None = None) -> None:
        await self._admin(url, "POST", "/flush_cache", {}, timeout_s)

    async def abort_request(
        self, url: str, rid: str | None = None, *, abort_all: bool = False, timeout_s: float | None = None
    ) -> None:
        if rid is None and not abort_all:
            raise ValueError("abort_request needs rid or abort_all=True")
        payload: dict[str, Any] = {"abort_all": True} if abort_all else {"rid": rid}
        await self._admin(url, "POST", "/abort_request", payload, timeout_s)

    async def get_model_info(self, url: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        return await self._admin(url, "GET", "/get_model_info", None, timeout_s)

    async def get_server_info(self, url: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        return await self._admin(url, "GET", "/get_server_info", None, timeout_s)

    async def _admin(
        self, url: str, method: str, path: str, payload: dict[str, Any] | None, timeout_s: float | None
    ) -> Any:
        return await self._call_with_retries(
            self._engine(url), method, path, payload, self.admin_timeout_s if timeout_s is None else timeout_s
        )
