"""rLLM-style rollout functions trained end to end through the CLI (`workflow.path=... workflow.name=...`), as
examples/agents/rllm_number_line.yaml plugs one in:

- a DAPO-style math function (tests/fixtures/rllm_programs/dapo_math.py) passing `apply_chat_template(...,
  tokenize=True)` straight to `client.generate` (a BatchEncoding under transformers 5), unbatched and in the
  batched-datum form, on the addition task;
- a multi-turn tool agent shaped like rLLM's deepresearch search agent (tests/fixtures/rllm_programs/tool_agent.py)
  on the tool world (tests/helpers/rllm_tool_world.py): chat_completion with `tools=`, tool calls parsed and executed,
  tool messages rendered back, several sequences per trajectory, merged into one training row where a turn extends
  the previous one token for token (as rLLM's trainer merges them).

Checked from the runs' own records (metrics, trajectory dumps, the tool's call log): every step trained, rewards
1 exactly where the answer is right, the tool really called with the arguments the model wrote and its result in
the next turn's prompt.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rllm_tool_world import EOS

from rllm.experimental.fully_async.client import choose_parser
from rllm.experimental.fully_async.message_utils import parse_response
from rllm.rewards.reward_types import RewardConfig, RewardInput
from rllm.rewards.search_reward import RewardSearchFn

REPO = Path(__file__).resolve().parents[2]
PROGRAMS = Path(__file__).resolve().parents[1] / "fixtures" / "rllm_programs"
STEPS = 3
ADDITION_WARMUP_STEPS = 340  # the default config's
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _train(command: list[str], root: Path, env: dict[str, str] | None = None) -> tuple[int, str, list[dict]]:
    env = dict(os.environ, RLLM_LOG_LEVEL="WARNING", PYTHONPATH=str(REPO), **(env or {}))
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=840)
    metrics = root / "run" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return proc.returncode, proc.stdout + proc.stderr, rows


def _dumped(directory: Path) -> list[dict]:
    return [json.loads(line) for p in sorted(directory.glob("*.jsonl")) for line in p.read_text().splitlines()]


COMMON = [
    f"trainer.total_training_steps={STEPS}",
    "trainer.test_freq=100",
    "trainer.val_before_train=false",
    "async_training.required_samples=8",
    "actor_rollout_ref.rollout.n=4",
    "engines.num_engines=1",
]


@pytest.fixture(scope="module")
def addition_default(tmp_path_factory) -> Path:
    """The addition task with the default config's warm-up (~44% held out): some sums come out right."""
    from rllm.experimental.fully_async.tasks.addition import prepare_addition_assets

    cache = tmp_path_factory.mktemp("addition_default")
    prepare_addition_assets(cache, seed=0, warmup_steps=ADDITION_WARMUP_STEPS)
    return cache


@pytest.mark.parametrize(("name", "batched"), [("rollout_fn", "false"), ("rollout_fn_batched", "true")])
def test_a_dapo_style_function_trains_with_tokenize_true_ids(tmp_path, addition_default, name, batched):
    command = [
        sys.executable,
        "-m",
        "rllm.experimental.fully_async",
        f"run.dir={tmp_path / 'run'}",
        f"task.cache_dir={addition_default}",
        f"task.warmup_steps={ADDITION_WARMUP_STEPS}",
        *COMMON,
        f"workflow.path={PROGRAMS / 'dapo_math.py'}",
        f"workflow.name={name}",
        f"workflow.rllm_batched={batched}",
        f"trainer.rollout_data_dir={tmp_path / 'dumps'}",
    ]
    code, output, rows = _train(command, tmp_path)
    assert code == 0, output[-3000:]
    assert len([r for r in rows if "trainer/step" in r]) == STEPS
    records = _dumped(tmp_path / "dumps")
    assert records and all(r["status"] == "ok" for r in records)
    for record in records:
        (seq,) = record["sequences"]
        # The ids the function rendered with tokenize=True reached the engine as the prompt "ab+cd=".
        assert len(seq["prompt_ids"]) == 6 and seq["prompt_text"][2] == "+" and seq["prompt_text"][5] == "="
        a, b = int(seq["prompt_text"][:2]), int(seq["prompt_text"][3:5])
        answer = "".join(seq["response_tokens"]).split("<eos>")[0]
        right = answer == f"{a + b:03d}"
        assert record["metadata"]["rllm"]["is_correct"] == right
        assert record["reward"] == 1.0 if right else record["reward"] <= 0.0, (answer, a + b, record["reward"])
    assert any(r["metadata"]["rllm"]["is_correct"] for r in records), "the warmed-up model answers some sums right"


