"""SGLang 0.5.6's LoRA API on the embedded engine: its server flags, its routes, and one extension for the
distributed transport. (The SGLang stand-in reuses the flag checks and the protocol; its routes are its own.)

Flags (`server_args.py`, `check_lora_server_args`): `--enable-lora`, `--lora-paths` (PATH | NAME=PATH | JSON;
they enable LoRA and load at start, a failure stops the start), `--max-lora-rank` and `--lora-target-modules`
(both required without `--lora-paths`, else inferred from those adapters; `all` expands to every supported module),
`--max-loras-per-batch` (default 8, > 0), `--max-loaded-loras` (default none; >= `--max-loras-per-batch` and >= the
number of `--lora-paths`).

    POST /load_lora_adapter    {lora_name, lora_path, pinned=false}   (SGLang's LoadLoRAAdapterReqInput)
    POST /unload_lora_adapter  {lora_name}                            (SGLang's UnloadLoRAAdapterReqInput)
    GET  /v1/models            the base model's card, then one per registered adapter (id = name, root = path,
                               parent = the base model's name), as SGLang's OpenAI-compatible route lists them
    POST /load_lora_adapter_from_distributed   (NOT SGLang's: this engine's extension, see below)

Load and unload answer SGLang's LoRAUpdateOutput, `{success, error_message, loaded_adapters: {name: path}}`, with
HTTP 200, or 400 when `success` is false; neither pauses generation (the protocol: `lora_serving.py`). An unload
answers once the adapter's requests have finished. Both run to completion even if the caller disconnects, as
SGLang's do (FastAPI does not cancel them): a half-done unload would leave a name unregistered but loaded.

The extension. SGLang 0.5.6 loads an adapter only from a path (`LoRAConfig(path)` reads `adapter_config.json`, the
weights come from the folder's files); it has no route that takes an adapter's tensors, and
`/update_weights_from_distributed` writes base-model parameters by name, which LoRA tensors are not. So on SGLang
adapters travel by disk (a peft folder on a filesystem the engines share). The embedded engine also takes them over
its weight-update group: `/load_lora_adapter_from_distributed` carries `lora_name`, `pinned`, `config` (the
adapter_config.json object) and the fields of SGLang's `/update_weights_from_distributed` (`names`, `dtypes`,
`shapes`, `group_name`, `load_format`), receives the tensors from rank 0 of the group exactly as that route does
(one broadcast per tensor, or one flattened bucket), and registers them as a peft folder's (`names` are peft's
tensor names). The trainer must make the call concurrently with its broadcast, as for the SGLang route.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from aiohttp import web

from rllm.experimental.fully_async.engines.embedded.lora import (
    LORA_TARGET_ALL,
    SUPPORTED_LORA_TARGET_MODULES,
    LoRALimits,
    config_rank_and_targets,
    read_adapter_folder,
    server_target_modules,
)
from rllm.experimental.fully_async.engines.embedded.lora_serving import LoRAServing, LoRAUpdateOutput
from rllm.experimental.fully_async.engines.embedded.weight_group_routes import STATE_KEY as GROUP_STATE_KEY
from rllm.experimental.fully_async.engines.weight_group import DEFAULT_GROUP_NAME

SERVING_KEY = web.AppKey("lora_serving", LoRAServing)
SERVED_NAME_KEY = web.AppKey("served_model_name", str)
CONTEXT_KEY = web.AppKey("context_length", int)


def add_lora_flags(parser: argparse.ArgumentParser) -> None:
    """SGLang 0.5.6's LoRA flags that apply to a CPU engine (names, types, defaults and help as `server_args.py`)."""
    parser.add_argument("--enable-lora", default=None, action="store_true", help="Enable LoRA support for the model.")
    parser.add_argument("--max-lora-rank", type=int, default=None, help="The maximum rank of LoRA adapters.")
    parser.add_argument(
        "--lora-target-modules",
        choices=[*SUPPORTED_LORA_TARGET_MODULES, LORA_TARGET_ALL],
        nargs="*",
        default=None,
        help="The union set of all target modules where LoRA should be applied ('all': every supported one).",
    )
    parser.add_argument(
        "--lora-paths",
        nargs="*",
        default=None,
        help="Adapters to load at start: <PATH> | <NAME>=<PATH> | JSON {lora_name, lora_path, pinned}.",
    )
    parser.add_argument(
        "--max-loras-per-batch",
        type=int,
        default=8,
        help="Maximum number of adapters for a running batch, include base-only request.",
    )
    parser.add_argument(
        "--max-loaded-loras",
        type=int,
        default=None,
        help="If specified, it limits the maximum number of LoRA adapters loaded at a time (>= --max-loras-per-batch).",
    )


