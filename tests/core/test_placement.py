"""GPU placement plan (core/placement.py): no GPU is shared, engines keep their tp block on one node."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from rllm.experimental.fully_async.core.placement import PlacementError, plan_placement


def _devices(plan):
    return [(slot.node, gpu) for slot in (*plan.engines, *plan.trainer) for gpu in slot.gpus]


def test_one_node_splits_engines_low_and_trainer_high():
    plan = plan_placement([8], num_engines=4, tp_size=1, trainer_ranks=4)
    assert [s.gpus for s in plan.engines] == [(0,), (1,), (2,), (3,)]
    assert [s.gpus for s in plan.trainer] == [(4,), (5,), (6,), (7,)]
    assert [s.index for s in plan.trainer] == [0, 1, 2, 3]


def test_two_nodes_put_generation_and_training_on_separate_nodes():
    plan = plan_placement([8, 8], num_engines=4, tp_size=2, trainer_ranks=8)
    assert {s.node for s in plan.engines} == {0}
    assert {s.node for s in plan.trainer} == {1}
    assert plan.engines[1].cuda_visible_devices == "2,3"


@pytest.mark.parametrize("nodes", [[4], [8], [2, 4], [8, 8], [3, 5]])
@pytest.mark.parametrize(("engines", "tp", "ranks"), list(itertools.product(range(5), (1, 2, 4), range(0, 10, 3))))
def test_no_gpu_is_ever_shared_and_a_plan_exists_whenever_one_is_possible(nodes, engines, tp, ranks):
    possible = engines <= sum(n // tp for n in nodes) and engines * tp + ranks <= sum(nodes)
    try:
        plan = plan_placement(nodes, num_engines=engines, tp_size=tp, trainer_ranks=ranks)
    except PlacementError as exc:
        assert not possible, f"no plan for {nodes}, {engines}x{tp} + {ranks}: {exc}"
        assert "\n" not in str(exc)
        return
    assert possible
    devices = _devices(plan)
    assert len(devices) == len(set(devices)) == engines * tp + ranks
    assert all(gpu < nodes[node] for node, gpu in devices)
    for slot in plan.engines:
        assert len(slot.gpus) == tp
        assert list(slot.gpus) == list(range(slot.gpus[0], slot.gpus[0] + tp))  # contiguous block


def test_too_few_gpus_names_what_is_missing():
    with pytest.raises(PlacementError, match=r"needs 12 GPUs \(4 engines x tp 2 \+ 4 trainer ranks\).*has 8: 4 GPU"):
        plan_placement([8], num_engines=4, tp_size=2, trainer_ranks=4)


def test_enough_gpus_in_total_but_no_node_fits_a_tp_block():
    # 2 nodes x 4 GPUs hold one block of 3 each: a third engine of tp 3 has no node, though 9 > 8 is not the issue.
    with pytest.raises(PlacementError, match="engine 2 needs 3 GPUs on one node"):
        plan_placement([4, 4, 1], num_engines=3, tp_size=3, trainer_ranks=0)


def test_engines_go_where_their_block_fits_and_the_trainer_takes_the_rest():
    plan = plan_placement([2, 4], num_engines=1, tp_size=4, trainer_ranks=2)
    assert (plan.engines[0].node, plan.engines[0].gpus) == (1, (0, 1, 2, 3))
    assert [(s.node, s.gpus) for s in plan.trainer] == [(0, (0,)), (0, (1,))]


def test_describe_lists_every_slot_and_idle_gpus():
    lines = plan_placement([8], num_engines=2, tp_size=2, trainer_ranks=2).describe()
    assert lines[0] == "engine 0: node 0 GPU 0,1"
    assert lines[-1] == "6 of 8 GPUs used, 2 idle"


# --- the `plan` command ----------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
GPU_CONFIG = REPO / "config" / "gpu_fsdp_sglang.yaml"


def test_plan_prints_every_engine_command_with_its_own_gpus(capsys):
    from rllm.experimental.fully_async.cli import plan

    code = plan.main(
        [
            "--config",
            str(GPU_CONFIG),
            "--gpus-per-node",
            "8",
            "engines.num_engines=2",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "trainer.n_gpus_per_node=1",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "engine 0: node 0 GPU 0,1" in out and "engine 1: node 0 GPU 2,3" in out
    assert "trainer 0: node 0 GPU 7" in out
    engine_lines = [line for line in out.splitlines() if "sglang.launch_server" in line]
    assert len(engine_lines) == 2
    assert engine_lines[1].lstrip().startswith("engine 1 (node 0): CUDA_VISIBLE_DEVICES=2,3 ")
    assert "--tp-size 2" in engine_lines[1]
    assert "--host 127.0.0.1" in engine_lines[1] and "--api-key" not in engine_lines[1]  # one node: loopback


def test_plan_over_trainer_nnodes_prints_each_process_with_its_node_and_the_bundles(capsys):
    from rllm.experimental.fully_async.cli import plan

    overrides = ["engines.num_engines=2", "trainer.n_gpus_per_node=3", "trainer.nnodes=2"]
    code = plan.main(["--config", str(GPU_CONFIG), "--gpus-per-node", "4", *overrides])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "GPUs from --gpus-per-node 4 --nodes 2: [4, 4] per node" in out
    assert "engine 1: node 0 GPU 1" in out and "trainer 0: node 0 GPU 2" in out and "trainer 5: node 1 GPU 3" in out
    assert "node 0 {GPU: 4, CPU: 3}, node 1 {GPU: 4, CPU: 4}" in out
    engine_lines = [line.strip() for line in out.splitlines() if "sglang.launch_server" in line]
    assert engine_lines[1].startswith("engine 1 (node 0): CUDA_VISIBLE_DEVICES=1 ")
    assert "--host NODE0_ADDRESS" in engine_lines[1] and "--api-key RUN_SECRET" in engine_lines[1]


def test_plan_with_fewer_nodes_than_trainer_nnodes_says_so_in_one_line(capsys):
    from rllm.experimental.fully_async.cli import plan

    code = plan.main(["--config", str(GPU_CONFIG), "--gpus-per-node", "8", "--nodes", "1", "trainer.nnodes=2"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1
    assert "trainer.nnodes=2 but the cluster has 1 node(s) with GPUs" in err and "1 node(s) missing" in err


def test_plan_says_in_one_line_what_is_missing(capsys):
    from rllm.experimental.fully_async.cli import plan

    code = plan.main(
        ["--config", str(GPU_CONFIG), "--gpus-per-node", "2", "engines.num_engines=4", "trainer.n_gpus_per_node=1"]
    )
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert len(err.splitlines()) == 1
    assert "needs 5 GPUs" in err and "3 GPU(s) missing" in err


def test_plan_of_the_cpu_default_needs_no_gpu(capsys):
    from rllm.experimental.fully_async.cli import plan

    assert plan.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("CPU run: 2 embedded engine process(es)")
    assert out.count("engines.embedded.server") == 2


def test_plan_without_gpus_plans_for_the_configs_own_shape_and_says_it_saw_none(capsys, monkeypatch):
    """A laptop planning a cluster run: no GPU here, so the plan is for trainer.nnodes nodes with the fewest GPUs
    that hold the engines' tp blocks and the trainer ranks, and the first line says those GPUs were not seen."""
    from rllm.experimental.fully_async.cli import plan

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(plan, "detect_gpus_per_node", lambda: ([0], "this machine (no CUDA)"))
    overrides = [
        "trainer.nnodes=2",
        "trainer.n_gpus_per_node=3",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    ]
    assert plan.main(["--config", str(GPU_CONFIG), *overrides]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("no GPU seen on this machine (no CUDA): this plan is for GPUs it did not see, 2 node(s)")
    # 4 engines x tp 2 + 6 ranks = 14 GPUs over 2 nodes: 7 each, and 7 holds three tp-2 blocks and a rank
    assert "2 node(s) x 7 GPUs" in out[0] and "GPUs from the config (assumed, not seen): [7, 7] per node" in out
    assert sum(line.startswith("trainer ") for line in out) == 6
    assert plan.assumed_cluster(1, num_engines=3, tp_size=4, ranks=2) == [14]
    assert plan.assumed_cluster(2, num_engines=3, tp_size=4, ranks=0) == [8, 8]  # 6 per node would split a block


# --- the plan enforced through Ray on one host (runtime/cluster/one_host.py) ---------------------------------------

RAY_GPU_SCRIPT = """
import json, os
import ray
from rllm.experimental.fully_async.core.placement import plan_placement
from rllm.experimental.fully_async.engines.sglang import SGLangEngineCommand
from rllm.experimental.fully_async.runtime.cluster.one_host import ray_gpu_environment, ray_num_gpus

plan = plan_placement([8], num_engines=2, tp_size=2, trainer_ranks=4)
with ray_gpu_environment(plan):
    ray.init(address="local", num_cpus=4, num_gpus=ray_num_gpus(plan), include_dashboard=False,
             object_store_memory=100_000_000, configure_logging=False, log_to_driver=False)

@ray.remote(num_gpus=1, num_cpus=0)
class Rank:
    def devices(self):
        return os.environ.get("CUDA_VISIBLE_DEVICES")

ranks = [Rank.remote() for _ in range(4)]
seen = ray.get([r.devices.remote() for r in ranks], timeout=120)
command = SGLangEngineCommand(model_path="m", tp_size=2)
engines = [command.env(i)["CUDA_VISIBLE_DEVICES"] for i in range(2)]
print(json.dumps({"ranks": sorted(seen), "engines": engines, "driver": os.environ.get("CUDA_VISIBLE_DEVICES")}))
ray.shutdown()
"""


@pytest.mark.slow  # its own Ray instance declaring 8 GPUs (~12 s on a busy 2-core machine)
def test_ray_declaring_gpus_gives_each_rank_one_trainer_gpu_and_never_an_engine_gpu(tmp_path):
    """Ray declares 8 GPUs this machine does not have: 2 engines of tp 2 keep GPUs 0-3, the 4 ranks get 4-7."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(
        [sys.executable, "-c", RAY_GPU_SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["ranks"] == ["4", "5", "6", "7"]  # one GPU each, none of the engines'
    assert seen["engines"] == ["0,1", "2,3"]
    assert seen["driver"] is None  # the driver's own environment is restored after Ray started


def test_the_host_plan_follows_the_run_spec():
    from rllm.experimental.fully_async.run_spec import build_run_spec
    from rllm.experimental.fully_async.runtime.cluster.one_host import host_gpu_plan, trainer_actor_gpus
    from rllm.experimental.fully_async.settings import load_config

    cpu = build_run_spec(load_config(None, []))
    assert host_gpu_plan(cpu, gpus_on_host=8) is None and trainer_actor_gpus(cpu) == 0
    overrides = ["engines.num_engines=3", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]
    gpu = build_run_spec(load_config(GPU_CONFIG, [*overrides, "trainer.n_gpus_per_node=2"], check_host=False))
    plan = host_gpu_plan(gpu, gpus_on_host=8)
    assert [s.gpus for s in plan.engines] == [(0, 1), (2, 3), (4, 5)]
    assert [s.gpus for s in plan.trainer] == [(6,), (7,)]
    assert trainer_actor_gpus(gpu) == 0  # two ranks: they ask for their GPUs, the coordinating actor for none
    one_rank = build_run_spec(load_config(GPU_CONFIG, overrides, check_host=False))
    assert trainer_actor_gpus(one_rank) == 1


def test_added_engines_go_to_the_node_with_the_most_free_gpus_or_to_the_node_named():
    from rllm.experimental.fully_async.core.placement import FreeNode, place_added_engines

    nodes = [FreeNode("aaaa11", "10.0.0.1", 0), FreeNode("bbbb22", "10.0.0.2", 2), FreeNode("bbcc33", "10.0.0.3", 4)]
    # Each engine to the emptiest node at that moment (ties: the first listed): 4 free, then 2 and 2 (tie), ...
    assert [n.node_id for n in place_added_engines(nodes, 3, 2)] == ["bbcc33", "bbbb22", "bbcc33"]
    assert [n.node_id for n in place_added_engines(nodes, 1, 1, node="bbbb")] == ["bbbb22"]  # a unique id prefix
    assert [n.node_id for n in place_added_engines(nodes, 2, 1, node="10.0.0.3")] == ["bbcc33"] * 2  # an address
    with pytest.raises(PlacementError, match=r"--node bb: 2 nodes of the cluster match") as ambiguous:
        place_added_engines(nodes, 1, 1, node="bb")
    with pytest.raises(PlacementError, match=r"--node zz: no node of the cluster match") as unknown:
        place_added_engines(nodes, 1, 1, node="zz")
    with pytest.raises(PlacementError, match=r"added engine 2 of 2 needs 2 free GPU\(s\) on one node, but node bbbb22"):
        place_added_engines(nodes, 2, 2, node="bbbb22")
    with pytest.raises(PlacementError, match=r"added engine 1 of 1 needs 1 free GPU\(s\) on one node, but node aaaa11"):
        place_added_engines(nodes, 1, 1, node="aaaa11")  # a node the run holds whole has none free
    with pytest.raises(PlacementError, match=r"added engine 4 of 4 needs 2 free GPU\(s\) on one node, but any node"):
        place_added_engines(nodes, 4, 2)
    for caught in (ambiguous, unknown):
        assert "\n" not in str(caught.value) and "aaaa11 (10.0.0.1)" in str(caught.value)  # it lists the nodes


def test_plan_shows_where_added_engines_would_go_beyond_the_nodes_the_run_holds(capsys):
    from rllm.experimental.fully_async.cli import plan

    overrides = ["engines.num_engines=2", "trainer.n_gpus_per_node=2", "trainer.nnodes=2"]
    base = ["--config", str(GPU_CONFIG), "--gpus-per-node", "4", "--nodes", "3", *overrides]
    assert plan.main([*base, "--add-engines", "2"]) == 0
    out = capsys.readouterr().out
    added = [line for line in out.splitlines() if line.startswith("added engine")]
    assert added == [
        "added engine 2: node node-2 (NODE2_ADDRESS), 1 GPU(s) + 1 CPU in a placement group of its own",
        "added engine 3: node node-2 (NODE2_ADDRESS), 1 GPU(s) + 1 CPU in a placement group of its own",
    ]
    assert plan.main([*base, "--add-engines", "1", "--node", "node-0"]) == 1  # the run holds node 0 whole
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "plan --add-engines 1: added engine 1 of 1 needs 1 free GPU(s)" in err
    assert plan.main([*base, "--add-engines", "5"]) == 1  # node 2 has 4 GPUs
    assert "added engine 5 of 5" in capsys.readouterr().err


def test_plan_refuses_a_node_for_a_local_run_in_one_line(capsys):
    from rllm.experimental.fully_async.cli import plan

    assert plan.main(["--add-engines", "1", "--node", "abc"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "trainer.nnodes=1 is a local run" in err and "drop --node" in err
    assert plan.main(["--add-engines", "1"]) == 0
    assert "engines add 1: a local run (trainer.nnodes=1) starts them on its own host" in capsys.readouterr().out
    assert plan.main(["--node", "abc"]) == 2  # --node alone plans nothing
