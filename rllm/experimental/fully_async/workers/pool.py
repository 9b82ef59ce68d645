"""Isolated user code: a pool of worker processes where a hung call is killed and a crash fails one call only.

Reward functions, environments and tools are user code (docs/design.md#rule-user-code-isolated). Each runs here, in a
worker process of a pebble `ProcessPool`, never in the rollout service's process: a call that passes its timeout has its
worker KILLED (pebble terminates the process and starts a fresh one), a call whose worker dies (segfault, `os._exit`,
OOM kill) fails alone, and an exception comes back as a value. In all three cases `WorkerPool.call` raises
`IsolatedCallError` whose `kind` is one of

    timeout    - no result within timeout_s; the worker was killed and replaced
    crash      - the worker process died during the call (exit code in the reason)
    exception  - the function raised; the reason holds its type and message
    unpicklable - the arguments or the result could not cross the process boundary
    closed     - the pool was closed before or during the call

and whose `reason` is one line fit for the ledger ("env_timeout: step did not return within 2s" is built from it).
It never hangs: besides pebble's own timeout, the awaiting side waits at most `timeout_s + kill_grace_s` and then
gives up on the call with kind=timeout.

Functions are given as a picklable callable or as a reference string resolved inside the worker:
"package.module:attr" or "/path/to/file.py:attr" (like verl's `custom_reward_function.path` + `name`).
Workers start with the "spawn" method by default: the rollout service is multi-threaded (Ray, aiohttp), and a
fork of a multi-threaded process can inherit a lock held by another thread and deadlock in the child.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import importlib
import importlib.util
import logging
import multiprocessing
import pickle
import sys
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Literal

from pebble import ProcessExpired, ProcessPool
from pebble.pool.process import PoolManager

logger = logging.getLogger(__name__)

# What the built-in callers ship to workers: the env session's reset/step and the built-in tools.
DEFAULT_PRELOAD = ("rllm.experimental.fully_async.envs.session", "rllm.experimental.fully_async.tools.calculator")
FailureKind = Literal["timeout", "crash", "exception", "unpicklable", "closed"]
FnRef = Callable[..., Any] | str


class IsolatedCallError(RuntimeError):
    """A call in the worker pool failed; `kind` says how (see the module docstring), `reason` is one line."""

    def __init__(self, kind: FailureKind, reason: str) -> None:
        super().__init__(reason)
        self.kind: FailureKind = kind
        self.reason = reason


class _PoolManagerThatReadsTheCallFirst(PoolManager):
    """pebble's pool manager, except a dead worker is matched to its call only after the call's start was read.

    A worker acknowledges a call before it runs it, but pebble reads acknowledgements on one thread and notices dead
    workers on another. A call that kills its worker at once (`os._exit` on entry) can be noticed dead before its
    acknowledgement is read; pebble then finds no call to blame and either breaks the whole pool ("All workers
    expired": every call in flight fails, the exit code is lost) or, with other calls running, forgets the death and
    leaves the call to its timeout. Waiting a moment for the acknowledgement blames the right call, with its exit
    code, and leaves the others alone.
    """

    ACKNOWLEDGEMENT_WAIT_S = 1.0  # acknowledgements are read within milliseconds; a worker with no call waits this

    def handle_worker_expiration(self, expiration: tuple) -> None:
        worker_id, _ = expiration
        deadline = time.monotonic() + self.ACKNOWLEDGEMENT_WAIT_S
        while time.monotonic() < deadline and not any(
            task.worker_id == worker_id for task in list(self.task_manager.tasks.values())
        ):
            time.sleep(0.005)
        super().handle_worker_expiration(expiration)


class _ProcessPool(ProcessPool):
    """pebble's ProcessPool with the manager above (its `_context` and `_pool_manager` as of pebble==5.2.3, pinned)."""

    def __init__(self, *, context: Any, **kwargs: Any) -> None:
        super().__init__(context=context, **kwargs)
        self._pool_manager = _PoolManagerThatReadsTheCallFirst(self._context, context)


_RESOLVED: dict[str, Callable[..., Any]] = {}  # per worker process: reference string -> callable


def resolve_reference(ref: str) -> Callable[..., Any]:
    """The callable a "module:attr" or "/file.py:attr" reference names (cached per process)."""
    if ref in _RESOLVED:
        return _RESOLVED[ref]
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"function reference {ref!r} is not 'module:name' or '/path/file.py:name'")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise FileNotFoundError(f"function reference {ref!r}: no file {path}")
        # Deterministic across processes (str hash is salted per process): a pickled object of this module sent
        # to another worker unpickles there once the same reference has been resolved.
        module_name = "_rllm_user_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"function reference {ref!r}: cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        # Registered before exec so that dataclasses and pickling inside the user module can find it.
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    fn = getattr(module, attr)
    if not callable(fn):
        raise TypeError(f"function reference {ref!r} names a {type(fn).__name__}, not a callable")
    _RESOLVED[ref] = fn
    return fn


