"""Timing and length models of the simulator, and the typed settings of one simulation.

Pure (no I/O). Units: seconds, tokens, groups (one prompt's n samples, as in `core/staleness.py`), samples.

Models, each written once here:
- engine decoding (continuous batching): with r requests running on an engine, it produces

      throughput(r) = peak · r / (r + r½),   r½ = peak / single − 1

  tokens/s in total, i.e. each request advances at throughput(r) / r tokens/s. `single` is the one-request decode
  speed (memory-bandwidth bound), `peak` the saturated rate (compute bound); the hyperbola is the usual roofline
  interpolation between them. At most `max_running_requests` requests decode at once per engine; more wait (FIFO).
- response lengths: log-normal with the given mean and log-space sigma, rounded, clipped to [1, max_tokens]
  (response length distributions of reasoning models are heavy-tailed; sigma sets how heavy).
- trainer step: fixed_s + per_token_s · tokens (a forward+backward over the batch is linear in its tokens).
- weight sync: the trainer is busy `total_s`; engines are paused `pause_s` of it (pause_s ≤ total_s); `nbytes` is
  what one sync moves (`ModelShape.sync_bytes`: every weight, or with LoRA the adapter alone: rank · (in + out)
  per wrapped linear layer, which is why a LoRA sync is small and needs no pause).
- host sharing (`host.cores` set: engines and trainer on the same cores, as in a CPU run): processor sharing.
  With the trainer training (demand d_t), b engines decoding (demand d_e each) and other jobs keeping
  `background` cores busy (null: 0), every busy component runs at

      speed = min(1, cores / (background + d_t · [trainer training] + d_e · b))

  of its uncontended rate (engine tokens/s, trainer step work), re-evaluated whenever one of them starts or
  stops; `host.cores` null (the default, as on GPUs): speed = 1, each component has hardware of its own.
  Weight syncs are not slowed (their times are measured as a whole, engines paused).
- off-policy statistics (`adaptive`, for adaptive staleness: the simulator has no policy to measure): a batch whose
  groups are s̄ versions stale on average has

      kl = kl_per_version · s̄,   ess = exp(−2 · kl),   cut = min(1, cut_per_version · s̄)

  (log-normal importance weights w: KL(pi_behav || pi_theta) = σ²/2 and ESS/N = 1/E[w²] = exp(−σ²)); the runtime's
  rule (`core/adaptive_staleness.StalenessController`) reads them exactly as it reads the trainer's measurements.
- an engine schedule (`engine_schedule`: [[time_s, engines], ...], a what-if of elastic rollout capacity, the
  runtime's `engines add/remove`): at each time the engine count becomes the given one. A joining engine takes work
  `engine.join_s` later (its start-up and weight load), at the version the others hold; a leaving engine (the last
  joined first) stops taking work and its samples in flight, running or waiting, move to the engines left (the
  fewest requests first), with partial rollout from their tokens (token-level resume: nothing regenerated, their
  tokens keep their versions), without it from their prompts (their tokens so far are regenerated and counted).
  With no engine, generation pauses: samples wait for one to join, and after `pipeline.no_engine_timeout_s` without
  one the run stops (null: it waits for the schedule's next join; a schedule ending at 0 needs the timeout). The
  concurrency cap (`pipeline.max_concurrent_rollouts`) stays as configured, as the runtime keeps it.
GPU scaling (for `--gpus`): engine throughput scales with rollout GPUs (engines = rollout GPUs / gpus_per_engine);
trainer time scales as (reference_gpus / T) ** scaling_exponent, divided by `separated_speedup` when the trainer
has GPUs of its own (see the verl scenario for why that factor exists).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rllm.experimental.fully_async.core.adaptive_staleness import AdaptiveStalenessRule, OffPolicySignals

_RULE = AdaptiveStalenessRule()  # the rule's defaults, defined once there


@dataclass
class EngineModel:
    peak_tokens_per_s: float = 20000.0  # one engine, saturated batch (sum over its running requests)
    single_tokens_per_s: float = 200.0  # one engine, one running request
    max_running_requests: int = 256  # per engine: decoded together at most (SGLang --max-running-requests)
    gpus_per_engine: int = 1  # tensor-parallel size: rollout GPUs / gpus_per_engine = engines (--gpus sweeps)
    join_s: float = 0.0  # engine_schedule: from a join to the engine's first request (start-up, weight load)

    def per_request_rate(self, running: int) -> float:
        """Tokens/s each of `running` requests advances at: throughput(r) / r = peak / (r + r½)."""
        if running <= 0:
            return 0.0
        r_half = max(self.peak_tokens_per_s / self.single_tokens_per_s - 1.0, 0.0)
        return self.peak_tokens_per_s / (running + r_half)


@dataclass
class LengthModel:
    mean_tokens: float = 512.0  # mean response length before clipping
    sigma: float = 0.6  # log-space standard deviation; 0 = every response has mean_tokens
    max_tokens: int | None = None  # data.max_response_length; null: no clip

    def sample(self, rng: random.Random) -> int:
        return self.sampler()(rng)

    def mean_after_clip(self, seed: int = 0, draws: int = 20000) -> float:
        """The mean length the simulator draws, after the rounding and the clip (sampled with `seed`)."""
        rng, sample = random.Random(seed), self.sampler()
        return sum(sample(rng) for _ in range(draws)) / draws

    def sampler(self) -> Callable[[random.Random], int]:
        """`sample` with the constants worked out once (a simulation draws one length per sample)."""
        sigma, cap = self.sigma, self.max_tokens
        fixed = max(1, round(self.mean_tokens))
        mu = math.log(self.mean_tokens) - sigma**2 / 2  # so that E[exp(N(mu, sigma))] = mean_tokens
        exp, gauss = math.exp, random.Random.gauss

        def draw(rng: random.Random) -> int:
            length = fixed if sigma <= 0 else max(1, round(exp(gauss(rng, mu, sigma))))
            return min(length, cap) if cap else length

        return draw


@dataclass
class TrainerModel:
    fixed_s: float = 0.0  # per optimizer step, independent of the batch (optimizer step, bookkeeping)
    per_token_s: float = 1e-4  # per trained response token (old log-prob + update, at reference_gpus)
    reference_gpus: int = 1  # the GPU count the two figures above were measured on
    scaling_exponent: float = 1.0  # step time ∝ (reference_gpus / T) ** this; 1 = linear per-GPU scaling
    separated_speedup: float = 1.0  # step time divisor when the trainer owns its GPUs (no colocated engine)

    def step_s(self, tokens: int, gpus: int | None = None, separated: bool = False) -> float:
        scale = (self.reference_gpus / gpus) ** self.scaling_exponent if gpus else 1.0
        speedup = self.separated_speedup if separated else 1.0
        return (self.fixed_s + self.per_token_s * tokens) * scale / speedup


@dataclass
class SyncModel:
    total_s: float = 0.0  # the trainer's time for one weight sync (write, push, engines' update)
    pause_s: float = 0.0  # the part of it during which engines decode nothing (<= total_s)
    nbytes: float = 0.0  # bytes one sync moves (ModelShape.sync_bytes); 0: not known


# The linear layers of a decoder layer LoRA can wrap (SGLang 0.5.6's --lora-target-modules names; `all`: each).
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """A Llama/Qwen2-style decoder's sizes (its HF config.json names), for the bytes a weight sync moves."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False
    head_dim: int | None = None  # null: hidden_size / num_attention_heads
    attention_bias: bool = True  # q, k and v projections with a bias (Qwen2's; Llama's config says false)

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelShape:
        """From a parsed config.json (`attention_bias` absent: Qwen2's bias, as its modelling code has it)."""
        return cls(
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=int(config["num_attention_heads"]),
            num_key_value_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
            vocab_size=int(config["vocab_size"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            head_dim=config.get("head_dim"),
            attention_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
        )

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        d = self.head_dim or h // self.num_attention_heads
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def parameters(self) -> int:
        """Every parameter: the layers' linears, q/k/v biases and two norms, the embedding, the head unless tied,
        the final norm."""
        shapes = self.linear_shapes()
        bias = sum(shapes[m][1] for m in ("q_proj", "k_proj", "v_proj")) if self.attention_bias else 0
        layer = sum(a * b for a, b in shapes.values()) + bias + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embeddings + self.hidden_size

    def lora_parameters(self, rank: int, targets: tuple[str, ...] = ("all",)) -> int:
        """A LoRA adapter's parameters: A (rank x in) and B (out x rank) for each wrapped linear of every layer."""
        shapes = self.linear_shapes()
        wrapped = LORA_MODULES if "all" in targets else targets
        unknown = sorted(set(wrapped) - set(shapes))
        if unknown:
            raise ValueError(f"LoRA target modules {unknown}: use {', '.join(LORA_MODULES)} or all")
        return self.num_hidden_layers * sum(rank * (shapes[m][0] + shapes[m][1]) for m in wrapped)

    def sync_bytes(self, dtype_bytes: int, lora_rank: int = 0, targets: tuple[str, ...] = ("all",)) -> int:
        """What one weight sync moves: every weight, or with `lora_rank` > 0 the adapter alone."""
        count = self.lora_parameters(lora_rank, targets) if lora_rank > 0 else self.parameters()
        return count * dtype_bytes


@dataclass
class HostModel:
    """Cores shared by engines and trainer (see the module docstring); the demands are in cores."""

    cores: float | None = None  # null: engines and trainer on separate hardware (no sharing)
    trainer_demand: float = 1.0  # cores the trainer keeps busy while it trains (1 torch thread: 1)
    engine_demand: float = 1.0  # cores one decoding engine keeps busy (engines.torch_threads)
    background: float | None = None  # cores other jobs keep busy throughout; null: 0, or fitted by `--from`

    def speed(self, trainer_busy: bool, busy_engines: int) -> float:
        """The processor-sharing factor every busy component runs at."""
        if self.cores is None:
            return 1.0
        demand = (self.background or 0.0) + self.trainer_demand * trainer_busy + self.engine_demand * busy_engines
        return min(1.0, self.cores / demand) if demand > 0 else 1.0


@dataclass
class Pipeline:
    """The scheduling settings, in the runtime's units (what a project config's `async_training` resolves to)."""

    required_samples: int = 64  # R: groups per optimizer step
    samples_per_prompt: int = 8  # n: samples per group
    max_staleness: int = 1  # η, in policy versions (one version per weight sync: core/versions.py)
    trigger_parameter_sync_step: int = 1  # K: optimizer steps per weight sync
    partial_rollout: bool = True  # True: a sync pauses running generations, they resume with the new weights
    max_concurrent_rollouts: int | None = None  # samples running at once over all engines; null: no cap
    queue_max_groups: int | None = None  # finished groups the queue holds; null: no cap
    num_engines: int = 2
    reject_fraction: float = 0.0  # groups the workflow/filter rejects at finish (e.g. DAPO's zero-variance)
    no_engine_timeout_s: float | None = None  # engine_schedule at 0 engines: the run stops after this; null: waits


@dataclass
class AdaptiveModel:
    """Adaptive staleness in the simulation: the runtime's rule (its keys as async_training.adaptive_staleness) and
    the modelled statistics it reads (module docstring). η starts at pipeline.max_staleness."""

    enable: bool = False
    min: int = _RULE.min
    max: int = _RULE.max
    step: int = _RULE.step
    raise_after: int = _RULE.raise_after
    raise_margin: float = _RULE.raise_margin
    min_ess: float = _RULE.min_ess
    max_kl: float = _RULE.max_kl
    max_cut: float = _RULE.max_cut
    raise_when_waiting: float = _RULE.raise_when_waiting
    kl_per_version: float = 0.005  # modelled KL(pi_behav || pi_theta) per token per version of staleness
    cut_per_version: float = 0.003  # modelled share of tokens clipped or masked per version of staleness

    def rule(self) -> AdaptiveStalenessRule:
        return AdaptiveStalenessRule(**{k: getattr(self, k) for k in AdaptiveStalenessRule.__dataclass_fields__})

    def signals(self, mean_staleness: float) -> OffPolicySignals:
        kl = self.kl_per_version * mean_staleness
        return OffPolicySignals(ess=math.exp(-2.0 * kl), kl=kl, cut=min(1.0, self.cut_per_version * mean_staleness))


@dataclass
class SimConfig:
    """One simulation: the pipeline, the models, how long, and the seed."""

    pipeline: Pipeline = field(default_factory=Pipeline)
    engine: EngineModel = field(default_factory=EngineModel)
    lengths: LengthModel = field(default_factory=LengthModel)
    trainer: TrainerModel = field(default_factory=TrainerModel)
    sync: SyncModel = field(default_factory=SyncModel)
    host: HostModel = field(default_factory=HostModel)
    adaptive: AdaptiveModel = field(default_factory=AdaptiveModel)
    steps: int = 20  # optimizer steps to simulate
    seed: int = 0
    async_staleness: int = 2  # η of the fully-async row the CLI prints when the config itself is synchronous (η=0)
    trainer_gpus: int | None = None  # null: trainer step times as given (no GPU scaling)
    separated: bool = False  # trainer on GPUs of its own (applies trainer.separated_speedup)
    engine_schedule: list[Any] = field(default_factory=list)  # [[time_s, engines], ...]: the count from each time on

    def schedule(self) -> list[tuple[float, int]]:
        """`engine_schedule` as checked (time, engine count) pairs, in time order."""
        return check_schedule(self.engine_schedule, self.pipeline.num_engines, self.pipeline.no_engine_timeout_s)


SCHEDULE_EXAMPLE = "e.g. simulate.engine_schedule=[[0,4],[600,8],[1800,2]]"


def schedule_entries(schedule: Sequence[Any]) -> list[tuple[float, int]]:
    """The schedule's (time, count) pairs, or ValueError with one line naming the first bad entry: each entry is
    [time_s, engines] with time >= 0 and strictly later than the one before, and a whole count >= 0."""
    out: list[tuple[float, int]] = []
    for i, entry in enumerate(schedule):
        where = f"engine_schedule[{i}]"
        if not isinstance(entry, Sequence) or isinstance(entry, str) or len(entry) != 2:
            raise ValueError(f"{where} = {entry!r}: each entry is [time_s, engines], {SCHEDULE_EXAMPLE}")
        at, count = entry
        if not _is_real(at) or not math.isfinite(at) or at < 0:
            raise ValueError(f"{where}: time {at!r} must be a number of seconds >= 0")
        if out and at <= out[-1][0]:
            raise ValueError(
                f"{where}: time {at:g}s is not after the entry before it ({out[-1][0]:g}s): times increase"
            )
        if not _is_real(count) or count != int(count) or count < 0:
            raise ValueError(f"{where}: engine count {count!r} must be a whole number >= 0")
        out.append((float(at), int(count)))
    return out


def check_schedule(schedule: Sequence[Any], start: int, timeout_s: float | None) -> list[tuple[float, int]]:
    """`schedule_entries`, and what the rest of the config decides: the count at 0 s is the run's own starting
    count (one owner: the layout, or pipeline.num_engines), and a schedule ending at 0 engines needs
    `pipeline.no_engine_timeout_s` (else the simulated run would wait for an engine forever)."""
    out = schedule_entries(schedule)
    if out and out[0][0] == 0 and out[0][1] != start:
        raise ValueError(
            f"engine_schedule[0]: {out[0][1]} engines at 0s, but the run starts with {start} (engines.num_engines, "
            "or simulate.pipeline.num_engines for a scenario): set that, or start the schedule after 0s"
        )
    if out and out[-1][1] == 0 and timeout_s is None:
        raise ValueError(
            f"engine_schedule ends at 0 engines ({out[-1][0]:g}s) and pipeline.no_engine_timeout_s is null: the run "
            "would wait for an engine forever; set simulate.pipeline.no_engine_timeout_s or end with an engine"
        )
    return out


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check(cfg: SimConfig) -> None:
    """Reject impossible settings with one line naming the key (ValueError)."""
    p, e = cfg.pipeline, cfg.engine
    rules = [
        (p.required_samples >= 1, "pipeline.required_samples must be >= 1"),
        (p.samples_per_prompt >= 1, "pipeline.samples_per_prompt must be >= 1"),
        (p.max_staleness >= 0, "pipeline.max_staleness must be >= 0"),
        (p.trigger_parameter_sync_step >= 1, "pipeline.trigger_parameter_sync_step must be >= 1"),
        (p.num_engines >= 1, "pipeline.num_engines must be >= 1"),
        (e.join_s >= 0, "engine.join_s must be >= 0"),
        (
            p.no_engine_timeout_s is None or p.no_engine_timeout_s >= 0,
            "pipeline.no_engine_timeout_s must be >= 0 (or null: wait for the schedule's next join)",
        ),
        (0.0 <= p.reject_fraction < 1.0, "pipeline.reject_fraction must be in [0, 1)"),
        (
            p.max_concurrent_rollouts is None or p.max_concurrent_rollouts >= p.samples_per_prompt,
            "pipeline.max_concurrent_rollouts must be >= samples_per_prompt (one group must fit)",
        ),
        (
            p.queue_max_groups is None or p.queue_max_groups >= p.required_samples,
            "pipeline.queue_max_groups must be >= required_samples",
        ),
        (e.peak_tokens_per_s > 0 and e.single_tokens_per_s > 0, "engine.*_tokens_per_s must be > 0"),
        (e.single_tokens_per_s <= e.peak_tokens_per_s, "engine.single_tokens_per_s must be <= peak_tokens_per_s"),
        (e.max_running_requests >= 1, "engine.max_running_requests must be >= 1"),
        (cfg.lengths.mean_tokens >= 1 and cfg.lengths.sigma >= 0, "lengths.mean_tokens >= 1 and sigma >= 0"),
        (cfg.trainer.fixed_s >= 0 and cfg.trainer.per_token_s >= 0, "trainer times must be >= 0"),
        (0 <= cfg.sync.pause_s <= cfg.sync.total_s, "sync.pause_s must be in [0, sync.total_s]"),
        (cfg.host.cores is None or cfg.host.cores > 0, "host.cores must be > 0 (or null: no sharing)"),
        (
            min(cfg.host.trainer_demand, cfg.host.engine_demand) > 0 and (cfg.host.background or 0.0) >= 0,
            "host.trainer_demand and host.engine_demand must be > 0, host.background >= 0",
        ),
        (cfg.steps >= 1, "steps must be >= 1"),
        (
            min(cfg.adaptive.kl_per_version, cfg.adaptive.cut_per_version) >= 0,
            "adaptive.kl_per_version and cut_per_version must be >= 0",
        ),
        (cfg.async_staleness >= 1, "async_staleness must be >= 1"),
    ]
    for ok, message in rules:
        if not ok:
            raise ValueError(message)
    cfg.schedule()  # its own checks, naming the entry
    if cfg.adaptive.enable:
        rule = cfg.adaptive.rule()  # its own checks, with the key in the message
        if not rule.min <= p.max_staleness <= rule.max:
            raise ValueError(f"pipeline.max_staleness ({p.max_staleness}) must be within adaptive [min, max]")
