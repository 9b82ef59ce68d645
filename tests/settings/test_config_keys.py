"""Honest configuration: every key is honoured, its effect observed, or refused in one line when loading.

"Honoured" is an observed effect, grouped by what is observed:
- the trainer's verl keys (the actor section, `actor_rollout_ref.model.*`, the critic section): the policy or
  critic backend is built from the loaded config exactly as the trainer builds it (`build_policy_backend`,
  `build_critic_backend`), and the key must change what was built (parameter dtype, gradient checkpointing on the
  module, the optimizer and its hyperparameters, the LR schedule, the entropy function) or what one update on a
  fixed batch does (the parameter change, verl's metrics, forward passes per micro-batch and recomputation,
  checkpointed calls): tests/helpers/config_effects.py. Each key is tried in the setting it is read in (a loss mode,
  dynamic micro-batches, the entropy being computed); outside that setting it is refused, and that is checked too.
- engine keys: the command line each engine is started with and the launcher's settings (engines/from_config.py).
- sampling keys: the sampling parameters every rollout request carries.
- the rest (the run's lifecycle: timeouts, restart policy, staleness budget, run directory, loggers, resume,
  workflows, rewards, advantages, corrections, filters, data order): the frozen run spec the runtime shells are
  built from must change, field by field. `SPEC_LEVEL` lists these keys with the component that reads each.

Keys only a GPU can show (`GPU_ONLY`: the autocast dtype and the three offload keys) are refused on CPU here, and
their effects are checked on CUDA by tests/gpu/test_config_keys_gpu.py. Every other verl leaf is refused by name.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import torch
from config_effects import critic, policy
from lora_helpers import write_adapter
from omegaconf import OmegaConf

from rllm.experimental.fully_async.run_spec import build_run_spec
from rllm.experimental.fully_async.settings.loader import ConfigError, base_config, load_config
from rllm.experimental.fully_async.settings.model_source import check_lora_adapter
from rllm.experimental.fully_async.settings.schema import PROJECT_SECTIONS
from rllm.experimental.fully_async.settings.verl_keys import (
    READ_ONLY_WHEN,
    VERL_KEYS_NOT_READ,
    VERL_KEYS_READ,
    is_read,
)

REPO = Path(__file__).resolve().parents[2]
ACTOR = "actor_rollout_ref.actor"


class SGD(torch.optim.SGD):
    """An optimizer class of this module, for `optim.optimizer_impl=test_config_keys` to be seen choosing it."""


@dataclass(frozen=True)
class Case:
    """A key's effect: the observation under `context` differs from the one under `context + change`."""

    change: tuple[str, ...]
    context: tuple[str, ...] = ()
    update: bool = True  # observe one update (slower); False: what was built and the LR schedule suffice


def case(*change: str, context: tuple[str, ...] = (), update: bool = True) -> Case:
    return Case(tuple(change), context, update)


# --- the trainer's verl keys ----------------------------------------------------------------------------------

# SGD: its step is the gradient itself, so what scales the gradient (grad_clip, loss scale, aggregation) shows in
# the parameter change (AdamW's first step is lr x sign(gradient), whatever the scale).
POLICY_BASE = (f"{ACTOR}.optim.optimizer=SGD", f"{ACTOR}.optim.lr=1.0")
ENTROPY = (f"{ACTOR}.entropy_coeff=0.01",)
SAPO, CLIP_COV, KL_COV = (f"{ACTOR}.policy_loss.loss_mode={mode}" for mode in ("sapo", "clip_cov", "kl_cov"))
NO_CLIP_BOUNDS = (f"{ACTOR}.clip_ratio_low=null", f"{ACTOR}.clip_ratio_high=null")
SHORT_SCHEDULE = (f"{ACTOR}.optim.total_training_steps=4",)
# config/tiny_cpu.yaml sets ppo_micro_batch_size_per_gpu, which dynamic micro-batching does not read: null clears it
NO_STATIC = (f"{ACTOR}.ppo_micro_batch_size_per_gpu=null",)
DYNAMIC = (f"{ACTOR}.use_dynamic_bsz=true", *NO_STATIC)
CLIP_COV_ALL = (CLIP_COV, f"{ACTOR}.policy_loss.clip_cov_lb=-10.0", f"{ACTOR}.policy_loss.clip_cov_ub=10.0")
LORA = ("actor_rollout_ref.model.lora_rank=4",)

