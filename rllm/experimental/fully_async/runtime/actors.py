"""Ray actor shells: they build the asyncio/sync cores from the config and forward calls. No policy here.

- `RolloutExecutorActor` (async actor): owns the engine client, data iterator, workflow, ledger and the
  `RolloutExecutor` loop; also answers validation requests through the same engines.
- `FullyAsyncTrainerActor`: owns the policy backend (patched verl actor), ParamSync and the `FullyAsyncTrainer`.
Configs cross the process boundary as plain containers and are rebuilt with OmegaConf inside.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf

logger = logging.getLogger(__name__)

RAY_CALL_TIMEOUT_S = 120.0  # short control calls between actors (report, set_version)


class _QueueAdapter:
    """Async `put_batch` over the MessageQueue actor handle, for the executor's event loop."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def put_batch(self, groups: list, timeout_s: float) -> Any:
        return await self.handle.put_batch.remote(groups, timeout_s)


@ray.remote(num_cpus=0)
class RolloutExecutorActor:
    def __init__(
        self, cfg: dict, engine_urls: list[str], queue: Any, state: dict | None = None, queued: list | None = None
    ) -> None:
        from transformers import AutoTokenizer

        from rllm.experimental.fully_async.algorithms.filters import build_group_filter
        from rllm.experimental.fully_async.core.ids import rejected_prompt_uid
        from rllm.experimental.fully_async.data import PromptIterator
        from rllm.experimental.fully_async.engines.client import EngineClient
        from rllm.experimental.fully_async.runtime.ledger_journal import journaled_ledger
        from rllm.experimental.fully_async.runtime.rollout_executor import ExecutorSettings, RolloutExecutor
        from rllm.experimental.fully_async.workflows import build_workflow, load_reward_fn

        logging.basicConfig(level=os.environ.get("RLLM_LOG_LEVEL", "WARNING"))
        self.cfg: DictConfig = OmegaConf.create(cfg)
        c = self.cfg
        self.tokenizer = AutoTokenizer.from_pretrained(c.actor_rollout_ref.model.path)
        self.reward_fn = load_reward_fn(c)
        # Under on_engine_failure=restart a request finding no live engine waits for a restarted one (the
        # supervisor gives a restart startup_timeout_s) rather than failing its sample.
        restarting = str(c.engines.on_engine_failure) == "restart"
        self.client = EngineClient(
            engine_urls,
            request_timeout_s=float(c.engines.request_timeout_s),
            wait_for_engine_s=float(c.engines.startup_timeout_s) + 30.0 if restarting else 0.0,
        )
        # The journal (every sample's issue and end, for the exactly-once audit) lives in the run dir. A relative
        # run.dir is resolved against this worker's cwd, which Ray gives the driver's. A fresh run starts it empty
        # at its first record; a resume cuts it back to the checkpoint (`SampleLedger.load_state_dict`).
        self.ledger = journaled_ledger(Path(c.run.dir).absolute() / "ledger.jsonl")
        train, val = load_prompt_datasets(c, self.tokenizer)
        if state is None:  # a resumed ledger has them already
            for rejected in train.rejected:
                # Left out before any rollout, yet still a prompt the user gave: the ledger accounts for it.
                uid = rejected_prompt_uid(rejected.index)
                self.ledger.issue([uid])
                self.ledger.mark_filtered([uid], rejected.reason)
        self.val: list = []
        if val is not None:
            self.val = list(PromptIterator(val, seed=0, num_epochs=1, shuffle=False))[: int(c.task.val_size)]
        prompts = PromptIterator(
            train,
            seed=int(c.data.seed if c.data.seed is not None else c.run.seed),
            num_epochs=int(c.trainer.total_epochs),
            shuffle=bool(c.data.shuffle),
        )
        at = c.async_training
        settings = ExecutorSettings(
            samples_per_prompt=int(c.actor_rollout_ref.rollout.n),
            max_staleness=int(at.max_staleness),
            batch_groups=int(at.required_samples) * int(at.trigger_parameter_sync_step),
            max_concurrent_rollouts=int(at.max_concurrent_rollouts),
        )
        self.executor = RolloutExecutor(
            settings,
            prompts,
            build_workflow(c, self.reward_fn),
            self.client,
            self.tokenizer,
            _QueueAdapter(queue),
            group_filter=build_group_filter(c),
            ledger=self.ledger,
        )
        self.queue = queue
        if state is not None:
            self.executor.load_state_dict(state, queued)

    async def run(self) -> dict:
        stats = await self.executor.run()
        await self.queue.close.remote()  # rollouts ended: the trainer drains what is left, then stops
        return dict(vars(stats))

    async def checkpoint_state(self) -> tuple[dict, list]:
        return await self.executor.checkpoint_state(lambda: self.queue.snapshot.remote())

    def set_version(self, version: int) -> None:
        self.executor.set_version(version)

    def set_paused(self, paused: bool) -> None:
        self.executor.set_paused(paused)

    def report_consumed(
        self, trained_uids: list[str], trained_groups: int, stale_uids: list[str], stale_groups: int
    ) -> None:
        self.executor.report_consumed(trained_uids, trained_groups, stale_uids, stale_groups)

    def stop(self) -> None:
        self.executor.stop()

    def ledger_counts(self) -> dict:
        return self.ledger.counts()

    def replace_engine(self, old_url: str, new_url: str) -> None:
        """Route rollouts to a restarted engine (already at the trainer's weights) instead of its dead predecessor."""
        self.client.replace_engine(old_url, new_url)

    def state_dict(self) -> dict:
        return self.executor.state_dict()

    def stats(self) -> dict:
        return dict(vars(self.executor.stats)) | {"version": self.executor.version}

    async def validate(self) -> dict:
        from rllm.experimental.fully_async.runtime.validation import evaluate

        if not self.val:
            return {}
        result = await evaluate(
            self.client,
            self.tokenizer,
            self.val,
            self.reward_fn,
            max_new_tokens=int(self.cfg.data.max_response_length),
            reward_timeout_s=float(self.cfg.workflow.reward_timeout_s),
        )
        return {
            "val/accuracy": result.accuracy,
            "val/num_prompts": float(result.num_prompts),
            "val/num_failed": float(result.num_failed),
            "val/version": float(max(result.versions, default=-1)),
        }

    async def aclose(self) -> None:
        await self.client.aclose()


