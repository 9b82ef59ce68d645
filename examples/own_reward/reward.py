"""A reward function with verl's signature, for `reward.custom_reward_function.path/name`.

    reward.custom_reward_function.path=examples/own_reward/reward.py
    reward.custom_reward_function.name=compute_score

verl calls `compute_score(data_source, solution_str, ground_truth, extra_info)` once per generated answer:
`data_source`, `ground_truth` (`reward_model.ground_truth`) and `extra_info` come from the parquet row, and
`solution_str` is the decoded response. Return a float (or a dict with a "score" key). It runs in a worker
process of the rollout service's pool with a timeout (`workflow.reward_timeout_s`): a call that hangs has its
worker killed; that, a crash or an exception fails that one trajectory with its reason.

This one grades numeric answers with a small format bonus: 1.0 for the right number, 0.1 for a well-formed but
wrong number, 0.0 for no number at all. Shaping like this helps a weak model find the format early.
"""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d+")


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    match = _NUMBER.search(solution_str)
    if match is None:
        return 0.0
    return 1.0 if match.group() == str(ground_truth).strip() else 0.1
