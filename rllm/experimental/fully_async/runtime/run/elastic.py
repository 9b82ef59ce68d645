"""Engines join and leave a running run: what applies the control endpoint's requests and the supervisor's events
(docs/design.md#rule-engine-set-can-change; the decisions are core/elastic.py's, the endpoint, claims and probes
`runtime/run/engine_control.py`'s).

- `ElasticEngines`: applies the requests `ControlServer` queues and the supervisor's events. Join: ParamSync loads
  the current weights and version into the engine (the trainer's `add_engine`) BEFORE the rollout service routes
  anything to it. Leave: the rollout service drains it (no new request; its in-flight samples are aborted there and
  continue elsewhere from their tokens; calls still on it after DRAIN_TIMEOUT_S are cut off and sent elsewhere from
  the tokens they were sent with), the trainer stops syncing to it, and an engine the run launched is stopped.
  Register: a server someone launched elsewhere, checked first (it answers, serves this run's model, takes its API
  key, belongs to no other run), then joined like a launched one; it is lost once its /health fails
  LOST_AFTER_FAILED_PROBES checks in a row. With no engine left generation waits (`engines.no_engine_timeout_s`).
- `EngineEvents`: RUN_DIR/engine_events.jsonl, one JSON line per join, leave, lost, restart and move
  (core/elastic.py's `event_record`, fields `EVENT_FIELDS`): what `report` and `simulate` read.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from rllm.experimental.fully_async.core.elastic import (
    EVENTS_FILE,
    MOVE_TOTALS,
    ElasticError,
    ElasticRequest,
    Member,
    Membership,
    NoEngineClock,
    SampleMoves,
    event_metrics,
    event_record,
    normalize_url,
    parse_request,
    refusal_to_register,
)
from rllm.experimental.fully_async.engines.supervisor import (
    EngineDiedError,
    EngineEvent,
    EngineLost,
    EngineReplaced,
    EngineStarted,
)
from rllm.experimental.fully_async.runtime.run.engine_control import (
    ControlServer,
    claim,
    claimed_by,
    health_error,
    probe_server,
    unclaim,
)

logger = logging.getLogger(__name__)

REGISTERED_PROBE_S = 5.0  # how often the driver checks /health of the servers registered by URL (no process to watch)
LOST_AFTER_FAILED_PROBES = 3  # failed checks in a row before one is lost: a server restarting briefly is not
DRAIN_TIMEOUT_S = 120.0  # a leaving engine's calls to come back after its abort; then they are cut off and re-sent


# ---------------------------------------------------------------------------------------------------- events


class EngineEvents:
    """RUN_DIR/engine_events.jsonl (appended, flushed per line) and the counts behind the engines/* metrics."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        self.counts: Counter[str] = Counter()

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps(record) + "\n")
        self.counts[record["event"]] += 1
        for total in MOVE_TOTALS:
            self.counts[total] += record[total]


# ---------------------------------------------------------------------------------------------------- the applier


@dataclass
class ElasticContext:
    """What `ElasticEngines` acts through: the driver's processes and its outputs."""

    run_dir: Path
    supervisor: Any  # EngineSupervisor
    trainer: Any  # FullyAsyncTrainerActor handle
    rollouts: Any  # RolloutServiceActor handle
    model_path: str  # the model the run's engines were launched with
    weights_dir: str  # where the run's disk syncs write (param_sync.weights_dir)
    no_engine_timeout_s: float
    sync_timeout_s: float
    step: Callable[[], int]
    message: Callable[[str], None]  # a progress-line message


class ElasticEngines:
    """See the module docstring: `watch()` is what the driver calls while it waits; `metrics()` goes in each step."""

    def __init__(self, ctx: ElasticContext, launched_urls: list[str], clock: Callable[[], float] = time.monotonic):
        self.ctx = ctx
        self.clock = clock
        self.membership = Membership.launched(launched_urls)
        self.events = EngineEvents(ctx.run_dir)
        self.no_engine = NoEngineClock(ctx.no_engine_timeout_s)
        self.control = ControlServer()
        self._version = 0  # the weight version the last joiner serves
        self._failed_probes: Counter[str] = Counter()  # registered engine id -> failed /health checks in a row
        self._next_probe = clock() + REGISTERED_PROBE_S
        for url in launched_urls:
            claim(url, ctx.run_dir)

    def start(self) -> None:
        self.control.start(self.ctx.run_dir)

    def close(self) -> None:
        self.control.close()
        for member in list(self.membership.members.values()):
            unclaim(member.url, self.ctx.run_dir)

    def metrics(self) -> dict[str, float]:
        return event_metrics(dict(self.events.counts), len(self.membership.active))

    # ---- the driver's watch --------------------------------------------------------------------------------

    def watch(self) -> None:
        """The supervisor's events, then the queued control requests, then the no-engine clock (raises
        EngineDiedError naming engines.no_engine_timeout_s once it has passed)."""
        for event in self.ctx.supervisor.poll():
            self.on_supervisor_event(event)
        if self.clock() >= self._next_probe:
            self._next_probe = self.clock() + REGISTERED_PROBE_S
            self.check_registered()
        for body, answer in self.control.pending():
            answer.set_result(self.apply(body))
        active = len(self.membership.active)
        if self.no_engine.update(active + len(self.membership.starting), self.clock()):
            self.ctx.message(
                f"no inference engine left: generation waits up to {self.no_engine.timeout_s:g}s "
                "(engines.no_engine_timeout_s) for one to join (`engines add N` or `engines register URL`)"
            )
        if self.no_engine.expired(self.clock()):
            raise EngineDiedError(self.no_engine.message())

    def apply(self, body: Any) -> dict[str, Any]:
        """One control request; the answer's `message` is its one line. A refused request leaves the run as it was."""
        try:
            request = parse_request(body)
            handler = {"add": self._add, "remove": self._remove, "register": self._register, "list": self._list}
            message = handler[request.op](request)
        except ElasticError as exc:
            logger.warning("engines request refused: %s", exc)
            return {"ok": False, "message": str(exc), "engines": self.membership.listing()}
        return {"ok": True, "message": message, "engines": self.membership.listing()}

    # ---- requests ------------------------------------------------------------------------------------------

    def _list(self, request: ElasticRequest) -> str:
        return f"{len(self.membership.active)} engine(s) active, {len(self.membership.starting)} starting"

    def _add(self, request: ElasticRequest) -> str:
        ids = []
        for _ in range(request.count):
            try:
                proc = self.ctx.supervisor.add_slot(request.node)
            except ValueError as exc:
                raise ElasticError(str(exc)) from exc
            slot = len(self.ctx.supervisor.launcher.processes) - 1
            member = self.membership.add(proc.url, "launched", slot=slot, state="starting")
            claim(member.url, self.ctx.run_dir)
            ids.append(member.id)
        return f"starting {request.count} engine(s): {', '.join(ids)}; each joins once healthy and synced"

    def _remove(self, request: ElasticRequest) -> str:
        member = self.membership.get(request.engine)
        if member.state == "starting":
            self.ctx.supervisor.release(member.slot)
            self._forget(member)
            return f"engine {member.id} was still starting; stopped"
        try:
            self.leave(member)
        except Exception as exc:  # an actor call failed or ran out of time: it stays out of routing, still synced
            raise ElasticError(
                f"engine {member.id} ({member.url}) is draining but has not left: {type(exc).__name__}: {exc}; "
                f"it gets no new request; retry `engines remove {member.id}`"
            ) from exc
        return f"engine {member.id} ({member.url}) left"

    def _register(self, request: ElasticRequest) -> str:
        answers = probe_server(request.url, request.api_key)
        refusal = refusal_to_register(
            request.url,
            answers,
            expected_model=self.ctx.model_path,
            membership=self.membership,
            claimed_by=claimed_by(request.url, self.ctx.run_dir),
            weights_dir=self.ctx.weights_dir,
        )
        if refusal is not None:
            raise ElasticError(refusal)
        member = self.membership.add(request.url, "registered", state="starting", api_key=request.api_key)
        try:
            self.join(member)
        except Exception as exc:
            self.membership.drop(member.id)
            raise ElasticError(f"{member.url} could not load this run's weights: {exc}") from exc
        claim(member.url, self.ctx.run_dir)
        return f"engine {member.id} ({member.url}) registered and serving weight version {self._version}"

    # ---- membership changes --------------------------------------------------------------------------------

    def join(self, member: Member) -> None:
        """Weights first, then traffic: the rollouts must not reach an engine below the trainer's version."""
        key = member.api_key
        began = time.monotonic()
        self._version = ray.get(self.ctx.trainer.add_engine.remote(member.url, key), timeout=self.ctx.sync_timeout_s)
        loaded_s = time.monotonic() - began  # the joiner's weight load, as the progress line reports it
        ray.get(self.ctx.rollouts.add_engine.remote(member.url, key), timeout=60)
        member.state = "active"
        self._record("join", member)
        self.ctx.message(
            f"engine {member.id} joined at {member.url} "
            f"(weight version {self._version} loaded in {loaded_s:.2f}s, {member.source})"
        )

    def leave(self, member: Member) -> None:
        member.state = "draining"
        moved = ray.get(
            self.ctx.rollouts.drain_engine.remote(member.url, DRAIN_TIMEOUT_S), timeout=DRAIN_TIMEOUT_S + 30
        )
        ray.get(self.ctx.trainer.remove_engine.remote(member.url), timeout=self.ctx.sync_timeout_s)
        if member.slot is not None:
            self.ctx.supervisor.release(member.slot)
        self._retire(member, "leave", moved)
        self.ctx.message(
            f"engine {member.id} left ({member.url}); {moved.samples} sample(s) in flight moved to other engines "
            f"({moved.tokens_regenerated} token(s) to generate again); {len(self.membership.active)} engine(s) active"
        )

    def _forget(self, member: Member) -> None:
        self.membership.drop(member.id)
        unclaim(member.url, self.ctx.run_dir)

    def _retire(self, member: Member, event: str, moved: SampleMoves | None) -> None:
        """Forget an engine that left or was lost; its `move` line (the samples it handed on) precedes its own."""
        self._forget(member)
        if moved is not None and moved.samples:
            self._record("move", member, moved)
        self._record(event, member)

    def on_supervisor_event(self, event: EngineEvent) -> None:
        if isinstance(event, EngineStarted):
            member = self.membership.by_slot(event.index)
            if member is None:  # removed while it started
                return
            member.url = normalize_url(event.url)
            try:
                self.join(member)
            except Exception as exc:  # it never served: stop it, the run goes on as it was
                logger.warning("engine %s at %s could not join: %s", member.id, member.url, exc)
                self.ctx.supervisor.release(event.index)
                self._retire(member, "lost", None)
                self.ctx.message(f"engine {member.id} ({member.url}) could not join and was stopped: {exc}")
        elif isinstance(event, EngineReplaced):
            member = self.membership.by_slot(event.index)
            version = ray.get(
                self.ctx.trainer.replace_engine.remote(event.old_url, event.new_url), timeout=self.ctx.sync_timeout_s
            )
            moved = ray.get(self.ctx.rollouts.engine_moves.remote(event.old_url), timeout=60)
            ray.get(self.ctx.rollouts.replace_engine.remote(event.old_url, event.new_url), timeout=60)
            if member is not None:
                if moved.samples:  # from the engine that died, at its URL
                    self._record("move", member, moved)
                unclaim(member.url, self.ctx.run_dir)
                member.url = normalize_url(event.new_url)
                claim(member.url, self.ctx.run_dir)
                self._record("restart", member)
            self.ctx.message(f"engine {event.index} restarted at {event.new_url} (weight version {version})")
        elif isinstance(event, EngineLost):
            member = self.membership.by_slot(event.index)
            if member is not None and member.state == "starting":  # `engines add`ed, never served: nothing moves
                self._retire(member, "lost", None)
                self.ctx.message(
                    f"engine {member.id} ({event.url}) could not join: {event.reason}; "
                    f"continuing with {len(self.membership.active)} engine(s)"
                )
                return
            if member is not None:
                self._lose(member, event.url)
            self.ctx.message(
                f"engine {event.index} lost ({event.url}: {event.reason}); "
                f"continuing with {len(self.membership.active)} engine(s)"
            )

    def check_registered(self) -> None:
        """A server registered by URL has no process the supervisor watches: it is lost once its /health fails
        LOST_AFTER_FAILED_PROBES checks in a row (its requests already fail over to the other engines)."""
        for member in [m for m in self.membership.active if m.source == "registered"]:
            error = health_error(member.url, member.api_key)
            self._failed_probes[member.id] = 0 if error is None else self._failed_probes[member.id] + 1
            if self._failed_probes[member.id] < LOST_AFTER_FAILED_PROBES:
                continue
            del self._failed_probes[member.id]
            self._lose(member, member.url)
            self.ctx.message(
                f"engine {member.id} lost ({member.url}: {error}, {LOST_AFTER_FAILED_PROBES} health checks in a row); "
                f"continuing with {len(self.membership.active)} engine(s)"
            )

    def _lose(self, member: Member, url: str) -> None:
        """An engine that served is gone: the rollouts and the trainer forget it, its samples moved, its lines."""
        moved = ray.get(self.ctx.rollouts.forget_engine.remote(url), timeout=60)
        ray.get(self.ctx.trainer.remove_engine.remote(url), timeout=self.ctx.sync_timeout_s)
        self._retire(member, "lost", moved)

    def _record(self, event: Any, member: Member, moved: SampleMoves | None = None) -> None:
        self.events.write(
            event_record(
                time=time.time(),
                step=self.ctx.step(),
                event=event,
                member=member,
                engines_active=len(self.membership.active),
                moves=moved,
            )
        )
