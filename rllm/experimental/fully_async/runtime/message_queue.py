"""MessageQueue: the bounded, batched, accounted queue of TrajectoryGroups between rollout and trainer.

Two layers (DESIGN rule 1):

- `GroupBuffer`, plain bookkeeping with no asyncio and no Ray: a FIFO of groups with a size bound in groups,
  cumulative counters and statistics. It never blocks; it answers "how much fits" and "take exactly n".
- `MessageQueue`, a thin async Ray actor around it that adds waiting, with a timeout on every wait.

Contract:

- Batched both ways: one Ray call moves many groups (ENVIRONMENT.md: one call per item tops out near 3-4k items/s,
  64 items per call reached ~33k/s).
- Back-pressure, never eviction: `put_batch` on a full queue waits for a `get_batch` to free space. It accepts
  groups in order as space frees and returns how many it accepted when all are in, the queue closes, or
  `timeout_s` passes, whichever comes first. A timed-out put is not an error inside the queue, because only the
  producer knows whether to retry `groups[accepted:]` or to give up; it gets `timed_out=True` and the count, so it
  never loses track of which groups are in.
- `get_batch(n, timeout_s)` returns exactly n groups (status "ok"), or none when the timeout passes first (status
  "timeout"; nothing is removed). After `close()` it drains what is left — fewer than n if that is all there is —
  and then returns status "closed" with no groups, so the trainer's loop ends without a special case.
- `close()` wakes every waiting put and get.
- `snapshot()` copies the queued groups (oldest first) for a checkpoint; a restore puts them back with put_batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import ray

from rllm.experimental.fully_async.core.buffer import GroupBuffer
from rllm.experimental.fully_async.core.protocol import TrajectoryGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PutResult:
    accepted: int  # groups[:accepted] are in the queue
    closed: bool  # the queue was closed: stop producing
    timed_out: bool  # timeout_s passed before all groups fitted


@dataclass(frozen=True)
class GetResult:
    groups: list[TrajectoryGroup]
    status: Literal["ok", "timeout", "closed"]  # "ok" also covers a short drain after close (len < n)


@ray.remote(num_cpus=0)  # waits on events, uses no CPU between calls: it must not take a slot from the workers
class MessageQueue:
    """Async Ray actor around a GroupBuffer; see the module docstring for the put/get/close contract."""

    def __init__(self, max_groups: int) -> None:
        self._buffer = GroupBuffer(max_groups)
        self._changed: asyncio.Condition | None = None  # created on the actor's event loop, at first use
        self._waiting_puts = 0
        self._waiting_gets = 0

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def put_batch(self, groups: list[TrajectoryGroup], timeout_s: float) -> PutResult:
        """Queue `groups` in order, waiting for space up to timeout_s seconds (see the module docstring)."""
        changed = self._condition()
        deadline = time.monotonic() + timeout_s
        accepted = 0
        async with changed:
            while True:
                taken = self._buffer.push(groups[accepted:])
                accepted += taken
                if taken:
                    changed.notify_all()
                if accepted == len(groups) or self._buffer.closed:
                    return PutResult(accepted, self._buffer.closed, timed_out=False)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not await self._wait(lambda: self._buffer.space > 0, remaining, "put"):
                    logger.info(
                        "put_batch timed out after %.1fs: %d of %d groups queued", timeout_s, accepted, len(groups)
                    )
                    return PutResult(accepted, self._buffer.closed, timed_out=True)

    async def get_batch(self, n: int, timeout_s: float) -> GetResult:
        """Exactly n oldest groups; or none on timeout; after close, what is left, then status "closed"."""
        if n < 1 or n > self._buffer.max_groups:
            # A get larger than the queue can ever hold would wait forever: reject it at once.
            raise ValueError(f"get_batch(n={n}) must ask for 1..{self._buffer.max_groups} groups (the queue size)")
        changed = self._condition()
        async with changed:
            ready = await self._wait(lambda: len(self._buffer) >= n, timeout_s, "get")
            if ready and len(self._buffer) >= n:
                groups = self._buffer.pop(n)
            elif self._buffer.closed:
                if not len(self._buffer):
                    return GetResult([], "closed")
                groups = self._buffer.pop(len(self._buffer))
            else:
                return GetResult([], "timeout")
            changed.notify_all()  # space freed: wake waiting puts
            return GetResult(groups, "ok")

    async def _wait(self, predicate: Callable[[], bool], timeout_s: float, kind: Literal["put", "get"]) -> bool:
        """Wait (lock held by the caller) until predicate() or close; False if timeout_s passed first."""
        if predicate() or self._buffer.closed:
            # Checked before waiting: asyncio.wait_for with a timeout of 0 would time out without ever running
            # the wait, so get_batch(n, timeout_s=0) would miss groups that are already there.
            return True
        changed = self._condition()
        if kind == "put":
            self._waiting_puts += 1
        else:
            self._waiting_gets += 1
        try:
            await asyncio.wait_for(changed.wait_for(lambda: predicate() or self._buffer.closed), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            if kind == "put":
                self._waiting_puts -= 1
            else:
                self._waiting_gets -= 1

    async def close(self) -> None:
        """Stop accepting groups and wake every waiter; queued groups can still be drained with get_batch."""
        changed = self._condition()
        async with changed:
            if not self._buffer.closed:
                logger.info("message queue closed with %d groups queued", len(self._buffer))
            self._buffer.close()
            changed.notify_all()

    async def stats(self) -> dict[str, Any]:
        return self._buffer.stats() | {"waiting_puts": self._waiting_puts, "waiting_gets": self._waiting_gets}

    async def snapshot(self) -> list[TrajectoryGroup]:
        """The queued groups, oldest first, left in place (for a checkpoint)."""
        return self._buffer.snapshot()
