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
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from rllm.experimental.fully_async.api.trajectory import TrajectoryGroup, TrajectoryStatus, VersionedTrajectory
from rllm.experimental.fully_async.core.ids import SampleId, prompt_uid
from rllm.experimental.fully_async.core.ledger import SampleLedger
from rllm.experimental.fully_async.core.staleness import StalenessManager
from rllm.experimental.fully_async.core.versions import groups_per_version
from rllm.experimental.fully_async.errors import FullyAsyncError
from rllm.experimental.fully_async.runtime.rollout.message_queue import MessageQueue

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

    @classmethod
    def from_spec(cls, spec: Any) -> ExecutorSettings:
        """From the run spec (run_spec.py): the schedule's η and B, the executor's sample counts."""
        s, ex = spec.schedule, spec.executor
        B = groups_per_version(s.required_samples, s.trigger_parameter_sync_step)
        return cls(ex.samples_per_prompt, s.max_staleness, B, ex.max_concurrent_rollouts)


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
        group_filter: Any | None = None,  # callable(list[TrajectoryGroup]) -> (kept, [(group, reason)])
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
        # Prompts whose samples were in flight when the checkpoint we resumed from was taken: run them first.
        self._reissue: list[tuple[Any, list[int]]] = []

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

    def set_max_staleness(self, max_staleness: int) -> None:
        """A new η from the trainer (adaptive staleness): the budget follows it (a higher η lets more start now)."""
        if max_staleness != self.staleness.eta:
            self.staleness.set_max_staleness(max_staleness)
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
                    datum, indexes = self._reissue.pop(0)
                    self._start_group(datum, indexes, issue=False)  # already issued before the restart
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

    def _start_group(self, datum: Any, indexes: list[int], *, issue: bool = True) -> None:
        if issue:
            self.ledger.issue([str(SampleId(datum.epoch, datum.record.index, i)) for i in indexes])
        self.staleness.on_start()
        self._running_samples += len(indexes)
        self.stats.groups_started += 1
        task = asyncio.create_task(self._run_group(datum, indexes))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_group(self, datum: Any, indexes: list[int]) -> None:
        n = len(indexes)
        accepted = False
        try:
            results = await self._run_samples(datum, indexes)
            trajectories = [self._as_trajectory(datum, i, result) for i, result in zip(indexes, results, strict=True)]
            group = TrajectoryGroup(
                prompt_uid=datum.prompt_uid,
                trajectories=trajectories,
                data_source=getattr(datum, "data_source", ""),
            )
            accepted = self._accept(group)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in the executor itself: stop loudly rather than lose samples
            logger.exception("group %s crashed", datum.prompt_uid)
            self._fatal = exc
        finally:
            self._running_samples -= n
            self.staleness.on_finish(accepted=accepted)
            self._state_changed.set()

    async def _run_samples(self, datum: Any, indexes: list[int]) -> list[Any]:
        """One result per sample: a VersionedTrajectory, or the exception its workflow raised. A workflow with
        `run_group` runs the group at once (one batched engine request); an exception there is every sample's
        result."""
        run_group = getattr(self.workflow, "run_group", None)
        if run_group is None:
            return await asyncio.gather(
                *(self.workflow.run(self.client, self.tokenizer, datum, i) for i in indexes), return_exceptions=True
            )
        try:
            return list(await run_group(self.client, self.tokenizer, datum, indexes))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return [exc] * len(indexes)

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

    def _accept(self, group: TrajectoryGroup) -> bool:
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

    def checkpoint_state(self) -> tuple[dict[str, Any], list[TrajectoryGroup]]:
        """This executor's state and every finished, untrained group (queued or in the backlog).

        Taken in one synchronous call on the service's loop, so nothing moves meanwhile: the ledger's in-flight
        samples are exactly those in the returned groups, those in the trainer's hands (none, when the trainer
        acknowledged its last batch first, as the checkpoint flow does), and those still generating (which
        `load_state_dict` re-issues).
        """
        return self.state_dict(), self.queue.snapshot()

    def load_state_dict(self, state: dict[str, Any], queued: list[TrajectoryGroup] | None = None) -> None:
        """Restore a checkpoint. Samples in flight that are not in `queued` are generated again, first."""
        self.version = int(state["version"])
        self._tell_workflow(self.version)
        self.ledger.load_state_dict(state["ledger"])
        self.prompts.load_state_dict(state["prompts"])
        self.staleness.load_state_dict(state["staleness"])
        queued_uids = {t.uid for g in queued or [] for t in g.trajectories}
        by_prompt: dict[tuple[int, int], list[int]] = {}
        for uid in self.ledger.in_flight_uids():
            if uid in queued_uids:
                continue
            sample = SampleId.parse(uid)
            by_prompt.setdefault((sample.epoch, sample.record), []).append(sample.index)
        records = {record.index: record for record in self.prompts.dataset}
        from rllm.experimental.fully_async.data.prompts import PromptDatum

        for (epoch, record), indexes in sorted(by_prompt.items()):
            datum = PromptDatum(prompt_uid=prompt_uid(epoch, record), epoch=epoch, record=records[record])
            self._reissue.append((datum, sorted(indexes)))
        if self._reissue:
            logger.info("re-issuing %d prompts that were in flight at the checkpoint", len(self._reissue))

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "ledger": self.ledger.state_dict(),
            "prompts": self.prompts.state_dict(),
            "staleness": self.staleness.state_dict(),
        }


def _reason_key(reason: str | None) -> str:
    """The ledger's reason: the part before the colon ('reward_error: ZeroDivisionError ...' -> 'reward_error')."""
    return (reason or "unknown").split(":", 1)[0]


def _is_engines_exhausted(exc: BaseException) -> bool:
    from rllm.experimental.fully_async.engines.client import NoHealthyEngineError

    return isinstance(exc, NoHealthyEngineError)
