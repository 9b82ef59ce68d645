"""`plan`: print where a run's engines and trainer ranks would go, and the engine command lines, starting nothing.

`python -m rllm.experimental.fully_async plan [--config FILE] [--gpus-per-node N] [--nodes M] [key=value ...]`

The GPUs come from the flags, else from the Ray cluster named by RAY_ADDRESS (its nodes' GPU resources, the driver's
node first, as the runtime orders them), else from this machine (torch.cuda.device_count()). A machine without GPUs
(a laptop planning a cluster run) gets the plan for the config's own shape: `trainer.nnodes` nodes, each with the
fewest GPUs that hold the engines (`engines.num_engines` x the tensor-parallel size, blocks whole) and the
`trainer.n_gpus_per_node` x `trainer.nnodes` trainer ranks, and is told the plan is for GPUs it did not see. The
placement itself is
`core.placement.plan_on_nodes` over the first `trainer.nnodes` nodes, the function the runtime uses. Every process is
printed with its node; on several nodes, engines listen on their node's address with the run's secret.

`--add-engines N [--node NODE]` also shows where `engines add N [--node NODE]` would put N more engines of a
running cluster run (`core.placement.place_added_engines`, the rule the runtime applies): on the Ray cluster at
RAY_ADDRESS, the GPUs free there now (nodes the run holds have none; nodes that joined since it started count);
from the flags, the nodes beyond the plan's `trainer.nnodes`. A local run (`trainer.nnodes=1`) starts them on its
host, and refuses `--node`.
Exit codes: 0 a plan fits, 1 the GPUs do not suffice (one line says what is missing), 2 bad config.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import torch
from omegaconf import DictConfig

from rllm.experimental.fully_async.core.placement import (
    FreeNode,
    PlacementError,
    PlacementPlan,
    node_bundles,
    place_added_engines,
    plan_on_nodes,
)
from rllm.experimental.fully_async.engines.from_config import engine_command
from rllm.experimental.fully_async.run_spec import engine_lora_spec, engines_spec
from rllm.experimental.fully_async.runtime.cluster.multi_node import cluster_gpu_nodes, free_gpu_nodes
from rllm.experimental.fully_async.settings import ConfigError, load_config
from rllm.experimental.fully_async.settings.derive import largest_staleness

PLACEHOLDER_HOST = "127.0.0.1"
PLACEHOLDER_PORT = 30000  # the launcher picks free ports at start; engine i is shown on PLACEHOLDER_PORT + i
PLACEHOLDER_SECRET = "RUN_SECRET"  # a fresh secret is drawn at every start (engines.from_config.api_key_for)


def detect_gpus_per_node() -> tuple[list[int], str]:
    """GPUs per node and where the count came from: the Ray cluster at RAY_ADDRESS, else this machine."""
    if os.environ.get("RAY_ADDRESS"):
        # lazy: only a plan for the cluster at RAY_ADDRESS connects to Ray
        import ray

        ray.init(address=os.environ["RAY_ADDRESS"], configure_logging=False, log_to_driver=False)
        try:
            counts = [node.gpus for node in cluster_gpu_nodes()]
        finally:
            ray.shutdown()
        return counts, f"Ray cluster at {os.environ['RAY_ADDRESS']}"
    try:
        return [torch.cuda.device_count()], "this machine (torch.cuda.device_count())"
    except Exception:  # torch without CUDA support: no GPUs
        return [0], "this machine (no CUDA)"


def detect_free_nodes() -> list[FreeNode]:
    """The GPU nodes of the Ray cluster at RAY_ADDRESS with the GPUs free there now."""
    import ray  # lazy: only `plan` against a running cluster joins Ray; a plan on paper never imports it

    ray.init(address=os.environ["RAY_ADDRESS"], configure_logging=False, log_to_driver=False)
    try:
        return [free for _, free in free_gpu_nodes()]
    finally:
        ray.shutdown()


def planned_free_nodes(gpus_per_node: list[int], nnodes: int) -> list[FreeNode]:
    """The nodes of `gpus_per_node` as a started run leaves them: its first `nnodes` nodes with GPUs are held whole
    (no GPU free), every later one is free. Named `node-i` / `NODEi_ADDRESS` as the plan's lines name them."""
    with_gpus = [n for n in gpus_per_node if n > 0]
    return [FreeNode(f"node-{i}", f"NODE{i}_ADDRESS", 0 if i < nnodes else n) for i, n in enumerate(with_gpus)]


