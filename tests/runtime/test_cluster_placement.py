"""The placement plan enforced on a two-node Ray cluster (runtime/cluster/: multi_node.py, engine_hosts.py).

`ray.cluster_utils.Cluster` starts a head and a second node on this machine, on 127.0.0.1, each declaring GPUs it does
not have and a resource naming it. The plan puts engine 0 on node 0, engine 1 and two trainer ranks on node 1. The
test checks, from inside each process, the node it runs on and the `CUDA_VISIBLE_DEVICES` it sees; that real embedded
engines started by the engine hosts answer through the addresses they report (and refuse calls without the run's
secret); that the engine supervisor restarts a killed remote engine through its host; that an engine dies with a
host killed without stopping it; and that a cluster too small for the plan is refused in one line. The cluster runs
in a subprocess: the session's Ray (tests/conftest.py) stays untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from rllm.experimental.fully_async.core.placement import PlacementError, node_bundles, plan_on_nodes

pytestmark = pytest.mark.timeout(240)

CLUSTER_SCRIPT = """
import json, os, signal, sys, time
t0 = time.monotonic()
import httpx, ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table
from rllm.experimental.fully_async.core.placement import PlacementError, plan_on_nodes
from rllm.experimental.fully_async.engines.launcher import EmbeddedEngineCommand
from rllm.experimental.fully_async.engines.supervisor import EngineSupervisor
from rllm.experimental.fully_async.runtime.cluster.multi_node import cluster_gpu_nodes, reserve
from rllm.experimental.fully_async.runtime.cluster.engine_hosts import ClusterEngines
from rllm.experimental.fully_async.runtime.trainer.rank import PolicyRank

model_path, log_dir = sys.argv[1], sys.argv[2]


def gone(pid):
    try:  # exited: no such process, or a zombie nobody has reaped yet
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


common = dict(node_ip_address="127.0.0.1", object_store_memory=80_000_000)
cluster = Cluster(initialize_head=True, head_node_args=dict(
    num_cpus=2, num_gpus=2, resources={"node_a": 1}, include_dashboard=False, **common))
