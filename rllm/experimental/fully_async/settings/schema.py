"""The typed sections this project adds to verl's config, and its fully-async defaults for verl keys.

This is the schema `settings/loader.py` composes on verl's `ppo_trainer` defaults: one dataclass per top-level section
(`PROJECT_SECTIONS`: `async_training`, `engines`, `param_sync`, `task`, `workflow`, `env`, `tools`,
`run`), each field with a
comment on its unit and how to choose it, and `FULLY_ASYNC_VERL_DEFAULTS` for the verl keys whose verl default
does not suit this trainer. Loading, merging, derived values and validation live in `settings/loader.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rllm.experimental.fully_async.core.adaptive_staleness import AdaptiveStalenessRule

_RULE = AdaptiveStalenessRule()  # the adaptive rule's defaults, owned by the rule


@dataclass
class AdaptiveStalenessConfig:
    """η that follows measured off-policyness (the rule and the statistics: core/adaptive_staleness.py). Off by
    default; every other key here is read only with enable=true. η starts at async_training.max_staleness."""

    # Let η move at each weight sync between min and max, by the thresholds below; false: η stays at
    # async_training.max_staleness for the whole run.
    enable: bool = False
    # The lowest η the rule may set (0: synchronous on-policy data whenever the statistics demand it).
    min: int = _RULE.min
    # The highest η the rule may set; also sizes the queue (queue_max_groups null: (max + 2) * R) and, with LoRA,
    # how many adapter versions the engines keep (engines.lora).
    max: int = _RULE.max
    step: int = _RULE.step  # versions added or removed per decision (one decision per weight sync)
    # Syncs in a row with every statistic clear of its threshold (and its margin) before η is raised.
    raise_after: int = _RULE.raise_after
    # η rises only while every statistic is within this fraction of its limit (0.5: kl <= max_kl / 2, ess >=
    # 1 - (1 - min_ess) / 2, ...); between that and the limit η holds. 1: no dead band (η hovers at the limit).
    raise_margin: float = _RULE.raise_margin
    # Thresholds, measured per batch between the behaviour policy and the trainer's weights at the step; one
    # statistic outside lowers η at the next sync. Measured on the embedded default (tests/bench/README.md): early
    # in training at η=2 ess ~0.5, kl ~0.2; after the first 20 steps ess > 0.9, kl < 0.03.
    min_ess: float = _RULE.min_ess  # effective sample size of the token importance weights / tokens
    max_kl: float = _RULE.max_kl  # KL(pi_behav || pi_theta) per token (k3 estimator)
    max_cut: float = _RULE.max_cut  # share of tokens the trust region clipped or masked (PPO clip, m2po or mask)
    # η rises only while the trainer waited for its batches at least this share of its step time (a higher η
    # only buys throughput when the trainer waits for data); 0: raise on the statistics alone.
    raise_when_waiting: float = _RULE.raise_when_waiting


@dataclass
class AsyncTrainingConfig:
    """The fully-async schedule. rLLM / verl fully_async_policy keys are accepted; see `settings/compat.py`."""

    # η: max policy versions (weight syncs, core/versions.py) a trained token may lag the trainer (AReaL's eta).
    # 0 with trigger_parameter_sync_step 1 = synchronous on-policy. The capacity rule lets at most
    # (max_staleness + version + 1) * B groups be started by version `version`, B = required_samples * K.
    # null: derived from rLLM's staleness_threshold (the formula: settings/compat.max_staleness_from_rllm).
    max_staleness: int | None = None
    # rLLM/verl key: extra fraction of samples the rollouter may produce beyond one sync window.
    staleness_threshold: float | None = None
    # K: push weights to the engines (one new policy version) every K optimizer steps (K=1: after every step).
    trigger_parameter_sync_step: int = 1
    # Prompt groups per optimizer step (each group holds actor_rollout_ref.rollout.n samples).
    # null: data.train_batch_size.
    required_samples: int | None = None
    # Resume generations interrupted by a weight update (tokens tagged by version) instead of restarting them.
    partial_rollout: bool = True
    # Old log-probs for the PPO ratio: the engine's rollout log-probs (true) or recomputed by the trainer.
    use_rollout_log_probs: bool = True
    # Recompute proximal log-probs with the trainer's weights before each step (decoupled PPO, AReaL).
    compute_prox_log_prob: bool = False
    # Cap on rollout workflows running at once (across engines). null: 2 * required_samples * rollout.n.
    max_concurrent_rollouts: int | None = None
    # MessageQueue capacity in groups. null: (max_staleness + 2) * required_samples (adaptive: its max for η).
    queue_max_groups: int | None = None
    # Seconds the trainer waits for a batch before failing with a message (never a hang).
    queue_get_timeout_s: float = 600.0
    # η adapted at every weight sync to the batches' measured off-policy statistics (see AdaptiveStalenessConfig).
    adaptive_staleness: AdaptiveStalenessConfig = field(default_factory=AdaptiveStalenessConfig)


@dataclass
class EnginesLoRAConfig:
    """SGLang 0.5.6's LoRA flags for the engines, read only when the policy trains as LoRA
    (actor_rollout_ref.model.lora_rank > 0). Each weight sync loads a new adapter version under its own name and the
    engines keep every version the staleness bound still admits: η_max + 1 of them (η_max: async_training.
    max_staleness, or adaptive_staleness.max), one more while the oldest is being retired. null: derived."""

    # --max-loaded-loras: adapters an engine holds at once; SGLang evicts the least recently used beyond it (the
    # load that evicts waits for the evicted adapter's requests). null: η_max + 2. Must be >= η_max + 1.
    max_loaded_loras: int | None = None
    # --max-loras-per-batch: distinct adapters in one running batch (the base model counts as one); a request whose
    # adapter does not fit waits, and so does the queue behind it. null: η_max + 2. Must be >= η_max + 1.
    max_loras_per_batch: int | None = None
    # --max-lora-rank: the largest adapter rank served. null: actor_rollout_ref.model.lora_rank.
    max_lora_rank: int | None = None
    # --lora-target-modules: SGLang's module names (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
    # qkv_proj gate_up_proj) or [all]. null: from actor_rollout_ref.model.target_modules (all-linear -> [all]).
    target_modules: list[str] | None = None
    # --lora-eviction-policy (sglang only): which GPU buffer slot a newly used adapter overwrites: lru | fifo.
    eviction_policy: str = "lru"
    # --lora-backend (sglang only): the multi-LoRA GPU kernels: csgmv | triton | ascend.
    backend: str = "csgmv"


@dataclass
class EnginesConfig:
    """Inference engines. `embedded` is this project's CPU server; `sglang` needs GPUs."""

    backend: str = "embedded"  # embedded | sglang
    num_engines: int = 2  # engine processes; on CPU keep num_engines + 1 (trainer) <= cores for best speed
    max_running_requests: int = 256  # per engine: requests decoded together in one forward pass at most
    startup_timeout_s: float = 180.0  # wait for /health after launch
    request_timeout_s: float = 300.0  # one /generate call, including time held while paused for a sync
    dtype: str = "float32"  # embedded engine weights dtype on CPU: float32 | bfloat16
    torch_threads: int = 1  # torch intra-op threads per embedded engine process
    # An engine process that dies (engines/supervisor.py): `restart` starts a new one that joins at the trainer's
    # weight version (its requests meanwhile go to the others, or wait for it); `continue` routes its requests to
    # the others and drops it from weight syncs (the run stops when none is left); `stop` ends the run with a
    # checkpoint and an error naming the engine.
    on_engine_failure: str = "restart"
    # Restarts per run, over all engines, failed ones included; then a dying engine is dropped as under
    # `continue`. Bounds a crash loop (an engine that dies at every start would otherwise restart forever).
    max_restarts: int = 3
    # With no inference engine left (the last one removed with `engines remove`, or lost once its restarts are used
    # up) generation pauses, requests waiting for an engine, rather than the run ending: it goes on when one joins
    # (`engines add N`, `engines register URL`) and stops with a checkpoint and one line after this many seconds
    # without one. 0 = stop as soon as the last engine is gone.
    no_engine_timeout_s: float = 600.0
    extra_args: dict[str, Any] = field(default_factory=dict)  # passed through to sglang.launch_server
    # Per-request sampling seeds (SGLang 0.5.6's sampling_params.sampling_seed): null = off (each engine's own
    # generator: tokens depend on arrival order and batch makeup); an integer S = every generation request carries
    # sampling_seed = core/ids.sampling_seed_for(S, request id), the request id being the sample's (e<epoch>/<row>/
    # <index>; /turn<k> for an agent's turns, -c<k> for an rLLM program's calls), so a sample draws the same tokens
    # from the same weights whatever else an engine runs, and a resumed generation continues as it would have.
    # SGLang reads it only with deterministic_inference=true.
    sampling_seed: int | None = None
    # --enable-deterministic-inference on every engine: SGLang's batch-invariant kernels (slower) and seeded sampling;
    # the embedded engine runs one request at a time, so log-probs too are bit-identical whatever the load. Needs
    # sampling_seed (else every sample of a prompt draws with SGLang's default seed 42: n identical samples).
    deterministic_inference: bool = False
    # SGLang's LoRA flags for the engines (EnginesLoRAConfig), read only when actor_rollout_ref.model.lora_rank > 0.
    lora: EnginesLoRAConfig = field(default_factory=EnginesLoRAConfig)
    # Seconds the embedded engine sleeps before every forward pass (SGLang's /slow_down `forward_sleep_time`, set
    # from the start): generation then takes wall time without taking the trainer's CPU, as on a GPU cluster where
    # generation dominates a step. For experiments (a rollout-bound regime on CPU, tests/bench/); 0 = off. The
    # embedded engine's only: on SGLang, POST /slow_down yourself.
    forward_sleep_s: float = 0.0


