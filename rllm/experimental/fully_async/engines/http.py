"""One engine over HTTP: every route of SGLang 0.5.6's native API the project uses, with typed errors.

`EngineHTTP` knows one URL and nothing about other engines, retries or routing (that is `pool.py`). Every call
has a timeout whose error names the engine and the route; a non-200 answer is an `EngineHTTPError` carrying the
status and body; connection failures are raised as aiohttp's own errors so the pool can count and retry them.
When the engine was started with `--api-key`, every call sends `Authorization: Bearer <key>` (SGLang's scheme).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import aiohttp

from rllm.experimental.fully_async.errors import FullyAsyncError


class EngineError(FullyAsyncError, RuntimeError):
    """Base class of every error an engine call raises; the message names the engine URL."""


class EngineHTTPError(EngineError):
    """The engine answered with a non-success status or body."""

    def __init__(self, url: str, path: str, status: int, body: str) -> None:
        super().__init__(f"{url}{path} answered HTTP {status}: {body[:500]}")
        self.url, self.path, self.status, self.body = url, path, status, body

    def __reduce__(self) -> tuple:
        # Pickled across Ray processes with the constructor's arguments, not the message (see SyncError).
        return (type(self), (self.url, self.path, self.status, self.body))


class EngineTimeoutError(EngineError):
    """An engine did not answer within the call's timeout."""


class EngineConnectionError(EngineError):
    """An engine could not be reached (after retries, for admin calls)."""


# Connection-level failures: the engine may be gone. Callers count these toward marking an engine dead.
CONNECTION_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)


def new_session(max_connections: int = 1024) -> aiohttp.ClientSession:
    """A pooled session; it belongs to the event loop that creates it."""
    connector = aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=30)
    return aiohttp.ClientSession(connector=connector, json_serialize=json.dumps)


