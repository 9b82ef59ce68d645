"""Which of verl's keys the fully-async trainer reads; any other verl key set to a non-default value is refused.

verl 0.7.1's tree has ~600 leaves (`_generated_ppo_trainer.yaml`); this trainer reads about a hundred. A user who
sets one it never reads (a reference model, a reward model, verl's profiler, an FSDP1 option) would otherwise get a
run that silently does something else. The tables:

- `VERL_KEYS_READ`: the documented allow-list, each entry a dotted key (or a prefix ending in '.') with where it is
  read. The actor and critic sections are listed leaf by leaf: verl's DataParallelPPOActor reads only some of
  what its Ray workers read, and the rest must not pass as read.
- `VERL_KEYS_NOT_READ`: keys of those sections that are refused, with the reason the refusal gives.
- `READ_ONLY_WHEN`: read keys that have an effect only in some settings (a CUDA device, dynamic micro-batches, a
  loss mode that reads them, the entropy being computed); set outside them they are refused, naming the setting.

`unread_verl_key_refusals` compares the merged config with the defaults (verl's plus `FULLY_ASYNC_VERL_DEFAULTS`)
and refuses every key that differs and is not read, each in one line (`load_config` raises them together). Each
read key's effect is observed in tests/settings/test_config_keys.py (on CPU) or tests/gpu/test_config_keys_gpu.py
(the CUDA-only ones).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from rllm.experimental.fully_async.errors import ConfigError
from rllm.experimental.fully_async.settings.schema import PROJECT_SECTIONS

_ACTOR = "actor_rollout_ref.actor"
_FSDP = f"{_ACTOR}.fsdp_config"

VERL_KEYS_READ: dict[str, str] = {
    # model and data
    "actor_rollout_ref.model.path": "tokenizer, engines and trainer (RunSpec.trainer/engines.model_path)",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "the policy module, any rank count (backends/fsdp.py)",
    "actor_rollout_ref.model.lora_rank": "> 0: peft's LoRA adapter trains, the base is frozen (backends/fsdp.py)",
    "actor_rollout_ref.model.lora_alpha": "the adapter's LoraConfig lora_alpha (scaling alpha / r)",
    "actor_rollout_ref.model.target_modules": "the adapter's LoraConfig target_modules (and --lora-target-modules)",
    "actor_rollout_ref.model.exclude_modules": "the adapter's LoraConfig exclude_modules",
    "actor_rollout_ref.model.lora_adapter_path": "a saved peft adapter the policy starts from (backends/fsdp.py)",
    "data.train_files": "prompt dataset (RunSpec.executor.data)",
    "data.val_files": "validation prompts (RunSpec.executor.data)",
    "data.max_prompt_length": "prompt filter/truncation (RunSpec.executor.data)",
    "data.max_response_length": "max_new_tokens and Dr.GRPO's normaliser (RunSpec.executor.sampling, trainer)",
    "data.train_batch_size": "async_training.required_samples when that is null (settings/derive.py)",
    "data.truncation": "overlong prompts (RunSpec.executor.data.overlong)",
    "data.filter_overlong_prompts": "overlong prompts (RunSpec.executor.data.overlong)",
    "data.seed": "prompt order (RunSpec.executor.data.seed)",
    "data.shuffle": "prompt order (RunSpec.executor.data.shuffle)",
    # The policy update: the actor section goes to verl's FSDPActorConfig and its patched DataParallelPPOActor
    # (backends/fsdp.py). Each key below is read there; READ_ONLY_WHEN says which only in some settings.
    f"{_ACTOR}.strategy": "fsdp2 or megatron: the backend (settings/validate.py)",
    f"{_ACTOR}.ppo_mini_batch_size": "one mini-batch per step: accepted when >= required_samples (see below)",
    f"{_ACTOR}.ppo_micro_batch_size_per_gpu": "rows per forward/backward (verl's dp_actor, static micro-batches)",
    f"{_ACTOR}.use_dynamic_bsz": "micro-batches cut by a token budget (verl's prepare_dynamic_batch)",
    f"{_ACTOR}.ppo_max_token_len_per_gpu": "the token budget of a dynamic micro-batch",
    f"{_ACTOR}.clip_ratio": "verl's fallback for clip_ratio_low / clip_ratio_high when either is null",
    f"{_ACTOR}.clip_ratio_low": "the PPO clip below 1 (verl's policy losses)",
    f"{_ACTOR}.clip_ratio_high": "the PPO clip above 1 (verl's policy losses)",
    f"{_ACTOR}.clip_ratio_c": "dual-clip bound (vanilla, dppo_tv, dppo_kl losses)",
    f"{_ACTOR}.loss_agg_mode": "verl's agg_loss (every loss but sapo)",
    f"{_ACTOR}.loss_scale_factor": "Dr.GRPO's constant normaliser (seq-mean-token-sum-norm)",
    f"{_ACTOR}.entropy_coeff": "entropy bonus in the loss (verl's dp_actor)",
    f"{_ACTOR}.calculate_entropy": "entropy computed and reported (actor/entropy)",
    f"{_ACTOR}.tau_pos": "SAPO's positive temperature (loss_mode=sapo)",
    f"{_ACTOR}.tau_neg": "SAPO's negative temperature (loss_mode=sapo)",
    f"{_ACTOR}.use_torch_compile": "torch.compile of verl's entropy function",
    f"{_ACTOR}.entropy_from_logits_with_chunking": "verl's chunked entropy function",
    f"{_ACTOR}.entropy_checkpointing": "the entropy computed under activation checkpointing",
    f"{_ACTOR}.grad_clip": "gradient-norm clipping before the step (verl's _optimizer_step)",
    f"{_ACTOR}.use_kl_loss": "false only (settings/validate.py: no reference model)",
    f"{_ACTOR}.ppo_epochs": "1 only (settings/validate.py: one optimizer step per batch)",
    f"{_ACTOR}.policy_loss.loss_mode": "verl's POLICY_LOSS_REGISTRY",
    f"{_ACTOR}.policy_loss.clip_cov_ratio": "loss_mode=clip_cov",
    f"{_ACTOR}.policy_loss.clip_cov_lb": "loss_mode=clip_cov",
    f"{_ACTOR}.policy_loss.clip_cov_ub": "loss_mode=clip_cov",
    f"{_ACTOR}.policy_loss.kl_cov_ratio": "loss_mode=kl_cov",
    f"{_ACTOR}.policy_loss.ppo_kl_coef": "loss_mode=kl_cov",
    f"{_ACTOR}.optim.optimizer": "verl's build_optimizer: the optimizer class",
    f"{_ACTOR}.optim.optimizer_impl": "verl's build_optimizer: the module the class comes from",
    f"{_ACTOR}.optim.lr": "the optimizer's learning rate",
    f"{_ACTOR}.optim.weight_decay": "the optimizer's weight decay",
    f"{_ACTOR}.optim.betas": "the optimizer's betas (Adam family)",
    f"{_ACTOR}.optim.override_optimizer_config": "extra optimizer arguments",
    f"{_ACTOR}.optim.lr_scheduler_type": "the LR schedule (backends/build_lr_scheduler)",
    f"{_ACTOR}.optim.warmup_style": "verl's deprecated name of lr_scheduler_type",
    f"{_ACTOR}.optim.lr_warmup_steps": "the LR schedule's warm-up",
    f"{_ACTOR}.optim.lr_warmup_steps_ratio": "the LR schedule's warm-up, as a share of total_training_steps",
    f"{_ACTOR}.optim.total_training_steps": "the cosine schedule's length (defaults to trainer.total_training_steps)",
    f"{_ACTOR}.optim.min_lr_ratio": "the cosine schedule's floor",
    f"{_ACTOR}.optim.num_cycles": "the cosine schedule's cycles",
    f"{_FSDP}.model_dtype": "the dtype the policy's parameters are loaded in",
    f"{_FSDP}.dtype": "the autocast dtype of verl's actor on CUDA",
    f"{_FSDP}.param_offload": "parameters on the CPU between calls (verl's offload_fsdp_model_to_cpu)",
    f"{_FSDP}.optimizer_offload": "optimizer state on the CPU between steps (verl's offload_fsdp_optimizer)",
    f"{_FSDP}.offload_policy": "FSDP2's CPUOffloadPolicy",
    f"{_FSDP}.reshard_after_forward": "FSDP2's fully_shard",
    # sampling and engines
    "actor_rollout_ref.rollout.name": "must equal engines.backend (settings/validate.py)",
    "actor_rollout_ref.rollout.n": "group size (RunSpec.executor.samples_per_prompt)",
    "actor_rollout_ref.rollout.temperature": "sampling and the trainer's log-probs (RunSpec)",
    "actor_rollout_ref.rollout.top_p": "sampling (RunSpec.executor.sampling)",
    "actor_rollout_ref.rollout.top_k": "sampling (RunSpec.executor.sampling)",
    "actor_rollout_ref.rollout.ignore_eos": "sampling (RunSpec.executor.sampling)",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "sglang engines (RunSpec.engines)",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "sglang engines (RunSpec.engines)",
    # accepted only at the value this trainer runs with (settings/validate.py refuses others)
    "actor_rollout_ref.rollout.mode": "only async (engines are servers)",
    "actor_rollout_ref.rollout.calculate_log_probs": "only true (engines always return log-probs)",
    "actor_rollout_ref.hybrid_engine": "only false (engines are separate processes)",
    # advantages and corrections (algorithms/)
    "algorithm.adv_estimator": "algorithms/advantages.py AdvantageConfig",
    "algorithm.gamma": "AdvantageConfig (gae, reinforce_plus_plus)",
    "algorithm.lam": "AdvantageConfig (gae)",
    "algorithm.norm_adv_by_std_in_grpo": "AdvantageConfig",
    "algorithm.singleton_group_advantage": "AdvantageConfig",
    "algorithm.gigpo": "AdvantageConfig.gigpo",
    "algorithm.off_policy_correction": "algorithms/correction_config.py CorrectionConfig",
    "algorithm.rollout_correction.": "CorrectionConfig (verl's spelling, mapped)",
    "algorithm.group_filter": "algorithms/filters.py FilterConfig",
    # the run
    "trainer.total_training_steps": "RunSpec.run",
    "trainer.total_epochs": "RunSpec.executor.data",
    "trainer.test_freq": "RunSpec.run",
    "trainer.save_freq": "RunSpec.run",
    "trainer.val_before_train": "RunSpec.run",
    "trainer.resume_mode": "RunSpec.run",
    "trainer.resume_from_path": "RunSpec.run",
    "trainer.project_name": "RunSpec.run (metrics sink)",
    "trainer.experiment_name": "RunSpec.run (run.dir default, metrics sink)",
    "trainer.logger": "RunSpec.run (metrics sink)",
    "trainer.device": "RunSpec.trainer (cuda refused without CUDA)",
    "trainer.n_gpus_per_node": "RunSpec.trainer.world_size (trainer ranks, runtime/trainer/ranks.py)",
    "trainer.nnodes": "RunSpec.trainer.world_size",
    "trainer.rollout_data_dir": "trajectory dumps per step (RunSpec.run.rollout_data_dir, observe/dumps.py)",
    "trainer.validation_data_dir": "validation dumps (RunSpec.run.validation_data_dir, observe/dumps.py)",
    "actor_rollout_ref.rollout.val_kwargs.": "multi_turn validation sampling (RunSpec.executor.validation)",
    # rewards
    "reward.custom_reward_function.path": "RunSpec.executor.reward_fn_path",
    "reward.custom_reward_function.name": "RunSpec.executor.reward_fn_name",
    "custom_reward_function.path": "verl's older spelling of reward.custom_reward_function.path",
    "custom_reward_function.name": "verl's older spelling of reward.custom_reward_function.name",
    # the critic (algorithm.adv_estimator=gae only): verl's FSDPCriticConfig, DataParallelPPOCritic (backends/critic.py)
    "critic.strategy": "fsdp2 (as the actor)",
    "critic.ppo_epochs": "1 only (backends/critic.py validate_critic_section)",
    "critic.ppo_micro_batch_size_per_gpu": "rows per critic forward/backward (static micro-batches)",
    "critic.forward_micro_batch_size_per_gpu": "rows per value forward (static micro-batches)",
    "critic.use_dynamic_bsz": "critic micro-batches cut by a token budget",
    "critic.ppo_max_token_len_per_gpu": "the token budget of a dynamic critic micro-batch",
    "critic.forward_max_token_len_per_gpu": "the token budget of a dynamic value forward",
    "critic.cliprange_value": "the value clip (verl's compute_value_loss)",
    "critic.loss_agg_mode": "verl's agg_loss of the value loss",
    "critic.grad_clip": "gradient-norm clipping of the critic's step",
    "critic.model.enable_gradient_checkpointing": "the value module (backends/critic.py)",
    **{
        f"critic.optim.{key}": f"the critic's optimizer or LR schedule (as {_ACTOR}.optim.{key})"
        for key in (
            "optimizer",
            "optimizer_impl",
            "lr",
            "weight_decay",
            "betas",
            "override_optimizer_config",
            "lr_scheduler_type",
            "warmup_style",
            "lr_warmup_steps",
            "lr_warmup_steps_ratio",
            "total_training_steps",
            "min_lr_ratio",
            "num_cycles",
        )
    },
}

# Keys (or prefixes ending in '.') under the read sections that verl's Ray workers read but this trainer does not,
# with why: a refusal names the reason. Everything not in VERL_KEYS_READ is refused too, these just say more.
VERL_KEYS_NOT_READ: dict[str, str] = {
    f"{_ACTOR}.checkpoint.": "checkpoints are this project's (trainer.save_freq)",
    f"{_ACTOR}.profiler.": "verl's profiler is not run",
    f"{_ACTOR}.megatron.": "read only with actor_rollout_ref.actor.strategy=megatron",
    f"{_ACTOR}.kl_loss_coef": "no reference model (use_kl_loss is refused)",
    f"{_ACTOR}.kl_loss_type": "no reference model (use_kl_loss is refused)",
    f"{_ACTOR}.data_loader_seed": "prompts come from the rollout service (data.seed)",
    f"{_ACTOR}.shuffle": "one optimizer step per batch, nothing to shuffle",
    f"{_ACTOR}.rollout_n": "set actor_rollout_ref.rollout.n",
    f"{_ACTOR}.ppo_micro_batch_size": "verl's deprecated global size; set ppo_micro_batch_size_per_gpu",
    f"{_ACTOR}.freeze_vision_tower": "vision-language models are not supported",
    f"{_ACTOR}.use_prefix_grouper": "verl's shared-prefix forward needs batches this trainer does not build",
    f"{_ACTOR}.use_fused_kernels": "verl patches the model's forward for it in its Ray worker, which is not run",
    f"{_ACTOR}.use_remove_padding": "the padding-free path needs flash-attention; the trainer runs sdpa",
    f"{_ACTOR}.ulysses_sequence_parallel_size": "no sequence parallelism (it needs the padding-free path)",
    f"{_ACTOR}.calculate_sum_pi_squared": "its output is not used by this trainer",
    f"{_ACTOR}.sum_pi_squared_checkpointing": "its output is not used by this trainer",
    f"{_ACTOR}.router_replay.": "MoE router replay is not run",
    f"{_ACTOR}.qat.": "quantisation-aware training is not run",
    f"{_ACTOR}.optim.clip_grad": "verl's actor clips with actor_rollout_ref.actor.grad_clip; set that",
    f"{_ACTOR}.optim.zero_indexed_step": "verl's legacy schedules (used here, as by its FSDP workers) ignore it",
    f"{_FSDP}.wrap_policy.": "FSDP2 wraps each decoder layer (the model's _no_split_modules)",
    f"{_FSDP}.fsdp_size": "one flat FSDP2 mesh over all trainer ranks (no hybrid sharding)",
    f"{_FSDP}.forward_prefetch": "FSDP1 only; the trainer shards with FSDP2",
    f"{_FSDP}.use_orig_params": "FSDP1 only; the trainer shards with FSDP2",
    f"{_FSDP}.seed": "the trainer seeds from run.seed",
    f"{_FSDP}.full_determinism": "read by verl's new engine workers only",
    f"{_FSDP}.ulysses_sequence_parallel_size": "no sequence parallelism (it needs the padding-free path)",
    f"{_FSDP}.entropy_from_logits_with_chunking": "verl's actor reads actor_rollout_ref.actor's; set that",
    f"{_FSDP}.use_torch_compile": "verl's actor reads actor_rollout_ref.actor.use_torch_compile; set that",
    f"{_FSDP}.entropy_checkpointing": "verl's actor reads actor_rollout_ref.actor's; set that",
    f"{_FSDP}.forward_only": "read by verl's new engine workers only",
    f"{_FSDP}.strategy": "set actor_rollout_ref.actor.strategy",
    f"{_FSDP}.qat.": "quantisation-aware training is not run",
    "actor_rollout_ref.model.use_remove_padding": "the padding-free path needs flash-attention; the trainer runs sdpa",
    "actor_rollout_ref.model.enable_activation_offload": "verl applies it in its Ray worker, which is not run",
    "actor_rollout_ref.model.use_fused_kernels": "verl patches the model's forward for it in its Ray worker",
    "actor_rollout_ref.model.use_liger": "verl patches the model for it in its Ray worker, which is not run",
    "actor_rollout_ref.model.trust_remote_code": "models load with transformers' own classes only",
    "actor_rollout_ref.model.override_config": "the model loads with its folder's config.json",
    "critic.model.path": "the critic starts from the policy's folder (actor_rollout_ref.model.path)",
    "critic.model.tokenizer_path": "the critic reads the policy's tokens (actor_rollout_ref.model.path)",
    "critic.ppo_mini_batch_size": "the critic takes one step per batch: its mini-batch is the batch",
    "critic.model.fsdp_config.": "the critic is one plain module in fp32 (backends/critic.py): nothing is sharded",
    "critic.optim.clip_grad": "verl's critic clips with critic.grad_clip; set that",
    "critic.optim.zero_indexed_step": "verl's legacy schedules (used here) ignore it",
    # whole sections and families: the reason a refusal gives when no entry above is closer
    "actor_rollout_ref.ref.": "no reference model is run (use_kl_loss and KL in the reward are refused)",
    "actor_rollout_ref.rollout.log_prob_": "the engines return the rollout's log-probs; the trainer's own "
    "recomputation is sized by actor.ppo_micro_batch_size_per_gpu / ppo_max_token_len_per_gpu",
    "actor_rollout_ref.rollout.": "verl's rollout worker is not run: engines.* and the sampling keys configure the "
    "engines",
    "algorithm.kl_ctrl.": "no KL penalty in the reward (no reference model)",
    "algorithm.kl_penalty": "no KL penalty in the reward (no reference model)",
    "algorithm.use_kl_in_reward": "no KL penalty in the reward (no reference model)",
    "algorithm.": "verl's trainer reads it in a loop this trainer does not run",
    "reward_model.": "no reward model is run: rewards come from reward.custom_reward_function",
    "data.": "the prompt loader reads only the data keys in settings/verl_keys.py",
    "trainer.": "verl's trainer loop is not run; the run reads only the trainer keys in settings/verl_keys.py",
}


@dataclass(frozen=True)
class ReadOnlyWhen:
    """A read key that has an effect only when `holds(cfg)`; set otherwise, it is refused with `condition`."""

    holds: Callable[[DictConfig], bool]
    condition: str  # completes "'<key>' is read only ..."


def _actor(cfg: DictConfig) -> DictConfig:
    return cfg.actor_rollout_ref.actor


def _on_cuda(cfg: DictConfig) -> bool:
    return cfg.trainer.device == "cuda"


def _fsdp2_sharded(cfg: DictConfig) -> bool:
    """The backend shards with fully_shard: several ranks, or CPUOffloadPolicy (backends/fsdp.py)."""
    world = int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes)
    return world > 1 or (_on_cuda(cfg) and bool(_actor(cfg).fsdp_config.get("offload_policy", False)))


def _entropy_computed(cfg: DictConfig) -> bool:
    return float(_actor(cfg).entropy_coeff) != 0 or bool(_actor(cfg).calculate_entropy)


# verl 0.7.1's policy losses (trainer/ppo/core_algos.py) and which of the actor's loss keys each reads.
_CLIPS = ("clip_ratio_low", "clip_ratio_high")
_AGG = ("loss_agg_mode",)
LOSS_MODE_READS: dict[str, tuple[str, ...]] = {
    "vanilla": (*_CLIPS, "clip_ratio_c", *_AGG),
    "bypass_mode": (*_CLIPS, "clip_ratio_c", *_AGG),  # its default loss_type ppo_clip is vanilla's
    "dppo_tv": (*_CLIPS, "clip_ratio_c", *_AGG),
    "dppo_kl": (*_CLIPS, "clip_ratio_c", *_AGG),
    "gspo": (*_CLIPS, *_AGG),
    "geo_mean": (*_CLIPS, *_AGG),
    "cispo": (*_CLIPS, *_AGG),
    "clip_cov": (*_CLIPS, "policy_loss.clip_cov_ratio", "policy_loss.clip_cov_lb", "policy_loss.clip_cov_ub", *_AGG),
    "kl_cov": ("policy_loss.kl_cov_ratio", "policy_loss.ppo_kl_coef", *_AGG),
    "gpg": _AGG,
    "sapo": ("tau_pos", "tau_neg"),  # aggregates with seq-mean-token-mean whatever loss_agg_mode says
}


def _loss_reads(leaf: str) -> ReadOnlyWhen:
    modes = [mode for mode, keys in LOSS_MODE_READS.items() if leaf in keys]

    def holds(cfg: DictConfig) -> bool:
        mode = str(_actor(cfg).policy_loss.loss_mode)
        return mode not in LOSS_MODE_READS or leaf in LOSS_MODE_READS[mode]  # another registered loss: its own

    return ReadOnlyWhen(holds, f"with policy_loss.loss_mode {' / '.join(modes)}")


_ENTROPY = "when the entropy is computed (actor.entropy_coeff != 0 or actor.calculate_entropy=true)"
_CUDA = "with trainer.device=cuda"


def _lora(cfg: DictConfig) -> bool:
    return int(cfg.actor_rollout_ref.model.lora_rank or 0) > 0


_LORA = "with actor_rollout_ref.model.lora_rank > 0 (the policy trains a LoRA adapter)"

READ_ONLY_WHEN: dict[str, ReadOnlyWhen] = {
    **{
        f"actor_rollout_ref.model.{leaf}": ReadOnlyWhen(_lora, _LORA)
        for leaf in ("lora_alpha", "target_modules", "exclude_modules", "lora_adapter_path")
    },
    f"{_FSDP}.dtype": ReadOnlyWhen(_on_cuda, f"{_CUDA} (verl's autocast dtype; on CPU the trainer computes in fp32)"),
    f"{_FSDP}.offload_policy": ReadOnlyWhen(_on_cuda, f"{_CUDA} (on CPU the parameters are in CPU memory already)"),
    f"{_FSDP}.param_offload": ReadOnlyWhen(
        lambda cfg: _on_cuda(cfg) and not _actor(cfg).fsdp_config.offload_policy,
        f"{_CUDA} (on CPU the parameters are in CPU memory already) and without fsdp_config.offload_policy (which "
        "keeps them there)",
    ),
    f"{_FSDP}.optimizer_offload": ReadOnlyWhen(
        lambda cfg: _on_cuda(cfg) and not _actor(cfg).fsdp_config.offload_policy,
        f"{_CUDA} (on CPU the optimizer state is in CPU memory already) and without fsdp_config.offload_policy "
        "(which keeps it there)",
    ),
    f"{_FSDP}.reshard_after_forward": ReadOnlyWhen(
        _fsdp2_sharded, "when the policy is sharded (several trainer ranks, or fsdp_config.offload_policy on CUDA)"
    ),
    f"{_ACTOR}.ppo_micro_batch_size_per_gpu": ReadOnlyWhen(
        lambda cfg: not _actor(cfg).use_dynamic_bsz,
        "with use_dynamic_bsz=false (dynamic micro-batches are cut by ppo_max_token_len_per_gpu)",
    ),
    f"{_ACTOR}.ppo_max_token_len_per_gpu": ReadOnlyWhen(
        lambda cfg: bool(_actor(cfg).use_dynamic_bsz), "with use_dynamic_bsz=true"
    ),
    f"{_ACTOR}.clip_ratio": ReadOnlyWhen(
        lambda cfg: _actor(cfg).clip_ratio_low is None or _actor(cfg).clip_ratio_high is None,
        "where clip_ratio_low or clip_ratio_high is null (verl's losses read those two; set them instead)",
    ),
    f"{_ACTOR}.loss_scale_factor": ReadOnlyWhen(
        lambda cfg: _actor(cfg).loss_agg_mode == "seq-mean-token-sum-norm", "with loss_agg_mode=seq-mean-token-sum-norm"
    ),
    f"{_ACTOR}.use_torch_compile": ReadOnlyWhen(_entropy_computed, f"{_ENTROPY}: verl compiles its entropy function"),
    f"{_ACTOR}.entropy_from_logits_with_chunking": ReadOnlyWhen(_entropy_computed, _ENTROPY),
    f"{_ACTOR}.entropy_checkpointing": ReadOnlyWhen(_entropy_computed, _ENTROPY),
    **{
        f"{_ACTOR}.{leaf}": _loss_reads(leaf)
        for leaf in sorted({leaf for keys in LOSS_MODE_READS.values() for leaf in keys})
    },
    "critic.ppo_micro_batch_size_per_gpu": ReadOnlyWhen(
        lambda cfg: not cfg.critic.use_dynamic_bsz, "with critic.use_dynamic_bsz=false"
    ),
    "critic.forward_micro_batch_size_per_gpu": ReadOnlyWhen(
        lambda cfg: not cfg.critic.use_dynamic_bsz, "with critic.use_dynamic_bsz=false"
    ),
    "critic.ppo_max_token_len_per_gpu": ReadOnlyWhen(
        lambda cfg: bool(cfg.critic.use_dynamic_bsz), "with critic.use_dynamic_bsz=true"
    ),
    "critic.forward_max_token_len_per_gpu": ReadOnlyWhen(
        lambda cfg: bool(cfg.critic.use_dynamic_bsz), "with critic.use_dynamic_bsz=true"
    ),
}

# Unread verl keys rLLM's launch scripts set, with what does that job here (named in the refusal).
_ENGINE_LOG_PROBS = "log-probs come from the engines, recomputed ones with the actor's batch settings"
VERL_KEYS_INSTEAD: dict[str, str] = {
    "trainer.default_local_dir": "this run writes checkpoints to RUN_DIR/checkpoints: set run.dir",
    "reward_model.": "no reward model or manager: the workflow scores (an rLLM rollout function: its reward)",
    "algorithm.kl_ctrl.": "no KL penalty in the reward: algorithm.use_kl_in_reward stays false",
    "actor_rollout_ref.ref.": "no reference model",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": _ENGINE_LOG_PROBS,
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": _ENGINE_LOG_PROBS,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": _ENGINE_LOG_PROBS,
    "actor_rollout_ref.rollout.max_num_batched_tokens": "engines.max_running_requests (or engines.extra_args: SGLang)",
    "actor_rollout_ref.rollout.skip_tokenizer_init": "the engines take token ids",
    "actor_rollout_ref.rollout.dtype": "engines.dtype, or engines.extra_args.dtype for SGLang",
    "actor_rollout_ref.rollout.engine_kwargs.": "SGLang's server flags are engines.extra_args",
}

_SKIPPED_LEAVES = ("_target_",)  # verl's dataclass targets: not settings


def _matches(key: str, entry: str) -> bool:
    """`entry` is the key itself, a prefix ending in '.', or a section whose leaves `key` is one of."""
    return key == entry or (entry.endswith(".") and key.startswith(entry)) or key.startswith(entry + ".")


def _closest(key: str, table: dict[str, str]) -> int:
    """Length of the most specific entry of `table` that matches `key` (0: none)."""
    return max((len(entry) for entry in table if _matches(key, entry)), default=0)


def is_read(key: str) -> bool:
    """True when `key` (dotted) is a verl key this trainer reads (in some setting: see READ_ONLY_WHEN): the most
    specific entry that matches it is in VERL_KEYS_READ rather than VERL_KEYS_NOT_READ."""
    return _closest(key, VERL_KEYS_READ) > _closest(key, VERL_KEYS_NOT_READ)


def refusal_reason(key: str) -> str:
    """Why `key` is not read: the most specific entry (the longest that matches) of VERL_KEYS_NOT_READ or
    VERL_KEYS_INSTEAD (what does that job here), else the general reason (verl reads it in a worker or loop this
    trainer does not run)."""
    reasons = {**VERL_KEYS_NOT_READ, **VERL_KEYS_INSTEAD}  # where a key has both, the one naming what to use
    entries = sorted((entry for entry in reasons if _matches(key, entry)), key=len, reverse=True)
    return reasons[entries[0]] if entries else "verl reads it in a worker or loop this trainer does not run"


def changed_verl_leaves(cfg: DictConfig, base: DictConfig) -> list[str]:
    """Dotted verl keys (outside this project's sections) whose value differs from the defaults.

    Raw values first (cheap), then resolved: rLLM writes `critic.strategy: fsdp2` where verl interpolates the
    actor's strategy, which is the same setting.
    """
    changed: list[str] = []
    for section in cfg:
        if section in PROJECT_SECTIONS:
            continue
        _walk(cfg[section], base.get(section), str(section), changed)
    return [key for key in changed if _resolved(cfg, key) != _resolved(base, key)]


def _resolved(cfg: DictConfig, key: str) -> Any:
    try:
        value = OmegaConf.select(cfg, key, throw_on_missing=False)
    except Exception:  # an interpolation that does not resolve: the raw values differ, so count it as changed
        return object()
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def _walk(node: Any, default: Any, prefix: str, out: list[str]) -> None:
    if isinstance(node, DictConfig) and len(node) and isinstance(default, DictConfig) and len(default):
        for key in node:
            if key in _SKIPPED_LEAVES:
                continue
            child = node._get_node(key)
            other = default._get_node(key) if key in default.keys() else None  # noqa: SIM118 - `in` skips ??? values
            _walk(child, other, f"{prefix}.{key}", out)
        return
    if _raw(node) != _raw(default):
        out.append(prefix)


def _raw(node: Any) -> Any:
    if node is None:
        return None
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=False)
    return node._value() if hasattr(node, "_value") else node


def unread_verl_key_refusals(
    cfg: DictConfig, base: DictConfig, *, step_from_mini_batch: bool = False
) -> list[ConfigError]:
    """A ConfigError (one line, naming the key) for each verl key set to a non-default value that nothing reads, or
    that is read only in a setting this config is not in (READ_ONLY_WHEN): all of them, so that `load_config`
    names every refused key at once. `step_from_mini_batch`: rLLM's require_batches sized the step from
    actor.ppo_mini_batch_size (settings/rllm_yaml.py), which is then read."""
    gae = cfg.algorithm.adv_estimator == "gae"
    megatron = cfg.actor_rollout_ref.actor.strategy == "megatron"
    refused: list[ConfigError] = []
    for key in changed_verl_leaves(cfg, base):
        if megatron and _matches(key, "actor_rollout_ref.actor.megatron."):
            continue  # verl's Megatron worker reads the section (backends/megatron.py)
        if key.startswith("critic.") and not gae:
            refused.append(
                ConfigError(f"'{key}' is read only with algorithm.adv_estimator=gae (the critic); remove it", key=key)
            )
            continue
        if key == "data.train_batch_size" and cfg.async_training.required_samples is not None:
            value, samples = cfg.data.train_batch_size, cfg.async_training.required_samples
            if value not in (0, samples):  # 0: rLLM's "batches come from the queue"
                refused.append(
                    ConfigError(
                        f"'data.train_batch_size' ({value}) is read only when async_training.required_samples is "
                        f"null, and that is {samples}; remove one",
                        key=key,
                    )
                )
            continue
        if key == f"{_ACTOR}.ppo_mini_batch_size":
            if not step_from_mini_batch:
                try:
                    _check_mini_batch(cfg)
                except ConfigError as error:
                    refused.append(error)
            continue
        if not is_read(key):
            why = refusal_reason(key)
            refused.append(
                ConfigError(f"'{key}' is verl's, not used by the fully-async trainer ({why}); remove it", key=key)
            )
            continue
        rule = READ_ONLY_WHEN.get(key)
        # null asks for nothing (verl's "unset"): it is how an override clears a value a composed YAML sets
        if rule is not None and not rule.holds(cfg) and OmegaConf.select(cfg, key) is not None:
            message = f"'{key}' is read only {rule.condition}; remove it (or set it to null over a YAML)"
            refused.append(ConfigError(message, key=key))
    return refused


def _check_mini_batch(cfg: DictConfig) -> None:
    """verl splits a step's prompts into mini-batches of ppo_mini_batch_size, one optimizer step each. Here a step is
    always one mini-batch (async_training.required_samples prompt groups), so a size >= that means what runs; a
    smaller one would ask for several optimizer steps per batch, which this trainer never takes. (With
    required_samples null, rLLM's require_batches sizes the step from it: settings/rllm_yaml.py.)"""
    size, samples = int(_actor(cfg).ppo_mini_batch_size), cfg.async_training.required_samples
    if samples is not None and size < int(samples):
        raise ConfigError(
            f"'{_ACTOR}.ppo_mini_batch_size' ({size}) < async_training.required_samples ({samples}) would split a "
            "step into several optimizer steps; the fully-async trainer takes one per batch: remove it or set it "
            f">= {samples}",
            key=f"{_ACTOR}.ppo_mini_batch_size",
        )
