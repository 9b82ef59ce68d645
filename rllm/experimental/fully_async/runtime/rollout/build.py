"""The rollout service's process wired from the run spec, in one place (docs/design.md#rule-one-wiring-place):
`build_rollout_process`.

What it builds, bottom up: the engines' tokenizer; the worker pool where user code (rewards, environments, tools)
runs with timeouts that kill a hung call (workers/pool.py); the reward; the engine client; the ledger with its
journal in the run dir; the train and held-out prompts; the workflows; the executor and its queue, restored from a
checkpoint when resuming; the sync gate that orders weight syncs, validations and checkpoints; and the
`RolloutService` over them. The Ray actor (actor.py) is a shell around the result; a test can call this without Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from rllm.experimental.fully_async.algorithms.filters import build_group_filter
from rllm.experimental.fully_async.api.workflow import Workflow
from rllm.experimental.fully_async.core.ids import rejected_prompt_uid
from rllm.experimental.fully_async.core.ledger import SampleLedger
from rllm.experimental.fully_async.core.versions import lora_versions_kept
from rllm.experimental.fully_async.data.datasets import load_prompt_datasets
from rllm.experimental.fully_async.data.prompts import PromptIterator
from rllm.experimental.fully_async.engines.client import EngineClient
from rllm.experimental.fully_async.run_spec import ExecutorSpec, RunSpec
from rllm.experimental.fully_async.runtime.rollout.executor import ExecutorSettings, RolloutExecutor
from rllm.experimental.fully_async.runtime.rollout.ledger_journal import journaled_ledger
from rllm.experimental.fully_async.runtime.rollout.message_queue import MessageQueue
from rllm.experimental.fully_async.runtime.rollout.service import CHECKPOINT_COLLECT_TIMEOUT_S, RolloutService
from rllm.experimental.fully_async.runtime.rollout.validation import SyncGate
from rllm.experimental.fully_async.workers.pool import DEFAULT_PRELOAD, WorkerPool
from rllm.experimental.fully_async.workflows import IsolatedReward, build_workflow, env_spec, load_reward_fn


@dataclass
class RolloutProcess:
    """The rollout service's process: the service and what validation uses beside it."""

    spec: RunSpec
    service: RolloutService
    client: EngineClient
    tokenizer: Any
    pool: WorkerPool
    reward_fn: Any
    workflow: Workflow
    val_workflow: Workflow | None  # AsyncAgentTrainer's val_rollout_fn; None: validation plays `workflow`
    val_prompts: list  # the held-out prompts (data.val_size of them), in file order
    gate: SyncGate


def build_rollout_process(
    spec: RunSpec,
    engine_urls: list[str],
    state: dict | None = None,
    queued: list | None = None,
    api_key: str = "",
) -> RolloutProcess:
    """The rollout service from the run spec, serving `engine_urls` (`api_key`: their per-run secret when they listen
    beyond loopback); `state` and `queued` are a checkpoint's rollout part and queue when resuming."""
    ex, data = spec.executor, spec.executor.data
    tokenizer = AutoTokenizer.from_pretrained(spec.engines.model_path)  # the engines' model, its tokens
    pool = build_worker_pool(ex)
    reward_fn = load_reward_fn(ex, pool)
    uses_reward = ex.workflow_path is None and (ex.workflow_name == "single_turn" or ex.reward_fn_path)
    if isinstance(reward_fn, IsolatedReward) and uses_reward:
        pool.preload += (reward_fn.reference,)
    client = build_engine_client(spec, engine_urls, api_key)
    ledger = build_ledger(spec)
    train, val = load_prompt_datasets(data, tokenizer)
    if state is None:  # a resumed ledger has them already
        ledger_rejected_prompts(ledger, train.rejected)
    val_prompts: list = []
    if val is not None:
        val_prompts = list(PromptIterator(val, seed=0, num_epochs=1, shuffle=False))[: data.val_size]
    prompts = PromptIterator(train, seed=data.seed, num_epochs=data.total_epochs, shuffle=data.shuffle)
    queued = queued or []
    queue = MessageQueue(max_groups=max(ex.queue_max_groups, len(queued)))
    workflow = build_workflow(ex, reward_fn, pool)
    val_workflow = build_workflow(ex, reward_fn, pool, held_out=True) if ex.rllm_functions else None
    executor = RolloutExecutor(
        ExecutorSettings.from_spec(spec),
        prompts,
        workflow,
        client,
        tokenizer,
        queue,
        group_filter=build_group_filter(ex.group_filter),
        ledger=ledger,
    )
    if state is not None:
        executor.load_state_dict(state, queued)
        queue.put(queued)
    gate = SyncGate()  # weight syncs vs validations (pinned to one version) and checkpoint pauses
    service = RolloutService(
        executor,
        queue,
        gate=gate,
        # Under the driver's 120 s wait for write_checkpoint (a sync to wait out, the collection, the continue):
        # a call held by a paused SGLang engine only returns at the continue, so the collection ends by timeout.
        collect_timeout_s=min(spec.param_sync.timeout_s, CHECKPOINT_COLLECT_TIMEOUT_S),
    )
    return RolloutProcess(spec, service, client, tokenizer, pool, reward_fn, workflow, val_workflow, val_prompts, gate)


