"""The rollout functions a program hands `runner.AsyncAgentTrainer`, as they travel to the rollout service.

The program cloudpickles them in its own process: closures and functions of its `__main__` by value (their code and
the values they captured), functions of importable modules by reference, as Ray ships them when rLLM hands them to
its executor actor. The run spec carries the bytes (`ExecutorSpec.rllm_functions`); the rollout service unpickles
them (workflows.runner_workflow). They are not configuration: the config says only `workflow.name=rllm_runner`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# workflow.name of a run started by runner.AsyncAgentTrainer: the workflow is the rollout function the program gave
# it, carried by value in the run spec (ExecutorSpec.rllm_functions), not a file the config names.
RUNNER_WORKFLOW = "rllm_runner"


@dataclass(frozen=True)
class RolloutFunctions:
    train: bytes  # rollout_fn
    val: bytes | None = None  # val_rollout_fn; None: rollout_fn validates too (rLLM's rule)


def with_rllm_functions(spec: Any, functions: RolloutFunctions | None) -> Any:
    """`spec` (run_spec.RunSpec) carrying `functions` to the rollout service; unchanged for None."""
    if functions is None:
        return spec
    return dataclasses.replace(spec, executor=dataclasses.replace(spec.executor, rllm_functions=functions))
