"""MessageQueue, the rollout service's in-process queue: FIFO, backlog instead of eviction, waits woken by changes
(never polling), close that drains, removal of stale groups wherever they wait, stats and snapshot."""

from __future__ import annotations

import asyncio

import pytest

from rllm.experimental.fully_async.api.trajectory import (
    TrajectoryStatus,
    VersionedGroup,
    VersionedSequence,
    VersionedTrajectory,
)
from rllm.experimental.fully_async.core.buffer import GroupBuffer
from rllm.experimental.fully_async.runtime.rollout.message_queue import GetResult, MessageQueue

WAIT_S = 30.0  # generous: the machine is shared; a hang still fails instead of blocking the suite


def make_group(i: int, version: int = 0, failed: bool = False) -> VersionedGroup:
    seq = VersionedSequence(
        prompt_ids=[1, 2], response_ids=[3, 4], response_logprobs=[-0.1, -0.2], response_versions=[version] * 2
    )
    status = TrajectoryStatus.FAILED if failed else TrajectoryStatus.OK
    trajectories = [
        VersionedTrajectory(uid=f"p{i}/{k}", prompt_uid=f"p{i}", sequences=[seq], status=status) for k in range(2)
    ]
    return VersionedGroup(prompt_uid=f"p{i}", trajectories=trajectories)


def uids(groups: list[VersionedGroup]) -> list[str]:
    return [g.prompt_uid for g in groups]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, WAIT_S))


def test_put_and_get_are_fifo_and_counted():
    async def scenario():
        queue = MessageQueue(max_groups=4)
        queue.put([make_group(i) for i in range(3)])
        first = await queue.get_batch(2, timeout_s=5)
        assert (uids(first.groups), first.status) == (["p0", "p1"], "ok")
        stats = queue.stats()
        assert (stats["size"], stats["total_put"], stats["total_got"], stats["backlog"]) == (1, 3, 2, 0)

    run(scenario())


def test_a_full_queue_keeps_the_rest_in_a_backlog_in_order_never_evicting():
    queue = MessageQueue(max_groups=2)
    woken = []
    queue.subscribe(lambda: woken.append(queue.backlog))
    queue.put([make_group(i) for i in range(5)])
    assert (len(queue), queue.backlog) == (2, 3)
    assert uids(queue.pop(2)) == ["p0", "p1"]
    assert (len(queue), queue.backlog) == (2, 1)  # space freed: the backlog moved in, oldest first
    assert uids(queue.snapshot()) == ["p2", "p3", "p4"]
    assert woken == [3, 1]  # subscribers hear every change (the executor restarts when the backlog shrinks)


def test_a_waiting_get_wakes_on_put_and_a_timeout_takes_nothing():
    async def scenario():
        queue = MessageQueue(max_groups=4)
        assert await queue.get_batch(2, timeout_s=0.1) == GetResult([], "timeout")
        queue.put([make_group(0)])
        waiting = asyncio.create_task(queue.get_batch(2, timeout_s=WAIT_S))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        queue.put([make_group(1)])
        assert uids((await waiting).groups) == ["p0", "p1"]
        assert await queue.get_batch(1, timeout_s=0) == GetResult([], "timeout")  # zero timeout: no wait

    run(scenario())


def test_close_drains_the_backlog_then_reports_closed():
    async def scenario():
        queue = MessageQueue(max_groups=2)
        queue.put([make_group(i) for i in range(3)])
        waiting = asyncio.create_task(queue.get_batch(2, timeout_s=WAIT_S))
        await asyncio.sleep(0)
        assert uids((await waiting).groups) == ["p0", "p1"]
        queue.close()
        queue.put([make_group(9)])  # refused after close, and counted
        drained = await queue.get_batch(2, timeout_s=WAIT_S)  # returns at once: closed, one left
        assert (uids(drained.groups), drained.status) == (["p2"], "ok")
        assert await queue.get_batch(2, timeout_s=WAIT_S) == GetResult([], "closed")
        stats = queue.stats()
        assert (stats["closed"], stats["total_rejected_closed"], stats["size"]) == (True, 1, 0)

    run(scenario())


def test_remove_if_takes_groups_from_the_buffer_and_the_backlog():
    queue = MessageQueue(max_groups=2)
    queue.put([make_group(0, version=0), make_group(1, version=5), make_group(2, version=0), make_group(3, version=5)])
    removed = queue.remove_if(lambda g: g.min_version == 0)
    assert uids(removed) == ["p0", "p2"]
    assert uids(queue.snapshot()) == ["p1", "p3"] and queue.backlog == 0


def test_a_get_larger_than_the_queue_is_refused_at_once():
    with pytest.raises(ValueError, match=r"must ask for 1\.\.4 groups"):
        run(MessageQueue(max_groups=4).get_batch(5, timeout_s=WAIT_S))


def test_stats_report_oldest_version_and_trajectory_states():
    queue = MessageQueue(max_groups=4)
    groups = [make_group(0, version=3), make_group(1, version=1, failed=True), make_group(2, version=2)]
    queue.put(groups)
    stats = queue.stats()
    assert stats["oldest_min_version"] == 1
    assert stats["trajectories_by_status"] == {"ok": 4, "failed": 2}
    assert stats["oldest_created_at"] == groups[0].created_at


def test_group_buffer_accepts_what_fits_and_refuses_impossible_pops():
    buffer = GroupBuffer(max_groups=2)
    assert buffer.push([make_group(i) for i in range(3)]) == 2
    assert buffer.space == 0
    with pytest.raises(ValueError, match="cannot pop 3"):
        buffer.pop(3)
    assert uids(buffer.pop(2)) == ["p0", "p1"]
    buffer.close()
    assert buffer.push([make_group(5)]) == 0
    assert buffer.stats()["oldest_min_version"] is None
    with pytest.raises(ValueError):
        GroupBuffer(0)