@dataclass
class ParamSyncConfig:
    """How new weights reach the engines."""

    # disk (HF safetensors folder + /update_weights_from_disk) | distributed (broadcast through SGLang's
    # weight-update group: NCCL on GPU, gloo on CPU) | nccl (alias of distributed, as verl/rLLM users write it)
    transport: str = "disk"
    bucket_mb: float = 256.0  # distributed: MiB per broadcast (one HTTP call + one collective per bucket per sync)
    # distributed: the address engines reach trainer rank 0 at (the weight-update group's store): auto (127.0.0.1
    # when every engine runs on rank 0's node, else that node's IP as Ray knows it) | an IP address or host name
    master_address: str = "auto"
    weights_dir: str | None = None  # shared folder for the disk transport; null: RUN_DIR/weights
    timeout_s: float = 300.0  # each of pause, update and resume, per engine
    # dtype of the weights pushed to engines: auto (bfloat16 when the trainer runs on CUDA, else the trainer's
    # parameter dtype) | float32 | bfloat16. fp32 doubles the bytes written and loaded at every sync.
    dtype: str = "auto"


@dataclass
class TaskConfig:
    """A built-in task that generates its own data and model (the embedded default)."""

    name: str | None = None  # addition | smollm2 | null (null: data.train_files and actor_rollout_ref.model.path)
    seed: int = 0  # data split, model init and warm-up
    cache_dir: str = "~/.cache/rllm_fully_async"  # generated data and warmed-up model, keyed by settings
    warmup_steps: int = 340  # supervised warm-up steps (fixed count: the 20-50% window is seconds wide)
    val_size: int = 1000  # held-out prompts measured for validation accuracy (<= generated split)


