"""The run specification: frozen dataclasses built once from the validated config and handed to the components.

`build_run_spec(cfg)` reads every key the run honours, in one place, so that a component never reaches into the
config tree (no scattered `getattr` defaults) and a test can show each key changes what runs. Each value is held
once: the schedule both sides read is `ScheduleSpec`. Units: groups are prompts with their n samples; versions
count weight syncs (one bump per sync, see `core/versions.py`); times are seconds. verl sections handed whole to
verl (the actor, the critic) stay plain read-only mappings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rllm.experimental.fully_async.algorithms.advantages import AdvantageConfig
from rllm.experimental.fully_async.algorithms.correction_config import CorrectionConfig, correction_config_from
from rllm.experimental.fully_async.algorithms.filters import FilterConfig
from rllm.experimental.fully_async.api.config import dataclass_from_config
from rllm.experimental.fully_async.api.rollout_functions import RolloutFunctions
from rllm.experimental.fully_async.core.adaptive_staleness import AdaptiveStalenessRule


@dataclass(frozen=True)
class SamplingSpec:
    """What every rollout request asks the engine for (verl's rollout section, data.max_response_length)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    ignore_eos: bool


@dataclass(frozen=True)
class DataSpec:
    """Prompt files and how they are read (verl's data section)."""

    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    max_prompt_length: int
    overlong: str  # filter | truncate_left | truncate_right | error (data.filter_overlong_prompts, data.truncation)
    seed: int  # data.seed, or run.seed when unset
    shuffle: bool
    total_epochs: int
    val_size: int  # task.val_size: held-out prompts measured per validation
    rows: bool = False  # workflow.rllm_rows: rLLM dataset rows, given as stored (data/rows.py); else verl prompts


@dataclass(frozen=True)
class AgentSpec:
    """A multi_turn workflow's environment, tools and row layout (`env`, `tools`, `workflow.layout`)."""

    env_name: str
    env_path: str | None
    env_kwargs: Mapping[str, Any]
    max_turns: int
    max_total_tokens: int
    step_timeout_s: float
    layout: str  # per_step | concat
    tool_format: str
    tool_timeout_s: float
    tools: Mapping[str, str]  # name -> function reference; empty: no tools


@dataclass(frozen=True)
class ValidationSamplingSpec:
    """How multi_turn validation samples (verl's actor_rollout_ref.rollout.val_kwargs): n episodes per held-out
    prompt, success = mean episode reward. Single-turn validation decodes once, greedily (verl's defaults stay)."""

    n: int
    temperature: float  # 0 when do_sample is false
    top_p: float
    top_k: int


@dataclass(frozen=True)
class ScheduleSpec:
    """The fully-async schedule both sides read (async_training): step size, sync interval, staleness bound.
    Units: core/versions.py (B = groups_per_version(required_samples, trigger_parameter_sync_step))."""

    required_samples: int  # R: groups (prompts) per optimizer step
    trigger_parameter_sync_step: int  # K: optimizer steps per weight sync (one version)
    max_staleness: int  # η, in policy versions (derived from rLLM's staleness_threshold: settings/compat.py)
    # async_training.adaptive_staleness when enabled: η starts at max_staleness and moves at each sync
    adaptive: AdaptiveStalenessRule | None = None


@dataclass(frozen=True)
class ExecutorSpec:
    """The rollout side: budget, sampling, workflow, filter."""

    samples_per_prompt: int  # actor_rollout_ref.rollout.n
    max_concurrent_rollouts: int
    queue_max_groups: int
    partial_rollout: bool
    sampling: SamplingSpec
    workflow_name: str
    workflow_path: str | None
    reward_timeout_s: float
    reward_fn_path: str | None
    reward_fn_name: str | None
    group_filter: FilterConfig | None
    data: DataSpec
    agent: AgentSpec | None = None  # workflow.name=multi_turn
    rllm_batched: bool = False  # workflow.rllm_batched (an rLLM rollout function at workflow.path)
    validation: ValidationSamplingSpec | None = None
    rllm_functions: RolloutFunctions | None = None  # workflow.name=rllm_runner: AsyncAgentTrainer's (api/)


@dataclass(frozen=True)
class TrainerSpec:
    """The trainer rank(s): schedule, old log-probs, the verl actor section, advantages, corrections."""

    model_path: str
    device: str  # trainer.device
    world_size: int  # trainer ranks = trainer.n_gpus_per_node x trainer.nnodes (verl counts devices; one rank each)
    nnodes: int  # trainer.nnodes: one node keeps the ranks' rendezvous on this machine
    seed: int
    use_rollout_log_probs: bool
    compute_prox_log_prob: bool
    temperature: float
    queue_get_timeout_s: float
    enable_gradient_checkpointing: bool  # actor_rollout_ref.model.enable_gradient_checkpointing
    max_response_length: int  # Dr.GRPO's constant normaliser (actor.loss_scale_factor, derived)
    actor: Mapping[str, Any]  # actor_rollout_ref.actor, handed to verl's FSDPActorConfig
    strategy: str  # actor_rollout_ref.actor.strategy: fsdp2 | megatron
    actor_rollout_ref: Mapping[str, Any] | None  # the whole section, for verl's Megatron worker (megatron only)
    advantages: AdvantageConfig
    correction: CorrectionConfig | None
    critic: Mapping[str, Any] | None  # the critic section when algorithm.adv_estimator=gae
    lora: TrainerLoRASpec | None = None  # actor_rollout_ref.model.lora_rank > 0: the policy trains a peft adapter


@dataclass(frozen=True)
class TrainerLoRASpec:
    """The policy trained as a LoRA adapter (verl 0.7.1's actor_rollout_ref.model.lora_* keys), applied with peft's
    get_peft_model as verl's FSDP workers do (backends/fsdp.py); None in TrainerSpec.lora: all weights train."""

    rank: int  # actor_rollout_ref.model.lora_rank
    alpha: float  # actor_rollout_ref.model.lora_alpha
    target_modules: str | tuple[str, ...]  # actor_rollout_ref.model.target_modules: all-linear or module names
    exclude_modules: str | tuple[str, ...] | None  # actor_rollout_ref.model.exclude_modules
    adapter_path: str | None = None  # actor_rollout_ref.model.lora_adapter_path: a saved peft adapter to start from

    def peft_kwargs(self) -> dict[str, Any]:
        """LoraConfig's arguments, as verl 0.7.1's fsdp_workers builds them (task CAUSAL_LM, bias none), and the
        saved adapter to start from (`adapter_path`, when set: backends/fsdp.py loads it instead)."""
        listed = lambda m: m if m is None or isinstance(m, str) else list(m)  # noqa: E731
        kwargs: dict[str, Any] = {
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": listed(self.target_modules),
            "exclude_modules": listed(self.exclude_modules),
            "bias": "none",
        }
        return kwargs if self.adapter_path is None else {**kwargs, "adapter_path": self.adapter_path}


@dataclass(frozen=True)
class EngineLoRASpec:
    """LoRA on the engines (actor_rollout_ref.model.lora_rank > 0): SGLang 0.5.6's LoRA server flags, from
    engines.lora.* with their derived defaults (settings/derive.py); engines/lora.py turns them into flags."""

    max_lora_rank: int  # --max-lora-rank
    target_modules: tuple[str, ...]  # --lora-target-modules (SGLang's names, or ("all",))
    max_loras_per_batch: int  # --max-loras-per-batch
    max_loaded_loras: int | None  # --max-loaded-loras (None: no limit)
    eviction_policy: str  # --lora-eviction-policy (sglang only)
    backend: str  # --lora-backend (sglang only)


@dataclass(frozen=True)
class EnginesSpec:
    """The inference engines and how they are started and supervised."""

    backend: str
    model_path: str
    num_engines: int
    max_running_requests: int
    startup_timeout_s: float
    request_timeout_s: float
    dtype: str
    torch_threads: int
    on_engine_failure: str
    max_restarts: int
    extra_args: Mapping[str, Any]
    tensor_model_parallel_size: int  # sglang only (honoured by engines/)
    gpu_memory_utilization: float  # sglang only
    seed: int
    log_level: str
    sampling_seed: int | None = None  # engines.sampling_seed: per-request seeds (engines/client.py)
    deterministic_inference: bool = False  # engines.deterministic_inference
    lora: EngineLoRASpec | None = None  # LoRA adapters served (actor_rollout_ref.model.lora_rank > 0)
    forward_sleep_s: float = 0.0  # engines.forward_sleep_s: the embedded engine's sleep before every forward pass
    no_engine_timeout_s: float = 600.0  # engines.no_engine_timeout_s: how long generation waits with no engine


@dataclass(frozen=True)
class ParamSyncSpec:
    """How new weights reach the engines."""

    transport: str  # disk | distributed (nccl: its alias; gloo on CPU, NCCL on GPU)
    bucket_mb: float  # distributed: MiB per broadcast
    master_address: str  # distributed: auto | the address engines reach trainer rank 0 at
    weights_dir: str
    timeout_s: float
    dtype: str  # auto (the trainer's parameter dtype: bf16 on GPU) | float32 | bfloat16


@dataclass(frozen=True)
class TaskSpec:
    name: str | None
    seed: int
    cache_dir: str
    warmup_steps: int


@dataclass(frozen=True)
class RunSectionSpec:
    """The run's lifetime, output and reporting."""

    dir: str
    log_level: str
    project_name: str
    experiment_name: str
    loggers: tuple[str, ...]
    total_training_steps: int | None  # None: until trainer.total_epochs of data is used
    test_freq: int  # optimizer steps between validations; <= 0: never
    save_freq: int  # optimizer steps between checkpoints; <= 0: never
    val_before_train: bool
    resume_mode: str
    resume_from_path: str | None
    task: TaskSpec
    rollout_data_dir: str | None = None  # trainer.rollout_data_dir: each step's trajectories as {step}.jsonl
    validation_data_dir: str | None = None  # trainer.validation_data_dir: each validation's episodes
    record_batches: bool = False  # run.record_batches: RUN_DIR/record/ for replay (runtime/trainer/record.py)


@dataclass(frozen=True)
class RunSpec:
    schedule: ScheduleSpec
    executor: ExecutorSpec
    trainer: TrainerSpec
    engines: EnginesSpec
    param_sync: ParamSyncSpec
    run: RunSectionSpec


def build_run_spec(cfg: DictConfig) -> RunSpec:
    """The frozen run spec from a config that `load_config` returned (derived values filled, validated)."""
    at, rollout, actor = cfg.async_training, cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    model_path = str(cfg.actor_rollout_ref.model.path)
    run_seed = int(cfg.run.seed)
    data = data_spec(cfg)
    reward = cfg.reward.custom_reward_function
    legacy = cfg.custom_reward_function  # verl's older top-level spelling, read when the new one is unset
    schedule = ScheduleSpec(
        required_samples=int(at.required_samples),
        trigger_parameter_sync_step=int(at.trigger_parameter_sync_step),
        max_staleness=int(at.max_staleness),
        adaptive=adaptive_staleness_rule(at),
    )
    executor = ExecutorSpec(
        samples_per_prompt=int(rollout.n),
        max_concurrent_rollouts=int(at.max_concurrent_rollouts),
        queue_max_groups=int(at.queue_max_groups),
        partial_rollout=bool(at.partial_rollout),
        sampling=SamplingSpec(
            max_new_tokens=int(cfg.data.max_response_length),
            temperature=float(rollout.temperature),
            top_p=float(rollout.top_p),
            top_k=int(rollout.top_k),
            ignore_eos=bool(rollout.ignore_eos),
        ),
        workflow_name=str(cfg.workflow.name),
        workflow_path=cfg.workflow.path,
        reward_timeout_s=float(cfg.workflow.reward_timeout_s),
        reward_fn_path=reward.path or legacy.path,
        reward_fn_name=(reward.name if reward.path else legacy.name or reward.name) or None,
        group_filter=dataclass_from_config(cfg, "algorithm.group_filter", FilterConfig),
        data=data,
        agent=_agent_spec(cfg),
        rllm_batched=bool(cfg.workflow.rllm_batched),
        validation=validation_sampling_spec(cfg),
    )
    gae = cfg.algorithm.adv_estimator == "gae"
    trainer = TrainerSpec(
        model_path=model_path,
        device=str(cfg.trainer.device),
        world_size=int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes),
        nnodes=int(cfg.trainer.nnodes),
        seed=run_seed,
        use_rollout_log_probs=bool(at.use_rollout_log_probs),
        compute_prox_log_prob=bool(at.compute_prox_log_prob),
        temperature=float(rollout.temperature),
        queue_get_timeout_s=float(at.queue_get_timeout_s),
        enable_gradient_checkpointing=bool(cfg.actor_rollout_ref.model.enable_gradient_checkpointing),
        max_response_length=int(cfg.data.max_response_length),
        actor=_frozen(actor),
        strategy=str(actor.strategy),
        actor_rollout_ref=_frozen(cfg.actor_rollout_ref) if str(actor.strategy) == "megatron" else None,
        advantages=AdvantageConfig.from_config(cfg),
        correction=correction_config_from(cfg),
        critic=_frozen(cfg.critic) if gae else None,
        lora=trainer_lora_spec(cfg),
    )
    engines = engines_spec(cfg)
    param_sync = ParamSyncSpec(
        transport=str(cfg.param_sync.transport),
        bucket_mb=float(cfg.param_sync.bucket_mb),
        master_address=str(cfg.param_sync.master_address),
        weights_dir=str(cfg.param_sync.weights_dir),
        timeout_s=float(cfg.param_sync.timeout_s),
        dtype=str(cfg.param_sync.dtype),
    )
    t = cfg.trainer
    run = RunSectionSpec(
        dir=str(cfg.run.dir),
        log_level=str(cfg.run.log_level),
        project_name=str(t.project_name),
        experiment_name=str(t.experiment_name),
        loggers=tuple(str(x) for x in t.logger),
        total_training_steps=None if t.total_training_steps is None else int(t.total_training_steps),
        test_freq=int(t.test_freq),
        save_freq=int(t.save_freq),
        val_before_train=bool(t.val_before_train),
        resume_mode=str(t.resume_mode),
        resume_from_path=t.resume_from_path,
        task=TaskSpec(
            name=cfg.task.name,
            seed=int(cfg.task.seed),
            cache_dir=str(cfg.task.cache_dir),
            warmup_steps=int(cfg.task.warmup_steps),
        ),
        rollout_data_dir=None if t.rollout_data_dir is None else str(t.rollout_data_dir),
        validation_data_dir=None if t.validation_data_dir is None else str(t.validation_data_dir),
        record_batches=bool(cfg.run.record_batches),
    )
    return RunSpec(
        schedule=schedule, executor=executor, trainer=trainer, engines=engines, param_sync=param_sync, run=run
    )