@pytest.fixture(scope="module")
def tool_world(tmp_path_factory) -> tuple[Path, Path, Path]:
    from rllm_tool_world import prepare

    return prepare(tmp_path_factory.mktemp("tool_world"))


def test_a_deepresearch_shaped_tool_agent_calls_its_tool_and_trains(tmp_path, tool_world):
    from rllm_tool_world import build_tokenizer

    model_dir, train, val = tool_world
    log = tmp_path / "tool_calls.jsonl"
    command = [
        sys.executable,
        "-m",
        "rllm.experimental.fully_async",
        f"run.dir={tmp_path / 'run'}",
        "task.name=null",
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files={train}",
        f"data.val_files={val}",
        "data.max_prompt_length=64",
        "data.max_response_length=40",
        f"workflow.path={PROGRAMS / 'tool_agent.py'}",
        "workflow.name=rollout_fn",
        f"trainer.rollout_data_dir={tmp_path / 'dumps'}",
        *COMMON,
    ]
    code, output, rows = _train(command, tmp_path, {"RLLM_TEST_TOOL_LOG": str(log)})
    assert code == 0, output[-3000:]
    assert len([r for r in rows if "trainer/step" in r]) == STEPS
    records = [r for r in _dumped(tmp_path / "dumps") if r["status"] == "ok"]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls and all(c["result"] == str(c["a"] * c["b"]) for c in calls)
    assert {c["pid"] for c in calls} != {os.getpid()}  # it ran in the rollout service, not here
    tok = build_tokenizer()
    called = [r for r in records if r["metadata"]["rllm"]["total_tool_calls"] > 0]
    assert called, "no trained episode called the tool"
    canonical_replies = 0
    for record in called:
        if record["metadata"]["rllm"]["overlong"]:
            # The agent's rule (deepresearch's): an episode cut short (here: a long tool error left no room under
            # the client's max_tokens, so chat_completion raised) trains none of its tokens.
            assert not any(m for seq in record["sequences"] for m in seq["loss_mask"])
            continue
        reply, shown_next, next_trained, merged = _first_turn(tok, record)
        # The model's call, parsed and executed: the next turn's input is this turn's conversation, then the tool's
        # result. chat_completion re-renders the messages each turn (as rLLM's client does): a reply that is one
        # well-formed call, spelled as the tokenizer spells it, comes back token for token, so the next turn extends
        # this one and rLLM's Trajectory.merge() makes them one training row (the tool's result in it with mask 0);
        # anything else (a sampled model now and then writes a stray "</tool_call>" after its call, spells a piece
        # byte by byte, or writes `"a":7` where the parsed arguments render back as `"a": 7`) comes back as the
        # template renders the parsed message: a row of its own.
        text = tok.decode(reply, skip_special_tokens=False)
        if _renders_back(tok, text) and tok.encode(text, add_special_tokens=False) == reply:
            canonical_replies += 1
            assert merged, "a turn its successor extends token for token is merged into one row"
        call_text = tok.decode(reply, skip_special_tokens=True)
        args = json.loads(call_text.split("<tool_call>")[1].split("</tool_call>")[0])["arguments"]
        valid = set(args) == {"a", "b"} and all(type(v) is int for v in args.values())  # the tool's own rule
        result = str(args["a"] * args["b"]) if valid else "Error:"
        assert f"<tool_response>{result}" in shown_next
        assert next_trained  # the answer turn is trained
    scored = 0
    for record in records:
        question = record["sequences"][0]["prompt_text"].split("user\n")[1].split("<|im_end|>")[0]
        a, b = (int(x) for x in question.split("*"))
        reply = _final_reply(tok, record)
        if reply is None:
            continue
        # deepresearch's reward is the token F1 of the answer RewardSearchFn extracts from the last assistant message
        # (its first \boxed{}, else its first number, ...): "6, b: 2" against 6 is 0.5; an unboxed "9" against 9 is 1.
        output = RewardSearchFn(RewardConfig())(RewardInput(task_info={"ground_truth": str(a * b)}, action=reply))
        assert record["reward"] == pytest.approx(output.metadata.get("f1_score", 0.0) if reply else 0.0), reply
        scored += 1
    assert scored, "no episode's last reply was in its rows to score again"
    assert any(r["reward"] == 1.0 for r in called), "no episode copied the tool's result into its answer"
    assert canonical_replies, (
        "no tool-calling reply was spelled as the tokenizer spells it: nothing compared token for token"
    )
    rows = [r["metadata"]["rllm_rows"] for r in records]
    assert all(len(r["sequences"]) == c["rows"] <= c["sequences"] for r, c in zip(records, rows, strict=True))
    assert any(c["rows"] < c["sequences"] for c in rows), "no trajectory's turns were merged into one row"


