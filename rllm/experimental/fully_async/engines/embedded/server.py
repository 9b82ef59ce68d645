"""HTTP front of the embedded engine: the SGLang 0.5.6 native API subset over aiohttp, and its CLI.

    python -m rllm.experimental.fully_async.engines.embedded.server \\
        --model-path DIR --host 127.0.0.1 --port N [--max-running-requests 256] [--dtype float32] [--seed 0]

Routes, request and response fields are SGLang's (`sglang/srt/entrypoints/http_server.py`,
`sglang/srt/managers/io_struct.py`), so the client, the executor and the tests talk to this server and to SGLang
the same way. The engine is token-in/token-out: `text` prompts are refused (there is no tokenizer) and
responses carry no `text`. Everything that decides *what* to run lives in `scheduler.py`; this module only
translates JSON. `/get_server_info` adds `engine_stats` (forward-pass and token counters) so tests can check that
requests really share forward passes.

`/generate` with `stream: true` answers as SGLang 0.5.6 does without `--stream-output` (http_server.generate_request,
tokenizer_manager._handle_batch_output and _wait_one_response): Server-Sent Events, one `data: {json}` chunk
after each new token (the latest state when the reader falls behind), each holding the request so far (cumulative
`output_ids`, `meta_info` with `finish_reason` null until the last chunk, cumulative `output_token_logprobs`), a
batch's chunks interleaved with their prompt's `index`, an invalid request as a `data: {"error": {...}}` chunk,
then `data: [DONE]`. An abort ends the stream with the abort's chunk.

The `/test_only/*` routes (`decode_hold.py`) are NOT SGLang's: a control for tests, refused unless the engine is
started with `--enable-test-only-routes`.

The distributed weight-update routes (`/init_weights_update_group` & co) are in `weight_group_routes.py`.
LoRA (SGLang's flags `--enable-lora`, `--lora-paths`, `--max-lora-rank`, `--lora-target-modules`,
`--max-loras-per-batch`, `--max-loaded-loras`; `/generate`'s `lora_path`): the flags and the routes
`/load_lora_adapter`, `/unload_lora_adapter`, `/v1/models` and the extension `/load_lora_adapter_from_distributed`
are in `lora_api.py`, the serving protocol in `lora_serving.py`. SGLang's `--lora-backend` and
`--lora-eviction-policy` choose GPU kernels and which GPU buffer slot an adapter overwrites; the embedded engine has
neither and does not take them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import uuid
from typing import Any, NamedTuple

import torch
from aiohttp import web
from transformers.utils import logging as hf_logging

from rllm.experimental.fully_async.engines.embedded.decode_hold import ENABLE_FLAG, add_test_only_routes
from rllm.experimental.fully_async.engines.embedded.lora import LoRALimits
from rllm.experimental.fully_async.engines.embedded.lora_api import (
    add_lora_flags,
    add_lora_routes,
    check_lora_flags,
    load_initial_adapters,
    lora_limits,
    request_lora_paths,
)
from rllm.experimental.fully_async.engines.embedded.lora_serving import LoRAServing
from rllm.experimental.fully_async.engines.embedded.model_runner import DTYPES, ModelRunner, load_model
from rllm.experimental.fully_async.engines.embedded.sampling import SamplingParams
from rllm.experimental.fully_async.engines.embedded.scheduler import (
    GenerateOutput,
    Scheduler,
    WeightUpdateError,
    interleave_streams,
)
from rllm.experimental.fully_async.engines.embedded.weight_group_routes import add_weight_group_routes
from rllm.experimental.fully_async.engines.embedded.weights import WeightLoader

logger = logging.getLogger(__name__)

SCHEDULER_KEY = web.AppKey("scheduler", Scheduler)
API_KEY = web.AppKey("api_key", str)
ARGS_KEY = web.AppKey("args", argparse.Namespace)


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)  # SGLang's error body shape


async def _json_body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError as exc:
        raise ValueError(f"request body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    return body


def _meta_info(out: GenerateOutput, return_logprob: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": out.rid,
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.output_ids),
        "cached_tokens": 0,
        "weight_version": out.weight_version,
    }
    if out.e2e_latency is not None:  # SGLang sets it when the request finishes
        meta["e2e_latency"] = out.e2e_latency
    if return_logprob:
        # SGLang: [logprob, token_id, token_text]; text is None without a tokenizer.
        meta["output_token_logprobs"] = [
            [lp, tok, None] for lp, tok in zip(out.output_logprobs, out.output_ids, strict=True)
        ]
    return meta


def _per_item(value: Any, n: int, name: str, is_single_value: Any) -> list[Any]:
    """Broadcast a single value (or check a per-item list) over a batch of n prompts."""
    if is_single_value(value):
        return [value] * n
    if not isinstance(value, list) or len(value) != n:
        raise ValueError(f"{name} must be one value or a list with one entry per prompt ({n})")
    return value


class _GenerateCall(NamedTuple):
    """A parsed /generate body: one entry per prompt (`single`: the body held one prompt, not a batch)."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    rids: list[str]
    logprob_flags: list[bool]
    lora_paths: list[str | None]
    single: bool
    stream: bool


