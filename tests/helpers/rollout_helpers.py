"""A rollout service over a real executor, queue and ledger whose workflow generates no text (one token per sample,
tagged with the version the test moves): the scheduling tests' service."""

from __future__ import annotations

import asyncio

from rllm.experimental.fully_async.api.trajectory import VersionedSequence, VersionedTrajectory
from rllm.experimental.fully_async.core.ids import SampleId
from rllm.experimental.fully_async.core.ledger import SampleLedger
from rllm.experimental.fully_async.data.prompts import PromptIterator, PromptRecord
from rllm.experimental.fully_async.runtime.rollout.executor import ExecutorSettings, RolloutExecutor
from rllm.experimental.fully_async.runtime.rollout.ledger_journal import journaled_ledger
from rllm.experimental.fully_async.runtime.rollout.message_queue import MessageQueue
from rllm.experimental.fully_async.runtime.rollout.service import RolloutService

SAMPLES = 2


WAIT_S = 30.0  # generous on a shared machine; a hang still fails


class VersionTaggingWorkflow:
    """One token per sample, tagged with `engine_version`; rewards alternate so every group has variance."""

    name = "version_tagging"

    def __init__(self) -> None:
        self.engine_version = 0

    async def run(self, client, tokenizer, datum, sample_index: int) -> VersionedTrajectory:
        await asyncio.sleep(0.001)  # a real await: groups finish interleaved with the trainer's requests
        sequence = VersionedSequence(list(datum.prompt_ids), [5], [-0.5], [self.engine_version])
        uid = str(SampleId(datum.epoch, datum.record.index, sample_index))
        return VersionedTrajectory(uid, datum.prompt_uid, [sequence], reward=float(sample_index % 2))


def make_service(
    num_prompts: int,
    *,
    max_groups: int = 100,
    max_staleness: int = 1,
    groups_per_version: int = 2,
    max_concurrent: int = 8,
    journal=None,
) -> tuple[RolloutService, VersionTaggingWorkflow]:
    records = [
        PromptRecord(index=i, prompt_ids=[2, 3], messages=[], data_source="t", ground_truth="0")
        for i in range(num_prompts)
    ]
    workflow = VersionTaggingWorkflow()
    queue = MessageQueue(max_groups)
    settings = ExecutorSettings(SAMPLES, max_staleness, groups_per_version, max_concurrent)
    executor = RolloutExecutor(
        settings,
        PromptIterator(records, seed=0, num_epochs=1, shuffle=False),
        workflow,
        None,  # client: the workflow needs none
        None,  # tokenizer
        queue,
        ledger=journaled_ledger(journal) if journal is not None else SampleLedger(),
    )
    return RolloutService(executor, queue), workflow


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, WAIT_S))