def _final_reply(tok, record: dict) -> str | None:
    """The last assistant message's content as the agent scored it: the last run of trained tokens of the last row,
    parsed as the client parses a reply. None when it is not all there (the row cut at data.max_response_length,
    or the episode cut short, its tokens untrained)."""
    if record["metadata"]["rllm_rows"]["response_tokens_cut"] or record["metadata"]["rllm"]["overlong"]:
        return None
    last = record["sequences"][-1]
    mask, ids = last["loss_mask"], last["response_ids"]
    start = len(mask)  # the trailing run of trained tokens; none when the last reply was empty
    while start > 0 and mask[start - 1] == 1:
        start -= 1
    return parse_response(tok, choose_parser(tok), ids[start:])["content"]


def _renders_back(tok, text: str) -> bool:
    """Is `text` (a reply) one call that the chat template renders back exactly as written, once parsed as rLLM's
    Qwen parser parses it (json.loads of the body; the arguments dumped again by json.dumps)?"""
    match = re.fullmatch(r"<tool_call>([^<]*)</tool_call>" + re.escape(EOS), text)
    if match is None:
        return False
    try:
        call = json.loads(match.group(1).strip())
    except json.JSONDecodeError:
        return False
    if not isinstance(call, dict) or not {"name", "arguments"} <= set(call) or not isinstance(call["arguments"], dict):
        return False
    function = {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}
    message = {"role": "assistant", "content": "", "tool_calls": [{"function": function}]}
    return tok.apply_chat_template([message], tokenize=False) == f"<|im_start|>assistant\n{text}"


def _first_turn(tok, record: dict) -> tuple[list[int], str, bool, bool]:
    """(the first reply's ids, the text the model was shown next, whether the next reply is trained, merged?): from
    one merged row (reply, then the tool message with mask 0, then the next reply) or from two rows."""
    first = record["sequences"][0]
    mask, ids = first["loss_mask"], first["response_ids"]
    end = mask.index(0) if 0 in mask else len(mask)
    if end < len(mask):
        resume = end + (mask[end:].index(1) if 1 in mask[end:] else len(mask) - end)
        return ids[:end], tok.decode(ids[end:resume], skip_special_tokens=False), any(mask[resume:]), True
    second = record["sequences"][1]
    return ids, second["prompt_text"], any(second["loss_mask"]), False
