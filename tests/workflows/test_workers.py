"""The isolated worker pool: hung calls are killed within their timeout, crashes fail one call, never the run."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from rllm.experimental.fully_async.workers import IsolatedCallError, WorkerPool


def add(a: int, b: int) -> int:
    return a + b


def hang_forever() -> None:
    while True:
        time.sleep(1)


def die() -> None:
    os._exit(7)


def fail() -> None:
    raise ValueError("bad input\nsecond line")


def worker_pid() -> int:
    return os.getpid()


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(max_workers=1, kill_grace_s=10.0) as p:
        yield p


def test_call_returns_the_result_from_another_process(pool):
    assert asyncio.run(pool.call(add, 2, 3, timeout_s=30)) == 5
    assert asyncio.run(pool.call(worker_pid, timeout_s=30)) != os.getpid()


def test_hung_call_is_killed_within_its_timeout_and_the_next_call_works(pool):
    async def scenario():
        pid_before = await pool.call(worker_pid, timeout_s=30)
        start = time.monotonic()
        with pytest.raises(IsolatedCallError) as info:
            await pool.call(hang_forever, timeout_s=1.0)
        elapsed = time.monotonic() - start
        assert info.value.kind == "timeout"
        assert "within 1s" in info.value.reason
        assert elapsed < 1.0 + 5.0, f"the hung call took {elapsed:.1f}s to fail"
        # The one worker was killed and replaced: the next call runs in a new process.
        assert await pool.call(add, 1, 1, timeout_s=30) == 2
        assert await pool.call(worker_pid, timeout_s=30) != pid_before

    asyncio.run(scenario())


def test_crash_fails_one_call_only(pool):
    async def scenario():
        results = await asyncio.gather(
            pool.call(die, timeout_s=30), pool.call(add, 4, 5, timeout_s=30), return_exceptions=True
        )
        assert isinstance(results[0], IsolatedCallError) and results[0].kind == "crash"
        assert "exit code 7" in results[0].reason
        assert results[1] == 9

    asyncio.run(scenario())


def test_a_worker_dead_before_its_call_start_is_read_fails_that_call_alone_with_its_exit_code():
    """pebble reads a call's start on one thread and notices dead workers on another; under load a call that kills
    its worker at once was noticed first, which broke the whole pool ("All workers expired") and lost the exit code.
    Reading every message late here makes that order certain."""
    with WorkerPool(max_workers=2, kill_grace_s=10.0) as late_pool:
        manager = late_pool._get_pool()._pool_manager
        read_next_message = manager.process_next_message

        def read_late(timeout: float) -> None:
            time.sleep(0.2)
            read_next_message(timeout)

        manager.process_next_message = read_late

        async def scenario():
            return await asyncio.gather(
                late_pool.call(die, timeout_s=30), late_pool.call(add, 4, 5, timeout_s=30), return_exceptions=True
            )

        crashed, added = asyncio.run(scenario())
        assert isinstance(crashed, IsolatedCallError) and crashed.kind == "crash", crashed
        assert "exit code 7" in crashed.reason, crashed.reason
        assert added == 9
        assert asyncio.run(late_pool.call(add, 1, 2, timeout_s=30)) == 3


def test_exception_comes_back_as_one_line_reason(pool):
    with pytest.raises(IsolatedCallError) as info:
        asyncio.run(pool.call(fail, timeout_s=30))
    assert info.value.kind == "exception"
    assert info.value.reason.endswith("raised ValueError: bad input second line")
    assert "\n" not in info.value.reason


def test_reference_string_is_resolved_in_the_worker(pool, tmp_path):
    user = tmp_path / "user_code.py"
    user.write_text("import os\ndef triple(x):\n    return 3 * x\n")
    assert asyncio.run(pool.call(f"{user}:triple", 4, timeout_s=30)) == 12
    assert asyncio.run(pool.call("operator:mul", 6, 7, timeout_s=30)) == 42
    with pytest.raises(IsolatedCallError) as info:
        asyncio.run(pool.call(f"{user}:missing", timeout_s=30))
    assert info.value.kind == "exception" and "missing" in info.value.reason


def test_closed_pool_refuses_calls():
    p = WorkerPool(max_workers=1)
    p.close()
    with pytest.raises(IsolatedCallError) as info:
        asyncio.run(p.call(add, 1, 2, timeout_s=5))
    assert info.value.kind == "closed"
