"""A stand-in for SGLang 0.5.6's HTTP server, written from its source, generating with the embedded engine.

SGLang cannot be installed on CPU machines, so the client, ParamSync and the end-to-end loop are also tested
against this server. Its HTTP layer reproduces what `sglang/srt/entrypoints/http_server.py` and
`sglang/srt/managers/tokenizer_manager.py` (0.5.6) do, quirks included; generation reuses the embedded engine's
`Scheduler` and `ModelRunner` underneath. Behaviour reproduced (source functions in brackets):
- `weight_version` is the server's string (`--weight-version`, default "default"); `/generate` reports the
  version current when the response is built (`_handle_batch_output`: `self.server_args.weight_version`).
- `/update_weights_from_disk` while paused loads and returns WITHOUT applying `weight_version`; only the unpaused
  path (which waits for running requests: model_update_lock.writer_lock) sets it (`update_weights_from_disk`).
- `/update_weight_version` (`new_version`, `abort_all_requests` defaulting to TRUE) sets it at any time;
  `/get_weight_version` and `/weight_version` read it.
- Requests arriving while paused are held before they reach the scheduler, not refused (`is_pause_cond`); aborts
  do not touch them. Pause modes: abort (abort everything in the scheduler, then poll: while a request still
  holds the model-update lock, sleep 1 s and abort again, so a pause with requests in flight takes ~1 s and one
  without returns at once: `pause_generation`, tokenizer_manager.py lines 1264-1277), in_place and retract (the
  scheduler stops stepping and keeps its requests).
- A request aborted in the waiting queue returns `meta_info` with `id`, `finish_reason {type: abort, message}`,
  `completion_tokens` and the log-prob lists, but no `weight_version` and no `prompt_tokens` (`_handle_abort_req`).
- HTTP codes: body validation fails with 422 `{"detail": [...]}` (FastAPI); `/generate` ValueErrors 400
  `{"error": {"message"}}`; failed weight loads 400 with `success: false`; `/abort_request` 200 with an empty body;
  `/flush_cache` 400 while requests run; with `--api-key`, every path but /health* and /metrics needs
  `Authorization: Bearer <key>` or gets 401 `{"error": "Unauthorized"}` (`add_api_key_middleware`).
- `sampling_params.sampling_seed` is accepted on every request and read only under `--enable-deterministic-inference`
  (`SamplingBatchInfo.from_schedule_batch` builds the seed tensor only then), where a request without one draws
  with the default 42 (`SamplingParams.__init__`) and the kernels are batch-invariant (here: each request runs
  alone, the embedded scheduler's deterministic mode); without the flag the seed is ignored. A seeded request draws
  with SGLang's own rule (`multinomial_with_seed`), which is biased (engines/embedded/sampling.py).
- `/slow_down {forward_sleep_time}` (GET or POST; a number, or null or <= 0 to stop) makes the scheduler sleep that
  long before every batch and answers 200 with a null body (`Scheduler.slow_down`, `run_batch`): the tests' way to
  catch a request mid-decode.
- LoRA: `--enable-lora` & co, `/load_lora_adapter`, `/unload_lora_adapter`, `/v1/models`, `/generate`'s
  `lora_path`; its quirks are listed in `lora_routes.py`.
- `/generate` with `stream: true` (`http_server.generate_request`, `tokenizer_manager._wait_one_response` and
  `_handle_batch_output`, without `--stream-output`, which the launcher never passes): the status and headers
  (`text/event-stream`) go out at once, a request sent while paused is held after them; then one
  `data: {json}\n\n` chunk per scheduler output, only the latest when several came between two reads, each the
  request so far: cumulative `text` and `output_ids`, `meta_info` with `finish_reason` null until the last chunk, the
  server's `weight_version` as each chunk is built, cumulative `output_token_logprobs`, `response_sent_to_client_ts`
  on the first chunk only and `e2e_latency` on the last; a batch's chunks interleaved, each with its prompt's
  `index`; a ValueError as a `data: {"error": {"message"}}` chunk; `data: [DONE]\n\n` last. A request aborted in
  the waiting queue ends its stream with `_handle_abort_req`'s chunk (its last token as `output_ids`, none here).
  Not reproduced: SGLang aborts a stream's requests 2 s after its client disconnects (`create_abort_task`); the
  stand-in frees them at once, as the embedded engine does.
- A running request aborted (by `/abort_request`, a pause or `abort_all_requests`) ends with SGLang's `FINISH_ABORT`
  (`{type: abort, message: "Aborted", status_code: null, err_type: null}`); one aborted in the waiting queue with
  `_handle_abort_req`'s `{type: abort, message: "Abort in waiting queue"}`.
- The `--test-only-fail-lora-*` flags (`lora_fault.py`: an adapter load that fails, or kills the process) are NOT
  SGLang's either.
- The `/test_only/*` routes (the embedded engine's `decode_hold.py`: hold forward passes while chosen requests
  decode) are NOT SGLang's; the stand-in serves them always, being a test fixture itself.
The distributed weight-update routes are in `distributed_routes.py`. `/get_server_info` carries
`internal_states: [<embedded scheduler stats>]` (SGLang's shape; the keys inside are the embedded engine's, which
the tests read).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import time
import uuid
from typing import Any

import torch
from aiohttp import web
from distributed_routes import add_routes as _add_distributed_routes
from lora_fault import add_fault_flags
from lora_routes import InternalServerError, lora_paths
from lora_routes import add_routes as _add_lora_routes

from rllm.experimental.fully_async.engines.embedded.decode_hold import add_test_only_routes
from rllm.experimental.fully_async.engines.embedded.lora import (
    LORA_TARGET_ALL,
    SUPPORTED_LORA_TARGET_MODULES,
    LoRALimits,
)
from rllm.experimental.fully_async.engines.embedded.lora_api import (
    check_lora_flags,
    load_initial_adapters,
    lora_limits,
)
from rllm.experimental.fully_async.engines.embedded.lora_serving import LoRAServing
from rllm.experimental.fully_async.engines.embedded.model_runner import ModelRunner, load_model
from rllm.experimental.fully_async.engines.embedded.requests import GenerateOutput, WeightUpdateError
from rllm.experimental.fully_async.engines.embedded.sampling import SamplingParams
from rllm.experimental.fully_async.engines.embedded.scheduler import PAUSE_MODES, Scheduler, interleave_streams
from rllm.experimental.fully_async.engines.embedded.weights import WeightLoader

logger = logging.getLogger("sglang_standin")

STATE = web.AppKey("state", object)
# tokenizer_manager.pause_generation (mode abort) re-checks the model-update lock every second while it is held.
PAUSE_POLL_S = 1.0
SGLANG_DTYPES = {"auto": "float32", "float": "float32", "float32": "float32", "bfloat16": "bfloat16"}
# schedule_batch.FINISH_ABORT().to_json(): how a running request that was aborted finishes
RUNNING_ABORT = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def _detail(loc: str, msg: str) -> web.Response:
    return web.json_response({"detail": [{"type": "value_error", "loc": ["body", loc], "msg": msg}]}, status=422)


def lora_limits_off() -> LoRALimits:
    """Limits of a server without --enable-lora (its LoRA routes refuse before reading them)."""
    return LoRALimits(max_lora_rank=0, target_modules=frozenset())


class StandinState:
    """The TokenizerManager's state that matters here: pause flag and condition, version, model-update lock."""

    def __init__(self, scheduler: Scheduler, args: argparse.Namespace, lora: LoRAServing | None = None) -> None:
        self.scheduler = scheduler
        self.args = args
        self.lora = lora or LoRAServing(lora_limits_off(), lambda: scheduler.runner.model, enabled=False)
        self.weight_version: str = args.weight_version
        self.model_path: str = args.model_path
        self.is_pause = False
        self.pause_mode: str | None = None  # for /get_server_info only
        self.is_pause_cond = asyncio.Condition()
        self.readers = 0  # generate requests holding model_update_lock.reader_lock
        self.readers_cond = asyncio.Condition()
        self.writer = False
        self.waiting_aborted: set[str] = set()

    def abort_all(self, message: str) -> int:
        """AbortReq(abort_all): the scheduler aborts its requests; waiting-queue ones answer without a version."""
        self.waiting_aborted |= self.scheduler.waiting_rids()
        return self.scheduler.abort_all(message, include_held=False)

    def is_locked(self) -> bool:
        """RWLock.is_locked: a request holds the reader lock or a weight update holds the writer lock."""
        return self.writer or self.readers > 0

    async def reader_enter(self) -> None:
        async with self.readers_cond:
            await self.readers_cond.wait_for(lambda: not self.writer)
            self.readers += 1

    async def reader_exit(self) -> None:
        async with self.readers_cond:
            self.readers -= 1
            self.readers_cond.notify_all()

    @contextlib.asynccontextmanager
    async def writer_lock(self) -> Any:
        async with self.readers_cond:
            await self.readers_cond.wait_for(lambda: not self.writer)
            self.writer = True
            await self.readers_cond.wait_for(lambda: self.readers == 0)
        try:
            yield
        finally:
            async with self.readers_cond:
                self.writer = False
                self.readers_cond.notify_all()


