"""The calculator tool task (tasks/calculator.py, config/tool_cpu.yaml): a tool call's result is appended as a
masked tool message in the task's own chat format, the answer after it is rewarded by the environment, and the
warm-up demonstrations train only the model's own turns."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from workflow_helpers import Datum, ScriptedClient

from rllm.experimental.fully_async.api.trajectory import TrajectoryStatus, VersionedGroup
from rllm.experimental.fully_async.core.batch import groups_to_dataproto
from rllm.experimental.fully_async.envs import EnvSpec
from rllm.experimental.fully_async.envs.product import ProductEnv
from rllm.experimental.fully_async.run_spec import build_run_spec
from rllm.experimental.fully_async.settings.loader import load_config
from rllm.experimental.fully_async.tasks import calculator as task
from rllm.experimental.fully_async.workers import WorkerPool
from rllm.experimental.fully_async.workflows import MultiTurnWorkflow, build_workflow

REPO = Path(__file__).resolve().parents[2]


def product_datum(tokenizer, a: int, b: int) -> Datum:
    return Datum("p0", tokenizer.encode(task.PROMPT), {"a": a, "b": b}, str(a * b), task.DATA_SOURCE)


@pytest.fixture(scope="module")
def tok():
    return task.build_tokenizer()


def test_the_calculator_turns_the_problem_into_a_copy_and_only_model_turns_train(tok):
    spec = build_run_spec(
        load_config(
            REPO / "config" / "tool_cpu.yaml",
            ["task.name=null", "data.train_files=x", "actor_rollout_ref.model.path=y"],
        )
    )
    agent = spec.executor.agent
    assert agent.env_name == "product" and dict(agent.tools) == {"c": "calculator"} and agent.tool_format == "compact"
    with WorkerPool(max_workers=1) as pool:
        workflow = build_workflow(spec.executor, None, pool)
        assert isinstance(workflow, MultiTurnWorkflow) and workflow.tools is not None
        client = ScriptedClient(tok, ["c[23*47]", "1081"])
        traj = asyncio.run(workflow.run(client, tok, product_datum(tok, 23, 47), 0))
    assert traj.status == TrajectoryStatus.OK and traj.reward == 1.0 and traj.step_rewards == [0.0, 1.0]
    assert tok.decode(client.calls[1]) == "Q23*47=c[23*47]<eos>>1081:"  # the tool result as a tool message
    assert traj.metadata["steps"][0]["tool"] is True and traj.metadata["end_reason"] == "done"
    data = groups_to_dataproto([VersionedGroup("p0", [traj])], pad_token_id=0, temperature=1.0)
    # two rows (turns); the tool result sits in the second row's prompt, never in a trained response
    assert data.batch["response_mask"].sum().item() == len("c[23*47]") + 1 + len("1081") + 1
    wrong = asyncio.run(
        MultiTurnWorkflow(EnvSpec(name="product"), {"max_new_tokens": 9}).run(
            ScriptedClient(tok, ["1234"]), tok, product_datum(tok, 23, 47), 0
        )
    )
    assert wrong.reward == 0.0 and wrong.metadata["end_reason"] == "done" and wrong.metadata["num_turns"] == 1


def test_product_env_and_demonstrations():
    env = ProductEnv()
    assert env.reset(0, {"a": 12, "b": 34}) == "12*34="
    assert env.step("408") == ("", 1.0, True, {"correct": True}) and env.step("4o8")[1] == 0.0
    rng = random.Random(0)
    demos = [task.demo_segments(12, 34, rng) for _ in range(200)]
    tool = [d for d in demos if len(d) == 4]
    assert 0.25 < len(tool) / len(demos) < 0.55  # DEMO_TOOL_P of them call the tool
    assert tool[0] == [("Q12*34=", False), ("c[12*34]<eos>", True), (">408:", False), ("408<eos>", True)]
    train, val = task.make_pairs(0)
    assert not set(train) & set(val) and len(val) == task.NUM_VAL