def check_lora_flags(args: argparse.Namespace) -> None:
    """SGLang's `check_lora_server_args`: parse `--lora-paths` into (name, path, pinned), enable LoRA when they are
    given, and refuse what SGLang refuses (its asserts, worded as SGLang words them). Raises ValueError."""
    refs = [_lora_ref(item) for item in (args.lora_paths or [])]
    args.lora_refs = refs
    if refs and args.enable_lora is None:
        args.enable_lora = True  # SGLang: "--enable-lora is set to True because --lora-paths is provided."
    if args.max_loras_per_batch <= 0:
        raise ValueError("max_loras_per_batch must be positive")
    if not args.enable_lora:
        return
    args.lora_target_modules = server_target_modules(args.lora_target_modules)
    if not refs and not (args.max_lora_rank and args.lora_target_modules):
        raise ValueError(
            "When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
            "--lora-target-modules for LoRA initialization."
        )
    if args.max_loaded_loras is not None:
        if args.max_loaded_loras < args.max_loras_per_batch:
            raise ValueError(
                "max_loaded_loras should be greater than or equal to max_loras_per_batch. "
                f"max_loaded_loras={args.max_loaded_loras}, max_loras_per_batch={args.max_loras_per_batch}"
            )
        if len(refs) > args.max_loaded_loras:
            raise ValueError(
                "The number of LoRA paths should not exceed max_loaded_loras. "
                f"max_loaded_loras={args.max_loaded_loras}, lora_paths={len(refs)}"
            )


def _lora_ref(item: str) -> tuple[str, str, bool]:
    """One `--lora-paths` entry (SGLang's LoRAPathAction): PATH, NAME=PATH or a JSON object."""
    item = item.strip()
    if item.startswith("{") and item.endswith("}"):
        obj = json.loads(item)
        if "lora_path" not in obj or "lora_name" not in obj:
            raise ValueError(
                f"{item!r} looks like a JSON str, but it does not contain 'lora_name' and 'lora_path' keys."
            )
        return str(obj["lora_name"]), str(obj["lora_path"]), bool(obj.get("pinned", False))
    name, sep, path = item.partition("=")
    return (name, path, False) if sep else (item, item, False)


def lora_limits(args: argparse.Namespace) -> LoRALimits:
    """The limits an engine serves adapters under. Like SGLang's `init_lora_shapes`, a rank or target modules not
    given are inferred from the `--lora-paths` adapters (their largest rank, the union of their modules)."""
    rank, targets = args.max_lora_rank, args.lora_target_modules
    if rank is None or targets is None:
        shapes = [config_rank_and_targets(read_adapter_folder(path)[0]) for _, path, _ in args.lora_refs]
        rank = rank if rank is not None else max((r for r, _ in shapes), default=0)
        targets = targets if targets is not None else frozenset().union(*(t for _, t in shapes))
    return LoRALimits(
        max_lora_rank=int(rank),
        target_modules=frozenset(targets),
        max_loras_per_batch=args.max_loras_per_batch,
        max_loaded_loras=args.max_loaded_loras,
    )


async def load_initial_adapters(lora: LoRAServing, refs: list[tuple[str, str, bool]]) -> None:
    """Load the `--lora-paths` adapters; one that fails stops the start, as in SGLang (`init_lora_adapters`)."""
    for name, path, pinned in refs:
        result = await lora.load_lora_adapter(name, path, pinned)
        if not result.success:
            raise RuntimeError(f"Failed to load LoRA adapter {name}: {result.error_message}")


