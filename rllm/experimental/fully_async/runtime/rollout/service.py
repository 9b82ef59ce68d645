"""RolloutService: the rollout side in one process — executor loop, message queue, staleness budget, ledger.

docs/design.md#rule-one-rollout-service. One async Ray actor (`RolloutServiceActor`) owns the `RolloutExecutor` (which
owns the staleness budget and the ledger with its journal) and the `MessageQueue` it fills, so their invariants hold on
one event loop with no lock and no call to another process. The trainer talks to it with one call per step:

    take_batch(BatchRequest(n_groups, version, ack, timeout_s)) -> Batch        (api/step_messages.py)

which, in order: applies the acknowledgement of the previous batch (ledger: trained; budget: consumed), takes
the trainer's η when it sends one (adaptive staleness: the budget follows it, and the drop rule from the groups
started next: a group keeps the η it was admitted under, core/staleness.StalenessBounds, which the executor's
staleness manager owns: η has one owner in this process) and its policy version
(core/versions.py; new rollouts may start against it), drops every queued group too stale for that version
(ledger: dropped_stale; their budget slots come back), waits up to timeout_s for n_groups fresh groups
and returns them with the queue, ledger and rollout statistics the driver reports.
Guarantees: a stale group never leaves this process; a request that times out takes nothing; after the
rollouts end the last request gets what is left (fewer groups), the next one status "closed".

`RolloutService` is the asyncio core (no Ray, so a test can drive it with a real executor); its Ray actor is
`actor.py`'s `RolloutServiceActor`, which builds it from the frozen run spec (run_spec.py; it never reads the config
tree) and adds validation and the checkpoint part it writes itself.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rllm.experimental.fully_async.api.step_messages import Ack, Batch, BatchRequest
from rllm.experimental.fully_async.api.trajectory import VersionedGroup
from rllm.experimental.fully_async.core.engine_activity import IntervalMeter
from rllm.experimental.fully_async.observe.metrics_sink import prefixed
from rllm.experimental.fully_async.runtime.checkpoints.format import write_rollout_part
from rllm.experimental.fully_async.runtime.rollout.executor import RolloutExecutor
from rllm.experimental.fully_async.runtime.rollout.message_queue import MessageQueue
from rllm.experimental.fully_async.runtime.rollout.validation import SyncGate

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)
# The most a checkpoint waits for the tokens in flight (and, before that, for a weight sync to finish).
CHECKPOINT_COLLECT_TIMEOUT_S = 30.0


class RolloutService:
    """The executor and its queue behind the one-call contract of the module docstring."""

    def __init__(
        self,
        executor: RolloutExecutor,
        queue: MessageQueue,
        gate: SyncGate | None = None,
        collect_timeout_s: float = 60.0,
    ) -> None:
        self.executor = executor
        self.queue = queue
        self.gate = gate if gate is not None else SyncGate()  # syncs vs validations and checkpoint pauses
        self.collect_timeout_s = collect_timeout_s  # bounds the wait for a sync and for the tokens in flight
        self.ledger = executor.ledger
        self._filter_seen: dict[str, float] = {}  # the executor's cumulative filter counts at the last batch
        # Throughput and engine idleness are reported per interval between batches (see `_generation_metrics`).
        self._last_batch_at = time.monotonic()
        self._activity = IntervalMeter(self._last_batch_at)  # engines' busy time and tokens (core/engine_activity.py)
        self._last_tokens = 0  # finished samples' tokens at the last batch, for a client without an engine pool
        self.batches_taken = 0  # batches handed to the trainer: its step count (names validation dumps)
        self.interrupted = False  # `interrupt()`: the run is stopping; take_batch answers at once, taking nothing

    async def run(self) -> dict[str, Any]:
        """Run the executor until the data is exhausted or `stop()`; then close the queue so the trainer drains it."""
        try:
            stats = await self.executor.run()
        finally:
            self.queue.close()
        return dict(vars(stats))

    def stop(self) -> None:
        self.executor.stop()

    def interrupt(self) -> None:
        """The run is stopping (Ctrl-C, SIGTERM, a failure) and the driver wants a checkpoint: a `take_batch`
        waiting for groups, and every later one, returns "interrupted" with none. The trainer's wait for a batch
        would otherwise hold up its checkpoint (the trainer's calls run one at a time) until groups came, which
        with no engine left is never: the driver gave up after 300 s and saved nothing. Generation and the
        tokens in flight are untouched, so the rollout part of the checkpoint still holds them."""
        self.interrupted = True
        self.queue.wake()

    def acknowledge(self, ack: Ack) -> None:
        """The trainer trained these samples and groups: ledger them trained and count them consumed."""
        if ack:
            self.executor.report_consumed(list(ack.sample_ids), ack.groups, [], 0)

    async def take_batch(self, request: BatchRequest) -> Batch:
        if request.n_groups < 1 or request.n_groups > self.queue.max_groups:
            # A request larger than the queue can ever hold would wait forever: reject it at once.
            raise ValueError(f"take_batch(n_groups={request.n_groups}) must ask for 1..{self.queue.max_groups}")
        self.acknowledge(request.ack)
        if request.max_staleness is not None:  # adaptive staleness: budget and drop rule follow the trainer's η
            self.executor.set_max_staleness(request.max_staleness, request.version)
        self.executor.set_version(request.version)
        n, started = request.n_groups, time.monotonic()
        deadline = started + request.timeout_s
        stale = 0
        while True:
            stale += self._drop_stale(request.version)
            if self.interrupted:
                groups, status = [], "interrupted"
                break
            if len(self.queue) >= n:
                groups, status = self.queue.pop(n), "ok"
                break
            if self.queue.closed:
                left = len(self.queue)
                groups, status = (self.queue.pop(left), "ok") if left else ([], "closed")
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                groups, status = [], "timeout"
                break
            # Woken by every change; a group that arrives stale is dropped at the top of the loop.
            await self.queue.wait_for(lambda: len(self.queue) >= n or self.queue.closed or self.interrupted, remaining)
        wait_s = time.monotonic() - started
        self.batches_taken += bool(groups)
        metrics = self.metrics() | self._filter_metrics() | self._generation_metrics()
        return Batch(groups, status, stale, wait_s, metrics)  # type: ignore[arg-type]

    def _filter_metrics(self) -> dict[str, float]:
        """filter/*: the group filter's work since the previous batch (groups in and kept, trajectories dropped by
        reason), so each step reports what was filtered while its batch was being made."""
        stats = self.executor.stats
        totals = {"input_groups": float(stats.filter_input_groups), "kept_groups": float(stats.filter_kept_groups)}
        totals |= {f"dropped_trajectories/{k}": float(v) for k, v in stats.filter_dropped.items()}
        delta = {f"filter/{k}": v - self._filter_seen.get(k, 0.0) for k, v in totals.items()}
        self._filter_seen = totals
        return delta

    def _generation_metrics(self) -> dict[str, float]:
        """rollout/tokens_per_s and engines/idle_frac over the interval since the previous batch.

        An engine is idle while none of our requests is on it, as the trainer is idle while it waits for a batch:
        both are fractions of the same wall-clock interval, so "who waited" compares. The tokens are the output
        tokens the engines returned in the interval, credited when each /generate call returns, on the clock and
        at the place its busy time is measured (core/engine_activity.py), so an interval with tokens has busy
        time and one 100% idle has none. So they are what the engines did: model output tokens only (a tool's or
        environment's observation tokens are not generated by an engine) and pieces later discarded included (a
        group dropped stale, a restart without partial rollout); `rollout/tokens_generated` (cumulative) still
        counts the response tokens of finished samples. With a client that has no engine pool (no busy time to
        compare), the tokens are those of the samples that finished in the interval and there is no idle share.
        """
        now = time.monotonic()
        pool = getattr(self.executor.client, "pool", None)
        if pool is not None:
            serving, retired = pool.activities()
            interval = self._activity.read(now, serving, retired)
            out = {"rollout/tokens_per_s": interval.tokens_per_s}
            if interval.idle_frac is not None:
                out["engines/idle_frac"] = interval.idle_frac
            return out
        elapsed = max(now - self._last_batch_at, 1e-9)
        tokens = self.executor.stats.tokens_generated
        rate = (tokens - self._last_tokens) / elapsed
        self._last_batch_at, self._last_tokens = now, tokens
        return {"rollout/tokens_per_s": rate}

    def _drop_stale(self, version: int) -> int:
        """Remove every queued group staler at `version` than its bound; ledger it and free its budget slot."""
        stale: list[VersionedGroup] = self.queue.remove_if(
            lambda g: self.executor.staleness.bounds.is_too_stale(g.min_version, version)
        )
        if stale:
            uids = [t.uid for g in stale for t in g.trajectories]
            self.executor.report_consumed([], 0, uids, len(stale))
        return len(stale)

    def metrics(self) -> dict[str, float]:
        """queue/*, ledger/*, rollout/*: what the driver reports each step, numbers only."""
        stats = self.executor.stats
        rollout = {
            "groups_started": stats.groups_started,
            "groups_queued": stats.groups_queued,
            "samples_failed": stats.samples_failed,
            "samples_resumed": stats.samples_resumed,
            "version": self.executor.version,
            "tokens_generated": stats.tokens_generated,  # cumulative (experiments: generated per trained token)
            "max_staleness": self.executor.staleness.eta,
        }
        if stats.resumed:  # after a resume: how the samples in flight at the checkpoint went on, and their tokens
            rollout |= {f"resume/{outcome}": n for outcome, n in stats.resumed.items()}
            rollout |= {
                "resume/tokens_restored": stats.resumed_tokens_restored,
                "resume/tokens_discarded": stats.resumed_tokens_discarded,
            }
        return (
            prefixed("queue", self.queue.stats())
            | prefixed("ledger", self.ledger.counts())
            | prefixed("rollout", rollout)
        )

    def checkpoint_state(self) -> tuple[dict[str, Any], list[VersionedGroup]]:
        return self.executor.checkpoint_state()

    async def collected_checkpoint_state(self) -> tuple[dict[str, Any], list[VersionedGroup]]:
        """`checkpoint_state` with every sample's tokens up to now in it (token-level resume).

        Tokens reach the rollout side when a /generate call returns, which for a long generation may be long after
        they were made. So, when samples are generating and their progress is recorded, the engines are paused
        with mode abort, as for a weight sync but keeping the weights (SyncGate: no sync meanwhile): each call in
        flight comes back with its tokens, which land in the samples' records, and is re-sent, held by the paused
        engine; the state is taken, then the engines continue. With partial_rollout off a paused generation would
        restart from its prompt, so nothing is paused: the records hold what has come back.
        """
        executor = self.executor
        if not (executor.settings.partial_rollout and executor.resumable and executor.running_samples):
            return self.checkpoint_state()
        timeout_s = self.collect_timeout_s
        async with self.gate.collecting(timeout_s), executor.client.tokens_collected(timeout_s) as complete:
            if not complete:
                logger.warning(
                    "checkpoint: some generations did not come back within %gs of pausing the engines; "
                    "their latest tokens are not in this checkpoint",
                    timeout_s,
                )
            return self.checkpoint_state()

    async def write_checkpoint(self, directory: str) -> dict[str, Any]:
        """Write the rollout part (rollout.json, queue.json) into a checkpoint's temporary directory; returns the
        manifest entries. The trainer must have acknowledged its last batch first (the driver's checkpoint flow)."""

        state, groups = await self.collected_checkpoint_state()
        return write_rollout_part(Path(directory), state, groups)
