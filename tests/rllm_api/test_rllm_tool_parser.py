"""rLLM's tool parsers and its assistant-message shape, against model outputs written by hand in each format.

What rLLM's agents read (examples/fully_async/deepresearch/search_agent.py): `message.get("tool_calls", [])`,
`call["id"]`, `call["function"]["name"]`, `json.loads(call["function"]["arguments"])`, and `content` without the
call markup. Malformed calls are skipped, never raised.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rllm.experimental.fully_async.client import choose_parser
from rllm.experimental.fully_async.message_utils import (
    build_tool_message,
    extract_thinking,
    parse_response,
    strip_tool_markup,
)
from rllm.parser import PARSER_REGISTRY, get_tool_parser
from rllm.parser.tool_parser import QwenToolParser, R1ToolParser, ToolParser
from rllm.tools.tool_base import ToolCall, ToolOutput

R1_CALLS_BEGIN, R1_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
R1_BEGIN, R1_END, R1_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


class TextTokenizer:
    """Decodes a "token id" list that is really a list of characters: parse_response decodes ids first."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(ids)


def message_for(text: str, parser) -> dict:
    return parse_response(TextTokenizer(), parser, list(text))


def r1_call(name: str, args: str, fence: str = "```json\n") -> str:
    return f"{R1_BEGIN}function{R1_SEP}{name}\n{fence}{args}\n```{R1_END}"


# ---------------------------------------------------------------- Qwen / Hermes
QWEN_SEARCH = (
    "I should look this up.\n<tool_call>\n"
    '{"name": "local_search", "arguments": {"query": "Eiffel Tower height"}}\n</tool_call>'
)


def test_qwen_call_becomes_an_openai_tool_call_and_leaves_the_content():
    message = message_for(QWEN_SEARCH, QwenToolParser())
    assert message["role"] == "assistant" and message["content"] == "I should look this up."
    (call,) = message["tool_calls"]
    assert call["id"] == "call_0" and call["type"] == "function" and call["function"]["name"] == "local_search"
    assert json.loads(call["function"]["arguments"]) == {"query": "Eiffel Tower height"}


def test_qwen_parallel_calls_keep_their_order_and_ids():
    text = "".join(
        f'<tool_call>{{"name": "multiply", "arguments": {{"a": {a}, "b": 2}}}}</tool_call>' for a in (3, 5, 7)
    )
    message = message_for(text, QwenToolParser())
    assert [c["id"] for c in message["tool_calls"]] == ["call_0", "call_1", "call_2"]
    assert [json.loads(c["function"]["arguments"])["a"] for c in message["tool_calls"]] == [3, 5, 7]
    assert message["content"] == ""


def test_qwen3_thinking_stays_in_the_content_as_rllm_keeps_it():
    text = "<think>\nI need the population.\n</think>\n\n" + QWEN_SEARCH.split("\n", 1)[1]
    message = message_for(text, QwenToolParser())
    assert message["content"] == "<think>\nI need the population.\n</think>"
    assert len(message["tool_calls"]) == 1
    assert extract_thinking(message["content"]) == ("I need the population.", "")


def test_malformed_qwen_calls_are_skipped_and_the_good_ones_kept():
    bad_json = '<tool_call>{"name": "local_search", "arguments": {"query": "x"</tool_call>'
    not_a_call = '<tool_call>{"name": "local_search"}</tool_call>'  # rLLM raises KeyError here: skipped instead
    a_list = "<tool_call>[1, 2]</tool_call>"
    good = '<tool_call>{"name": "local_search", "arguments": {"query": "y"}}</tool_call>'
    message = message_for(f"a {bad_json} b {not_a_call} {a_list} c {good}", QwenToolParser())
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"query": "y"}]
    assert message["content"] == "a  b   c"  # every delimited call leaves the content, malformed ones too


def test_an_unclosed_qwen_call_is_no_call_and_stays_in_the_content():
    text = 'Let me search <tool_call>{"name": "local_search", "arguments": {"query": "cut off'
    message = message_for(text, QwenToolParser())
    assert "tool_calls" not in message and message["content"] == text