async def _body(request: web.Request) -> dict[str, Any] | None:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


@web.middleware
async def api_key_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    key = request.app[STATE].args.api_key
    exempt = request.method == "OPTIONS" or request.path.startswith(("/health", "/metrics"))
    if key and not exempt and request.headers.get("Authorization") != "Bearer " + key:
        return web.json_response({"error": "Unauthorized"}, status=401)
    return await handler(request)


def _per_item(value: Any, n: int, is_single: Any) -> list[Any]:
    """GenerateReqInput.normalize_batch_and_arguments: one value is broadcast over the batch, a list must match it."""
    if is_single(value):
        return [value] * n
    if not isinstance(value, list) or len(value) != n:
        raise ValueError(f"The length of the list must match the batch size ({n})")
    return value


async def generate(request: web.Request) -> web.Response:
    """POST /generate: one prompt, or a batch (input_ids a list of lists, GenerateReqInput's batch form).

    A batch passes the pause gate and takes the reader lock once, its prompts run together, and the answer is the
    list of their outputs when the last one finishes (tokenizer_manager._handle_batch_request, not streamed).
    """
    st: StandinState = request.app[STATE]
    body = await _body(request)
    if body is None:
        return _detail("", "Input should be a valid dictionary")
    input_ids = body.get("input_ids")
    if not isinstance(input_ids, list) or not input_ids:
        # SGLang tokenizes text; a CPU stand-in without a tokenizer serves token-id prompts only.
        return web.json_response({"error": {"message": "the stand-in serves input_ids prompts"}}, status=400)
    single = not isinstance(input_ids[0], list)
    prompts = [input_ids] if single else input_ids
    n = len(prompts)
    try:
        raw_params = _per_item(body.get("sampling_params"), n, lambda v: v is None or isinstance(v, dict))
        params = [SamplingParams.from_json(p) for p in raw_params]
        if not st.args.enable_deterministic_inference:  # accepted, then unused (module docstring)
            params = [dataclasses.replace(p, sampling_seed=None) for p in params]
        rid = body.get("rid")
        # _normalize_rid: one string rid over a batch becomes rid_0, rid_1, ...; a list must match the batch.
        if single:
            rids = [rid]
        elif isinstance(rid, str):
            rids = [f"{rid}_{i}" for i in range(n)]
        else:
            rids = _per_item(rid, n, lambda v: v is None)
        logprob = _per_item(body.get("return_logprob", False), n, lambda v: isinstance(v, bool))
        loras = lora_paths(st, body.get("lora_path"), n)
    except InternalServerError:
        return web.Response(status=500, text="Internal Server Error")
    except (ValueError, TypeError) as exc:
        return web.json_response({"error": {"message": str(exc)}}, status=400)
    rids = [str(r or uuid.uuid4().hex) for r in rids]
    if body.get("stream"):
        return await _stream(request, st, prompts, params, rids, logprob, loras, single)
    async with st.is_pause_cond:  # held while paused (generate_request)
        await st.is_pause_cond.wait_for(lambda: not st.is_pause)
    await st.reader_enter()
    try:
        outs = await asyncio.gather(
            *(
                st.scheduler.generate(list(p), sp, rid, lora_path=lora)
                for p, sp, rid, lora in zip(prompts, params, rids, loras, strict=True)
            )
        )
    except ValueError as exc:
        return web.json_response({"error": {"message": str(exc)}}, status=400)
    finally:
        await st.reader_exit()
    answers = [_output(st, out, rid, lp) for out, rid, lp in zip(outs, rids, logprob, strict=True)]
    return web.json_response(answers[0] if single else answers)


