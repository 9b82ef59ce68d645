"""A built-in one-answer environment for the tool task: multiply two numbers, with a calculator at hand.

reset gives the problem "23*47="; the episode's one env step is the model's answer (digits), rewarded 1.0 when it
equals the product, else 0.0, and the episode is done. A turn that calls the calculator tool (handled by the
workflow's ToolBox, not here) does not count as a step: its result comes back as a tool message, and the model
answers after it. A tiny model cannot multiply two-digit numbers itself; with the tool it only has to copy.
"""

from __future__ import annotations

from typing import Any


class ProductEnv:
    """See the module docstring. `task` holds "a" and "b" (ints), as the calculator task's data does."""

    def __init__(self) -> None:
        self.a = self.b = 0

    def reset(self, seed: int, task: dict[str, Any]) -> str:
        self.a, self.b = int(task["a"]), int(task["b"])
        return f"{self.a}*{self.b}="

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        answer = action_text.strip()
        correct = answer.isdigit() and int(answer) == self.a * self.b
        return "", 1.0 if correct else 0.0, True, {"correct": correct}

    def state_key(self) -> str:
        return f"{self.a}*{self.b}"
