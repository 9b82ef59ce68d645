"""The stand-in's LoRA routes and `/generate`'s `lora_path`, as SGLang 0.5.6 serves them.

The protocol behind them is SGLang's registry and tokenizer manager, shared with the embedded engine
(`engines/embedded/lora_serving.py`, whose docstring lists each behaviour with its source function: loads and
unloads never pause generation, an unload waits for the adapter's requests while holding the LoRA update lock, a
name unloaded since is reloaded by the next request naming it, LRU eviction past `--max-loaded-loras`, admission by
`--max-loras-per-batch` with the base model counting as one). Here the adapter is served as SGLang serves it
(`strict=False`: scaling alpha / r whatever `use_rslora` says, `use_dora` & co unread). Kept here, from SGLang's
HTTP layer (source functions in brackets):
- `/load_lora_adapter` (`lora_name`, `lora_path`, `pinned` default false) and `/unload_lora_adapter`
  (`lora_name`) answer the LoRAUpdateOutput dataclass as orjson writes it, `{success, error_message,
  loaded_adapters: {name: path}, rid: null, http_worker_ipc: null}`, 200, or 400 when `success` is false
  (`http_server.load_lora_adapter`); without `--enable-lora`: 400 "LoRA is not enabled. Please set
  `--enable-lora` to enable LoRA.". A body without `lora_name` (or `lora_path`): FastAPI's 422. The call runs to its
  end even if the caller disconnects (FastAPI does not cancel it).
- `/v1/models`: the served model's card (id and root: the model path, `max_model_len`: the context length), then
  one card per registered adapter (id: its name, root: its path, parent: the served model), only with
  `--enable-lora` (`http_server.available_models`); an adapter being unloaded is no longer listed.
- `/generate`'s `lora_path` is ignored without `--enable-lora`: the request runs on the base model
  (`generate_request` resolves adapters only `if self.server_args.enable_lora and obj.lora_path`). With it, one
  string is broadcast over a batch (`_normalize_lora_paths`); a list shorter than the batch fails with 500
  (`GenerateReqInput.__getitem__` indexes past it: an uncaught IndexError), a longer one is cut; any other type is
  400 "lora_path should be a list or a string.". The answer's meta_info names no adapter.
- Flags (`server_args.py`): `--enable-lora`, `--max-lora-rank`, `--lora-target-modules` (choices: SGLang's nine
  names and `all`), `--lora-paths`, `--max-loras-per-batch` (8), `--max-loaded-loras`, `--lora-eviction-policy`
  (lru | fifo), `--lora-backend` (triton | csgmv | ascend; default csgmv), `--max-lora-chunk-size` (16..128);
  `check_lora_server_args`'s asserts stop the server. The eviction policy and backend pick GPU buffer slots and
  kernels: accepted, with nothing on a CPU to act on.
Not SGLang's: the test-only `--test-only-fail-lora-*` flags (`lora_fault.py`) make a load fail or the process end.
Not reproduced: SGLang reads an adapter inside its scheduler loop, so its forward passes stall for the read; here the
read runs beside them.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web
from lora_fault import injected_failure


class InternalServerError(Exception):
    """What SGLang does not catch: FastAPI answers 500 "Internal Server Error"."""


def lora_paths(st: Any, value: Any, n: int) -> list[str | None]:
    """Each prompt's adapter name as SGLang resolves `lora_path` (module docstring: ignored without --enable-lora,
    a string broadcast, a list indexed per prompt)."""
    if not st.args.enable_lora or not value:
        return [None] * n
    if isinstance(value, str):
        names: list[str | None] = [value] * n
    elif isinstance(value, list):
        if len(value) < n:
            raise InternalServerError  # GenerateReqInput.__getitem__: IndexError
        names = list(value[:n])
    else:
        raise ValueError("lora_path should be a list or a string.")
    st.lora.check_request(names)
    return names


async def load_lora_adapter(request: web.Request, st: Any) -> web.Response:
    body = await _body(request)
    for key in ("lora_name", "lora_path"):
        if body is None or not isinstance(body.get(key), str):
            return _detail(key)
    fault = injected_failure(st.args, body["lora_name"])  # test-only (lora_fault.py), not SGLang's
    if fault is not None:
        return fault
    work = st.lora.load_lora_adapter(body["lora_name"], body["lora_path"], bool(body.get("pinned", False)))
    return _lora_answer(await asyncio.shield(asyncio.ensure_future(work)))  # FastAPI does not cancel it


async def unload_lora_adapter(request: web.Request, st: Any) -> web.Response:
    body = await _body(request)
    if body is None or not isinstance(body.get("lora_name"), str):
        return _detail("lora_name")
    work = st.lora.unload_lora_adapter(body["lora_name"])
    return _lora_answer(await asyncio.shield(asyncio.ensure_future(work)))


def _lora_answer(result: Any) -> web.Response:
    return web.json_response(result.to_json(), status=200 if result.success else 400)


async def available_models(request: web.Request, st: Any) -> web.Response:
    """GET /v1/models: the served model (its name is --model-path), then the registered adapters."""
    served, created = st.args.model_path, int(time.time())
    cards = [_card(served, served, None, st.scheduler.runner.info.context_length, created)]
    if st.args.enable_lora:
        cards += [_card(r.lora_name, r.lora_path, served, None, created) for r in st.lora.registered()]
    return web.json_response({"object": "list", "data": cards})


def _detail(loc: str) -> web.Response:
    return web.json_response(
        {"detail": [{"type": "missing", "loc": ["body", loc], "msg": "Field required"}]}, status=422
    )


async def _body(request: web.Request) -> dict[str, Any] | None:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _card(model_id: str, root: str | None, parent: str | None, max_len: int | None, created: int) -> dict[str, Any]:
    keys = ("id", "object", "created", "owned_by", "root", "parent", "max_model_len")
    return dict(zip(keys, (model_id, "model", created, "sglang", root, parent, max_len), strict=True))


def add_routes(app: web.Application, state: Any) -> None:
    """Register the LoRA routes on the stand-in's app; `state` is its StandinState (its `lora` and `args`)."""
    app.router.add_post("/load_lora_adapter", lambda r: load_lora_adapter(r, state))
    app.router.add_post("/unload_lora_adapter", lambda r: unload_lora_adapter(r, state))
    app.router.add_get("/v1/models", lambda r: available_models(r, state))
