"""GPU placement: which GPUs (node, index) each inference engine and each trainer rank gets. Pure.

The rule is the design's: engines and trainer ranks never share a GPU. An engine needs `tp_size` GPUs on ONE node
(tensor parallelism runs over NVLink inside a node); a trainer rank needs one GPU. Engines are placed first, first
fit from node 0; trainer ranks take what is left from the last node backward. On the common shapes the two sides
then sit on separate nodes (2 nodes x 8 GPUs, 8 engines + 8 ranks: node 0 generates, node 1 trains) and a rank's
FSDP peers are its neighbours. When the GPUs do not suffice, `PlacementError` says in one line what is missing.

The runtime turns a plan into process settings (`CUDA_VISIBLE_DEVICES` per engine, Ray resources per rank; on a
cluster, one placement-group bundle per node from `node_bundles`); the `plan` command prints it without starting
anything; the simulator can sweep splits through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rllm.experimental.fully_async.errors import FullyAsyncError


class PlacementError(FullyAsyncError, ValueError):
    """The cluster cannot host the requested engines and trainer ranks; the message names what is missing."""


@dataclass(frozen=True)
class GpuSlot:
    """One process's GPUs: engine `index` (tp_size GPUs) or trainer rank `index` (one GPU), all on `node`."""

    role: str  # "engine" | "trainer"
    index: int
    node: int
    gpus: tuple[int, ...]  # device indices on that node, as CUDA_VISIBLE_DEVICES lists them

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(str(g) for g in self.gpus)


@dataclass(frozen=True)
class PlacementPlan:
    engines: tuple[GpuSlot, ...]
    trainer: tuple[GpuSlot, ...]
    gpus_per_node: tuple[int, ...]

    @property
    def gpus_used(self) -> int:
        return sum(len(s.gpus) for s in (*self.engines, *self.trainer))

    @property
    def gpus_total(self) -> int:
        return sum(self.gpus_per_node)

    def describe(self) -> list[str]:
        """One line per slot, then the idle GPUs, for the `plan` command."""
        lines = [
            f"{slot.role} {slot.index}: node {slot.node} GPU {slot.cuda_visible_devices}"
            for slot in (*self.engines, *self.trainer)
        ]
        idle = self.gpus_total - self.gpus_used
        lines.append(f"{self.gpus_used} of {self.gpus_total} GPUs used" + (f", {idle} idle" if idle else ""))
        return lines

    @property
    def nodes_used(self) -> tuple[int, ...]:
        """The nodes holding at least one engine or trainer rank, ascending."""
        return tuple(sorted({slot.node for slot in (*self.engines, *self.trainer)}))

    def engines_on(self, node: int) -> tuple[GpuSlot, ...]:
        return tuple(slot for slot in self.engines if slot.node == node)

    def trainer_on(self, node: int) -> tuple[GpuSlot, ...]:
        return tuple(slot for slot in self.trainer if slot.node == node)


@dataclass(frozen=True)
class NodeBundle:
    """What a run reserves on one node: all its GPUs, and one CPU per process the plan puts there.

    All the node's GPUs, not only the used ones: Ray accounts GPUs by count, not by device index, so a reservation
    of k GPUs would not stop Ray from handing device 6 to another job while the plan gives it to a trainer rank.
    Reserving the whole node makes the plan's device indices this run's alone.
    """

    node: int
    gpus: int
    cpus: int  # one per trainer rank, plus one for the node's engine host when engines run there


def node_bundles(plan: PlacementPlan) -> tuple[NodeBundle, ...]:
    """One bundle per node the plan uses, in node order (bundle b of a placement group is node `nodes_used[b]`)."""
    return tuple(
        NodeBundle(node, plan.gpus_per_node[node], len(plan.trainer_on(node)) + (1 if plan.engines_on(node) else 0))
        for node in plan.nodes_used
    )


def plan_placement(gpus_per_node: Sequence[int], num_engines: int, tp_size: int, trainer_ranks: int) -> PlacementPlan:
    """Place `num_engines` engines of `tp_size` GPUs and `trainer_ranks` one-GPU trainer ranks without sharing.

    Raises PlacementError (one line) when there are too few GPUs in total, or enough in total but no node with
    `tp_size` free GPUs left for some engine.
    """
    if num_engines < 0 or trainer_ranks < 0:
        raise ValueError(f"counts must be >= 0, got {num_engines} engines and {trainer_ranks} trainer ranks")
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if any(n < 0 for n in gpus_per_node):
        raise ValueError(f"GPU counts per node must be >= 0, got {list(gpus_per_node)}")
    needed = num_engines * tp_size + trainer_ranks
    have = sum(gpus_per_node)
    if needed > have:
        raise PlacementError(
            f"needs {needed} GPUs ({num_engines} engines x tp {tp_size} + {trainer_ranks} trainer ranks) but "
            f"{_cluster(gpus_per_node)} has {have}: {needed - have} GPU(s) missing; lower engines.num_engines, "
            "the tensor-parallel size or trainer.n_gpus_per_node x trainer.nnodes, or add nodes"
        )
    free = [list(range(n)) for n in gpus_per_node]  # free device indices per node, ascending
    engines: list[GpuSlot] = []
    for index in range(num_engines):
        # First fit: with equal blocks this reaches the most engines possible, sum(gpus // tp_size) over nodes.
        node = next((n for n, devices in enumerate(free) if len(devices) >= tp_size), None)
        if node is None:
            raise PlacementError(
                f"engine {index} needs {tp_size} GPUs on one node, but the free GPUs left are "
                f"{[len(d) for d in free]} per node of {_cluster(gpus_per_node)}; use a tensor-parallel size that "
                "divides the GPUs per node, or fewer engines"
            )
        block, free[node] = tuple(free[node][:tp_size]), free[node][tp_size:]
        engines.append(GpuSlot("engine", index, node, block))
    taken: list[tuple[int, int]] = []
    for node in reversed(range(len(free))):
        while free[node] and len(taken) < trainer_ranks:
            taken.append((node, free[node].pop()))  # from the last node down: away from the engines
    # Number ranks in (node, gpu) order so rank 0 is the lowest device and a node's ranks are consecutive.
    trainer = [GpuSlot("trainer", rank, node, (gpu,)) for rank, (node, gpu) in enumerate(sorted(taken))]
    return PlacementPlan(tuple(engines), tuple(trainer), tuple(gpus_per_node))


