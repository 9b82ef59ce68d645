"""MessageQueue on a real Ray actor: batched put/get, back-pressure, timeouts, close, stats, snapshot."""

from __future__ import annotations

import pytest

from rllm.experimental.fully_async.core.buffer import GroupBuffer
from rllm.experimental.fully_async.core.protocol import Sequence, Trajectory, TrajectoryGroup, TrajectoryStatus
from rllm.experimental.fully_async.runtime.message_queue import GetResult, MessageQueue, PutResult

RAY_TIMEOUT_S = 60  # generous: the machine is shared; a hang still fails instead of blocking the suite


def make_group(i: int, version: int = 0, failed: bool = False) -> TrajectoryGroup:
    seq = Sequence(
        prompt_ids=[1, 2], response_ids=[3, 4], response_logprobs=[-0.1, -0.2], response_versions=[version] * 2
    )
    status = TrajectoryStatus.FAILED if failed else TrajectoryStatus.OK
    trajectories = [Trajectory(uid=f"p{i}/{k}", prompt_uid=f"p{i}", sequences=[seq], status=status) for k in range(2)]
    return TrajectoryGroup(prompt_uid=f"p{i}", trajectories=trajectories)


def uids(groups: list[TrajectoryGroup]) -> list[str]:
    return [g.prompt_uid for g in groups]


@pytest.fixture
def queue(ray_session):
    handle = MessageQueue.remote(max_groups=4)
    yield handle
    ray_session.kill(handle)


def call(ray, ref):
    return ray.get(ref, timeout=RAY_TIMEOUT_S)


def test_batched_put_and_get_are_fifo_and_counted(ray_session, queue):
    assert call(ray_session, queue.put_batch.remote([make_group(i) for i in range(3)], timeout_s=5)) == PutResult(
        accepted=3, closed=False, timed_out=False
    )
    first = call(ray_session, queue.get_batch.remote(2, timeout_s=5))
    assert (uids(first.groups), first.status) == (["p0", "p1"], "ok")
    assert first.groups[0].trajectories[1].sequences[0].response_versions == [0, 0]  # payload crossed Ray intact
    stats = call(ray_session, queue.stats.remote())
    assert (stats["size"], stats["total_put"], stats["total_got"]) == (1, 3, 2)


def test_put_on_a_full_queue_waits_until_a_get_frees_space(ray_session, queue):
    call(ray_session, queue.put_batch.remote([make_group(i) for i in range(4)], timeout_s=5))
    pending_put = queue.put_batch.remote([make_group(4), make_group(5)], timeout_s=RAY_TIMEOUT_S)
    ready, _ = ray_session.wait([pending_put], timeout=0.5)
    assert not ready, "a put on a full queue must wait, not evict or fail"
    got = call(ray_session, queue.get_batch.remote(2, timeout_s=5))
    assert uids(got.groups) == ["p0", "p1"]
    assert call(ray_session, pending_put) == PutResult(accepted=2, closed=False, timed_out=False)
    snapshot = call(ray_session, queue.snapshot.remote())
    assert uids(snapshot) == ["p2", "p3", "p4", "p5"]  # nothing was evicted, order kept


def test_put_timeout_reports_how_many_groups_got_in(ray_session, queue):
    call(ray_session, queue.put_batch.remote([make_group(i) for i in range(3)], timeout_s=5))
    result = call(ray_session, queue.put_batch.remote([make_group(i) for i in range(3, 6)], timeout_s=0.2))
    assert result == PutResult(accepted=1, closed=False, timed_out=True)
    assert uids(call(ray_session, queue.snapshot.remote())) == ["p0", "p1", "p2", "p3"]


def test_get_timeout_returns_nothing_and_removes_nothing(ray_session, queue):
    assert call(ray_session, queue.get_batch.remote(2, timeout_s=0.2)) == GetResult([], "timeout")
    call(ray_session, queue.put_batch.remote([make_group(0)], timeout_s=5))
    assert call(ray_session, queue.get_batch.remote(2, timeout_s=0.2)) == GetResult([], "timeout")
    assert call(ray_session, queue.stats.remote())["size"] == 1


def test_a_zero_timeout_get_takes_groups_already_queued(ray_session, queue):
    call(ray_session, queue.put_batch.remote([make_group(0), make_group(1)], timeout_s=5))
    assert uids(call(ray_session, queue.get_batch.remote(2, timeout_s=0)).groups) == ["p0", "p1"]


def test_close_wakes_a_waiting_get_which_drains_then_reports_closed(ray_session, queue):
    call(ray_session, queue.put_batch.remote([make_group(0)], timeout_s=5))
    waiting_get = queue.get_batch.remote(3, timeout_s=RAY_TIMEOUT_S * 10)
    ready, _ = ray_session.wait([waiting_get], timeout=0.5)
    assert not ready
    call(ray_session, queue.close.remote())
    drained = call(ray_session, waiting_get)  # returns well before its own 600 s timeout: close woke it
    assert (uids(drained.groups), drained.status) == (["p0"], "ok")
    assert call(ray_session, queue.get_batch.remote(3, timeout_s=5)) == GetResult([], "closed")
    assert call(ray_session, queue.put_batch.remote([make_group(9)], timeout_s=5)) == PutResult(0, True, False)
    stats = call(ray_session, queue.stats.remote())
    assert (stats["closed"], stats["total_rejected_closed"], stats["size"]) == (True, 1, 0)


def test_close_wakes_a_waiting_put(ray_session, queue):
    call(ray_session, queue.put_batch.remote([make_group(i) for i in range(4)], timeout_s=5))
    waiting_put = queue.put_batch.remote([make_group(4)], timeout_s=RAY_TIMEOUT_S * 10)
    ready, _ = ray_session.wait([waiting_put], timeout=0.5)
    assert not ready
    call(ray_session, queue.close.remote())
    assert call(ray_session, waiting_put) == PutResult(accepted=0, closed=True, timed_out=False)


def test_a_get_larger_than_the_queue_is_refused_at_once(ray_session, queue):
    with pytest.raises(ValueError, match=r"must ask for 1\.\.4 groups"):
        call(ray_session, queue.get_batch.remote(5, timeout_s=RAY_TIMEOUT_S))


def test_stats_report_oldest_version_and_trajectory_states(ray_session, queue):
    groups = [make_group(0, version=3), make_group(1, version=1, failed=True), make_group(2, version=2)]
    call(ray_session, queue.put_batch.remote(groups, timeout_s=5))
    stats = call(ray_session, queue.stats.remote())
    assert stats["oldest_min_version"] == 1
    assert stats["trajectories_by_status"] == {"ok": 4, "failed": 2}
    assert stats["oldest_created_at"] == groups[0].created_at
    assert (stats["max_size"], stats["waiting_puts"], stats["waiting_gets"]) == (4, 0, 0)


def test_snapshot_copies_the_queue_without_consuming_it(ray_session, queue):
    groups = [make_group(0, version=5), make_group(1)]
    call(ray_session, queue.put_batch.remote(groups, timeout_s=5))
    assert call(ray_session, queue.snapshot.remote()) == groups
    assert call(ray_session, queue.get_batch.remote(2, timeout_s=5)).groups == groups


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