@dataclass
class WorkflowConfig:
    """The rollout workflow: `async def run(client, tokenizer, datum, ...) -> VersionedTrajectory` (see workflows/)."""

    # single_turn | multi_turn (an agent in env.*) | with `path`, the object's name | rllm_runner (set by runner.py)
    name: str = "single_turn"
    # A Python file defining `name`: a workflow class, or an rLLM rollout function `async def fn(client, tokenizer,
    # **datum)` (workflows/rllm_compat.py maps it, unchanged).
    path: str | None = None
    # A reward function running longer fails the trajectory; user reward code runs in the worker pool, where a hung
    # call's worker is killed (workers/pool.py).
    reward_timeout_s: float = 30.0
    # multi_turn: per_step (one training row per model turn; what GiGPO needs) | concat (one row per episode,
    # observations masked; cheaper for long episodes, GiGPO then reduces to GRPO). See workflows/multi_turn.py.
    layout: str = "per_step"
    # rLLM rollout functions: pass each datum field wrapped in a 1-element array, as verl's collate does (rLLM's
    # DAPO example indexes kwargs["raw_prompt"][0]). false: plain values.
    rllm_batched: bool = False
    # rLLM rollout functions: the data files hold rLLM dataset rows (rllm.data.DatasetRegistry), each given to the
    # function as it is stored. Set by data.train_dataset_name / val_dataset_name (settings/rllm_yaml.py).
    # false: verl RL-format parquet (prompt, data_source, reward_model), checked and tokenized.
    rllm_rows: bool = False


