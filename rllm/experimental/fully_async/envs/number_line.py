"""A built-in multi-step environment: walk along a short number line to a target.

The state is (position, target) on 0..size-1. An action is a signed step such as "+1", "-2" or "+3" (magnitude
1..max_step); an action that does not parse leaves the position unchanged (info["invalid"] = True). Moves are
clipped to the line. Reward 1.0 on the step that reaches the target, else 0.0; done when the target is reached
(the workflow's `env.max_turns` ends the other episodes).

Why this environment: with size 10 there are only 100 states, and the trajectories of one prompt group all start
at the same position, so they visit the same states again and again. GiGPO's anchor-state groups (identical
states across a group's trajectories) are therefore large and real: from the same state, a "+3" that reaches the
target a turn earlier gets a higher discounted step return than a "+1".

Observation text: "<position>><target>:" e.g. "3>7:" (single digits; the number-line task's vocabulary).
"""

from __future__ import annotations

import re
from typing import Any

_ACTION = re.compile(r"^\s*([+-])([0-9])\s*$")


def format_observation(position: int, target: int) -> str:
    return f"{position}>{target}:"


def parse_action(text: str, max_step: int) -> int | None:
    """The signed step an action text asks for, or None when it is not "+k"/"-k" with 1 <= k <= max_step."""
    match = _ACTION.match(text)
    if match is None:
        return None
    magnitude = int(match.group(2))
    if not 1 <= magnitude <= max_step:
        return None
    return magnitude if match.group(1) == "+" else -magnitude


class NumberLineEnv:
    """See the module docstring. `task` holds "start" and "target" (ints), as the number-line task's data does."""

    def __init__(self, size: int = 10, max_step: int = 3) -> None:
        if not 2 <= size <= 10:
            raise ValueError(f"NumberLineEnv size must be in 2..10 (single-digit observations), got {size}")
        if not 1 <= max_step <= 9:
            raise ValueError(f"NumberLineEnv max_step must be in 1..9, got {max_step}")
        self.size = size
        self.max_step = max_step
        self.position = 0
        self.target = 0

    def reset(self, seed: int, task: dict[str, Any]) -> str:
        start, target = int(task["start"]), int(task["target"])
        for name, value in (("start", start), ("target", target)):
            if not 0 <= value < self.size:
                raise ValueError(f"task {name}={value} is off the number line 0..{self.size - 1}")
        self.position, self.target = start, target
        return format_observation(self.position, self.target)

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        move = parse_action(action_text, self.max_step)
        if move is not None:
            self.position = min(self.size - 1, max(0, self.position + move))
        done = self.position == self.target
        info = {"invalid": move is None, "position": self.position}
        return format_observation(self.position, self.target), 1.0 if done else 0.0, done, info

    def state_key(self) -> str:
        return format_observation(self.position, self.target)
