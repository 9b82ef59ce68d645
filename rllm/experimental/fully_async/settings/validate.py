"""Validation: ranges, choices and cross-field rules, checked once after the derived values are filled.

Every failure is a `ConfigError` whose message is one line naming the key and what would fix it.
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig, OmegaConf

from rllm.experimental.fully_async.api.rollout_functions import RUNNER_WORKFLOW
from rllm.experimental.fully_async.core.adaptive_staleness import AdaptiveStalenessRule
from rllm.experimental.fully_async.core.addresses import check_master_address
from rllm.experimental.fully_async.errors import ConfigError
from rllm.experimental.fully_async.errors import first_line as _first_line
from rllm.experimental.fully_async.settings.derive import largest_staleness
from rllm.experimental.fully_async.settings.schema import EnginesLoRAConfig, EnvConfig, ToolsConfig, WorkflowConfig
from rllm.experimental.fully_async.tasks import task_names, unknown_task_message

logger = logging.getLogger(__name__)

_CHOICES: dict[str, tuple[str, ...]] = {
    "engines.backend": ("embedded", "sglang"),
    "engines.dtype": ("float32", "bfloat16"),
    "engines.on_engine_failure": ("restart", "continue", "stop"),
    "param_sync.transport": ("disk", "distributed", "nccl"),  # nccl: verl/rLLM's name for distributed
    "param_sync.dtype": ("auto", "float32", "bfloat16"),
    "actor_rollout_ref.rollout.name": ("embedded", "sglang"),
    "actor_rollout_ref.actor.loss_agg_mode": (
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ),
    "data.truncation": ("error", "left", "right"),
    "trainer.resume_mode": ("auto", "disable", "resume_path"),
    "run.log_level": ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
    "workflow.layout": ("per_step", "concat"),
    "tools.format": ("hermes", "compact"),
    "engines.lora.eviction_policy": ("lru", "fifo"),  # SGLang's --lora-eviction-policy choices
    "engines.lora.backend": ("csgmv", "triton", "ascend"),  # SGLang's --lora-backend choices
}

# key -> (minimum, strict): value must be > minimum (strict) or >= minimum.
_LOWER_BOUNDS: dict[str, tuple[float, bool]] = {
    "async_training.max_staleness": (0, False),
    "async_training.trigger_parameter_sync_step": (1, False),
    "async_training.required_samples": (1, False),
    "async_training.max_concurrent_rollouts": (1, False),
    "async_training.queue_max_groups": (1, False),
    "async_training.queue_get_timeout_s": (0, True),
    "engines.num_engines": (1, False),
    "param_sync.bucket_mb": (0, True),
    "trainer.n_gpus_per_node": (1, False),
    "trainer.nnodes": (1, False),
    "engines.max_running_requests": (1, False),
    "engines.startup_timeout_s": (0, True),
    "engines.request_timeout_s": (0, True),
    "engines.torch_threads": (1, False),
    "engines.max_restarts": (0, False),
    "engines.no_engine_timeout_s": (0, False),
    "engines.forward_sleep_s": (0, False),
    "param_sync.timeout_s": (0, True),
    "workflow.reward_timeout_s": (0, True),
    "env.max_turns": (1, False),
    "env.max_total_tokens": (1, False),
    "env.step_timeout_s": (0, True),
    "tools.timeout_s": (0, True),
    "actor_rollout_ref.rollout.val_kwargs.n": (1, False),
    "actor_rollout_ref.rollout.val_kwargs.temperature": (0, False),
    "task.warmup_steps": (0, False),
    "task.val_size": (1, False),
    "actor_rollout_ref.rollout.n": (1, False),
    "actor_rollout_ref.rollout.temperature": (0, False),
    "actor_rollout_ref.actor.optim.lr": (0, True),
    "actor_rollout_ref.actor.clip_ratio": (0, True),
    "actor_rollout_ref.actor.grad_clip": (0, True),
    "data.max_prompt_length": (1, False),
    "data.max_response_length": (1, False),
    "data.train_batch_size": (0, False),  # 0: rLLM's "batches come from the queue" (needs required_samples)
}


def validate(cfg: DictConfig, *, check_host: bool = True) -> None:
    """Ranges, choices and cross-field rules, each failure one line naming the key. `check_host=False` skips what
    depends on this machine (CUDA present), for commands that plan a run elsewhere (`plan`, `simulate`)."""
    refuse_unsupported(cfg, check_host=check_host)
    for key, choices in _CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in choices:
            raise ConfigError(f"'{key}' must be one of {', '.join(choices)}; got {value!r}")
    for key, (minimum, strict) in _LOWER_BOUNDS.items():
        value = OmegaConf.select(cfg, key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"'{key}' must be a number, got {value!r}")
        if value < minimum or (strict and value == minimum):
            relation = ">" if strict else ">="
            raise ConfigError(f"'{key}' must be {relation} {minimum}, got {value!r}")
    top_p = OmegaConf.select(cfg, "actor_rollout_ref.rollout.top_p")
    if not 0 < float(top_p) <= 1:
        raise ConfigError(f"'actor_rollout_ref.rollout.top_p' must be in (0, 1], got {top_p!r}")

    _validate_algorithm(cfg)
    _validate_cross_fields(cfg)


def refuse_unsupported(cfg: DictConfig, *, check_host: bool = True) -> None:
    """Refuse settings this build or this machine cannot honour (a transport, strategy, device or topology it lacks),
    rather than running something else."""
    # The distributed transport works with one or several FSDP ranks (rank 0 broadcasts: runtime/sync/sender.py)
    # and Megatron (its HF export stream); only the address the engines reach rank 0 at can be wrong here.
    try:
        check_master_address(cfg.param_sync.master_address)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    strategy = cfg.actor_rollout_ref.actor.strategy
    if strategy == "megatron":
        _refuse_unsupported_megatron(cfg, check_host=check_host)
    elif "megatron" in cfg.actor_rollout_ref.actor:
        raise ConfigError(
            f"'actor_rollout_ref.actor.strategy={strategy}' on verl's ppo_megatron_trainer defaults: set strategy: "
            "megatron, or compose on ppo_trainer for FSDP2"
        )
    elif strategy != "fsdp2":
        raise ConfigError(
            f"'actor_rollout_ref.actor.strategy={strategy}': the trainer shards with FSDP2 only; use strategy: fsdp2"
        )
    if cfg.trainer.device == "cuda":
        # lazy: torch (~1 s) stays out of importing settings/ (the CLI's startup); only a CUDA or Megatron config asks
        import torch

        # With trainer.nnodes > 1 the ranks run on the Ray cluster's GPU nodes, which the placement checks: the
        # driver's own machine may be a CPU head node.
        if check_host and int(cfg.trainer.nnodes) == 1 and not torch.cuda.is_available():
            raise ConfigError("'trainer.device=cuda' but CUDA is not available here; set trainer.device=cpu")
    elif cfg.trainer.device != "cpu":
        raise ConfigError(f"'trainer.device' must be cpu or cuda, got {cfg.trainer.device!r}")
    rollout = cfg.actor_rollout_ref.rollout
    fixed = {
        "actor_rollout_ref.hybrid_engine": (cfg.actor_rollout_ref.hybrid_engine, False, "engines are separate servers"),
        "actor_rollout_ref.rollout.mode": (rollout.mode, "async", "engines are servers answering HTTP"),
        "actor_rollout_ref.rollout.calculate_log_probs": (
            rollout.calculate_log_probs,
            True,
            "engines always return them",
        ),
    }
    for key, (value, only, why) in fixed.items():
        if value != only:
            raise ConfigError(f"'{key}={value}' cannot be honoured ({why}); set it to {only} or remove it")
    if cfg.engines.backend != "embedded" and cfg.engines.forward_sleep_s:
        raise ConfigError(
            "'engines.forward_sleep_s' slows the embedded engine (an experiment's stand-in for slow generation); with "
            f"engines.backend={cfg.engines.backend} remove it (SGLang's own route is POST /slow_down)"
        )
    if cfg.engines.backend == "embedded" and len(cfg.engines.extra_args):
        raise ConfigError(
            "'engines.extra_args' is passed to sglang.launch_server; with engines.backend=embedded remove it"
        )


def refuse_unusable_megatron() -> None:
    """strategy megatron on a machine without CUDA, or without megatron-core, mbridge or TransformerEngine: one
    line, before anything else about the config (verl would otherwise fail deep inside its worker)."""
    # lazy: torch (~1 s) stays out of importing settings/ (the CLI's startup); only a CUDA or Megatron config asks
    import torch

    # lazy: backends.megatron imports torch at its top (~1 s), asked only for a Megatron config
    from rllm.experimental.fully_async.backends.megatron import CUDA_REFUSAL, megatron_unusable_reason

    if not torch.cuda.is_available():
        raise ConfigError(CUDA_REFUSAL)
    reason = megatron_unusable_reason(cuda_available=True)
    if reason is not None:
        raise ConfigError(f"'actor_rollout_ref.actor.strategy=megatron': {reason}")


def _refuse_unsupported_megatron(cfg: DictConfig, *, check_host: bool) -> None:
    """The Megatron backend (backends/megatron.py): CUDA only, one trainer process, no critic."""
    if check_host:
        refuse_unusable_megatron()
    if "megatron" not in cfg.actor_rollout_ref.actor:
        raise ConfigError(
            "'actor_rollout_ref.actor.strategy=megatron' needs verl's Megatron keys: add ppo_megatron_trainer to "
            "the YAML's defaults (see config/gpu_megatron_sglang.yaml)"
        )
    if cfg.trainer.device != "cuda":
        raise ConfigError("'actor_rollout_ref.actor.strategy=megatron' runs on GPUs only: set trainer.device=cuda")
    world = int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes)
    if world != 1:
        raise ConfigError(
            f"'trainer.n_gpus_per_node x trainer.nnodes' is {world} with strategy megatron: the Megatron trainer runs "
            "as one process (one GPU) here; set both to 1 or use strategy: fsdp2 for several trainer GPUs"
        )
    if cfg.algorithm.adv_estimator == "gae":
        raise ConfigError("'algorithm.adv_estimator=gae' needs the FSDP critic: use strategy: fsdp2 for GAE")
    correction = cfg.algorithm.get("off_policy_correction")
    if correction is not None and correction.get("prox_log_probs") == "previous":
        raise ConfigError(
            "'algorithm.off_policy_correction.prox_log_probs=previous' needs the FSDP trainer (the Megatron backend "
            "keeps no copy of its previous weights): use prox_log_probs: loglinear with prox_lag: 1, or strategy: fsdp2"
        )
    if correction is not None and correction.get("control_prox") is not None:
        raise ConfigError(
            "'algorithm.off_policy_correction.control_prox' needs the FSDP trainer (the Megatron backend keeps no "
            "copy of its previous weights): remove it, or use strategy: fsdp2"
        )
    megatron = cfg.actor_rollout_ref.actor.megatron
    for key in MEGATRON_PARALLEL_KEYS:
        value = megatron.get(key)
        if value not in (None, 1):
            raise ConfigError(
                f"'actor_rollout_ref.actor.megatron.{key}={value}': the Megatron trainer runs as one process on one "
                "GPU here (no multi-GPU Megatron path yet); set it to 1, or use strategy: fsdp2 for several GPUs"
            )


# Megatron's model-parallel sizes: each above 1 needs that many GPUs in one Megatron process group.
MEGATRON_PARALLEL_KEYS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


def _validate_algorithm(cfg: DictConfig) -> None:
    # lazy: verl and algorithms/ (which imports it) cost ~4 s, kept out of importing settings/ (CLI startup)
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    # lazy: algorithms.advantages and .corrections import verl (~4 s), like the line above
    from rllm.experimental.fully_async.algorithms.advantages import (
        GROUP_ESTIMATORS,
        SUPPORTED_ESTIMATORS,
        AdvantageConfig,
    )
    from rllm.experimental.fully_async.algorithms.corrections import build_correction
    from rllm.experimental.fully_async.algorithms.filters import FilterConfig
    from rllm.experimental.fully_async.api.config import dataclass_from_config

    estimator = cfg.algorithm.adv_estimator
    if estimator not in SUPPORTED_ESTIMATORS:
        raise ConfigError(
            f"'algorithm.adv_estimator' must be one of {', '.join(sorted(SUPPORTED_ESTIMATORS))}; got {estimator!r}"
        )
    if estimator != "gigpo" and cfg.algorithm.get("gigpo") is not None:
        raise ConfigError(
            f"'algorithm.gigpo' is read only with algorithm.adv_estimator=gigpo (got {estimator!r}); remove it"
        )
    if estimator == "gae":
        # lazy: backends.critic imports verl and peft (~5 s), read only with adv_estimator=gae
        from rllm.experimental.fully_async.backends.critic import validate_critic_section

        try:
            validate_critic_section(cfg.critic)
        except ValueError as exc:
            raise ConfigError(_first_line(exc)) from exc
        if cfg.critic.strategy != "fsdp2":
            raise ConfigError(
                f"'critic.strategy' must be fsdp2, got {cfg.critic.strategy!r}: the critic is built as the policy is "
                "(one module at one rank: backends/critic.py)"
            )
        if int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes) != 1:
            raise ConfigError(
                "'trainer.n_gpus_per_node' x 'trainer.nnodes' must be 1 with algorithm.adv_estimator=gae "
                "(verl's critic is unpatched: its loss is not proven correct across ranks)"
            )
    # The algorithm sections validate themselves when built; their errors name the key.
    built = {}

    def group_filter(cfg: DictConfig) -> FilterConfig | None:
        return dataclass_from_config(cfg, "algorithm.group_filter", FilterConfig)

    for build in (AdvantageConfig.from_config, build_correction, group_filter):
        try:
            built[build] = build(cfg)
        except (ValueError, TypeError) as exc:
            raise ConfigError(_first_line(exc)) from exc
    loss_mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    correction = built[build_correction]
    if correction is not None and correction.policy_loss_mode is not None and loss_mode != "vanilla":
        raise ConfigError(
            "'actor_rollout_ref.actor.policy_loss.loss_mode' must be 'vanilla' with algorithm.off_policy_correction"
            f" mode=m2po or prox_log_probs=loglinear (their registered loss replaces it); got {loss_mode!r}"
        )
    if loss_mode not in POLICY_LOSS_REGISTRY:
        raise ConfigError(
            "'actor_rollout_ref.actor.policy_loss.loss_mode' must be one of "
            f"{', '.join(sorted(POLICY_LOSS_REGISTRY))}; got {loss_mode!r}"
        )
    if estimator in GROUP_ESTIMATORS and cfg.actor_rollout_ref.rollout.n < 2:
        raise ConfigError(
            f"'actor_rollout_ref.rollout.n' must be >= 2 for the group-relative estimator '{estimator}' "
            "(set actor_rollout_ref.rollout.n=8, or algorithm.adv_estimator=reinforce_plus_plus)"
        )


def _validate_cross_fields(cfg: DictConfig) -> None:
    at = cfg.async_training
    actor = cfg.actor_rollout_ref.actor
    if actor.use_kl_loss:
        raise ConfigError(
            "'actor_rollout_ref.actor.use_kl_loss' needs a reference model, which the fully-async trainer "
            "does not run; set it to false"
        )
    if actor.ppo_epochs != 1:
        raise ConfigError(
            "'actor_rollout_ref.actor.ppo_epochs' must be 1: the fully-async trainer makes exactly one optimizer "
            "step per batch (raise async_training.required_samples for larger steps)"
        )
    _validate_sampling_seed(cfg.engines)
    _validate_engine_lora(cfg)
    _validate_trainer_lora(cfg)
    if cfg.engines.backend != cfg.actor_rollout_ref.rollout.name:
        raise ConfigError(
            f"'engines.backend' ({cfg.engines.backend}) and 'actor_rollout_ref.rollout.name' "
            f"({cfg.actor_rollout_ref.rollout.name}) disagree; set both to the same engine"
        )
    micro = actor.ppo_micro_batch_size_per_gpu
    if not actor.use_dynamic_bsz and (micro is None or micro < 1):
        raise ConfigError(
            "'actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu' must be >= 1 "
            "(or set actor_rollout_ref.actor.use_dynamic_bsz=true)"
        )
    if at.max_concurrent_rollouts < int(cfg.actor_rollout_ref.rollout.n):
        raise ConfigError(
            "'async_training.max_concurrent_rollouts' must be >= actor_rollout_ref.rollout.n "
            f"({cfg.actor_rollout_ref.rollout.n}) so one prompt group can run"
        )
    _validate_adaptive_staleness(at)
    _validate_control_prox(cfg)
    if at.queue_max_groups < at.required_samples:
        raise ConfigError(
            f"'async_training.queue_max_groups' ({at.queue_max_groups}) must be >= "
            f"async_training.required_samples ({at.required_samples}) or the trainer can never get a batch"
        )
    if at.use_rollout_log_probs and at.compute_prox_log_prob and at.max_staleness == 0:
        logger.info("compute_prox_log_prob with max_staleness=0: proximal and behaviour policies coincide")
    if cfg.task.name is None:
        for key in ("data.train_files", "actor_rollout_ref.model.path"):
            if not OmegaConf.select(cfg, key):
                raise ConfigError(f"'{key}' must be set when task.name is null (or set task.name=addition)")
    _validate_agent(cfg)
    if cfg.task.name is not None and cfg.task.name not in task_names():
        raise ConfigError(unknown_task_message(cfg.task.name))
    total = cfg.trainer.total_training_steps
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 1):
        raise ConfigError(f"'trainer.total_training_steps' must be a positive integer or null, got {total!r}")


def _validate_control_prox(cfg: DictConfig) -> None:
    """algorithm.off_policy_correction.control_prox is the synchronous control of an experiment (η = 0, K = 1):
    elsewhere tokens of older versions exist and the async arms' own proximal policy is the one to use."""
    correction = cfg.algorithm.get("off_policy_correction")
    if correction is None or correction.get("control_prox") is None:
        return
    at = cfg.async_training
    if at.max_staleness != 0 or at.trigger_parameter_sync_step != 1 or at.adaptive_staleness.enable:
        raise ConfigError(
            "'algorithm.off_policy_correction.control_prox' is a control for synchronous runs only: set "
            "async_training.max_staleness=0, trigger_parameter_sync_step=1 and adaptive_staleness.enable=false "
            f"(got max_staleness={at.max_staleness}, trigger_parameter_sync_step={at.trigger_parameter_sync_step}, "
            f"adaptive {bool(at.adaptive_staleness.enable)}), or remove it"
        )


