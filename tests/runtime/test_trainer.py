"""FullyAsyncTrainer: on-policy equivalence, stale-group handling, short last batch, weight-sync cadence, and the
decoupled loss whose proximal policy comes from the update itself (equal to recomputing it).

The trainer runs with the real patched verl backend; the rollout side is its one-call contract over the real queue
bookkeeping (GroupBuffer), recording each request (version, acknowledgement).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from omegaconf import OmegaConf

from rllm.experimental.fully_async.algorithms.advantages import AdvantageConfig
from rllm.experimental.fully_async.api.step_messages import Ack, Batch, BatchRequest
from rllm.experimental.fully_async.api.trajectory import VersionedGroup, VersionedSequence, VersionedTrajectory
from rllm.experimental.fully_async.backends.fsdp import FSDPPolicyBackend, build_actor_config
from rllm.experimental.fully_async.core.batch import groups_to_dataproto
from rllm.experimental.fully_async.core.buffer import GroupBuffer
from rllm.experimental.fully_async.runtime.trainer.fully_async_trainer import (
    FullyAsyncTrainer,
    QueueTimeoutError,
    TrainerSettings,
)
from rllm.experimental.fully_async.settings.loader import verl_base_config

GROUPS = 4
SAMPLES = 4


class LocalRollouts:
    """The rollout side's one-call contract (api.step_messages.RolloutSource) over a queue of groups, recording every
    request and acknowledgement. Stale-group handling is the service's, tested in test_rollout_service.py."""

    def __init__(self, groups: list[VersionedGroup], closed: bool = False) -> None:
        self.buffer = GroupBuffer(max_groups=1000)
        self.buffer.push(groups)
        if closed:
            self.buffer.close()
        self.requests: list[BatchRequest] = []
        self.trained: list[str] = []
        self.acked_groups = 0
        self.syncs_open = 0  # begin_weight_sync without its end_weight_sync (the validation gate left closed)

    def take_batch(self, request: BatchRequest) -> Batch:
        self.requests.append(request)
        self.acknowledge(request.ack)
        n = request.n_groups
        if len(self.buffer) >= n:
            return Batch(self.buffer.pop(n), "ok", 0, 0.0)
        if self.buffer.closed:
            left = len(self.buffer)
            return Batch(self.buffer.pop(left), "ok", 0, 0.0) if left else Batch([], "closed", 0, 0.0)
        return Batch([], "timeout", 0, 0.0)

    def acknowledge(self, ack: Ack) -> None:
        self.trained += ack.sample_ids
        self.acked_groups += ack.groups

    def begin_weight_sync(self) -> float:
        self.syncs_open += 1
        return 0.0

    def end_weight_sync(self) -> None:
        self.syncs_open -= 1

    @property
    def versions(self) -> list[int]:
        return [r.version for r in self.requests]


def _actor_cfg(lr: float = 1e-3):
    cfg = verl_base_config().actor_rollout_ref.actor
    cfg.optim.lr = lr
    cfg.optim.weight_decay = 0.0
    cfg.use_torch_compile = False
    cfg.fsdp_config.use_torch_compile = False
    cfg.ppo_micro_batch_size_per_gpu = GROUPS * SAMPLES
    cfg.ppo_mini_batch_size = GROUPS * SAMPLES
    cfg.use_remove_padding = False
    return cfg