def added_engine_lines(
    nodes: list[FreeNode], first_index: int, count: int, tp_size: int, node: str | None
) -> list[str]:
    """`added engine i: node ...` per engine of `engines add count [--node node]`; PlacementError if they do not fit."""
    placed = place_added_engines(nodes, count, tp_size, node)
    return [
        f"added engine {first_index + i}: node {where.name}, {tp_size} GPU(s) + 1 CPU in a placement group of its own"
        for i, where in enumerate(placed)
    ]


def trainer_ranks(cfg: DictConfig) -> int:
    """verl counts trainer devices as n_gpus_per_node x nnodes; one rank per device."""
    return int(cfg.trainer.n_gpus_per_node or 1) * int(cfg.trainer.nnodes or 1)


def engine_tp_size(cfg: DictConfig) -> int:
    return int(cfg.actor_rollout_ref.rollout.tensor_model_parallel_size or 1)


def engine_lines(cfg: DictConfig, slots: list[tuple[int, int, dict[str, str]]], multi_node: bool = False) -> list[str]:
    """`engine i (node n): ENV argv` for each (index, node, environment), built by the runtime's `engine_command`.
    On several nodes an engine listens on its node's address and requires the run's secret (placeholders here)."""
    command = engine_command(engines_spec(cfg), PLACEHOLDER_SECRET if multi_node else None)
    lines = []
    for index, node, env in slots:
        prefix = "".join(f"{k}={v} " for k, v in env.items())
        host = f"NODE{node}_ADDRESS" if multi_node else PLACEHOLDER_HOST
        argv = command.build(host, PLACEHOLDER_PORT + index, index)
        lines.append(f"  engine {index} (node {node}): {prefix}{shlex.join(argv)}")
    return lines


def lora_line(cfg: DictConfig) -> str | None:
    """With LoRA, what the engines' LoRA flags hold (their flags are on the engine lines)."""
    lora = engine_lora_spec(cfg)
    if lora is None:
        return None
    eta_max = largest_staleness(cfg.async_training)
    loaded = "no limit" if lora.max_loaded_loras is None else str(lora.max_loaded_loras)
    return (
        f"LoRA: each sync loads one adapter version per engine (no pause); an engine keeps the eta_max + 1 = "
        f"{eta_max + 1} versions the staleness bound admits: --max-loaded-loras {loaded}, --max-loras-per-batch "
        f"{lora.max_loras_per_batch}, --max-lora-rank {lora.max_lora_rank}, modules {' '.join(lora.target_modules)}"
    )


