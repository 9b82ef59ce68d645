"""Watch a run's engine processes and act on one that dies: restart it, go on without it, or stop the run.

`engines.on_engine_failure` chooses (`decide_on_engine_death` is the whole policy):
- `restart` (default): start a new process for the slot, on a new port, at most `engines.max_restarts` times per
  run (a crash loop must not spin forever); past that the slot is lost as under `continue`. The new engine joins
  once healthy: the caller loads the current weights into it and swaps it in for the dead URL
  (`ParamSync.replace_engine`, `EngineClient.replace_engine`).
- `continue`: the slot is lost; requests go to the other engines, weight syncs skip it.
- `stop`: the run ends with a checkpoint and an error naming the engine.

Slots come and go with the run's membership (docs/design.md#rule-engine-set-can-change): `add_slot()` starts an
engine in a new slot, reported as `EngineStarted` once healthy (the caller syncs it, then routes to it), or as
`EngineLost` if it exits or is not healthy within `startup_timeout_s` (never restarted: it never served); `release`
stops a slot whose engine left, which is never restarted. With `stop_when_all_lost=False` (the driver's: with no
engine left it waits for one to join, `engines.no_engine_timeout_s`) losing every slot is reported, not raised.

The driver calls `poll()` while it waits for training steps. `poll()` never blocks on a starting engine: it
reaps, spawns and probes /health once, and reports what changed since the last call. A requests' failover is not
its business: the client already re-sends a dead engine's requests elsewhere, or waits for a replacement.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from rllm.experimental.fully_async.engines.launcher import EngineStartupError
from rllm.experimental.fully_async.errors import FullyAsyncError

logger = logging.getLogger(__name__)

EngineFailurePolicy = Literal["restart", "continue", "stop"]
DeathAction = Literal["restart", "drop", "stop"]


def decide_on_engine_death(policy: EngineFailurePolicy, restarts_used: int, max_restarts: int) -> DeathAction:
    """What to do with an engine slot whose process died (or whose restart failed)."""
    if policy == "stop":
        return "stop"
    if policy == "restart" and restarts_used < max_restarts:
        return "restart"
    return "drop"


class EngineDiedError(FullyAsyncError, RuntimeError):
    """An engine process died and `engines.on_engine_failure` says to stop (or no engine is left to serve)."""


@dataclass(frozen=True)
class EngineReplaced:
    """Slot `index` serves again, at `new_url`; its dead predecessor was `old_url`."""

    index: int
    old_url: str
    new_url: str


@dataclass(frozen=True)
class EngineLost:
    """Slot `index` (last at `url`) is gone for the rest of the run."""

    index: int
    url: str
    reason: str


@dataclass(frozen=True)
class EngineStarted:
    """Slot `index`, added during the run (`add_slot`), serves at `url` for the first time."""

    index: int
    url: str


EngineEvent = EngineReplaced | EngineLost | EngineStarted


class WatchedProcess(Protocol):
    """What the supervisor reads of one engine: `launcher.EngineProcess`, or a remote one on a cluster node."""

    url: str
    pid: int
    log_path: Any

    @property
    def returncode(self) -> int | None: ...

    def alive(self) -> bool: ...


class SupervisedLauncher(Protocol):
    """What the supervisor needs of `launcher.EngineLauncher` (or of `runtime.engine_hosts.ClusterEngines`)."""

    processes: list[WatchedProcess]

    def restart(self, index: int) -> WatchedProcess: ...

    def probe(self, index: int) -> bool: ...

    def kill(self, index: int) -> None: ...


class ElasticLauncher(SupervisedLauncher, Protocol):
    """A launcher that can also start and stop single slots during the run (`launcher.EngineLauncher`; a cluster's
    `ClusterEngines`, whose `places_on_nodes` is True, also takes `add(node)`)."""

    def add(self) -> WatchedProcess: ...

    def release(self, index: int) -> None: ...


@dataclass
class _Slot:
    state: Literal["running", "starting", "lost", "released"] = "running"
    dead_url: str = ""  # the URL clients and syncs still know, while a replacement starts
    joined: bool = True  # False for a slot added during the run until it first serves (EngineStarted)
    started_at: float = 0.0
    lost_reason: str = ""  # why the slot was lost, for the error when every slot is


class EngineSupervisor:
    """See the module docstring. `restarts` counts restart attempts (failed ones too) across all slots."""

    def __init__(
        self,
        launcher: SupervisedLauncher,
        policy: EngineFailurePolicy,
        *,
        max_restarts: int = 3,
        startup_timeout_s: float = 180.0,
        clock: Callable[[], float] = time.monotonic,
        stop_when_all_lost: bool = True,
    ) -> None:
        self.launcher = launcher
        self.policy = policy
        self.max_restarts = max_restarts
        self.startup_timeout_s = startup_timeout_s
        self.clock = clock
        self.restarts = 0
        self.stop_when_all_lost = stop_when_all_lost
        self._slots = [_Slot() for _ in launcher.processes]

    def add_slot(self, node: str | None = None) -> WatchedProcess:
        """Start an engine in a new slot (`launcher.add`); `poll()` reports `EngineStarted` once it is healthy.
        `node` places it on that Ray cluster node (a cluster run's launcher, `ClusterEngines.add`). Raises
        ValueError (one line) when the launcher cannot add engines, or cannot place one on `node`."""
        add = getattr(self.launcher, "add", None)
        if add is None:
            raise ValueError("this run's engines cannot grow: its launcher has no add()")
        if node is not None and not getattr(self.launcher, "places_on_nodes", False):
            raise ValueError(
                f"engines add --node {node}: this run's engines are local (trainer.nnodes=1), started on the driver's "
                "host; --node places engines on a Ray cluster's nodes (trainer.nnodes > 1); drop --node"
            )
        proc = add(node) if node is not None else add()
        self._slots.append(_Slot(state="starting", started_at=self.clock(), joined=False))
        return proc

    def release(self, index: int) -> None:
        """Slot `index`'s engine left the run: stop it and never restart it."""
        self._slots[index].state = "released"
        self.launcher.release(index)  # type: ignore[attr-defined]  # only slots add_slot made, or launched ones

    @property
    def num_alive(self) -> int:
        return sum(slot.state == "running" for slot in self._slots)

    def metrics(self) -> dict[str, float]:
        return {
            "engines/alive": float(self.num_alive),
            "engines/starting": float(sum(s.state == "starting" for s in self._slots)),
            "engines/lost": float(sum(s.state == "lost" for s in self._slots)),
            "engines/restarts": float(self.restarts),
        }

    def poll(self) -> list[EngineEvent]:
        """Notice deaths, start replacements, report the ones that became healthy. Raises EngineDiedError when the
        policy says stop, or when every slot is lost."""
        events: list[EngineEvent] = []
        for index, slot in enumerate(self._slots):
            if slot.state == "running":
                proc = self.launcher.processes[index]
                if not proc.alive():
                    reason = f"pid {proc.pid} exited with code {proc.returncode} (log {proc.log_path})"
                    self._on_death(index, slot, proc.url, reason, events)
            elif slot.state == "starting":
                self._check_start(index, slot, events)
        if self.stop_when_all_lost and all(slot.state in ("lost", "released") for slot in self._slots):
            lost = "; ".join(f"engine {i}: {slot.lost_reason}" for i, slot in enumerate(self._slots))
            raise EngineDiedError(f"every inference engine is gone and none can be restarted ({lost})")
        return events

    def _on_death(self, index: int, slot: _Slot, url: str, reason: str, events: list[EngineEvent]) -> None:
        action = decide_on_engine_death(self.policy, self.restarts, self.max_restarts)
        logger.warning("engine %d (%s) died: %s; action: %s", index, url, reason, action)
        if action == "stop":
            raise EngineDiedError(
                f"engine {index} ({url}) died: {reason}. engines.on_engine_failure=stop ends the run; set it to "
                "restart or continue to keep training"
            )
        if action == "drop":
            slot.state = "lost"
            why = reason if self.policy != "restart" else f"{reason}; restart budget of {self.max_restarts} used up"
            slot.lost_reason = f"{slot.dead_url or url} {why}"
            events.append(EngineLost(index, slot.dead_url or url, why))
            return
        self.restarts += 1
        slot.dead_url = slot.dead_url or url  # a failed restart keeps the URL the rest of the run still knows
        slot.state = "starting"
        slot.started_at = self.clock()
        new = self.launcher.restart(index)
        logger.warning(
            "engine %d: restart %d of %d as pid %d on %s", index, self.restarts, self.max_restarts, new.pid, new.url
        )

    def _check_start(self, index: int, slot: _Slot, events: list[EngineEvent]) -> None:
        proc = self.launcher.processes[index]
        try:
            healthy = self.launcher.probe(index)
        except EngineStartupError as exc:
            what = "restart failed" if slot.joined else "start failed"
            self._start_failed(index, slot, proc.url, f"{what}: {str(exc).splitlines()[0]}", events)
            return
        if healthy:
            slot.state = "running"
            new_url = self.launcher.processes[index].url
            if slot.joined:
                events.append(EngineReplaced(index, slot.dead_url, new_url))
            else:  # a slot added during the run serves for the first time: nothing knew a URL of it before
                slot.joined = True
                events.append(EngineStarted(index, new_url))
            slot.dead_url = ""
            return
        if self.clock() - slot.started_at > self.startup_timeout_s:
            self.launcher.kill(index)
            what = "restart" if slot.joined else "start"
            reason = f"{what} not healthy within {self.startup_timeout_s:g}s (log {proc.log_path})"
            self._start_failed(index, slot, proc.url, reason, events)

    def _start_failed(self, index: int, slot: _Slot, url: str, reason: str, events: list[EngineEvent]) -> None:
        """A start that failed: a restart is a death (the policy decides); an engine added during the run that never
        served is lost at once, whatever the policy: it held no request and no weights, so neither a restart budget
        spent on it nor `on_engine_failure=stop` ending the run would help, and the run goes on with the engines it
        has (the caller reports it as failed to join)."""
        if slot.joined:
            self._on_death(index, slot, url, reason, events)
            return
        logger.warning("engine %d (%s) added during the run did not start: %s", index, url, reason)
        slot.state = "lost"
        slot.lost_reason = f"{url} {reason}"
        events.append(EngineLost(index, url, reason))