def _preload(names: tuple[str, ...]) -> None:
    """Worker initializer: import what the calls will need before any call's clock starts."""
    for name in names:
        if ":" in name:
            resolve_reference(name)
        else:
            importlib.import_module(name)


def _invoke(fn: FnRef, args: tuple, kwargs: dict) -> Any:
    """Runs in the worker: resolve the reference there, so the parent never imports user code."""
    target = resolve_reference(fn) if isinstance(fn, str) else fn
    return target(*args, **kwargs)


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


class WorkerPool:
    """`max_workers` worker processes running user functions with per-call timeouts (see the module docstring).

    `max_tasks`: calls a worker serves before it is replaced (0: never), a guard against user code that leaks.
    `kill_grace_s`: how much longer than timeout_s the caller waits for pebble to report the kill.
    `preload`: modules (or function references) every worker imports when it starts, outside any call's timeout:
    a call's time limit also covers importing its function's module in a fresh worker, which on a busy machine
    can take longer than a short step timeout.
    The pool is started lazily by the first call and must be closed with `close()` (or `async with`).
    """

    def __init__(
        self,
        max_workers: int = 2,
        *,
        max_tasks: int = 0,
        start_method: str = "spawn",
        kill_grace_s: float = 5.0,
        preload: tuple[str, ...] = DEFAULT_PRELOAD,
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"WorkerPool needs max_workers >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.max_tasks = max_tasks
        self.start_method = start_method
        self.kill_grace_s = kill_grace_s
        self.preload = tuple(preload)
        self._pool: ProcessPool | None = None
        self._closed = False

    def _get_pool(self) -> ProcessPool:
        if self._closed:
            raise IsolatedCallError("closed", "worker_pool_closed: the worker pool was closed")
        if self._pool is not None and not self._pool.active:
            # pebble marks the whole pool broken when a worker dies with no call to blame (for example its preload
            # failed): start a fresh pool rather than fail every call.
            logger.warning("worker pool broke (a worker died unexpectedly); starting a fresh one")
            broken, self._pool = self._pool, None
            broken.stop()
        if self._pool is None:
            self._pool = _ProcessPool(
                max_workers=self.max_workers,
                max_tasks=self.max_tasks,
                context=multiprocessing.get_context(self.start_method),
                initializer=_preload if self.preload else None,
                initargs=(self.preload,),
            )
        return self._pool

    async def call(self, fn: FnRef, *args: Any, timeout_s: float, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` in a worker; its result, or IsolatedCallError within timeout_s + kill_grace_s."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        name = fn if isinstance(fn, str) else getattr(fn, "__qualname__", repr(fn))
        try:
            future = self._get_pool().schedule(_invoke, args=(fn, args, kwargs), timeout=timeout_s)
        except RuntimeError as exc:  # pebble: "the pool is not running"
            raise IsolatedCallError("closed", f"worker_pool_closed: {_one_line(str(exc))}") from exc
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout=timeout_s + self.kill_grace_s)
        except asyncio.CancelledError:
            future.cancel()  # pebble kills the worker running a cancelled call
            raise
        except (concurrent.futures.TimeoutError, TimeoutError) as exc:
            # pebble's TimeoutError (worker killed) or our outer guard (pebble did not report in time).
            future.cancel()
            raise IsolatedCallError("timeout", f"{name} did not return within {timeout_s:g}s (worker killed)") from exc
        except BrokenProcessPool as exc:  # see _get_pool: the next call gets a fresh pool
            raise IsolatedCallError("crash", f"{name}: a worker process died and broke the pool ({exc})") from exc
        except ProcessExpired as exc:
            raise IsolatedCallError("crash", f"{name}: worker process died (exit code {exc.exitcode})") from exc
        except concurrent.futures.CancelledError as exc:
            raise IsolatedCallError("closed", f"{name}: the call was cancelled by the pool shutting down") from exc
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            if _is_pickling_failure(exc):
                raise IsolatedCallError("unpicklable", f"{name}: {_one_line(f'{type(exc).__name__}: {exc}')}") from exc
            raise IsolatedCallError("exception", f"{name} raised {_one_line(f'{type(exc).__name__}: {exc}')}") from exc
        except Exception as exc:  # the user function raised: a failed call, not a failed run
            raise IsolatedCallError("exception", f"{name} raised {_one_line(f'{type(exc).__name__}: {exc}')}") from exc

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (running calls are killed); idempotent."""
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            pool.join(timeout=timeout_s)

    async def __aenter__(self) -> WorkerPool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _is_pickling_failure(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, pickle.PicklingError) or "pickle" in text
