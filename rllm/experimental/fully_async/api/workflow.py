"""The rollout workflow contract: what a workflow is given (an engine client) and what it returns.

A workflow is one `async` method (AReaL's contract): given an engine client, the tokenizer and one prompt datum,
it runs one sample to the end and returns a `VersionedTrajectory`. Implementations: workflows/ (single-turn, multi-turn,
rLLM rollout functions) and a user's own class at `workflow.path`.

Resumable workflows (token-level resume, api/progress.py): a workflow whose `run` (and `run_group`) takes a
`progress` keyword is given a `SampleProgress` per sample by the executor. It passes `progress.generation` to the
client's `generate(..., progress=...)` (so the tokens so far are where a checkpoint reads them), keeps any other
state it needs to go on in `progress.episode`, and, given a record restored from a checkpoint, continues from it. A
workflow without that keyword is restarted from the prompt after a crash (`resumes_samples`).
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

from rllm.experimental.fully_async.api.progress import GenerationProgress
from rllm.experimental.fully_async.api.trajectory import VersionedTrajectory


class GenerationClient(Protocol):
    """What a workflow needs from `client.EngineClient` (a Protocol so tests can pass any engine client).
    `progress` is only passed by resumable workflows (module docstring)."""

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        *,
        rid: str | None = None,
        progress: GenerationProgress | None = None,
    ) -> Any: ...


class BatchGenerationClient(GenerationClient, Protocol):
    """A client that also sends several prompts as one batched request (what `run_group` of SingleTurnWorkflow
    needs)."""

    async def generate_batch(
        self,
        prompts: list[list[int]],
        sampling_params: dict[str, Any],
        *,
        rids: list[str],
        progress: list[GenerationProgress] | None = None,
    ) -> list[Any]: ...


class Workflow(Protocol):
    """One rollout sample. Returning a FAILED trajectory (never raising) rejects the sample with a reason.

    A workflow may also define `run_group(client, tokenizer, datum, sample_indexes) -> list[VersionedTrajectory]` to run
    one prompt's samples together (SingleTurnWorkflow sends them as one batched engine request); the executor
    calls it when present, else `run` once per sample.
    """

    async def run(
        self, client: GenerationClient, tokenizer: Any, datum: Any, sample_index: int
    ) -> VersionedTrajectory: ...


def resumes_samples(workflow: Any) -> bool:
    """Whether `workflow` records and continues its samples' progress: its `run` (and its `run_group`, if it has
    one) takes a `progress` keyword (module docstring)."""
    methods = [getattr(workflow, "run", None), getattr(workflow, "run_group", None)]
    present = [m for m in methods if m is not None]
    return bool(present) and all(_takes(m, "progress") for m in present)


def _takes(method: Any, name: str) -> bool:
    try:
        return name in inspect.signature(method).parameters
    except (TypeError, ValueError):  # a builtin or a callable without a signature
        return False