def _validate_sampling_seed(engines: DictConfig) -> None:
    """engines.sampling_seed and deterministic_inference: each needs the other where the engine would not honour
    it alone (settings/schema.py EnginesConfig)."""
    seed = engines.sampling_seed
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ConfigError(f"'engines.sampling_seed' must be an integer or null, got {seed!r}")
    if engines.deterministic_inference and seed is None:
        raise ConfigError(
            "'engines.deterministic_inference' gives every request SGLang's default sampling_seed 42, so the n "
            "samples of a prompt would be identical: set engines.sampling_seed too (each sample then has its own)"
        )
    if seed is not None and engines.backend == "sglang" and not engines.deterministic_inference:
        raise ConfigError(
            "'engines.sampling_seed' is ignored by SGLang 0.5.6 unless it runs with --enable-deterministic-inference: "
            "set engines.deterministic_inference=true too, or remove engines.sampling_seed"
        )


# SGLang 0.5.6's --lora-target-modules choices (sglang/srt/utils/common.py SUPPORTED_LORA_TARGET_MODULES, and all).
SGLANG_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj")
SGLANG_LORA_TARGETS += ("gate_up_proj", "all")


def _validate_trainer_lora(cfg: DictConfig) -> None:
    """actor_rollout_ref.model.lora_rank > 0: what a LoRA run cannot do yet, refused in one line each."""
    rank = int(cfg.actor_rollout_ref.model.lora_rank or 0)
    if rank < 0:
        raise ConfigError(f"'actor_rollout_ref.model.lora_rank={rank}': use 0 (all weights train) or a rank > 0")
    if rank == 0:
        return
    if cfg.actor_rollout_ref.actor.strategy == "megatron":
        raise ConfigError(
            "'actor_rollout_ref.model.lora_rank' with actor_rollout_ref.actor.strategy=megatron: LoRA is built on the "
            "FSDP2 backend only (peft over the HF model); set strategy=fsdp2 or lora_rank=0"
        )
    if cfg.param_sync.transport in ("distributed", "nccl"):
        raise ConfigError(
            f"'param_sync.transport={cfg.param_sync.transport}' with actor_rollout_ref.model.lora_rank > 0: adapters "
            "travel by disk only (a peft folder each version, /load_lora_adapter); set param_sync.transport=disk"
        )
    if cfg.algorithm.adv_estimator == "gae":
        raise ConfigError(
            "'actor_rollout_ref.model.lora_rank' with algorithm.adv_estimator=gae: the critic trains all its "
            "weights and the policy's LoRA has no critic counterpart here; use a critic-free estimator or lora_rank=0"
        )


