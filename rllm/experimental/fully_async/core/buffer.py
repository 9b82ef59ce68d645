"""GroupBuffer: the bounded FIFO of VersionedGroups between rollout and trainer, as plain bookkeeping.

Pure (docs/design.md#rule-functional-core): no asyncio, no Ray. It never blocks; it answers "how much fits" and "take
exactly n". The rollout service's `runtime/rollout/message_queue.py` adds the waiting around it.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

from rllm.experimental.fully_async.api.trajectory import VersionedGroup


class GroupBuffer:
    """A bounded FIFO of VersionedGroups with cumulative counts. Never blocks; not thread-safe (one owner)."""

    def __init__(self, max_groups: int) -> None:
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups}")
        self.max_groups = max_groups
        self._groups: deque[VersionedGroup] = deque()
        self.closed = False
        self.total_put = 0
        self.total_got = 0
        self.total_rejected_closed = 0  # groups offered after close and turned away

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def space(self) -> int:
        return self.max_groups - len(self._groups)

    def push(self, groups: Sequence[VersionedGroup]) -> int:
        """Append as many of `groups` (in order) as fit; return how many. Nothing is taken after close."""
        if self.closed:
            self.total_rejected_closed += len(groups)
            return 0
        n = min(len(groups), self.space)
        self._groups.extend(groups[:n])
        self.total_put += n
        return n

    def pop(self, n: int) -> list[VersionedGroup]:
        """Remove and return the n oldest groups; ValueError if fewer are queued."""
        if n < 1 or n > len(self._groups):
            raise ValueError(f"cannot pop {n} groups from a buffer holding {len(self._groups)}")
        out = [self._groups.popleft() for _ in range(n)]
        self.total_got += n
        return out

    def remove_if(self, predicate: Callable[[VersionedGroup], bool]) -> list[VersionedGroup]:
        """Remove and return the groups for which predicate holds (oldest first); the others keep their order."""
        kept: deque[VersionedGroup] = deque()
        removed: list[VersionedGroup] = []
        for group in self._groups:
            (removed if predicate(group) else kept).append(group)
        self._groups = kept
        return removed

    def close(self) -> None:
        self.closed = True

    def snapshot(self) -> list[VersionedGroup]:
        return list(self._groups)

    def stats(self) -> dict[str, Any]:
        """Size, bounds, cumulative counts, the oldest token version queued, and queued trajectories by status."""
        versions = [v for v in (g.min_version for g in self._groups) if v is not None]
        by_status = Counter(t.status.value for g in self._groups for t in g.trajectories)
        return {
            "size": len(self._groups),
            "max_size": self.max_groups,
            "closed": self.closed,
            "total_put": self.total_put,
            "total_got": self.total_got,
            "total_rejected_closed": self.total_rejected_closed,
            "oldest_min_version": min(versions) if versions else None,
            "oldest_created_at": self._groups[0].created_at if self._groups else None,
            "trajectories_by_status": dict(by_status),
        }
