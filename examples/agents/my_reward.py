"""A reward with step rewards for a multi_turn workflow (verl's signature, run in the worker pool).

Plug it in with `reward.custom_reward_function.path=examples/agents/my_reward.py` (name: compute_score). It is called
once per finished episode: `solution_str` is the transcript after the prompt, `extra_info` the datum's extra_info
plus "steps" (each turn's action, observation, env reward and info), "end_reason" and "env_rewards".
Returning {"score": s, "step_rewards": [{"step_index": i, "reward": r}, ...]} rewards each turn (a turn not listed
gets none, counted 0 by GiGPO); returning a plain number puts it on the last turn.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    steps = extra_info["steps"]
    target = int(ground_truth)
    step_rewards = []
    before = abs(target - int(extra_info["start"]))
    for step in steps:
        after = step["info"].get("distance", before)
        # progress shaping: +0.2 for a move towards the target, -0.2 otherwise, +1 for arriving
        reward = (0.2 if after < before else -0.2) + (1.0 if after == 0 else 0.0)
        step_rewards.append({"step_index": step["index"], "reward": reward})
        before = after
    success = float(extra_info["end_reason"] == "done")
    return {"score": success, "step_rewards": step_rewards}