cluster.add_node(num_cpus=4, num_gpus=4, resources={"node_b": 1}, **common)
ray.init(address=cluster.address, configure_logging=False, log_to_driver=False)
out = {"t": {"cluster": time.monotonic() - t0}}
try:
    names = {n["NodeID"]: ("a" if "node_a" in n["Resources"] else "b") for n in ray.nodes() if n["Alive"]}
    nodes = cluster_gpu_nodes()
    out["order"] = [names[n.node_id] for n in nodes]
    plan = plan_on_nodes([n.gpus for n in nodes], nnodes=2, num_engines=2, tp_size=2, trainer_ranks=2)
    placement = reserve(plan, nodes, timeout_s=60)
    out["t"]["reserved"] = time.monotonic() - t0
    table = placement_group_table(placement.group)
    out["bundles"] = [(names[table["bundles_to_node_id"][i]], b) for i, b in enumerate(table["bundles"].values())]
    out["strategy"] = table["strategy"]

    ranks = [PolicyRank.options(**options).remote(r, 2, "cuda", devices)
             for r, (options, devices) in enumerate(zip(placement.rank_options(), placement.rank_devices()))]
    out["ranks"] = [(names[p["node_id"]], p["cuda_visible_devices"])
                    for p in ray.get([rank.placement.remote() for rank in ranks], timeout=60)]

    out["t"]["ranks"] = time.monotonic() - t0
    key = "run-secret"
    command = EmbeddedEngineCommand(model_path, max_running_requests=4, num_threads=1, extra_args=("--api-key", key))
    engines = ClusterEngines(command, placement, api_key=key, bind_host="127.0.0.1", startup_timeout_s=90,
                             log_dir=log_dir)
    with engines:
        out["t"]["engines"] = time.monotonic() - t0
        hosts = {node: ray.get(host.where.remote(), timeout=30) for node, host in engines.hosts.items()}
        out["hosts"] = {str(node): names[h["node_id"]] for node, h in hosts.items()}
        out["engines"] = []
        for proc in engines.processes:
            environ = open(f"/proc/{proc.pid}/environ", "rb").read().split(b"\\0")
            devices = next(v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"CUDA_VISIBLE_DEVICES="))
            health = httpx.get(f"{proc.url}/health", timeout=10).status_code
            keyless = httpx.get(f"{proc.url}/get_weight_version", timeout=10).status_code
            keyed = httpx.get(f"{proc.url}/get_weight_version", timeout=10,
                              headers={"Authorization": f"Bearer {key}"}).status_code
            out["engines"].append(dict(index=proc.index, devices=devices, health=health, keyless=keyless,
                                       keyed=keyed, alive=proc.alive(), pid=proc.pid, url=proc.url))
        # The supervisor watches remote engines as local ones: engine 1 (node 1) killed, restarted there.
        supervisor = EngineSupervisor(engines, "restart", max_restarts=1, startup_timeout_s=90)
        os.kill(engines.processes[1].pid, signal.SIGKILL)
        events, deadline = [], time.monotonic() + 120
        while not events and time.monotonic() < deadline:
            events = supervisor.poll()
            time.sleep(0.5)
        new = engines.processes[1]
        out["restart"] = dict(events=[type(e).__name__ for e in events], new_url=new.url,
                              old_url=out["engines"][1]["url"],
                              health=httpx.get(f"{new.url}/health", timeout=10).status_code)
        out["engines"].append(dict(index=1, pid=new.pid))
        # A host killed without stop() (its owner died) takes its engine with it.
        ray.kill(engines.hosts[0])
        deadline = time.monotonic() + 30
        while not gone(engines.processes[0].pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        out["orphan_gone"] = gone(engines.processes[0].pid)
    out["engines_alive_after_stop"] = [not gone(e["pid"]) for e in out["engines"]]
    for rank in ranks:
        ray.kill(rank)
    placement.release()

    out["t"]["stopped"] = time.monotonic() - t0
    # A plan the cluster cannot hold: node 1 "has" 8 GPUs in the plan, 4 in the cluster.
    too_big = plan_on_nodes([2, 8], nnodes=2, num_engines=1, tp_size=2, trainer_ranks=8)
    try:
        reserve(too_big, nodes, timeout_s=3)
        out["too_big"] = None
    except PlacementError as exc:
        out["too_big"] = str(exc)
finally:
    out["t"]["end"] = time.monotonic() - t0
    print("RESULT " + json.dumps(out), flush=True)
    ray.shutdown()
    cluster.shutdown()
"""


@pytest.mark.slow  # a two-node Ray cluster with real engines and rank actors (~100 s on 2 cores)
def test_a_two_node_cluster_runs_every_process_on_its_planned_node_and_gpus(tmp_path, tiny_model_dir):
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-c", CLUSTER_SCRIPT, str(tiny_model_dir), str(tmp_path / "engines")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    print("seconds since start:", out["t"])
    assert out["order"] == ["a", "b"]  # the driver's node is plan node 0
    # One bundle per node, pinned: all of its GPUs, one CPU per process the plan puts there.
    assert out["strategy"] == "STRICT_SPREAD"
    assert out["bundles"] == [["a", {"GPU": 2.0, "CPU": 1.0}], ["b", {"GPU": 4.0, "CPU": 3.0}]]
    assert out["ranks"] == [["b", "2"], ["b", "3"]]  # node 1's GPUs 2 and 3, seen from inside each rank
    assert out["hosts"] == {"0": "a", "1": "b"}  # each node's engine host runs on that node
    engines = {e["index"]: e for e in out["engines"][:2]}
    assert [engines[i]["devices"] for i in (0, 1)] == ["0,1", "0,1"]  # each engine its own node's block
    for engine in engines.values():
        assert engine["alive"] and engine["health"] == 200, engine
        assert (engine["keyless"], engine["keyed"]) == (401, 200), engine  # the run's secret is required
    assert out["restart"]["events"] == ["EngineReplaced"] and out["restart"]["health"] == 200
    assert out["restart"]["new_url"] != out["restart"]["old_url"]  # a new process on a new port
    assert out["orphan_gone"]  # engine 0 died with its host, killed without stop()
    assert out["engines_alive_after_stop"] == [False, False, False]
    assert out["too_big"] is not None and "\n" not in out["too_big"]
    assert "could not reserve the placement in 3 s" in out["too_big"] and "node 1 (127.0.0.1" in out["too_big"]
    assert "8 GPU + 8 CPU of its 4 GPU + 4 CPU" in out["too_big"]


class _OneNodeWithoutReservation:
    """A one-node plan on the session's Ray (tests/conftest.py), which has no GPUs to reserve: the plan is real, only
    the placement group is left out, so the engine host asks for no resources (ClusterPlacement's other method)."""

    def __init__(self, plan: object) -> None:
        self.plan = plan

    def engine_host_options(self, node: int) -> dict:
        return {"num_cpus": 0}


def test_cluster_engines_start_kill_restart_and_stop_an_engine_through_its_host(ray_session, tiny_model_dir, tmp_path):
    """The driver's side of the cluster engines, in the inner loop: a real embedded engine started by an engine host
    actor answers at the address it reports (with the run's secret), is seen dead once killed through the host,
    comes back as a new process through `restart` and `probe` (as the supervisor drives it), and `stop` ends it."""
    import httpx
    import psutil

    from rllm.experimental.fully_async.engines.launcher import EmbeddedEngineCommand
    from rllm.experimental.fully_async.runtime.cluster.engine_hosts import ClusterEngines

    key = "run-secret"
    plan = plan_on_nodes([1], nnodes=1, num_engines=1, tp_size=1, trainer_ranks=0)
    command = EmbeddedEngineCommand(
        str(tiny_model_dir), max_running_requests=4, num_threads=1, extra_args=("--api-key", key)
    )
    engines = ClusterEngines(
        command,
        _OneNodeWithoutReservation(plan),
        api_key=key,
        bind_host="127.0.0.1",
        startup_timeout_s=90,
        log_dir=tmp_path,
    )
    auth = {"Authorization": f"Bearer {key}"}

    def wait_for(condition, what: str, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.2)

    def ended(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    with engines:
        [first] = engines.processes
        assert first.alive() and first.returncode is None
        assert httpx.get(f"{first.url}/get_weight_version", headers=auth, timeout=10).status_code == 200
        assert httpx.get(f"{first.url}/get_weight_version", timeout=10).status_code == 401  # the secret is required
        engines.kill(0)
        wait_for(lambda: not first.alive(), "the killed engine still looks alive")
        assert first.returncode is not None
        engines.restart(0)
        wait_for(lambda: engines.probe(0), "the restarted engine never became healthy")
        second = engines.processes[0]
        assert second.pid != first.pid  # a new process (on a port picked afresh)
        assert httpx.get(f"{second.url}/health", timeout=10).status_code == 200
    assert engines.processes == [] and engines.hosts == {}

    wait_for(lambda: ended(second.pid), "the engine outlived stop()", 30)


def test_plan_on_nodes_uses_the_first_nnodes_nodes_and_names_what_is_missing():
    plan = plan_on_nodes([2, 4, 8], nnodes=2, num_engines=2, tp_size=2, trainer_ranks=2)
    assert plan.gpus_per_node == (2, 4)  # the third node is not part of the run
    assert [(s.node, s.gpus) for s in plan.engines] == [(0, (0, 1)), (1, (0, 1))]
    assert [(s.node, s.gpus) for s in plan.trainer] == [(1, (2,)), (1, (3,))]
    assert [(b.node, b.gpus, b.cpus) for b in node_bundles(plan)] == [(0, 2, 1), (1, 4, 3)]
    with pytest.raises(PlacementError, match=r"trainer.nnodes=3 but the cluster has 2 node\(s\) with GPUs .*1 node"):
        plan_on_nodes([4, 0, 4], nnodes=3, num_engines=1, tp_size=1, trainer_ranks=1)
    with pytest.raises(PlacementError, match=r"needs 8 GPUs .* has 6: 2 GPU\(s\) missing"):
        plan_on_nodes([2, 4], nnodes=2, num_engines=3, tp_size=2, trainer_ranks=2)


def test_a_cluster_run_needs_sglang_engines_and_cuda_ranks_and_says_so_before_joining_ray(tmp_path):
    from contextlib import ExitStack

    from rllm.experimental.fully_async.errors import ConfigError
    from rllm.experimental.fully_async.run_spec import build_run_spec
    from rllm.experimental.fully_async.runtime.cluster.multi_node import start_on_cluster
    from rllm.experimental.fully_async.settings import load_config

    cfg = load_config(None, ["trainer.nnodes=2", "trainer.device=cuda"], check_host=False)
    with ExitStack() as stack, pytest.raises(ConfigError) as caught:
        start_on_cluster(build_run_spec(cfg), stack, tmp_path)
    assert "\n" not in str(caught.value)
    assert "trainer.nnodes=2 places SGLang engines and CUDA trainer ranks" in str(caught.value)
    assert "(got embedded, cuda)" in str(caught.value)


def test_a_cpu_driver_may_start_a_cluster_run_whose_ranks_are_on_gpu_nodes():
    import torch

    from rllm.experimental.fully_async.errors import ConfigError
    from rllm.experimental.fully_async.settings import load_config

    gpu_config = os.path.join(os.path.dirname(__file__), "..", "..", "config", "gpu_fsdp_sglang.yaml")
    cfg = load_config(gpu_config, ["trainer.nnodes=2"])  # the head node need not have CUDA: the ranks are elsewhere
    assert (cfg.trainer.device, cfg.trainer.nnodes) == ("cuda", 2)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"'trainer\.device=cuda' but CUDA is not available here"):
            load_config(gpu_config, [])  # on one node the ranks run here


JOIN_SCRIPT = """
import json, sys, time
t0 = time.monotonic()
import httpx, ray
from ray._private.state import available_resources_per_node
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table
from rllm.experimental.fully_async.core.placement import plan_on_nodes
from rllm.experimental.fully_async.engines.launcher import EmbeddedEngineCommand
from rllm.experimental.fully_async.engines.supervisor import EngineStarted, EngineSupervisor
from rllm.experimental.fully_async.runtime.cluster.engine_hosts import ClusterEngines
from rllm.experimental.fully_async.runtime.cluster.multi_node import cluster_gpu_nodes, reserve

model_path, log_dir = sys.argv[1], sys.argv[2]


def gone(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def refusal(node):
    try:
        supervisor.add_slot(node)
    except ValueError as exc:
        return str(exc)


common = dict(node_ip_address="127.0.0.1", object_store_memory=80_000_000)
cluster = Cluster(initialize_head=True, head_node_args=dict(
    num_cpus=2, num_gpus=1, resources={"node_a": 1}, include_dashboard=False, **common))
ray.init(address=cluster.address, configure_logging=False, log_to_driver=False)
out = {"t": {}}
try:
    nodes = cluster_gpu_nodes()
    placement = reserve(plan_on_nodes([n.gpus for n in nodes], 1, num_engines=1, tp_size=1, trainer_ranks=0), nodes)
    key = "run-secret"
    command = EmbeddedEngineCommand(model_path, max_running_requests=4, num_threads=1, extra_args=("--api-key", key))
    with ClusterEngines(command, placement, api_key=key, bind_host="127.0.0.1", startup_timeout_s=90,
                        log_dir=log_dir) as engines:
        out["t"]["started"] = time.monotonic() - t0
        supervisor = EngineSupervisor(engines, "restart", startup_timeout_s=90, stop_when_all_lost=False)
        out["held"] = refusal(None)  # the run's group holds the head's only GPU
        out["unknown"] = refusal("ffffnotanode")
        # A node joins the cluster after the engines started.
        cluster.add_node(num_cpus=2, num_gpus=2, resources={"node_b": 1}, **common)
        cluster.wait_for_nodes()
        new_id = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "node_b" in n["Resources"])
        out["t"]["joined"] = time.monotonic() - t0
        proc = supervisor.add_slot(new_id[:10])
        events, deadline = [], time.monotonic() + 120
        while not events and time.monotonic() < deadline:
            events = supervisor.poll()
            time.sleep(0.3)
        out["t"]["added"] = time.monotonic() - t0
        out["events"] = [(type(e).__name__, e.index, e.url == proc.url) for e in events]
        out["host_on_new_node"] = ray.get(proc.host.where.remote(), timeout=30)["node_id"] == new_id
        environ = open(f"/proc/{proc.pid}/environ", "rb").read().split(b"\\0")
        out["devices"] = next(v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"CUDA_VISIBLE_DEVICES="))
        body = {"input_ids": [[3, 4, 5]], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
        answer = httpx.post(f"{proc.url}/generate", json=body, timeout=60, headers={"Authorization": f"Bearer {key}"})
        out["generate"] = (answer.status_code, len(answer.json()[0]["output_ids"]) if answer.status_code == 200 else 0)
        table = placement_group_table(engines.added[1].group)
        out["bundle"] = [table["bundles_to_node_id"][0] == new_id, table["bundles"][0]]
        out["free_on_new_node"] = [available_resources_per_node()[new_id].get("GPU", 0)]
        group_id = engines.added[1].group.id
        supervisor.release(1)
        deadline = time.monotonic() + 30
        while not gone(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        out["released_gone"] = gone(proc.pid)
        time.sleep(1)
        out["free_on_new_node"].append(available_resources_per_node()[new_id].get("GPU", 0))
        out["group_after_release"] = ray.util.placement_group_table().get(group_id.hex(), {}).get("state")
        out["first_alive"] = engines.processes[0].alive() and not engines.added
finally:
    out["t"]["end"] = time.monotonic() - t0
    print("RESULT " + json.dumps(out), flush=True)
    ray.shutdown()
    cluster.shutdown()
"""


@pytest.mark.slow  # a Ray cluster that grows by a node, two real engines (~60 s on 2 cores)
def test_an_engine_added_during_the_run_is_placed_on_a_node_that_joined_after_the_start(tmp_path, tiny_model_dir):
    """`ClusterEngines.add(node)` (what `engines add N --node NODE` reaches through the supervisor): the run starts
    with one engine on the head node, which its placement group holds whole; a node joins; the added engine runs on
    that node (seen from inside), in a bundle of its own there, joins once healthy and generates; released, its
    process ends and its GPU is free again. A node that does not exist, or no free GPU anywhere: one line."""
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-c", JOIN_SCRIPT, str(tiny_model_dir), str(tmp_path / "engines")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    print("seconds since start:", out["t"])
    assert out["held"] and "\n" not in out["held"], out
    assert "added engine 1 of 1 needs 1 free GPU(s) on one node, but any node has fewer" in out["held"]
    assert out["unknown"] and "--node ffffnotanode: no node of the cluster match" in out["unknown"], out
    assert "\n" not in out["unknown"]
    assert out["events"] == [["EngineStarted", 1, True]], out
    assert out["host_on_new_node"] and out["devices"] in ("0", "1"), out  # one of the new node's two GPUs
    assert out["generate"] == [200, 4], out
    assert out["bundle"] == [True, {"GPU": 1.0, "CPU": 1.0}], out
    assert out["free_on_new_node"] == [1.0, 2.0], out  # the bundle held one GPU; released, both are free
    assert out["released_gone"] and out["group_after_release"] == "REMOVED", out
    assert out["first_alive"], out
