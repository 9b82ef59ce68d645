"""Multi-step environments: the interface (base.py), built-ins (number_line.py), isolated episodes (session.py)."""

from rllm.experimental.fully_async.envs.base import ENV_REGISTRY, Environment, EnvSpec, state_hash
from rllm.experimental.fully_async.envs.number_line import NumberLineEnv
from rllm.experimental.fully_async.envs.session import EnvError, IsolatedEnv

__all__ = ["ENV_REGISTRY", "EnvError", "EnvSpec", "Environment", "IsolatedEnv", "NumberLineEnv", "state_hash"]