def test_string_arguments_pass_through_and_non_ascii_is_kept():
    text = (
        '<tool_call>{"name": "f", "arguments": "{\\"city\\": \\"Z\\u00fcrich\\"}"}</tool_call>'
        '<tool_call>{"name": "g", "arguments": {"city": "Zürich"}}</tool_call>'
    )
    first, second = message_for(text, QwenToolParser())["tool_calls"]
    assert first["function"]["arguments"] == '{"city": "Zürich"}'  # a string is kept as the model wrote it
    assert second["function"]["arguments"] == '{"city": "Zürich"}'  # a dict is dumped without ASCII escapes


def test_plain_text_has_no_tool_calls_key():
    assert message_for("The answer is \\boxed{42}.", QwenToolParser()) == {
        "role": "assistant",
        "content": "The answer is \\boxed{42}.",
    }


# ---------------------------------------------------------------- R1
def test_r1_calls_are_parsed_and_all_markup_leaves_the_content():
    text = (
        "Checking both.\n"
        + R1_CALLS_BEGIN
        + r1_call("get_weather", '{"city": "Paris"}')
        + "\n"
        + r1_call("get_time", '{"tz": "CET"}', fence="```json")
        + R1_CALLS_END
    )
    message = message_for(text, R1ToolParser())
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    assert json.loads(message["tool_calls"][1]["function"]["arguments"]) == {"tz": "CET"}
    assert message["content"] == "Checking both."  # rLLM leaves the outer calls_begin/end markers: removed here


def test_malformed_r1_calls_are_skipped():
    no_prefix = f"{R1_BEGIN}get_weather\n```json\n{{}}\n```{R1_END}"
    no_fence = f'{R1_BEGIN}function{R1_SEP}get_weather\n{{"city": "Paris"}}{R1_END}'
    bad_json = r1_call("get_weather", '{"city": ')
    good = r1_call("get_time", '{"tz": "UTC"}')
    calls = R1ToolParser().parse(no_prefix + no_fence + bad_json + good)
    assert calls == [ToolCall(name="get_time", arguments={"tz": "UTC"})]


# ---------------------------------------------------------------- choosing the parser
@pytest.mark.parametrize(
    ("name", "cls", "expected"),
    [
        ("Qwen/Qwen3-8B", "Qwen2TokenizerFast", QwenToolParser),
        ("/ckpt/my-model", "Qwen2Tokenizer", QwenToolParser),  # the class name decides
        ("agentica-org/DeepSWE-Preview", "TokenizersBackend", QwenToolParser),
        ("deepseek-ai/DeepSeek-R1-Distill-Llama-8B", "LlamaTokenizerFast", R1ToolParser),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "Qwen2TokenizerFast", QwenToolParser),  # not a Llama class
    ],
)
def test_rllm_picks_the_parser_by_tokenizer_name_and_class(name, cls, expected):
    tokenizer = type(cls, (), {"name_or_path": name, "chat_template": None})()
    assert type(ToolParser.get_parser(tokenizer)) is expected
    assert type(choose_parser(tokenizer)) is expected


def test_other_names_raise_in_rllm_and_fall_back_to_the_chat_templates_markup_here():
    plain = type("TokenizersBackend", (), {"name_or_path": "meta-llama/Llama-3.1-8B", "chat_template": "{{ x }}"})
    with pytest.raises(ValueError, match=r"No tool parser found for meta-llama/Llama-3\.1-8B"):
        ToolParser.get_parser(plain())
    assert choose_parser(plain()) is None
    hermes = SimpleNamespace(name_or_path="/tmp/model", chat_template="... <tool_call>\n{{ tool_call }} ...")
    r1 = SimpleNamespace(name_or_path="/tmp/model", chat_template={"default": f"... {R1_BEGIN} ..."})
    assert isinstance(choose_parser(hermes), QwenToolParser) and isinstance(choose_parser(r1), R1ToolParser)


def test_registry_markup_helpers_and_value_types():
    assert get_tool_parser("qwen") is QwenToolParser and set(PARSER_REGISTRY) == {"qwen", "r1"}
    with pytest.raises(ValueError, match="'hermes' not found"):
        get_tool_parser("hermes")
    assert "<tool_call>" in QwenToolParser().get_tool_prompt('{"name": "f"}')
    assert strip_tool_markup(None, "  x ") == "x"
    tool_message = build_tool_message("f", "4", "call_0")
    assert tool_message == {"role": "tool", "name": "f", "content": "4", "tool_call_id": "call_0"}
    assert str(ToolOutput(name="f", output={"a": 1})) == '{"a": 1}'
    assert str(ToolOutput("f", error="boom")) == "Error: boom"
