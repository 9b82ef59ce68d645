"""Rollout workflows: `async run(client, tokenizer, datum, sample_index) -> VersionedTrajectory`, chosen by config.

`build_workflow(spec.executor, reward_fn, pool)` picks one, from the run spec (run_spec.py ExecutorSpec):
- `workflow.name=rllm_runner`: the rollout function given to `runner.AsyncAgentTrainer`, shipped by value in the run
  spec (api/rollout_functions.py), its `val_rollout_fn` for validation.
- `workflow.path` set: the object `workflow.name` in that file. An `async def fn(client, tokenizer, **datum)` is an
  rLLM rollout function (workflows/rllm_compat.py runs it unchanged); a class is built as
  `cls(reward_fn=..., sampling_params=...)`.
- `single_turn`: one generation scored by the reward function.
- `multi_turn`: an agent playing `env.*` (and calling `tools.*`) turn by turn (workflows/multi_turn.py), its
  environment and tools in the worker `pool`. Its reward is the environment's unless the config names a reward
  function (`reward.custom_reward_function.path`).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any

import cloudpickle
from transformers import AutoConfig
from verl.utils.import_utils import load_extern_object

from rllm.experimental.fully_async.api.rollout_functions import RUNNER_WORKFLOW
from rllm.experimental.fully_async.api.workflow import Workflow
from rllm.experimental.fully_async.envs.base import EnvSpec
from rllm.experimental.fully_async.errors import ConfigError
from rllm.experimental.fully_async.run_spec import thaw
from rllm.experimental.fully_async.workflows.base import IsolatedReward, load_reward_fn, score_safely
from rllm.experimental.fully_async.workflows.multi_turn import MultiTurnWorkflow
from rllm.experimental.fully_async.workflows.rllm_compat import RllmRolloutWorkflow
from rllm.experimental.fully_async.workflows.single_turn import SingleTurnWorkflow
from rllm.experimental.fully_async.workflows.tools import ToolBox

if TYPE_CHECKING:
    from rllm.experimental.fully_async.run_spec import AgentSpec, ExecutorSpec, SamplingSpec

__all__ = [
    "IsolatedReward",
    "MultiTurnWorkflow",
    "SingleTurnWorkflow",
    "Workflow",
    "build_workflow",
    "check_agent_fits_model",
    "env_spec",
    "load_reward_fn",
    "sampling_params_from",
    "score_safely",
]


def sampling_params_from(sampling: SamplingSpec) -> dict[str, Any]:
    """SGLang sampling parameters from the run spec's sampling (verl's rollout section, data.max_response_length:
    one turn's limit)."""
    return dataclasses.asdict(sampling)


def build_workflow(executor: ExecutorSpec, reward_fn: Any, pool: Any = None, *, held_out: bool = False) -> Workflow:
    """The workflow `executor` names (module docstring). `pool`: the rollout service's WorkerPool. `held_out`: the
    one validation plays the held-out prompts with (differs only for AsyncAgentTrainer's val_rollout_fn)."""
    sampling_params = sampling_params_from(executor.sampling)
    if executor.workflow_name == RUNNER_WORKFLOW and executor.workflow_path is None:
        return runner_workflow(executor, held_out)
    if executor.workflow_path:
        obj = load_extern_object(module_path=executor.workflow_path, object_name=executor.workflow_name)
        if inspect.iscoroutinefunction(obj):
            return rllm_rollout_workflow(obj, executor)
        return obj(reward_fn=reward_fn, sampling_params=sampling_params)
    if executor.workflow_name == "single_turn":
        return SingleTurnWorkflow(reward_fn, sampling_params, executor.reward_timeout_s)
    if executor.workflow_name == "multi_turn" and executor.agent is not None:
        return build_multi_turn(executor, reward_fn, pool, sampling_params)
    raise ValueError(
        f"workflow.name: unknown workflow {executor.workflow_name!r} (use single_turn, multi_turn or set path)"
    )


def rllm_rollout_workflow(rollout_fn: Any, executor: ExecutorSpec) -> Workflow:
    """An rLLM rollout function as a workflow (workflows/rllm_compat.py), its client's `max_tokens` the run's
    prompt + response budget, as rLLM's executor sets it (data.max_prompt_length + data.max_response_length), its
    rows made as rLLM's batch makes them (merged, prompts and responses held to those lengths)."""

    max_prompt, max_response = executor.data.max_prompt_length, executor.sampling.max_new_tokens
    return RllmRolloutWorkflow(
        rollout_fn,
        batched=executor.rllm_batched,
        max_tokens=max_prompt + max_response,
        max_prompt_length=max_prompt,
        max_response_length=max_response,
    )


def runner_workflow(executor: ExecutorSpec, held_out: bool = False) -> Workflow:
    """The rollout function AsyncAgentTrainer was given (its val_rollout_fn for `held_out`, when it has one; else
    rollout_fn validates too, rLLM's rule), unpickled in this process."""

    functions = executor.rllm_functions
    if functions is None:
        raise ConfigError(
            f"'workflow.name={RUNNER_WORKFLOW}' runs the rollout_fn given to runner.AsyncAgentTrainer: start the run "
            "from the program that builds it (its .train()), or name a file in workflow.path"
        )
    payload = functions.val if held_out and functions.val is not None else functions.train
    return rllm_rollout_workflow(cloudpickle.loads(payload), executor)


def build_multi_turn(
    executor: ExecutorSpec, reward_fn: Any, pool: Any, sampling_params: dict[str, Any]
) -> MultiTurnWorkflow:

    agent = executor.agent
    assert agent is not None, "build_multi_turn needs a multi_turn spec (ExecutorSpec.agent)"
    toolbox = ToolBox(dict(agent.tools), agent.tool_format, agent.tool_timeout_s) if agent.tools else None
    return MultiTurnWorkflow(
        env_spec(agent),
        sampling_params,
        pool=pool,
        tools=toolbox,
        layout=agent.layout,
        reward_fn=reward_fn if executor.reward_fn_path else None,  # the environment's reward unless one is named
        reward_timeout_s=executor.reward_timeout_s,
    )


def env_spec(agent: AgentSpec) -> EnvSpec:
    """The environment an agent plays, from the run spec (what its worker preloads, what each episode builds)."""
    return EnvSpec(
        name=agent.env_name,
        path=agent.env_path,
        kwargs=thaw(agent.env_kwargs) or {},  # env.kwargs: null is no kwargs
        max_turns=agent.max_turns,
        max_total_tokens=agent.max_total_tokens,
        step_timeout_s=agent.step_timeout_s,
    )


def check_agent_fits_model(cfg: Any) -> None:
    """A multi_turn episode must fit the engine's context: env.max_total_tokens <= the model's
    max_position_embeddings (ConfigError otherwise, one line). Run before any process starts."""
    if cfg.workflow.path is not None or cfg.workflow.name != "multi_turn":
        return

    context = getattr(AutoConfig.from_pretrained(cfg.actor_rollout_ref.model.path), "max_position_embeddings", None)
    if context is not None and int(cfg.env.max_total_tokens) > int(context):
        raise ConfigError(
            f"'env.max_total_tokens' ({cfg.env.max_total_tokens}) exceeds the model's context length ({context}); "
            f"set env.max_total_tokens <= {context}"
        )
