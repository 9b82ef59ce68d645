"""`engines`: add, remove, register and list the inference engines of a RUNNING run
(docs/design.md#rule-engine-set-can-change).

    python -m rllm.experimental.fully_async engines add N --run-dir D          # N more engines of the run's kind
    python -m rllm.experimental.fully_async engines add N --node NODE --run-dir D   # on that Ray cluster node
    python -m rllm.experimental.fully_async engines remove ID --run-dir D      # its samples move to the others
    python -m rllm.experimental.fully_async engines register URL [--api-key K] --run-dir D   # your own SGLang server
    python -m rllm.experimental.fully_async engines list --run-dir D

Each command reads RUN_DIR/control.json (the run's loopback control endpoint and its token; readable by the run's
owner only), sends one request, and prints the run's one-line answer. The run applies it between steps, or while
it waits for one (runtime/run/elastic.py). Exit codes: 0 applied, 2 refused (the line says why; the run is
unchanged), 1 no run answered.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx

from rllm.experimental.fully_async.core.elastic import CONTROL_FILE
from rllm.experimental.fully_async.errors import EXIT_BAD_INPUT, FullyAsyncError

PROG = "python -m rllm.experimental.fully_async engines"
REQUEST_TIMEOUT_S = 960.0  # the run's own bound on applying a request is 900 s (runtime/run/elastic.py)


class NoRunError(FullyAsyncError, RuntimeError):
    """No running run answers at the run dir given."""


class RefusedError(FullyAsyncError, ValueError):
    """The run refused the request; the run is unchanged."""

    exit_code = EXIT_BAD_INPUT


def control_of(run_dir: Path) -> dict[str, Any]:
    """The control endpoint of the run at `run_dir` ({url, token}); NoRunError in one line when there is none."""
    if not run_dir.is_dir():
        raise NoRunError(f"no run at {run_dir}: the directory does not exist")
    path = run_dir / CONTROL_FILE
    try:
        control = json.loads(path.read_text())
    except FileNotFoundError:
        raise NoRunError(
            f"no running run at {run_dir}: no {CONTROL_FILE} (the run has not started, or ended)"
        ) from None
    except (OSError, ValueError) as exc:
        raise NoRunError(f"cannot read {path}: {exc} (only the run's owner can read it)") from exc
    if not isinstance(control, dict) or not {"url", "token"} <= set(control):
        raise NoRunError(f"{path} is not a control file written by a run (no url and token)")
    return control


def send(run_dir: Path, body: dict[str, Any], *, token: str | None = None) -> dict[str, Any]:
    """Send one request to the run at `run_dir` and return its answer ({ok, message, engines}); `token` overrides
    the control file's (tests of a wrong token)."""
    control = control_of(run_dir)
    headers = {"Authorization": f"Bearer {control['token'] if token is None else token}"} if token != "" else {}
    try:
        answer = httpx.post(f"{control['url']}/engines", json=body, headers=headers, timeout=REQUEST_TIMEOUT_S)
    except httpx.TransportError as exc:
        raise NoRunError(
            f"no run answers at {run_dir}: {control['url']} ({type(exc).__name__}; the run ended or was killed)"
        ) from exc
    if answer.status_code == 401:
        raise RefusedError(f"the run at {run_dir} refused the request: wrong or missing control token")
    try:
        result = answer.json()
    except ValueError as exc:
        raise NoRunError(f"{control['url']} answered HTTP {answer.status_code} without JSON: not this run's") from exc
    if not result.get("ok"):
        raise RefusedError(str(result.get("message", f"HTTP {answer.status_code}")))
    return result


def format_engines(engines: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'id':<4} {'state':<9} {'source':<11} url"]
    lines += [f"{e['id']:<4} {e['state']:<9} {e['source']:<11} {e['url']}" for e in engines]
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="op", required=True)
    add = sub.add_parser("add", help="start N more engines of the run's own kind; each joins once synced")
    add.add_argument("count", type=int, metavar="N")
    add.add_argument(
        "--node",
        default=None,
        help="a cluster run (trainer.nnodes > 1): the Ray node (id, address or id prefix) to start them on; default: "
        "the node with the most free GPUs. `plan --add-engines N` shows where they would go",
    )
    remove = sub.add_parser("remove", help="take engine ID out of the run; its in-flight samples move to others")
    remove.add_argument("engine", metavar="ID")
    register = sub.add_parser("register", help="add an SGLang server launched elsewhere, by URL")
    register.add_argument("url", metavar="URL")
    register.add_argument("--api-key", default=None, help="the server's --api-key, if it was started with one")
    sub.add_parser("list", help="the run's engines")
    for each in (add, remove, register, sub.choices["list"]):
        each.add_argument("--run-dir", required=True, type=Path, help="the running run's run.dir")
    args = parser.parse_args(argv)
    body: dict[str, Any] = {"op": args.op}
    if args.op == "add":
        body["count"] = args.count
        if args.node is not None:
            body["node"] = args.node
    elif args.op == "remove":
        body["engine"] = args.engine
    elif args.op == "register":
        body |= {"url": args.url, "api_key": args.api_key}
    result = send(args.run_dir, body)
    print(result["message"])
    if args.op == "list":
        print("\n".join(format_engines(result.get("engines", []))))
    sys.stdout.flush()
    return 0