@dataclass
class EnvConfig:
    """The environment a multi_turn workflow plays (envs/base.py): read only with workflow.name=multi_turn."""

    name: str | None = None  # a built-in (number_line) or, with `path`, the class name in that file
    path: str | None = None  # a Python file or module defining the environment class; null: a built-in
    kwargs: dict[str, Any] = field(default_factory=dict)  # constructor keyword arguments
    max_turns: int = 8  # model turns per episode; then it ends with reason max_turns
    # prompt + every turn + every observation, in tokens; past it the episode ends with reason length. Must fit the
    # engine's context (the model's max_position_embeddings): checked when the rollout service starts.
    max_total_tokens: int = 512
    step_timeout_s: float = 10.0  # one reset/step call; past it the worker is killed and the episode ends (timeout)


@dataclass
class ToolsConfig:
    """Tools a multi_turn agent may call (workflows/tools.py); empty `functions`: no tools."""

    format: str = "hermes"  # hermes (<tool_call>{json}</tool_call>) | compact (name[argument], tiny vocabularies)
    timeout_s: float = 5.0  # one tool call; past it the worker is killed and the episode ends (timeout)
    # tool name -> "module:function" or "/file.py:function"; "calculator" names the built-in calculator
    functions: dict[str, str] = field(default_factory=dict)


@dataclass
class RunConfig:
    """Where the run writes, and how it reports."""

    dir: str | None = None  # RUN_DIR: metrics.jsonl, checkpoints, weights; null: runs/<experiment_name>
    seed: int = 0  # trainer RNG (model init is the model folder's)
    log_level: str = "WARNING"  # for library loggers; the progress line is always printed
    # Keep RUN_DIR/record/: every step's batch as the trainer took it, its policy version and RNG states, so
    # `python -m rllm.experimental.fully_async replay RUN_DIR` can re-run the training and check it bit for bit
    # (runtime/trainer/record.py; ~140 KB a step on the embedded default). Safe to turn on or off at a resume.
    record_batches: bool = False


PROJECT_SECTIONS: dict[str, type] = {
    "async_training": AsyncTrainingConfig,
    "engines": EnginesConfig,
    "param_sync": ParamSyncConfig,
    "task": TaskConfig,
    "workflow": WorkflowConfig,
    "env": EnvConfig,
    "tools": ToolsConfig,
    "run": RunConfig,
}

# Fully-async defaults for verl keys: what a CPU user would otherwise have to override every time.
FULLY_ASYNC_VERL_DEFAULTS: dict[str, Any] = {
    "actor_rollout_ref": {
        # The engines are standalone servers that always return log-probs (verl: hybrid_engine=true, false).
        "hybrid_engine": False,
        "rollout": {"name": "embedded", "n": 8, "calculate_log_probs": True},
        "actor": {
            "strategy": "fsdp2",  # the backend shards with FSDP2's fully_shard (backends/fsdp.py)
            "use_torch_compile": False,  # no compile on CPU and for tiny models
            "fsdp_config": {"use_torch_compile": False},
            "ppo_micro_batch_size_per_gpu": 64,
        },
        "model": {"use_remove_padding": False, "enable_gradient_checkpointing": False},
    },
    "algorithm": {
        "adv_estimator": "grpo",
        # This project's algorithm sections (algorithms/): null = off. Their fields are the dataclasses'
        # (CorrectionConfig, FilterConfig, GiGPOConfig) and are checked by building them in validate().
        # {mode: decoupled|m2po|tis|bypass|none, prox_log_probs, level, cap_mode, cap, prox_lag, tau, m2_threshold,
        # control_prox}
        "off_policy_correction": None,
        "group_filter": None,  # {drop_zero_variance, max_response_length, drop_truncated, length_scope, ...}
        "gigpo": None,  # {omega, step_gamma, step_norm_by_std, epsilon}
        "singleton_group_advantage": "zero",  # zero | verl (verl gives a group of one its raw reward)
    },
    "trainer": {"logger": ["console"], "val_before_train": True, "device": "cpu", "n_gpus_per_node": 1},
    # Used only with algorithm.adv_estimator=gae. verl's micro-batch resolves to null, which the critic refuses.
    "critic": {
        "strategy": "fsdp2",  # as the actor (backends/critic.py shards like backends/fsdp.py)
        "ppo_micro_batch_size_per_gpu": 64,
        "model": {"enable_gradient_checkpointing": False, "use_remove_padding": False},
    },
}