def _validate_engine_lora(cfg: DictConfig) -> None:
    """engines.lora.*: read only with LoRA; the engines must hold every adapter version the staleness bound admits
    (η_max + 1, settings/derive.py) and serve the trainer's rank and modules, as SGLang 0.5.6 can."""
    lora, rank = cfg.engines.lora, int(cfg.actor_rollout_ref.model.lora_rank or 0)
    if rank <= 0:
        for key, default in EnginesLoRAConfig().__dict__.items():
            if lora[key] != default:
                raise ConfigError(
                    f"'engines.lora.{key}' is read only when the policy trains as LoRA "
                    "(actor_rollout_ref.model.lora_rank > 0); remove it"
                )
        return
    need = largest_staleness(cfg.async_training) + 1
    for key, flag in (("max_loaded_loras", "--max-loaded-loras"), ("max_loras_per_batch", "--max-loras-per-batch")):
        if lora[key] is not None and lora[key] < need:
            raise ConfigError(
                f"'engines.lora.{key}={lora[key]}' cannot hold the η+1={need} adapter versions the staleness bound "
                f"admits (η_max={need - 1}): raise it (SGLang's {flag}) to at least {need}, or lower the staleness"
            )
    if lora.max_loaded_loras is not None and lora.max_loaded_loras < lora.max_loras_per_batch:
        raise ConfigError(
            f"'engines.lora.max_loaded_loras' ({lora.max_loaded_loras}) must be >= engines.lora.max_loras_per_batch "
            f"({lora.max_loras_per_batch}): SGLang refuses to start otherwise"
        )
    if lora.max_lora_rank < rank:
        raise ConfigError(
            f"'engines.lora.max_lora_rank' ({lora.max_lora_rank}) is below actor_rollout_ref.model.lora_rank ({rank}): "
            "the engines would refuse every adapter; raise it or leave it null"
        )
    unknown = [m for m in lora.target_modules if m not in SGLANG_LORA_TARGETS]
    if unknown or not lora.target_modules or ("all" in lora.target_modules and len(lora.target_modules) > 1):
        raise ConfigError(
            f"'engines.lora.target_modules' {list(lora.target_modules)}: SGLang 0.5.6 serves LoRA on "
            f"{', '.join(SGLANG_LORA_TARGETS[:-1])}, or [all] alone; set actor_rollout_ref.model.target_modules to "
            "those (or all-linear)"
        )
    sglang_only = {k: lora[k] for k in ("eviction_policy", "backend") if lora[k] != EnginesLoRAConfig().__dict__[k]}
    if cfg.engines.backend == "embedded" and sglang_only:
        raise ConfigError(f"'engines.lora.{next(iter(sglang_only))}' is read by SGLang only (GPU); remove it")
    if cfg.engines.backend == "sglang" and cfg.param_sync.transport in ("distributed", "nccl"):
        raise ConfigError(
            f"'param_sync.transport={cfg.param_sync.transport}' cannot carry LoRA adapters to SGLang 0.5.6, which "
            "loads them only from a folder (/load_lora_adapter): set param_sync.transport=disk with "
            "param_sync.weights_dir on a filesystem every engine reads"
        )


