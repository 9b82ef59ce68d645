"""The discrete-event loop: engines, executor, queue, trainer and weight syncs on one simulated clock.

Pure: no Ray, asyncio, threads or files; deterministic for a seed (one `random.Random`, ties broken by event order).
The scheduling decisions are the runtime's own pure functions, called exactly where the runtime calls them:
- a group starts only while `StalenessManager.capacity(version) > 0` and the running samples leave room for one
  more group (`RolloutExecutor._can_start`); the manager is built as the runtime builds it
  (`runtime/rollout/service.py`): B = `groups_per_version(required_samples, K)`, η = max_staleness;
- finished groups go through `on_finish(accepted)`, the trainer takes `required_samples` groups oldest first
  (`MessageQueue.get_batch`), drops what `StalenessBounds.split` calls too stale (`on_discarded`) and asks again, and
  reports the trained ones (`on_consumed`) after the update (`FullyAsyncTrainer`);
- a step ends with a weight sync that bumps the version by one when `is_sync_step` says so (core/versions.py);
- `adaptive.enable`: each batch's modelled statistics go to the runtime's `StalenessController`, which decides at the
  sync; its η reaches the budget and the drop rule when the sync completes (the runtime's next request), and a
  group keeps the η it was admitted under (`StalenessBounds`, as the rollout service does).
Partial rollouts: with `partial_rollout` a sync pauses the engines, and running requests continue with the new
weights, so their later tokens carry the new version (a sample's oldest token keeps its start version); without
it the sync waits until the running requests have finished and no new group starts meanwhile (verl's mode without
partial rollout). Generation itself is modelled in `model.py`. Host sharing (`host.cores`): one speed factor
(HostModel.speed) multiplies every engine's decoding rate and the trainer's progress through its step's work; it
is re-evaluated after every event that starts or stops a component (`_reshare`).
An engine schedule (`engine_schedule`, model.py) changes the engine set at its times (`_on_schedule`): engines are
never deleted, a leaving one is marked inactive (pending events name engines by index); new groups go to the ready
engines only; each stretch of one count is a `Segment` of the result.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from typing import Any

from rllm.experimental.fully_async.core.adaptive_staleness import StalenessController
from rllm.experimental.fully_async.core.staleness import StalenessManager
from rllm.experimental.fully_async.core.versions import groups_per_version, is_sync_step
from rllm.experimental.fully_async.simulate.model import SimConfig, check
from rllm.experimental.fully_async.simulate.result import Segment, SimResult

_EPS = 1e-9


class _Group:
    __slots__ = ("accept", "min_version", "mixed", "remaining", "tokens")

    def __init__(self, n: int, accept: bool) -> None:
        self.remaining = n
        self.accept = accept
        self.min_version: int | None = None  # read by StalenessBounds.split, as VersionedGroup.min_version
        self.tokens = 0
        self.mixed = 0


class _Request:
    __slots__ = ("done", "group", "length", "start", "target", "version")

    def __init__(self, group: _Group, length: int) -> None:
        self.group, self.length = group, length
        self.target = self.start = 0.0
        self.done = 0.0  # tokens it had when admitted (moved from a removed engine with its tokens)
        self.version: int | None = None  # version of its first token


class _Engine:
    """Processor sharing: every running request advances `progress` tokens; one finishes at its `target`."""

    def __init__(self) -> None:
        self.progress = 0.0
        self.last_t = 0.0
        self.running: dict[int, _Request] = {}
        self.heap: list[tuple[float, int]] = []
        self.waiting: deque[tuple[int, _Request]] = deque()
        self.paused = False
        self.epoch = 0
        self.busy_s = 0.0
        self.paused_s = 0.0
        self.version = 0
        self.active = True  # False once the schedule removed it
        self.ready = True  # False from its join until engine.join_s later
        self.joined_at = 0.0
        self.left_at: float | None = None


class Simulation:
    """One run of the pipeline. `run()` returns a SimResult; build a new one per run."""

    def __init__(self, cfg: SimConfig, *, trace: bool = False) -> None:
        check(cfg)
        self.cfg = cfg
        p = cfg.pipeline
        self.R, self.n, self.K, self.eta = (
            p.required_samples,
            p.samples_per_prompt,
            p.trigger_parameter_sync_step,
            p.max_staleness,
        )
        self.manager = StalenessManager(groups_per_version(self.R, self.K), max_staleness=self.eta)
        self.controller = StalenessController(cfg.adaptive.rule(), self.eta) if cfg.adaptive.enable else None
        self.next_eta = self.eta  # decided at a sync, applied when it completes
        self.rng = random.Random(cfg.seed)
        self.sample_length = cfg.lengths.sampler()
        self.engines = [_Engine() for _ in range(p.num_engines)]
        self.ready_engines = list(range(p.num_engines))  # active and ready: where new work goes, in index order
        self.engine_version = 0  # the version the engines hold (a joining engine gets it)
        self.engines_paused = False  # a sync's pause is on
        self.orphans: deque[_Request] = deque()  # samples in flight with no engine (the schedule at 0)
        self.empty_since: float | None = None  # when the engine count last fell to 0
        self.decoded = 0.0  # tokens decoded so far, over all engines
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.t = 0.0
        self.version = 0  # executor's and trainer's version (bumped when a sync completes)
        self.running_samples = 0
        self.next_rid = 0
        self.queue: deque[_Group] = deque()
        self.outbox: deque[_Group] = deque()  # finished, kept, waiting for queue space (back-pressure)
        self.draining = False  # a sync without partial rollout is waiting for running requests
        self.step = 0
        self.fresh: list[_Group] = []
        self.requested = 0
        self.trainer_state = "wait"
        self.wait_started = 0.0
        self.step_wait = 0.0
        self.sync_started = 0.0
        self.speed = 1.0  # host sharing factor now (HostModel.speed)
        self.train_left = 0.0  # uncontended seconds left of the step being trained
        self.train_at = 0.0  # when train_left was last brought up to date
        self.train_started = 0.0
        self.train_tokens = 0
        self.train_epoch = 0
        self.trace: list[tuple[Any, ...]] | None = [] if trace else None
        self.result = SimResult(0.0, 0, 0, 0.0, 0.0, 0.0, 0.0, p.num_engines, 0, 0, {}, 0, 0)
        self.segment = Segment(0.0, p.num_engines, eta=self.eta)
        self.result.segments.append(self.segment)
        for at, count in cfg.schedule():
            if at > 0:  # the count at 0 s is the run's own (model.check_schedule)
                self._push(at, "schedule", count)

    # ---- clock ------------------------------------------------------------------------------------------

    def _push(self, at: float, kind: str, data: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, data))

    def run(self) -> SimResult:
        self._try_start()
        self._trainer_poll()
        self._reshare()
        while self.trainer_state != "done":
            if not self.events:
                raise RuntimeError(f"simulation stalled at t={self.t:.3f}s, step {self.step}: no event pending")
            at, _, kind, data = heapq.heappop(self.events)
            self.t = at
            getattr(self, f"_on_{kind}")(data)
            self._reshare()
        for engine in self.engines:
            self._advance(engine)
            self.result.engine_busy_s += engine.busy_s
            self.result.engine_paused_s += engine.paused_s
        self._close_segment()
        r = self.result
        r.wall_s, r.steps, r.tokens_decoded = self.t, self.step, self.decoded
        r.engine_s = sum((self.t if e.left_at is None else e.left_at) - e.joined_at for e in self.engines)
        r.final_eta = self.eta if self.controller is not None else None
        r.trace = self.trace or []
        return r

    def _note(self, *event: Any) -> None:
        if self.trace is not None:
            self.trace.append(event)

    # ---- engines -----------------------------------------------------------------------------------------

    def _advance(self, engine: _Engine) -> None:
        dt = self.t - engine.last_t
        if engine.paused:
            engine.paused_s += dt
        elif engine.running:
            advanced = dt * self.cfg.engine.per_request_rate(len(engine.running)) * self.speed
            engine.progress += advanced
            self.decoded += advanced * len(engine.running)
            engine.busy_s += dt
        engine.last_t = self.t

    def _schedule(self, index: int) -> None:
        engine = self.engines[index]
        engine.epoch += 1
        if engine.paused or not engine.running:
            return
        rate = self.cfg.engine.per_request_rate(len(engine.running)) * self.speed
        self._push(self.t + max(engine.heap[0][0] - engine.progress, 0.0) / rate, "engine", (index, engine.epoch))

    def _admit(self, engine: _Engine, rid: int, request: _Request) -> None:
        request.start = engine.progress - request.done  # a moved sample continues from its tokens
        request.target = request.start + request.length
        if not request.done:
            request.version = engine.version
        engine.running[rid] = request
        heapq.heappush(engine.heap, (request.target, rid))

    def _on_engine(self, data: tuple[int, int]) -> None:
        index, epoch = data
        engine = self.engines[index]
        if epoch != engine.epoch:
            return  # superseded: the engine's load changed after this event was scheduled
        self._advance(engine)
        done = []
        while engine.heap and engine.heap[0][0] <= engine.progress + _EPS * max(1.0, engine.progress):
            _, rid = heapq.heappop(engine.heap)
            done.append(engine.running.pop(rid))
        limit = self.cfg.engine.max_running_requests
        while engine.waiting and len(engine.running) < limit:
            self._admit(engine, *engine.waiting.popleft())
        self._schedule(index)
        for request in done:
            self._finish_sample(request, engine.version)
        self._maybe_sync_after_drain()
        self._try_start()

    def _finish_sample(self, request: _Request, engine_version: int) -> None:
        group = request.group
        self.result.tokens_generated += request.length
        self.running_samples -= 1
        group.tokens += request.length
        version = engine_version if request.version is None else request.version
        group.mixed += int(version != engine_version)  # a sync came between its first and last token
        group.min_version = version if group.min_version is None else min(group.min_version, version)
        group.remaining -= 1
        if group.remaining:
            return
        self.manager.on_finish(accepted=group.accept)
        self._note("finish", group.accept)
        if group.accept:
            self.outbox.append(group)
            self._flush()

    # ---- executor ----------------------------------------------------------------------------------------

    def _try_start(self) -> None:
        """RolloutExecutor._can_start, then start, until it says no."""
        cap = self.cfg.pipeline.max_concurrent_rollouts
        while not self.draining and self.ready_engines and (cap is None or self.running_samples + self.n <= cap):
            capacity = self.manager.capacity(self.version)
            self._note("capacity", self.version, capacity)
            if capacity <= 0:
                return
            self.manager.on_start()
            self._note("start")
            self._start_group()

    def _start_group(self) -> None:
        """Start one group: its samples go together, as one batched request, to the engine with the fewest
        requests (running + waiting), as the runtime's single-turn groups do (EnginePool.pick, generate_batch)."""
        group = _Group(self.n, accept=self.rng.random() >= self.cfg.pipeline.reject_fraction)
        self.running_samples += self.n
        limit = self.cfg.engine.max_running_requests
        index = self._least_loaded()
        engine = self.engines[index]
        self._advance(engine)
        sample, rng, running, waiting = self.sample_length, self.rng, engine.running, engine.waiting
        for rid in range(self.next_rid, self.next_rid + self.n):  # the per-sample loop is the simulator's hot path
            request = _Request(group, sample(rng))
            if len(running) < limit and not waiting:
                self._admit(engine, rid, request)
            else:
                waiting.append((rid, request))
        self.next_rid += self.n
        self._schedule(index)

    def _least_loaded(self) -> int:
        """The ready engine with the fewest requests (running + waiting), the lowest index among equals."""
        engines = self.engines
        return min(self.ready_engines, key=lambda i: len(engines[i].running) + len(engines[i].waiting))

    def _flush(self) -> None:
        self._move_outbox()
        self._trainer_poll()

    def _move_outbox(self) -> None:
        limit = self.cfg.pipeline.queue_max_groups
        while self.outbox and (limit is None or len(self.queue) < limit):
            self.queue.append(self.outbox.popleft())

    # ---- trainer -----------------------------------------------------------------------------------------

    def _trainer_poll(self) -> None:
        """FullyAsyncTrainer.take_batch: get `need - fresh` oldest groups once that many are queued; drop stale."""
        while self.trainer_state == "wait":
            if not self.requested:
                self.requested = self.R - len(self.fresh)
            if len(self.queue) < self.requested:
                return
            got = [self.queue.popleft() for _ in range(self.requested)]
            self.requested = 0
            kept, stale = self.manager.bounds.split(got, self.version)  # type: ignore[arg-type]
            self._note("split", self.version, tuple(g.min_version for g in got), len(stale))
            self.fresh.extend(kept)
            if stale:
                self.manager.on_discarded(len(stale))
                self.result.dropped_stale_groups += len(stale)
            self._move_outbox()
            if stale:
                self._try_start()
            if len(self.fresh) == self.R:
                self._start_training()

    def _start_training(self) -> None:
        waited = self.t - self.wait_started
        self.result.trainer_wait_s += waited
        self.step_wait = waited
        self.trainer_state = "train"
        self.train_tokens = sum(g.tokens for g in self.fresh)
        c = self.cfg
        self.train_left = c.trainer.step_s(self.train_tokens, c.trainer_gpus, c.separated)
        self.result.trainer_work_s += self.train_left
        self.train_at = self.train_started = self.t
        self._reshare()
        self._schedule_trainer()

    def _schedule_trainer(self) -> None:
        self.train_epoch += 1
        self._push(self.t + max(self.train_left, 0.0) / self.speed, "trained", self.train_epoch)

    def _on_trained(self, epoch: int) -> None:
        if epoch != self.train_epoch:
            return  # superseded: the host's sharing changed after this event was scheduled
        tokens, self.train_left = self.train_tokens, 0.0
        self.result.trainer_busy_s += self.t - self.train_started
        self.result.step_busy_s.append(self.t - self.train_started)
        self.result.step_tokens.append(tokens)
        batch, self.fresh = self.fresh, []
        self.step += 1
        self.manager.on_consumed(len(batch))
        self._note("consumed", len(batch))
        r = self.result
        r.tokens_trained += tokens
        batch_staleness = []
        for group in batch:
            staleness = self.version - (group.min_version or 0)
            batch_staleness.append(staleness)
            r.staleness[staleness] = r.staleness.get(staleness, 0) + 1
            r.mixed_version_samples += group.mixed
        r.step_wait_s.append(self.step_wait)
        seg = self.segment
        seg.steps += 1
        seg.tokens_trained += tokens
        for staleness in batch_staleness:
            seg.staleness[staleness] = seg.staleness.get(staleness, 0) + 1
        if self.controller is not None:
            signals = self.cfg.adaptive.signals(sum(batch_staleness) / max(1, len(batch_staleness)))
            step_s = self.step_wait + (self.t - self.train_started)
            self.controller.observe(signals, trainer_wait=self.step_wait / step_s if step_s > 0 else 0.0)
        if is_sync_step(self.step, self.K):
            if self.controller is not None:
                decision = self.controller.decide()
                self.next_eta = decision.after
                r.eta_changes += [(self.step, decision.before, decision.after)] if decision.changed else []
            self._note("sync", self.step, self.version + 1)
            self.trainer_state = "sync"
            self.sync_started = self.t
            if self.cfg.pipeline.partial_rollout:
                self._begin_pause()
            else:
                self.draining = True
                self._maybe_sync_after_drain()
            return
        self._step_done()

    def _step_done(self) -> None:
        self.result.step_end_s.append(self.t)
        if self.step >= self.cfg.steps:
            self.trainer_state = "done"
            return
        self.trainer_state = "wait"
        self.wait_started = self.t
        self._trainer_poll()

    # ---- host sharing ------------------------------------------------------------------------------------------

    def _reshare(self) -> None:
        """Re-evaluate the sharing factor; when it changed, bring every clock up to now at the old one and
        reschedule the completions at the new one."""
        busy = sum(1 for e in self.engines if e.running and not e.paused)
        speed = self.cfg.host.speed(self.trainer_state == "train", busy)
        if speed == self.speed:
            return
        for engine in self.engines:
            self._advance(engine)
        if self.trainer_state == "train":
            self.train_left -= (self.t - self.train_at) * self.speed
            self.train_at = self.t
        self.speed = speed
        for index in range(len(self.engines)):
            self._schedule(index)
        if self.trainer_state == "train":
            self._schedule_trainer()

    # ---- weight sync -------------------------------------------------------------------------------------

    def _maybe_sync_after_drain(self) -> None:
        if self.draining and self.trainer_state == "sync" and self.running_samples == 0:
            self._begin_pause()

    def _begin_pause(self) -> None:
        self.engines_paused = True
        for engine in self.engines:
            self._advance(engine)
            engine.paused = engine.active
        for index in range(len(self.engines)):
            self._schedule(index)  # cancels pending completions
        self._push(self.t + self.cfg.sync.pause_s, "pause_end")
        self._push(self.t + self.cfg.sync.total_s, "sync_done")

    def _on_pause_end(self, _: Any) -> None:
        self.engines_paused = False
        self.engine_version = self.version + 1
        for index, engine in enumerate(self.engines):
            self._advance(engine)
            engine.paused = False
            engine.version = self.engine_version
            for request in engine.running.values():
                if request.start == engine.progress:  # no token yet: its first token has the new version
                    request.version = engine.version
            self._schedule(index)

    def _on_sync_done(self, _: Any) -> None:
        self.version += 1
        if self.next_eta != self.eta:  # the trainer's next request carries the η decided at this sync
            self.eta = self.next_eta
            self.manager.set_max_staleness(self.eta, self.version)
        self.result.syncs += 1
        self.result.trainer_sync_s += self.t - self.sync_started
        self.draining = False
        self._try_start()
        self._step_done()

    # ---- the engine schedule ---------------------------------------------------------------------------------

    def _on_schedule(self, count: int) -> None:
        """The engine count becomes `count` (model.py's engine_schedule): engines join, or the last joined leave
        and their samples move to the others."""
        active = [i for i, e in enumerate(self.engines) if e.active]
        if count == len(active):
            return  # no change: the stretch goes on
        for engine in self.engines:
            self._advance(engine)
        self._close_segment()
        self.segment = Segment(self.t, count, change=count - len(active), eta=self.eta)
        self.result.segments.append(self.segment)
        moved: list[_Request] = []
        for index in active[count:]:
            moved += self._remove(index)
        for _ in range(count - len(active)):
            self._join()
        self.segment.samples_moved = len(moved)
        self.result.samples_moved += len(moved)
        self.orphans.extend(moved)
        if count == 0:
            self.empty_since = self.t
            timeout = self.cfg.pipeline.no_engine_timeout_s
            if timeout is not None:
                self._push(self.t + timeout, "no_engine", self.t)
        else:
            self.empty_since = None
        self._place_orphans()
        self._try_start()

    def _remove(self, index: int) -> list[_Request]:
        """Take engine `index` out; its samples in flight, with the tokens each has (running ones)."""
        engine = self.engines[index]
        engine.active = engine.ready = engine.paused = False
        engine.left_at = self.t
        if index in self.ready_engines:
            self.ready_engines.remove(index)
        out = []
        for request in engine.running.values():
            request.done = min(max(engine.progress - request.start, 0.0), float(request.length))
            out.append(request)
        out += [request for _, request in engine.waiting]
        engine.running.clear()
        engine.heap.clear()
        engine.waiting.clear()
        self._schedule(index)  # cancels its pending completion
        return out

    def _join(self) -> None:
        engine = _Engine()
        engine.last_t = engine.joined_at = self.t
        engine.version, engine.paused = self.engine_version, self.engines_paused
        self.engines.append(engine)
        index = len(self.engines) - 1
        if self.cfg.engine.join_s > 0:
            engine.ready = False
            self._push(self.t + self.cfg.engine.join_s, "ready", index)
        else:
            self.ready_engines.append(index)

    def _on_ready(self, index: int) -> None:
        engine = self.engines[index]
        if not engine.active:
            return  # removed while it was still starting
        engine.ready = True
        engine.last_t = self.t
        self.ready_engines.append(index)
        self.ready_engines.sort()
        self._place_orphans()
        self._try_start()

    def _place_orphans(self) -> None:
        """Samples without an engine go to the ready ones, the fewest requests first: with partial rollout from
        their tokens (token-level resume), without it from their prompts (their tokens so far counted again)."""
        if not self.ready_engines or not self.orphans:
            return
        limit, touched = self.cfg.engine.max_running_requests, set()
        while self.orphans:
            request = self.orphans.popleft()
            if request.done and not self.cfg.pipeline.partial_rollout:
                regenerated = round(request.done)
                self.segment.tokens_regenerated += regenerated
                self.result.tokens_regenerated += regenerated
                request.done, request.version = 0.0, None
            index = self._least_loaded()
            engine = self.engines[index]
            rid = self.next_rid
            self.next_rid += 1
            if len(engine.running) < limit and not engine.waiting:
                self._admit(engine, rid, request)
            else:
                engine.waiting.append((rid, request))
            touched.add(index)
        for index in touched:
            self._schedule(index)

    def _on_no_engine(self, since: float) -> None:
        if self.empty_since == since:  # no engine joined since the count fell to 0
            self.result.stopped = f"no engine for {self.cfg.pipeline.no_engine_timeout_s:g}s from {since:g}s"
            self.trainer_state = "done"

    def _close_segment(self) -> None:
        seg = self.segment
        seg.end_s, seg.eta = self.t, self.eta
        seg.tokens_decoded = self.decoded - sum(s.tokens_decoded for s in self.result.segments[:-1])


def simulate(cfg: SimConfig, *, trace: bool = False) -> SimResult:
    """Run one simulation (see the module docstring); `trace` records every policy decision for tests."""
    return Simulation(cfg, trace=trace).run()