def _parse_generate(body: dict[str, Any], lora: LoRAServing | None) -> _GenerateCall:
    if body.get("text") is not None or "input_ids" not in body:
        raise ValueError("the embedded engine is token-in/token-out: send input_ids (no text, no tokenizer)")
    if not isinstance(body.get("stream", False), bool):
        raise ValueError(f"stream must be true or false, got {body['stream']!r}")
    input_ids = body["input_ids"]
    single = isinstance(input_ids, list) and (not input_ids or not isinstance(input_ids[0], list))
    prompts = [input_ids] if single else input_ids
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("input_ids must be a non-empty list of ints or a list of such lists")
    n = len(prompts)
    params = _per_item(body.get("sampling_params"), n, "sampling_params", lambda v: v is None or isinstance(v, dict))
    rids = _per_item(body.get("rid"), n, "rid", lambda v: v is None or isinstance(v, str))
    return _GenerateCall(
        prompts=[list(p) for p in prompts],
        params=[SamplingParams.from_json(p) for p in params],
        rids=[r if r is not None else uuid.uuid4().hex for r in rids],
        logprob_flags=_per_item(body.get("return_logprob", False), n, "return_logprob", lambda v: isinstance(v, bool)),
        lora_paths=request_lora_paths(body, n, lora),
        single=single,
        stream=bool(body.get("stream", False)),
    )


async def generate(request: web.Request) -> web.StreamResponse:
    """POST /generate: one prompt (input_ids: list[int]) or a batch (list[list[int]]); streamed with stream=true."""
    scheduler = request.app[SCHEDULER_KEY]
    try:
        call = _parse_generate(await _json_body(request), scheduler.lora)
    except (ValueError, TypeError) as exc:
        return _error(str(exc))
    if call.stream:
        return await _stream_generate(request, scheduler, call)
    prompts, params, rids, logprob_flags, single = call.prompts, call.params, call.rids, call.logprob_flags, call.single
    tasks = [
        asyncio.ensure_future(scheduler.generate(p, sp, rid, lora_path=lora))
        for p, sp, rid, lora in zip(prompts, params, rids, call.lora_paths, strict=True)
    ]
    try:
        results = await asyncio.gather(*tasks, return_exceptions=True)
    except asyncio.CancelledError:
        # The client disconnected (handler cancellation): stop its requests so they free their rows.
        for task in tasks:
            task.cancel()
        raise
    for res in results:
        if isinstance(res, asyncio.CancelledError):
            raise res
        if isinstance(res, ValueError):
            return _error(str(res))
        if isinstance(res, BaseException):
            logger.error("generate failed: %r", res)
            return _error(f"generation failed: {res}", status=500)
    payload = [
        {"output_ids": out.output_ids, "meta_info": _meta_info(out, flag)}
        for out, flag in zip(results, logprob_flags, strict=True)
    ]
    return web.json_response(payload[0] if single else payload)


