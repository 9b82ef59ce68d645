"""The reward call every workflow shares, and how a reward function is loaded.

A workflow (the contract: api/workflow.py) runs one sample to the end and returns a `VersionedTrajectory`. It never
raises for a bad sample: a reward function that raises, hangs or returns a non-number gives a FAILED trajectory with the
reason, so the ledger counts it and the run goes on. Only cancellation and engine exhaustion (no engine left) propagate.

Where a reward runs (docs/design.md#rule-user-code-isolated): a user's synchronous reward function
(`reward.custom_reward_function`, or verl's `default_compute_score`) is an `IsolatedReward`, called in the worker pool
(workers/pool.py), whose timeout KILLS a hung call's worker. A built-in task's reward (this package's code, pure and
fast) and any in-process callable run on a daemon thread that runs nothing else meanwhile (threads are reused, never
shared by two calls); an `async def` reward is awaited on the loop. Each with `reward_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import inspect
import logging
import math
import numbers
import os
import queue
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from verl.utils.import_utils import load_extern_object
from verl.utils.reward_score import default_compute_score

from rllm.experimental.fully_async.workers.pool import IsolatedCallError, resolve_reference

if TYPE_CHECKING:
    from rllm.experimental.fully_async.run_spec import ExecutorSpec

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Any]  # verl's signature: (data_source, solution_str, ground_truth, extra_info) -> float


@dataclass(frozen=True)
class IsolatedReward:
    """A reward function by reference ("module:name" or "/file.py:name"), run in `pool` by `score_safely`.

    Calling the object directly runs the function in this process (a custom workflow that calls its reward_fn
    itself gets the plain function's behaviour, without isolation).
    """

    reference: str
    pool: Any  # workers.pool.WorkerPool

    def __call__(self, *args: Any, **kwargs: Any) -> Any:

        return resolve_reference(self.reference)(*args, **kwargs)


@dataclass(frozen=True)
class RewardOutcome:
    """A reward, or why there is none."""

    reward: float | None
    failure: str | None = None
    extra: dict[str, Any] | None = None


async def score_safely(
    reward_fn: RewardFn,
    timeout_s: float,
    *,
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None,
) -> RewardOutcome:
    """Call a reward function with a timeout; turn exceptions, hangs and non-numbers into a failure reason.

    An `IsolatedReward` runs in the worker pool: past the timeout its worker is killed. Other synchronous reward
    functions run in a thread of their own so a slow one does not stall the event loop that drives every other
    rollout; a hung thread cannot be killed in Python, it is abandoned and the sample fails.
    verl reward functions may return a float or a dict with a "score" key (the rest is kept as extra metrics).
    """
    if isinstance(reward_fn, IsolatedReward):
        try:
            raw = await reward_fn.pool.call(
                reward_fn.reference, data_source, solution_str, ground_truth, extra_info, timeout_s=timeout_s
            )
        except IsolatedCallError as exc:
            if exc.kind == "timeout":
                return RewardOutcome(None, f"reward_timeout: no result within {timeout_s:g}s (worker killed)")
            detail = exc.reason.split(" raised ", 1)[-1] if exc.kind == "exception" else exc.reason
            return RewardOutcome(None, f"reward_error: {detail}")
        return _outcome(raw)
    try:
        if inspect.iscoroutinefunction(reward_fn):
            call: Awaitable[Any] = reward_fn(data_source, solution_str, ground_truth, extra_info)
        else:
            call = _in_own_thread(reward_fn, data_source, solution_str, ground_truth, extra_info)
        raw = await asyncio.wait_for(call, timeout=timeout_s)
    except asyncio.TimeoutError:
        return RewardOutcome(None, f"reward_timeout: no result within {timeout_s:g}s")
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a user function: any exception is a failed sample, not a failed run
        return RewardOutcome(None, f"reward_error: {type(exc).__name__}: {exc}")
    return _outcome(raw)


def _outcome(raw: Any) -> RewardOutcome:
    """A verl reward's return value (a number, or a dict with "score") as an outcome, or why it is not one."""
    extra = None
    if isinstance(raw, dict):
        extra = {k: v for k, v in raw.items() if k != "score"}
        raw = raw.get("score")
    # numbers.Real admits numpy scalars (np.float32, np.int64), which verl's reward managers accept too.
    if isinstance(raw, (bool, np.bool_)) or not isinstance(raw, numbers.Real):
        return RewardOutcome(None, f"reward_not_a_number: got {type(raw).__name__} {raw!r:.60}")
    raw = float(raw)
    if not math.isfinite(raw):
        return RewardOutcome(None, f"reward_not_finite: got {raw}")
    return RewardOutcome(float(raw), None, extra)


class _DaemonThreads:
    """Daemon threads that each run one call at a time, reused across calls, grown when all are busy.

    Not asyncio.to_thread: its pool has min(32, cpus + 4) workers, and a reward that hangs keeps its worker
    forever, so a handful of hung calls would make every later reward wait for a worker and time out. Here a call
    never waits for a worker: it takes an idle one or starts a new one, and a hung call strands only its own
    thread. Reuse matters because starting a thread per reward cost ~10% of the rollout service's CPU on the
    embedded default (hundreds of samples a second). Daemon threads do not block interpreter exit.
    """

    def __init__(self, max_idle: int = 8) -> None:
        self.max_idle = max_idle
        self._idle: list[queue.SimpleQueue] = []
        self._lock = threading.Lock()

    def submit(self, call: Callable[[], Any], on_done: Callable[[Any, BaseException | None], None]) -> None:
        """Run `call()` on an idle thread (or a new one), then `on_done(result, error)` on that thread."""
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._work, args=(inbox,), name="reward-fn", daemon=True).start()
        inbox.put((call, on_done))

    def _work(self, inbox: queue.SimpleQueue) -> None:
        while True:
            call, on_done = inbox.get()
            try:
                result, error = call(), None
            except BaseException as exc:  # handed to on_done, which hands it to the awaiting coroutine
                result, error = None, exc
            # Idle again before reporting, so the caller's next call (made as soon as it hears) finds this thread.
            with self._lock:
                keep = len(self._idle) < self.max_idle
                if keep:
                    self._idle.append(inbox)
            on_done(result, error)
            if not keep:
                return