def plan_on_nodes(
    gpus_per_node: Sequence[int], nnodes: int, num_engines: int, tp_size: int, trainer_ranks: int
) -> PlacementPlan:
    """The plan over the first `nnodes` nodes with GPUs of a cluster (`trainer.nnodes`; the runtime lists the
    driver's node first, so engines fill the driver's node first and trainer ranks the last node).

    Raises PlacementError (one line) when the cluster has fewer nodes with GPUs than `nnodes`, or when those nodes'
    GPUs do not hold the engines and ranks.
    """
    if nnodes < 1:
        raise ValueError(f"nnodes must be >= 1, got {nnodes}")
    with_gpus = [n for n in gpus_per_node if n > 0]
    if len(with_gpus) < nnodes:
        raise PlacementError(
            f"trainer.nnodes={nnodes} but the cluster has {len(with_gpus)} node(s) with GPUs "
            f"({list(gpus_per_node)} GPUs per node): {nnodes - len(with_gpus)} node(s) missing; add nodes or lower "
            "trainer.nnodes"
        )
    return plan_placement(with_gpus[:nnodes], num_engines=num_engines, tp_size=tp_size, trainer_ranks=trainer_ranks)


def _cluster(gpus_per_node: Sequence[int]) -> str:
    if len(set(gpus_per_node)) == 1 and gpus_per_node:
        return f"{len(gpus_per_node)} node(s) x {gpus_per_node[0]} GPUs"
    return f"nodes with {list(gpus_per_node)} GPUs"


@dataclass(frozen=True)
class FreeNode:
    """A node engines may be added on during a run: its id, its address and the GPUs no one holds there now (a node
    the run's placement group holds has none: the group reserves every GPU of its nodes, see NodeBundle)."""

    node_id: str
    address: str
    free_gpus: int

    @property
    def name(self) -> str:
        return f"{self.node_id[:12]} ({self.address})"


def pick_node(nodes: Sequence[FreeNode], node: str) -> FreeNode:
    """The node `node` names: its id or address exactly, else a unique prefix of its id; PlacementError (one line)
    when none or several match."""
    exact = [n for n in nodes if node in (n.node_id, n.address)]
    found = exact if len(exact) == 1 else [n for n in nodes if n.node_id.startswith(node)]
    if len(found) != 1:
        known = ", ".join(n.name for n in nodes) or "none"
        what = "no node" if not found else f"{len(found)} nodes"
        raise PlacementError(
            f"--node {node}: {what} of the cluster match (nodes with GPUs: {known}); give a node id or a unique prefix "
            "of one (`ray list nodes`)"
        )
    return found[0]


def place_added_engines(nodes: Sequence[FreeNode], count: int, tp_size: int, node: str | None = None) -> list[FreeNode]:
    """Where `count` engines added to a running run go, one node per engine, each needing `tp_size` free GPUs on
    that node. With `node` every engine goes there (an id, an address or a unique id prefix, `pick_node`); without
    it each engine goes to the node with the most free GPUs at that moment (ties: the first in `nodes`), so the
    added engines spread over the emptiest nodes. PlacementError (one line) when they do not fit.
    """
    if count < 1 or tp_size < 1:
        raise ValueError(f"count and tp_size must be >= 1, got {count} and {tp_size}")
    free = {n.node_id: n.free_gpus for n in nodes}
    candidates = [pick_node(nodes, node)] if node is not None else list(nodes)
    placed: list[FreeNode] = []
    for index in range(count):
        best = max(candidates, key=lambda n: free[n.node_id], default=None)
        if best is None or free[best.node_id] < tp_size:
            where = f"node {best.name}" if node is not None and best is not None else "any node"
            left = ", ".join(f"{n.name}: {free[n.node_id]}" for n in nodes) or "no node with GPUs"
            raise PlacementError(
                f"added engine {index + 1} of {count} needs {tp_size} free GPU(s) on one node, but {where} has fewer "
                f"(free GPUs: {left}); nodes the run already holds have none free: add a node to the cluster, or "
                "add fewer engines"
            )
        free[best.node_id] -= tp_size
        placed.append(best)
    return placed