class _SyncHandle:
    """Blocking calls on an actor handle with a timeout, for the trainer's synchronous loop."""

    def __init__(self, handle: Any, timeout_s: float) -> None:
        self.handle = handle
        self.timeout_s = timeout_s

    def __getattr__(self, name: str):
        method = getattr(self.handle, name)

        def call(*args: Any) -> Any:
            try:
                return ray.get(method.remote(*args), timeout=self.timeout_s)
            except ray.exceptions.GetTimeoutError as exc:
                raise TimeoutError(f"no answer from {name}() within {self.timeout_s:g}s") from exc

        return call


# `replace_engine` has a thread of its own: it must not wait behind a `train_step` that waits for rollouts from the
# engine being replaced. Every other method stays in the default group, one at a time, so e.g. a checkpoint's
# `state_dict` never runs beside an update.
@ray.remote(num_cpus=1, concurrency_groups={"engines": 1})
class FullyAsyncTrainerActor:
    def __init__(self, cfg: dict, engine_urls: list[str], queue: Any, executor: Any) -> None:
        from transformers import AutoTokenizer

        from rllm.experimental.fully_async.algorithms.advantages import AdvantageConfig
        from rllm.experimental.fully_async.algorithms.corrections import build_correction
        from rllm.experimental.fully_async.backends.fsdp import FSDPPolicyBackend
        from rllm.experimental.fully_async.runtime.fully_async_trainer import FullyAsyncTrainer, TrainerSettings
        from rllm.experimental.fully_async.runtime.param_sync import DiskTransport, ParamSync
        from rllm.experimental.fully_async.verl_patch import require_patched_verl

        logging.basicConfig(level=os.environ.get("RLLM_LOG_LEVEL", "WARNING"))
        require_patched_verl()
        c = OmegaConf.create(cfg)
        self.cfg = c
        model_path = c.actor_rollout_ref.model.path
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        correction = build_correction(c)
        if correction is not None and correction.policy_loss_mode is not None:
            # decoupled PPO with the proximal policy from the update itself: its loss replaces verl's vanilla one
            c.actor_rollout_ref.actor.policy_loss.loss_mode = correction.policy_loss_mode
        backend = FSDPPolicyBackend(model_path, c.actor_rollout_ref.actor, seed=int(c.run.seed))
        at = c.async_training
        timeout_s = float(c.param_sync.timeout_s)
        self.param_sync = ParamSync(
            engine_urls,
            DiskTransport(Path(c.param_sync.weights_dir)),
            pause_timeout_s=timeout_s,
            update_timeout_s=timeout_s,
            continue_timeout_s=timeout_s,
        )
        settings = TrainerSettings(
            required_samples=int(at.required_samples),
            max_staleness=int(at.max_staleness),
            trigger_parameter_sync_step=int(at.trigger_parameter_sync_step),
            use_rollout_log_probs=bool(at.use_rollout_log_probs),
            compute_prox_log_prob=bool(at.compute_prox_log_prob),
            temperature=float(c.actor_rollout_ref.rollout.temperature),
            pad_token_id=int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0),
            queue_get_timeout_s=float(at.queue_get_timeout_s),
            on_engine_failure=str(c.engines.on_engine_failure),
        )
        critic = None
        if c.algorithm.adv_estimator == "gae":
            from rllm.experimental.fully_async.backends.critic import FSDPCriticBackend

            critic = FSDPCriticBackend(model_path, c.critic, seed=int(c.run.seed))
        self.trainer = FullyAsyncTrainer(
            settings,
            backend,
            _QueueGetter(queue, float(at.queue_get_timeout_s)),
            _SyncHandle(executor, RAY_CALL_TIMEOUT_S),
            self.param_sync,
            advantages=AdvantageConfig.from_config(c),
            correction=correction,
            critic=critic,
        )

    def train_step(self) -> dict | None:
        return self.trainer.train_step()

    def sync_weights(self, bump: bool = True) -> dict:
        return self.trainer.sync_weights(bump=bump)

    def state_dict(self) -> dict:
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.trainer.load_state_dict(state)

    def version(self) -> int:
        return self.trainer.version

    @ray.method(concurrency_group="engines")
    def replace_engine(self, old_url: str, new_url: str) -> int:
        """Load the current weights into a restarted engine and sync to it from now on; returns its version.
        Runs beside a `train_step` that waits for a batch; ParamSync's lock orders it with syncs."""
        return self.param_sync.replace_engine(old_url, new_url)