_REWARD_THREADS = _DaemonThreads()


def _in_own_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """Run `fn(*args)` on a daemon thread that runs nothing else meanwhile (`_DaemonThreads`); a future of it."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # timed out and cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def report(result: Any, error: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop may be closed by the time a hung call returns
            loop.call_soon_threadsafe(settle, result, error)

    _REWARD_THREADS.submit(functools.partial(fn, *args), report)
    return future


BUILTIN_REWARD_PREFIX = "rllm.experimental.fully_async.tasks."  # built-in tasks' rewards: trusted, in-process


def load_reward_fn(executor: ExecutorSpec, pool: Any = None) -> RewardFn:
    """The configured reward: verl's custom_reward_function (path + name), else verl's default_compute_score.

    `executor.reward_fn_path`/`reward_fn_name` hold both of verl's locations, resolved by the run spec
    (`reward.custom_reward_function` (0.7.1), else the legacy top-level `custom_reward_function`). The path is a
    Python file (as in verl) or an importable module name. The function is loaded here too, so that a bad path fails
    at start-up in one line; with a `pool`, a synchronous function that is not a built-in task's comes back as an
    `IsolatedReward` (run in the pool, see the module docstring).
    """
    path, name = executor.reward_fn_path, executor.reward_fn_name or "compute_score"
    fn = _load_reward_fn(path, name)
    if pool is None or inspect.iscoroutinefunction(fn):
        return fn
    if not path:
        return IsolatedReward("verl.utils.reward_score:default_compute_score", pool)
    if path.startswith(BUILTIN_REWARD_PREFIX):
        return fn
    if path.endswith(".py") or os.path.exists(path):
        return IsolatedReward(f"{os.path.abspath(path)}:{name}", pool)
    return IsolatedReward(f"{path}:{name}", pool)


def _load_reward_fn(path: str | None, name: str) -> RewardFn:

    if not path:
        return default_compute_score
    if not path.endswith(".py") and not os.path.exists(path):
        # A dotted module name (e.g. a built-in task's). verl's loader executes a file without registering it
        # in sys.modules, which breaks modules that define dataclasses; importing by name has no such problem.
        try:
            return getattr(importlib.import_module(path), name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(
                f"reward.custom_reward_function: could not load '{name}' from module {path}: {exc}"
            ) from exc
    try:
        # verl's get_custom_reward_fn without its reward_kwargs wrapper (reward_kwargs is refused at load)
        return load_extern_object(module_path=path, object_name=name)
    except Exception as exc:
        raise ValueError(
            f"reward.custom_reward_function: could not load '{name}' from {path}: {type(exc).__name__}: {exc}"
        ) from exc
