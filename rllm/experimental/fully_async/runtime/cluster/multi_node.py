"""The placement plan (core/placement.py) made true on a Ray cluster of several nodes.

Plan node i is the i-th node with GPUs of the cluster, the driver's node first (`cluster_gpu_nodes`). One
placement group holds one bundle per node the plan uses (`core.placement.node_bundles`: all the node's GPUs and one
CPU per process there), each bundle pinned to its node by Ray's `ray.io/node-id` label, strategy STRICT_SPREAD.
Every process is then scheduled into its node's bundle:
- trainer rank r asks for one GPU and one CPU of its bundle and sets `CUDA_VISIBLE_DEVICES` to the plan's device
  (`rank_options`, `rank_devices`; runtime/trainer/ranks.py applies it before CUDA starts): Ray counts GPUs, the
  plan names them, and since the bundle holds every GPU of the node no other job can be given that device;
- the node's engines are started by one engine host actor on that node (engine_hosts.py), which gives each
  engine subprocess its plan block as `CUDA_VISIBLE_DEVICES`.
If the group cannot be reserved in time, one line names each node's bundle and what that node has.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rllm.experimental.fully_async.core.placement import (
    FreeNode,
    PlacementError,
    PlacementPlan,
    node_bundles,
    place_added_engines,
    plan_on_nodes,
    plan_placement,
)
from rllm.experimental.fully_async.errors import ConfigError
from rllm.experimental.fully_async.runtime.cluster.engine_hosts import cluster_engines
from rllm.experimental.fully_async.runtime.cluster.ray_session import init_ray, ray_lifetime

logger = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries it (ray.util.placement_group.NODE_ID_LABEL_KEY)


@dataclass(frozen=True)
class ClusterNode:
    """One alive Ray node with GPUs: its id, address (engines listen there) and resources."""

    node_id: str
    address: str
    gpus: int
    cpus: int


def cluster_gpu_nodes() -> list[ClusterNode]:
    """The connected cluster's alive nodes with GPUs, the driver's node first, then by node id (a stable order)."""

    driver = ray.get_runtime_context().get_node_id()
    nodes = [
        ClusterNode(n["NodeID"], n["NodeManagerAddress"], int(n["Resources"].get("GPU", 0)), int(n["Resources"]["CPU"]))
        for n in ray.nodes()
        if n.get("Alive") and n["Resources"].get("GPU", 0) >= 1
    ]
    return sorted(nodes, key=lambda n: (n.node_id != driver, n.node_id))


def free_gpu_nodes() -> list[tuple[ClusterNode, FreeNode]]:
    """Every alive node with GPUs (`cluster_gpu_nodes`' order, nodes that joined after the run started included)
    with the GPUs no placement group or task holds there now."""

    # Ray has no public per-node "available" view; ray.available_resources() sums over nodes.
    from ray._private.state import available_resources_per_node

    available = available_resources_per_node()
    return [
        (n, FreeNode(n.node_id, n.address, int(available.get(n.node_id, {}).get("GPU", 0))))
        for n in cluster_gpu_nodes()
    ]


@dataclass
class ClusterPlacement:
    """A reserved plan: `nodes[i]` is plan node i, `bundle_of[i]` its bundle in `group`."""

    plan: PlacementPlan
    nodes: tuple[ClusterNode, ...]
    group: Any  # ray.util.placement_group.PlacementGroup
    bundle_of: dict[int, int]

    def _strategy(self, node: int) -> Any:

        return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=self.bundle_of[node])

    def rank_options(self) -> list[dict[str, Any]]:
        """Ray `.options` for each trainer rank: one GPU and one CPU of its node's bundle."""
        one = {"num_gpus": 1, "num_cpus": 1}
        return [{**one, "scheduling_strategy": self._strategy(slot.node)} for slot in self.plan.trainer]

    def rank_devices(self) -> list[str]:
        """`CUDA_VISIBLE_DEVICES` of each trainer rank: its plan device (Ray's own pick is by count, not by index)."""
        return [slot.cuda_visible_devices for slot in self.plan.trainer]

    def engine_host_options(self, node: int) -> dict[str, Any]:
        """Ray `.options` for the engine host of plan node `node`: its engines' GPUs and one CPU of the bundle."""
        gpus = sum(len(slot.gpus) for slot in self.plan.engines_on(node))
        return {"num_gpus": gpus, "num_cpus": 1, "scheduling_strategy": self._strategy(node)}

    def reserve_added(
        self, tp_size: int, node: str | None, name: str, timeout_s: float
    ) -> tuple[ClusterPlacement, FreeNode]:
        """A one-engine reservation for an engine added during the run (`ClusterEngines.add`): on `node`, else the
        node with the most free GPUs now (`place_added_engines`), one bundle of `tp_size` GPUs + 1 CPU there
        (`reserve`; its engine host's options are `engine_host_options(0)`). PlacementError (one line) if none fits."""
        nodes = free_gpu_nodes()
        [target] = place_added_engines([free for _, free in nodes], 1, tp_size, node)
        cluster_node = next(n for n, free in nodes if free is target)
        one = plan_placement([tp_size], num_engines=1, tp_size=tp_size, trainer_ranks=0)
        return reserve(one, [cluster_node], timeout_s=timeout_s, name=name), target

    def release(self) -> None:
        """Give the reservation back (idempotent); processes scheduled into it must be ended first."""

        if self.group is not None and ray.is_initialized():
            remove_placement_group(self.group)
        self.group = None


def reserve(
    plan: PlacementPlan, nodes: list[ClusterNode], timeout_s: float = 120.0, name: str = ""
) -> ClusterPlacement:
    """Reserve the plan's nodes (plan node i = `nodes[i]`) as one placement group; wait at most `timeout_s`.
    `name` tells the group apart from the run's others (an engine added during the run has its own).

    Raises PlacementError (one line) when the group is not placed in time, e.g. another job holds GPUs there.
    """

    if len(nodes) < len(plan.gpus_per_node):
        raise ValueError(f"the plan has {len(plan.gpus_per_node)} nodes, {len(nodes)} given")
    bundles = node_bundles(plan)
    group = placement_group(
        [{"GPU": b.gpus, "CPU": b.cpus} for b in bundles],
        strategy="STRICT_SPREAD",
        bundle_label_selector=[{NODE_ID_LABEL: nodes[b.node].node_id} for b in bundles],
        name=f"rllm-fully-async-{ray.get_runtime_context().get_job_id()}{name}",
    )
    if not group.wait(timeout_seconds=timeout_s):
        remove_placement_group(group)
        wanted = "; ".join(
            f"node {b.node} ({nodes[b.node].address}, id {nodes[b.node].node_id[:8]}): {b.gpus} GPU + {b.cpus} CPU "
            f"of its {nodes[b.node].gpus} GPU + {nodes[b.node].cpus} CPU"
            for b in bundles
        )
        raise PlacementError(
            f"could not reserve the placement in {timeout_s:g} s: {wanted}; another job may hold some of them "
            "(`ray status` shows what is in use)"
        )
    placement = ClusterPlacement(plan, tuple(nodes), group, {b.node: i for i, b in enumerate(bundles)})
    logger.info("placement group reserved on %d node(s): %s", len(bundles), [nodes[b.node].address for b in bundles])
    return placement


def start_on_cluster(spec: Any, stack: Any, log_dir: Any) -> tuple[Any, dict[str, list]]:
    """A `trainer.nnodes > 1` run's processes on the Ray cluster at RAY_ADDRESS (else `auto`): join it, plan over
    its first `trainer.nnodes` GPU nodes, reserve the plan, start the engines through their node's engine host.

    Everything started is registered on `stack` (an ExitStack), so it stops in reverse order. Returns the engines
    (the launcher's interface) and the trainer ranks' placement ({"options": [...], "devices": [...]}).
    """

    if spec.engines.backend != "sglang" or spec.trainer.device != "cuda":
        raise ConfigError(
            f"trainer.nnodes={spec.trainer.nnodes} places SGLang engines and CUDA trainer ranks over a Ray cluster; it "
            f"needs engines.backend=sglang and trainer.device=cuda (got {spec.engines.backend}, {spec.trainer.device})"
        )
    address = os.environ.get("RAY_ADDRESS", "auto")
    stack.enter_context(ray_lifetime(functools.partial(init_ray, address=address)))
    nodes = cluster_gpu_nodes()
    try:
        plan = plan_on_nodes(
            [n.gpus for n in nodes],
            spec.trainer.nnodes,
            num_engines=spec.engines.num_engines,
            tp_size=spec.engines.tensor_model_parallel_size,
            trainer_ranks=spec.trainer.world_size,
        )
    except PlacementError as exc:
        raise ConfigError(f"GPU placement on the Ray cluster at {address}: {exc}") from exc
    logger.info("placement over %d node(s):\n%s", spec.trainer.nnodes, "\n".join(plan.describe()))
    placement = reserve(plan, nodes, timeout_s=spec.engines.startup_timeout_s)
    stack.callback(placement.release)  # after the engines and ranks (LIFO) have ended
    engines = stack.enter_context(cluster_engines(spec.engines, placement, log_dir))
    return engines, {"options": placement.rank_options(), "devices": placement.rank_devices()}
