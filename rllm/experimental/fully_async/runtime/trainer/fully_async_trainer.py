"""FullyAsyncTrainer: batch -> staleness check -> advantages -> old log-probs -> one verl update -> weight sync.

One call of `train_step()` is exactly one optimizer step (the patched `update_policy` treats the whole batch as
one mini-batch). Its guarantees:
- it makes one call to the rollout side per step, `take_batch(BatchRequest)` (api/step_messages.py), which carries
  its policy version and the acknowledgement of the previous batch; the service drops groups older than
  `max_staleness` versions itself (ledger: dropped_stale), so the batch holds `required_samples` fresh groups;
- the acknowledgement of the last batch is held until the next request, or delivered by `flush_ack()` (the
  checkpoint flow calls it first, so every trained sample is ledgered trained in the checkpoint);
- the old log-probs of the PPO ratio come from the batch: the engine's rollout log-probs, or proximal
  log-probs recomputed by the trainer with the weights it has before the step (decoupled PPO), per config;
- it alone decides when to sync: after every K-th step (`core/versions.is_sync_step`, K =
  trigger_parameter_sync_step) and, at the end of a run, after a last step that was not one (`push_last_weights`),
  it pushes the weights (ParamSync) and bumps the policy version, the one owner of it (core/versions.py); the next
  request tells the rollout side, so capacity for newer rollouts opens;
- with adaptive staleness (a `StalenessController`, core/adaptive_staleness.py) each batch's off-policy statistics
  feed the controller, which moves η at each sync; every request carries the η in force, so the rollout service's
  budget follows it from the request after the sync;
- every wait (the batch, Ray calls, sync) has a timeout whose error says what was waited for;
- with a recorder (run.record_batches), each step's batch, version and RNG states are written before the step runs,
  so `replay` can re-run the training (runtime/trainer/record.py, replay.py).
With max_staleness 0 and trigger 1 this is exactly synchronous on-policy training.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rllm.experimental.fully_async.api.policy_backend import PolicyBackend
from rllm.experimental.fully_async.api.step_messages import Ack, BatchRequest, RolloutSource
from rllm.experimental.fully_async.api.trajectory import TrajectoryStatus, VersionedGroup
from rllm.experimental.fully_async.core.adaptive_staleness import OffPolicySignals, StalenessController
from rllm.experimental.fully_async.core.batch import PAD_VERSION, groups_to_dataproto
from rllm.experimental.fully_async.core.versions import is_sync_step
from rllm.experimental.fully_async.errors import FullyAsyncError
from rllm.experimental.fully_async.observe.verl_metrics import verl_named_metrics
from rllm.experimental.fully_async.runtime.checkpoints.trainer_state import capture_rng_state, restore_rng_state
from rllm.experimental.fully_async.runtime.sync.param_sync import SyncError
from rllm.experimental.fully_async.workflows.rllm_metrics import StaleCounts, batch_metadata_metrics

logger = logging.getLogger(__name__)

_HOST_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class QueueTimeoutError(FullyAsyncError, TimeoutError):
    """The trainer waited longer than async_training.queue_get_timeout_s for a batch."""


@dataclass(frozen=True)
class TrainerSettings:
    required_samples: int  # R: groups per optimizer step
    trigger_parameter_sync_step: int  # K: optimizer steps per weight sync (core/versions.py)
    use_rollout_log_probs: bool
    compute_prox_log_prob: bool
    temperature: float
    pad_token_id: int
    queue_get_timeout_s: float
    on_engine_failure: str = "continue"  # engines.on_engine_failure: restart | continue | stop
    max_response_length: int | None = None  # data.max_response_length, in the batch's meta_info (Dr.GRPO)
    max_prompt_length: int | None = None  # data.max_prompt_length: verl's prompt_length/clip_ratio
    world_size: int = 1  # trainer ranks: verl's perf/throughput is per GPU


class FullyAsyncTrainer:
    """The training loop's step. Collaborators come in as objects so a test can pass local ones.

    `rollouts` (api.step_messages.RolloutSource: take_batch, acknowledge), `backend` (api.policy_backend.PolicyBackend),
    `param_sync.sync(write_weights, new_version)`.
    """

    def __init__(
        self,
        settings: TrainerSettings,
        backend: PolicyBackend,
        rollouts: RolloutSource,
        param_sync: Any | None,
        advantages: Any,  # algorithms.advantages.AdvantageConfig
        correction: Any | None = None,
        critic: Any | None = None,  # backends.critic.FSDPCriticBackend, for adv_estimator=gae
        version: int = 0,
        step: int = 0,
        dump: Any | None = None,  # (step, groups, data) -> None: trainer.rollout_data_dir (observe/dumps.py)
        staleness: StalenessController | None = None,  # async_training.adaptive_staleness; None: η fixed
        recorder: Any | None = None,  # run.record_batches: runtime/trainer/record.py BatchRecorder; None: off
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.rollouts = rollouts
        self._pending_ack = Ack()
        self._validation_running = False  # from the last batch (api.step_messages.Batch.validating)
        self.param_sync = param_sync
        self.advantages = advantages
        self.correction = correction
        self.critic = critic
        self.version = version
        self.step = step
        self._synced_step = step  # the step whose weights the engines hold (the initial ones at step 0)
        self.dump = dump
        self.staleness = staleness
        self._stale_counts = StaleCounts()  # rLLM's cumulative fully_async/count/* (not checkpointed, as in rLLM)
        self.recorder = recorder

    # ------------------------------------------------------------------------------------------------------

    def take_batch(self) -> tuple[list[VersionedGroup], dict[str, float]]:
        """One request for `required_samples` fresh groups, acknowledging the previous batch. Returns the groups
        (fewer only when the rollouts have ended) and metrics, including the rollout side's statistics."""
        need = self.settings.required_samples
        eta = self.staleness.eta if self.staleness is not None else None
        request = BatchRequest(need, self.version, self._pending_ack, self.settings.queue_get_timeout_s, eta)
        started = time.monotonic()
        batch = self.rollouts.take_batch(request)
        call_s = time.monotonic() - started
        self._pending_ack = Ack()  # delivered with the request
        self._validation_running = batch.validating
        if batch.status == "timeout":
            raise QueueTimeoutError(
                f"trainer waited {self.settings.queue_get_timeout_s:g}s for {need} groups at step {self.step + 1} "
                "and got none (rollouts stalled? raise async_training.queue_get_timeout_s or check the engines)"
            )
        staleness = [g.staleness(self.version) for g in batch.groups]
        metrics = dict(batch.metrics)
        metrics |= {
            "timing/wait_batch_s": call_s,
            "timing/take_overhead_s": max(0.0, call_s - batch.wait_s),  # the call minus the wait for groups
            "staleness/mean": float(np.mean(staleness)) if staleness else 0.0,
            "staleness/max": float(max(staleness, default=0)),
            "staleness/dropped_groups": float(batch.stale_groups),
        }
        # The distribution, one count per staleness value (groups), for the report's histogram per step range.
        for value, count in Counter(staleness).items():
            metrics[f"staleness/hist/{value}"] = float(count)
        return batch.groups, metrics

    def flush_ack(self) -> None:
        """Deliver the last batch's acknowledgement now (before a checkpoint or at the end of a run)."""
        if self._pending_ack:
            self.rollouts.acknowledge(self._pending_ack)
            self._pending_ack = Ack()

    def train_step(self) -> dict[str, float] | None:
        """One optimizer step on one batch, then a weight sync when due. Returns flat float metrics, or None
        when the rollouts have ended and nothing is left to train."""
        step_started = time.monotonic()
        groups, metrics = self.take_batch()
        if not groups:
            return None
        clock = _Stopwatch()
        if self.recorder is not None:  # the step's inputs, before anything of it runs (replay: record.py)
            self.recorder.write(self.step + 1, self.version, groups)
            metrics["timing/record_s"] = clock.lap()
        cpu_started = time.process_time()
        data = groups_to_dataproto(
            groups,
            pad_token_id=self.settings.pad_token_id,
            temperature=self.settings.temperature,
            max_response_length=self.settings.max_response_length,
        )
        metrics["timing/assemble_s"] = clock.lap()
        if self.critic is not None:
            # Values from the critic's weights before its own step: they anchor the value clip.
            data.batch["values"] = self.critic.compute_values(data)
        advantages = self.advantages.compute_with_stats(data)
        data = advantages.data
        metrics.update(advantages.to_metrics())  # advantages/* and, for GiGPO, gigpo/* (its step groups)
        metrics.update(self._old_log_probs(data))
        metrics["timing/advantages_s"] = clock.lap()
        if self.critic is not None:
            metrics.update(self.critic.update_critic(data))  # needs `returns` from the GAE estimator
        metrics.update(self.backend.update_policy(data))
        metrics["timing/update_s"] = clock.lap()
        self.step += 1
        if self.staleness is not None:
            # The wait for groups, not the call around it: what a higher η could shorten.
            waited = metrics["timing/wait_batch_s"] - metrics["timing/take_overhead_s"]
            trainer_wait = waited / max(time.monotonic() - step_started, 1e-9)
            self.staleness.observe(offpolicy_signals(metrics), trainer_wait=trainer_wait)

        self._pending_ack = Ack.of(groups)  # delivered with the next request (or by flush_ack)
        metrics.update(_batch_metrics(groups, data))
        # What rLLM rollout functions put in Trajectory.metadata, under rLLM's names (workflows/rllm_metrics.py).
        rllm = [
            t.metadata["rllm"]
            for g in groups
            for t in g.trajectories
            if t.status == TrajectoryStatus.OK and "rllm" in t.metadata
        ]
        if rllm:
            metrics.update(batch_metadata_metrics(rllm))
            metrics.update(self._stale_counts.update(rllm, self.version))
        if self.dump is not None:  # the trajectories with the advantages just computed
            self.dump(self.step, groups, data)
        metrics["timing/bookkeeping_s"] = clock.lap()
        # This process's CPU seconds over assemble..bookkeeping, and the cores it shares: on a CPU run (trainer and
        # engines on one host) compute_cpu_s / (assemble + advantages + update + bookkeeping) is the share of a
        # core the trainer got, which `simulate --from` uses to divide the contention out (simulate/calibrate.py).
        metrics["timing/compute_cpu_s"] = time.process_time() - cpu_started
        metrics["host/cpus"] = float(_HOST_CPUS)

        if is_sync_step(self.step, self.settings.trigger_parameter_sync_step):
            # The validation gate costs two calls to the busy rollout actor (~0.13 s a step measured): only when a
            # validation is running (none can start before this step returns).
            metrics.update(self.sync_weights(gate=self._validation_running))
            metrics["timing/sync_s"] = clock.lap()  # the whole sync: gate calls, staging, ParamSync (sync/total_s)
            if self.staleness is not None:
                metrics.update(self._decide_staleness())
        if self.staleness is not None:
            metrics["staleness/eta"] = float(self.staleness.eta)  # in force from the next request
        metrics["timing/step_s"] = time.monotonic() - step_started
        metrics["trainer/idle_frac"] = metrics["timing/wait_batch_s"] / max(metrics["timing/step_s"], 1e-9)
        metrics["trainer/tokens_per_s"] = metrics["batch/tokens"] / max(metrics["timing/step_s"], 1e-9)
        metrics["trainer/step"] = float(self.step)
        metrics["trainer/version"] = float(self.version)
        # verl's names for the same batch (critic/score/*, response_length/*, timing_s/*, perf/*), beside ours.
        metrics |= verl_named_metrics(
            data,
            metrics,
            max_response_length=self.settings.max_response_length,
            max_prompt_length=self.settings.max_prompt_length,
            use_critic=self.critic is not None,
            n_gpus=self.settings.world_size,
        )
        return metrics

    def _decide_staleness(self) -> dict[str, float]:
        """At a sync: the controller's decision over the batches since the last one, as metrics (and a log line
        when η changes). The next request carries the new η with the new version."""
        assert self.staleness is not None
        decision = self.staleness.decide()
        seen = decision.signals
        out = {f"adaptive/{k}": v for k, v in (("ess", seen.ess), ("kl", seen.kl), ("cut", seen.cut)) if v is not None}
        out["adaptive/outside"] = float(len(decision.outside))
        if decision.trainer_wait is not None:
            out["adaptive/trainer_wait"] = decision.trainer_wait
        if decision.changed:
            out["staleness/eta_change"] = float(decision.after - decision.before)
            logger.info("step %d: adaptive staleness %s", self.step, decision.describe())
        return out

    def push_last_weights(self) -> dict[str, float]:
        """At the end of a run: push the weights trained since the last sync (the last step was not a sync step,
        K > 1), so the engines, and the final validation, hold what was trained. Nothing when they already do."""
        if self._synced_step == self.step:
            return {}
        return self.sync_weights()

    def sync_weights(self, *, bump: bool = True, gate: bool = True) -> dict[str, float]:
        """Push the current weights to every engine as version+1 (or as the current version, after a resume).
        The rollout side learns the new version with the next request."""
        new_version = self.version + 1 if bump else self.version
        self._synced_step = self.step
        if bump and self.correction is not None and self.correction.uses_previous_weights:
            self.backend.weights_synced()  # the proximal policy from now on is the version these weights replace
        if self.param_sync is None:
            self.version = new_version
            return {}

        # A validation in progress is pinned to the engines' current weights: the sync waits for it to finish.
        # `gate=False` (the trainer's own step, when its batch said no validation runs) skips the two calls.
        waited_s = self.rollouts.begin_weight_sync() if gate else 0.0
        try:
            report = self.param_sync.sync(self.backend.save_hf, new_version)
        except SyncError as exc:
            if gate:
                self.rollouts.end_weight_sync()
            # Engines whose process is gone are dropped from syncs when the config allows it; any other failure (an
            # engine that answered with an error, a timeout) stops the run. Under `continue` some engine must have
            # taken the update; under `restart` none need have: the restarted engines load these weights.
            lost = set(exc.failures)
            policy = self.settings.on_engine_failure
            dead_only = lost <= set(exc.unreachable)
            if not (dead_only and (policy == "restart" or (policy == "continue" and exc.updated))):
                raise
            for url in sorted(lost):
                self.param_sync.remove_engine(url, allow_none_left=policy == "restart")
            self.version = new_version
            plan = (
                "left out of weight syncs until restarted" if policy == "restart" else "dropped for the rest of the run"
            )
            logger.warning("step %d: dead engine(s) %s %s", self.step, ", ".join(sorted(lost)), plan)
            return {"sync/engines_lost": float(len(lost)), "sync/wait_validation_s": waited_s}
        except BaseException:
            if gate:
                self.rollouts.end_weight_sync()
            raise
        if gate:
            self.rollouts.end_weight_sync()
        self.version = report.version
        return {
            "sync/total_s": report.total_s,
            "sync/pause_s": report.pause_s,
            "sync/write_s": report.write_s,
            "sync/wait_validation_s": waited_s,
        }

    def state_dict(self, policy: dict[str, Any] | None = None) -> dict[str, Any]:
        """Step, version, RNG states (and the critic's state) with the policy's: the backend's full state dict, or
        `policy` when given (a reference to shards the backend wrote itself, runtime/checkpoints/trainer_state.py)."""

        return {
            "backend": self.backend.state_dict() if policy is None else policy,
            "step": self.step,
            "version": self.version,
            "rng": capture_rng_state(),
            **({"critic": self.critic.state_dict()} if self.critic is not None else {}),
            **({"staleness": self.staleness.state_dict()} if self.staleness is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any], *, load_policy: bool = True) -> None:
        """Restore `state_dict`'s result; `load_policy=False` when the caller has restored the policy already."""

        if load_policy:
            self.backend.load_state_dict(state["backend"])
        if self.critic is not None:
            if "critic" not in state:
                raise ValueError("the checkpoint has no critic state (it was not a GAE run): start a new run.dir")
            self.critic.load_state_dict(state["critic"])
        self.step = int(state["step"])
        self.version = int(state["version"])
        if self.staleness is not None and "staleness" in state:  # a run that adapted η resumes at its η
            self.staleness.load_state_dict(state["staleness"])
        restore_rng_state(state["rng"])

    # ------------------------------------------------------------------------------------------------------

    def _old_log_probs(self, data: Any) -> dict[str, float]:
        """Fill `old_log_probs` (and `rollout_is_weights` under decoupled PPO) as the config asks."""
        s = self.settings
        behaviour = data.batch["rollout_log_probs"]
        if self.correction is not None:
            proximal = None
            if self.correction.uses_previous_weights:  # pi_prox: the weights before the last step
                proximal = self.backend.compute_log_prob(data, weights="previous")
            elif self.correction.needs_recompute:
                proximal = self.backend.compute_log_prob(data)
            return self.correction.apply(data, proximal_log_probs=proximal, trainer_version=self.version)
        if s.compute_prox_log_prob or not s.use_rollout_log_probs:
            data.batch["old_log_probs"] = self.backend.compute_log_prob(data)
        else:
            data.batch["old_log_probs"] = behaviour.clone()
        return {}