def adaptive_staleness_rule(at: Any) -> AdaptiveStalenessRule | None:
    """The adaptive rule from `async_training` (checked by settings/validate.py), None when disabled."""
    section = at["adaptive_staleness"]
    fields = {k: section[k] for k in AdaptiveStalenessRule.__dataclass_fields__}
    return AdaptiveStalenessRule(**fields) if section["enable"] else None


def engines_spec(cfg: DictConfig) -> EnginesSpec:
    """The engines part alone: `plan` prints their command lines from it without building the whole spec."""
    e, rollout = cfg.engines, cfg.actor_rollout_ref.rollout
    return EnginesSpec(
        backend=str(e.backend),
        model_path=str(cfg.actor_rollout_ref.model.path),
        num_engines=int(e.num_engines),
        max_running_requests=int(e.max_running_requests),
        startup_timeout_s=float(e.startup_timeout_s),
        request_timeout_s=float(e.request_timeout_s),
        dtype=str(e.dtype),
        torch_threads=int(e.torch_threads),
        on_engine_failure=str(e.on_engine_failure),
        max_restarts=int(e.max_restarts),
        extra_args=_frozen(e.extra_args),
        tensor_model_parallel_size=int(rollout.tensor_model_parallel_size),
        gpu_memory_utilization=float(rollout.gpu_memory_utilization),
        seed=int(cfg.run.seed),
        log_level=str(cfg.run.log_level),
        sampling_seed=None if e.sampling_seed is None else int(e.sampling_seed),
        deterministic_inference=bool(e.deterministic_inference),
        forward_sleep_s=float(e.forward_sleep_s),
        no_engine_timeout_s=float(e.no_engine_timeout_s),
        lora=engine_lora_spec(cfg),
    )


