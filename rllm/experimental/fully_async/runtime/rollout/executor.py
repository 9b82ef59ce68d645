"""RolloutExecutor: prompts -> workflows -> groups -> MessageQueue, under the staleness budget.

The executor is an asyncio loop (run inside the rollout service's process, `runtime/rollout/service.py`, next to
the queue it fills) with these guarantees:
- a new prompt group starts only while the staleness manager grants capacity (AReaL's rule, `core/staleness.py`),
  fewer than `max_concurrent_rollouts` samples are running, and the queue has no backlog (back-pressure);
- every prompt sample is issued in the ledger before it starts and ends in exactly one state: failed(reason)
  or filtered(reason) here, trained or dropped_stale when the service applies the trainer's acknowledgement
  (`report_consumed`);
- a finished group goes into the in-process queue at once (no call to another process); a full queue keeps it
  in its backlog and stops new groups from starting, never drops it;
- failures surface: a workflow exception fails its sample with the reason; losing every engine stops the loop
  and `run()` raises it.
The executor owns the prompt iterator, the ledger and the staleness counters, so its `state_dict()` is the
rollout side of a checkpoint.

Token-level resume: the executor holds one `SampleProgress` per running sample of a resumable workflow, from
`_start_group` until `_accept` queues or ends it; what a checkpoint saves of them and how a resumed run re-issues
them is `token_resume.py`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from rllm.experimental.fully_async.api.progress import (
    SampleProgress,
)
from rllm.experimental.fully_async.api.trajectory import TrajectoryStatus, VersionedGroup, VersionedTrajectory
from rllm.experimental.fully_async.api.workflow import resumes_samples
from rllm.experimental.fully_async.core.ids import SampleId
from rllm.experimental.fully_async.core.ledger import SampleLedger
from rllm.experimental.fully_async.core.staleness import StalenessManager
from rllm.experimental.fully_async.core.versions import groups_per_version
from rllm.experimental.fully_async.engines.client import NoHealthyEngineError
from rllm.experimental.fully_async.errors import FullyAsyncError
from rllm.experimental.fully_async.runtime.rollout.message_queue import MessageQueue
from rllm.experimental.fully_async.runtime.rollout.token_resume import reissue_plan, saved_progress

logger = logging.getLogger(__name__)


class EnginesExhaustedError(FullyAsyncError, RuntimeError):
    """No inference engine is left to serve rollouts: the run cannot continue."""


@dataclass
class ExecutorSettings:
    """What the executor needs from the config, in its own units."""

    samples_per_prompt: int
    max_staleness: int  # η, in policy versions
    groups_per_version: int  # B (core/versions.groups_per_version)
    max_concurrent_rollouts: int  # samples
    total_epochs: int | None = None  # None: until stopped
    partial_rollout: bool = True  # False: a resumed sample's unfinished generation restarts from its prompt

    @classmethod
    def from_spec(cls, spec: Any) -> ExecutorSettings:
        """From the run spec (run_spec.py): the schedule's η and B, the executor's sample counts."""
        s, ex = spec.schedule, spec.executor
        B = groups_per_version(s.required_samples, s.trigger_parameter_sync_step)
        return cls(
            ex.samples_per_prompt, s.max_staleness, B, ex.max_concurrent_rollouts, partial_rollout=ex.partial_rollout
        )


@dataclass
class ExecutorStats:
    groups_started: int = 0
    groups_queued: int = 0
    samples_failed: int = 0
    samples_resumed: int = 0  # samples whose generation was interrupted by a weight update and resumed
    tokens_generated: int = 0  # response tokens of finished samples (model and tool/observation tokens alike)
    filter_input_groups: int = 0  # groups offered to the group filter (algorithm.group_filter)
    filter_kept_groups: int = 0
    filter_dropped: dict[str, int] = field(default_factory=dict)  # trajectories dropped, by the ledger's reason
    # Samples in flight at the checkpoint this run resumed from, by how they went on (api.progress.RESUME_OUTCOMES),
    # and their saved tokens: restored, and of those thrown away (restarted from the prompt after all).
    resumed: dict[str, int] = field(default_factory=dict)
    resumed_tokens_restored: int = 0
    resumed_tokens_discarded: int = 0
    started_at: float = field(default_factory=time.monotonic)


class RolloutExecutor:
    """The asyncio core: no Ray inside, so a test can drive it with a local queue and engine client."""

    def __init__(
        self,
        settings: ExecutorSettings,
        prompts: Any,  # data.PromptIterator: an iterator of PromptDatum with state_dict()
        workflow: Any,  # workflows.Workflow
        client: Any,  # client.EngineClient
        tokenizer: Any,
        queue: MessageQueue,
        group_filter: Any | None = None,  # callable(list[VersionedGroup]) -> (kept, [(group, reason)])
        ledger: SampleLedger | None = None,
        version: int = 0,
    ) -> None:
        self.settings = settings
        self.prompts = prompts
        self.workflow = workflow
        self.client = client
        self.tokenizer = tokenizer
        self.queue = queue
        self.group_filter = group_filter
        self.ledger = ledger if ledger is not None else SampleLedger()
        self.version = version
        self._tell_workflow(version)
        self.staleness = StalenessManager(settings.groups_per_version, max_staleness=settings.max_staleness)
        self.stats = ExecutorStats()
        self._running_samples = 0
        self._state_changed = asyncio.Event()  # capacity, concurrency, queue space or stop changed
        self._stopping = False
        self._fatal: BaseException | None = None
        self._tasks: set[asyncio.Task] = set()
        self._paused = False
        queue.subscribe(self._state_changed.set)  # space freed or groups removed: maybe start more
        self.resumable = resumes_samples(workflow)  # records each sample's progress (module docstring)
        # Each running sample's record (resumable workflows; for others, only resumed samples, for their outcome).
        self._progress: dict[str, SampleProgress] = {}
        # Prompts whose samples were in flight when the checkpoint we resumed from was taken: run them first, each
        # sample from its saved record.
        self._reissue: list[tuple[Any, list[int], dict[str, SampleProgress]]] = []

    # ---- control, called from the trainer side ------------------------------------------------------------

    def set_version(self, version: int) -> None:
        """The trainer's version (core/versions.py): newer rollouts may start (capacity grows by B per version)."""
        if version != self.version:
            self.version = version
            self._state_changed.set()
        self._tell_workflow(version)

    def _tell_workflow(self, version: int) -> None:
        """A workflow that keeps the policy version for user code (an rLLM rollout function's
        `client.cur_version`, workflows/rllm_compat.py) hears every version the trainer reports."""
        tell = getattr(self.workflow, "set_version", None)
        if tell is not None:
            tell(version)
        use = getattr(self.client, "use_policy_version", None)  # LoRA: new requests name this version's adapter
        if use is not None:
            use(version)

    def set_max_staleness(self, max_staleness: int, version: int) -> None:
        """A new η from the trainer (adaptive staleness) from `version` on: the budget follows it (a higher η lets more
        start now), and so does the drop bound of the groups started from now on (`staleness.bounds`)."""
        if max_staleness != self.staleness.eta:
            self.staleness.set_max_staleness(max_staleness, version)
            self._state_changed.set()

    def set_paused(self, paused: bool) -> None:
        """Stop starting new groups (e.g. during validation or a checkpoint); running ones continue."""
        self._paused = paused
        self._state_changed.set()

    def report_consumed(
        self, trained_uids: list[str], trained_groups: int, stale_uids: list[str], stale_groups: int
    ) -> None:
        """The trainer trained or dropped these samples; dropped stale groups free their capacity again."""
        if trained_uids:
            self.ledger.mark_trained(trained_uids)
        if trained_groups:
            self.staleness.on_consumed(trained_groups)
        if stale_uids:
            self.ledger.mark_dropped_stale(stale_uids)
        if stale_groups:
            self.staleness.on_discarded(stale_groups)
        self._state_changed.set()

    def stop(self) -> None:
        self._stopping = True
        self._state_changed.set()

    @property
    def running_samples(self) -> int:
        """Samples generating now (started, not yet queued or ended)."""
        return self._running_samples

    # ---- main loop -----------------------------------------------------------------------------------------

    async def run(self) -> ExecutorStats:
        """Start groups while the budget allows; returns when the data is exhausted or `stop()` is called."""
        try:
            while not self._stopping and self._fatal is None:
                if not self._can_start():
                    self._state_changed.clear()
                    if self._can_start() or self._stopping or self._fatal is not None:
                        continue
                    await self._state_changed.wait()
                    continue
                if self._reissue:
                    datum, indexes, saved = self._reissue.pop(0)
                    self._start_group(datum, indexes, issue=False, saved=saved)  # issued before the restart
                    continue
                datum = next(self.prompts, None)
                if datum is None:
                    logger.info("prompt data exhausted after %d groups", self.stats.groups_started)
                    break
                self._start_group(datum, list(range(self.settings.samples_per_prompt)))
            if self._tasks and not self._stopping:
                await asyncio.gather(*self._tasks, return_exceptions=True)  # results handled in _run_group
        finally:
            self._stopping = True
            for task in self._tasks:
                task.cancel()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            self._state_changed.set()
        if self._fatal is not None:
            raise self._fatal
        return self.stats

    def _can_start(self) -> bool:
        if self._paused or self._stopping:
            return False
        n = self.settings.samples_per_prompt
        if self._running_samples + n > self.settings.max_concurrent_rollouts:
            return False
        if self.queue.backlog:
            return False  # back-pressure: the queue is full and finished groups are waiting for space
        return self.staleness.capacity(self.version) > 0

    def _start_group(
        self, datum: Any, indexes: list[int], *, issue: bool = True, saved: dict[str, SampleProgress] | None = None
    ) -> None:
        uids = [str(SampleId(datum.epoch, datum.record.index, i)) for i in indexes]
        if issue:
            self.ledger.issue(uids)
        saved = saved or {}
        for uid in uids:
            if uid in saved:
                self._progress[uid] = saved[uid]
            elif self.resumable:
                self._progress[uid] = SampleProgress(uid)
        self.staleness.on_start()
        self._running_samples += len(indexes)
        self.stats.groups_started += 1
        task = asyncio.create_task(self._run_group(datum, indexes, uids))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_group(self, datum: Any, indexes: list[int], uids: list[str]) -> None:
        n = len(indexes)
        accepted = False
        try:
            records = [self._progress[uid] for uid in uids] if self.resumable else None
            results = await self._run_samples(datum, indexes, records)
            trajectories = [self._as_trajectory(datum, i, result) for i, result in zip(indexes, results, strict=True)]
            group = VersionedGroup(
                prompt_uid=datum.prompt_uid,
                trajectories=trajectories,
                data_source=getattr(datum, "data_source", ""),
            )
            self._journal_resumed(uids)
            accepted = self._accept(group)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in the executor itself: stop loudly rather than lose samples
            logger.exception("group %s crashed", datum.prompt_uid)
            self._fatal = exc
        finally:
            for uid in uids:  # in the step that queued or ended them (no await since `_accept`)
                self._progress.pop(uid, None)
            self._running_samples -= n
            self.staleness.on_finish(accepted=accepted)
            self._state_changed.set()

    async def _run_samples(self, datum: Any, indexes: list[int], records: list[SampleProgress] | None) -> list[Any]:
        """One result per sample: a VersionedTrajectory, or the exception its workflow raised. A workflow with
        `run_group` runs the group at once (one batched engine request); an exception there is every sample's
        result. `records`: each sample's progress, for a resumable workflow."""
        run_group = getattr(self.workflow, "run_group", None)
        if run_group is None:
            progress = records or [None] * len(indexes)
            runs = (
                self.workflow.run(self.client, self.tokenizer, datum, i, **({"progress": p} if p is not None else {}))
                for i, p in zip(indexes, progress, strict=True)
            )
            return await asyncio.gather(*runs, return_exceptions=True)
        try:
            kwargs = {} if records is None else {"progress": records}
            return list(await run_group(self.client, self.tokenizer, datum, indexes, **kwargs))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return [exc] * len(indexes)

    def _journal_resumed(self, uids: list[str]) -> None:
        """Journal and count how this group's samples restored from a checkpoint went on (their records' outcome:
        continued, or restarted from the prompt and why), right before they are queued or end."""
        by_outcome: dict[str, list[str]] = {}
        for uid in uids:
            record = self._progress.get(uid)
            if record is None or record.outcome is None:
                continue  # a fresh sample
            by_outcome.setdefault(record.outcome, []).append(uid)
            self.stats.resumed_tokens_restored += record.restored_tokens
            self.stats.resumed_tokens_discarded += record.discarded_tokens
        for outcome, batch in by_outcome.items():
            self.ledger.mark_resumed(batch, outcome)
            self.stats.resumed[outcome] = self.stats.resumed.get(outcome, 0) + len(batch)

    def _as_trajectory(self, datum: Any, index: int, result: Any) -> VersionedTrajectory:
        uid = str(SampleId(datum.epoch, datum.record.index, index))
        if isinstance(result, VersionedTrajectory):
            self.stats.samples_resumed += int(result.num_resumes > 0)
            self.stats.tokens_generated += sum(len(s.response_ids) for s in result.sequences)
            return result
        if isinstance(result, asyncio.CancelledError):
            raise result
        if isinstance(result, BaseException) and _is_engines_exhausted(result):
            self._fatal = EnginesExhaustedError(f"no inference engine left: {result}")
        reason = f"workflow_error: {type(result).__name__}: {result}"
        logger.warning("sample %s failed: %s", uid, reason)
        return VersionedTrajectory(
            uid=uid, prompt_uid=datum.prompt_uid, sequences=[], status=TrajectoryStatus.FAILED, failure_reason=reason
        )

    def _accept(self, group: VersionedGroup) -> bool:
        """Ledger the failures, apply the group filter, queue what is left. Returns whether a group was queued."""
        ok = []
        for trajectory in group.trajectories:
            if trajectory.status == TrajectoryStatus.OK:
                ok.append(trajectory)
            else:
                self.stats.samples_failed += 1
                self.ledger.mark_failed([trajectory.uid], _reason_key(trajectory.failure_reason))
        group.trajectories = ok
        if not ok:
            return False
        if self.group_filter is not None:
            # A dropped group frees its budget slot (on_finish(accepted=False)), so a replacement starts at once:
            # the budget itself over-samples, and the trainer's batches stay full whatever the filter drops.
            kept, dropped = self.group_filter([group])
            self.stats.filter_input_groups += 1
            self.stats.filter_kept_groups += len(kept)
            for dropped_group, reason in dropped:
                self.ledger.mark_filtered([t.uid for t in dropped_group.trajectories], reason)
                self.stats.filter_dropped[reason] = self.stats.filter_dropped.get(reason, 0) + len(
                    dropped_group.trajectories
                )
            if not kept:
                return False
            group = kept[0]  # may hold fewer trajectories than the input (trajectory-level length drops)
        self.queue.put([group])
        self.stats.groups_queued += 1
        return True

    # ---- checkpoint ----------------------------------------------------------------------------------------

    def checkpoint_state(self) -> tuple[dict[str, Any], list[VersionedGroup]]:
        """This executor's state and every finished, untrained group (queued or in the backlog).

        Taken in one synchronous call on the service's loop, so nothing moves meanwhile: the ledger's in-flight
        samples are exactly those in the returned groups, those in the trainer's hands (none, when the trainer
        acknowledged its last batch first, as the checkpoint flow does), and those still generating (which
        `load_state_dict` re-issues), whose progress so far is in the state's `in_flight_progress`.
        """
        return self.state_dict(), self.queue.snapshot()

    def in_flight_progress(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(saved, unsaved) progress of every sample still generating (token_resume.saved_progress)."""
        records = list(self._progress.values()) + [r for _, _, saved in self._reissue for r in saved.values()]
        return saved_progress(records)

    def load_state_dict(self, state: dict[str, Any], queued: list[VersionedGroup] | None = None) -> None:
        """Restore a checkpoint. Samples in flight that are not in `queued` are run again, first, each from its saved
        progress when there is one (module docstring)."""
        self.version = int(state["version"])
        self._tell_workflow(self.version)
        self.ledger.load_state_dict(state["ledger"])
        self.prompts.load_state_dict(state["prompts"])
        self.staleness.load_state_dict(state["staleness"])
        self._reissue = reissue_plan(
            state,
            self.ledger.in_flight_uids(),
            queued or [],
            self.prompts.dataset,
            resumable=self.resumable,
            partial_rollout=self.settings.partial_rollout,
        )

    def state_dict(self) -> dict[str, Any]:
        saved, unsaved = self.in_flight_progress()
        return {
            "version": self.version,
            "ledger": self.ledger.state_dict(),
            "prompts": self.prompts.state_dict(),
            "staleness": self.staleness.state_dict(),
            "in_flight_progress": saved,
            "in_flight_unsaved": unsaved,
        }


def _reason_key(reason: str | None) -> str:
    """The ledger's reason: the part before the colon ('reward_error: ZeroDivisionError ...' -> 'reward_error')."""
    return (reason or "unknown").split(":", 1)[0]


def _is_engines_exhausted(exc: BaseException) -> bool:

    return isinstance(exc, NoHealthyEngineError)
