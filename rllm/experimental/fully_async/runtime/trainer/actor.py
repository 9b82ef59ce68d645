"""Ray actor shell of the trainer (docs/design.md#rule-one-wiring-place). No policy here. Every call it makes to the
rollout service waits with a timeout that names the call (docs/design.md#rule-every-wait-has-a-timeout).

- `FullyAsyncTrainerActor`: owns the policy backend (patched verl actor), ParamSync and the `FullyAsyncTrainer`,
  built by `build.py` from the run spec; it reaches the rollout side through one call per step
  (`runtime/rollout/service.py`).
Settings cross the process boundary as the frozen RunSpec (run_spec.py); verl's sections in it are rebuilt
with OmegaConf inside.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import ray

from rllm.experimental.fully_async.runtime.checkpoints.trainer_state import load_trainer_part, write_trainer_part
from rllm.experimental.fully_async.runtime.trainer.build import build_trainer, param_sync_factory

logger = logging.getLogger(__name__)

RAY_CALL_TIMEOUT_S = 120.0  # short control calls between actors (an acknowledgement before a checkpoint)
RAY_TRANSFER_SLACK_S = 60.0  # on top of a take_batch's own wait: moving the groups between processes


class _RolloutServiceClient:
    """The trainer's blocking view of the RolloutService actor (api.step_messages.RolloutSource), with timeouts."""

    def __init__(self, handle: Any, sync_gate_timeout_s: float) -> None:
        self.handle = handle
        self.sync_gate_timeout_s = sync_gate_timeout_s

    def take_batch(self, request: Any) -> Any:
        timeout_s = request.timeout_s + RAY_TRANSFER_SLACK_S
        try:
            return ray.get(self.handle.take_batch.remote(request), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(f"no answer from the rollout service's take_batch within {timeout_s:g}s") from exc

    def acknowledge(self, ack: Any) -> None:
        self._call("acknowledge", ack, timeout_s=RAY_CALL_TIMEOUT_S)

    def begin_weight_sync(self) -> float:
        # The service itself bounds the wait for a running validation by param_sync.timeout_s.
        return self._call("begin_weight_sync", timeout_s=self.sync_gate_timeout_s + RAY_TRANSFER_SLACK_S)

    def end_weight_sync(self) -> None:
        self._call("end_weight_sync", timeout_s=RAY_CALL_TIMEOUT_S)

    def _call(self, name: str, *args: Any, timeout_s: float) -> Any:
        try:
            return ray.get(getattr(self.handle, name).remote(*args), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(f"no answer from the rollout service's {name} within {timeout_s:g}s") from exc


# `replace_engine` has a thread of its own: it must not wait behind a `train_step` that waits for rollouts from the
# engine being replaced. Every other method stays in the default group, one at a time, so e.g. `write_checkpoint`
# never runs beside an update.
@ray.remote(num_cpus=1, concurrency_groups={"engines": 1})
class FullyAsyncTrainerActor:
    def __init__(
        self,
        spec: Any,
        engine_urls: list[str],
        rollouts: Any,
        api_key: str | None = None,
        ranks: dict | None = None,
        record: Any = None,
    ) -> None:
        """`spec` is the run's frozen RunSpec (run_spec.py), built once by the driver: every setting this actor
        honours is read from it. `api_key`: the engines' per-run secret (None on loopback); `ranks`: the trainer
        ranks' Ray options and devices from a cluster placement ({"options", "devices"}; None on one host);
        `record`: where this trainer writes the batch record (run.record_batches; runtime/trainer/record.py)."""
        logging.basicConfig(level=os.environ.get("RLLM_LOG_LEVEL", "WARNING"))
        rollout_source = _RolloutServiceClient(rollouts, sync_gate_timeout_s=spec.param_sync.timeout_s)
        param_sync_for = param_sync_factory(spec, engine_urls, api_key)
        self.trainer = build_trainer(spec, rollout_source, param_sync_for, ranks=ranks, record=record)
        self.backend = self.trainer.backend
        self.param_sync = self.trainer.param_sync

    def train_step(self) -> dict | None:
        return self.trainer.train_step()

    def sync_weights(self, bump: bool = True) -> dict:
        return self.trainer.sync_weights(bump=bump)

    def push_last_weights(self) -> dict:
        return self.trainer.push_last_weights()

    def write_checkpoint(self, directory: str) -> dict:
        """Acknowledge the last batch to the rollout service, then write the trainer part into a checkpoint's
        temporary directory: trainer.pt from this process, the policy's torch.distributed.checkpoint shards from
        every rank (runtime/checkpoints/trainer_state.py; the weights never travel through the driver, nor to one rank).
        Returns the manifest entries and the version the checkpoint is at."""
        self.trainer.flush_ack()
        return {"files": write_trainer_part(Path(directory), self.trainer), "version": self.trainer.version}

    def load_checkpoint(self, directory: str, state: dict) -> None:
        """Restore from the checkpoint in `directory`, whose trainer.pt (verified by the driver) is `state`."""
        load_trainer_part(Path(directory), state, self.trainer)

    def shutdown(self) -> None:
        """End the trainer's rank actors, if it has any (a multi-rank trainer); the driver calls it before
        killing this actor, so no rank outlives the run."""
        if hasattr(self.backend, "shutdown"):
            self.backend.shutdown()

    def version(self) -> int:
        return self.trainer.version

    @ray.method(concurrency_group="engines")
    def replace_engine(self, old_url: str, new_url: str) -> int:
        """Load the current weights into a restarted engine and sync to it from now on; returns its version.
        Runs beside a `train_step` that waits for a batch; ParamSync's lock orders it with syncs."""
        return self.param_sync.replace_engine(old_url, new_url)

    @ray.method(concurrency_group="engines")
    def add_engine(self, url: str, api_key: str | None = None) -> int:
        """Load the current weights into a joining engine and sync to it from now on; returns its version
        (docs/design.md#rule-engine-set-can-change). Ordered with syncs by ParamSync's lock, as `replace_engine`."""
        if self.param_sync is None:
            return self.trainer.version
        return self.param_sync.add_engine(url, api_key)

    @ray.method(concurrency_group="engines")
    def remove_engine(self, url: str) -> None:
        """Stop syncing to an engine that left or was lost (the last one too: syncs then only stage the weights
        until one joins, and no sync waits for an engine that has left)."""
        if self.param_sync is not None:
            self.param_sync.remove_engine(url, allow_none_left=True)
