"""FSDPCriticBackend: values, one clipped-value-loss step per batch, fitting returns, checkpoints and GAE, on CPU.

Real verl code (DataParallelPPOCritic, compute_value_loss, the gae estimator) on the session's tiny random Qwen2
loaded as a one-label token classifier. Batches come from test_verl_patch.make_batch (6 rows, prompts of 4 and
responses of 5 tokens, some rows shorter).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from verl import DataProto
from verl_helpers import BATCH_SIZE, RESPONSE_LEN, make_batch

from rllm.experimental.fully_async.algorithms.advantages import AdvantageConfig
from rllm.experimental.fully_async.backends.critic import (
    FSDPCriticBackend,
    build_critic_config,
    validate_critic_section,
)

LR = 1e-2  # large, so a few steps on a tiny model visibly fit the returns
CLIP_V = 0.2


def critic_cfg(**overrides) -> dict:
    """The keys a user sets; everything else comes from verl's dataclass defaults."""
    cfg = {
        "ppo_micro_batch_size_per_gpu": 6,
        "cliprange_value": CLIP_V,
        "grad_clip": 1.0,
        "optim": {"lr": LR, "weight_decay": 0.0},
        "model": {"enable_gradient_checkpointing": False},
    }
    cfg.update(overrides)
    return cfg


def critic_batch(seed: int = 0, empty: bool = False) -> DataProto:
    """A trainer-shaped batch (float response_mask) with per-row returns in [-1, 1] on the response tokens."""
    data = make_batch(seed, empty_rows=tuple(range(BATCH_SIZE)) if empty else ())
    mask = data.batch["response_mask"].float()
    data.batch["response_mask"] = mask
    gen = torch.Generator().manual_seed(seed + 100)
    data.batch["returns"] = (2 * torch.rand(BATCH_SIZE, 1, generator=gen) - 1).expand(-1, RESPONSE_LEN) * mask
    return data


def params(backend: FSDPCriticBackend) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in backend.model.parameters()])


def adam_steps(backend: FSDPCriticBackend) -> set[int]:
    """The step count AdamW keeps per parameter: how many optimizer steps really happened."""
    return {int(state["step"]) for state in backend.optimizer.state.values()}


def masked_abs_error(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((values - returns).abs() * mask).sum() / mask.sum())


# ----------------------------------------------------------------------------------------------------------------
# Values
# ----------------------------------------------------------------------------------------------------------------


def test_values_have_one_finite_fp32_value_per_response_token_and_zero_on_padding(tiny_model_dir):
    backend = FSDPCriticBackend(tiny_model_dir, critic_cfg(forward_micro_batch_size_per_gpu=4))
    data = critic_batch()
    values = backend.compute_values(data)
    assert values.shape == (BATCH_SIZE, RESPONSE_LEN) and values.dtype == torch.float32
    assert torch.isfinite(values).all()
    mask = data.batch["response_mask"].bool()
    assert torch.all(values[~mask] == 0) and values[mask].abs().sum() > 0
    # The value of response token t is read from the position before it, in full fp32 (no bf16 autocast on CPU):
    # a plain forward of the same model gives the same numbers to float rounding.
    b = data.batch
    with torch.no_grad():
        logits = backend.model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        ).logits
    expected = logits[:, -RESPONSE_LEN - 1 : -1, 0] * b["response_mask"]
    torch.testing.assert_close(values, expected, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# The update
# ----------------------------------------------------------------------------------------------------------------


def test_vf_loss_is_the_clipped_value_loss_of_the_docstring_over_the_whole_batch(tiny_model_dir):
    backend = FSDPCriticBackend(tiny_model_dir, critic_cfg())
    data = critic_batch(seed=3)
    vpred = backend.compute_values(data)  # the weights the update's forward sees, before its step
    mask = data.batch["response_mask"]
    offsets = torch.linspace(-0.5, 0.5, BATCH_SIZE * RESPONSE_LEN).reshape(BATCH_SIZE, RESPONSE_LEN)
    old = (vpred + offsets) * mask  # V_old away from V_theta: the clip binds on some tokens, not on others
    data.batch["values"] = old
    returns = data.batch["returns"]

    clipped = torch.clamp(vpred, old - CLIP_V, old + CLIP_V)
    per_token = torch.maximum((vpred - returns) ** 2, (clipped - returns) ** 2)
    expected = 0.5 * (per_token * mask).sum() / mask.sum()  # token-mean over all 20 response tokens
    metrics = backend.update_critic(data)
    assert metrics["critic/vf_loss"] == pytest.approx(float(expected), rel=1e-5)
    assert 0 < metrics["critic/vf_clipfrac"] < 1


@pytest.mark.slow  # hundreds of critic updates (~17 s on a busy 2-core machine)
def test_update_critic_fits_fixed_returns(tiny_model_dir):
    backend = FSDPCriticBackend(tiny_model_dir, critic_cfg(ppo_micro_batch_size_per_gpu=4))
    data = critic_batch(seed=1)
    returns, mask = data.batch["returns"], data.batch["response_mask"]
    start_error = masked_abs_error(backend.compute_values(data), returns, mask)
    losses = []
    for _ in range(10):
        data.batch["values"] = backend.compute_values(data)  # as the trainer does: V_old fresh every batch
        metrics = backend.update_critic(data)
        assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values()), metrics
        losses.append(metrics["critic/vf_loss"])
    end_error = masked_abs_error(backend.compute_values(data), returns, mask)
    assert losses[-1] < 0.25 * losses[0], losses
    assert end_error < 0.5 * start_error, (start_error, end_error)


