"""The engines control endpoint of a running run, and who may serve which engine: the HTTP and file side of
elastic rollout capacity (docs/design.md#rule-engine-set-can-change; `runtime/run/elastic.py` applies what arrives).

- `ControlServer`: aiohttp on 127.0.0.1, an ephemeral port, in a daemon thread of the driver's process. Each request
  must carry `Authorization: Bearer <token>`, the per-run token created at start and written with the URL into
  RUN_DIR/control.json (mode 0600: its owner alone can read it; removed when the run ends). A request is queued
  and waits for its answer: the driver applies queued requests where it watches the engines (between steps and
  while it waits for one), so the actor calls they make stay ordered with everything else the driver does.
- Claims: a run claims each engine it serves in a per-user folder of this host (ENGINE_CLAIMS_DIR), so a second run
  registering an engine of the first is refused while the first runs. Runs on other hosts cannot see these claims.
- Probes: what a server someone launched elsewhere answers before it may register (`probe_server`, judged by
  core/elastic.py's `refusal_to_register`), and whether a registered one still answers `/health`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import os
import queue
import secrets
import tempfile
import threading
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

from rllm.experimental.fully_async.core.elastic import CONTROL_FILE, ServerAnswers, authorized, normalize_url

logger = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 900.0  # a request's wait for the driver (a join loads weights; a leave drains)
PROBE_TIMEOUT_S = 5.0  # each call to a server being registered
ENGINE_CLAIMS_DIR = Path(tempfile.gettempdir()) / f"rllm-fully-async-engines-{os.getuid()}"


# ---------------------------------------------------------------------------------------------------- control server


class ControlServer:
    """See the module docstring. `start(run_dir)` serves and writes the control file; `close()` stops both and
    answers every request still queued with an error."""

    def __init__(self) -> None:
        self.token = secrets.token_urlsafe(32)
        self.requests: queue.Queue[tuple[dict[str, Any], concurrent.futures.Future[dict[str, Any]]]] = queue.Queue()
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engines-control", daemon=True)
        self._runner: web.AppRunner | None = None
        self._file: Path | None = None
        self._closed = False

    def start(self, run_dir: Path) -> None:
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=30)
        self.url = f"http://127.0.0.1:{port}"
        self._file = Path(run_dir) / CONTROL_FILE
        write_private(self._file, {"url": self.url, "token": self.token, "pid": os.getpid()})
        logger.info("engines control endpoint on %s (token in %s)", self.url, self._file)

    async def _serve(self) -> int:
        app = web.Application()
        app.router.add_post("/engines", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        return int(self._runner.addresses[0][1])

    async def _handle(self, request: web.Request) -> web.Response:
        if not authorized(request.headers.get("Authorization"), self.token):
            return web.json_response({"ok": False, "message": "wrong or missing control token"}, status=401)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"ok": False, "message": "the request body is not JSON"}, status=400)
        if self._closed:
            return web.json_response({"ok": False, "message": "the run is stopping"}, status=503)
        answer: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self.requests.put((body, answer))
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(answer), ANSWER_TIMEOUT_S)
        except TimeoutError:
            result = {"ok": False, "message": f"the run did not apply the request within {ANSWER_TIMEOUT_S:g}s"}
        return web.json_response(result, status=200 if result.get("ok") else 400)

    def pending(self) -> list[tuple[dict[str, Any], concurrent.futures.Future[dict[str, Any]]]]:
        """The requests queued since the last call, in arrival order."""
        items = []
        while True:
            try:
                items.append(self.requests.get_nowait())
            except queue.Empty:
                return items

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._file is not None:
            self._file.unlink(missing_ok=True)
        for _, answer in self.pending():
            answer.set_result({"ok": False, "message": "the run is stopping"})
        if self._thread.is_alive():
            if self._runner is not None:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._loop.close()


def write_private(path: Path, content: dict[str, Any]) -> None:
    """Write `content` as JSON readable by its owner only (mode 0600 from its creation: no moment of wider mode)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(content, out)


# ---------------------------------------------------------------------------------------------------- claims


def _claim_file(url: str) -> Path:
    return ENGINE_CLAIMS_DIR / (hashlib.sha256(normalize_url(url).encode()).hexdigest()[:24] + ".json")


def claimed_by(url: str, run_dir: Path) -> str | None:
    """The run dir of another live run on this host that claims `url`, else None (a dead owner's claim lapses)."""
    try:
        claim = json.loads(_claim_file(url).read_text())
    except (OSError, ValueError):
        return None
    owner, pid = str(claim.get("run_dir", "")), int(claim.get("pid", 0))
    if owner == str(Path(run_dir).resolve()) or not _alive(pid):
        return None
    return owner


def claim(url: str, run_dir: Path) -> None:
    ENGINE_CLAIMS_DIR.mkdir(mode=0o700, exist_ok=True)
    content = {"url": normalize_url(url), "run_dir": str(Path(run_dir).resolve()), "pid": os.getpid()}
    write_private(_claim_file(url), content)


def unclaim(url: str, run_dir: Path) -> None:
    if claimed_by(url, run_dir) is None:  # ours, or lapsed: never another live run's
        _claim_file(url).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def health_error(url: str, api_key: str | None, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why `url`/health does not answer 200, or None when it does."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        answer = httpx.get(f"{url}/health", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return f"/health: {type(exc).__name__}"
    return None if answer.status_code == 200 else f"/health answered HTTP {answer.status_code}"


def probe_server(url: str, api_key: str | None, timeout_s: float = PROBE_TIMEOUT_S) -> ServerAnswers:
    """Ask a server to register what `refusal_to_register` judges: /health, /get_model_info, /get_weight_version."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=httpx.Timeout(timeout_s), headers=headers) as http:
        try:
            health = http.get(f"{url}/health")
        except httpx.HTTPError as exc:
            return ServerAnswers(health_error=f"{type(exc).__name__}: {exc}")
        if health.status_code != 200:
            return ServerAnswers(health_error=f"/health answered HTTP {health.status_code}")
        try:
            info = http.get(f"{url}/get_model_info")
            body = info.json() if info.status_code == 200 else None
            version = http.get(f"{url}/get_weight_version")
        except (httpx.HTTPError, ValueError) as exc:
            return ServerAnswers(health_error=f"/get_model_info: {type(exc).__name__}: {exc}")
        reported = version.json().get("weight_version") if version.status_code == 200 else None
        return ServerAnswers(None, info.status_code, body if isinstance(body, dict) else None, reported)
