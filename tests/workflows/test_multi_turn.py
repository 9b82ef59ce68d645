"""The multi-turn workflow with a scripted client: token bookkeeping, spans, end reasons, tools, isolation."""

from __future__ import annotations

import asyncio

import pytest
from workflow_helpers import ScriptedClient, datum

from rllm.experimental.fully_async.api.trajectory import TrajectoryStatus, VersionedGroup
from rllm.experimental.fully_async.core.batch import groups_to_dataproto
from rllm.experimental.fully_async.envs import EnvSpec, state_hash
from rllm.experimental.fully_async.tasks.number_line import build_tokenizer
from rllm.experimental.fully_async.workers import WorkerPool
from rllm.experimental.fully_async.workflows.multi_turn import MultiTurnWorkflow
from rllm.experimental.fully_async.workflows.tools import ToolBox, calculator, parse_tool_call


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def run(workflow, client, tok, d, index=0):
    return asyncio.run(workflow.run(client, tok, d, index))


def test_turns_are_appended_token_by_token_with_spans_rewards_and_state_hashes(tok):
    workflow = MultiTurnWorkflow(EnvSpec(name="number_line", max_turns=4), {"max_new_tokens": 3})
    client = ScriptedClient(tok, ["+3", "+1"], versions=[[0, 0, 1], [1, 1, 1]])
    traj = run(workflow, client, tok, datum(tok))
    text = tok.decode(client.calls[1])
    assert text == "N3>7:+3<eos>6>7:"  # the model's own ids (EOS included) followed by the observation's
    assert traj.status == TrajectoryStatus.OK and traj.metadata["end_reason"] == "done"
    assert [len(s.prompt_ids) for s in traj.sequences] == [5, 12]
    assert traj.sequences[0].response_versions == [0, 0, 1] and traj.sequences[0].num_resumes == 1
    assert traj.sequences[1].response_logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert traj.step_rewards == [0.0, 1.0] and traj.reward == 1.0
    assert traj.step_state_hashes == [state_hash("3>7:"), state_hash("6>7:")]
    steps = traj.metadata["steps"]
    assert [(s["start"], s["end"], s["obs_end"]) for s in steps] == [(5, 8, 12), (12, 15, 15)]


def test_max_turns_and_length_end_reasons(tok):
    workflow = MultiTurnWorkflow(EnvSpec(name="number_line", max_turns=2), {"max_new_tokens": 3})
    traj = run(workflow, ScriptedClient(tok, ["-1", "-1"]), tok, datum(tok))
    assert traj.metadata["end_reason"] == "max_turns" and traj.step_rewards == [0.0, 0.0]
    assert traj.status == TrajectoryStatus.OK and len(traj.sequences) == 2
    # 5 prompt tokens + 3 + 4 observation = 12, then only 2 tokens of budget left: the turn is cut, then length.
    short = MultiTurnWorkflow(EnvSpec(name="number_line", max_turns=5, max_total_tokens=14), {"max_new_tokens": 3})
    traj = run(short, ScriptedClient(tok, ["-1", "-1", "-1"]), tok, datum(tok))
    assert traj.metadata["end_reason"] == "length"
    assert len(traj.sequences[1].response_ids) == 2 and traj.sequences[1].finish_reason == "length"


def test_concat_layout_masks_observations_and_keeps_versions(tok):
    workflow = MultiTurnWorkflow(EnvSpec(name="number_line"), {"max_new_tokens": 3}, layout="concat")
    traj = run(workflow, ScriptedClient(tok, ["+3", "+1"], versions=[[0, 0, 1], [1, 2, 2]]), tok, datum(tok))
    (seq,) = traj.sequences
    assert tok.decode(seq.prompt_ids) == "N3>7:" and tok.decode(seq.response_ids) == "+3<eos>6>7:+1<eos>"
    assert seq.loss_mask == [1, 1, 1, 0, 0, 0, 0, 1, 1, 1]
    assert seq.response_versions == [0, 0, 1, 1, 1, 1, 1, 1, 2, 2]
    assert traj.step_rewards == [1.0] and seq.min_version == 0


def test_group_rows_share_state_hashes_where_states_repeat(tok):
    workflow = MultiTurnWorkflow(EnvSpec(name="number_line"), {"max_new_tokens": 3})
    scripts = [["+3", "+1"], ["+1", "+2", "+1"], ["-1", "+3", "+2"]]
    trajs = [run(workflow, ScriptedClient(tok, s), tok, datum(tok), i) for i, s in enumerate(scripts)]
    data = groups_to_dataproto([VersionedGroup("p0", trajs)], pad_token_id=0, temperature=1.0)
    hashes = list(data.non_tensor_batch["state_hash"])
    assert len(hashes) == 8
    assert hashes.count(state_hash("3>7:")) == 3  # every trajectory's first step
    assert hashes.count(state_hash("6>7:")) == 2  # reached by "+3" and by "+1,+2"
    # The step reward sits on the last response token of the step that reached the target.
    rewards = data.batch["token_level_rewards"].sum(-1).tolist()
    assert rewards == [0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0]


HANGING_ENV = """
import time
class Stuck:
    def reset(self, seed, task):
        return "s"
    def step(self, action):
        time.sleep(3600)
"""


