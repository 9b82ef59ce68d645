"""Benchmark (a script, not a test): MessageQueue throughput, batched Ray calls against one call per trajectory.

Run from the repository root: `.venv/bin/python tests/bench/bench_queue.py [--batch 64] [--seconds 5]` (the package
must be importable: installed by install/install_cpu.sh, or with PYTHONPATH=.).

A producer (the driver) puts one-trajectory groups while a consumer thread gets them, both through the real
MessageQueue actor, with a few calls in flight each (as the executor and trainer would). Each mode runs for about
`--seconds` and the script prints trajectories/s for both modes and their ratio side by side. Numbers depend on
the machine's load: compare the two modes of one run, not runs with each other.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from collections import deque

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # bind loopback only (ENVIRONMENT.md)

import ray  # after the variables above, so every Ray code path sees them

from rllm.experimental.fully_async.core.protocol import Sequence, Trajectory, TrajectoryGroup
from rllm.experimental.fully_async.runtime.message_queue import MessageQueue

logger = logging.getLogger(__name__)
IN_FLIGHT = 4  # calls each side keeps outstanding: enough to hide one round trip, as an async caller would
CALL_TIMEOUT_S = 60


def make_group(i: int) -> TrajectoryGroup:
    """One trajectory of a 6-token prompt and a 4-token answer, the addition task's shape."""
    seq = Sequence(
        prompt_ids=[3, 4, 13, 5, 6, 14],
        response_ids=[3, 7, 9, 1],
        response_logprobs=[-0.5] * 4,
        response_versions=[0] * 4,
    )
    return TrajectoryGroup(f"p{i}", [Trajectory(uid=f"p{i}/0", prompt_uid=f"p{i}", sequences=[seq])])


def run_mode(per_call: int, seconds: float) -> tuple[int, float]:
    """Move trajectories through a fresh queue for ~`seconds`; return (trajectories moved, elapsed seconds)."""
    queue = MessageQueue.remote(max_groups=max(1024, 8 * per_call))
    ray.get(queue.stats.remote(), timeout=CALL_TIMEOUT_S)  # actor started before the clock starts
    batches = [[make_group(i * per_call + k) for k in range(per_call)] for i in range(256)]
    got = 0
    stop = threading.Event()

    def consume() -> None:
        nonlocal got
        pending: deque = deque()
        while not (stop.is_set() and not pending):
            while not stop.is_set() and len(pending) < IN_FLIGHT:
                pending.append(queue.get_batch.remote(per_call, timeout_s=1.0))
            result = ray.get(pending.popleft(), timeout=CALL_TIMEOUT_S)
            got += len(result.groups)

    consumer = threading.Thread(target=consume, daemon=True)
    start = time.perf_counter()
    consumer.start()
    pending: deque = deque()
    i = 0
    while time.perf_counter() - start < seconds:
        pending.append(queue.put_batch.remote(batches[i % len(batches)], timeout_s=CALL_TIMEOUT_S))
        i += 1
        if len(pending) >= IN_FLIGHT:
            ray.get(pending.popleft(), timeout=CALL_TIMEOUT_S)
    ray.get(list(pending), timeout=CALL_TIMEOUT_S)
    # Let the consumer drain what was put, then stop it.
    while got < i * per_call and time.perf_counter() - start < seconds + CALL_TIMEOUT_S:
        time.sleep(0.01)
    elapsed = time.perf_counter() - start
    stop.set()
    consumer.join(timeout=CALL_TIMEOUT_S)
    ray.kill(queue)
    return got, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="trajectories per Ray call in the batched mode")
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each mode")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=1_000_000_000, configure_logging=False)
    try:
        single_n, single_s = run_mode(1, args.seconds)
        batched_n, batched_s = run_mode(args.batch, args.seconds)
    finally:
        ray.shutdown()
    single_rate, batched_rate = single_n / single_s, batched_n / batched_s
    # The result table is this script's output, so it goes to stdout rather than a logger.
    print(f"{'mode':<24}{'trajectories':>14}{'seconds':>10}{'traj/s':>12}")
    print(f"{'1 per call':<24}{single_n:>14}{single_s:>10.2f}{single_rate:>12.0f}")
    print(f"{f'{args.batch} per call':<24}{batched_n:>14}{batched_s:>10.2f}{batched_rate:>12.0f}")
    print(f"batched / single = {batched_rate / single_rate:.1f}x")


if __name__ == "__main__":
    main()