POLICY_CASES: dict[str, Case] = {
    # what is built
    "actor_rollout_ref.model.enable_gradient_checkpointing": case(
        "actor_rollout_ref.model.enable_gradient_checkpointing=true"  # on the module, and recomputed in backward
    ),
    f"{ACTOR}.fsdp_config.model_dtype": case(f"{ACTOR}.fsdp_config.model_dtype=bf16", update=False),
    # LoRA: the adapter peft builds (its rank, scaling and modules, in `describe`) and what a step moves
    "actor_rollout_ref.model.lora_rank": case(*LORA),
    "actor_rollout_ref.model.lora_alpha": case("actor_rollout_ref.model.lora_alpha=64", context=LORA),
    "actor_rollout_ref.model.target_modules": case("actor_rollout_ref.model.target_modules=[q_proj]", context=LORA),
    "actor_rollout_ref.model.exclude_modules": case(
        "actor_rollout_ref.model.exclude_modules=[down_proj]", context=LORA
    ),
    # the saved adapter (the `start_adapter` fixture's folder, for SAVED_ADAPTER) is what the policy starts from
    "actor_rollout_ref.model.lora_adapter_path": case(
        "actor_rollout_ref.model.lora_adapter_path=SAVED_ADAPTER", context=LORA
    ),
    f"{ACTOR}.use_torch_compile": case(f"{ACTOR}.use_torch_compile=true", context=ENTROPY, update=False),
    f"{ACTOR}.entropy_from_logits_with_chunking": case(
        f"{ACTOR}.entropy_from_logits_with_chunking=true", context=ENTROPY, update=False
    ),
    # the optimizer and its schedule
    f"{ACTOR}.optim.optimizer": case(f"{ACTOR}.optim.optimizer=Adam", update=False),
    f"{ACTOR}.optim.optimizer_impl": case(f"{ACTOR}.optim.optimizer_impl={__name__}", update=False),
    f"{ACTOR}.optim.lr": case(f"{ACTOR}.optim.lr=0.5", update=False),
    f"{ACTOR}.optim.weight_decay": case(f"{ACTOR}.optim.weight_decay=0.1", update=False),
    f"{ACTOR}.optim.betas": case(
        f"{ACTOR}.optim.betas=[0.8,0.9]", context=(f"{ACTOR}.optim.optimizer=AdamW",), update=False
    ),
    f"{ACTOR}.optim.override_optimizer_config": case(
        f"{ACTOR}.optim.override_optimizer_config={{momentum: 0.9}}", update=False
    ),
    f"{ACTOR}.optim.lr_scheduler_type": case(f"{ACTOR}.optim.lr_scheduler_type=constant", update=False),
    f"{ACTOR}.optim.warmup_style": case(f"{ACTOR}.optim.warmup_style=constant", update=False),
    f"{ACTOR}.optim.lr_warmup_steps": case(f"{ACTOR}.optim.lr_warmup_steps=3", update=False),
    f"{ACTOR}.optim.lr_warmup_steps_ratio": case(f"{ACTOR}.optim.lr_warmup_steps_ratio=0.01", update=False),
    f"{ACTOR}.optim.total_training_steps": case(f"{ACTOR}.optim.total_training_steps=10", update=False),
    f"{ACTOR}.optim.min_lr_ratio": case(f"{ACTOR}.optim.min_lr_ratio=0.5", context=SHORT_SCHEDULE, update=False),
    f"{ACTOR}.optim.num_cycles": case(f"{ACTOR}.optim.num_cycles=0.25", context=SHORT_SCHEDULE, update=False),
    # micro-batching: forward passes per update
    f"{ACTOR}.ppo_micro_batch_size_per_gpu": case(f"{ACTOR}.ppo_micro_batch_size_per_gpu=2"),
    f"{ACTOR}.use_dynamic_bsz": case(
        f"{ACTOR}.use_dynamic_bsz=true", *NO_STATIC, f"{ACTOR}.ppo_max_token_len_per_gpu=9"
    ),
    f"{ACTOR}.ppo_max_token_len_per_gpu": case(f"{ACTOR}.ppo_max_token_len_per_gpu=9", context=DYNAMIC),
    # the loss and the step
    f"{ACTOR}.clip_ratio": case(f"{ACTOR}.clip_ratio=0.1", context=NO_CLIP_BOUNDS),
    f"{ACTOR}.clip_ratio_low": case(f"{ACTOR}.clip_ratio_low=0.1"),
    f"{ACTOR}.clip_ratio_high": case(f"{ACTOR}.clip_ratio_high=0.1"),
    f"{ACTOR}.clip_ratio_c": case(f"{ACTOR}.clip_ratio_c=1.5"),
    f"{ACTOR}.loss_agg_mode": case(f"{ACTOR}.loss_agg_mode=seq-mean-token-mean"),
    f"{ACTOR}.loss_scale_factor": case(
        f"{ACTOR}.loss_scale_factor=3", context=(f"{ACTOR}.loss_agg_mode=seq-mean-token-sum-norm",)
    ),
    f"{ACTOR}.entropy_coeff": case(f"{ACTOR}.entropy_coeff=0.5"),
    f"{ACTOR}.calculate_entropy": case(f"{ACTOR}.calculate_entropy=true"),
    f"{ACTOR}.entropy_checkpointing": case(f"{ACTOR}.entropy_checkpointing=true", context=ENTROPY),
    f"{ACTOR}.grad_clip": case(f"{ACTOR}.grad_clip=0.001"),
    f"{ACTOR}.policy_loss.loss_mode": case(f"{ACTOR}.policy_loss.loss_mode=gspo"),
    f"{ACTOR}.tau_pos": case(f"{ACTOR}.tau_pos=3.0", context=(SAPO,)),
    f"{ACTOR}.tau_neg": case(f"{ACTOR}.tau_neg=3.0", context=(SAPO,)),
    # clip_cov detaches a clip_cov_ratio share of the tokens whose advantage-log-prob covariance is in [lb, ub]
    f"{ACTOR}.policy_loss.clip_cov_ratio": case(f"{ACTOR}.policy_loss.clip_cov_ratio=0.5", context=CLIP_COV_ALL),
    f"{ACTOR}.policy_loss.clip_cov_lb": case(
        f"{ACTOR}.policy_loss.clip_cov_lb=-10.0", context=(CLIP_COV, f"{ACTOR}.policy_loss.clip_cov_ratio=0.5")
    ),
    f"{ACTOR}.policy_loss.clip_cov_ub": case(
        f"{ACTOR}.policy_loss.clip_cov_ub=0.0", context=(*CLIP_COV_ALL, f"{ACTOR}.policy_loss.clip_cov_ratio=0.5")
    ),
    f"{ACTOR}.policy_loss.kl_cov_ratio": case(f"{ACTOR}.policy_loss.kl_cov_ratio=0.5", context=(KL_COV,)),
    f"{ACTOR}.policy_loss.ppo_kl_coef": case(
        f"{ACTOR}.policy_loss.ppo_kl_coef=5.0", context=(KL_COV, f"{ACTOR}.policy_loss.kl_cov_ratio=0.5")
    ),
}

GAE = ("algorithm.adv_estimator=gae", "critic.optim.optimizer=SGD", "critic.optim.lr=1.0")
CRITIC_SHORT_SCHEDULE = ("critic.optim.total_training_steps=4", "critic.optim.lr_scheduler_type=cosine")
CRITIC_CASES: dict[str, Case] = {
    "critic.model.enable_gradient_checkpointing": case("critic.model.enable_gradient_checkpointing=true"),
    "critic.optim.optimizer": case("critic.optim.optimizer=Adam"),
    "critic.optim.optimizer_impl": case(f"critic.optim.optimizer_impl={__name__}"),
    "critic.optim.lr": case("critic.optim.lr=0.5"),
    "critic.optim.weight_decay": case("critic.optim.weight_decay=0.1"),
    "critic.optim.betas": case("critic.optim.betas=[0.8,0.9]", context=("critic.optim.optimizer=AdamW",)),
    "critic.optim.override_optimizer_config": case("critic.optim.override_optimizer_config={momentum: 0.9}"),
    "critic.optim.lr_scheduler_type": case("critic.optim.lr_scheduler_type=cosine", context=CRITIC_SHORT_SCHEDULE[:1]),
    "critic.optim.warmup_style": case("critic.optim.warmup_style=cosine", context=CRITIC_SHORT_SCHEDULE[:1]),
    "critic.optim.lr_warmup_steps": case("critic.optim.lr_warmup_steps=3"),
    "critic.optim.lr_warmup_steps_ratio": case("critic.optim.lr_warmup_steps_ratio=0.5"),
    "critic.optim.total_training_steps": case(
        "critic.optim.total_training_steps=10", context=CRITIC_SHORT_SCHEDULE[1:]
    ),
    "critic.optim.min_lr_ratio": case("critic.optim.min_lr_ratio=0.5", context=CRITIC_SHORT_SCHEDULE),
    "critic.optim.num_cycles": case("critic.optim.num_cycles=0.25", context=CRITIC_SHORT_SCHEDULE),
    "critic.ppo_micro_batch_size_per_gpu": case("critic.ppo_micro_batch_size_per_gpu=2"),
    "critic.forward_micro_batch_size_per_gpu": case("critic.forward_micro_batch_size_per_gpu=2"),
    "critic.use_dynamic_bsz": case("critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=9"),
    "critic.ppo_max_token_len_per_gpu": case(
        "critic.ppo_max_token_len_per_gpu=9", context=("critic.use_dynamic_bsz=true",)
    ),
    "critic.forward_max_token_len_per_gpu": case(
        "critic.forward_max_token_len_per_gpu=9", context=("critic.use_dynamic_bsz=true",)
    ),
    "critic.cliprange_value": case("critic.cliprange_value=0.1"),
    "critic.loss_agg_mode": case("critic.loss_agg_mode=seq-mean-token-mean"),
    "critic.grad_clip": case("critic.grad_clip=0.001"),
}

# Read only on CUDA: refused on CPU (checked here), their effect checked by tests/gpu/test_config_keys_gpu.py.
GPU_ONLY = {
    f"{ACTOR}.fsdp_config.dtype": "float16",
    f"{ACTOR}.fsdp_config.param_offload": "true",
    f"{ACTOR}.fsdp_config.optimizer_offload": "true",
    f"{ACTOR}.fsdp_config.offload_policy": "true",
}
# Read only when the policy is sharded (several ranks): test_sharding_keys_reach_every_rank below.
SHARDED_ONLY = {f"{ACTOR}.fsdp_config.reshard_after_forward"}
# Accepted at one value only (the one this trainer runs with); any other is refused.
ONE_VALUE = {
    f"{ACTOR}.strategy": ("fsdp", "FSDP2 only"),
    f"{ACTOR}.use_kl_loss": ("true", "needs a reference model"),
    f"{ACTOR}.ppo_epochs": ("2", "exactly one optimizer step"),
    f"{ACTOR}.ppo_mini_batch_size": ("32", "would split a step into several optimizer steps"),
    "critic.strategy": ("fsdp", "critic.strategy"),
    "critic.ppo_epochs": ("2", "'critic.ppo_epochs' must be 1"),
}


