"""Continuous-batching scheduler of the embedded engine (asyncio; no HTTP here).

One asyncio task owns the decode loop. Each iteration, between forward passes, it:
  1. applies a pending weight swap if no row is running (so a swap is atomic: no step ever sees half-new
     weights, and no response mixes tokens of two versions);
  2. drops finished or aborted rows from the batched KV cache;
  3. admits waiting requests (FIFO, up to `max_running_requests` rows and `max_prefill_tokens` prompt tokens)
     and prefills them together in one forward pass;
  4. runs one decode forward pass for every running row.
Forward passes run in a worker thread (`asyncio.to_thread`) so the event loop keeps serving HTTP, aborts and
weight loading meanwhile; every other state change happens on the loop, between passes, so nothing is locked.

Guarantees the HTTP layer and the client rely on (they mirror SGLang 0.5.6):
- `pause("abort")` finishes every queued and running request at once with what it has (finish reason abort) and
  holds newly arriving requests until `resume()`; they then run normally. `pause("in_place"|"retract")` stops
  stepping but keeps the running requests (their KV stays), and `resume()` continues them.
- `swaps.update_weights_from_disk` loads the new model off the loop while decoding goes on, then stops admitting,
  waits for the running requests to finish (as SGLang's model-update writer lock does), swaps, and re-opens
  admission. Each response therefore carries the single `weight_version` that produced all its tokens. That
  protocol lives in `weights.py` (`Scheduler.swaps`); this loop only applies the pending swap (step 1).
- Every request's tokens, log-probs and version come from one model; the version is the one at its prefill.
- A request with a `sampling_seed` draws its tokens from its seed and positions alone (sampling.py); the others
  share one seeded generator, reproducible for the same arrival order and batch makeup. Its log-probs still depend
  on the batch in the last bits (a CPU matmul rounds differently for another number of rows, ~1e-6 here).
- `deterministic=True` (SGLang's `--enable-deterministic-inference`): every request has a seed (SGLang's default,
  42, when it sends none) and runs alone, one at a time, so its tokens and log-probs are bit-identical whatever
  else was sent; SGLang gets there with batch-invariant kernels, which a CPU matmul does not offer. Throughput is
  one request's.
- LoRA (`lora`, an engine started with `--enable-lora`; the protocol is SGLang's, `lora_serving.py`): a request
  naming an adapter (`lora_path`) takes it after the pause gate and holds it until it ends, so every token it
  generates comes from that adapter, and an unload of it waits for the request. Loads and unloads never pause the
  loop. Admission is FIFO under SGLang's `--max-loras-per-batch` rule (the base model counting as one adapter):
  the first waiting request whose adapter does not fit the running batch waits, and so do those behind it. Rows of
  different adapters share every forward pass (`lora.LoRALayers`).
- `slow_down(seconds)` (SGLang's `/slow_down`, `Scheduler.run_batch`'s `forward_sleep_time`) sleeps that long before
  every step, so a test can catch a request mid-decode: the tiny test models decode 240 tokens in 0.2 s, a window a
  loaded machine misses. The sleep is on the loop, as SGLang's is in its scheduler process: HTTP keeps answering.
- `generate_stream` (SGLang's `stream: true`) yields the request so far after each new token, the latest state only
  when several tokens came between two reads (as SGLang's tokenizer manager keeps only its last output), then the
  finished request.
- `decode_hold` is a TEST-ONLY control (`decode_hold.py`, not SGLang's): armed, it admits the requests it names
  together once all have arrived and stops forward passes at the first step boundary where they are decoding, so a
  test acts on them however slow the machine is.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from rllm.experimental.fully_async.engines.embedded.decode_hold import DecodeHold
from rllm.experimental.fully_async.engines.embedded.lora import LoRAAdapter
from rllm.experimental.fully_async.engines.embedded.lora_serving import LoRAServing
from rllm.experimental.fully_async.engines.embedded.model_runner import ModelRunner
from rllm.experimental.fully_async.engines.embedded.requests import GenerateOutput, WeightUpdateError, _Request
from rllm.experimental.fully_async.engines.embedded.sampling import (
    DEFAULT_SAMPLING_SEED,
    SampleOutput,
    SamplingParams,
)
from rllm.experimental.fully_async.engines.embedded.weights import WeightLoader, WeightSwaps

# WeightUpdateError is re-exported: the HTTP layers catch it from here.
__all__ = ["PAUSE_MODES", "GenerateOutput", "Scheduler", "WeightUpdateError", "interleave_streams"]

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "in_place", "retract")
_T = TypeVar("_T")


class Scheduler:
    """Continuous batching over a `ModelRunner`, with SGLang's pause/abort/update semantics."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_running_requests: int = 256,
        max_prefill_tokens: int = 16384,
        weight_version: str = "0",
        weight_loader: WeightLoader,
        deterministic: bool = False,
        lora: LoRAServing | None = None,
    ) -> None:
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
        self.runner = runner
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.deterministic = deterministic
        self.weight_version = weight_version
        self.lora = lora  # None: the engine serves the base model only (no --enable-lora)
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []  # row order of runner's KV cache
        self._by_rid: dict[str, _Request] = {}
        self._paused_mode: str | None = None
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._wake = asyncio.Event()
        self.swaps = WeightSwaps(self, weight_loader)
        self._task: asyncio.Task[None] | None = None
        self._pass_in_progress = False  # a forward pass runs in the worker thread: the KV cache is not ours
        self.forward_sleep_s: float | None = None  # SGLang's /slow_down: a sleep before every step
        self.decode_hold = DecodeHold(self.wake)  # test-only (decode_hold.py); inert unless armed
        self.stats: dict[str, int] = {
            "requests_finished": 0,
            "requests_aborted": 0,
            "generated_tokens": 0,
            "weight_updates": 0,
            "max_running_seen": 0,
            "max_adapters_in_pass": 0,  # distinct LoRA adapters (base model excluded) in one forward pass, at most
            "lora_admission_waits": 0,  # steps where a waiting request's adapter did not fit --max-loras-per-batch
        }

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the decode loop on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="embedded-engine-decode-loop")

    async def stop(self) -> None:
        """Stop the loop and abort whatever is still queued or running."""
        self.abort_all("engine shutting down")
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def paused(self) -> bool:
        return self._paused_mode is not None

    @property
    def paused_mode(self) -> str | None:
        return self._paused_mode

    @property
    def num_running(self) -> int:
        return len(self._running)

    def wake(self) -> None:
        """Make the loop look at its state again (a swap was queued or withdrawn)."""
        self._wake.set()

    def snapshot(self) -> dict[str, Any]:
        """Counters for /get_server_info (forward passes prove batching)."""
        return {
            **self.stats,
            **self.swaps.loader.counts,
            "forward_passes": self.runner.forward_passes,
            "prefill_passes": self.runner.prefill_passes,
            "num_running": len(self._running),
            "num_waiting": len(self._waiting),
            "paused": self._paused_mode,
            "weight_version": self.weight_version,
            "kv_cache_columns": self.runner.cache_columns,
            "deterministic": self.deterministic,
            **(self.lora.stats if self.lora is not None else {}),
        }

    # ---------------------------------------------------------------- requests
    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        rid: str,
        lora_path: str | None = None,
        *,
        on_token: Callable[[_Request], None] | None = None,
    ) -> GenerateOutput:
        """Queue one request and wait for it; holds while paused. Raises ValueError for invalid input.
        `lora_path`: the name of the LoRA adapter to generate with (SGLang's field), None for the base model.
        `on_token(request)` is called after each token the request gets (`generate_stream`'s listener)."""
        self._validate(input_ids, rid)
        if lora_path is not None and self.lora is None:
            raise ValueError(f"lora_path {lora_path!r} names an adapter, but this engine runs without --enable-lora")
        if self.deterministic and params.sampling_seed is None:
            params = dataclasses.replace(params, sampling_seed=DEFAULT_SAMPLING_SEED)  # as SGLang's default
        loop = asyncio.get_running_loop()
        max_new = min(params.max_new_tokens, self.runner.info.context_length - len(input_ids))
        req = _Request(rid, list(input_ids), params, max_new, loop.create_future(), on_token=on_token)
        self._by_rid[rid] = req
        try:
            # Held here while paused (SGLang: is_pause_cond); the caller's HTTP timeout bounds the wait and a
            # disconnect cancels it. An /abort_request for it ends the wait too.
            while self._paused_mode is not None and not req.done:
                req.held = True
                unpaused = loop.create_task(self._unpaused.wait())
                try:
                    await asyncio.wait([unpaused, req.future], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    unpaused.cancel()
            req.held = False
            if lora_path is not None and not req.done:
                assert self.lora is not None  # checked above
                req.adapter = await self.lora.acquire(lora_path)  # after the pause gate, as SGLang
            if req.done:
                return await req.future
            if max_new <= 0:
                self._finish(req, {"type": "length", "length": max_new})
            else:
                self._waiting.append(req)
                self._wake.set()
            return await req.future
        except asyncio.CancelledError:
            self._abandon(req)
            raise
        finally:
            self._by_rid.pop(rid, None)
            if req.adapter is not None and self.lora is not None:
                self.lora.release(req.adapter)  # its rows are done: the loop drops them before any unload acts

    async def generate_stream(
        self, input_ids: list[int], params: SamplingParams, rid: str, lora_path: str | None = None
    ) -> AsyncIterator[GenerateOutput]:
        """`generate`, streamed: after each new token the request so far (`finish_reason` None), then the finished
        request. A reader slower than the decode loop gets the latest state only (SGLang's tokenizer manager keeps
        its last output too). Raises ValueError for invalid input; closing the iterator abandons the request."""
        latest: list[_Request] = []
        new_tokens = asyncio.Event()

        def on_token(req: _Request) -> None:
            latest[:] = [req]
            new_tokens.set()

        result = asyncio.ensure_future(self.generate(input_ids, params, rid, lora_path, on_token=on_token))
        try:
            while True:
                tokens = asyncio.ensure_future(new_tokens.wait())
                try:
                    await asyncio.wait([result, tokens], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    tokens.cancel()
                if result.done():
                    yield result.result()
                    return
                new_tokens.clear()
                if latest[0].done:  # finished with this token: the last chunk, on its way, carries it
                    continue
                yield self._so_far(latest[0])
        finally:
            if not result.done():
                result.cancel()  # the reader went away: generate's cancellation frees the request's row
                with contextlib.suppress(asyncio.CancelledError):
                    await result

    def _so_far(self, req: _Request) -> GenerateOutput:
        """A running request's snapshot, as a streamed chunk reports it."""
        return GenerateOutput(
            rid=req.rid,
            output_ids=list(req.output_ids),
            output_logprobs=list(req.logprobs),
            finish_reason=None,
            prompt_tokens=len(req.input_ids),
            weight_version=req.weight_version if req.weight_version is not None else self.weight_version,
            e2e_latency=None,
        )

    def _validate(self, input_ids: list[int], rid: str) -> None:
        vocab = self.runner.info.vocab_size
        if not input_ids:
            raise ValueError("input_ids is empty")
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in input_ids):
            raise ValueError(f"input_ids must be ints in [0, {vocab})")
        if len(input_ids) >= self.runner.info.context_length:
            raise ValueError(
                f"prompt of {len(input_ids)} tokens does not fit the context length {self.runner.info.context_length}"
            )
        if rid in self._by_rid:
            raise ValueError(f"a request with rid {rid!r} is already in flight")

    def abort(self, rid: str, message: str = "aborted by /abort_request") -> bool:
        """Finish request `rid` now with what it has (finish reason abort). False if it is not in flight."""
        req = self._by_rid.get(rid)
        if req is None or req.done:
            return False
        self._finish(req, {"type": "abort", "message": message})
        return True

    def abort_all(self, message: str = "aborted", *, include_held: bool = True) -> int:
        """Abort every queued and running request (and held ones unless told not to); returns how many."""
        count = 0
        for req in list(self._by_rid.values()):
            if not req.done and (include_held or not req.held):
                self._finish(req, {"type": "abort", "message": message})
                count += 1
        return count

    def waiting_rids(self) -> set[str]:
        """Requests queued but not yet prefilled (SGLang's waiting queue); held requests are not among them."""
        return {req.rid for req in self._waiting if not req.done}

    def _abandon(self, req: _Request) -> None:
        """The caller went away (HTTP disconnect): free its slot without resolving anything."""
        if not req.done:
            req.done = True
            self.stats["requests_aborted"] += 1
            if not req.future.done():
                req.future.cancel()
            self._wake.set()

    def _finish(self, req: _Request, finish_reason: dict[str, Any]) -> None:
        if req.done:
            return
        req.done = True
        if finish_reason["type"] == "abort":
            self.stats["requests_aborted"] += 1
        else:
            self.stats["requests_finished"] += 1
        if not req.future.done():
            req.future.set_result(
                GenerateOutput(
                    rid=req.rid,
                    output_ids=list(req.output_ids),
                    output_logprobs=list(req.logprobs),
                    finish_reason=finish_reason,
                    prompt_tokens=len(req.input_ids),
                    weight_version=req.weight_version if req.weight_version is not None else self.weight_version,
                    e2e_latency=time.monotonic() - req.arrived,
                )
            )
        self._wake.set()  # the loop drops the row between steps

    # ---------------------------------------------------------------- pause / resume
    def pause(self, mode: str = "abort") -> int:
        """Pause generation; with mode abort, in-flight requests return at once. Returns how many were aborted."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._paused_mode = mode
        self._unpaused.clear()
        # Requests already held by an earlier pause stay held: aborting them would only make clients re-send.
        aborted = self.abort_all("generation paused (mode=abort)", include_held=False) if mode == "abort" else 0
        logger.info("generation paused (mode=%s, aborted %d requests)", mode, aborted)
        return aborted

    def resume(self) -> None:
        """Continue generation; held requests are admitted, in-place paused ones continue."""
        self._paused_mode = None
        self._unpaused.set()
        self._wake.set()
        logger.info("generation continued")

    def slow_down(self, forward_sleep_s: float | None) -> None:
        """Sleep `forward_sleep_s` before every step from now on; None or <= 0 ends it (SGLang's `slow_down`)."""
        self.forward_sleep_s = forward_sleep_s if forward_sleep_s is not None and forward_sleep_s > 0 else None
        logger.info("forward sleep set to %s s", self.forward_sleep_s)

    # ---------------------------------------------------------------- weights (updates: `self.swaps`)
    def set_weight_version(self, new_version: str) -> None:
        """Relabel the current weights (SGLang /update_weight_version); requests already admitted keep theirs."""
        self.weight_version = new_version

    def flush_cache(self) -> bool:
        """Drop the KV cache; as SGLang, refuse while requests are running (True if flushed)."""
        if self._running or self._waiting or self._pass_in_progress:
            return False
        self.runner.clear()
        return True

    # ---------------------------------------------------------------- the loop
    def _has_work(self) -> bool:
        if self.swaps.pending is not None and not self._running:
            return True
        if self.decode_hold.holds(self._running, self._waiting):  # test-only: no pass until it is released
            return False
        if self._running and self._paused_mode not in ("in_place", "retract"):
            return True
        if self.decode_hold.gates(self._running, self._waiting):  # test-only: admits once all its requests are here
            return False
        return bool(self._waiting) and self._paused_mode is None and self.swaps.pending is None

    async def _loop(self) -> None:
        while True:
            self._drop_done_rows()
            if not self._has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # A failed forward pass (e.g. out of memory) fails the requests in the batch, not the engine.
                logger.exception("forward pass failed; failing %d running requests", len(self._running))
                for req in self._running:
                    if not req.done:
                        req.done = True
                        if not req.future.done():
                            req.future.set_exception(RuntimeError(f"forward pass failed: {exc}"))
                self._running = []
                self.runner.clear()

    async def _step(self) -> None:
        if self.forward_sleep_s is not None:
            await asyncio.sleep(self.forward_sleep_s)
            self._drop_done_rows()  # rows aborted during the sleep
            if not self._has_work():
                return
        if self.swaps.pending is not None and not self._running:
            await self.swaps.apply_pending(self._in_thread)
            return
        admitted = self._admit()
        if admitted:
            for req in admitted:
                req.weight_version = self.weight_version
            # Rows join before the pass so a failure below fails them too and the row order matches the cache.
            self._running.extend(admitted)
            out = await self._in_thread(
                self.runner.prefill,
                [r.input_ids for r in admitted],
                [r.params for r in admitted],
                self._adapters(admitted),
            )
            self._consume(admitted, out)
            self._drop_done_rows()
        if self._running and self._paused_mode is None and not self.decode_hold.holds(self._running, self._waiting):
            rows = list(self._running)
            out = await self._in_thread(
                self.runner.decode, [r.output_ids[-1] for r in rows], [r.params for r in rows], self._adapters(rows)
            )
            self._consume(rows, out)
        self.stats["max_running_seen"] = max(self.stats["max_running_seen"], len(self._running))

    def _adapters(self, rows: list[_Request]) -> list[LoRAAdapter | None] | None:
        """Each row's adapter for a forward pass (None when LoRA is off)."""
        if self.lora is None:
            return None
        adapters = [r.adapter for r in rows]
        distinct = len({a.lora_id for a in adapters if a is not None})
        self.stats["max_adapters_in_pass"] = max(self.stats["max_adapters_in_pass"], distinct)
        return adapters

    async def _in_thread(self, fn: Callable[..., _T], *args: Any) -> _T:
        self._pass_in_progress = True
        try:
            return await asyncio.to_thread(fn, *args)
        finally:
            self._pass_in_progress = False

    def _admit(self) -> list[_Request]:
        if self._paused_mode is not None or self.swaps.pending is not None:
            return []
        if self.decode_hold.gates(self._running, self._waiting):
            return []
        admitted: list[_Request] = []
        budget = self.max_prefill_tokens
        limit = 1 if self.deterministic else self.max_running_requests  # alone: nothing else in its batch
        batch_loras = {r.lora_id for r in self._running}
        while self._waiting and len(self._running) + len(admitted) < limit:
            req = self._waiting[0]
            if req.done:
                self._waiting.popleft()
                continue
            if self.lora is not None and not self.lora.can_run(batch_loras | {req.lora_id}):
                self.stats["lora_admission_waits"] += 1  # SGLang: batch_is_full, admission stops here (FIFO)
                break
            if admitted and len(req.input_ids) > budget:
                break
            batch_loras.add(req.lora_id)
            budget -= len(req.input_ids)
            admitted.append(self._waiting.popleft())
        return admitted

    def _consume(self, rows: list[_Request], out: SampleOutput) -> None:
        """Append each row's sampled token and finish the rows that hit a stop condition."""
        eos = self.runner.info.eos_token_ids
        for req, token, logprob in zip(rows, out.token_ids, out.logprobs, strict=True):
            if req.done:  # aborted while the pass ran: its token is discarded
                continue
            req.output_ids.append(token)
            req.logprobs.append(logprob)
            self.stats["generated_tokens"] += 1
            if req.on_token is not None:
                req.on_token(req)
            params = req.params
            # SGLang's check_finished order: length first, then stop tokens (ignore_eos disables both kinds).
            if len(req.output_ids) >= req.max_new_tokens:
                self._finish(req, {"type": "length", "length": req.max_new_tokens})
            elif not params.ignore_eos and (token in eos or token in params.stop_token_ids):
                self._finish(req, {"type": "stop", "matched": token})

    def _drop_done_rows(self) -> None:
        if any(r.done for r in self._running):
            keep = [i for i, r in enumerate(self._running) if not r.done]
            self.runner.retain(keep)
            self._running = [self._running[i] for i in keep]
        while self._waiting and self._waiting[0].done:
            self._waiting.popleft()


async def interleave_streams(
    streams: list[AsyncIterator[GenerateOutput]],
) -> AsyncIterator[tuple[int, GenerateOutput]]:
    """(index, chunk) from the streams of a batch's prompts, each as it comes: SGLang's streamed batch
    (tokenizer_manager._handle_batch_request waits on every prompt's next output, FIRST_COMPLETED). Closes them all
    on exit, so a reader that goes away abandons every prompt."""
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                index = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                yield index, out
                pending[asyncio.ensure_future(anext(streams[index]))] = index
    finally:
        for task in pending:
            task.cancel()
        # A stream is closed only once its pending read has ended (an async generator cannot close mid-read).
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
