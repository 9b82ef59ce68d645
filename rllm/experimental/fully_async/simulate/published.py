"""Predict a published async-vs-colocated speedup from the colocated run's step components.

The scenario's `published:` block (see config/simulate/verl_dapo_qwen25_math_7b.yaml):

    source: where the figures come from
    sync_prompts_per_step: prompts one colocated step trains (its "step" in the table)
    async_old_log_prob: false      # whether the async trainer also recomputes old log-probs
    rows:
      - gpus: 32                   # colocated: engines and trainer share all of them, in turn
        generation_s: 357.41       # per colocated step
        old_log_prob_s: 107.71
        update_s: 313.81
        step_s: 790.10             # the rest (reward, bookkeeping) = step_s - the three above
        rollout_gpus: 16           # the async run's split
        trainer_gpus: 16
        speedup: 2.66              # published: colocated wall / async wall, same prompts
    variants:                      # optional: each row predicted again with these simulate settings
      - name: separated_speedup=2.0 max_staleness=1
        simulate: {trainer: {separated_speedup: 2.0}, pipeline: {max_staleness: 1}}

Per row, with the scenario's simulate block for everything else (lengths, engine curve shape, sync cost):
1. colocated synchronous (η = 0, K = 1, R = sync_prompts_per_step, engines on all `gpus`): the trainer's
   per-token cost is set so that old-log-prob + update take what was published at the mean batch size, the rest
   is its fixed cost; the engines' peak tokens/s is fitted (`calibrate.fit_generation`) so the
   simulated generation (the trainer's wait) takes `generation_s`;
2. fully async with the scenario's pipeline on `rollout_gpus` engines' worth of GPUs, trainer step times scaled
   from `gpus` to `trainer_gpus` (model.TrainerModel: per-GPU scaling, `separated_speedup`);
3. speedup = colocated time per prompt / async time per prompt, both in steady state (the first sync windows,
   while the async pipeline fills, are left out: over a 400-step run they weigh little).
A variant changes only the async side (step 2) on the same fitted engines and trainer: its settings are merged onto
the scenario's simulate block, so "the colocated components alone" and "with the stated factor" come from one fit.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rllm.experimental.fully_async.simulate.calibrate import fit_generation
from rllm.experimental.fully_async.simulate.engine import simulate
from rllm.experimental.fully_async.simulate.layout import synchronous, with_gpus
from rllm.experimental.fully_async.simulate.model import SimConfig
from rllm.experimental.fully_async.simulate.result import SimResult
from rllm.experimental.fully_async.simulate.scenarios import ScenarioError, build_config

ROW_KEYS = frozenset(
    {"gpus", "generation_s", "old_log_prob_s", "update_s", "step_s", "rollout_gpus", "trainer_gpus", "speedup"}
)
BLOCK_KEYS = frozenset({"source", "sync_prompts_per_step", "async_old_log_prob", "rows", "variants"})
VARIANT_KEYS = frozenset({"name", "simulate"})


@dataclass(frozen=True)
class RowPrediction:
    gpus: int
    rollout_gpus: int
    trainer_gpus: int
    published: float
    predicted: float
    sync_s_per_prompt: float
    async_s_per_prompt: float
    peak_tokens_per_s: float  # fitted, per engine
    async_result: SimResult
    variants: tuple[tuple[str, float], ...] = ()  # (variant name, predicted speedup), in the block's order

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1.0


def mean_clipped_length(cfg: SimConfig) -> float:
    return cfg.lengths.mean_after_clip(seed=cfg.seed + 1)


def steady_s_per_step(result: SimResult, skip_steps: int) -> float:
    ends = result.step_end_s
    skip = min(skip_steps, len(ends) - 1)
    return (ends[-1] - ends[skip - 1]) / (len(ends) - skip) if skip > 0 else ends[-1] / len(ends)


def predict_row(
    cfg: SimConfig,
    block: Mapping[str, Any],
    row: Mapping[str, Any],
    variants: Sequence[tuple[str, SimConfig]] = (),
) -> RowPrediction:
    unknown = sorted(set(row) - ROW_KEYS)
    if unknown:
        raise ScenarioError(f"published.rows: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(ROW_KEYS))})")
    gpus, prompts = int(row["gpus"]), int(block["sync_prompts_per_step"])
    # 1. colocated synchronous, fitted to the published components
    sync = synchronous(cfg)
    sync.pipeline.required_samples = prompts
    sync.pipeline.max_concurrent_rollouts = None
    sync.steps = 3
    sync = with_gpus(sync, gpus, gpus, separated=False)
    tokens = prompts * cfg.pipeline.samples_per_prompt * mean_clipped_length(cfg)
    compute_s = float(row["old_log_prob_s"]) + float(row["update_s"])
    sync.trainer.reference_gpus = gpus
    sync.trainer.per_token_s = compute_s / tokens
    sync.trainer.fixed_s = max(0.0, float(row["step_s"]) - float(row["generation_s"]) - compute_s)
    guess = tokens / sync.pipeline.num_engines / float(row["generation_s"])
    sync = fit_generation(sync, 2 * float(row["generation_s"]), start=guess, bracket=(guess / 2, guess * 256)).cfg
    sync_result = simulate(sync)
    sync_s_per_prompt = steady_s_per_step(sync_result, 1) / prompts
    # 2. fully async on the published split, same engines per GPU, trainer scaled
    rollout_gpus, trainer_gpus = int(row["rollout_gpus"]), int(row["trainer_gpus"])

    def fully_async(variant: SimConfig) -> tuple[float, SimResult]:
        fast = copy.deepcopy(variant)
        fast.engine = copy.deepcopy(sync.engine)
        fast.trainer = copy.deepcopy(sync.trainer)
        fast.trainer.separated_speedup = variant.trainer.separated_speedup
        fast.trainer.scaling_exponent = variant.trainer.scaling_exponent
        if not block.get("async_old_log_prob", False):
            fast.trainer.per_token_s = float(row["update_s"]) / tokens
        fast = with_gpus(fast, rollout_gpus, trainer_gpus, separated=True)
        result = simulate(fast)
        warmup = 2 * fast.pipeline.trigger_parameter_sync_step
        return steady_s_per_step(result, warmup) / fast.pipeline.required_samples, result

    async_s_per_prompt, async_result = fully_async(cfg)
    predicted_variants = tuple((name, sync_s_per_prompt / fully_async(v)[0]) for name, v in variants)
    return RowPrediction(
        gpus=gpus,
        rollout_gpus=rollout_gpus,
        trainer_gpus=trainer_gpus,
        published=float(row["speedup"]),
        predicted=sync_s_per_prompt / async_s_per_prompt,
        sync_s_per_prompt=sync_s_per_prompt,
        async_s_per_prompt=async_s_per_prompt,
        peak_tokens_per_s=sync.engine.peak_tokens_per_s,
        async_result=async_result,
        variants=predicted_variants,
    )


def predict_published(cfg: SimConfig, block: Mapping[str, Any]) -> list[RowPrediction]:
    unknown = sorted(set(block) - BLOCK_KEYS)
    if unknown:
        raise ScenarioError(f"published: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(BLOCK_KEYS))})")
    if "sync_prompts_per_step" not in block or not block.get("rows"):
        raise ScenarioError("published: needs sync_prompts_per_step and at least one entry in rows")
    variants = []
    for variant in block.get("variants") or []:
        unknown = sorted(set(variant) - VARIANT_KEYS)
        if unknown or "name" not in variant:
            raise ScenarioError(f"published.variants: each entry is {{name, simulate}}, got {dict(variant)!r}")
        variants.append((str(variant["name"]), build_config(cfg, [dict(variant.get("simulate") or {})])))
    return [predict_row(cfg, block, row, variants) for row in block["rows"]]
