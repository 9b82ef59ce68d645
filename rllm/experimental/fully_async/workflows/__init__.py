"""Rollout workflows: `async run(client, tokenizer, datum, sample_index) -> Trajectory`, chosen by config.

`build_workflow(cfg, reward_fn, pool)` picks one:
- `workflow.path` set: the object `workflow.name` in that file. An `async def fn(client, tokenizer, **datum)` is an
  rLLM rollout function (workflows/rllm_compat.py runs it unchanged); a class is built as
  `cls(reward_fn=..., sampling_params=...)`.
- `single_turn`: one generation scored by the reward function.
- `multi_turn`: an agent playing `env.*` (and calling `tools.*`) turn by turn (workflows/multi_turn.py), its
  environment and tools in the worker `pool`. Its reward is the environment's unless the config names a reward
  function (`reward.custom_reward_function.path`).
"""

from __future__ import annotations

import inspect
from typing import Any

from rllm.experimental.fully_async.workflows.base import (
    IsolatedReward,
    Workflow,
    load_reward_fn,
    score_safely,
)
from rllm.experimental.fully_async.workflows.multi_turn import MultiTurnWorkflow
from rllm.experimental.fully_async.workflows.single_turn import SingleTurnWorkflow

__all__ = [
    "IsolatedReward",
    "MultiTurnWorkflow",
    "SingleTurnWorkflow",
    "Workflow",
    "build_workflow",
    "check_agent_fits_model",
    "load_reward_fn",
    "sampling_params_from",
    "score_safely",
]


def sampling_params_from(cfg: Any) -> dict[str, Any]:
    """SGLang sampling parameters from verl's rollout section and data.max_response_length (one turn's limit)."""
    rollout = cfg.actor_rollout_ref.rollout
    return {
        "max_new_tokens": int(cfg.data.max_response_length),
        "temperature": float(rollout.temperature),
        "top_p": float(rollout.top_p),
        "top_k": int(rollout.top_k),
        "ignore_eos": bool(rollout.ignore_eos),
    }


def build_workflow(cfg: Any, reward_fn: Any, pool: Any = None) -> Workflow:
    """The workflow `cfg.workflow` names (module docstring). `pool`: the rollout service's WorkerPool."""
    sampling_params = sampling_params_from(cfg)
    if cfg.workflow.path:
        from verl.utils.import_utils import load_extern_object

        obj = load_extern_object(module_path=cfg.workflow.path, object_name=cfg.workflow.name)
        if inspect.iscoroutinefunction(obj):
            from rllm.experimental.fully_async.workflows.rllm_compat import RllmRolloutWorkflow

            return RllmRolloutWorkflow(obj, batched=bool(cfg.workflow.rllm_batched))
        return obj(reward_fn=reward_fn, sampling_params=sampling_params)
    if cfg.workflow.name == "single_turn":
        return SingleTurnWorkflow(reward_fn, sampling_params, float(cfg.workflow.reward_timeout_s))
    if cfg.workflow.name == "multi_turn":
        return build_multi_turn(cfg, reward_fn, pool, sampling_params)
    raise ValueError(f"workflow.name: unknown workflow {cfg.workflow.name!r} (use single_turn, multi_turn or set path)")


def build_multi_turn(cfg: Any, reward_fn: Any, pool: Any, sampling_params: dict[str, Any]) -> MultiTurnWorkflow:
    from omegaconf import OmegaConf

    from rllm.experimental.fully_async.envs.base import EnvSpec
    from rllm.experimental.fully_async.workflows.tools import ToolBox

    env = OmegaConf.to_container(cfg.env, resolve=True) if OmegaConf.is_config(cfg.env) else dict(cfg.env)
    tools = cfg.tools
    toolbox = ToolBox(dict(tools.functions), str(tools.format), float(tools.timeout_s)) if tools.functions else None
    user_reward = bool(cfg.reward.custom_reward_function.get("path"))
    return MultiTurnWorkflow(
        EnvSpec.from_config(env),
        sampling_params,
        pool=pool,
        tools=toolbox,
        layout=str(cfg.workflow.layout),
        reward_fn=reward_fn if user_reward else None,
        reward_timeout_s=float(cfg.workflow.reward_timeout_s),
    )


def check_agent_fits_model(cfg: Any) -> None:
    """A multi_turn episode must fit the engine's context: env.max_total_tokens <= the model's
    max_position_embeddings (ConfigError otherwise, one line). Run before any process starts."""
    if cfg.workflow.path is not None or cfg.workflow.name != "multi_turn":
        return
    from transformers import AutoConfig

    from rllm.experimental.fully_async.errors import ConfigError

    context = getattr(AutoConfig.from_pretrained(cfg.actor_rollout_ref.model.path), "max_position_embeddings", None)
    if context is not None and int(cfg.env.max_total_tokens) > int(context):
        raise ConfigError(
            f"'env.max_total_tokens' ({cfg.env.max_total_tokens}) exceeds the model's context length ({context}); "
            f"set env.max_total_tokens <= {context}"
        )