def test_hung_env_step_fails_the_trajectory_with_its_reason(tok, tmp_path):
    (tmp_path / "stuck.py").write_text(HANGING_ENV)
    spec = EnvSpec(name="Stuck", path=str(tmp_path / "stuck.py"), step_timeout_s=1.0)
    with WorkerPool(max_workers=1) as pool:
        workflow = MultiTurnWorkflow(spec, {"max_new_tokens": 3}, pool=pool)
        traj = run(workflow, ScriptedClient(tok, ["+1"]), tok, datum(tok))
    assert traj.status == TrajectoryStatus.FAILED
    assert traj.metadata["end_reason"] == "timeout"
    assert traj.failure_reason.startswith("env_timeout: env step did not return within 1s")


def test_calculator_and_call_formats():
    assert calculator("12*34") == "408" and calculator("(7-2)/2") == "2.5" and calculator("-3+10//4") == "-1"
    with pytest.raises(ValueError):
        calculator("__import__('os')")
    with pytest.raises(ValueError):
        calculator("9**999")
    call = parse_tool_call(
        'x <tool_call>{"name": "calc", "arguments": {"expression": "1+2"}}</tool_call>', "hermes", {"calc"}
    )
    assert call.name == "calc" and call.kwargs == {"expression": "1+2"}
    assert parse_tool_call("c[12*3]", "compact", {"c"}).args == ("12*3",)
    assert parse_tool_call("d[12*3]", "compact", {"c"}) is None


HANGING_TOOL = """
import time
def slow(expression):
    time.sleep(3600)
"""


def test_tool_result_is_appended_as_a_masked_message_and_a_hung_tool_is_killed(tok, tmp_path):
    (tmp_path / "slow_tool.py").write_text(HANGING_TOOL)
    tools = ToolBox({"c": "calculator", "s": f"{tmp_path / 'slow_tool.py'}:slow"}, format="compact", timeout_s=1.0)
    with WorkerPool(max_workers=1) as pool:
        workflow = MultiTurnWorkflow(EnvSpec(name="number_line"), {"max_new_tokens": 8}, pool=pool, tools=tools)
        client = ScriptedClient(tok, ["c[7-3]", "+3", "+1"])
        # "c", "[" and "]" are not in the number-line vocabulary: the tool call is scripted as text via <unk>;
        # parse the decoded text through a tokenizer-independent stub instead.
        client.tokenizer = _TextTokenizer(tok)
        traj = run(workflow, client, client.tokenizer, datum(tok))
        assert traj.metadata["steps"][0]["tool"] is True and traj.step_rewards == [0.0, 0.0, 1.0]
        assert client.tokenizer.decode(client.calls[1]).endswith("c[7-3]<eos>4")  # the tool's answer, appended
        assert traj.step_state_hashes[0] == state_hash("3>7:")
        assert traj.step_state_hashes[1] not in (traj.step_state_hashes[0], traj.step_state_hashes[2])
        hung = run(workflow, ScriptedClient(_TextTokenizer(tok), ["s[1]"]), _TextTokenizer(tok), datum(tok))
    assert hung.status == TrajectoryStatus.FAILED and hung.failure_reason.startswith("tool_timeout: tool s")


class _TextTokenizer:
    """The number-line tokenizer extended with a private id per extra character (tool calls need 'c[]')."""

    def __init__(self, base):
        self.base = base
        self.extra = {c: 100 + i for i, c in enumerate("cs[]")}
        self.eos_token_id = base.eos_token_id

    def encode(self, text, add_special_tokens=False):
        return [self.extra[c] if c in self.extra else self.base.convert_tokens_to_ids(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        back = {v: k for k, v in self.extra.items()}
        return "".join(back.get(i) or self.base.decode([i], skip_special_tokens=skip_special_tokens) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, return_dict=False):
        text = "".join(m["content"] for m in messages)
        return self.encode(text) if tokenize else text


def test_rllm_client_splits_chunks_by_version_and_merge_masks_the_gap(tok):
    from rllm.experimental.fully_async.client import RolloutClient
    from rllm.experimental.fully_async.protocol import Trajectory as RllmTrajectory
    from rllm.experimental.fully_async.workflows.rllm_compat import RllmRolloutWorkflow

    async def rollout_fn(client, tokenizer, **kwargs):
        first = await client.generate(kwargs["prompt_ids"], {"max_tokens": 3})
        assert [c.version for c in first.output_chunks] == [0, 1] and client.cur_version == 1
        second = await client.generate(first.all_tokens() + tokenizer.encode("6>7:"), {"max_new_tokens": 3})
        traj = RllmTrajectory(sequences=[first.to_sequence(), second.to_sequence()], reward=1.0, metadata={"k": 1})
        traj.sequences = traj.merge()
        return traj

    client = ScriptedClient(tok, ["+3", "+1"], versions=[[0, 0, 1], [1, 1, 1]])
    t = run(RllmRolloutWorkflow(rollout_fn), client, tok, datum(tok))
    assert t.status == TrajectoryStatus.OK and t.reward == 1.0 and t.metadata["rllm"] == {"k": 1}
    (seq,) = t.sequences
    assert tok.decode(seq.response_ids) == "+3<eos>6>7:+1<eos>"
    assert seq.loss_mask == [1, 1, 1, 0, 0, 0, 0, 1, 1, 1]
    assert seq.response_versions == [0, 0, 1, 1, 1, 1, 1, 1, 1, 1]
    assert RolloutClient(client, tok).cur_version == 0

    async def broken(client, tokenizer, **kwargs):
        raise KeyError("raw_prompt")

    failed = run(RllmRolloutWorkflow(broken), client, tok, datum(tok))
    assert (
        failed.status == TrajectoryStatus.FAILED and failed.failure_reason == "rollout_fn_error: KeyError: 'raw_prompt'"
    )