@pytest.fixture(scope="module")
def user_model(tiny_model_dir) -> tuple[str, ...]:
    """The overrides of a user's own model (the session's tiny Qwen2) without a built-in task."""
    return ("task.name=null", f"actor_rollout_ref.model.path={tiny_model_dir}", "data.train_files=unused.parquet")


@functools.cache
def _observe(kind: str, overrides: tuple[str, ...], update: bool) -> dict:
    """Observations are deterministic (seeded model, fixed batch): a context shared by several keys is built once."""
    cfg = load_config(None, list(overrides))
    return policy(cfg, update=update) if kind == "policy" else critic(cfg)


def _assert_effect(kind: str, base: tuple[str, ...], key: str, spec: Case) -> None:
    before = _observe(kind, (*base, *spec.context), spec.update)
    after = _observe(kind, (*base, *spec.context, *spec.change), spec.update)
    changed = sorted(name for name in before if before[name] != after[name])
    assert changed, f"{key}: {' '.join(spec.change)} changed nothing the {kind} backend built or did: {before}"


@pytest.fixture(scope="module")
def start_adapter(tiny_model_dir, tmp_path_factory) -> str:
    """A peft adapter of the tiny model (r 4 as LORA, lora_alpha verl's default 16), saved as peft saves it."""
    return str(write_adapter(tiny_model_dir, tmp_path_factory.mktemp("start_adapter") / "a", seed=7, rank=4, alpha=16))


@pytest.mark.parametrize("key", sorted(POLICY_CASES))
def test_each_actor_key_changes_what_the_policy_is_or_does(key, user_model, one_torch_thread, request):
    spec = POLICY_CASES[key]
    if any("SAVED_ADAPTER" in c for c in spec.change):
        folder = request.getfixturevalue("start_adapter")
        spec = Case(tuple(c.replace("SAVED_ADAPTER", folder) for c in spec.change), spec.context, spec.update)
    _assert_effect("policy", (*user_model, *POLICY_BASE), key, spec)


@pytest.mark.parametrize("key", sorted(CRITIC_CASES))
def test_each_critic_key_changes_what_the_critic_is_or_does(key, user_model, one_torch_thread):
    spec = CRITIC_CASES[key]
    _assert_effect("critic", (*user_model, *GAE), key, spec)


def test_gradient_checkpointing_is_on_the_one_rank_module_and_recomputes(user_model, one_torch_thread):
    """The default CPU path and the one-GPU config run one in-process rank: checkpointing must be applied there."""
    plain = policy(load_config(None, [*user_model, *POLICY_BASE]))
    checkpointing = "actor_rollout_ref.model.enable_gradient_checkpointing=true"
    on = policy(load_config(None, [*user_model, *POLICY_BASE, checkpointing]))
    assert not plain["describe"]["gradient_checkpointing"] and on["describe"]["gradient_checkpointing"]
    assert on["layer_forwards"] == 2 * plain["layer_forwards"]  # every layer forward runs again in backward
    assert on["change_head"] == plain["change_head"]  # the same step: checkpointing trades memory, not numbers


def test_keys_read_only_in_some_settings_are_refused_outside_them(user_model):
    """Each READ_ONLY_WHEN key, set in the default setting where it has no effect, is refused naming the setting."""
    outside = {
        f"{ACTOR}.clip_ratio": "0.1",  # clip_ratio_low/high are set
        f"{ACTOR}.tau_pos": "2.0",  # vanilla loss
        f"{ACTOR}.tau_neg": "2.0",
        f"{ACTOR}.policy_loss.clip_cov_ratio": "0.5",
        f"{ACTOR}.policy_loss.clip_cov_lb": "0.5",
        f"{ACTOR}.policy_loss.clip_cov_ub": "0.5",
        f"{ACTOR}.policy_loss.kl_cov_ratio": "0.5",
        f"{ACTOR}.policy_loss.ppo_kl_coef": "0.5",
        f"{ACTOR}.loss_scale_factor": "3",  # token-mean
        f"{ACTOR}.use_torch_compile": "true",  # no entropy computed
        f"{ACTOR}.entropy_from_logits_with_chunking": "true",
        f"{ACTOR}.entropy_checkpointing": "true",
        f"{ACTOR}.ppo_max_token_len_per_gpu": "9",  # static micro-batches
        f"{ACTOR}.fsdp_config.reshard_after_forward": "false",  # one rank, unsharded
        "actor_rollout_ref.model.lora_alpha": "64",  # lora_rank 0: all weights train
        "actor_rollout_ref.model.target_modules": "[q_proj]",
        "actor_rollout_ref.model.exclude_modules": "[down_proj]",
        "actor_rollout_ref.model.lora_adapter_path": "/adapter",
        **GPU_ONLY,  # trainer.device=cpu
    }
    contexts = {
        f"{ACTOR}.clip_ratio_low": ((SAPO,), "0.1"),  # sapo reads no clip bound
        f"{ACTOR}.clip_ratio_high": ((SAPO,), "0.1"),
        f"{ACTOR}.clip_ratio_c": ((f"{ACTOR}.policy_loss.loss_mode=gspo",), "1.5"),
        f"{ACTOR}.loss_agg_mode": ((SAPO,), "seq-mean-token-mean"),  # sapo aggregates its own way
        f"{ACTOR}.ppo_micro_batch_size_per_gpu": ((f"{ACTOR}.use_dynamic_bsz=true",), "2"),  # the YAML's 256 too
        "critic.ppo_micro_batch_size_per_gpu": ((*GAE, "critic.use_dynamic_bsz=true"), "2"),
        "critic.forward_micro_batch_size_per_gpu": ((*GAE, "critic.use_dynamic_bsz=true"), "2"),
        "critic.ppo_max_token_len_per_gpu": (GAE, "9"),
        "critic.forward_max_token_len_per_gpu": (GAE, "9"),
    }
    assert set(outside) | set(contexts) == set(READ_ONLY_WHEN), set(READ_ONLY_WHEN) ^ (set(outside) | set(contexts))
    cases = {key: ((), value) for key, value in outside.items()} | contexts
    for key, (context, value) in cases.items():
        with pytest.raises(ConfigError, match=f"'{key}' is read only") as info:
            load_config(None, [*user_model, *context, f"{key}={value}"])
        assert "\n" not in str(info.value)
    # inside their settings the same keys load (their effects: the cases above)
    load_config(None, [*user_model, *ENTROPY, f"{ACTOR}.use_torch_compile=true"])
    cuda = [f"{key}={value}" for key, value in GPU_ONLY.items() if not key.endswith("offload_policy")]
    load_config(None, [*user_model, "trainer.device=cuda", *cuda], check_host=False)  # a GPU host being planned
    with pytest.raises(ConfigError, match=r"without fsdp_config\.offload_policy"):  # which keeps them on the CPU
        load_config(
            None,
            [*user_model, "trainer.device=cuda", *cuda, f"{ACTOR}.fsdp_config.offload_policy=true"],
            check_host=False,
        )


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (("param_sync.transport=distributed",), r"'param_sync\.transport=distributed' with .*lora_rank > 0: .*disk"),
        (("algorithm.adv_estimator=gae",), r"'actor_rollout_ref\.model\.lora_rank' with algorithm\.adv_estimator=gae"),
        (("actor_rollout_ref.model.lora_rank=-1",), r"'actor_rollout_ref\.model\.lora_rank=-1'"),
    ],
)
def test_lora_settings_that_cannot_run_are_refused_in_one_line(user_model, overrides, named):
    with pytest.raises(ConfigError, match=named) as info:
        load_config(None, [*user_model, *LORA, *overrides])
    assert "\n" not in str(info.value)


