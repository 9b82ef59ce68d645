"""The stand-in's distributed weight-update routes, as SGLang 0.5.6 serves them (source functions in brackets):

- `/init_weights_update_group` (`master_address`, `master_port`, `rank_offset`, `world_size`, `group_name`
  default "weight_update_group", `backend` default "nccl"): joins a new process group as rank rank_offset + tp_rank
  through `tcp://master_address:master_port` and answers once every rank joined; 200 `{success, message}` or 400
  with "Failed to initialize custom process group: ..." (`model_runner.init_weights_update_group`).
- `/update_weights_from_distributed` (`names`, `dtypes`, `shapes`, `group_name`, `flush_cache` default true,
  `abort_all_requests`, `weight_version`, `load_format`): `abort_all_requests` aborts first; when paused the
  update runs at once and returns WITHOUT applying `weight_version`; otherwise it takes the model-update writer
  lock (waits for running requests) and applies `weight_version` on success
  (`tokenizer_communicator_mixin.update_weights_from_distributed`). The receive is one broadcast from rank 0 per
  tensor, or one per call with load_format=flattened_bucket (`model_runner.update_weights_from_distributed`).
  Unknown group: SGLang's model runner asserts (which can take its scheduler down); the stand-in answers 400.
- `/destroy_weights_update_group` (`group_name`): 200, or 400 "The group to be destroyed does not exist.".
Missing fields: 422 `{"detail": [...]}` (FastAPI validation).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from rllm.experimental.fully_async.engines.embedded.scheduler import WeightUpdateError
from rllm.experimental.fully_async.engines.embedded.weights import copy_some_into
from rllm.experimental.fully_async.engines.weight_group import DEFAULT_GROUP_NAME, WeightUpdateGroups

GROUPS = web.AppKey("weight_update_groups", WeightUpdateGroups)
GROUP_TIMEOUT_S = 1800.0  # torch's default_pg_timeout, which SGLang's init_custom_process_group uses


def _detail(loc: str, msg: str = "Field required") -> web.Response:
    return web.json_response({"detail": [{"type": "missing", "loc": ["body", loc], "msg": msg}]}, status=422)


def _answer(success: bool, message: str) -> web.Response:
    return web.json_response({"success": success, "message": message}, status=200 if success else 400)


async def _body(request: web.Request) -> dict[str, Any] | None:
    try:
        body = await request.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


async def init_weights_update_group(request: web.Request) -> web.Response:
    body = await _body(request)
    for key in ("master_address", "master_port", "rank_offset", "world_size"):
        if body is None or body.get(key) is None:
            return _detail(key)
    assert body is not None
    success, message = await asyncio.to_thread(
        request.app[GROUPS].init_group,
        master_address=str(body["master_address"]),
        master_port=int(body["master_port"]),
        rank_offset=int(body["rank_offset"]),
        world_size=int(body["world_size"]),
        group_name=str(body.get("group_name", DEFAULT_GROUP_NAME)),
        backend=str(body.get("backend", "nccl")),
        timeout_s=GROUP_TIMEOUT_S,
    )
    return _answer(success, message)


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    body = await _body(request) or {}
    success, message = await asyncio.to_thread(
        request.app[GROUPS].destroy, str(body.get("group_name", DEFAULT_GROUP_NAME))
    )
    return _answer(success, message)


async def update_weights_from_distributed(request: web.Request, state: Any) -> web.Response:
    """`state` is the stand-in's `StandinState` (pause flag and condition, writer lock, version)."""
    body = await _body(request)
    for key in ("names", "dtypes", "shapes"):
        if body is None or not isinstance(body.get(key), list):
            return _detail(key)
    assert body is not None
    if body.get("abort_all_requests"):
        state.abort_all("Abort in waiting queue")
    groups = request.app[GROUPS]

    async def update() -> tuple[bool, str]:
        try:
            tensors, buffer = await asyncio.to_thread(
                groups.receive,
                body["names"],
                body["dtypes"],
                body["shapes"],
                str(body.get("group_name", DEFAULT_GROUP_NAME)),
                body.get("load_format"),
            )
            try:
                await state.scheduler.swaps.update_weights_in_place(
                    lambda model: copy_some_into(model, tensors), None, abort_all_requests=False, drain_timeout_s=600.0
                )
            finally:
                groups.recycle(buffer)
        except (WeightUpdateError, KeyError, ValueError, RuntimeError) as exc:
            return False, (
                f"Failed to update parameter online: {exc}. The full weights of the ModelRunner are partially "
                "updated. Please discard the whole weights."
            )
        return True, "Succeeded to update parameter online."

    async with state.is_pause_cond:
        if state.is_pause:  # SGLang returns here, before the weight version is applied
            return _answer(*await update())
    async with state.writer_lock():
        success, message = await update()
    version = body.get("weight_version")
    if success and version is not None:
        state.weight_version = str(version)
        message += f" Weight version updated to {version}."
    return _answer(success, message)


def add_routes(app: web.Application, state: Any) -> None:
    """Register the three routes (POST, as SGLang) on the stand-in's app."""
    app[GROUPS] = WeightUpdateGroups("cpu")
    app.router.add_post("/init_weights_update_group", init_weights_update_group)
    app.router.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    app.router.add_post("/update_weights_from_distributed", lambda r: update_weights_from_distributed(r, state))