class _QueueGetter:
    def __init__(self, handle: Any, timeout_s: float) -> None:
        self.handle = handle
        self.timeout_s = timeout_s

    def get_batch(self, n: int, timeout_s: float) -> list:
        # The actor's own wait is bounded by timeout_s; the Ray get adds slack for transfer.
        return ray.get(self.handle.get_batch.remote(n, timeout_s), timeout=timeout_s + 60)


def _files(value: Any) -> list[str]:
    """verl accepts one path or a list of paths for data.train_files / data.val_files."""
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def load_prompt_datasets(cfg: DictConfig, tokenizer: Any) -> tuple[Any, Any]:
    """The train and (optional) validation PromptDatasets the config names; DataError names file, row, field."""
    from rllm.experimental.fully_async.data import PromptDataset

    overlong, max_len = overlong_policy(cfg), int(cfg.data.max_prompt_length)
    train = PromptDataset(_files(cfg.data.train_files), tokenizer, max_len, overlong)
    val = PromptDataset(_files(cfg.data.val_files), tokenizer, max_len, overlong) if cfg.data.val_files else None
    return train, val


def overlong_policy(cfg: DictConfig) -> str:
    """verl's keys for prompts longer than data.max_prompt_length, as PromptDataset's `overlong` argument."""
    if cfg.data.filter_overlong_prompts:
        return "filter"
    return {"left": "truncate_left", "right": "truncate_right"}.get(str(cfg.data.truncation), "error")
