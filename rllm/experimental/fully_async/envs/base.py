"""The environment interface, the `env` config section, and how an environment is found by name or path.

An environment is a plain synchronous class (gym-like, text in and text out):

    reset(seed: int, task: dict) -> observation: str
    step(action_text: str) -> (observation: str, reward: float, done: bool, info: dict)

`task` is the datum's `extra_info` plus its `ground_truth` (key "ground_truth"). The object must be picklable: it
runs in the isolated worker pool (workers/pool.py), and `envs.session.IsolatedEnv` ships it to a worker for every
call and keeps the returned copy, so a step that hangs or crashes is killed without touching the last good state.
That is what makes the interface async-friendly: the workflow awaits `IsolatedEnv.reset/step`; the user writes
ordinary code.

Optional: `state_key() -> str`, the identity of the current state for GiGPO's anchor states. Without it the
state identity is the observation text the step acted on (see `state_hash`).

Config (`env` section, proposed keys; all honoured by workflows/multi_turn.py):
    env.name              built-in name (ENV_REGISTRY) or, with env.path, the class name in that file
    env.path              a Python file or "module" defining the class (like workflow.path); null: built-in
    env.kwargs            constructor keyword arguments (dict)
    env.max_turns         model turns per episode before it ends with reason max_turns
    env.max_total_tokens  prompt + every turn + observations; the episode ends with reason length past it
    env.step_timeout_s    wall-clock limit of one reset/step call; past it the worker is killed (reason timeout)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

# Built-in environments by name -> "module:Class", resolved inside the worker (never imported by the service).
ENV_REGISTRY: dict[str, str] = {
    "number_line": "rllm.experimental.fully_async.envs.number_line:NumberLineEnv",
    "product": "rllm.experimental.fully_async.envs.product:ProductEnv",
}


@runtime_checkable
class Environment(Protocol):
    """What an environment class implements (see the module docstring)."""

    def reset(self, seed: int, task: dict[str, Any]) -> str: ...

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]: ...


@dataclass(frozen=True)
class EnvSpec:
    """The `env` config section, validated (keys in the module docstring)."""

    name: str
    path: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 8
    max_total_tokens: int = 512
    step_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.path and self.name not in ENV_REGISTRY:
            raise ValueError(
                f"env.name: unknown environment {self.name!r} (built-ins: {sorted(ENV_REGISTRY)}; or set env.path)"
            )
        if self.max_turns < 1:
            raise ValueError(f"env.max_turns must be >= 1, got {self.max_turns}")
        if self.max_total_tokens < 1:
            raise ValueError(f"env.max_total_tokens must be >= 1, got {self.max_total_tokens}")
        if self.step_timeout_s <= 0:
            raise ValueError(f"env.step_timeout_s must be > 0, got {self.step_timeout_s}")

    @property
    def reference(self) -> str:
        """The "module:Class" or "/file.py:Class" reference the worker resolves."""
        if self.path:
            return f"{self.path}:{self.name}"
        return ENV_REGISTRY[self.name]

    @classmethod
    def from_config(cls, section: Any) -> EnvSpec:
        """From an `env` mapping (OmegaConf or dict); unknown keys are refused with their names."""
        data = dict(section)
        known = {"name", "path", "kwargs", "max_turns", "max_total_tokens", "step_timeout_s"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"env: unknown key(s) {unknown} (known: {sorted(known)})")
        if "kwargs" in data and data["kwargs"] is not None:
            data["kwargs"] = dict(data["kwargs"])
        else:
            data.pop("kwargs", None)
        return cls(**data)


def state_hash(text: str) -> str:
    """The state identity GiGPO groups steps by: a short SHA-256 of the state text (stable across processes)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
