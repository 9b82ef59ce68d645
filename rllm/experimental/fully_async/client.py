"""rLLM's `RolloutClient` (rllm-org/rllm, `rllm/experimental/fully_async/client.py`) over this project's engine client.

What a rollout function gets as `client`, with rLLM's names and meanings:

- `await client.generate(prompt_ids, sampling_params) -> OutputWithVersion`: SGLang sampling parameters
  (`max_tokens` is taken as `max_new_tokens`). A generation that a weight sync interrupts is continued on the new
  weights (the engine client's resumable generation, engines/resumable.py), so the output holds one
  `OutputChunk` per run of tokens of one policy version; every token's version is the one the engine reported
  for it (rLLM stamps its own `cur_version` instead).
- `await client.chat_completion(messages, sampling_params=None, tools=None) -> (message, output)`: the
  tokenizer's chat template renders `messages` (tool messages included) with `tools=`, the model generates up to
  `max_tokens - len(prompt)` new tokens unless the parameters say otherwise, and the text becomes an assistant
  message with its tool calls parsed (message_utils.parse_response: `content` without the markup, `tool_calls`
  in OpenAI's shape).
- `client.cur_version` / `set_version(v)`: the policy version the engines serve. The rollout service sets it when
  the trainer's version reaches it (workflows/rllm_compat.py), and a generation that comes back with newer
  tokens raises it.
- `client.max_tokens` (prompt + response budget of `chat_completion`: rLLM's executor sets
  `data.max_prompt_length + data.max_response_length`, as the adapter does here), `client.tokenizer`,
  `client.parser` (the tool parser), `client.max_concurrency`.
- `pause()` / `resume()`: while paused, new `generate` calls wait (up to `pause_timeout_s`, then TimeoutError).
  rLLM's executor pauses its client around a weight sync; here nothing needs to, because the engines hold new
  requests themselves while a sync pauses them, so the methods are there for code that calls them.
- `RolloutClient("http://127.0.0.1:30000", tokenizer)` (rLLM's `router_url`): a client of its own over an engine
  speaking SGLang's native API (an embedded engine or SGLang), for a script outside a training run; `close()`.

Token ids enter as a list, tuple, numpy array, torch tensor or `BatchEncoding` (api/token_ids.py); transformers 5's
`apply_chat_template(..., tokenize=True)` returns the latter.

Which tool-call format: rLLM's choice by tokenizer name (rllm.parser.tool_parser); for a tokenizer named otherwise
(a local folder, a tokenizer built in code), the format its chat template writes (`<tool_call>`: Qwen;
`<｜tool▁call▁begin｜>`: R1). rLLM raises when the name decides nothing; here `chat_completion` raises only when
`tools=` is passed and neither the name nor the template decides (without tools there is nothing to parse).
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
from collections.abc import Mapping
from typing import Any

from rllm.experimental.fully_async.api.token_ids import token_ids
from rllm.experimental.fully_async.engines.client import EngineClient
from rllm.experimental.fully_async.message_utils import parse_response
from rllm.experimental.fully_async.protocol import OutputChunk, OutputWithVersion
from rllm.parser.tool_parser import QwenToolParser, R1ToolParser, ToolParser

# The sample a coroutine is generating for, so the engine requests of one rollout carry its id (set by the
# adapter around each rollout function call; asyncio tasks inherit it).
SAMPLE_UID: contextvars.ContextVar[str | None] = contextvars.ContextVar("rllm_sample_uid", default=None)

DEFAULT_MAX_TOKENS = 32768  # rLLM's default, replaced by the run's prompt + response budget in a training run


class RolloutClient:
    """rLLM's rollout client over an engine client (module docstring)."""

    def __init__(
        self,
        router_url: Any,
        tokenizer: Any = None,
        max_concurrency: int = 4096,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        *,
        pause_timeout_s: float = 600.0,
    ) -> None:
        if isinstance(router_url, str):
            self.router_url: str | None = router_url.rstrip("/")
            self.engine: Any = EngineClient([self.router_url], max_connections=max_concurrency)
            self._owns_engine = True
        elif callable(getattr(router_url, "generate", None)):
            self.router_url, self.engine, self._owns_engine = None, router_url, False
        else:
            raise TypeError(
                f"RolloutClient: router_url must be an engine URL (str) or an engine client with generate(), "
                f"got {type(router_url).__name__}"
            )
        self.tokenizer = tokenizer
        self.cur_version = 0
        self.max_tokens = max_tokens
        self.pause_timeout_s = pause_timeout_s
        self.resume_event = asyncio.Event()
        self.resume_event.set()
        self._max_concurrency = max_concurrency
        self._parser: ToolParser | None = None
        self._parser_chosen = False
        self._calls = itertools.count()

    @property
    def max_concurrency(self) -> int:
        return self._max_concurrency

    @property
    def parser(self) -> ToolParser | None:
        """The tool parser for this tokenizer's model, chosen on first use (module docstring); settable."""
        if not self._parser_chosen:
            self._parser, self._parser_chosen = choose_parser(self.tokenizer), True
        return self._parser

    @parser.setter
    def parser(self, parser: ToolParser | None) -> None:
        self._parser, self._parser_chosen = parser, True

    def set_version(self, version: int) -> None:
        self.cur_version = int(version)

    def pause(self) -> None:
        self.resume_event.clear()

    def resume(self) -> None:
        self.resume_event.set()

    async def close(self) -> None:
        """Close the engine client this client opened itself (a URL was given); a shared one is left open."""
        if self._owns_engine:
            await self.engine.aclose()

    # ---------------------------------------------------------------- low level
    async def generate(self, prompt_ids: Any, sampling_params: dict[str, Any] | None = None) -> OutputWithVersion:
        """Generate from token ids (module docstring); resumed across weight syncs, one chunk per version."""
        ids = token_ids(prompt_ids, "generate: prompt_ids")
        params = engine_params(sampling_params)
        if not self.resume_event.is_set():
            try:
                await asyncio.wait_for(self.resume_event.wait(), self.pause_timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(
                    f"RolloutClient stayed paused for {self.pause_timeout_s:g}s; call client.resume()"
                ) from None
        result = await self.engine.generate(ids, params, rid=self._rid())
        output = OutputWithVersion(
            prompt_ids=ids, output_chunks=[], finish_reason=result.finish_reason, lora_path=result.lora_path
        )
        start = 0
        for end in range(1, len(result.output_ids) + 1):  # one chunk per run of tokens of one version
            if end == len(result.output_ids) or result.versions[end] != result.versions[start]:
                text = self._decode(result.output_ids[:end])  # rLLM: a chunk's text is the response so far
                chunk = OutputChunk(
                    list(result.output_ids[start:end]), list(result.logprobs[start:end]), result.versions[start], text
                )
                output.append(chunk)
                start = end
        if result.versions:
            self.cur_version = max(self.cur_version, max(result.versions))
        return output

    # ---------------------------------------------------------------- chat
    async def chat_completion(
        self,
        messages: list[dict[str, Any]],
        sampling_params: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[dict[str, Any], OutputWithVersion]:
        """Render `messages` with the chat template, generate, parse the reply (module docstring)."""
        if self.tokenizer is None:
            raise ValueError("tokenizer required for chat_completion")
        parser = self.parser
        if tools and parser is None:
            raise ValueError(
                f"chat_completion(tools=...): cannot tell which tool-call format the model of tokenizer "
                f"{self.tokenizer.name_or_path!r} writes (rLLM picks Qwen's <tool_call> for qwen/r2e/deepswe "
                "names, R1's for deepseek/deepscaler/deepcoder ones, and its chat template names neither); "
                "set client.parser = rllm.parser.QwenToolParser() (or R1ToolParser())"
            )
        rendered = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        prompt_ids = token_ids(rendered, "chat_completion: the chat template's result")
        params = dict(sampling_params or {})
        if params.get("max_new_tokens") is None and params.get("max_tokens") is None:
            budget = self.max_tokens - len(prompt_ids)
            if budget < 1:
                raise ValueError(
                    f"chat_completion: the prompt is {len(prompt_ids)} tokens, no room left under the client's "
                    f"max_tokens {self.max_tokens} (data.max_prompt_length + data.max_response_length)"
                )
            params["max_new_tokens"] = budget
        output = await self.generate(prompt_ids, params)
        return parse_response(self.tokenizer, parser, output.all_response_ids()), output

    # ---------------------------------------------------------------- helpers
    def _rid(self) -> str | None:
        uid = SAMPLE_UID.get()
        return None if uid is None else f"{uid}-c{next(self._calls)}"

    def _decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(list(ids), skip_special_tokens=True)


def engine_params(sampling_params: Any) -> dict[str, Any]:
    """SGLang sampling parameters from a user's: a copy, `max_tokens` read as `max_new_tokens` (SGLang's native
    API knows only the latter; rLLM's budget arithmetic accepts either)."""
    if sampling_params is None:
        return {}
    if not isinstance(sampling_params, Mapping):
        raise TypeError(
            f"sampling_params must be a dict of SGLang sampling parameters, got {type(sampling_params).__name__}"
        )
    params = dict(sampling_params)
    if "max_tokens" in params:
        budget = params.pop("max_tokens")
        if params.get("max_new_tokens") is None:
            params["max_new_tokens"] = budget
    if params.get("max_new_tokens", 0) is None:
        del params["max_new_tokens"]  # None: the engine's default, as SGLang reads a missing key
    return params


def choose_parser(tokenizer: Any) -> ToolParser | None:
    """rLLM's parser for `tokenizer` by name; else by the markup its chat template writes; else None."""
    if tokenizer is None:
        return None
    try:
        return ToolParser.get_parser(tokenizer)
    except (ValueError, AttributeError):
        pass
    template = getattr(tokenizer, "chat_template", None)
    text = " ".join(template.values()) if isinstance(template, dict) else str(template or "")
    if R1ToolParser().tool_call_begin in text:
        return R1ToolParser()
    if QwenToolParser().tool_call_begin in text:
        return QwenToolParser()
    return None
