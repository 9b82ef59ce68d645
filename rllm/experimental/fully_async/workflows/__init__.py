"""Rollout workflows: `async run(client, tokenizer, datum, sample_index) -> Trajectory`, chosen by config."""

from __future__ import annotations

from typing import Any

from rllm.experimental.fully_async.workflows.base import Workflow, load_reward_fn, score_safely
from rllm.experimental.fully_async.workflows.multi_turn import MultiTurnWorkflow
from rllm.experimental.fully_async.workflows.single_turn import SingleTurnWorkflow

__all__ = ["MultiTurnWorkflow", "SingleTurnWorkflow", "Workflow", "build_workflow", "load_reward_fn", "score_safely"]


def build_workflow(cfg: Any, reward_fn: Any) -> Workflow:
    """The workflow `cfg.workflow` names, with sampling settings from verl's rollout section."""
    rollout = cfg.actor_rollout_ref.rollout
    sampling_params = {
        "max_new_tokens": int(cfg.data.max_response_length),
        "temperature": float(rollout.temperature),
        "top_p": float(rollout.top_p),
        "top_k": int(rollout.top_k),
        "ignore_eos": bool(rollout.ignore_eos),
    }
    if cfg.workflow.path:
        from verl.utils.import_utils import load_extern_object

        workflow_cls = load_extern_object(module_path=cfg.workflow.path, object_name=cfg.workflow.name)
        return workflow_cls(reward_fn=reward_fn, sampling_params=sampling_params)
    if cfg.workflow.name == "single_turn":
        return SingleTurnWorkflow(reward_fn, sampling_params, float(cfg.workflow.reward_timeout_s))
    raise ValueError(f"workflow.name: unknown workflow {cfg.workflow.name!r} (use single_turn or set workflow.path)")
