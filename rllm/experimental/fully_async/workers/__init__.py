"""The isolated worker pool that runs user code (reward functions, environments, tools); see pool.py."""

from rllm.experimental.fully_async.workers.pool import IsolatedCallError, WorkerPool, resolve_reference

__all__ = ["IsolatedCallError", "WorkerPool", "resolve_reference"]