def _output(
    st: StandinState, out: GenerateOutput, rid: str, return_logprob: bool, *, stamp: bool = True
) -> dict[str, Any]:
    """One prompt's answer, or a streamed chunk of it (`finish_reason` None: the request so far); a prompt aborted
    in the waiting queue has no weight_version, prompt_tokens nor e2e_latency (`_handle_abort_req`). `stamp`: the
    first (or only) output sent, which `_wait_one_response` stamps with `response_sent_to_client_ts`."""
    finish = out.finish_reason
    in_waiting_queue = finish is not None and finish.get("type") == "abort" and rid in st.waiting_aborted
    if finish is not None and finish.get("type") == "abort":
        finish = {"type": "abort", "message": "Abort in waiting queue"} if in_waiting_queue else RUNNING_ABORT
    meta: dict[str, Any] = {"id": rid, "finish_reason": finish}
    if return_logprob:
        pairs = zip(out.output_logprobs, out.output_ids, strict=True)
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in pairs]
    meta["completion_tokens"] = len(out.output_ids)
    if not in_waiting_queue:
        meta.update(
            prompt_tokens=out.prompt_tokens, weight_version=st.weight_version, total_retractions=0, cached_tokens=0
        )
        if finish is not None:
            meta["e2e_latency"] = out.e2e_latency
    if stamp:
        meta["response_sent_to_client_ts"] = time.time()
    if finish is not None:
        st.waiting_aborted.discard(rid)
    return {"text": "", "output_ids": out.output_ids, "meta_info": meta}