def run_plan(
    cfg: DictConfig,
    gpus_per_node: list[int] | None = None,
    source: str = "flags",
    add_engines: int = 0,
    node: str | None = None,
) -> int:
    """Print the plan, and where `add_engines` more engines would go (on `node`); returns the exit code (0 fits,
    1 does not, 2 `node` given for a local run)."""
    if (line := lora_line(cfg)) is not None:
        print(line)
    nnodes = int(cfg.trainer.nnodes or 1)
    if add_engines and nnodes == 1:
        if node is not None:
            print(
                f"plan --node {node}: trainer.nnodes=1 is a local run, its engines start on the driver's host; --node "
                "places engines on a Ray cluster's nodes (trainer.nnodes > 1); drop --node",
                file=sys.stderr,
            )
            return 2
        print(f"engines add {add_engines}: a local run (trainer.nnodes=1) starts them on its own host")
    if str(cfg.engines.backend) == "embedded":
        num_engines = int(cfg.engines.num_engines)
        print(f"CPU run: {num_engines} embedded engine process(es) on loopback, 1 trainer rank; no GPU needed")
        print("\n".join(engine_lines(cfg, [(i, 0, {}) for i in range(num_engines)])))
        return 0
    num_engines, tp, ranks = int(cfg.engines.num_engines), engine_tp_size(cfg), trainer_ranks(cfg)
    if gpus_per_node is None:
        gpus_per_node, source = detect_gpus_per_node()
        if sum(gpus_per_node) == 0 and not os.environ.get("RAY_ADDRESS"):
            gpus_per_node = assumed_cluster(nnodes, num_engines, tp, ranks)
            print(
                f"no GPU seen on {source}: this plan is for GPUs it did not see, {nnodes} node(s) x "
                f"{gpus_per_node[0]} GPUs, the fewest that hold engines.num_engines={num_engines} x tp {tp} and "
                f"trainer.n_gpus_per_node x trainer.nnodes = {ranks} trainer rank(s); --gpus-per-node N [--nodes M] "
                "plans for your nodes"
            )
            source = "the config (assumed, not seen)"
    try:
        plan = plan_on_nodes(gpus_per_node, nnodes, num_engines=num_engines, tp_size=tp, trainer_ranks=ranks)
    except PlacementError as exc:
        print(f"plan: {exc} (GPUs from {source}; --gpus-per-node N --nodes M plans for other nodes)", file=sys.stderr)
        return 1
    print(f"GPUs from {source}: {gpus_per_node} per node" + _unused(gpus_per_node, nnodes))
    print("\n".join(plan.describe()))
    if nnodes > 1:
        print(f"one placement group, one bundle per node: {_bundles(plan)}; one engine host actor per engine node")
    slots = [(slot.index, slot.node, {"CUDA_VISIBLE_DEVICES": slot.cuda_visible_devices}) for slot in plan.engines]
    print("\n".join(engine_lines(cfg, slots, multi_node=nnodes > 1)))
    if add_engines and nnodes > 1:
        on_cluster = bool(os.environ.get("RAY_ADDRESS")) and source.startswith("Ray cluster")
        nodes = detect_free_nodes() if on_cluster else planned_free_nodes(gpus_per_node, nnodes)
        try:
            print("\n".join(added_engine_lines(nodes, num_engines, add_engines, tp, node)))
        except PlacementError as exc:
            print(f"plan --add-engines {add_engines}: {exc}", file=sys.stderr)
            return 1
    return 0


def assumed_cluster(nnodes: int, num_engines: int, tp_size: int, ranks: int) -> list[int]:
    """GPUs per node of the smallest cluster of `nnodes` equal nodes that the placement fits: the total spread
    evenly, raised until every engine's tp block fits whole on a node (`plan_placement`'s first fit)."""
    per_node = max(1, -(-(num_engines * tp_size + ranks) // nnodes))
    while True:
        try:
            plan_on_nodes([per_node] * nnodes, nnodes, num_engines=num_engines, tp_size=tp_size, trainer_ranks=ranks)
            return [per_node] * nnodes
        except PlacementError:
            per_node += 1  # ends: at num_engines * tp_size + ranks GPUs per node everything fits on the first node


def _unused(gpus_per_node: list[int], nnodes: int) -> str:
    with_gpus = sum(1 for n in gpus_per_node if n > 0)
    return f"; trainer.nnodes={nnodes}: {with_gpus - nnodes} node(s) left unused" if with_gpus > nnodes else ""


def _bundles(plan: PlacementPlan) -> str:
    return ", ".join(f"node {b.node} {{GPU: {b.gpus}, CPU: {b.cpus}}}" for b in node_bundles(plan))


def main(argv: list[str]) -> int:
    """`plan` subcommand: parse flags and overrides, load the config, print the plan. Returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m rllm.experimental.fully_async plan", description=__doc__)
    parser.add_argument("--config", default=None)
    parser.add_argument("--gpus-per-node", type=int, default=None, help="GPUs on each node (default: detect)")
    parser.add_argument(
        "--nodes", type=int, default=None, help="number of nodes, with --gpus-per-node (default: trainer.nnodes)"
    )
    parser.add_argument(
        "--add-engines",
        type=int,
        default=0,
        metavar="N",
        help="also show where `engines add N` would put N more engines of the running run",
    )
    parser.add_argument("--node", default=None, help="with --add-engines: the node `engines add N --node NODE` names")
    args, overrides = parser.parse_known_args(argv)
    if args.add_engines < 0 or (args.node is not None and not args.add_engines):
        print("plan: --add-engines N needs N >= 1, and --node needs --add-engines", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, overrides, check_host=False)  # planning a GPU host from anywhere
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    nodes = args.nodes if args.nodes is not None else int(cfg.trainer.nnodes or 1)
    gpus = [args.gpus_per_node] * nodes if args.gpus_per_node is not None else None
    source = f"--gpus-per-node {args.gpus_per_node} --nodes {nodes}"
    return run_plan(cfg, gpus, source=source, add_engines=args.add_engines, node=args.node)
