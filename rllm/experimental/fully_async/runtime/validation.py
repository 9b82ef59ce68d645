"""Held-out validation through the engines: greedy decoding, the task's reward, accuracy = mean reward."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from rllm.experimental.fully_async.workflows.base import RewardFn, score_safely

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ValidationResult:
    accuracy: float  # mean reward over scored prompts (exact match: the fraction correct)
    num_prompts: int
    num_failed: int  # reward function failed: excluded from the mean and counted here
    versions: tuple[int, ...]  # weight versions the engines reported while answering


async def evaluate(
    client: Any,
    tokenizer: Any,
    data: list[Any],
    reward_fn: RewardFn,
    *,
    max_new_tokens: int,
    reward_timeout_s: float = 30.0,
) -> ValidationResult:
    """Greedy-decode every datum once (temperature 0) and score it. Engine errors propagate."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0}

    async def one(datum: Any) -> tuple[float | None, set[int]]:
        result = await client.generate(list(datum.prompt_ids), dict(params), rid=f"val/{datum.prompt_uid}")
        text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
        outcome = await score_safely(
            reward_fn,
            reward_timeout_s,
            data_source=datum.data_source,
            solution_str=text,
            ground_truth=datum.ground_truth,
            extra_info=datum.extra_info,
        )
        return outcome.reward, set(result.versions)

    results = await asyncio.gather(*(one(d) for d in data))
    scored = [r for r, _ in results if r is not None]
    versions = sorted(set().union(*(v for _, v in results))) if results else []
    return ValidationResult(
        accuracy=sum(scored) / len(scored) if scored else 0.0,
        num_prompts=len(data),
        num_failed=len(results) - len(scored),
        versions=tuple(versions),
    )