def _groups(backend: FSDPPolicyBackend | None, version: int, seed: int, prefix: str = "p") -> list[VersionedGroup]:
    """Random prompts/responses; rollout log-probs from `backend` (on-policy) or constant (stale data)."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(GROUPS):
        prompt = torch.randint(2, 32, (3 + g % 2,), generator=gen).tolist()
        trajectories = []
        for i in range(SAMPLES):
            response = torch.randint(2, 32, (2 + (i % 3),), generator=gen).tolist()
            seq = VersionedSequence(prompt, response, [-1.0] * len(response), [version] * len(response))
            trajectories.append(
                VersionedTrajectory(f"{prefix}{g}/{i}", f"{prefix}{g}", [seq], reward=float((g + i) % 2))
            )
        groups.append(VersionedGroup(f"{prefix}{g}", trajectories))
    if backend is not None:
        data = groups_to_dataproto(groups, pad_token_id=0, temperature=1.0)
        log_probs = backend.compute_log_prob(data)
        row = 0
        for group in groups:
            for trajectory in group.trajectories:
                n = len(trajectory.sequences[0].response_ids)
                trajectory.sequences[0].response_logprobs = log_probs[row, :n].tolist()
                row += 1
    return groups


def _settings(**overrides) -> TrainerSettings:
    values = dict(
        required_samples=GROUPS,
        trigger_parameter_sync_step=1,
        use_rollout_log_probs=True,
        compute_prox_log_prob=False,
        temperature=1.0,
        pad_token_id=0,
        queue_get_timeout_s=1.0,
    )
    values.update(overrides)
    return TrainerSettings(**values)


def _advantages() -> AdvantageConfig:
    return AdvantageConfig.from_config(OmegaConf.create({"algorithm": {"adv_estimator": "grpo"}}))


def test_staleness_zero_trigger_one_equals_a_synchronous_verl_step(tiny_model_dir):
    fully_async = FSDPPolicyBackend(tiny_model_dir, _actor_cfg())
    groups = _groups(fully_async, version=0, seed=1)
    rollouts = LocalRollouts(groups)
    trainer = FullyAsyncTrainer(_settings(), fully_async, rollouts, param_sync=None, advantages=_advantages())
    trainer.train_step()

    # Reference: verl's own synchronous on-policy step (flag off, one mini-batch = the batch, one micro-batch):
    # its on-policy shortcut takes old log-probs from the same forward pass.
    from verl.workers.actor.dp_actor import DataParallelPPOActor

    synchronous = FSDPPolicyBackend(tiny_model_dir, _actor_cfg())
    config = copy.deepcopy(synchronous.config)
    object.__setattr__(config, "fully_async", False)
    actor = DataParallelPPOActor(config, synchronous.model, synchronous.optimizer)
    actor.param_dtype = torch.float32
    data = _advantages().compute(groups_to_dataproto(copy.deepcopy(groups), pad_token_id=0, temperature=1.0))
    data.batch["old_log_probs"] = torch.zeros_like(data.batch["rollout_log_probs"])  # replaced by verl on-policy
    del data.batch["rollout_log_probs"]
    actor.update_policy(data)

    for (name, a), b in zip(fully_async.model.named_parameters(), synchronous.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), name
    start = FSDPPolicyBackend(tiny_model_dir, _actor_cfg())
    moved = any(
        not torch.equal(a, b) for a, b in zip(start.model.parameters(), fully_async.model.parameters(), strict=True)
    )
    assert moved  # the comparison is not vacuous: the step changed the weights
    assert trainer.version == 1 and rollouts.versions == [0]
    assert rollouts.trained == []  # the acknowledgement waits for the next request ...
    trainer.flush_ack()  # ... or a checkpoint
    assert sorted(rollouts.trained) == sorted(t.uid for g in groups for t in g.trajectories)
    assert rollouts.acked_groups == GROUPS
    trainer.flush_ack()
    assert rollouts.acked_groups == GROUPS  # delivered once


def test_one_request_per_step_carries_the_version_and_the_previous_acknowledgement(tiny_model_dir):
    backend = FSDPPolicyBackend(tiny_model_dir, _actor_cfg())
    first, second = _groups(None, version=2, seed=2, prefix="a"), _groups(None, version=3, seed=3, prefix="b")
    rollouts = LocalRollouts(first + second)
    trainer = FullyAsyncTrainer(_settings(), backend, rollouts, param_sync=None, advantages=_advantages(), version=3)
    metrics = trainer.train_step()
    assert metrics["staleness/max"] == 1 and metrics["staleness/dropped_groups"] == 0
    # GRPO advantages of rewards alternating 0/1 within each group: centred, spread, none zero
    assert metrics["advantages/adv_mean"] == pytest.approx(0.0, abs=1e-5) and metrics["advantages/adv_abs_max"] > 0
    assert metrics["advantages/zero_adv_token_fraction"] == 0.0
    assert metrics["advantages/num_groups"] == GROUPS and metrics["advantages/num_zero_spread_groups"] == 0
    # the trainer's CPU seconds over its compute and the host's cores (simulate --from divides contention out)
    compute_wall = sum(metrics[f"timing/{k}_s"] for k in ("assemble", "advantages", "update", "bookkeeping"))
    assert metrics["timing/compute_cpu_s"] > 0 and metrics["host/cpus"] >= 1
    assert metrics["timing/compute_cpu_s"] <= compute_wall * metrics["host/cpus"] + 0.05
    trainer.train_step()
    assert len(rollouts.requests) == 2  # one call per step
    assert rollouts.requests[0].ack == Ack() and rollouts.versions == [3, 4]
    assert sorted(rollouts.requests[1].ack.sample_ids) == sorted(t.uid for g in first for t in g.trajectories)
    assert rollouts.requests[1].ack.groups == GROUPS


def test_a_closed_queue_gives_a_short_last_batch_then_none(tiny_model_dir):
    backend = FSDPPolicyBackend(tiny_model_dir, _actor_cfg())
    groups = _groups(backend, version=0, seed=4)[:3]  # fewer than required_samples
    rollouts = LocalRollouts(groups, closed=True)
    trainer = FullyAsyncTrainer(_settings(), backend, rollouts, param_sync=None, advantages=_advantages())
    metrics = trainer.train_step()
    assert metrics["batch/groups"] == 3
    assert trainer.train_step() is None
    assert len(rollouts.trained) == 3 * SAMPLES  # acknowledged by the request that found the rollouts ended


def test_weights_sync_every_k_steps_and_a_stalled_queue_times_out_with_a_message(tiny_model_dir):
    backend = FSDPPolicyBackend(tiny_model_dir, _actor_cfg())
    groups = _groups(backend, version=0, seed=5) + _groups(backend, version=0, seed=6, prefix="q")
    rollouts = LocalRollouts(groups)
    trainer = FullyAsyncTrainer(
        _settings(trigger_parameter_sync_step=2),
        backend,
        rollouts,
        param_sync=None,
        advantages=_advantages(),
    )
    trainer.train_step()
    assert trainer.version == 0
    trainer.train_step()
    assert trainer.version == 1 and rollouts.versions == [0, 0]
    assert trainer.push_last_weights() == {} and trainer.version == 1  # step 2 synced: nothing left to push
    with pytest.raises(QueueTimeoutError, match="queue_get_timeout_s"):
        trainer.train_step()


def test_a_run_ending_between_syncs_pushes_its_last_weights_once(tiny_model_dir):
    backend = FSDPPolicyBackend(tiny_model_dir, _actor_cfg())
    rollouts = LocalRollouts(_groups(backend, version=0, seed=5))
    trainer = FullyAsyncTrainer(
        _settings(trigger_parameter_sync_step=2), backend, rollouts, param_sync=None, advantages=_advantages()
    )
    trainer.train_step()
    assert trainer.version == 0  # step 1 of K = 2: no sync
    trainer.push_last_weights()
    assert trainer.version == 1
    trainer.push_last_weights()
    assert trainer.version == 1  # already pushed


def test_adaptive_staleness_moves_eta_at_a_sync_and_the_next_request_carries_it(tiny_model_dir):
    from rllm.experimental.fully_async.core.adaptive_staleness import AdaptiveStalenessRule, StalenessController

    backend = FSDPPolicyBackend(tiny_model_dir, _actor_cfg())
    on_policy = _groups(backend, version=0, seed=5) + _groups(backend, version=0, seed=6, prefix="q")
    rollouts = LocalRollouts(on_policy + _stale_groups(backend, seed=7))
    # raise_when_waiting=0: these rollouts are in memory, so the trainer never waits for a batch.
    lenient = AdaptiveStalenessRule(
        min=1, max=3, raise_after=1, min_ess=0.5, max_kl=0.5, max_cut=0.5, raise_margin=1, raise_when_waiting=0
    )
    controller = StalenessController(lenient, eta=2)
    trainer = FullyAsyncTrainer(
        _settings(), backend, rollouts, param_sync=None, advantages=_advantages(), staleness=controller
    )
    first = trainer.train_step()  # on-policy data: every statistic inside, η 2 -> 3 at the sync
    assert first["adaptive/ess"] == pytest.approx(1.0, abs=1e-3) and first["staleness/eta"] == 3
    assert first["staleness/eta_change"] == 1 and 0 <= first["adaptive/trainer_wait"] < 0.5
    trainer.train_step()  # already at max: held
    third = trainer.train_step()  # behaviour log-probs off by N(0, 1): ess far below 0.5, η 3 -> 2
    assert third["adaptive/ess"] < 0.5 and third["staleness/eta"] == 2 and third["staleness/eta_change"] == -1
    assert [r.max_staleness for r in rollouts.requests] == [2, 3, 3]
    assert trainer.state_dict()["staleness"] == {"eta": 2, "clear_streak": 0}


def _stale_groups(backend: FSDPPolicyBackend, seed: int) -> list[VersionedGroup]:
    """Groups whose rollout log-probs are the backend's plus noise: behaviour weights spread around 1, some > 2."""
    groups = _groups(backend, version=0, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    for group in groups:
        for trajectory in group.trajectories:
            sequence = trajectory.sequences[0]
            noise = torch.randn(len(sequence.response_logprobs), generator=gen)
            sequence.response_logprobs = [
                lp + float(n) for lp, n in zip(sequence.response_logprobs, noise, strict=True)
            ]
    return groups


def _trained_with(tiny_model_dir, groups, correction_section: dict, **actor_overrides):
    """One trainer step with `correction_section` as algorithm.off_policy_correction (and `actor_overrides` on the
    actor section); returns (backend, metrics)."""
    from rllm.experimental.fully_async.algorithms.corrections import build_correction

    correction = build_correction(OmegaConf.create({"algorithm": {"off_policy_correction": correction_section}}))
    actor_cfg = _actor_cfg()
    for key, value in actor_overrides.items():
        actor_cfg[key] = value
    if correction.policy_loss_mode is not None:  # as the trainer actor does before it builds the backend
        actor_cfg.policy_loss.loss_mode = correction.policy_loss_mode
    backend = FSDPPolicyBackend(tiny_model_dir, actor_cfg)
    trainer = FullyAsyncTrainer(
        _settings(),
        backend,
        LocalRollouts(copy.deepcopy(groups)),
        param_sync=None,
        advantages=_advantages(),
        correction=correction,
    )
    return backend, trainer.train_step()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_loglinear_proximal_from_the_update_equals_recomputation(tiny_model_dir, level):
    # With one mini-batch per step the log-linear pi_prox is the update's own detached log-probs, i.e. the policy
    # before the step: the same step as recomputing it in a separate forward pass, without that pass.
    groups = _stale_groups(FSDPPolicyBackend(tiny_model_dir, _actor_cfg()), seed=3)
    section = {"mode": "decoupled", "level": level, "cap_mode": "truncate", "cap": 2.0}
    recompute, recompute_metrics = _trained_with(tiny_model_dir, groups, section | {"prox_log_probs": "recompute"})
    loglinear, loglinear_metrics = _trained_with(tiny_model_dir, groups, section | {"prox_log_probs": "loglinear"})
    bypass, _ = _trained_with(tiny_model_dir, groups, {"mode": "bypass"})

    for (name, a), b in zip(recompute.model.named_parameters(), loglinear.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), name
    # Not vacuous: the weights matter (no correction steps elsewhere), and some were capped.
    assert any(
        not torch.allclose(a, b, atol=1e-5)
        for a, b in zip(recompute.model.parameters(), bypass.model.parameters(), strict=True)
    )
    assert recompute_metrics["off_policy/capped_token_fraction"] > 0
    for stat in ("weight_mean", "weight_max", "capped_token_fraction", "capped_seq_fraction"):
        # computed inside the loss per micro-batch; one micro-batch here, so equal to the batch-level statistics
        assert loglinear_metrics[f"off_policy/{stat}"] == pytest.approx(recompute_metrics[f"off_policy/{stat}"]), stat
    assert loglinear_metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)  # ratio against pi_prox is 1