def trainer_lora_spec(cfg: DictConfig) -> TrainerLoRASpec | None:
    """actor_rollout_ref.model.lora_* as the trainer's peft adapter, or None when lora_rank is 0."""
    model = cfg.actor_rollout_ref.model
    if not int(model.get("lora_rank", 0) or 0):
        return None

    def modules(value: Any) -> str | tuple[str, ...] | None:
        return value if value is None or isinstance(value, str) else tuple(str(m) for m in value)

    return TrainerLoRASpec(
        rank=int(model.lora_rank),
        alpha=float(model.lora_alpha),
        target_modules=modules(model.target_modules),
        exclude_modules=modules(model.get("exclude_modules")),
        adapter_path=None if model.get("lora_adapter_path") is None else str(model.lora_adapter_path),
    )


def engine_lora_spec(cfg: DictConfig) -> EngineLoRASpec | None:
    """engines.lora.* once derived (settings/derive.py), or None when the policy is not trained as LoRA."""
    if not int(cfg.actor_rollout_ref.model.get("lora_rank", 0) or 0):
        return None
    lora = cfg.engines.lora
    return EngineLoRASpec(
        max_lora_rank=int(lora.max_lora_rank),
        target_modules=tuple(str(m) for m in lora.target_modules),
        max_loras_per_batch=int(lora.max_loras_per_batch),
        max_loaded_loras=None if lora.max_loaded_loras is None else int(lora.max_loaded_loras),
        eviction_policy=str(lora.eviction_policy),
        backend=str(lora.backend),
    )


