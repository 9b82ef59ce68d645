"""Tools for multi-turn workflows: the call format, the calculator, and running calls in the worker pool.

A model turn is a tool call when its decoded text (special tokens skipped) parses in the configured format:

- "hermes" (Qwen/Hermes style): ``<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>``
  anywhere in the turn; the first such block is the call.
- "compact" (for tiny vocabularies): the whole turn is ``name[argument text]``, e.g. ``c[12*34]``; the argument
  text is passed as the tool's single positional argument.

The tool runs in the isolated worker pool with `timeout_s` (a hung tool is killed: `ToolError(kind="timeout")`);
what it returns (str() of it) is appended as a tool message with loss mask 0. A tool that raises does not end the
episode: the model sees "error: <reason>" as the tool's answer, as it would from a real tool API, and can try
again. Only a timeout or a crash of the worker ends it (`ToolError`). Tools are functions, given by reference
("module:function" or "/file.py:function") so the rollout service never imports them.

Config (proposed, `tools` section): `tools.format` (hermes | compact), `tools.timeout_s`, `tools.functions`
(a mapping name -> reference; built-in: "calculator").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from rllm.experimental.fully_async.tools.calculator import calculator
from rllm.experimental.fully_async.workers.pool import IsolatedCallError, WorkerPool, resolve_reference

__all__ = ["BUILTIN_TOOLS", "ToolBox", "ToolError", "ToolInvocation", "calculator", "parse_tool_call"]

CallFormat = Literal["hermes", "compact"]
# In a light module of their own: a worker imports the tool's module inside the call's time limit.
BUILTIN_TOOLS: dict[str, str] = {"calculator": "rllm.experimental.fully_async.tools.calculator:calculator"}

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_COMPACT = re.compile(r"^\s*([A-Za-z_]\w*)\[(.*)\]\s*$", re.DOTALL)


class ToolError(RuntimeError):
    """A tool call that ends the episode; `kind` is "timeout" or "tool_error", `reason` one line."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


@dataclass(frozen=True)
class ToolInvocation:
    """A call to one of this project's built-in tools, as parsed from a turn (rLLM's `ToolCall`, with a dict of
    arguments, lives in `rllm.tools.tool_base` for rLLM programs)."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


def parse_tool_call(text: str, fmt: CallFormat, known: set[str]) -> ToolInvocation | None:
    """The call a turn makes, or None when the turn is not a call to a known tool (then it is an env action)."""
    if fmt == "compact":
        match = _COMPACT.match(text)
        if match is None or match.group(1) not in known:
            return None
        return ToolInvocation(match.group(1), (match.group(2),))
    match = _HERMES.search(text)
    if match is None:
        return None
    try:
        body = json.loads(match.group(1))
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("name") not in known:
        return None
    arguments = body.get("arguments") or {}
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolInvocation(str(body["name"]), (), dict(arguments)) if isinstance(arguments, dict) else None


@dataclass
class ToolBox:
    """The tools a workflow offers: name -> reference, the call format and the per-call timeout."""

    functions: dict[str, str]
    format: CallFormat = "hermes"
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.format not in ("hermes", "compact"):
            raise ValueError(f"tools.format must be hermes or compact, got {self.format!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"tools.timeout_s must be > 0, got {self.timeout_s}")
        self.functions = {name: BUILTIN_TOOLS.get(ref, ref) for name, ref in self.functions.items()}

    def parse(self, text: str) -> ToolInvocation | None:
        return parse_tool_call(text, self.format, set(self.functions))

    async def run(self, call: ToolInvocation, pool: WorkerPool | None) -> str:
        """The tool's answer as text; "error: ..." when it raised; ToolError on a timeout or a crash."""
        reference = self.functions[call.name]
        if pool is None:
            try:
                return str(resolve_reference(reference)(*call.args, **call.kwargs))
            except Exception as exc:  # the model sees the error, as from a real tool API
                return f"error: {type(exc).__name__}: {exc}"
        try:
            return str(await pool.call(reference, *call.args, timeout_s=self.timeout_s, **call.kwargs))
        except IsolatedCallError as exc:
            if exc.kind == "exception":
                return "error: " + exc.reason.split(" raised ", 1)[-1]
            kind = "timeout" if exc.kind == "timeout" else "tool_error"
            detail = f"did not return within {self.timeout_s:g}s" if kind == "timeout" else exc.reason
            raise ToolError(kind, f"tool {call.name} {detail}") from exc
