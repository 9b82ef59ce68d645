"""The embedded engine's distributed weight-update routes (SGLang's names, fields and answers):

    POST /init_weights_update_group       {master_address, master_port, rank_offset, world_size, group_name, backend}
    POST /destroy_weights_update_group    {group_name}
    POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache, abort_all_requests,
                                           weight_version, load_format}

Each answers `{"success", "message"}`, HTTP 200 or 400. `/init_weights_update_group` returns once every rank of
the group has joined, `/update_weights_from_distributed` once the trainer's broadcast of that call's tensors has
completed and they are applied: the trainer must make these calls CONCURRENTLY with its own side of the
rendezvous and the broadcast (sglang `model_runner.init_weights_update_group` / `update_weights_from_distributed`).
Receiving runs in a worker thread while the engine keeps decoding; the received tensors are then copied into the
served model between steps once no request runs (`WeightSwaps.update_weights_in_place`, the same drain as a disk
update), so no request ever mixes the weights of one call with older ones. A sync of several calls (buckets) is
atomic for requests only while the engine is paused, as in SGLang: ParamSync pauses first. Unlike SGLang while
paused, the embedded engine applies `weight_version` on success (its disk route does the same); ParamSync sets and
reads the version back either way.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch
from aiohttp import web

from rllm.experimental.fully_async.engines.embedded.scheduler import Scheduler, WeightUpdateError
from rllm.experimental.fully_async.engines.embedded.weights import copy_some_into
from rllm.experimental.fully_async.engines.weight_group import DEFAULT_GROUP_NAME, WeightUpdateGroups

logger = logging.getLogger(__name__)


class _State:
    def __init__(self, scheduler: Scheduler, groups: WeightUpdateGroups, timeout_s: float) -> None:
        self.scheduler, self.groups, self.timeout_s = scheduler, groups, timeout_s


STATE_KEY = web.AppKey("weight_group_state", _State)


def _answer(success: bool, message: str) -> web.Response:
    return web.json_response({"success": success, "message": message}, status=200 if success else 400)


async def init_weights_update_group(request: web.Request) -> web.Response:
    st = request.app[STATE_KEY]
    try:
        body = await request.json()
        fields = {k: body[k] for k in ("master_address", "master_port", "rank_offset", "world_size")}
    except (ValueError, KeyError, TypeError) as exc:
        return _answer(False, f"bad request: {exc!r}")
    backend = str(body.get("backend", "nccl"))
    if backend == "nccl" and not torch.cuda.is_available():
        return _answer(False, "backend nccl needs CUDA; the embedded engine runs on CPU: use backend gloo")
    success, message = await asyncio.to_thread(
        st.groups.init_group,
        master_address=str(fields["master_address"]),
        master_port=int(fields["master_port"]),
        rank_offset=int(fields["rank_offset"]),
        world_size=int(fields["world_size"]),
        group_name=str(body.get("group_name", DEFAULT_GROUP_NAME)),
        backend=backend,
        timeout_s=st.timeout_s,
    )
    return _answer(success, message)


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    st = request.app[STATE_KEY]
    body = await request.json() if request.can_read_body else {}
    success, message = await asyncio.to_thread(st.groups.destroy, str(body.get("group_name", DEFAULT_GROUP_NAME)))
    return _answer(success, message)


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    st = request.app[STATE_KEY]
    try:
        body: dict[str, Any] = await request.json()
        names, dtypes, shapes = list(body["names"]), list(body["dtypes"]), [list(s) for s in body["shapes"]]
    except (ValueError, KeyError, TypeError) as exc:
        return _answer(False, f"bad request: {exc!r}")
    group_name = str(body.get("group_name", DEFAULT_GROUP_NAME))
    version = body.get("weight_version")
    if body.get("abort_all_requests"):
        st.scheduler.abort_all("aborted for a weight update")
    try:
        tensors, buffer = await asyncio.to_thread(
            st.groups.receive, names, dtypes, shapes, group_name, body.get("load_format")
        )
    except Exception as exc:
        message = f"Failed to update parameter online: {exc}."
        logger.error(message)
        return _answer(False, message)
    try:
        await st.scheduler.swaps.update_weights_in_place(
            lambda model: copy_some_into(model, tensors),
            None if version is None else str(version),
            abort_all_requests=False,
            drain_timeout_s=st.timeout_s,
        )
    except WeightUpdateError as exc:
        logger.error("update from group %s failed: %s", group_name, exc)
        return _answer(False, f"Failed to update parameter online: {exc}.")
    finally:
        st.groups.recycle(buffer)  # copied into the model (or refused): the buffer is free
    message = "Succeeded to update parameter online."
    if version is not None:
        message += f" Weight version updated to {version}."
    return _answer(True, message)


def add_weight_group_routes(app: web.Application, scheduler: Scheduler, timeout_s: float) -> WeightUpdateGroups:
    """Register the three routes on `app`; returns the groups object (the server destroys them at shutdown)."""
    groups = WeightUpdateGroups("cpu")
    app[STATE_KEY] = _State(scheduler, groups, timeout_s)
    app.router.add_post("/init_weights_update_group", init_weights_update_group)
    app.router.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    app.router.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    return groups