def build_worker_pool(executor: ExecutorSpec) -> WorkerPool:
    """The worker pool for user code, its workers preloading the environment's and the reward's modules so that
    no call's timeout pays for an import. Its workers exit with this process."""
    preload = list(DEFAULT_PRELOAD)
    if executor.agent is not None:  # a multi_turn workflow (no workflow.path)
        preload.append(env_spec(executor.agent).reference)
    return WorkerPool(max_workers=2, preload=tuple(preload))


def build_engine_client(spec: RunSpec, engine_urls: list[str], api_key: str) -> EngineClient:
    """The client every rollout and validation generates through. A request finding no live engine waits for one
    rather than failing its sample: under on_engine_failure=restart for a restarted one (the supervisor gives a
    restart startup_timeout_s), and for one to join for engines.no_engine_timeout_s (the driver stops the run once
    that passed without an engine: docs/design.md#rule-engine-set-can-change)."""
    restarting = spec.engines.on_engine_failure == "restart"
    restart_wait_s = spec.engines.startup_timeout_s + 30.0 if restarting else 0.0
    return EngineClient(
        engine_urls,
        request_timeout_s=spec.engines.request_timeout_s,
        partial_rollout=spec.executor.partial_rollout,
        wait_for_engine_s=max(restart_wait_s, spec.engines.no_engine_timeout_s),
        api_key=api_key or None,
        sampling_seed=spec.engines.sampling_seed,
        lora_keep=lora_keep(spec),  # LoRA: each request names the newest adapter; old unused ones are unloaded
    )


def lora_keep(spec: RunSpec) -> int | None:
    """LoRA: the adapter versions the engines keep, the η_max + 1 the staleness bound admits; None without LoRA."""
    if spec.engines.lora is None:
        return None
    schedule = spec.schedule
    return lora_versions_kept(schedule.max_staleness, schedule.adaptive.max if schedule.adaptive is not None else None)


def build_ledger(spec: RunSpec) -> SampleLedger:
    """The sample ledger with its journal (every sample's issue and end, for the exactly-once audit) in the run dir.

    A relative run.dir is resolved against this worker's cwd, which Ray gives the driver's. A fresh run starts the
    journal empty at its first record; a resume cuts it back to the checkpoint (`SampleLedger.load_state_dict`)."""
    return journaled_ledger(Path(spec.run.dir).absolute() / "ledger.jsonl")


def ledger_rejected_prompts(ledger: SampleLedger, rejected: list) -> None:
    """Prompts left out before any rollout (too long, malformed) are still prompts the user gave: the ledger
    accounts for each as filtered with its reason."""
    for prompt in rejected:
        uid = rejected_prompt_uid(prompt.index)
        ledger.issue([uid])
        ledger.mark_filtered([uid], prompt.reason)