def _validate_adaptive_staleness(at: DictConfig) -> None:
    """The rule's own checks; its keys are read only with enable; η starts within [min, max]."""
    section = at.adaptive_staleness
    fields = {k: section[k] for k in AdaptiveStalenessRule.__dataclass_fields__}
    if not section.enable:
        for key, value in fields.items():
            if value != AdaptiveStalenessRule.__dataclass_fields__[key].default:
                raise ConfigError(
                    f"'async_training.adaptive_staleness.{key}' is read only with "
                    "async_training.adaptive_staleness.enable=true; remove it or enable the rule"
                )
        return
    try:
        rule = AdaptiveStalenessRule(**fields)
    except ValueError as exc:
        raise ConfigError(f"async_training.{_first_line(exc)}") from exc
    if not rule.min <= at.max_staleness <= rule.max:
        raise ConfigError(
            f"async_training.max_staleness ({at.max_staleness}) is where adaptive staleness starts: it must be "
            f"within async_training.adaptive_staleness [min, max] = [{rule.min}, {rule.max}]"
        )


BUILTIN_WORKFLOWS = ("single_turn", "multi_turn")


def _validate_agent(cfg: DictConfig) -> None:
    """The workflow, and the sections only a multi_turn workflow reads (env, tools, workflow.layout, val_kwargs)."""
    wf = cfg.workflow
    runner = wf.path is None and wf.name == RUNNER_WORKFLOW
    if wf.path is None and wf.name not in BUILTIN_WORKFLOWS and not runner:
        raise ConfigError(
            f"'workflow.name' {wf.name!r} is not a built-in workflow ({', '.join(BUILTIN_WORKFLOWS)}); "
            "set workflow.path to the file that defines it"
        )
    if wf.rllm_batched != WorkflowConfig.rllm_batched and wf.path is None and not runner:
        raise ConfigError("'workflow.rllm_batched' is read only with an rLLM rollout function at workflow.path")
    if wf.rllm_rows and wf.path is None and not runner:
        raise ConfigError(
            "rLLM dataset rows (data.train_dataset_name / val_dataset_name, workflow.rllm_rows) are read only by an "
            "rLLM rollout function (runner.AsyncAgentTrainer, or workflow.path); give verl parquet in data.train_files"
        )
    multi_turn = wf.path is None and wf.name == "multi_turn"
    if not multi_turn:
        defaults = {"env": EnvConfig(), "tools": ToolsConfig()}
        for section, default in defaults.items():
            for key, value in default.__dict__.items():
                if _plain(cfg[section][key]) != value:
                    raise ConfigError(f"'{section}.{key}' is read only with workflow.name=multi_turn; remove it")
        if wf.layout != WorkflowConfig.layout:
            raise ConfigError("'workflow.layout' is read only with workflow.name=multi_turn; remove it")
    val_kwargs = cfg.actor_rollout_ref.rollout.val_kwargs
    if wf.path is None and wf.name == "single_turn":
        verl_defaults = {"n": 1, "temperature": 0, "do_sample": False, "top_p": 1.0, "top_k": -1}
        for key, value in verl_defaults.items():
            if val_kwargs[key] != value:
                raise ConfigError(
                    f"'actor_rollout_ref.rollout.val_kwargs.{key}' is read only by agent workflows "
                    "(single-turn validation decodes each prompt once, greedily); remove it"
                )
    elif runner:
        sampling = {"temperature": 0, "do_sample": False, "top_p": 1.0, "top_k": -1}  # verl's defaults
        for key, value in sampling.items():
            if val_kwargs[key] != value:
                raise ConfigError(
                    f"'actor_rollout_ref.rollout.val_kwargs.{key}': AsyncAgentTrainer's rollout functions pass their "
                    "own sampling_params (rLLM applies none of val_kwargs either); remove it"
                )
    elif not val_kwargs.do_sample and val_kwargs.temperature != 0:
        raise ConfigError(
            "'actor_rollout_ref.rollout.val_kwargs.temperature' is used only with val_kwargs.do_sample=true "
            "(verl's rule: do_sample=false decodes greedily); set both"
        )
    if not multi_turn:
        return
    if cfg.env.name is None:
        raise ConfigError("'env.name' must be set with workflow.name=multi_turn (a built-in such as number_line)")
    # lazy: envs/ and workflows.tools pull the worker pool, httpx and verl (~5 s), read only for multi_turn
    from rllm.experimental.fully_async.envs.base import EnvSpec
    from rllm.experimental.fully_async.workflows.tools import ToolBox

    try:
        EnvSpec.from_config(_plain(cfg.env))
        if len(cfg.tools.functions):
            ToolBox(dict(cfg.tools.functions), str(cfg.tools.format), float(cfg.tools.timeout_s))
    except ValueError as exc:
        raise ConfigError(_first_line(exc)) from exc


def _plain(node: object) -> object:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
