"""Engines on the nodes of a Ray cluster: one engine host actor per node starts that node's engines there.

An `EngineHost` is a small Ray actor scheduled into its node's placement-group bundle
(runtime/cluster/multi_node.py). It runs the ordinary `engines.launcher.EngineLauncher` on its node, for the engines
the plan puts there (`PlacedEngineCommand`: run-wide engine indices, the plan's GPU blocks), listening on the node's
address, and answers for them: start, alive, restart, probe, kill, stop.

`ClusterEngines` is the driver's side: it has the launcher's interface (`urls`, `api_key`, `processes`, `restart`,
`probe`, `kill`, `stop`, a context manager), so `engines.supervisor.EngineSupervisor` and the run watch remote
engines as they watch local ones. Engines beyond loopback need the per-run secret (`--api-key`): `cluster_engines`
makes one. It also has the elastic launcher's `add(node)` and `release(index)` (`engines add N [--node NODE]`):
an added engine is placed on a node of the cluster as it is then, nodes that joined after the start included, in a
placement group of its own (one bundle on that node) with an engine host of its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from pathlib import Path
from typing import Any

import ray

from rllm.experimental.fully_async.engines.from_config import engine_command
from rllm.experimental.fully_async.engines.launcher import EngineLauncher, EngineStartupError, PlacedEngineCommand
from rllm.experimental.fully_async.engines.supervisor import EngineDiedError

logger = logging.getLogger(__name__)

HOST_CALL_TIMEOUT_S = 60.0  # one call to an engine host that does not wait for an engine to start


@ray.remote
class EngineHost:
    """The engines of one node: an EngineLauncher on this node for `slots` ((engine index, CUDA_VISIBLE_DEVICES));
    devices None: the GPUs Ray gave this actor (an engine added during the run reserves a count, not indices)."""

    def __init__(
        self,
        command: Any,
        slots: list[tuple[int, str | None]],
        bind_host: str | None,
        startup_timeout_s: float,
        log_dir: str,
    ) -> None:

        mine = ",".join(str(g) for g in ray.get_gpu_ids())
        slots = [(index, mine if devices is None else devices) for index, devices in slots]
        host = bind_host or ray.util.get_node_ip_address()  # reachable from the other nodes
        self.launcher = EngineLauncher(
            PlacedEngineCommand(command, tuple(slots)),
            len(slots),
            host=host,
            startup_timeout_s=startup_timeout_s,
            log_dir=log_dir,
            die_with_parent=True,  # a host killed with its owner (a driver that died) must not leave engines on GPUs
        )

    def where(self) -> dict[str, Any]:
        """This actor's node id and process id (for tests and logs)."""

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def start(self, wait: bool = True) -> list[dict[str, Any]]:
        self.launcher.start(wait=wait)
        return [self._info(i) for i in range(len(self.launcher.processes))]

    def status(self, local: int) -> tuple[bool, int | None]:
        proc = self.launcher.processes[local]
        return proc.alive(), proc.returncode

    def restart(self, local: int) -> dict[str, Any]:
        self.launcher.restart(local)
        return self._info(local)

    def probe(self, local: int) -> tuple[bool, dict[str, Any]]:
        """Health of a (re)starting engine, and its process now (a lost port race starts it again elsewhere)."""
        return self.launcher.probe(local), self._info(local)

    def kill(self, local: int) -> None:
        self.launcher.kill(local)

    def release(self, local: int) -> None:
        self.launcher.release(local)

    def stop(self) -> None:
        self.launcher.stop()

    def _info(self, local: int) -> dict[str, Any]:
        proc = self.launcher.processes[local]
        return {"url": proc.url, "pid": proc.pid, "log_path": str(proc.log_path)}


class RemoteEngineProcess:
    """One engine on a cluster node, as the supervisor reads it (`launcher.EngineProcess`'s fields)."""

    def __init__(self, index: int, host: Any, local: int, info: dict[str, Any]) -> None:
        self.index, self.host, self.local = index, host, local
        self.url, self.pid, self.log_path = info["url"], int(info["pid"]), info["log_path"]
        self._returncode: int | None = None

    def alive(self) -> bool:
        try:
            alive, self._returncode = ray.get(self.host.status.remote(self.local), timeout=HOST_CALL_TIMEOUT_S)
        except ray.exceptions.RayActorError:  # the host is gone (its node died): so is the engine, or it is orphaned
            logger.warning("the engine host of engine %d (%s) is gone", self.index, self.url)
            return False
        return bool(alive)

    @property
    def returncode(self) -> int | None:
        return self._returncode


