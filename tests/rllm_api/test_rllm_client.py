"""rLLM's RolloutClient here (client.py): token ids in every form user code passes, tool calls parsed from
`chat_completion` and tool messages rendered back, versions, pause/resume, and the workflow adapter's one client.

The engine is scripted (it answers each request with the next text of its script, tokens tagged with versions);
the tokenizer is the tool world's real one (tests/helpers/rllm_tool_world.py: a Qwen-like chat template that renders
`tools=` and tool messages).
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from rllm_tool_world import TOOL_SCHEMA, build_tokenizer, messages_for, tool_call_text

from rllm.experimental.fully_async.api.token_ids import token_ids
from rllm.experimental.fully_async.api.trajectory import TrajectoryStatus
from rllm.experimental.fully_async.client import SAMPLE_UID, RolloutClient
from rllm.experimental.fully_async.data.prompts import PromptIterator, PromptRecord
from rllm.experimental.fully_async.engines.client import GenerationResult
from rllm.experimental.fully_async.protocol import OutputChunk, OutputWithVersion, Sequence, Trajectory
from rllm.experimental.fully_async.runtime.rollout.executor import ExecutorSettings, RolloutExecutor
from rllm.experimental.fully_async.runtime.rollout.message_queue import MessageQueue
from rllm.experimental.fully_async.tasks.addition import build_addition_tokenizer
from rllm.experimental.fully_async.workflows.rllm_compat import RllmRolloutWorkflow


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@dataclass
class ScriptedEngine:
    """Answers request i with the tokens of `replies[i]` + EOS, versions from `versions[i]` (default all 0)."""

    tokenizer: Any
    replies: list[str]
    versions: list[list[int]] | None = None
    requests: list[tuple[list[int], dict[str, Any], str | None]] = field(default_factory=list)

    async def generate(self, input_ids, sampling_params, *, rid=None) -> GenerationResult:
        turn = len(self.requests)
        self.requests.append((input_ids, sampling_params, rid))
        ids = [*self.tokenizer.encode(self.replies[turn], add_special_tokens=False), self.tokenizer.eos_token_id]
        versions = self.versions[turn] if self.versions else [0] * len(ids)
        return GenerationResult(ids, [-0.5] * len(ids), versions, "stop", len(set(versions)) - 1, len(input_ids))


# ---------------------------------------------------------------- token ids
def test_every_form_of_token_ids_user_code_passes_becomes_a_list_of_ints(tok):
    encoding = tok.apply_chat_template(messages_for(12, 34), add_generation_prompt=True, tokenize=True)
    ids = tok.apply_chat_template(messages_for(12, 34), add_generation_prompt=True, tokenize=True, return_dict=False)
    assert type(encoding).__name__ == "BatchEncoding" and list(encoding) == ["input_ids", "attention_mask"]
    forms = [
        encoding,  # transformers 5's tokenize=True
        ids,  # transformers 4.57's
        tuple(ids),
        np.array(ids),
        np.array([ids]),  # return_tensors="np": (1, n)
        torch.tensor(ids),
        torch.tensor([ids]),  # return_tensors="pt"
        {"input_ids": torch.tensor([ids])},  # return_tensors="pt", return_dict=True
        [ids],  # a batched call with one conversation
        [np.int64(i) for i in ids],
    ]
    for form in forms:
        converted = token_ids(form)
        assert converted == ids and all(type(t) is int for t in converted), type(form)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("12+34=", "generate: prompt_ids: got str '12+34=', not token ids"),
        ([1.0, 2.0], "generate: prompt_ids[0] is float 1.0, not a token id"),
        ([[1, 2], [3, 4]], "generate: prompt_ids: got a batch of 2 sequences"),
        ({"attention_mask": [1]}, "generate: prompt_ids: got a dict without 'input_ids' (keys 'attention_mask')"),
        (None, "generate: prompt_ids: got NoneType, not token ids"),
        ([True, 3], "generate: prompt_ids[0] is bool True"),
    ],
)
def test_anything_else_is_refused_in_one_line_naming_the_type(value, message):
    with pytest.raises(TypeError, match=re.escape(message)) as info:
        token_ids(value, "generate: prompt_ids")
    assert "\n" not in str(info.value)


def test_protocol_types_built_by_users_store_lists(tok):
    encoding = tok.apply_chat_template(messages_for(12, 34), add_generation_prompt=True, tokenize=True)
    seq = Sequence(encoding, np.array([5, 6]), [-0.1, -0.2], torch.tensor([1, 1]))
    assert seq.prompt_ids == encoding["input_ids"] and seq.response_ids == [5, 6]
    assert seq.input_ids == encoding["input_ids"] + [5, 6]
    out = OutputWithVersion(torch.tensor([[1, 2]]), [OutputChunk(np.array([3]), [-0.1], 2)])
    assert out.all_tokens() == [1, 2, 3] and out.to_sequence().response_versions == [2]
    with pytest.raises(TypeError, match=r"Sequence\.prompt_ids: got str"):
        Sequence("hello", [1], [0.0], [1])
    resized = Sequence([1, 2, 3, 4], [5], [-0.5], [1], start_version=1, response_versions=[2]).resize_prompt_length(2)
    assert (resized.prompt_ids, resized.response_ids, resized.response_masks) == ([1, 2], [3, 4, 5], [0, 0, 1])
    assert resized.response_logprobs == [0.0, 0.0, -0.5] and resized.response_versions == [1, 1, 2]


# ---------------------------------------------------------------- generate
def test_generate_takes_a_batch_encoding_and_returns_chunks_per_version(tok):
    engine = ScriptedEngine(tok, ["\\boxed{408}"], versions=[[0, 0, 0, 1, 1, 1]])
    client = RolloutClient(engine, tok)
    encoding = tok.apply_chat_template(messages_for(12, 34), add_generation_prompt=True, tokenize=True)

    async def one():
        token = SAMPLE_UID.set("e0/7/2")
        try:
            return await client.generate(encoding, {"max_tokens": 16, "temperature": 1.0})
        finally:
            SAMPLE_UID.reset(token)

    output = asyncio.run(one())
    sent_ids, sent_params, rid = engine.requests[0]
    assert sent_ids == encoding["input_ids"] and sent_params == {"max_new_tokens": 16, "temperature": 1.0}
    assert rid.startswith("e0/7/2-c")
    assert [(len(c.response_ids), c.version) for c in output.output_chunks] == [(3, 0), (3, 1)]
    assert output.response_text == "\\boxed{408}" and output.finish_reason == "stop"
    assert output.to_sequence().response_versions == [0, 0, 0, 1, 1, 1] and client.cur_version == 1
    client.set_version(4)
    assert client.cur_version == 4


# ---------------------------------------------------------------- chat_completion with tools
def test_a_tool_call_is_parsed_and_the_tool_message_renders_into_the_next_prompt(tok):
    engine = ScriptedEngine(tok, [tool_call_text(23, 47), "\\boxed{1081}"])
    client = RolloutClient(engine, tok, max_tokens=200)
    messages = messages_for(23, 47)

    async def episode():
        params = {"temperature": 1.0}
        message, first = await client.chat_completion(messages, sampling_params=params, tools=[TOOL_SCHEMA])
        (call,) = message["tool_calls"]
        result = str(json.loads(call["function"]["arguments"])["a"] * 47)
        tool_message = {"role": "tool", "tool_call_id": call["id"], "name": "multiply", "content": result}
        answer, second = await client.chat_completion([*messages, message, tool_message], tools=[TOOL_SCHEMA])
        return message, first, answer, second

    message, first, answer, second = asyncio.run(episode())
    assert message["content"] == "" and message["tool_calls"][0]["function"]["name"] == "multiply"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": 23, "b": 47}
    assert answer == {"role": "assistant", "content": "\\boxed{1081}"}
    first_prompt, second_prompt = engine.requests[0][0], engine.requests[1][0]
    assert engine.requests[0][1] == {"temperature": 1.0, "max_new_tokens": 200 - len(first_prompt)}
    # The next prompt extends the first turn token for token: the call rendered back as generated, then the result.
    assert second_prompt[: len(first.all_tokens())] == first.all_tokens()
    assert tok.decode(second_prompt[len(first.all_tokens()) :]).startswith(
        "<|im_start|>user\n<tool_response>1081</tool_response>"
    )
    assert Trajectory([first.to_sequence(), second.to_sequence()]).merge()[0].response_masks.count(0) > 0


def test_tools_without_a_known_call_format_and_an_exhausted_budget_are_refused(tok):
    client = RolloutClient(ScriptedEngine(tok, ["x"]), tok, max_tokens=10)
    with pytest.raises(ValueError, match="no room left under the client's max_tokens 10"):
        asyncio.run(client.chat_completion(messages_for(1, 2)))
    plain = build_addition_tokenizer()  # no model name, a template that writes no tool-call markup
    no_format = RolloutClient(ScriptedEngine(plain, ["12"]), plain)
    addition = [{"role": "user", "content": "1+2="}]
    with pytest.raises(ValueError, match="cannot tell which tool-call format"):
        asyncio.run(no_format.chat_completion(addition, tools=[TOOL_SCHEMA]))
    message, _ = asyncio.run(no_format.chat_completion(addition))  # without tools: plain content
    assert message == {"role": "assistant", "content": "12"}
    with pytest.raises(TypeError, match="router_url must be an engine URL"):
        RolloutClient(42, tok)


def test_while_paused_new_requests_wait_for_resume_and_a_long_pause_times_out(tok):
    engine = ScriptedEngine(tok, ["1", "2"])
    client = RolloutClient(engine, tok, pause_timeout_s=0.2)

    async def scenario():
        client.pause()
        waiting = asyncio.create_task(client.generate([3, 4], {"max_new_tokens": 2}))
        await asyncio.sleep(0.05)
        held = len(engine.requests)
        client.resume()
        await waiting
        client.pause()
        with pytest.raises(TimeoutError, match=r"stayed paused for 0\.2s; call client\.resume"):
            await client.generate([3, 4], {})
        return held

    assert asyncio.run(scenario()) == 0 and len(engine.requests) == 1


# ---------------------------------------------------------------- the adapter's one client
def test_all_rollouts_share_one_client_whose_version_the_executor_sets(tok):
    seen = []

    async def rollout_fn(client, tokenizer, **kwargs):
        seen.append((id(client), client.cur_version, client.max_tokens))
        output = await client.generate(tokenizer.apply_chat_template(kwargs["raw_prompt"], tokenize=True), {})
        return Trajectory([output.to_sequence()], reward=1.0)

    workflow = RllmRolloutWorkflow(rollout_fn, max_tokens=96)
    records = [PromptRecord(i, [5], messages_for(i, 2), "t", "0") for i in range(2)]
    executor = RolloutExecutor(
        ExecutorSettings(2, 1, 1, 8),
        PromptIterator(records, seed=0, num_epochs=1, shuffle=False),
        workflow,
        ScriptedEngine(tok, ["1"] * 4),
        tok,
        MessageQueue(10),
        version=3,
    )
    asyncio.run(asyncio.wait_for(executor.run(), 30))
    assert len(seen) == 4 and len({client_id for client_id, _, _ in seen}) == 1
    assert {(version, budget) for _, version, budget in seen} == {(3, 96)}
    executor.set_version(5)
    assert workflow.client_for(executor.client, tok).cur_version == 5
    assert all(t.status == TrajectoryStatus.OK for g in executor.queue.pop(2) for t in g.trajectories)
