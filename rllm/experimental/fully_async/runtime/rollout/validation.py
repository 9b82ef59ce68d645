"""Held-out validation through the engines, accuracy = mean reward, beside training at one pinned weight version.

What is measured:
- `evaluate`: single-turn; each prompt decoded once, greedily, and scored by the task's reward.
- `evaluate_episodes`: agents (multi_turn and other workflows); the training workflow itself plays each held-out
  prompt `n` times with verl's `val_kwargs` sampling, and accuracy is the mean episode reward (for a 0/1 reward:
  the held-out success rate). Failed episodes are counted apart, as failed rewards are.

When, without stopping training: every `trainer.test_freq` steps the driver asks the rollout service to start a
validation and goes on training. The validation runs in the service's event loop, on the same engines as the
rollouts, and its answers must all come from one weight version. Weight syncs are what would change it, so syncs
and validations exclude each other through a `SyncGate` in the service process:

- a validation waits for a sync in progress to finish, then reads every engine's version back (they must agree: that
  is the pinned version, `pinned_version`) and holds the gate while it generates;
- a sync (the trainer's `begin_weight_sync`, before ParamSync pauses the engines) waits for a running validation to
  finish, up to a timeout whose error names the validation.

A checkpoint's collection of the tokens in flight (`RolloutService.write_checkpoint`) also pauses and continues the
engines, without changing their weights: it excludes syncs (their pause and continue must not interleave) but not
validations (whose requests are continued from their tokens at the same version).

So the trainer keeps taking batches and making optimizer steps during a validation; only a weight push that falls
inside one waits for it (`sync/wait_validation_s`). The result carries the step it was started at (`val/step`), the
pinned version and whether every answer came from it (`val/off_version_answers`). `BackgroundValidation` keeps the
one running validation and the results not yet collected; the driver collects them after every step (the same Ray
call that starts a validation when one is due), so a result is logged at the first step after it finished, as
measuring the weights of `val/step` (observe/metrics_sink.py `log_validation`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rllm.experimental.fully_async.api.trajectory import TrajectoryStatus, VersionedTrajectory
from rllm.experimental.fully_async.workflows.base import RewardFn, score_safely
from rllm.experimental.fully_async.workflows.rllm_metrics import episodes_metadata_metrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ValidationResult:
    accuracy: float  # mean reward over scored prompts (exact match: the fraction correct)
    num_prompts: int
    num_failed: int  # reward function failed: excluded from the mean and counted here
    versions: tuple[int, ...]  # weight versions the engines reported while answering
    # rLLM rollout functions' val/avg_reward, val/num_samples, val/<metadata key> (workflows/rllm_metrics.py)
    metadata_metrics: dict[str, float] = field(default_factory=dict)


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


async def evaluate_episodes(
    workflow: Any, client: Any, tokenizer: Any, data: list[Any], *, n: int, sampling: dict[str, Any]
) -> tuple[ValidationResult, list[VersionedTrajectory]]:
    """Play every held-out datum `n` times with `workflow` under `sampling` (SGLang parameters that replace the
    workflow's temperature/top_p/top_k). Returns the result and the episodes (for validation dumps)."""
    if dataclasses.is_dataclass(workflow) and hasattr(workflow, "sampling_params"):
        workflow = dataclasses.replace(workflow, sampling_params={**workflow.sampling_params, **sampling})
    elif not getattr(workflow, "chooses_sampling", False):  # rLLM rollout functions pass their own, as in rLLM
        logger.warning("workflow %s has no sampling_params: validation samples with its training settings", workflow)

    async def one(datum: Any, index: int) -> VersionedTrajectory:
        # Its own prompt ids: the engines' request ids must not collide with a training rollout of the same prompt.
        held_out = dataclasses.replace(datum, prompt_uid=f"val/{datum.prompt_uid}")
        return await workflow.run(client, tokenizer, held_out, index)

    episodes = await asyncio.gather(*(one(d, i) for d in data for i in range(n)))
    ok = [t for t in episodes if t.status == TrajectoryStatus.OK]
    versions = {v for t in episodes for s in t.sequences for v in s.response_versions}
    result = ValidationResult(
        accuracy=sum(t.reward for t in ok) / len(ok) if ok else 0.0,
        num_prompts=len(data),
        num_failed=len(episodes) - len(ok),
        versions=tuple(sorted(versions)),
        metadata_metrics=episodes_metadata_metrics(episodes),
    )
    return result, list(episodes)


# ---- pinned to one weight version, beside training -------------------------------------------------------------------


class SyncGate:
    """Weight syncs and validations exclude each other. One owner: the rollout service's event loop."""

    def __init__(self) -> None:
        self._syncing = False
        self._validating = False
        self._collecting = False  # a checkpoint has the engines paused to collect the tokens in flight
        self._changed: asyncio.Condition | None = None  # created in the loop that uses it

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    @property
    def syncing(self) -> bool:
        return self._syncing

    @property
    def validating(self) -> bool:
        return self._validating

    async def begin_sync(self, timeout_s: float) -> float:
        """Wait until no validation runs, then mark a sync in progress; returns the seconds waited."""
        changed = self._condition()
        started = time.monotonic()
        async with changed:
            try:
                await asyncio.wait_for(
                    changed.wait_for(lambda: not self._validating and not self._collecting), timeout_s
                )
            except asyncio.TimeoutError as exc:
                what = "the running validation" if self._validating else "a checkpoint's pause"
                raise TimeoutError(
                    f"weight sync waited {timeout_s:g}s for {what} to finish (raise "
                    "param_sync.timeout_s, or validate fewer prompts with task.val_size)"
                ) from exc
            self._syncing = True
        return time.monotonic() - started

    def collecting(self, timeout_s: float) -> contextlib.AbstractAsyncContextManager[None]:
        """Hold the gate while a checkpoint pauses the engines to collect the tokens in flight: waits for a sync in
        progress to finish first, and keeps the next one waiting until the engines are continued."""
        return self._held("_collecting", "checkpoint", timeout_s)

    async def end_sync(self) -> None:
        changed = self._condition()
        async with changed:
            self._syncing = False
            changed.notify_all()

    def validation(self, timeout_s: float) -> contextlib.AbstractAsyncContextManager[None]:
        """Hold the gate for one validation: waits for a sync in progress to finish first."""
        return self._held("_validating", "validation", timeout_s)

    @contextlib.asynccontextmanager
    async def _held(self, flag: str, holder: str, timeout_s: float) -> AsyncIterator[None]:
        """Set `flag` (one holder of that kind at a time) once no sync runs and no other holder of the kind holds
        it; a sync waits while it is set (`begin_sync`)."""
        changed = self._condition()
        async with changed:
            try:
                await asyncio.wait_for(
                    changed.wait_for(lambda: not self._syncing and not getattr(self, flag)), timeout_s
                )
            except asyncio.TimeoutError as exc:
                raise TimeoutError(f"{holder} waited {timeout_s:g}s for a weight sync to finish") from exc
            setattr(self, flag, True)
        try:
            yield
        finally:
            async with changed:
                setattr(self, flag, False)
                changed.notify_all()


def pinned_version(engine_versions: dict[str, str]) -> int:
    """The one weight version every engine reports (read back, never assumed); ValueError if they disagree."""
    values = set(engine_versions.values())
    if len(values) != 1:
        raise ValueError(f"engines disagree on their weight version, cannot pin a validation: {engine_versions}")
    return int(next(iter(values)))


class BackgroundValidation:
    """At most one validation running beside training, and the results the driver has not collected yet.

    One owner: the rollout service's event loop. `poll` is what the driver's per-step Ray call does: it hands over
    every result finished since the previous poll and, when asked, starts the next validation unless one still runs
    (then that one is skipped: two would compete for the engines and the gate).
    """

    def __init__(self) -> None:
        self._task: asyncio.Task | None = None
        self._finished: list[dict[str, float]] = []

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def poll(
        self, start: Callable[[], Awaitable[dict[str, float]]] | None = None
    ) -> tuple[bool, list[dict[str, float]]]:
        """The results finished since the last poll, oldest first; with `start`, begin `start()` in the background
        unless a validation runs. Returns (whether it started, the results)."""
        finished, self._finished = self._finished, []
        if start is None or self.running:
            return False, finished
        self._task = asyncio.create_task(self._keep(start))
        return True, finished

    async def _keep(self, start: Callable[[], Awaitable[dict[str, float]]]) -> None:
        result = await start()
        # Only now read `self._finished`: a poll meanwhile replaced the list (`append(await ...)` would bind the old
        # one and lose the result). No await between this and the append: a poll sees the result or not at all.
        self._finished.append(result)

    async def wait(self) -> None:
        """Until the running validation, if any, has finished (its errors are in its result, not raised here)."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    async def drain(self) -> list[dict[str, float]]:
        """Wait for the running validation, then every result not yet collected (the end of a run)."""
        await self.wait()
        return self.poll()[1]
