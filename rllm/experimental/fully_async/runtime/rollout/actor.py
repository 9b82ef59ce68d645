"""Ray actor shell of the rollout service (RolloutService in service.py), plus validation through the same engines.

One async actor, one process (docs/design.md#rule-one-rollout-service): the executor loop, the queue, the staleness
budget and the ledger share its event loop. The trainer calls `take_batch` once per step; the driver polls validations
after every step (collecting the finished ones, starting one when due), writes the rollout part of checkpoints,
routes rollouts to restarted engines and stops the rollouts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

import ray

from rllm.experimental.fully_async.api.step_messages import Ack, Batch, BatchRequest
from rllm.experimental.fully_async.core.elastic import SampleMoves
from rllm.experimental.fully_async.engines.lora import adapter_version
from rllm.experimental.fully_async.observe.dumps import write_episodes
from rllm.experimental.fully_async.run_spec import RunSpec
from rllm.experimental.fully_async.runtime.rollout.build import build_rollout_process
from rllm.experimental.fully_async.runtime.rollout.validation import (
    BackgroundValidation,
    evaluate,
    evaluate_episodes,
    pinned_version,
)

logger = logging.getLogger(__name__)


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
        logging.basicConfig(level=os.environ.get("RLLM_LOG_LEVEL", "WARNING"))
        process = build_rollout_process(spec, engine_urls, state, queued, api_key)
        self.spec, self.service, self.client, self.tokenizer = spec, process.service, process.client, process.tokenizer
        self.pool, self.reward_fn, self.gate = process.pool, process.reward_fn, process.gate
        self.workflow, self.val_workflow, self.val = process.workflow, process.val_workflow, process.val_prompts
        self.gate_timeout_s = spec.param_sync.timeout_s
        self.validations = BackgroundValidation()

    async def run(self) -> dict:
        return await self.service.run()

    async def take_batch(self, request: BatchRequest) -> Batch:
        batch = await self.service.take_batch(request)
        if self.validations.running:
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

    def interrupt(self) -> None:
        """The run is stopping: release the trainer's wait for a batch (RolloutService.interrupt)."""
        self.service.interrupt()

    def ledger_counts(self) -> dict:
        return self.service.ledger.counts()

    def metrics(self) -> dict[str, float]:
        return self.service.metrics()

    async def replace_engine(self, old_url: str, new_url: str) -> None:
        """Route rollouts to a restarted engine (already at the trainer's weights) instead of its dead predecessor.
        LoRA: it holds only the newest adapter; what each engine serves is read back so that requests naming an
        older version (re-sent from the dead engine, or started before the client heard of the newest) go to
        engines that still serve it (`EngineClient.read_lora_adapters`)."""
        self.client.replace_engine(old_url, new_url)
        if getattr(self.client, "lora_keep", None) is not None:
            await self.client.read_lora_adapters(timeout_s=60.0)

    def add_engine(self, url: str, api_key: str | None = None) -> None:
        """Route rollouts to a joining engine too (already at the trainer's weights: the driver synced it first)."""
        self.client.add_engine(url, api_key)

    async def drain_engine(self, url: str, timeout_s: float) -> SampleMoves:
        """A leaving engine: no new rollout goes to it, its in-flight samples continue on the others from their
        tokens, then it is out of routing; returns the samples that moved and what moving them cost
        (docs/design.md#rule-engine-set-can-change)."""
        await self.client.drain_engine(url, timeout_s)
        return self.client.sample_moves(url)

    def forget_engine(self, url: str) -> SampleMoves:
        """An engine that died for good: out of routing; returns the samples re-sent elsewhere from it so far."""
        moved = self.client.sample_moves(url)
        self.client.pool.remove_engine(url)
        return moved

    def engine_moves(self, url: str) -> SampleMoves:
        """Samples that left `url` for another engine so far (aborted while draining, or failed over)."""
        return self.client.sample_moves(url)

    async def begin_weight_sync(self) -> float:
        return await self.gate.begin_sync(self.gate_timeout_s)

    async def end_weight_sync(self) -> None:
        await self.gate.end_sync()

    async def poll_validations(self, start_step: int | None = None) -> tuple[bool, list[dict[str, float]]]:
        """The results of validations finished since the last call, and with `start_step` a validation of the
        weights the engines hold now started in the background unless one is running (returns whether it started).
        The driver calls this once after every step, so a result reaches the logs at the first step after it
        finished; it waits on nothing."""
        start = None if start_step is None else (lambda: self._validate_pinned(start_step))
        return self.validations.poll(start)

    async def finished_validations(self) -> list[dict[str, float]]:
        """Wait for a running validation, then return every result not yet returned (the end of a run)."""
        return await self.validations.drain()

    async def _validate_pinned(self, step: int) -> dict[str, float]:
        started, started_at = time.monotonic(), time.time()
        try:
            async with self.gate.validation(self.gate_timeout_s):
                urls = self.client.alive_urls
                versions = await asyncio.gather(*(self.client.get_weight_version(u) for u in urls))
                engines = dict(zip(urls, versions, strict=True))
                if getattr(self.client, "lora_version", None) is not None:
                    pinned = await self._pin_newest_adapter(urls)
                else:
                    pinned = pinned_version(engines)
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
        return result

    async def _pin_newest_adapter(self, urls: list[str]) -> int:
        """LoRA: the base never moves, so a validation is pinned to an adapter: the newest version every live engine
        serves, read back from them (/v1/models), and every request from now on names it (`use_policy_version`).
        The client's own version is the one the trainer gave with its last batch request; the sync after that step
        has loaded a newer adapter already, and the validation of a step measures the weights that step made, as
        a full-weights validation reads the engines' `weight_version`. Syncs wait meanwhile (the gate)."""
        listed = await asyncio.gather(*(self.client.lora_adapters(u, timeout_s=60.0) for u in urls))
        served = [{v for name in names if (v := adapter_version(name)) is not None} for names in listed]
        common = set.intersection(*served) if served else set()
        pinned = max(common) if common else int(self.client.lora_version)  # none in common: the engines answer
        self.client.use_policy_version(pinned)
        return pinned

    async def validate(self, step: int | None = None) -> dict:
        """Held-out accuracy; `step` names the validation dump file (default: the batches taken so far)."""
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
        spec = self.spec.executor.validation
        assert spec is not None, "build_run_spec always sets ExecutorSpec.validation"
        sampling = {"temperature": spec.temperature, "top_p": spec.top_p, "top_k": spec.top_k}
        result, episodes = await evaluate_episodes(
            self.val_workflow or self.workflow, self.client, self.tokenizer, self.val, n=spec.n, sampling=sampling
        )
        if self.spec.run.validation_data_dir:
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