def _sse(payload: Any) -> bytes:
    """One Server-Sent Event as SGLang writes it: `data: ` + compact JSON (orjson's) + a blank line."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _stream_generate(request: web.Request, scheduler: Scheduler, call: _GenerateCall) -> web.StreamResponse:
    """The streamed /generate: headers at once, a chunk per update of any prompt, `data: [DONE]` last."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    streams = [
        scheduler.generate_stream(p, sp, rid, lora)
        for p, sp, rid, lora in zip(call.prompts, call.params, call.rids, call.lora_paths, strict=True)
    ]
    try:
        async for index, out in interleave_streams(streams):
            chunk: dict[str, Any] = {
                "output_ids": out.output_ids,
                "meta_info": _meta_info(out, call.logprob_flags[index]),
            }
            if not call.single:
                chunk["index"] = index  # tokenizer_manager._handle_batch_request's rid_to_index
            await response.write(_sse(chunk))
    except ValueError as exc:  # SGLang: the error becomes a chunk of the stream (the status, 200, is sent)
        await response.write(_sse({"error": {"message": str(exc)}}))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def pause_generation(request: web.Request) -> web.Response:
    """POST /pause_generation {mode: abort | in_place | retract}."""
    try:
        body = await _json_body(request)
        request.app[SCHEDULER_KEY].pause(body.get("mode", "abort"))
    except ValueError as exc:
        return _error(str(exc))
    return web.json_response({"message": "Generation paused successfully."})


async def continue_generation(request: web.Request) -> web.Response:
    request.app[SCHEDULER_KEY].resume()
    return web.json_response({"message": "Generation continued successfully."})


async def abort_request(request: web.Request) -> web.Response:
    """POST /abort_request {rid} or {abort_all: true}."""
    try:
        body = await _json_body(request)
    except ValueError as exc:
        return _error(str(exc))
    scheduler = request.app[SCHEDULER_KEY]
    if body.get("abort_all"):
        count = scheduler.abort_all("aborted by /abort_request abort_all")
    elif body.get("rid"):
        count = int(scheduler.abort(str(body["rid"])))
    else:
        return _error("abort_request needs rid or abort_all=true")
    return web.json_response({"aborted": count})


async def update_weights_from_disk(request: web.Request) -> web.Response:
    """POST /update_weights_from_disk {model_path, weight_version, flush_cache, abort_all_requests, load_format}."""
    scheduler = request.app[SCHEDULER_KEY]
    args = request.app[ARGS_KEY]
    try:
        body = await _json_body(request)
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            raise ValueError("model_path is required")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise ValueError(f"load_format {body['load_format']!r} is not supported (auto | safetensors)")
        version = body.get("weight_version")
        version = None if version is None else str(version)
    except ValueError as exc:
        return web.json_response({"success": False, "message": str(exc), "num_paused_requests": 0}, status=400)
    try:
        aborted = await scheduler.swaps.update_weights_from_disk(
            model_path,
            version,
            abort_all_requests=bool(body.get("abort_all_requests", False)),
            drain_timeout_s=args.weight_update_timeout_s,
        )
    except WeightUpdateError as exc:
        logger.error("weight update from %s failed: %s", model_path, exc)
        return web.json_response({"success": False, "message": str(exc), "num_paused_requests": 0}, status=400)
    return web.json_response(
        {
            "success": True,
            "message": f"Succeeded to update model weights (weight_version={scheduler.weight_version}).",
            "num_paused_requests": aborted,
        }
    )


async def update_weight_version(request: web.Request) -> web.Response:
    """POST /update_weight_version {new_version, abort_all_requests}."""
    try:
        body = await _json_body(request)
        if body.get("new_version") is None:
            raise ValueError("new_version is required")
    except ValueError as exc:
        return _error(str(exc))
    scheduler = request.app[SCHEDULER_KEY]
    if body.get("abort_all_requests"):
        scheduler.abort_all("aborted by /update_weight_version")
    scheduler.set_weight_version(str(body["new_version"]))
    return web.json_response({"success": True, "new_version": scheduler.weight_version, "message": "ok"})


async def slow_down(request: web.Request) -> web.Response:
    """GET|POST /slow_down {forward_sleep_time}: sleep that many seconds before every step, null or <= 0 to stop.
    SGLang's test hook (SlowDownReqInput; it answers 200 with a null body), for tests that must catch a request
    mid-decode."""
    try:
        body = await _json_body(request)
        if "forward_sleep_time" not in body:
            raise ValueError("forward_sleep_time is required (seconds, or null to stop)")
        seconds = body["forward_sleep_time"]
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, int | float)):
            raise ValueError(f"forward_sleep_time must be a number of seconds or null, got {seconds!r}")
    except ValueError as exc:
        return _error(str(exc))
    request.app[SCHEDULER_KEY].slow_down(seconds)
    return web.json_response(None)


