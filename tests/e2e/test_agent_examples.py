"""The runnable agent examples (examples/agents/): their YAMLs load and build their workflows, and each piece (an
environment, a step reward, a tool, a workflow class) runs through the real workflow and worker pool."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from workflow_helpers import ScriptedClient, datum

from rllm.experimental.fully_async.api.trajectory import TrajectoryStatus
from rllm.experimental.fully_async.run_spec import build_run_spec
from rllm.experimental.fully_async.settings.loader import load_config
from rllm.experimental.fully_async.tasks.number_line import build_tokenizer
from rllm.experimental.fully_async.workers import WorkerPool
from rllm.experimental.fully_async.workflows import IsolatedReward, MultiTurnWorkflow, build_workflow, load_reward_fn
from rllm.experimental.fully_async.workflows.rllm_compat import RllmRolloutWorkflow
from rllm.experimental.fully_async.workflows.tools import ToolBox, ToolInvocation

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "agents"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(max_workers=1) as p:
        yield p


@pytest.fixture()
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the example YAMLs name their files relative to the repository root


def test_the_example_env_and_step_reward_play_an_episode_in_the_worker_pool(in_repo, tok, pool):
    cfg = load_config(EXAMPLES / "agent.yaml")
    spec = build_run_spec(cfg)
    assert spec.executor.agent.env_name == "CostlyLine" and spec.trainer.advantages.adv_estimator == "gigpo"
    reward = load_reward_fn(spec.executor, pool)
    assert isinstance(reward, IsolatedReward)
    workflow = build_workflow(spec.executor, reward, pool)
    assert isinstance(workflow, MultiTurnWorkflow) and workflow.reward_fn is reward
    traj = asyncio.run(workflow.run(ScriptedClient(tok, ["+3", "-1", "+2"]), tok, datum(tok, 3, 7), 0))
    assert traj.status == TrajectoryStatus.OK and traj.metadata["end_reason"] == "done"
    # 3 -> 6 (closer), -> 5 (away), -> 7 (arrived): the example reward's progress shaping, per turn
    assert traj.step_rewards == pytest.approx([0.2, -0.2, 1.2]) and traj.reward == 1.0
    assert [s["reward"] for s in traj.metadata["steps"]] == pytest.approx([-0.1, -0.1, 0.9])  # the env's own


def test_the_example_tool_answers_through_the_pool(tok, pool):
    tools = ToolBox({"distance": f"{EXAMPLES / 'my_tool.py'}:distance"}, format="compact", timeout_s=10.0)
    call = tools.parse("distance[3>7]")
    assert call == ToolInvocation("distance", ("3>7",))
    assert asyncio.run(tools.run(call, pool)) == "4"
    assert asyncio.run(tools.run(ToolInvocation("distance", ("x",)), pool)).startswith("error: ValueError")


def test_the_example_workflow_class_and_rllm_function_load_by_path(in_repo, tok):
    cfg = load_config(
        None,
        [f"workflow.path={EXAMPLES / 'my_workflow.py'}", "workflow.name=BestOfTwo", "task.name=number_line"],
    )

    def exact(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str == "+3")

    workflow = build_workflow(build_run_spec(cfg).executor, exact)
    traj = asyncio.run(workflow.run(ScriptedClient(tok, ["+1", "+3"]), tok, datum(tok, 3, 7), 0))
    assert traj.status == TrajectoryStatus.OK and len(traj.sequences) == 2 and traj.reward == 1.0
    rllm = build_workflow(build_run_spec(load_config(EXAMPLES / "rllm_number_line.yaml")).executor, None)
    # its client's chat budget is the run's prompt + response lengths (4 + 3), as rLLM's executor sets it
    assert isinstance(rllm, RllmRolloutWorkflow) and rllm.max_tokens == 7
