"""A user environment (plain synchronous class, picklable): the number line with a cost per move.

Plug it in with `env.path=examples/agents/my_env.py env.name=CostlyLine` (see examples/agents/agent.yaml). It runs
in the rollout service's worker pool: a `step` that hangs past `env.step_timeout_s` is killed and ends the
episode with reason `timeout`. Observations keep the number-line task's format ("3>7:") so its tiny model and
vocabulary work unchanged.
"""


class CostlyLine:
    def __init__(self, size: int = 10, max_step: int = 3, move_cost: float = 0.1) -> None:
        self.size, self.max_step, self.move_cost = size, max_step, move_cost
        self.position = self.target = 0

    def reset(self, seed: int, task: dict) -> str:
        """`task` is the datum's extra_info plus its ground_truth; the first observation is returned as text."""
        self.position, self.target = int(task["start"]), int(task["target"])
        return f"{self.position}>{self.target}:"

    def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        """One model turn's text -> (observation, step reward, done, info)."""
        text = action_text.strip()
        valid = len(text) == 2 and text[0] in "+-" and text[1].isdigit() and 1 <= int(text[1]) <= self.max_step
        if valid:
            move = int(text[1]) if text[0] == "+" else -int(text[1])
            self.position = min(self.size - 1, max(0, self.position + move))
        done = self.position == self.target
        reward = (1.0 if done else 0.0) - self.move_cost  # every move costs: shorter walks earn more
        return (
            f"{self.position}>{self.target}:",
            reward,
            done,
            {"valid": valid, "distance": abs(self.target - self.position)},
        )

    def state_key(self) -> str:
        """Optional: the state identity GiGPO groups steps by (default: the observation text)."""
        return f"{self.position}>{self.target}"
