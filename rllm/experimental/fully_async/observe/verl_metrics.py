"""verl's metric names for a trained batch, logged beside this project's so a verl user's dashboards carry over.

verl's `RayPPOTrainer` logs `compute_data_metrics` (`critic/score/*`, `critic/rewards/*`, `critic/advantages/*`,
`critic/returns/*`, `critic/values/*` with a critic, `response_length/*`, `response_length_non_aborted/*`,
`response/aborted_ratio`, `prompt_length/*`), `compute_timing_metrics` (`timing_s/<stage>`,
`timing_per_token_ms/<stage>`), `compute_throughout_metrics` (`perf/total_num_tokens`, `perf/time_per_step`,
`perf/throughput`) and `training/global_step`. `verl_named_metrics` calls those same functions on the trainer's
batch, with two corrections this trainer's batch layout needs:
- the batch is padded to its own longest response and prompt, not to `data.max_response_length` /
  `data.max_prompt_length` as verl's is, so verl's `*/clip_ratio` (length == padded width) would count the longest
  response as clipped every step; they are recomputed against the configured limits;
- verl's stages map onto this trainer's timings: `gen` = `timing/wait_batch_s` (the trainer's wait for a batch: all
  of generation in a synchronous run, only what async did not hide otherwise), `adv` = `timing/advantages_s` (with
  the old log-probs), `update_actor` = `timing/update_s` (with the critic's update under GAE), `update_weights` =
  `timing/sync_s`, `step` = `timing/step_s`.
The README's "Metric names" table lists this project's names beside verl's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from verl import DataProto
from verl.trainer.ppo.metric_utils import (
    compute_data_metrics,
    compute_throughout_metrics,
    compute_timing_metrics,
)

logger = logging.getLogger(__name__)

# verl stage -> this trainer's timing metric (module docstring).
VERL_STAGES: dict[str, str] = {
    "gen": "timing/wait_batch_s",
    "adv": "timing/advantages_s",
    "update_actor": "timing/update_s",
    "update_weights": "timing/sync_s",
    "step": "timing/step_s",
}


def _clip_ratio(lengths: torch.Tensor, limit: int | None) -> float | None:
    if limit is None or lengths.numel() == 0:
        return None
    return float((lengths >= limit).float().mean().item())


def verl_named_metrics(
    data: Any,
    metrics: Mapping[str, float],
    *,
    max_response_length: int | None,
    max_prompt_length: int | None,
    use_critic: bool,
    n_gpus: int = 1,
) -> dict[str, float]:
    """verl's names for one trained batch (`data`: the DataProto after advantages, `metrics`: this step's metrics
    with its `timing/*`). A batch verl's functions cannot take (every response empty) gives {} and a debug line."""

    batch = data.batch
    tensors = {k: batch[k] for k in ("responses", "attention_mask", "response_mask", "advantages", "returns")}
    # verl adds the KL penalty to the scores to make `token_level_rewards`; this trainer never does (a KL penalty
    # in the reward is refused by settings/verl_keys.py), so the scores are the rewards.
    tensors["token_level_scores"] = tensors["token_level_rewards"] = batch["token_level_rewards"]
    if use_critic:
        tensors["values"] = batch["values"]
    attention = batch["attention_mask"]
    view = DataProto.from_dict(tensors=tensors, meta_info={"global_token_num": attention.sum(-1).tolist()})
    try:
        out = dict(compute_data_metrics(view, use_critic=use_critic))
    except ValueError as exc:  # verl raises when every response is empty ("All samples are aborted")
        logger.debug("verl's data metrics skipped this step: %s", exc)
        return {}
    width = batch["responses"].shape[-1]
    response_lengths = attention[:, -width:].sum(-1)
    prompt_lengths = attention[:, :-width].sum(-1)
    fixes = {
        "response_length/clip_ratio": _clip_ratio(response_lengths, max_response_length),
        "response_length_non_aborted/clip_ratio": _clip_ratio(
            response_lengths[response_lengths > 0], max_response_length
        ),
        "prompt_length/clip_ratio": _clip_ratio(prompt_lengths, max_prompt_length),
    }
    for key, value in fixes.items():
        if value is None:
            out.pop(key, None)  # no configured limit: verl's figure would be meaningless here
        else:
            out[key] = value
    timing = {stage: float(metrics[key]) for stage, key in VERL_STAGES.items() if key in metrics}
    out.update(compute_timing_metrics(view, timing))
    if "step" in timing and timing["step"] > 0:
        out.update(compute_throughout_metrics(view, timing, n_gpus=max(1, n_gpus)))
    if "trainer/step" in metrics:
        out["training/global_step"] = float(metrics["trainer/step"])
    return {k: float(v) for k, v in out.items()}
