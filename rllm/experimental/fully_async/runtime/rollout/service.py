"""RolloutService: the rollout side in one process — executor loop, message queue, staleness budget, ledger.

DESIGN rule 2. One async Ray actor (`RolloutServiceActor`) owns the `RolloutExecutor` (which owns the staleness
budget and the ledger with its journal) and the `MessageQueue` it fills, so their invariants hold on one event
loop with no lock and no call to another process. The trainer talks to it with one call per step:

    take_batch(BatchRequest(n_groups, version, ack, timeout_s)) -> Batch        (api/step_messages.py)

which, in order: applies the acknowledgement of the previous batch (ledger: trained; budget: consumed), takes
the trainer's η when it sends one (adaptive staleness: the budget follows it, and the drop rule from the groups
started next: a group keeps the η it was admitted under, core/staleness.StalenessBounds) and its policy version
(core/versions.py; new rollouts may start against it), drops every queued group too stale for that version
(ledger: dropped_stale; their budget slots come back), waits up to timeout_s for n_groups fresh groups
and returns them with the queue, ledger and rollout statistics the driver reports.
Guarantees: a stale group never leaves this process; a request that times out takes nothing; after the
rollouts end the last request gets what is left (fewer groups), the next one status "closed".

`RolloutService` is the asyncio core (no Ray, so a test can drive it with a real executor); the actor builds it
from the frozen run spec (run_spec.py; it never reads the config tree) and adds validation and the checkpoint
part it writes itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from rllm.experimental.fully_async.api.step_messages import Ack, Batch, BatchRequest
from rllm.experimental.fully_async.api.trajectory import TrajectoryGroup
from rllm.experimental.fully_async.core.staleness import StalenessBounds
from rllm.experimental.fully_async.observe.metrics_sink import prefixed
from rllm.experimental.fully_async.runtime.rollout.executor import RolloutExecutor
from rllm.experimental.fully_async.runtime.rollout.message_queue import MessageQueue
from rllm.experimental.fully_async.runtime.rollout.validation import SyncGate, pinned_version

if TYPE_CHECKING:
    from rllm.experimental.fully_async.run_spec import ExecutorSpec, RunSpec

logger = logging.getLogger(__name__)
# The most a checkpoint waits for the tokens in flight (and, before that, for a weight sync to finish).
CHECKPOINT_COLLECT_TIMEOUT_S = 30.0


class RolloutService:
    """The executor and its queue behind the one-call contract of the module docstring."""

    def __init__(
        self,
        executor: RolloutExecutor,
        queue: MessageQueue,
        max_staleness: int,
        gate: SyncGate | None = None,
        collect_timeout_s: float = 60.0,
    ) -> None:
        self.executor = executor
        self.queue = queue
        self.bounds = StalenessBounds(max_staleness)  # each queued group's drop bound
        self.gate = gate if gate is not None else SyncGate()  # syncs vs validations and checkpoint pauses
        self.collect_timeout_s = collect_timeout_s  # bounds the wait for a sync and for the tokens in flight
        self.ledger = executor.ledger
        self._filter_seen: dict[str, float] = {}  # the executor's cumulative filter counts at the last batch
        # Throughput and engine idleness are reported per interval between batches (see `_generation_metrics`).
        self._last_batch_at = time.monotonic()
        self._last_tokens = 0
        self._last_busy: dict[str, float] = {}
        self.batches_taken = 0  # batches handed to the trainer: its step count (names validation dumps)

    async def run(self) -> dict[str, Any]:
        """Run the executor until the data is exhausted or `stop()`; then close the queue so the trainer drains it."""
        try:
            stats = await self.executor.run()
        finally:
            self.queue.close()
        return dict(vars(stats))

    def stop(self) -> None:
        self.executor.stop()

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
            self.bounds.set(request.max_staleness, request.version)
            self.executor.set_max_staleness(request.max_staleness)
        self.executor.set_version(request.version)
        n, started = request.n_groups, time.monotonic()
        deadline = started + request.timeout_s
        stale = 0
        while True:
            stale += self._drop_stale(request.version)
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
            await self.queue.wait_for(lambda: len(self.queue) >= n or self.queue.closed, remaining)
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

        An engine is idle while none of our requests is on it (`EnginePool.busy_seconds`), as the trainer is idle
        while it waits for a batch: both are fractions of the same wall-clock interval, so "who waited" compares.
        """
        now = time.monotonic()
        elapsed = max(now - self._last_batch_at, 1e-9)
        tokens = self.executor.stats.tokens_generated
        busy = self.executor.client.pool.busy_seconds() if hasattr(self.executor.client, "pool") else {}
        out = {"rollout/tokens_per_s": (tokens - self._last_tokens) / elapsed}
        if busy:
            fractions = [min(1.0, (b - self._last_busy.get(url, 0.0)) / elapsed) for url, b in busy.items()]
            out["engines/idle_frac"] = max(0.0, 1.0 - sum(fractions) / len(fractions))
        self._last_batch_at, self._last_tokens, self._last_busy = now, tokens, busy
        return out

    def _drop_stale(self, version: int) -> int:
        """Remove every queued group staler at `version` than its bound; ledger it and free its budget slot."""
        stale: list[TrajectoryGroup] = self.queue.remove_if(lambda g: self.bounds.is_too_stale(g.min_version, version))
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
            "max_staleness": self.bounds.current,
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

    def checkpoint_state(self) -> tuple[dict[str, Any], list[TrajectoryGroup]]:
        return self.executor.checkpoint_state()

    async def collected_checkpoint_state(self) -> tuple[dict[str, Any], list[TrajectoryGroup]]:
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
        from rllm.experimental.fully_async.runtime.checkpoints.format import write_rollout_part

        state, groups = await self.collected_checkpoint_state()
        return write_rollout_part(Path(directory), state, groups)