def _sse(payload: Any) -> bytes:
    """One Server-Sent Event as http_server.generate_request writes it: `data: ` + orjson's compact JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _stream(
    request: web.Request,
    st: StandinState,
    prompts: list[list[int]],
    params: list[SamplingParams],
    rids: list[str],
    logprob: list[bool],
    loras: list[str | None],
    single: bool,
) -> web.StreamResponse:
    """The streamed /generate (module docstring): headers first (Starlette's StreamingResponse), then the pause gate
    and the reader lock inside the stream, as tokenizer_manager.generate_request runs inside it."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    async with st.is_pause_cond:
        await st.is_pause_cond.wait_for(lambda: not st.is_pause)
    await st.reader_enter()
    try:
        streams = [
            st.scheduler.generate_stream(list(p), sp, r, lora)
            for p, sp, r, lora in zip(prompts, params, rids, loras, strict=True)
        ]
        sent = [False] * len(rids)
        async for index, out in interleave_streams(streams):
            chunk = _output(st, out, rids[index], logprob[index], stamp=not sent[index])
            sent[index] = True
            if "prompt_tokens" not in chunk["meta_info"]:  # aborted in the waiting queue: _handle_abort_req
                chunk["output_ids"] = out.output_ids[-1:]  # a stream gets its last token (none: it never ran)
            if not single:
                chunk["index"] = index
            await response.write(_sse(chunk))
    except ValueError as exc:
        await response.write(_sse({"error": {"message": str(exc)}}))
    finally:
        await st.reader_exit()
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def pause_generation(request: web.Request) -> web.Response:
    st: StandinState = request.app[STATE]
    body = await _body(request)
    mode = (body or {}).get("mode", "abort")
    if mode not in PAUSE_MODES:
        return _detail("mode", f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
    async with st.is_pause_cond:
        st.is_pause, st.pause_mode = True, mode
        if mode != "abort":
            st.scheduler.pause(mode)
        else:
            # SGLang polls: abort everything, then ask the model-update lock whether a request still holds it; if
            # one does, sleep a whole second and repeat. An aborted request needs a moment to release its reader
            # lock, so with requests in flight the first check almost always finds the lock held: a pause then
            # costs about a second. With none in flight it returns at once.
            while True:
                st.abort_all("Abort in waiting queue")
                if not st.is_locked():
                    break
                await asyncio.sleep(PAUSE_POLL_S)
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    st: StandinState = request.app[STATE]
    async with st.is_pause_cond:
        st.is_pause, st.pause_mode = False, None
        if st.scheduler.paused:
            st.scheduler.resume()
        st.is_pause_cond.notify_all()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def abort_request(request: web.Request) -> web.Response:
    st: StandinState = request.app[STATE]
    body = await _body(request) or {}
    if body.get("abort_all"):
        st.abort_all("Abort in waiting queue")
    elif body.get("rid"):
        rid = str(body["rid"])
        if rid in st.scheduler.waiting_rids():
            st.waiting_aborted.add(rid)
        st.scheduler.abort(rid, "Abort in waiting queue")
    return web.Response(status=200)


async def update_weights_from_disk(request: web.Request) -> web.Response:
    st: StandinState = request.app[STATE]
    body = await _body(request)
    if body is None or not isinstance(body.get("model_path"), str):
        return _detail("model_path", "Field required")
    if body.get("abort_all_requests"):
        st.abort_all("Abort in waiting queue")
    version = body.get("weight_version")

    async def load() -> tuple[bool, str]:
        try:
            await st.scheduler.swaps.update_weights_from_disk(
                body["model_path"], None, abort_all_requests=False, drain_timeout_s=600.0
            )
        except WeightUpdateError as exc:
            return False, f"Failed to update weights: {exc}."
        st.model_path = body["model_path"]
        return True, "Succeeded to update model weights."

    async with st.is_pause_cond:
        if st.is_pause:  # SGLang returns here, before the weight version is applied
            success, message = await load()
            return _update_answer(success, message)
    async with st.writer_lock():
        success, message = await load()
    if success and version is not None:
        st.weight_version = str(version)
        message += f" Weight version updated to {version}."
    return _update_answer(success, message)


def _update_answer(success: bool, message: str) -> web.Response:
    body = {"success": success, "message": message, "num_paused_requests": 0}
    return web.json_response(body, status=200 if success else 400)


async def update_weight_version(request: web.Request) -> web.Response:
    st: StandinState = request.app[STATE]
    body = await _body(request)
    if body is None or body.get("new_version") is None:
        return _detail("new_version", "Field required")
    if body.get("abort_all_requests", True):  # SGLang's default is True
        st.abort_all("Abort in waiting queue")
    st.weight_version = str(body["new_version"])
    return web.json_response(
        {"success": True, "message": f"Weight version updated to {st.weight_version}", "new_version": st.weight_version}
    )


async def slow_down(request: web.Request) -> web.Response:
    body = await _body(request)
    if body is None or "forward_sleep_time" not in body:
        return _detail("forward_sleep_time", "Field required")
    seconds = body["forward_sleep_time"]
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, int | float)):
        return _detail("forward_sleep_time", "Input should be a valid number")
    request.app[STATE].scheduler.slow_down(seconds)
    return web.json_response(None)  # the handler returns None: FastAPI answers `null`