class ClusterEngines:
    """The run's engines spread over the placement's nodes; see the module docstring."""

    places_on_nodes = True  # add(node) takes a node (engines.supervisor.EngineSupervisor.add_slot)

    def __init__(
        self,
        command: Any,
        placement: Any,
        *,
        api_key: str | None,
        bind_host: str | None = None,
        startup_timeout_s: float = 180.0,
        log_dir: str | Path = "engines",
    ) -> None:
        """`command`: the EngineCommand of every engine (with `api_key` in it when set); `placement`: a reserved
        `ClusterPlacement`; `bind_host`: the address engines listen on (None: each node's own address)."""
        self.command, self.placement, self.api_key = command, placement, api_key
        self.bind_host, self.startup_timeout_s, self.log_dir = bind_host, float(startup_timeout_s), str(log_dir)
        self.hosts: dict[int, Any] = {}  # plan node -> EngineHost
        self.processes: list[RemoteEngineProcess] = []
        self.added: dict[int, Any] = {}  # engine index -> its own ClusterPlacement (engines added during the run)

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.processes]

    def __enter__(self) -> ClusterEngines:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> list[str]:
        """Start every node's engines at once and wait until all are healthy; stops them all on failure."""
        plan = self.placement.plan
        try:
            for node in plan.nodes_used:
                slots = [(slot.index, slot.cuda_visible_devices) for slot in plan.engines_on(node)]
                if not slots:
                    continue
                self.hosts[node] = EngineHost.options(**self.placement.engine_host_options(node)).remote(
                    self.command, slots, self.bind_host, self.startup_timeout_s, self.log_dir
                )
            started = self._get({node: host.start.remote() for node, host in self.hosts.items()}, "start engines")
        except BaseException:
            self.stop()
            raise
        by_index: dict[int, RemoteEngineProcess] = {}
        for node, infos in started.items():
            for local, (slot, info) in enumerate(zip(plan.engines_on(node), infos, strict=True)):
                by_index[slot.index] = RemoteEngineProcess(slot.index, self.hosts[node], local, info)
        self.processes = [by_index[i] for i in sorted(by_index)]
        logger.info("started %d engine(s) on %d node(s): %s", len(self.processes), len(self.hosts), self.urls)
        return self.urls

    def restart(self, index: int) -> RemoteEngineProcess:
        old = self.processes[index]
        try:
            info = ray.get(old.host.restart.remote(old.local), timeout=HOST_CALL_TIMEOUT_S)
        except ray.exceptions.RayActorError as exc:
            raise EngineDiedError(
                f"engine {index} ({old.url}) cannot be restarted: its node's engine host is gone (node lost?)"
            ) from exc
        self.processes[index] = RemoteEngineProcess(index, old.host, old.local, info)
        return self.processes[index]

    def probe(self, index: int) -> bool:
        old = self.processes[index]
        try:
            healthy, info = ray.get(old.host.probe.remote(old.local), timeout=HOST_CALL_TIMEOUT_S)
        except ray.exceptions.RayTaskError as exc:
            raise EngineStartupError(str(exc.cause or exc).splitlines()[0]) from exc
        self.processes[index] = RemoteEngineProcess(index, old.host, old.local, info)
        return bool(healthy)

    def kill(self, index: int) -> None:
        proc = self.processes[index]
        ray.get(proc.host.kill.remote(proc.local), timeout=HOST_CALL_TIMEOUT_S)

    def add(self, node: str | None = None) -> RemoteEngineProcess:
        """Start one more engine, in a new slot, on a node of the cluster as it is NOW (a node that joined after
        the run started included), without waiting for it to be healthy (the supervisor probes it).

        `node`: a node id, its address or a unique id prefix; None: the node with the most free GPUs (ties: the
        driver's node first, then by node id; `core.placement.place_added_engines`). The engine gets a placement
        group of its own, one bundle pinned to that node (its tp GPUs + 1 CPU, `reserve`), and an engine host of
        its own there. Raises PlacementError (a ValueError, one line) when no such node exists or it lacks the
        free GPUs; nodes the run's placement group holds have none free (it reserves all their GPUs).
        """
        tp = len(self.placement.plan.engines[0].gpus) if self.placement.plan.engines else 1
        index = len(self.processes)
        placement, target = self.placement.reserve_added(tp, node, f"-engine-{index}", HOST_CALL_TIMEOUT_S)
        host = None
        try:
            host = EngineHost.options(**placement.engine_host_options(0)).remote(
                self.command, [(index, None)], self.bind_host, self.startup_timeout_s, self.log_dir
            )
            [info] = self._get({index: host.start.remote(wait=False)}, f"start engine {index}")[index]
        except BaseException as exc:
            if host is not None:
                with contextlib.suppress(Exception):
                    ray.kill(host)
            placement.release()
            if isinstance(exc, EngineStartupError):  # a refusal of this request (one line), not the run's end
                raise ValueError(f"engine {index} on node {target.name}: {exc}") from exc
            raise
        self.added[index] = placement
        self.processes.append(RemoteEngineProcess(index, host, 0, info))
        logger.info("engine %d added on node %s: %s", index, target.name, info["url"])
        return self.processes[index]

    def release(self, index: int) -> None:
        """Stop engine `index` for good (it left the run). An added engine's host ends and its bundle is freed; a
        started one's host keeps serving its node's other engines (their bundle stays the run's)."""
        proc = self.processes[index]
        try:
            ray.get(proc.host.release.remote(proc.local), timeout=HOST_CALL_TIMEOUT_S)
        except ray.exceptions.RayActorError:  # its host is gone: so is the engine (die_with_parent)
            logger.warning("engine %d (%s): its engine host is gone", index, proc.url)
        placement = self.added.pop(index, None)
        if placement is not None:
            ray.kill(proc.host)
            placement.release()
        logger.info("engine %d (%s) released", index, proc.url)

    def stop(self) -> None:
        """Stop every engine through its host, then end the hosts (idempotent)."""
        added = {f"added engine {i}": self.processes[i].host for i in self.added}
        hosts, self.hosts, self.processes = {**self.hosts, **added}, {}, []
        refs = {node: host.stop.remote() for node, host in hosts.items()}
        # Each host's stop on its own: one dead host must not cut the others' short (ray.get of all would raise).
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=HOST_CALL_TIMEOUT_S)
        for node, ref in refs.items():
            try:
                ray.get(ref, timeout=0)
            except Exception as exc:  # a dead host's engines died with it (die_with_parent)
                logger.warning("engine host on node %s did not stop its engines: %s", node, str(exc).splitlines()[0])
        for host in hosts.values():
            ray.kill(host)
        placements, self.added = self.added, {}
        for placement in placements.values():
            placement.release()

    def _get(self, refs: dict[int, Any], what: str) -> dict[int, Any]:
        timeout = self.startup_timeout_s + HOST_CALL_TIMEOUT_S  # the hosts wait startup_timeout_s themselves
        _, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
        if pending:
            late = [node for node, ref in refs.items() if ref in pending]
            raise EngineStartupError(f"engine hosts on node(s) {late} did not {what} within {timeout:g} s")
        try:
            return {node: ray.get(ref) for node, ref in refs.items()}
        except ray.exceptions.RayTaskError as exc:
            raise EngineStartupError(f"{what}: {str(exc.cause or exc).splitlines()[0]}") from exc


def cluster_engines(
    engines: Any, placement: Any, log_dir: str | Path, *, bind_host: str | None = None
) -> ClusterEngines:
    """The configured engines over a reserved placement, each listening on its node's address with a fresh per-run
    secret (`--api-key`; `.api_key` is what clients must send)."""

    api_key = secrets.token_urlsafe(32)
    return ClusterEngines(
        engine_command(engines, api_key),
        placement,
        api_key=api_key,
        bind_host=bind_host,
        startup_timeout_s=engines.startup_timeout_s,
        log_dir=log_dir,
    )
