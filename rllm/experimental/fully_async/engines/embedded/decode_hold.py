"""A TEST-ONLY control of the embedded engine: hold its forward passes once chosen requests are decoding.

Not part of SGLang's API, never called by the project, and refused unless the engine was started with
`--enable-test-only-routes`. A test that must act while a request decodes (abort it, pause, sync weights, take a
checkpoint, kill the engine) used to slow the engine down and poll its counters until a request ran; a loaded
machine missed that window (the request had not decoded a token yet, or had finished, when the test acted). Here
the engine itself stops, between two forward passes, at the first step boundary where the hold's condition is met:

    at least `running` requests whose rid starts with `rid_prefix` are running with >= `min_tokens` output tokens
    each, and at least `waiting` such requests wait in the queue.

From then until the release no prefill or decode pass runs, and nothing is admitted; everything else goes on (HTTP,
aborts, pauses, a weight swap once no row runs), so whatever the test does meets those requests exactly as the hold
found them, however slow the machine. Until `running + waiting` such requests have arrived, the armed hold admits
nothing: requests sent one by one are admitted together once the last is there, so none can finish before the
others start, whatever the delays between them. Arm the hold before sending the requests it waits for:

    POST /test_only/hold_decoding  {running: 1, min_tokens: 1, waiting: 0, rid_prefix: ""}   arm; answers at once
    POST /test_only/wait_for_hold  {timeout_s: 60}   answers once held: {"running": [{rid, output_tokens}],
                                                     "waiting": [rid]}, or 504 naming what it waited for
    POST /test_only/release_hold   forward passes go on; the hold is disarmed

The scheduler asks `DecodeHold.holds` at each step boundary; this module knows nothing else of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

from aiohttp import web

from rllm.experimental.fully_async.engines.embedded.requests import _Request

logger = logging.getLogger(__name__)

ENABLE_FLAG = "--enable-test-only-routes"


@dataclasses.dataclass(frozen=True)
class HoldCondition:
    """When the hold takes effect (see the module docstring)."""

    running: int = 1
    min_tokens: int = 1
    waiting: int = 0
    rid_prefix: str = ""

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> HoldCondition:
        unknown = sorted(set(body) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown hold_decoding key(s) {unknown}: use running, min_tokens, waiting, rid_prefix")
        cond = cls(**body)
        counts = (cond.running, cond.min_tokens, cond.waiting)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
            raise ValueError(f"running, min_tokens and waiting must be ints >= 0, got {counts}")
        if cond.running == 0 and cond.waiting == 0:
            raise ValueError("a hold needs running >= 1 or waiting >= 1 (else it holds an idle engine at once)")
        if not isinstance(cond.rid_prefix, str):
            raise ValueError(f"rid_prefix must be a string, got {cond.rid_prefix!r}")
        return cond


class DecodeHold:
    """The hold's state: armed with a condition, then held (with what it found) until released."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake  # the scheduler's: it looks at its state again
        self.condition: HoldCondition | None = None
        self.found: dict[str, Any] = {}
        self.reached = asyncio.Event()

    def arm(self, condition: HoldCondition) -> None:
        self.condition, self.found = condition, {}
        self.reached.clear()
        logger.info("test-only decode hold armed: %s", condition)
        self._wake()  # an idle loop checks the condition now

    def release(self) -> None:
        self.condition, self.found = None, {}
        self.reached.clear()
        self._wake()

    def gates(self, running: Iterable[_Request], waiting: Iterable[_Request]) -> bool:
        """True while nothing may be admitted: the hold is armed, not yet reached, and fewer than `running +
        waiting` of its requests are queued or running."""
        cond = self.condition
        if cond is None or self.reached.is_set():
            return False
        present = [r for r in (*running, *waiting) if not r.done and r.rid.startswith(cond.rid_prefix)]
        return len(present) < cond.running + cond.waiting

    def holds(self, running: Iterable[_Request], waiting: Iterable[_Request]) -> bool:
        """True while forward passes must not run; called by the scheduler between passes."""
        if self.reached.is_set():
            return True
        cond = self.condition
        if cond is None:
            return False
        mine = [r for r in running if not r.done and r.rid.startswith(cond.rid_prefix)]
        queued = [r.rid for r in waiting if not r.done and r.rid.startswith(cond.rid_prefix)]
        decoding = [r for r in mine if len(r.output_ids) >= cond.min_tokens]
        if len(decoding) < cond.running or len(queued) < cond.waiting:
            return False
        self.found = {
            "running": [{"rid": r.rid, "output_tokens": len(r.output_ids)} for r in mine],
            "waiting": queued,
        }
        self.reached.set()
        logger.info("test-only decode hold reached: %s", self.found)
        return True


HOLD_KEY = web.AppKey("decode_hold", DecodeHold)
ENABLED_KEY = web.AppKey("test_only_routes_enabled", bool)


def _refused(request: web.Request) -> web.Response | None:
    if request.app[ENABLED_KEY]:
        return None
    message = f"{request.path} is a test-only route: start the engine with {ENABLE_FLAG} to use it"
    return web.json_response({"error": {"message": message}}, status=403)


async def _json(request: web.Request) -> dict[str, Any]:
    body = await request.json() if request.can_read_body else {}
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    return body


async def hold_decoding(request: web.Request) -> web.Response:
    if (refusal := _refused(request)) is not None:
        return refusal
    try:
        condition = HoldCondition.from_json(await _json(request))
    except (ValueError, TypeError) as exc:
        return web.json_response({"error": {"message": str(exc)}}, status=400)
    request.app[HOLD_KEY].arm(condition)
    return web.json_response({"armed": dataclasses.asdict(condition)})


async def wait_for_hold(request: web.Request) -> web.Response:
    if (refusal := _refused(request)) is not None:
        return refusal
    hold = request.app[HOLD_KEY]
    try:
        timeout_s = float((await _json(request)).get("timeout_s", 60.0))
    except (ValueError, TypeError) as exc:
        return web.json_response({"error": {"message": str(exc)}}, status=400)
    if hold.condition is None:
        return web.json_response({"error": {"message": "no hold is armed: POST /test_only/hold_decoding"}}, 400)
    try:
        await asyncio.wait_for(hold.reached.wait(), timeout_s)
    except TimeoutError:
        message = f"the decode hold {hold.condition} was not reached within {timeout_s:g}s"
        return web.json_response({"error": {"message": message}}, status=504)
    return web.json_response(hold.found)


async def release_hold(request: web.Request) -> web.Response:
    if (refusal := _refused(request)) is not None:
        return refusal
    request.app[HOLD_KEY].release()
    return web.json_response({"released": True})


def add_test_only_routes(app: web.Application, hold: DecodeHold, *, enabled: bool) -> None:
    """Register /test_only/* (answering 403 with the flag to set unless `enabled`)."""
    app[HOLD_KEY] = hold
    app[ENABLED_KEY] = enabled
    app.router.add_post("/test_only/hold_decoding", hold_decoding)
    app.router.add_post("/test_only/wait_for_hold", wait_for_hold)
    app.router.add_post("/test_only/release_hold", release_hold)