@pytest.mark.parametrize(
    "split",
    [
        {"ppo_micro_batch_size_per_gpu": 4},  # 4 rows do not divide 6: the backend uses micro-batches of 3
        {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 14, "ppo_micro_batch_size_per_gpu": None},
    ],
    ids=["static", "dynamic"],
)
def test_one_optimizer_step_per_call_whatever_verls_mini_batch_size_says(tiny_model_dir, split):
    # Plain verl would take 3 steps on 6 rows with ppo_mini_batch_size=2.
    cfg = critic_cfg(ppo_mini_batch_size=2, optim={"lr": LR, "lr_warmup_steps": 2}, **split)
    backend = FSDPCriticBackend(tiny_model_dir, cfg)
    lrs = []
    for call in range(1, 4):
        data = critic_batch(seed=call)
        data.batch["values"] = backend.compute_values(data)
        metrics = backend.update_critic(data)
        assert metrics["critic/optimizer_step"] == 1.0 and metrics["critic/grad_norm"] > 0
        assert adam_steps(backend) == {call} and backend.optimizer_steps == call
        lrs.append(metrics["critic/lr"])
    assert lrs == pytest.approx([0.0, LR / 2, LR])  # verl's linear warmup, one tick per step

    # A batch without response tokens takes no step: weights, Adam state and the schedule stay.
    before, lr_before = params(backend), backend.lr_scheduler.get_last_lr()
    empty = critic_batch(seed=9, empty=True)
    empty.batch["values"] = backend.compute_values(empty)
    metrics = backend.update_critic(empty)
    assert metrics["critic/optimizer_step"] == 0.0 and "critic/grad_norm" not in metrics
    assert torch.equal(params(backend), before) and adam_steps(backend) == {3}
    assert backend.optimizer_steps == 3 and backend.lr_scheduler.get_last_lr() == lr_before


def test_missing_inputs_are_named(tiny_model_dir):
    backend = FSDPCriticBackend(tiny_model_dir, critic_cfg())
    data = critic_batch()
    with pytest.raises(KeyError, match="values"):
        backend.update_critic(data)
    with pytest.raises(KeyError, match="position_ids"):
        backend.compute_values(DataProto(batch=data.batch.exclude("position_ids")))


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------------------


def test_state_dict_round_trip_restores_values_optimizer_and_schedule(tiny_model_dir):
    cfg = critic_cfg(optim={"lr": LR, "lr_warmup_steps": 3})
    original = FSDPCriticBackend(tiny_model_dir, cfg)
    data = critic_batch(seed=2)
    data.batch["values"] = original.compute_values(data)
    original.update_critic(data)
    state = original.state_dict()

    restored = FSDPCriticBackend(tiny_model_dir, cfg, seed=123)  # another head initialisation
    assert not torch.equal(restored.compute_values(data), original.compute_values(data))
    restored.load_state_dict(state)
    assert torch.equal(restored.compute_values(data), original.compute_values(data))
    assert restored.optimizer_steps == 1
    # One more step from the same state lands on the same weights: Adam moments and the warmup came along.
    data.batch["values"] = original.compute_values(data)
    m_original, m_restored = original.update_critic(data), restored.update_critic(data)
    assert m_restored["critic/lr"] == m_original["critic/lr"] == pytest.approx(LR / 3)
    torch.testing.assert_close(params(restored), params(original), rtol=0, atol=1e-7)


# ----------------------------------------------------------------------------------------------------------------
# GAE end to end and configuration
# ----------------------------------------------------------------------------------------------------------------


def test_gae_values_then_advantages_then_critic_update(tiny_model_dir):
    backend = FSDPCriticBackend(tiny_model_dir, critic_cfg())
    data = critic_batch(seed=4)
    mask = data.batch["response_mask"]
    last = (mask.sum(-1).long() - 1).clamp(min=0)
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(BATCH_SIZE), last] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])  # outcome reward
    data.batch["token_level_rewards"] = rewards
    del data.batch["returns"]

    data.batch["values"] = backend.compute_values(data)
    data = AdvantageConfig(adv_estimator="gae", gamma=1.0, lam=0.95).compute(data)
    for key in ("advantages", "returns"):
        assert torch.isfinite(data.batch[key]).all() and torch.all(data.batch[key][mask == 0] == 0)
    metrics = backend.update_critic(data)
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["critic/optimizer_step"] == 1.0 and metrics["critic/vf_loss"] > 0


def test_verls_generated_critic_section_and_the_run_config_build(tiny_model_dir):
    import verl
    from omegaconf import OmegaConf

    from rllm.experimental.fully_async.settings.loader import base_config

    generated = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    run = base_config()
    for section in (generated.critic, run.critic):
        section.ppo_micro_batch_size_per_gpu = 8
        validate_critic_section(section)
        config = build_critic_config(section, tiny_model_dir)
        assert type(config).__name__ == "FSDPCriticConfig" and type(config.optim).__name__ == "FSDPOptimizerConfig"
        assert config.ppo_epochs == 1 and config.forward_micro_batch_size_per_gpu == 8
        assert config.model.path == str(tiny_model_dir)  # the critic starts from the policy's folder


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"ppo_epochs": 2}, "critic.ppo_epochs"),
        ({"optim": {"lr": 0.0}}, "critic.optim.lr"),
        ({"ppo_micro_batch_size_per_gpu": None}, "critic.ppo_micro_batch_size_per_gpu"),
        ({"model": {"use_remove_padding": True}}, "critic.model.use_remove_padding"),
        ({"loss_agg_mode": "token-sum"}, "critic.loss_agg_mode"),
        ({"optim": {"lr": 1e-3, "lr_scheduler_type": "cosine"}}, "critic.optim.total_training_steps"),
    ],
)
def test_sections_the_backend_cannot_honour_are_refused_naming_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        validate_critic_section(critic_cfg(**override))
