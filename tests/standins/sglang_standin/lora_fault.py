"""A TEST-ONLY fault of the stand-in's `/load_lora_adapter`: NOT SGLang's (0.5.6 has no such flags), never used by the
project, there so that a test can make one engine's adapter load fail, or die mid-way, inside a real run (the CLI
passes them through `engines.extra_args`, which a run hands to `sglang.launch_server` verbatim).

    --test-only-fail-lora-load NAME      the load of adapter NAME fails
    --test-only-fail-lora-how error      ... answered as SGLang answers a failed load: 400, LoRAUpdateOutput with
                                         success false and "Failed to load LoRA adapter NAME: <reason>"
    --test-only-fail-lora-how exit       ... by the process ending (exit code 137) as the load arrives: a load killed
                                         mid-way, the connection cut with no answer
    --test-only-fail-lora-once PATH      only the first engine process to get there fails, of all started with these
                                         flags (a run's engines share them, restarts included): it creates PATH, and a
                                         process that finds PATH there loads normally

The fault acts before the load reads anything, so a failed load leaves nothing registered, as SGLang's does.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from aiohttp import web

logger = logging.getLogger("sglang_standin")

FAULT_EXIT_CODE = 137  # what a SIGKILLed process reports


def add_fault_flags(parser: argparse.ArgumentParser) -> None:
    """The test-only flags (module docstring)."""
    parser.add_argument("--test-only-fail-lora-load", default=None, metavar="NAME")
    parser.add_argument("--test-only-fail-lora-how", default="error", choices=["error", "exit"])
    parser.add_argument("--test-only-fail-lora-once", default=None, metavar="PATH")


def _claimed(path: str | None) -> bool:
    """Whether this process is the one to fail: always without `--test-only-fail-lora-once`, else if it creates it."""
    if path is None:
        return True
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def injected_failure(args: Any, name: str) -> web.Response | None:
    """The fault for a load of adapter `name`, if one is armed for it and this process claims it; else None."""
    if getattr(args, "test_only_fail_lora_load", None) != name or not _claimed(args.test_only_fail_lora_once):
        return None
    if args.test_only_fail_lora_how == "exit":
        logger.warning("test-only fault: exiting as the load of LoRA adapter %s arrives", name)
        logging.shutdown()
        os._exit(FAULT_EXIT_CODE)
    logger.warning("test-only fault: failing the load of LoRA adapter %s", name)
    message = f"Failed to load LoRA adapter {name}: test-only fault (--test-only-fail-lora-load)"
    body = {"success": False, "error_message": message, "loaded_adapters": None, "rid": None, "http_worker_ipc": None}
    return web.json_response(body, status=400)