class EngineHTTP:
    """The HTTP calls of one engine at `url`. `session` returns the (shared, pooled) aiohttp session to use."""

    def __init__(
        self,
        url: str,
        session: Callable[[], aiohttp.ClientSession],
        *,
        api_key: str | None = None,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.url = url.rstrip("/")
        self._session = session
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.connect_timeout_s = connect_timeout_s

    async def request(self, method: str, path: str, payload: dict[str, Any] | None, timeout_s: float) -> Any:
        """One call; the JSON body (or text, or None when empty). Connection errors are raised as aiohttp's."""
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.connect_timeout_s)
        try:
            async with self._session().request(
                method, f"{self.url}{path}", json=payload, timeout=timeout, headers=self._headers
            ) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise EngineHTTPError(self.url, path, resp.status, text)
        except aiohttp.ConnectionTimeoutError:
            raise  # connect phase: a connection failure, retried by the caller
        except TimeoutError as exc:
            raise EngineTimeoutError(f"{self.url}{path} did not answer within {timeout_s:.1f}s") from exc
        if not text:
            return None
        try:
            return json.loads(text)
        except ValueError:
            return text

    # ---------------------------------------------------------------- routes (SGLang's names and fields)
    async def generate(self, payload: dict[str, Any], timeout_s: float) -> Any:
        return await self.request("POST", "/generate", payload, timeout_s)

    async def health(self, timeout_s: float) -> None:
        await self.request("GET", "/health", None, timeout_s)

    async def pause_generation(self, mode: str, timeout_s: float) -> None:
        await self.request("POST", "/pause_generation", {"mode": mode}, timeout_s)

    async def continue_generation(self, timeout_s: float) -> None:
        await self.request("POST", "/continue_generation", {}, timeout_s)

    async def abort_request(self, rid: str | None, abort_all: bool, timeout_s: float) -> None:
        if rid is None and not abort_all:
            raise ValueError("abort_request needs rid or abort_all=True")
        payload: dict[str, Any] = {"abort_all": True} if abort_all else {"rid": rid}
        await self.request("POST", "/abort_request", payload, timeout_s)

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str, *, flush_cache: bool, abort_all_requests: bool, timeout_s: float
    ) -> dict[str, Any]:
        payload = {
            "model_path": model_path,
            "weight_version": str(weight_version),
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        body = await self.request("POST", "/update_weights_from_disk", payload, timeout_s)
        if not isinstance(body, dict) or not body.get("success", False):
            raise EngineHTTPError(self.url, "/update_weights_from_disk", 200, str(body))
        return body

    async def update_weight_version(self, new_version: str, timeout_s: float) -> dict[str, Any]:
        # SGLang's abort_all_requests defaults to True: say False, or requests paused in place would be aborted.
        payload = {"new_version": str(new_version), "abort_all_requests": False}
        body = await self.request("POST", "/update_weight_version", payload, timeout_s)
        if not isinstance(body, dict) or not body.get("success", False):
            raise EngineHTTPError(self.url, "/update_weight_version", 200, str(body))
        return body

    async def get_weight_version(self, timeout_s: float) -> str:
        body = await self.request("GET", "/get_weight_version", None, timeout_s)
        if not isinstance(body, dict) or "weight_version" not in body:
            raise EngineHTTPError(self.url, "/get_weight_version", 200, str(body))
        return str(body["weight_version"])

    async def flush_cache(self, timeout_s: float) -> None:
        await self.request("POST", "/flush_cache", {}, timeout_s)

    async def get_model_info(self, timeout_s: float) -> dict[str, Any]:
        return await self.request("GET", "/get_model_info", None, timeout_s)

    async def get_server_info(self, timeout_s: float) -> dict[str, Any]:
        return await self.request("GET", "/get_server_info", None, timeout_s)

    # ---------------------------------------------------------------- LoRA (SGLang's routes; one extension)
    async def load_lora_adapter(self, name: str, path: str, pinned: bool, timeout_s: float) -> dict[str, Any]:
        """/load_lora_adapter; the answer's `loaded_adapters` (name -> path). A refusal (HTTP 400, success false)
        raises EngineHTTPError carrying SGLang's `error_message`."""
        payload = {"lora_name": name, "lora_path": path, "pinned": pinned}
        return _lora_update(
            self.url, "/load_lora_adapter", await self.request("POST", "/load_lora_adapter", payload, timeout_s)
        )

    async def unload_lora_adapter(self, name: str, timeout_s: float) -> dict[str, Any]:
        """/unload_lora_adapter; returns once the adapter's requests have finished (SGLang waits for them)."""
        body = await self.request("POST", "/unload_lora_adapter", {"lora_name": name}, timeout_s)
        return _lora_update(self.url, "/unload_lora_adapter", body)

    async def list_models(self, timeout_s: float) -> list[dict[str, Any]]:
        """/v1/models: the base model's card, then one per registered adapter (`parent` set)."""
        body = await self.request("GET", "/v1/models", None, timeout_s)
        if not isinstance(body, dict) or not isinstance(body.get("data"), list):
            raise EngineHTTPError(self.url, "/v1/models", 200, str(body))
        return body["data"]

    async def load_lora_adapter_from_distributed(
        self,
        *,
        name: str,
        config: dict[str, Any],
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        load_format: str | None,
        pinned: bool,
        timeout_s: float,
    ) -> dict[str, Any]:
        """The embedded engine's extension (not SGLang's): receive an adapter over the weight-update group; call it
        concurrently with rank 0's broadcast, as `/update_weights_from_distributed`."""
        payload = {
            "lora_name": name,
            "config": config,
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "load_format": load_format,
            "pinned": pinned,
        }
        path = "/load_lora_adapter_from_distributed"
        return _lora_update(self.url, path, await self.request("POST", path, payload, timeout_s))

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ) -> dict[str, Any]:
        payload = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self.request("POST", "/init_weights_update_group", payload, timeout_s)

    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None,
        flush_cache: bool,
        timeout_s: float,
    ) -> dict[str, Any]:
        payload = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "weight_version": weight_version,
        }
        return await self.request("POST", "/update_weights_from_distributed", payload, timeout_s)


def _lora_update(url: str, path: str, body: Any) -> dict[str, Any]:
    """SGLang's LoRAUpdateOutput with success true (a false one comes with HTTP 400, raised by `request`)."""
    if not isinstance(body, dict) or body.get("success") is not True:
        raise EngineHTTPError(url, path, 200, str(body))
    return body