async def get_weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[SCHEDULER_KEY].weight_version})


async def flush_cache(request: web.Request) -> web.Response:
    if request.app[SCHEDULER_KEY].flush_cache():
        return web.Response(text="Cache flushed.\n")
    return web.Response(text="Cache not flushed: requests are running.\n", status=400)


async def health(request: web.Request) -> web.Response:
    if not request.app[SCHEDULER_KEY].alive:
        return web.Response(status=503, text="decode loop is not running")
    return web.Response(status=200)


async def get_model_info(request: web.Request) -> web.Response:
    scheduler = request.app[SCHEDULER_KEY]
    info = scheduler.runner.info
    return web.json_response(
        {
            "model_path": info.model_path,
            "tokenizer_path": None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": scheduler.weight_version,
            "model_type": info.model_type,
            "vocab_size": info.vocab_size,
            "eos_token_ids": sorted(info.eos_token_ids),
            "context_length": info.context_length,
            "num_parameters": info.num_parameters,
        }
    )


async def get_server_info(request: web.Request) -> web.Response:
    scheduler = request.app[SCHEDULER_KEY]
    args = request.app[ARGS_KEY]
    stats = scheduler.snapshot()
    scalar = (str, int, float, bool, type(None))
    server_args = {k: v for k, v in vars(args).items() if k != "api_key" and isinstance(v, scalar)}
    return web.json_response(
        {**server_args, "engine": "rllm-embedded", "internal_states": [stats], "engine_stats": stats}
    )


@web.middleware
async def _require_api_key(request: web.Request, handler: Any) -> web.StreamResponse:
    """SGLang's add_api_key_middleware: with --api-key, all but /health* and /metrics need the key."""
    key = request.app[API_KEY]
    exempt = request.method == "OPTIONS" or request.path.startswith(("/health", "/metrics"))
    if key and not exempt and request.headers.get("Authorization") != "Bearer " + key:
        return web.json_response({"error": "Unauthorized"}, status=401)
    return await handler(request)


