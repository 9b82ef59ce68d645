"""One episode of an environment, run in the isolated worker pool and awaited from the rollout's event loop.

The environment object lives in the parent only as pickled bytes: every `reset`/`step` ships those bytes and the
class reference to a worker, which resolves the reference (importing the user's module there, never in the
rollout service), unpickles, calls, and pickles the object back. A call that passes `step_timeout_s` has its worker
killed and raises `EnvError(kind="timeout")`; a crash or an exception raises `EnvError(kind="env_error")`. The
last good state is untouched either way, but the episode is over: the workflow ends the trajectory with that
reason. Shipping the object costs a pickle round trip per step (about a millisecond for small environments); an
environment holding large state should keep it in a file or a service and pickle only a handle.

Because the object only ever exists as those bytes between calls, its state is what a checkpoint saves for an
episode in flight (`state`), and `restore` puts it back in a resumed run: a worker loads it (so an object whose pickle
no longer loads, e.g. its class changed, raises `EnvError` there and its episode starts over).

`pool=None` runs the calls in this process instead (trusted built-ins and unit tests only: no timeout can kill
an in-process call).
"""

from __future__ import annotations

import pickle
from typing import Any

from rllm.experimental.fully_async.envs.base import EnvSpec, state_hash
from rllm.experimental.fully_async.workers.pool import IsolatedCallError, WorkerPool, resolve_reference


class EnvError(RuntimeError):
    """An environment call failed; `kind` is "timeout" or "env_error", `reason` one line for the ledger."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


def _identity(env: Any, observation: str) -> str:
    key = env.state_key() if callable(getattr(env, "state_key", None)) else observation
    return state_hash(str(key))


def env_reset(reference: str, kwargs: dict[str, Any], seed: int, task: dict[str, Any]) -> tuple[bytes, str, str]:
    """Worker side of reset: build the environment, reset it; (pickled env, observation, state hash)."""
    env = resolve_reference(reference)(**kwargs)
    observation = env.reset(seed, task)
    if not isinstance(observation, str):
        raise TypeError(f"reset returned {type(observation).__name__}, expected str")
    return pickle.dumps(env), observation, _identity(env, observation)


def env_step(reference: str, blob: bytes, action_text: str) -> tuple[bytes, str, float, bool, dict, str]:
    """Worker side of step; (pickled env, observation, reward, done, info, state hash of the new state)."""
    resolve_reference(reference)  # imports the env's module in this worker so the pickled object can load
    env = pickle.loads(blob)
    result = env.step(action_text)
    if not (isinstance(result, tuple) and len(result) == 4):
        raise TypeError(f"step returned {type(result).__name__}, expected (observation, reward, done, info)")
    observation, reward, done, info = result
    if not isinstance(observation, str):
        raise TypeError(f"step returned an observation of type {type(observation).__name__}, expected str")
    reward = float(reward)
    return pickle.dumps(env), observation, reward, bool(done), dict(info or {}), _identity(env, observation)


def env_restore(reference: str, blob: bytes) -> bytes:
    """Worker side of restore: load a saved environment (its module imported first) and pickle it again."""
    resolve_reference(reference)
    return pickle.dumps(pickle.loads(blob))


class IsolatedEnv:
    """Async `reset`/`step` over an environment that runs in `pool` (see the module docstring)."""

    def __init__(self, spec: EnvSpec, pool: WorkerPool | None) -> None:
        self.spec = spec
        self.pool = pool
        self._blob: bytes | None = None

    async def _call(self, what: str, fn: Any, *args: Any) -> Any:
        if self.pool is None:
            try:
                return fn(*args)
            except Exception as exc:  # user code: the episode fails with the reason, the run goes on
                raise EnvError("env_error", f"env {what} raised {type(exc).__name__}: {exc}") from exc
        try:
            return await self.pool.call(fn, *args, timeout_s=self.spec.step_timeout_s)
        except IsolatedCallError as exc:
            kind = "timeout" if exc.kind == "timeout" else "env_error"
            detail = f"did not return within {self.spec.step_timeout_s:g}s" if kind == "timeout" else exc.reason
            raise EnvError(kind, f"env {what} {detail}") from exc

    async def reset(self, seed: int, task: dict[str, Any]) -> tuple[str, str]:
        """(observation, state hash) of the first state."""
        self._blob, observation, identity = await self._call(
            "reset", env_reset, self.spec.reference, dict(self.spec.kwargs), seed, task
        )
        return observation, identity

    @property
    def state(self) -> bytes | None:
        """The environment as pickled bytes (None before reset): what a checkpoint saves of an episode in flight."""
        return self._blob

    async def restore(self, state: bytes) -> None:
        """Continue from a saved `state`, loaded once in a worker to prove it still loads (EnvError if not)."""
        self._blob = await self._call("restore", env_restore, self.spec.reference, state)

    async def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any], str]:
        """(observation, reward, done, info, state hash of the new state)."""
        if self._blob is None:
            raise RuntimeError("IsolatedEnv.step before reset")
        self._blob, *rest = await self._call("step", env_step, self.spec.reference, self._blob, action_text)
        observation, reward, done, info, identity = rest
        return observation, reward, done, info, identity