def test_a_start_adapter_the_lora_keys_contradict_is_refused_in_one_line(user_model, start_adapter, tmp_path):
    """lora_adapter_path's adapter decides rank, alpha and modules (peft loads its own config, as in verl): a key that
    says otherwise would be silently overridden, so it is refused naming the adapter's value; so is a folder peft
    did not write."""
    adapter = f"actor_rollout_ref.model.lora_adapter_path={start_adapter}"
    check_lora_adapter(load_config(None, [*user_model, *LORA, adapter]))  # r 4, alpha 16, all-linear: consistent
    refused = {
        ("actor_rollout_ref.model.lora_rank=8",): r"adapter of r=4, but .*lora_rank=8: set lora_rank=4",
        ("actor_rollout_ref.model.lora_alpha=32",): r"lora_alpha=16, but .*lora_alpha=32: set lora_alpha=16",
        ("actor_rollout_ref.model.target_modules=[q_proj]",): r"holds an adapter on \[.*'v_proj'\], but .*q_proj",
        ("actor_rollout_ref.model.exclude_modules=[down_proj]",): r"exclude_modules=\['down_proj'\]: remove it",
        (f"actor_rollout_ref.model.lora_adapter_path={tmp_path}",): r"no adapter_config\.json there",
    }
    for overrides, words in refused.items():
        with pytest.raises(ConfigError, match=words) as info:
            check_lora_adapter(load_config(None, [*user_model, *LORA, adapter, *overrides]))
        assert "\n" not in str(info.value) and "lora_adapter_path=" in str(info.value)


def test_lora_with_megatron_is_refused_in_one_line():
    """On a GPU host being planned (the Megatron YAML needs CUDA): peft's adapter is built on FSDP2 only."""
    with pytest.raises(ConfigError, match=r"'actor_rollout_ref\.model\.lora_rank' with .*strategy=megatron") as info:
        load_config(REPO / "config" / "gpu_megatron_sglang.yaml", list(LORA), check_host=False)
    assert "\n" not in str(info.value)


def test_gpu_only_keys_are_refused_on_cpu_saying_so(user_model, tiny_model_dir):
    for key, value in GPU_ONLY.items():
        with pytest.raises(ConfigError, match=r"read only with trainer\.device=cuda") as info:
            load_config(None, [*user_model, f"{key}={value}"])
        assert key in str(info.value) and "\n" not in str(info.value)
    # the backend refuses them too, for a config built without load_config
    from rllm.experimental.fully_async.backends.fsdp import FSDPPolicyBackend

    with pytest.raises(ValueError, match=r"fsdp_config\.param_offload moves tensors off the GPU"):
        FSDPPolicyBackend(tiny_model_dir, {"ppo_micro_batch_size_per_gpu": 2, "fsdp_config": {"param_offload": True}})


def test_one_value_keys_are_refused_at_any_other(user_model):
    for key, (value, words) in ONE_VALUE.items():
        context = GAE if key.startswith("critic.") else ()
        with pytest.raises(ConfigError, match=words) as info:
            load_config(None, [*user_model, *context, f"{key}={value}"])
        assert "\n" not in str(info.value)
    # a mini-batch that holds the whole step means what runs: accepted
    cfg = load_config(None, [*user_model, f"{ACTOR}.ppo_mini_batch_size=128"])
    assert build_run_spec(cfg).schedule.required_samples == 64


def test_sharding_keys_reach_every_rank(ray_session, user_model, one_torch_thread):
    """Two CPU ranks built as the trainer builds them: gradient checkpointing and reshard_after_forward are on each
    rank's FSDP2 module (the one-rank case is above)."""
    from rllm.experimental.fully_async.runtime.trainer.build import build_policy_backend

    overrides = [
        *user_model,
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        f"{ACTOR}.fsdp_config.reshard_after_forward=false",
    ]
    group, dtype = build_policy_backend(build_run_spec(load_config(None, overrides)).trainer)
    try:
        ranks = group.describe()
    finally:
        group.shutdown()
    assert dtype == "torch.float32" and len(ranks) == 2
    for facts in ranks:
        assert facts["fsdp2"] and facts["gradient_checkpointing"] and facts["reshard_after_forward"] is False


def test_every_read_trainer_key_has_its_effect_checked():
    """The allow-list's actor, model and critic keys are each in one group above (or GPU-only, one value)."""
    trainer_keys = {k for k in VERL_KEYS_READ if k.startswith((f"{ACTOR}.", "actor_rollout_ref.model.", "critic."))}
    groups = [set(POLICY_CASES), set(CRITIC_CASES), set(GPU_ONLY), SHARDED_ONLY, set(ONE_VALUE), MODEL_PATH]
    covered = set().union(*groups)
    assert trainer_keys == covered, f"unchecked: {trainer_keys - covered}; not read: {covered - trainer_keys}"
    assert sum(len(g) for g in groups) == len(covered), "a key is in two groups"


MODEL_PATH = {"actor_rollout_ref.model.path"}  # its effects: test_model_path_tilde_is_expanded_for_every_reader


# --- engine and sampling keys: the command line and the request --------------------------------------------------


def _engine_view(cfg) -> dict:
    """What starting the engines would run: each engine's argv and environment, and the launcher's settings."""
    from rllm.experimental.fully_async.engines.from_config import engine_command, engine_launcher

    spec = build_run_spec(cfg).engines
    launcher = engine_launcher(spec, Path("/tmp/unused-engine-logs"))
    command = engine_command(spec)
    return {
        "argv": [command.build("127.0.0.1", 30000 + i, i) for i in range(launcher.num_engines)],
        "env": [command.env(i) for i in range(launcher.num_engines)],
        "startup_timeout_s": launcher.startup_timeout_s,
    }


SGLANG = ("engines.backend=sglang", "actor_rollout_ref.rollout.name=sglang")
SEEDED = ("engines.sampling_seed=7",)
ENGINE_CASES: dict[str, Case] = {
    "engines.backend": case(*SGLANG),
    "actor_rollout_ref.rollout.name": case(*SGLANG),
    "engines.num_engines": case("engines.num_engines=3"),
    "engines.max_running_requests": case("engines.max_running_requests=7"),
    "engines.startup_timeout_s": case("engines.startup_timeout_s=9.5"),
    "engines.dtype": case("engines.dtype=bfloat16"),
    "engines.torch_threads": case("engines.torch_threads=2"),
    "engines.forward_sleep_s": case("engines.forward_sleep_s=0.05"),
    "engines.extra_args": case("engines.extra_args={enable_metrics: true}", context=SGLANG),
    # alone it is refused (n identical samples): with per-request seeds (test_sampling_seed)
    "engines.deterministic_inference": case("engines.deterministic_inference=true", context=SEEDED),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": case(
        "actor_rollout_ref.rollout.tensor_model_parallel_size=4", context=SGLANG
    ),
    "actor_rollout_ref.rollout.gpu_memory_utilization": case(
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.7", context=SGLANG
    ),
    "run.seed": case("run.seed=5"),
    "run.log_level": case("run.log_level=INFO"),
    "actor_rollout_ref.model.path": case("actor_rollout_ref.model.path=/elsewhere"),
}


def test_extra_engine_args_are_refused_for_the_embedded_engine(user_model):
    with pytest.raises(ConfigError, match=r"with engines\.backend=embedded remove it"):
        load_config(None, [*user_model, "engines.extra_args={enable_metrics: true}"])