def build_app(scheduler: Scheduler, args: argparse.Namespace) -> web.Application:
    """The aiohttp application for one engine (routes as SGLang names them). Without --enable-lora (no
    `scheduler.lora`) the LoRA routes answer as SGLang's do then: "LoRA is not enabled"."""
    app = web.Application(client_max_size=1 << 30, middlewares=[_require_api_key])
    app[API_KEY] = getattr(args, "api_key", None) or ""
    app[SCHEDULER_KEY] = scheduler
    app[ARGS_KEY] = args
    for path, handler in [
        ("/generate", generate),
        ("/pause_generation", pause_generation),
        ("/continue_generation", continue_generation),
        ("/abort_request", abort_request),
        ("/update_weights_from_disk", update_weights_from_disk),
        ("/update_weight_version", update_weight_version),
        ("/flush_cache", flush_cache),
        ("/slow_down", slow_down),
    ]:
        app.router.add_post(path, handler)
    for path, handler in [
        ("/health", health),
        ("/get_weight_version", get_weight_version),
        ("/get_model_info", get_model_info),
        ("/get_server_info", get_server_info),
        ("/flush_cache", flush_cache),
        ("/slow_down", slow_down),
    ]:
        app.router.add_get(path, handler)
    add_weight_group_routes(app, scheduler, args.weight_update_timeout_s)  # /init_weights_update_group & co
    lora = scheduler.lora or LoRAServing(LoRALimits(0, frozenset()), lambda: scheduler.runner.model, enabled=False)
    add_lora_routes(app, lora, args.model_path, scheduler.runner.info.context_length)  # /load_lora_adapter & co
    # /test_only/*: NOT SGLang's; refused unless the flag is given (decode_hold.py)
    add_test_only_routes(app, scheduler.decode_hold, enabled=getattr(args, "enable_test_only_routes", False))
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Embedded CPU inference engine speaking the SGLang native API.")
    parser.add_argument("--model-path", required=True, help="HF causal-LM folder (config + safetensors)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-running-requests", type=int, default=256, help="rows decoded together at most")
    parser.add_argument("--max-prefill-tokens", type=int, default=16384, help="prompt tokens per prefill pass")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler's generator")
    parser.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="SGLang's flag: every request draws from its sampling_seed (default 42) and runs alone, so its tokens "
        "and log-probs do not depend on what else is sent (one request at a time)",
    )
    parser.add_argument("--weight-version", default="0", help="weight_version reported before any update")
    parser.add_argument(
        "--forward-sleep-time",
        type=float,
        default=0.0,
        help="seconds slept before every forward pass from the start, as after POST /slow_down (0: none)",
    )
    # How long an update waits for running requests (and a weight-update group for its peers) before failing.
    parser.add_argument("--weight-update-timeout-s", type=float, default=600.0)
    parser.add_argument("--num-threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (SGLang's --api-key)")
    parser.add_argument(
        "--parent-check-s", type=float, default=2.0, help="exit when the parent dies; checked this often (0: never)"
    )
    parser.add_argument(
        ENABLE_FLAG,
        action="store_true",
        help="serve the test-only /test_only/* routes (decode_hold.py: hold forward passes while requests decode); "
        "not SGLang's API, for the project's tests only",
    )
    add_lora_flags(parser)
    args = parser.parse_args(argv)
    try:
        check_lora_flags(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


async def serve(args: argparse.Namespace) -> None:
    """Load the model, serve until SIGTERM/SIGINT, then shut down cleanly."""
    model, info = await asyncio.to_thread(load_model, args.model_path, args.dtype)
    lora = None
    if args.enable_lora:
        limits = await asyncio.to_thread(lora_limits, args)
        lora = LoRAServing(limits, lambda: runner.model)
    runner = ModelRunner(model, info, seed=args.seed, lora_layers=lora.layers if lora else None)
    scheduler = Scheduler(
        runner,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        weight_version=str(args.weight_version),
        weight_loader=WeightLoader(args.dtype),
        deterministic=args.enable_deterministic_inference,
        lora=lora,
    )
    if lora is not None:
        await load_initial_adapters(lora, args.lora_refs)
    if args.forward_sleep_time > 0:  # engines.forward_sleep_s: a slow engine from the first request on
        scheduler.slow_down(args.forward_sleep_time)
    scheduler.start()
    # handler_cancellation: a client that disconnects (timeout, crash) cancels its handler, which frees its rows.
    app_runner = web.AppRunner(build_app(scheduler, args), handler_cancellation=True, access_log=None)
    await app_runner.setup()
    site = web.TCPSite(app_runner, args.host, args.port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watchdog = asyncio.create_task(_stop_when_orphaned(stop, args.parent_check_s))
    logger.info(
        "embedded engine ready on http://%s:%d (model %s, %s, %d params, eos %s)",
        args.host,
        args.port,
        info.model_path,
        args.dtype,
        info.num_parameters,
        sorted(info.eos_token_ids),
    )
    try:
        await stop.wait()
    finally:
        logger.info("shutting down")
        watchdog.cancel()
        await scheduler.stop()
        with contextlib.suppress(Exception):
            await app_runner.cleanup()


async def _stop_when_orphaned(stop: asyncio.Event, period_s: float) -> None:
    """Shut down if the process that started this engine dies (e.g. a SIGKILLed driver).

    Engines run in their own session so a Ctrl-C aimed at the driver does not kill them mid-sync; the price is
    that nothing else would stop them when the driver is killed outright. Re-parenting is the signal.
    """
    if period_s <= 0:
        return
    parent = os.getppid()
    while not stop.is_set():
        await asyncio.sleep(period_s)
        if os.getppid() != parent:
            logger.warning("parent process %d is gone: shutting down", parent)
            stop.set()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s engine:{args.port} %(name)s: %(message)s",
        force=True,  # as SGLang's configure_logger: a library's import-time basicConfig must not win
    )
    # One progress bar per weight update would flood the engine log.
    hf_logging.disable_progress_bar()
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    asyncio.run(serve(args))
    # Everything is shut down and flushed here; skipping the interpreter's own teardown (torch and transformers
    # take over a second to unload) makes stopping an engine near-instant for the launcher and the tests.
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