def offpolicy_signals(metrics: dict[str, float]) -> OffPolicySignals:
    """The adaptive rule's statistics from one step's update metrics (core/adaptive_staleness.py).

    verl's actor reports `rollout_corr/*` (pi_theta of the update's forward pass, i.e. the weights at the step,
    against the rollout log-probs) in every correction mode: ess ~= 1 / (1 + chi2_token) (exact when the weights
    average 1, as they do in expectation under pi_behav), kl = `rollout_corr/k3_kl`; cut = the larger of PPO's
    clipped fraction and a masking correction's masked fraction (cap_mode=mask, m2po, or decoupled's m2_threshold).
    A statistic the step lacks stays None.
    """
    chi2 = metrics.get("rollout_corr/chi2_token")
    cut_keys = ("actor/pg_clipfrac", "off_policy/masked_token_fraction", "off_policy/m2_masked_token_fraction")
    cuts = [metrics[k] for k in cut_keys if k in metrics]
    return OffPolicySignals(
        ess=1.0 / (1.0 + max(0.0, float(chi2))) if chi2 is not None else None,
        kl=float(metrics["rollout_corr/k3_kl"]) if "rollout_corr/k3_kl" in metrics else None,
        cut=float(max(cuts)) if cuts else None,
    )


class _Stopwatch:
    def __init__(self) -> None:
        self.last = time.monotonic()

    def lap(self) -> float:
        now = time.monotonic()
        elapsed, self.last = now - self.last, now
        return elapsed


def _batch_metrics(groups: list[VersionedGroup], data: Any) -> dict[str, float]:
    rewards = [t.reward for g in groups for t in g.trajectories if t.status == TrajectoryStatus.OK]
    mask = data.batch["response_mask"]
    versions = data.batch["response_versions"]
    lengths = mask.sum(-1)
    resumed = sum(t.num_resumes > 0 for g in groups for t in g.trajectories)
    # A row mixes versions when its newest and oldest real token differ: two reductions for the batch, not a
    # torch.unique per row.
    real = versions != PAD_VERSION
    newest = torch.where(real, versions, torch.iinfo(versions.dtype).min).amax(-1)
    oldest = torch.where(real, versions, torch.iinfo(versions.dtype).max).amin(-1)
    mixed = int(((newest != oldest) & real.any(-1)).sum())
    return {
        "reward/mean": float(np.mean(rewards)) if rewards else 0.0,
        "batch/groups": float(len(groups)),
        "batch/samples": float(len(rewards)),
        "batch/tokens": float(mask.sum().item()),
        "response_length/mean": float(lengths.float().mean().item()),
        "partial/resumed_samples": float(resumed),
        "partial/mixed_version_samples": float(mixed),
    }