def request_lora_paths(body: dict[str, Any], n: int, serving: LoRAServing | None) -> list[str | None]:
    """The adapter name of each of a /generate's n prompts (`lora_path`: one name, or a list with one per
    prompt), checked before any prompt runs. Raises ValueError naming the problem.

    Unlike SGLang, which ignores `lora_path` when started without `--enable-lora` (the request silently runs on
    the base model), the embedded engine refuses it: a sample must never be labelled with an adapter it did not
    use."""
    value = body.get("lora_path")
    if value is None or isinstance(value, str):
        names: list[str | None] = [value] * n
    elif isinstance(value, list) and len(value) == n and all(v is None or isinstance(v, str) for v in value):
        names = list(value)
    else:
        raise ValueError(f"lora_path must be one adapter name, null, or a list of {n} (one per prompt)")
    if any(names):
        if serving is None:
            raise ValueError("lora_path names a LoRA adapter, but this engine runs without --enable-lora")
        serving.check_request(names)
    return names


def _answer(result: LoRAUpdateOutput) -> web.Response:
    return web.json_response(result.to_json(), status=200 if result.success else 400)


def _bad(message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=400)


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as exc:
        raise ValueError(f"request body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    return body


def _name(body: dict[str, Any], key: str = "lora_name") -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key} is required (a non-empty string)")
    return value


async def _to_completion(work: Any) -> Any:
    """Run `work` (a coroutine) to its end even if the HTTP caller goes away (module docstring)."""
    return await asyncio.shield(asyncio.ensure_future(work))


async def load_lora_adapter(request: web.Request) -> web.Response:
    try:
        body = await _body(request)
        name, path = _name(body), _name(body, "lora_path")
    except ValueError as exc:
        return _bad(str(exc))
    serving = request.app[SERVING_KEY]
    return _answer(await _to_completion(serving.load_lora_adapter(name, path, bool(body.get("pinned", False)))))


async def unload_lora_adapter(request: web.Request) -> web.Response:
    try:
        name = _name(await _body(request))
    except ValueError as exc:
        return _bad(str(exc))
    return _answer(await _to_completion(request.app[SERVING_KEY].unload_lora_adapter(name)))


async def list_models(request: web.Request) -> web.Response:
    served = request.app[SERVED_NAME_KEY]
    created = int(time.time())
    cards = [_card(served, served, None, request.app[CONTEXT_KEY], created)]
    for ref in request.app[SERVING_KEY].registered():
        cards.append(_card(ref.lora_name, ref.lora_path, served, None, created))
    return web.json_response({"object": "list", "data": cards})


def _card(model_id: str, root: str | None, parent: str | None, max_len: int | None, created: int) -> dict[str, Any]:
    """SGLang's ModelCard (entrypoints/openai/protocol.py)."""
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "sglang",
        "root": root,
        "parent": parent,
        "max_model_len": max_len,
    }


async def load_lora_adapter_from_distributed(request: web.Request) -> web.Response:
    """The extension (module docstring): receive an adapter's tensors over a weight-update group and register it."""
    try:
        body = await _body(request)
        name = _name(body)
        config = body.get("config")
        if not isinstance(config, dict):
            raise ValueError("config is required: the adapter's adapter_config.json as a JSON object")
        names, dtypes, shapes = list(body["names"]), list(body["dtypes"]), [list(s) for s in body["shapes"]]
    except (ValueError, KeyError, TypeError) as exc:
        return _bad(f"bad request: {exc}")
    groups = request.app[GROUP_STATE_KEY].groups
    group_name = str(body.get("group_name", DEFAULT_GROUP_NAME))
    try:
        tensors, buffer = await asyncio.to_thread(
            groups.receive, names, dtypes, shapes, group_name, body.get("load_format")
        )
    except Exception as exc:
        return _answer(LoRAUpdateOutput(False, f"Failed to receive LoRA adapter {name}: {exc}."))
    try:
        serving = request.app[SERVING_KEY]
        pinned = bool(body.get("pinned", False))
        result = await _to_completion(serving.load_lora_adapter_from_tensors(name, config, dict(tensors), pinned))
    finally:
        groups.recycle(buffer)  # the adapter holds copies (lora.build_adapter)
    return _answer(result)


def add_lora_routes(app: web.Application, serving: LoRAServing, served_model_name: str, context_length: int) -> None:
    """Register the LoRA routes on `app` (an engine started with --enable-lora; its weight-group routes first)."""
    app[SERVING_KEY] = serving
    app[SERVED_NAME_KEY] = served_model_name
    app[CONTEXT_KEY] = context_length
    app.router.add_post("/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/unload_lora_adapter", unload_lora_adapter)
    app.router.add_post("/load_lora_adapter_from_distributed", load_lora_adapter_from_distributed)
    app.router.add_get("/v1/models", list_models)