def data_spec(cfg: DictConfig) -> DataSpec:
    """The prompt data part alone: the driver reads the data with it at start-up, before the whole spec exists."""
    return DataSpec(
        train_files=_files(cfg.data.train_files),
        val_files=_files(cfg.data.val_files),
        max_prompt_length=int(cfg.data.max_prompt_length),
        overlong="filter"
        if cfg.data.filter_overlong_prompts
        else {"left": "truncate_left", "right": "truncate_right"}.get(str(cfg.data.truncation), "error"),
        seed=int(cfg.data.seed if cfg.data.seed is not None else cfg.run.seed),
        shuffle=bool(cfg.data.shuffle),
        total_epochs=int(cfg.trainer.total_epochs),
        val_size=int(cfg.task.val_size),
        rows=bool(cfg.workflow.rllm_rows),
    )


def _agent_spec(cfg: DictConfig) -> AgentSpec | None:
    if cfg.workflow.path is not None or cfg.workflow.name != "multi_turn":
        return None  # validate() refuses env/tools/layout settings without a multi_turn workflow
    env, tools = cfg.env, cfg.tools
    return AgentSpec(
        env_name=str(env.name),
        env_path=env.path,
        env_kwargs=_frozen(env.kwargs),
        max_turns=int(env.max_turns),
        max_total_tokens=int(env.max_total_tokens),
        step_timeout_s=float(env.step_timeout_s),
        layout=str(cfg.workflow.layout),
        tool_format=str(tools.format),
        tool_timeout_s=float(tools.timeout_s),
        tools=_frozen(tools.functions),
    )


def validation_sampling_spec(cfg: DictConfig) -> ValidationSamplingSpec:
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    return ValidationSamplingSpec(
        n=int(val.n),
        temperature=float(val.temperature) if bool(val.do_sample) else 0.0,
        top_p=float(val.top_p),
        top_k=int(val.top_k),
    )


def _files(value: Any) -> tuple[str, ...]:
    return () if not value else (value,) if isinstance(value, str) else tuple(str(v) for v in value)


def _frozen(section: Any) -> Mapping[str, Any]:
    """A read-only deep copy of a config section (dicts become mappingproxies, lists tuples)."""
    raw = OmegaConf.to_container(section, resolve=True) if isinstance(section, DictConfig) else section
    return _freeze(raw)


def thaw(value: Any) -> Any:
    """A mutable deep copy of a frozen section (mappingproxies become dicts, tuples lists), for code that builds its
    own objects from it (verl's actor and critic configs)."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value