@ray.remote(num_cpus=0)  # waits on events and HTTP; the generation work is in the engine processes
class RolloutServiceActor:
    """The RolloutService built from the run spec, plus validation through the same engines (`api_key`: their
    per-run secret when they listen beyond loopback)."""

    def __init__(
        self,
        spec: RunSpec,
        engine_urls: list[str],
        state: dict | None = None,
        queued: list | None = None,
        api_key: str = "",
    ) -> None:
        from transformers import AutoTokenizer

        from rllm.experimental.fully_async.algorithms.filters import build_group_filter
        from rllm.experimental.fully_async.core.ids import rejected_prompt_uid
        from rllm.experimental.fully_async.data.datasets import load_prompt_datasets
        from rllm.experimental.fully_async.data.prompts import PromptIterator
        from rllm.experimental.fully_async.engines.client import EngineClient
        from rllm.experimental.fully_async.runtime.rollout.executor import ExecutorSettings
        from rllm.experimental.fully_async.runtime.rollout.ledger_journal import journaled_ledger
        from rllm.experimental.fully_async.workflows import IsolatedReward, build_workflow, load_reward_fn

        logging.basicConfig(level=os.environ.get("RLLM_LOG_LEVEL", "WARNING"))
        self.spec = spec
        ex, data = spec.executor, spec.executor.data
        self.tokenizer = AutoTokenizer.from_pretrained(spec.engines.model_path)  # the engines' model, its tokens
        # User code (rewards, environments, tools) runs in these worker processes, where a timeout kills a hung call
        # (workers/pool.py); they exit with this process.
        self.pool = _worker_pool(ex)
        self.reward_fn = load_reward_fn(ex, self.pool)
        uses_reward = ex.workflow_path is None and (ex.workflow_name == "single_turn" or ex.reward_fn_path)
        if isinstance(self.reward_fn, IsolatedReward) and uses_reward:
            self.pool.preload += (self.reward_fn.reference,)
        # Under on_engine_failure=restart a request finding no live engine waits for a restarted one (the
        # supervisor gives a restart startup_timeout_s) rather than failing its sample.
        restarting = spec.engines.on_engine_failure == "restart"
        self.client = EngineClient(
            engine_urls,
            request_timeout_s=spec.engines.request_timeout_s,
            partial_rollout=ex.partial_rollout,
            wait_for_engine_s=spec.engines.startup_timeout_s + 30.0 if restarting else 0.0,
            api_key=api_key or None,
            sampling_seed=spec.engines.sampling_seed,
        )
        # The journal (every sample's issue and end, for the exactly-once audit) lives in the run dir. A relative
        # run.dir is resolved against this worker's cwd, which Ray gives the driver's. A fresh run starts it empty
        # at its first record; a resume cuts it back to the checkpoint (`SampleLedger.load_state_dict`).
        ledger = journaled_ledger(Path(spec.run.dir).absolute() / "ledger.jsonl")
        train, val = load_prompt_datasets(data, self.tokenizer)
        if state is None:  # a resumed ledger has them already
            for rejected in train.rejected:
                # Left out before any rollout, yet still a prompt the user gave: the ledger accounts for it.
                uid = rejected_prompt_uid(rejected.index)
                ledger.issue([uid])
                ledger.mark_filtered([uid], rejected.reason)
        self.val: list = []
        if val is not None:
            self.val = list(PromptIterator(val, seed=0, num_epochs=1, shuffle=False))[: data.val_size]
        prompts = PromptIterator(train, seed=data.seed, num_epochs=data.total_epochs, shuffle=data.shuffle)
        settings = ExecutorSettings.from_spec(spec)
        queued = queued or []
        queue = MessageQueue(max_groups=max(ex.queue_max_groups, len(queued)))
        self.workflow = build_workflow(ex, self.reward_fn, self.pool)
        self.val_workflow = build_workflow(ex, self.reward_fn, self.pool, held_out=True) if ex.rllm_functions else None
        executor = RolloutExecutor(
            settings,
            prompts,
            self.workflow,
            self.client,
            self.tokenizer,
            queue,
            group_filter=build_group_filter(ex.group_filter),
            ledger=ledger,
        )
        if state is not None:
            executor.load_state_dict(state, queued)
            queue.put(queued)
        # Validations beside training, pinned to one weight version (runtime/rollout/validation.py).
        self.gate = SyncGate()
        self.gate_timeout_s = spec.param_sync.timeout_s
        self.service = RolloutService(
            executor,
            queue,
            max_staleness=spec.schedule.max_staleness,
            gate=self.gate,
            # Under the driver's 120 s wait for write_checkpoint (a sync to wait out, the collection, the continue):
            # a call held by a paused SGLang engine only returns at the continue, so the collection ends by timeout.
            collect_timeout_s=min(spec.param_sync.timeout_s, CHECKPOINT_COLLECT_TIMEOUT_S),
        )
        self._validation: asyncio.Task | None = None
        self._finished_validations: list[dict[str, float]] = []

    async def run(self) -> dict:
        return await self.service.run()

    async def take_batch(self, request: BatchRequest) -> Batch:
        batch = await self.service.take_batch(request)
        if self._validation is not None and not self._validation.done():
            batch = dataclasses.replace(batch, validating=True)
        return batch

    def acknowledge(self, ack: Ack) -> None:
        self.service.acknowledge(ack)

    async def write_checkpoint(self, directory: str) -> dict[str, Any]:
        return await self.service.write_checkpoint(directory)

    def set_paused(self, paused: bool) -> None:
        self.service.executor.set_paused(paused)

    def stop(self) -> None:
        self.service.stop()

    def ledger_counts(self) -> dict:
        return self.service.ledger.counts()

    def metrics(self) -> dict[str, float]:
        return self.service.metrics()

    def replace_engine(self, old_url: str, new_url: str) -> None:
        """Route rollouts to a restarted engine (already at the trainer's weights) instead of its dead predecessor."""
        self.client.replace_engine(old_url, new_url)

    async def begin_weight_sync(self) -> float:
        return await self.gate.begin_sync(self.gate_timeout_s)

    async def end_weight_sync(self) -> None:
        await self.gate.end_sync()

    async def start_validation(self, step: int) -> tuple[bool, list[dict[str, float]]]:
        """Start a validation of the weights the engines hold now, in the background, unless one is running.
        Returns whether it started, and the results of validations finished since the last call."""
        finished, self._finished_validations = self._finished_validations, []
        if self._validation is not None and not self._validation.done():
            return False, finished
        self._validation = asyncio.create_task(self._validate_pinned(step))
        return True, finished

    async def finished_validations(self) -> list[dict[str, float]]:
        """Wait for a running validation, then return every result not yet returned (the end of a run)."""
        if self._validation is not None:
            await asyncio.gather(self._validation, return_exceptions=True)  # its own errors are in its result
        finished, self._finished_validations = self._finished_validations, []
        return finished

    async def _validate_pinned(self, step: int) -> None:
        started, started_at = time.monotonic(), time.time()
        try:
            async with self.gate.validation(self.gate_timeout_s):
                urls = self.client.alive_urls
                versions = await asyncio.gather(*(self.client.get_weight_version(u) for u in urls))
                pinned = pinned_version(dict(zip(urls, versions, strict=True)))
                result = await self.validate(step)
            off = result.get("val/min_version", pinned) != pinned or result.get("val/version", pinned) != pinned
            result |= {"val/pinned_version": float(pinned), "val/off_version_answers": float(off)}
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an engine error or a timeout: this validation is lost, the run goes on
            logger.warning("validation started at step %d failed: %s: %s", step, type(exc).__name__, exc)
            result = {"val/failed": 1.0}
        result |= {
            "val/step": float(step),
            "val/duration_s": time.monotonic() - started,
            "val/started_at": started_at,  # wall clock, comparable with metrics.jsonl's `time`
            "val/finished_at": time.time(),
        }
        self._finished_validations.append(result)

    async def validate(self, step: int | None = None) -> dict:
        """Held-out accuracy; `step` names the validation dump file (default: the batches taken so far)."""
        from rllm.experimental.fully_async.runtime.rollout.validation import evaluate

        if not self.val:
            return {}
        ex = self.spec.executor
        if ex.workflow_path is not None or ex.workflow_name != "single_turn":
            return await self._validate_episodes(self.service.batches_taken if step is None else step)
        result = await evaluate(
            self.client,
            self.tokenizer,
            self.val,
            self.reward_fn,
            max_new_tokens=ex.sampling.max_new_tokens,
            reward_timeout_s=ex.reward_timeout_s,
        )
        return {
            "val/accuracy": result.accuracy,
            "val/num_prompts": float(result.num_prompts),
            "val/num_failed": float(result.num_failed),
            "val/version": float(max(result.versions, default=-1)),
            "val/min_version": float(min(result.versions, default=-1)),
        }

    async def _validate_episodes(self, step: int) -> dict:
        from rllm.experimental.fully_async.runtime.rollout.validation import evaluate_episodes

        spec = self.spec.executor.validation
        assert spec is not None, "build_run_spec always sets ExecutorSpec.validation"
        sampling = {"temperature": spec.temperature, "top_p": spec.top_p, "top_k": spec.top_k}
        result, episodes = await evaluate_episodes(
            self.val_workflow or self.workflow, self.client, self.tokenizer, self.val, n=spec.n, sampling=sampling
        )
        if self.spec.run.validation_data_dir:
            from rllm.experimental.fully_async.observe.dumps import write_episodes

            write_episodes(Path(self.spec.run.validation_data_dir), step, episodes, self.tokenizer)
        return {
            "val/accuracy": result.accuracy,
            "val/num_prompts": float(result.num_prompts),
            "val/num_failed": float(result.num_failed),
            "val/version": float(max(result.versions, default=-1)),
            **result.metadata_metrics,
        }

    async def aclose(self) -> None:
        await self.client.aclose()
        self.pool.close()


def _worker_pool(executor: ExecutorSpec) -> Any:
    """The worker pool for user code, its workers preloading the environment's and the reward's modules so that
    no call's timeout pays for an import."""
    from rllm.experimental.fully_async.workers.pool import DEFAULT_PRELOAD, WorkerPool
    from rllm.experimental.fully_async.workflows import env_spec

    preload = list(DEFAULT_PRELOAD)
    if executor.agent is not None:  # a multi_turn workflow (no workflow.path)
        preload.append(env_spec(executor.agent).reference)
    return WorkerPool(max_workers=2, preload=tuple(preload))