async def weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[STATE].weight_version})


async def flush_cache(request: web.Request) -> web.Response:
    ok = request.app[STATE].scheduler.flush_cache()
    text = (
        "Cache flushed.\nPlease check backend logs for more details. "
        "(When there are running or waiting requests, the operation will not be performed.)\n"
    )
    return web.Response(text=text, status=200 if ok else 400)


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[STATE].scheduler.alive else 503)


async def model_info(request: web.Request) -> web.Response:
    st: StandinState = request.app[STATE]
    return web.json_response(
        {
            "model_path": st.model_path,
            "tokenizer_path": st.args.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": st.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }
    )


async def server_info(request: web.Request) -> web.Response:
    st: StandinState = request.app[STATE]
    args = {k: v for k, v in vars(st.args).items() if isinstance(v, (str, int, float, bool, type(None)))}
    args.pop("api_key", None)
    stats = {**st.scheduler.snapshot(), "paused": st.pause_mode}
    return web.json_response({**args, "internal_states": [stats], "version": "0.5.6-standin"})


def build_app(scheduler: Scheduler, args: argparse.Namespace) -> web.Application:
    app = web.Application(client_max_size=1 << 30, middlewares=[api_key_middleware])
    app[STATE] = StandinState(scheduler, args, scheduler.lora)
    _add_distributed_routes(app, app[STATE])  # /init_weights_update_group & co
    _add_lora_routes(app, app[STATE])  # /load_lora_adapter, /unload_lora_adapter, /v1/models
    add_test_only_routes(app, scheduler.decode_hold, enabled=True)  # not SGLang's (module docstring)
    for path, handler, methods in [
        ("/generate", generate, ("POST", "PUT")),
        ("/pause_generation", pause_generation, ("POST",)),
        ("/continue_generation", continue_generation, ("POST",)),
        ("/abort_request", abort_request, ("POST",)),
        ("/update_weights_from_disk", update_weights_from_disk, ("POST",)),
        ("/update_weight_version", update_weight_version, ("POST",)),
        ("/flush_cache", flush_cache, ("GET", "POST")),
        ("/slow_down", slow_down, ("GET", "POST")),
        ("/health", health, ("GET",)),
        ("/health_generate", health, ("GET",)),
        ("/get_weight_version", weight_version, ("GET",)),
        ("/weight_version", weight_version, ("GET",)),
        ("/get_model_info", model_info, ("GET",)),
        ("/model_info", model_info, ("GET",)),
        ("/get_server_info", server_info, ("GET",)),
        ("/server_info", server_info, ("GET",)),
    ]:
        for method in methods:
            app.router.add_route(method, path, handler)
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`sglang.launch_server`'s flags that the project's launcher emits (names, types and defaults as 0.5.6)."""
    p = argparse.ArgumentParser(prog="sglang.launch_server (stand-in)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dtype", default="auto", choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--log-level", default="info")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--skip-server-warmup", action="store_true")
    p.add_argument("--api-key", default=None)
    p.add_argument("--enable-deterministic-inference", action="store_true")
    # LoRA (server_args.py, names, choices and defaults as 0.5.6)
    p.add_argument("--enable-lora", default=None, action="store_true")
    p.add_argument("--max-lora-rank", type=int, default=None)
    p.add_argument(
        "--lora-target-modules", choices=[*SUPPORTED_LORA_TARGET_MODULES, LORA_TARGET_ALL], nargs="*", default=None
    )
    p.add_argument("--lora-paths", nargs="*", default=None)
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--max-loaded-loras", type=int, default=None)
    p.add_argument("--lora-eviction-policy", default="lru", choices=["lru", "fifo"])
    p.add_argument("--lora-backend", default="csgmv", choices=["triton", "csgmv", "ascend"])
    p.add_argument("--max-lora-chunk-size", type=int, default=16, choices=[16, 32, 64, 128])
    add_fault_flags(p)  # test-only, not SGLang's (lora_fault.py)
    args = p.parse_args(argv)
    try:
        check_lora_flags(args)  # SGLang's check_lora_server_args (its asserts stop the server)
    except ValueError as exc:
        p.error(str(exc))
    if args.tp_size != 1:
        p.error("the CPU stand-in runs tp_size 1 only")
    if args.dtype in ("half", "float16"):
        p.error("the CPU stand-in runs float32 or bfloat16")
    return args


async def serve(args: argparse.Namespace) -> None:
    dtype = SGLANG_DTYPES[args.dtype]
    model, info = await asyncio.to_thread(load_model, args.model_path, dtype)
    lora = None
    if args.enable_lora:
        # strict=False: served as SGLang serves it (alpha / r, other peft options unread)
        lora = LoRAServing(await asyncio.to_thread(lora_limits, args), lambda: runner.model, strict=False)
    runner = ModelRunner(
        model,
        info,
        seed=args.random_seed or 0,
        seeded_rule="sglang-0.5.6",  # its biased rule
        lora_layers=lora.layers if lora else None,
    )
    scheduler = Scheduler(
        runner,
        max_running_requests=args.max_running_requests or 256,
        weight_loader=WeightLoader(dtype),
        deterministic=args.enable_deterministic_inference,
        lora=lora,
    )
    if lora is not None:
        await load_initial_adapters(lora, args.lora_refs)
    scheduler.start()
    app_runner = web.AppRunner(build_app(scheduler, args), handler_cancellation=True, access_log=None)
    await app_runner.setup()
    await web.TCPSite(app_runner, args.host, args.port).start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    logger.info("SGLang stand-in ready on http://%s:%d", args.host, args.port)
    try:
        await stop.wait()
    finally:
        await scheduler.stop()
        with contextlib.suppress(Exception):
            await app_runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # force: as SGLang's configure_logger does; a library imported first (verl sets WARNING at import) must not
    # swallow the server's own lines.
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s standin:{args.port} %(message)s", force=True)
    torch.set_num_threads(int(os.environ.get("SGLANG_STANDIN_THREADS", "1")))
    torch.manual_seed(args.random_seed or 0)
    asyncio.run(serve(args))
    logging.shutdown()
    os._exit(0)