def test_a_previous_weights_proximal_policy_reaches_the_update_through_the_backend_the_trainer_actor_builds(
    tiny_model_dir,
):
    """prox_log_probs=previous: the backend `build_policy_backend` makes for it keeps its weights from before each
    step, and on the second step the proximal policy is the weights before the first: PPO's ratio against it is not
    1 at the step (ppo_kl != 0), where a proximal policy recomputed at the step leaves it at 1 (ppo_kl 0)."""
    from types import SimpleNamespace

    from rllm.experimental.fully_async.algorithms.corrections import build_correction
    from rllm.experimental.fully_async.runtime.trainer.build import build_policy_backend

    def two_steps(prox: str) -> tuple[FSDPPolicyBackend, dict]:
        section = {"mode": "decoupled", "prox_log_probs": prox}
        correction = build_correction(OmegaConf.create({"algorithm": {"off_policy_correction": section}}))
        spec = SimpleNamespace(
            model_path=str(tiny_model_dir),
            actor=OmegaConf.to_container(_actor_cfg()),
            strategy="fsdp2",
            world_size=1,
            seed=0,
            enable_gradient_checkpointing=False,
        )
        backend, _ = build_policy_backend(spec, correction)
        groups = _stale_groups(backend, seed=5) + _stale_groups(backend, seed=6)  # version 0: stale at step 2
        trainer = FullyAsyncTrainer(
            _settings(),
            backend,
            LocalRollouts(groups),
            param_sync=None,
            advantages=_advantages(),
            correction=correction,
        )
        trainer.train_step()
        return backend, trainer.train_step()

    previous_backend, previous = two_steps("previous")
    recompute_backend, recompute = two_steps("recompute")
    assert previous_backend.keep_previous_weights and not recompute_backend.keep_previous_weights
    assert recompute["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-7)
    assert abs(previous["actor/ppo_kl"]) > 1e-5, previous["actor/ppo_kl"]


def _synchronous_steps(tiny_model_dir, section: dict | None, steps: int = 3, lr: float = 0.05) -> list[dict]:
    """`steps` synchronous steps (η = 0, K = 1: each batch generated by the trainer's weights of that step, tagged
    with its version) with `section` as algorithm.off_policy_correction, through the backend the trainer actor
    builds; returns each step's metrics. A large learning rate moves the policy enough for a clip to bind."""
    from types import SimpleNamespace

    from rllm.experimental.fully_async.algorithms.corrections import build_correction
    from rllm.experimental.fully_async.runtime.trainer.build import build_policy_backend

    correction = build_correction(OmegaConf.create({"algorithm": {"off_policy_correction": section}}))
    spec = SimpleNamespace(
        model_path=str(tiny_model_dir),
        actor=OmegaConf.to_container(_actor_cfg(lr=lr)),
        strategy="fsdp2",
        world_size=1,
        seed=0,
        enable_gradient_checkpointing=False,
    )
    backend, _ = build_policy_backend(spec, correction)
    rollouts = LocalRollouts([])
    trainer = FullyAsyncTrainer(
        _settings(), backend, rollouts, param_sync=None, advantages=_advantages(), correction=correction
    )
    metrics = []
    for step in range(steps):
        rollouts.buffer.push(_groups(backend, version=trainer.version, seed=40 + step, prefix=f"s{step}-"))
        metrics.append(trainer.train_step())
    return metrics


def test_the_synchronous_control_clips_against_the_policy_one_step_back_where_plain_sync_never_clips(tiny_model_dir):
    """control_prox=previous_step at η = 0: every token's proximal policy is the weights one step back, so from the
    second step on the clip binds (pg_clipfrac > 0, ppo_kl != 0) on on-policy data; plain synchronous PPO, and
    prox_log_probs=previous without the control (a token of the trainer's version keeps pi_behav), never clip."""
    plain = _synchronous_steps(tiny_model_dir, None)
    previous = _synchronous_steps(tiny_model_dir, {"mode": "decoupled", "prox_log_probs": "previous"})
    control = _synchronous_steps(
        tiny_model_dir, {"mode": "decoupled", "prox_log_probs": "previous", "control_prox": "previous_step"}
    )
    for metrics in (plain, previous):
        assert all(m["actor/pg_clipfrac"] == 0.0 for m in metrics), [m["actor/pg_clipfrac"] for m in metrics]
    assert control[0]["actor/pg_clipfrac"] == 0.0  # step 1: no step back yet, the policy is its own proximal one
    assert all(m["actor/pg_clipfrac"] > 0.0 for m in control[1:]), [m["actor/pg_clipfrac"] for m in control]
    assert all(abs(m["actor/ppo_kl"]) > 1e-5 for m in control[1:])
    # w = pi_{V-1} / pi_behav: not 1 once the step back differs from the current weights
    assert control[1]["off_policy/weight_max"] > 1.0 > control[1]["off_policy/weight_min"]


def test_the_m2po_control_masks_on_the_movement_since_the_step_back_and_keeps_the_on_policy_gradient(tiny_model_dir):
    """mode=m2po with control_prox=previous_step: the second moment of log pi_theta - log pi_{V-1} masks tokens at
    η = 0 (plain m2po's log-ratio against pi_behav is 0 at the step, so it never masks there)."""
    plain = _synchronous_steps(tiny_model_dir, {"mode": "m2po", "tau": 0.001})
    control = _synchronous_steps(tiny_model_dir, {"mode": "m2po", "tau": 0.001, "control_prox": "previous_step"})
    assert all(m["off_policy/masked_token_fraction"] == 0.0 for m in plain)
    assert control[0]["off_policy/masked_token_fraction"] == 0.0
    assert all(m["off_policy/masked_token_fraction"] > 0.0 for m in control[1:])
    assert control[1]["off_policy/weight_max"] > 1.0 > control[1]["off_policy/weight_min"]


def test_with_several_steps_per_sync_the_previous_weights_move_only_at_a_sync(tiny_model_dir):
    """prox_log_probs=previous at K = 2: the trainer tells the backend when its weights become a version, so the
    proximal policy is version V - 1's weights (those of the sync before the last), not the last step's."""
    from types import SimpleNamespace

    from rllm.experimental.fully_async.algorithms.corrections import build_correction
    from rllm.experimental.fully_async.runtime.trainer.build import build_policy_backend

    correction = build_correction(
        OmegaConf.create({"algorithm": {"off_policy_correction": {"mode": "decoupled", "prox_log_probs": "previous"}}})
    )
    spec = SimpleNamespace(
        model_path=str(tiny_model_dir),
        actor=OmegaConf.to_container(_actor_cfg()),
        strategy="fsdp2",
        world_size=1,
        seed=0,
        enable_gradient_checkpointing=False,
    )
    backend, _ = build_policy_backend(spec, correction)
    rollouts = LocalRollouts([])
    trainer = FullyAsyncTrainer(
        _settings(trigger_parameter_sync_step=2),
        backend,
        rollouts,
        param_sync=None,
        advantages=_advantages(),
        correction=correction,
    )
    weights = [[p.detach().clone() for p in backend.model.parameters()]]  # after each step (index 0: initial)
    for step in range(5):
        rollouts.buffer.push(_groups(backend, version=trainer.version, seed=60 + step, prefix=f"k{step}-"))
        trainer.train_step()
        weights.append([p.detach().clone() for p in backend.model.parameters()])
    # syncs after steps 2 and 4: version 2 is in force, its previous version is the weights after step 2
    assert trainer.version == 2
    kept = backend.previous_weights.tensors
    assert all(torch.equal(a, b) for a, b in zip(kept, weights[2], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(kept, weights[4], strict=True))  # not the last step's


def test_m2po_runs_in_verls_update_as_unclipped_importance_weighted_ppo_with_its_mask(tiny_model_dir):
    # Through the real actor update: with tau above every squared log-ratio nothing is masked and the step is verl's
    # PPO against the behaviour policy with the clip (and dual clip) out of reach; a tau that binds masks a share of
    # the tokens, reports it, and changes the step.
    groups = _stale_groups(FSDPPolicyBackend(tiny_model_dir, _actor_cfg()), seed=4)  # (log r)^2 ~ 1 on average
    loose, loose_metrics = _trained_with(tiny_model_dir, groups, {"mode": "m2po", "tau": 1e6})
    unclipped, _ = _trained_with(
        tiny_model_dir, groups, {"mode": "bypass"}, clip_ratio_low=1e6, clip_ratio_high=1e6, clip_ratio_c=1e9
    )
    for (name, a), b in zip(loose.model.named_parameters(), unclipped.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), name
    assert loose_metrics["off_policy/masked_token_fraction"] == 0.0 and loose_metrics["off_policy/m2"] > 0.5
    strict, strict_metrics = _trained_with(tiny_model_dir, groups, {"mode": "m2po", "tau": 0.5})
    assert 0 < strict_metrics["off_policy/masked_token_fraction"] < 1
    assert strict_metrics["off_policy/m2_kept"] < 0.5
    assert any(
        not torch.allclose(a, b, atol=1e-5)
        for a, b in zip(strict.model.parameters(), loose.model.parameters(), strict=True)
    )


def test_loglinear_mask_mode_gives_rejected_tokens_no_gradient():
    from rllm.experimental.fully_async.algorithms.correction_config import CorrectionConfig
    from rllm.experimental.fully_async.algorithms.decoupled_loss import decoupled_update_time_loss

    config = build_actor_config(_actor_cfg())
    log_prob = torch.tensor([[-1.0, -1.0, -1.0, -1.0]], requires_grad=True)
    behav = torch.tensor([[-1.0, -3.0, 1.0, -1.2]])  # w = 1, e^2 (rejected), e^-2 (rejected), e^0.2
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    loss, metrics = decoupled_update_time_loss(
        behav, log_prob, torch.ones(1, 4), mask, config=config, correction=CorrectionConfig(cap_mode="mask", cap=2.0)
    )
    loss.backward()
    gradient = log_prob.grad[0]
    assert gradient[1] == 0 and gradient[2] == 0
    assert gradient[0] == pytest.approx(-1 / 4) and gradient[3] == pytest.approx(-math.exp(0.2) / 4)
    assert metrics["off_policy/masked_token_fraction"] == pytest.approx(0.5)

    empty_loss, empty_metrics = decoupled_update_time_loss(
        behav, log_prob, torch.ones(1, 4), torch.zeros(1, 4), config=config, correction=CorrectionConfig()
    )
    assert torch.isfinite(empty_loss) and not any(k.startswith("off_policy/") for k in empty_metrics)


@pytest.mark.parametrize("policy", ["restart", "continue", "stop"])
def test_a_sync_finding_every_engine_dead_goes_on_only_when_a_restart_will_bring_them_back(
    tiny_model_dir, tmp_path, policy
):
    from rllm.experimental.fully_async.engines import free_port
    from rllm.experimental.fully_async.runtime.sync.param_sync import DiskTransport, ParamSync, SyncError

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: a killed engine
    backend = FSDPPolicyBackend(tiny_model_dir, _actor_cfg())
    with ParamSync([dead], DiskTransport(tmp_path / "weights"), pause_timeout_s=5) as param_sync:
        rollouts = LocalRollouts([])
        trainer = FullyAsyncTrainer(_settings(on_engine_failure=policy), backend, rollouts, param_sync, _advantages())
        if policy != "restart":
            with pytest.raises(SyncError, match=dead):
                trainer.sync_weights()
            assert trainer.version == 0 and param_sync.engine_urls == [dead]
            assert rollouts.syncs_open == 0, "a failed sync must reopen the validation gate"
            return
        assert trainer.sync_weights() == {"sync/engines_lost": 1.0, "sync/wait_validation_s": 0.0}
        assert rollouts.syncs_open == 0
        # The version moves on and its weights are staged for the restarted engine to load.
        assert trainer.version == 1
        assert param_sync.engine_urls == [] and (tmp_path / "weights" / "v1" / "model.safetensors").exists()
