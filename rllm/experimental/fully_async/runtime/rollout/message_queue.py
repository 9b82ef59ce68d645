"""MessageQueue: the bounded queue of finished VersionedGroups inside the rollout service, with its waits.

`core/buffer.GroupBuffer` is the bookkeeping (bounded FIFO, counters, statistics); this class adds what needs an
event loop, and lives in the rollout service's process next to the executor that fills it and the `take_batch`
that empties it (docs/design.md#rule-one-rollout-service), so no call crosses a process and no lock is needed:
everything runs on one loop.

Contract:
- `put(groups)` never blocks and never drops: what does not fit waits in a *backlog*, in order, and moves into
  the buffer as `pop` frees space. A non-empty backlog is the back-pressure signal: the executor starts no new
  group while `backlog` > 0 (the staleness budget bounds the backlog anyway).
- `pop(n)` takes exactly the n oldest queued groups; `remove_if` takes groups out wherever they are (too stale).
- `close()` ends the rollouts: nothing new is accepted, the backlog still drains into the buffer, and once it is
  empty the buffer reports `closed` so the trainer's last request gets what is left, then "closed".
- `wait_for(predicate, timeout_s)` waits on a change (put, pop, remove, close), never by polling.
- `subscribe(callback)` calls back on every change (the executor wakes its loop when space frees).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rllm.experimental.fully_async.api.trajectory import VersionedGroup
from rllm.experimental.fully_async.core.buffer import GroupBuffer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GetResult:
    groups: list[VersionedGroup]
    status: Literal["ok", "timeout", "closed"]  # "ok" also covers a short drain after close (len < n)


class MessageQueue:
    """GroupBuffer + backlog + waits, for one event loop. See the module docstring for the contract."""

    def __init__(self, max_groups: int) -> None:
        self.buffer = GroupBuffer(max_groups)
        self._backlog: deque[VersionedGroup] = deque()
        self._closing = False
        self._changed: asyncio.Event | None = None  # replaced at each change: every waiter of the old one wakes
        self._listeners: list[Callable[[], None]] = []

    # ---- state -----------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Groups ready to take (in the buffer; the backlog enters as space frees)."""
        return len(self.buffer)

    @property
    def max_groups(self) -> int:
        return self.buffer.max_groups

    @property
    def backlog(self) -> int:
        return len(self._backlog)

    @property
    def closed(self) -> bool:
        """Closed and the backlog drained: what the buffer holds is all that is left."""
        return self.buffer.closed

    # ---- changes ---------------------------------------------------------------------------------------------

    def subscribe(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    def put(self, groups: Sequence[VersionedGroup]) -> None:
        if self._closing:
            self.buffer.total_rejected_closed += len(groups)
            return
        self._backlog.extend(groups)
        self._refill()

    def pop(self, n: int) -> list[VersionedGroup]:
        groups = self.buffer.pop(n)
        self._refill()
        return groups

    def remove_if(self, predicate: Callable[[VersionedGroup], bool]) -> list[VersionedGroup]:
        removed = self.buffer.remove_if(predicate)
        kept: deque[VersionedGroup] = deque()
        for group in self._backlog:
            (removed if predicate(group) else kept).append(group)
        self._backlog = kept
        if removed:
            self._refill()
        return removed

    def close(self) -> None:
        if not self._closing:
            logger.info("message queue closed with %d groups queued, %d in backlog", len(self.buffer), self.backlog)
        self._closing = True
        self._refill()

    def _refill(self) -> None:
        if self._backlog:
            taken = self.buffer.push(list(self._backlog)[: self.buffer.space])
            for _ in range(taken):
                self._backlog.popleft()
        if self._closing and not self._backlog:
            self.buffer.close()
        self._notify()

    def wake(self) -> None:
        """Wake every `wait_for` to check its predicate again (a change outside the queue that a waiter reads)."""
        self._notify()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        for callback in self._listeners:
            callback()

    # ---- waiting ---------------------------------------------------------------------------------------------

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until predicate() holds (checked at each change); False if timeout_s passed first."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if self._changed is None:
                self._changed = asyncio.Event()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                return predicate()
        return True

    async def get_batch(self, n: int, timeout_s: float) -> GetResult:
        """Exactly n oldest groups; or none on timeout; after close, what is left, then status "closed"."""
        if n < 1 or n > self.max_groups:
            # A get larger than the queue can ever hold would wait forever: reject it at once.
            raise ValueError(f"get_batch(n={n}) must ask for 1..{self.max_groups} groups (the queue size)")
        await self.wait_for(lambda: len(self.buffer) >= n or self.closed, timeout_s)
        if len(self.buffer) >= n:
            return GetResult(self.pop(n), "ok")
        if self.closed:
            return GetResult(self.pop(len(self.buffer)), "ok") if len(self.buffer) else GetResult([], "closed")
        return GetResult([], "timeout")

    # ---- reports ---------------------------------------------------------------------------------------------

    def snapshot(self) -> list[VersionedGroup]:
        """Every finished, untrained group (queued, then backlog), oldest first, left in place (for a checkpoint)."""
        return self.buffer.snapshot() + list(self._backlog)

    def stats(self) -> dict[str, Any]:
        return self.buffer.stats() | {"backlog": self.backlog}