def test_a_forward_sleep_is_refused_for_sglang_engines(user_model):
    with pytest.raises(ConfigError, match=r"'engines\.forward_sleep_s' slows the embedded engine") as info:
        load_config(None, [*user_model, *SGLANG, "engines.forward_sleep_s=0.05"], check_host=False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("key", sorted(ENGINE_CASES))
def test_each_engine_key_changes_the_engine_command_or_launcher(key, user_model):
    spec = ENGINE_CASES[key]
    before = _engine_view(load_config(None, [*user_model, *spec.context], check_host=False))
    after = _engine_view(load_config(None, [*user_model, *spec.context, *spec.change], check_host=False))
    assert before != after, f"{key}: the engines would start the same way: {before}"


SAMPLING_CASES = {
    "actor_rollout_ref.rollout.temperature": "0.7",
    "actor_rollout_ref.rollout.top_p": "0.9",
    "actor_rollout_ref.rollout.top_k": "20",
    "actor_rollout_ref.rollout.ignore_eos": "true",
    "data.max_response_length": "9",
}


def test_each_sampling_key_changes_what_every_request_asks_for(user_model):
    from rllm.experimental.fully_async.workflows import sampling_params_from

    def request(*overrides: str) -> dict:
        return sampling_params_from(build_run_spec(load_config(None, [*user_model, *overrides])).executor.sampling)

    baseline = request()
    for key, value in SAMPLING_CASES.items():
        assert request(f"{key}={value}") != baseline, key


# --- the rest: the run spec the runtime shells are built from ------------------------------------------------------

# Keys whose consumer is a runtime shell (a Ray actor, the driver, the workflow): the walk checks the frozen spec the
# shell is built from changes; their behaviour is exercised by the runtime tests named.
SPEC_LEVEL: dict[str, str] = {
    "async_training.": "the staleness budget and queue (RolloutService; test_rollout_service, test_staleness)",
    "param_sync.": "ParamSync and its transports (test_param_sync, test_distributed_sync)",
    "engines.request_timeout_s": "the engine client (test_client)",
    "engines.on_engine_failure": "the engine supervisor (test_engine_restart)",
    "engines.max_restarts": "the engine supervisor (test_engine_restart)",
    "engines.no_engine_timeout_s": "the driver's wait with no engine left (test_elastic_engines, test_elastic)",
    "engines.sampling_seed": "the engine client's per-request sampling seeds (test_sampling_seed)",
    # without LoRA they are refused (REFUSED); with actor_rollout_ref.model.lora_rank > 0 they are the engines' LoRA
    # flags (tests/settings/test_engine_lora_settings.py)
    "engines.lora.": "the engines' LoRA flags (test_engine_lora_settings, test_engine_lora)",
    "task.": "the built-in task (test_task)",
    "workflow.": "the rollout workflow (test_agent_wiring, test_multi_turn)",
    "env.": "the multi_turn environment (test_agent_wiring)",
    "tools.": "the multi_turn tools (test_tool_task)",
    "run.dir": "the run directory (test_run_dir)",
    "run.record_batches": "the trainer's batch record, read by replay (test_replay)",
    "data.": "the prompt data (test_data)",
    "algorithm.": "advantages, corrections, filters (test_advantages, test_corrections, test_filters)",
    "trainer.": "the driver's schedule, resume, metrics sink, trainer ranks (test_e2e, test_resume, test_run_dir)",
    "reward.": "the reward function (test_workers)",
    "custom_reward_function.": "the reward function (test_workers)",
    "actor_rollout_ref.rollout.": "executor settings and validation sampling (test_multi_turn)",
    "actor_rollout_ref.hybrid_engine": "one value only",
}

# A value different from the default config's (config/tiny_cpu.yaml) for each leaf the generic rule cannot pick.
PERTURB: dict[str, str] = {
    "async_training.staleness_threshold": "0.5",
    "async_training.use_rollout_log_probs": "false",
    "engines.sampling_seed": "7",
    "param_sync.transport": "distributed",
    "param_sync.weights_dir": "/tmp/elsewhere",
    "param_sync.dtype": "bfloat16",
    "param_sync.master_address": "10.0.0.5",
    "task.name": "smollm2",
    "task.cache_dir": "/tmp/cache",
    "workflow.name": "my_agent",
    "workflow.path": "/tmp/agent.py",
    "workflow.layout": "concat",
    "env.name": "number_line",
    "env.path": "/tmp/env.py",
    "env.kwargs": "{size: 8}",
    "tools.format": "compact",
    "tools.functions": "{calculator: calculator}",
    "trainer.rollout_data_dir": "/tmp/dumps",
    "trainer.validation_data_dir": "/tmp/val_dumps",
    "run.dir": "/tmp/run",
    "engines.on_engine_failure": "stop",
    "data.train_files": "/tmp/other.parquet",
    "data.val_files": "/tmp/other_val.parquet",
    "data.truncation": "left",
    "data.seed": "7",
    "actor_rollout_ref.rollout.mode": "sync",
    "algorithm.adv_estimator": "rloo",
    "algorithm.gamma": "0.9",
    "algorithm.lam": "0.9",
    "algorithm.singleton_group_advantage": "verl",
    "algorithm.gigpo": "{omega: 0.5}",
    "algorithm.off_policy_correction": "{mode: tis}",
    "algorithm.rollout_correction.rollout_is": "token",
    "algorithm.rollout_correction.rollout_rs": "token",
    "algorithm.rollout_correction.rollout_rs_threshold": "2.0",
    "algorithm.rollout_correction.loss_type": "reinforce",
    "algorithm.group_filter": "{drop_zero_variance: true}",
    "trainer.resume_mode": "disable",
    "trainer.resume_from_path": "/tmp/ckpt/step_1",
    "trainer.project_name": "other",
    "trainer.experiment_name": "other",
    "trainer.logger": "[console,tensorboard]",
    "trainer.device": "cuda",
    "trainer.total_training_steps": "9",
    "reward.custom_reward_function.path": "/tmp/reward.py",
    "reward.custom_reward_function.name": "score",
    "custom_reward_function.path": "/tmp/reward.py",
    "custom_reward_function.name": "score",
}

# Keys refused at their perturbed value in the default config, with the words the refusal must contain.
LORA_KEYS = ("max_loaded_loras", "max_loras_per_batch", "max_lora_rank", "target_modules", "eviction_policy", "backend")
PERTURB |= dict(
    zip((f"engines.lora.{k}" for k in LORA_KEYS), ("4", "4", "8", "[q_proj]", "fifo", "triton"), strict=True)
)
REFUSED: dict[str, str] = {
    **{f"engines.lora.{k}": "read only when the policy trains as LoRA" for k in LORA_KEYS},
    "async_training.staleness_threshold": "only derives max_staleness when that is null",
    "workflow.name": "not a built-in workflow",
    "workflow.rllm_batched": "read only with an rLLM rollout function",
    "workflow.rllm_rows": "read only by an rLLM rollout function",
    "workflow.layout": "read only with workflow.name=multi_turn",
    **{
        f"{section}.{key}": "read only with workflow.name=multi_turn"
        for section, keys in {
            "env": ("name", "path", "kwargs", "max_turns", "max_total_tokens", "step_timeout_s"),
            "tools": ("format", "timeout_s", "functions"),
        }.items()
        for key in keys
    },
    "actor_rollout_ref.rollout.val_kwargs.n": "single-turn validation decodes each prompt once",
    "algorithm.rollout_correction.rollout_rs": "not supported here",
    "algorithm.rollout_correction.rollout_rs_threshold": "has no counterpart here",
    "algorithm.rollout_correction.loss_type": "has no counterpart here",
    "algorithm.rollout_correction.rollout_is_batch_normalize": "has no counterpart here",
    "algorithm.rollout_correction.rollout_is_threshold": "used only with rollout_is",
    "actor_rollout_ref.rollout.mode": "cannot be honoured",
    "actor_rollout_ref.rollout.calculate_log_probs": "cannot be honoured",
    "actor_rollout_ref.hybrid_engine": "cannot be honoured",
    "data.train_batch_size": "is read only when async_training.required_samples is null",
    **{
        f"async_training.adaptive_staleness.{key}": "is read only with async_training.adaptive_staleness.enable=true"
        for key in (
            "min",
            "max",
            "step",
            "raise_after",
            "raise_margin",
            "min_ess",
            "max_kl",
            "max_cut",
            "raise_when_waiting",
        )
    },
    "algorithm.gigpo": "read only with algorithm.adv_estimator=gigpo",
    # a built-in task (the default) makes its own data and model: refused, never replaced (test_task.py)
    "data.train_files": "task.name=addition makes its own data and model",
    "data.val_files": "task.name=addition makes its own data and model",
}
if torch.cuda.is_available():
    PERTURB["trainer.device"] = "cpu"  # on a GPU host the other way round; both are in the spec
else:
    REFUSED["trainer.device"] = "CUDA is not available"


def _perturbed(key: str, value: object) -> str:
    if key in PERTURB:
        return PERTURB[key]
    if isinstance(value, bool):
        return str(not value).lower()
    if isinstance(value, int):
        return str(value + 1)
    if isinstance(value, float):
        return repr(value / 2 if value > 0 else 0.5)
    raise AssertionError(f"no perturbed value for {key}={value!r}: add one to PERTURB")


def _spec_fields(spec: object, prefix: str = "") -> dict[str, object]:
    """The spec flattened to its leaf fields, so a failure names the field that did (not) change."""
    if not hasattr(spec, "__dataclass_fields__"):
        return {prefix: spec}
    out: dict[str, object] = {}
    for f in fields(spec):
        out |= _spec_fields(getattr(spec, f.name), f"{prefix}{f.name}.")
    return out


def _check(key: str, baseline: dict[str, object], default_value: object) -> None:
    value = _perturbed(key, default_value)
    try:
        spec = _spec_fields(build_run_spec(load_config(None, [f"{key}={value}"])))
    except ConfigError as exc:
        assert "\n" not in str(exc), str(exc)
        assert key in REFUSED and REFUSED[key] in str(exc), f"{key}={value} refused: {exc}"
        return
    assert key not in REFUSED, f"{key}={value} was accepted, expected a refusal with {REFUSED[key]!r}"
    changed = [name for name in spec if spec[name] != baseline.get(name)]
    assert changed, f"{key}={value}: no field of the run spec changed"


@pytest.fixture(scope="module")
def default():
    cfg = load_config()
    return cfg, _spec_fields(build_run_spec(cfg))


def _leaves(node: object, prefix: str) -> list[tuple[str, object]]:
    if isinstance(node, dict) and node:
        return [leaf for k, v in node.items() if k != "_target_" for leaf in _leaves(v, f"{prefix}.{k}")]
    return [(prefix, node)]


def _spec_level_keys() -> list[str]:
    """Project leaves and allow-listed verl keys outside the effect groups above."""
    cfg = base_config()
    project = [k for s in PROJECT_SECTIONS for k, _ in _leaves(OmegaConf.to_container(cfg[s]), s)]
    verl = [k for k in VERL_KEYS_READ if not k.endswith(".")]
    verl += [
        "algorithm.rollout_correction.rollout_is",
        "algorithm.rollout_correction.rollout_rs",
        "algorithm.rollout_correction.loss_type",
        "algorithm.rollout_correction.rollout_rs_threshold",
        "algorithm.rollout_correction.rollout_is_batch_normalize",
        "algorithm.rollout_correction.rollout_is_threshold",
        "algorithm.rollout_correction.bypass_mode",
        "actor_rollout_ref.rollout.val_kwargs.n",
    ]
    effect_groups = {*POLICY_CASES, *CRITIC_CASES, *GPU_ONLY, *SHARDED_ONLY, *ONE_VALUE, *ENGINE_CASES, *SAMPLING_CASES}
    return [k for k in dict.fromkeys([*project, *verl]) if k not in effect_groups and not k.startswith("critic.")]


def test_every_key_is_in_an_effect_group_or_spec_level_with_its_reader():
    for key in _spec_level_keys():
        assert any(key == e or key.startswith(e) for e in SPEC_LEVEL), f"{key}: in no group and no SPEC_LEVEL entry"


@pytest.mark.parametrize("key", _spec_level_keys())
def test_every_other_key_changes_the_run_spec_or_is_refused(key, default):
    cfg, baseline = default
    _check(key, baseline, OmegaConf.select(cfg, key))


def test_every_other_verl_key_is_refused_by_name():
    cfg = OmegaConf.to_container(base_config(), resolve=False)
    leaves = [k[1:] for k, _ in _leaves(cfg, "") if k[1:].split(".")[0] not in PROJECT_SECTIONS]
    unread = [k for k in leaves if not is_read(k)]
    assert len(unread) > 350  # verl's tree is ~600 leaves; the actor and critic sections are listed leaf by leaf
    for key in ("actor_rollout_ref.ref.fsdp_config.param_offload", "algorithm.kl_ctrl.kl_coef", "trainer.val_only"):
        assert key in unread
    for key in [*VERL_KEYS_NOT_READ, "actor_rollout_ref.actor.checkpoint.save_contents"]:
        assert not is_read(key + "leaf" if key.endswith(".") else key)
    # end to end for a spread of them (each load is ~0.4 s, so not all 500)
    for key in unread[:: max(1, len(unread) // 12)]:
        value = OmegaConf.select(base_config(), key, throw_on_missing=False)
        perturbed = "7" if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)) else None
        perturbed = perturbed or ("true" if value is False else "false" if value is True else "something_else")
        with pytest.raises(ConfigError, match=r"not used by the fully-async trainer|critic|must be") as info:
            load_config(None, [f"{key}={perturbed}"])
        assert "\n" not in str(info.value)


def test_the_actor_keys_verl_reads_elsewhere_are_refused_with_the_reason():
    """Keys verl's Ray workers read but the trainer's DataParallelPPOActor does not (the issue's four among them)."""
    cases = {
        f"{ACTOR}.fsdp_config.use_torch_compile=true": "reads actor_rollout_ref.actor.use_torch_compile",
        f"{ACTOR}.fsdp_config.fsdp_size=2": "one flat FSDP2 mesh",
        f"{ACTOR}.optim.clip_grad=0.5": "set that",
        f"{ACTOR}.ulysses_sequence_parallel_size=2": "no sequence parallelism",
        "actor_rollout_ref.model.use_remove_padding=true": "needs flash-attention",
        "actor_rollout_ref.model.enable_activation_offload=true": "Ray worker",
        "critic.model.path=/x": "the policy's folder",
    }
    for override, words in cases.items():
        context = GAE if override.startswith("critic.") else ()
        with pytest.raises(ConfigError, match="not used by the fully-async trainer") as info:
            load_config(None, [*context, override])
        assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


# --- an rLLM program's verl keys -------------------------------------------------------------------------------

# The verl keys rLLM's fully-async deep-research example sets for its trainer (examples/fully_async/deepresearch/
# config/8b_stale05_rs.sh, values as written there), as overrides of the GPU FSDP config on a GPU host being planned.
RLLM_EXAMPLE_KEYS = [
    "data.truncation=left",
    "data.max_prompt_length=700",
    "data.max_response_length=20000",
    "data.train_batch_size=0",
    "actor_rollout_ref.rollout.n=8",
    "algorithm.adv_estimator=grpo",
    "algorithm.norm_adv_by_std_in_grpo=False",
    "algorithm.use_kl_in_reward=False",
    "algorithm.kl_ctrl.kl_coef=0.0",
    f"{ACTOR}.strategy=fsdp2",
    f"{ACTOR}.use_kl_loss=False",
    f"{ACTOR}.kl_loss_coef=0.0",
    f"{ACTOR}.clip_ratio_low=0.2",
    f"{ACTOR}.clip_ratio_high=0.28",
    f"{ACTOR}.clip_ratio_c=10.0",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.model.enable_activation_offload=True",
    f"{ACTOR}.use_dynamic_bsz=True",
    f"{ACTOR}.ppo_max_token_len_per_gpu=20700",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=25875",
    f"{ACTOR}.optim.lr=1e-6",
    f"{ACTOR}.optim.lr_warmup_steps=10",
    f"{ACTOR}.ppo_mini_batch_size=2048",
    f"{ACTOR}.fsdp_config.param_offload=True",
    f"{ACTOR}.fsdp_config.optimizer_offload=True",
    f"{ACTOR}.entropy_coeff=0",
    f"{ACTOR}.grad_clip=1.0",
    f"{ACTOR}.loss_agg_mode=token-mean",
    f"{ACTOR}.ulysses_sequence_parallel_size=1",
    f"{ACTOR}.fsdp_config.fsdp_size=8",
    f"{ACTOR}.fsdp_config.dtype=float16",
    "async_training.required_samples=256",
    "trainer.device=cuda",
]


def test_an_rllm_programs_refused_verl_keys_are_all_named_at_once_each_with_why_in_one_line(user_model):
    """Load the example's keys: one ConfigError names every refused key (before, one per load: an edit-and-run
    per key), each refusal one line that names the key (also as its ConfigError.key, for the runner to report) and
    the reason; drop them and load again: what is left runs (on a GPU host)."""
    overrides = [*user_model, *RLLM_EXAMPLE_KEYS]
    with pytest.raises(ConfigError) as caught:
        load_config(REPO / "config" / "gpu_fsdp_sglang.yaml", overrides, check_host=False)
    refused = {}
    lines = str(caught.value).splitlines()
    assert len(lines) == len(caught.value.refusals) and caught.value.key == caught.value.refusals[0].key
    assert lines[0].endswith(f"[and {len(lines) - 1} more keys refused, listed below]")  # the first line says so
    for exc, line in zip(caught.value.refusals, lines, strict=True):
        assert exc.key is not None and f"'{exc.key}'" in str(exc) and "\n" not in str(exc), str(exc)
        assert line.startswith(str(exc))
        assert "(" in str(exc) or "read only" in str(exc), f"no reason given: {exc}"
        assert any(o.startswith(f"{exc.key}=") for o in overrides), f"refused a key the program did not set: {exc}"
        refused[exc.key] = str(exc)
    overrides = [o for o in overrides if o.split("=")[0] not in refused]
    cfg = load_config(REPO / "config" / "gpu_fsdp_sglang.yaml", overrides, check_host=False)
    assert set(refused) == {
        "algorithm.kl_ctrl.kl_coef",  # no KL in the reward
        f"{ACTOR}.kl_loss_coef",  # no reference model
        "actor_rollout_ref.model.use_remove_padding",  # needs flash-attention's varlen path
        "actor_rollout_ref.model.enable_activation_offload",  # applied by verl's Ray worker only
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",  # the engines return log-probs
        f"{ACTOR}.fsdp_config.fsdp_size",  # one flat FSDP2 mesh
    }, refused
    # the rest is honoured: offload and fp16 autocast on CUDA, the mini-batch holds the whole step
    actor = build_run_spec(cfg).trainer.actor
    assert actor["fsdp_config"]["param_offload"] and actor["fsdp_config"]["dtype"] == "float16"
    assert actor["clip_ratio_c"] == 10.0 and build_run_spec(cfg).trainer.enable_gradient_checkpointing


# --- agent keys, the critic, Megatron ----------------------------------------------------------------------------

# A multi_turn agent config: each env/tools/layout/val_kwargs key changes the spec there (refused elsewhere, above).
AGENT = ["workflow.name=multi_turn", "env.name=number_line", "env.max_total_tokens=64"]
AGENT_PERTURB = {
    "env.name": None,  # only built-in is number_line; env.path below names a class instead
    "env.path": ["env.path=/tmp/env.py", "env.name=MyEnv"],
    "env.kwargs": ["env.kwargs={size: 8}"],
    "env.max_turns": ["env.max_turns=3"],
    "env.max_total_tokens": ["env.max_total_tokens=65"],
    "env.step_timeout_s": ["env.step_timeout_s=1.5"],
    "tools.format": ["tools.format=compact"],
    "tools.timeout_s": ["tools.timeout_s=1.5"],
    "tools.functions": ["tools.functions={calculator: calculator}"],
    "workflow.layout": ["workflow.layout=concat"],
    "actor_rollout_ref.rollout.val_kwargs.n": ["actor_rollout_ref.rollout.val_kwargs.n=4"],
    "actor_rollout_ref.rollout.val_kwargs.do_sample": [
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
    ],
    "actor_rollout_ref.rollout.val_kwargs.top_p": ["actor_rollout_ref.rollout.val_kwargs.top_p=0.5"],
    "actor_rollout_ref.rollout.val_kwargs.top_k": ["actor_rollout_ref.rollout.val_kwargs.top_k=5"],
}


@pytest.mark.parametrize("key", [k for k, v in AGENT_PERTURB.items() if v])
def test_every_agent_key_changes_the_run_spec_of_a_multi_turn_run(key):
    baseline = build_run_spec(load_config(None, AGENT))
    assert baseline.executor.agent is not None and baseline.executor.agent.env_name == "number_line"
    assert build_run_spec(load_config(None, [*AGENT, *AGENT_PERTURB[key]])) != baseline, key


def test_agent_settings_that_cannot_run_are_refused_in_one_line():
    cases = {
        "env.name=null": "'env.name' must be set",
        "env.name=maze": "unknown environment 'maze'",
        "tools.functions={c: calculator}\ntools.format=xml": "'tools.format' must be one of",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0": "used only with val_kwargs.do_sample=true",
        "env.max_turns=0": "'env.max_turns' must be >= 1",
    }
    for overrides, words in cases.items():
        with pytest.raises(ConfigError, match=words.replace("(", r"\(")) as info:
            load_config(None, [*AGENT, *overrides.split("\n")])
        assert "\n" not in str(info.value)


def test_the_critic_section_is_read_only_with_gae():
    with pytest.raises(ConfigError, match=r"read only with algorithm\.adv_estimator=gae"):
        load_config(None, ["critic.optim.lr=1e-3"])
    spec = build_run_spec(load_config(None, ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-3"]))
    assert spec.trainer.critic is not None and spec.trainer.critic["optim"]["lr"] == 1e-3


@pytest.mark.parametrize(
    "key",
    [
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
    ],
)
def test_megatron_parallel_sizes_above_one_are_refused_until_a_multi_gpu_path_runs(key):
    path = REPO / "config" / "gpu_megatron_sglang.yaml"
    load_config(path, [f"actor_rollout_ref.actor.megatron.{key}=1"], check_host=False)  # planned from anywhere
    with pytest.raises(ConfigError, match=rf"'actor_rollout_ref\.actor\.megatron\.{key}=2'.*one GPU") as info:
        load_config(path, [f"actor_rollout_ref.actor.megatron.{key}=2"], check_host=False)
    assert "\n" not in str(info.value)


# --- the shipped GPU YAMLs -------------------------------------------------------------------------------------


def test_gpu_fsdp_yaml_loads_with_every_key_honoured_or_refused():
    path = REPO / "config" / "gpu_fsdp_sglang.yaml"
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"'trainer.device=cuda' but CUDA is not available"):
            load_config(path)
    cfg = load_config(path, ["trainer.device=cpu"] if not torch.cuda.is_available() else [])
    spec = build_run_spec(cfg)
    assert spec.engines.backend == "sglang" and spec.engines.num_engines == 4 and spec.engines.dtype == "bfloat16"
    assert spec.trainer.enable_gradient_checkpointing is True  # reaches its one rank (test_gradient_checkpointing...)
    assert spec.trainer.actor["use_dynamic_bsz"] is True and spec.trainer.actor["fsdp_config"]["dtype"] == "bfloat16"
    assert spec.schedule.max_staleness == 2 and spec.run.test_freq == 25
    # every leaf the file sets is this project's or a verl key that is read, and in a setting it is read in
    written = OmegaConf.to_container(OmegaConf.load(path))
    written.pop("defaults")
    for key, _ in _leaves(written, ""):
        key = key[1:]
        assert key.split(".")[0] in PROJECT_SECTIONS or is_read(key), key
        rule = READ_ONLY_WHEN.get(key)
        assert rule is None or rule.holds(OmegaConf.merge(cfg, {"trainer": {"device": "cuda"}})), key


def test_gpu_lora_yaml_loads_with_every_key_honoured_and_engines_that_hold_eta_plus_one_adapters():
    """config/gpu_fsdp_sglang_lora.yaml (a 7B-class LoRA run on one 8-GPU node), checked on CPU as a GPU host would
    load it: verl's LoRA keys reach the trainer's peft adapter, SGLang's LoRA flags the engine command lines, every
    engine holds the η+1 versions the staleness bound admits, and the GPUs add up to one node."""
    from rllm.experimental.fully_async.engines.from_config import engine_command

    path = REPO / "config" / "gpu_fsdp_sglang_lora.yaml"
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"'trainer.device=cuda' but CUDA is not available"):
            load_config(path)
    cfg = load_config(path, ["trainer.device=cpu"] if not torch.cuda.is_available() else [])
    spec = build_run_spec(cfg)
    lora, engines = spec.trainer.lora, spec.engines
    assert lora is not None and lora.peft_kwargs() == {
        "r": 32,
        "lora_alpha": 64.0,
        "target_modules": "all-linear",
        "exclude_modules": None,
        "bias": "none",
    }
    assert engines.backend == "sglang" and engines.lora is not None
    eta = spec.schedule.max_staleness
    assert engines.lora.max_loaded_loras >= eta + 1 and engines.lora.max_loras_per_batch >= eta + 1
    assert engines.lora.max_lora_rank == lora.rank and engines.lora.target_modules == ("all",)
    argv = " ".join(engine_command(engines).build("127.0.0.1", 30000, 0))
    flags = (
        "--enable-lora --max-lora-rank 32 --lora-target-modules all --max-loras-per-batch 4 --max-loaded-loras 4 "
        "--lora-eviction-policy lru --lora-backend csgmv"
    )
    assert flags in argv and "Qwen2.5-7B" in argv
    assert engines.num_engines * 1 + spec.trainer.world_size == 8 and spec.trainer.nnodes == 1  # tp 1 per engine
    assert cfg.param_sync.transport == "disk"  # SGLang loads adapters from a folder only
    written = OmegaConf.to_container(OmegaConf.load(path))
    written.pop("defaults")
    for key, _ in _leaves(written, ""):
        key = key[1:]
        assert key.split(".")[0] in PROJECT_SECTIONS or is_read(key), key
        rule = READ_ONLY_WHEN.get(key)
        assert rule is None or rule.holds(OmegaConf.merge(cfg, {"trainer": {"device": "cuda"}})), key
    # η above what the engines hold is refused in one line naming the flag to raise
    with pytest.raises(ConfigError, match=r"'engines\.lora\.max_loaded_loras=4' cannot hold the η\+1=5") as info:
        load_config(path, ["trainer.device=cpu", "async_training.max_staleness=4"], check_host=False)
    assert "\n" not in str(info.value)


def test_gpu_megatron_yaml_is_refused_without_cuda_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: tests/backends/test_megatron.py covers the Megatron YAML")
    with pytest.raises(ConfigError, match="needs CUDA") as info:
        load_config(REPO / "config" / "gpu_megatron_sglang.yaml")
    assert "\n" not in str(info.value)


# --- a YAML written for rLLM's fully-async module ---------------------------------------------------------------

# The key set and defaults of rLLM's rllm/experimental/fully_async/config/fully_async_ppo_trainer.yaml.
RLLM_YAML = """
hydra:
  searchpath: [pkg://verl.trainer.config]
defaults: [ppo_trainer, _self_]
async_training:
  staleness_threshold: 0.1
  trigger_parameter_sync_step: 4
  require_batches: 1
  required_samples: 128
  partial_rollout: true
  use_rollout_log_probs: true
  compute_prox_log_prob: false
  use_trainer_do_validate: false
  checkpoint_engine: {enable: ENABLE, device_buffer_size_M: 4096, overlap_broadcast_and_consume: false}
rollout: {nnodes: 1, n_gpus_per_node: 8, n: 4, total_rollout_steps: 1000, total_epochs: 10, test_freq: 1,
          rejection_sample: false}
data: {train_batch_size: 0, gen_batch_size: 1, train_dataset_name: null, train_split: train,
       val_dataset_name: null, val_split: test}
critic: {strategy: fsdp2}
actor_rollout_ref:
  hybrid_engine: false
  checkpoint_engine: ${oc.select:async_training.checkpoint_engine, null}
  actor: {strategy: fsdp2, use_rollout_log_probs: "${oc.select:async_training.use_rollout_log_probs, True}"}
  rollout: {name: sglang, mode: async, calculate_log_probs: true}
"""


def test_rllm_fully_async_yaml_loads_with_each_key_mapped(tmp_path):
    path = tmp_path / "rllm.yaml"
    path.write_text(RLLM_YAML.replace("ENABLE", "false"))
    cfg = load_config(path)
    spec = build_run_spec(cfg)
    assert spec.executor.samples_per_prompt == 4  # rollout.n
    assert spec.engines.backend == "sglang" and spec.engines.num_engines == 4  # 8 GPUs / verl's default tp=2
    assert spec.run.total_training_steps == 8  # ceil(1000 rollout samples / 128 per step)
    assert spec.executor.data.total_epochs == 10
    assert spec.run.test_freq == 4  # every weight sync = every 4 optimizer steps
    assert spec.schedule.trigger_parameter_sync_step == 4 and spec.schedule.required_samples == 128
    assert spec.schedule.max_staleness == 0  # rLLM's 0.1 threshold: floor(int(128 * 1.1 * 4) / (128 * 4)) - 1 = 0
    assert spec.executor.group_filter is None


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (("ENABLE", "true"), "'async_training.checkpoint_engine.enable=true'"),
        (("use_trainer_do_validate: false", "use_trainer_do_validate: true"), "validation runs on the rollout engines"),
        (("require_batches: 1", "require_batches: 2"), "required_samples=128 is set and wins"),
        (("gen_batch_size: 1", "gen_batch_size: 4"), "'data.gen_batch_size=4'"),
        (
            ("train_dataset_name: null", "train_dataset_name: /nonexistent/t.parquet"),
            "=/nonexistent/t.parquet': no such file",
        ),
        (("nnodes: 1", "nnodes: 2"), "'rollout.nnodes=2'"),
        (("hybrid_engine: false", "hybrid_engine: true"), "'actor_rollout_ref.hybrid_engine=True'"),
        (("mode: async", "mode: sync"), "'actor_rollout_ref.rollout.mode=sync'"),
        (("n: 4,", "n: 4, bogus: 1,"), "'rollout.bogus' is not a key of rLLM's"),
    ],
)
def test_rllm_keys_that_cannot_be_honoured_are_refused_naming_the_equivalent(tmp_path, change, named):
    path = tmp_path / "rllm.yaml"
    path.write_text(RLLM_YAML.replace(*change).replace("ENABLE", "false"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert named in str(info.value) and "\n" not in str(info.value)
    assert "did you mean" not in str(info.value)


def test_rllm_require_batches_sizes_the_step_when_required_samples_is_null():
    cfg = load_config(None, ["async_training.required_samples=null", "async_training.require_batches=2"])
    assert cfg.async_training.required_samples == 2 * cfg.actor_rollout_ref.actor.ppo_mini_batch_size


def test_rllm_rejection_sample_turns_on_the_zero_variance_filter():
    spec = build_run_spec(load_config(None, ["rollout.rejection_sample=true"]))
    assert spec.executor.group_filter is not None and spec.executor.group_filter.drop_zero_variance
