"""Benchmark (a script, not a test): the rollout side's queue and the one call per trainer step.

Run from the repository root: `PYTHONPATH=. .venv/bin/python tests/bench/bench_queue.py [--groups 16] [--seconds 5]`.

Two figures, side by side:
- in-process: groups/s through the rollout service's MessageQueue (put by the executor, pop by take_batch), which
  no longer crosses a process (issue 11: the separate MessageQueue actor is gone);
- one take_batch over Ray: a Batch of `--groups` groups of `--samples` one-trajectory samples (the addition task's
  shape) returned by an async actor, as the trainer's one call per step does; calls/s and ms per call.
Numbers depend on the machine's load: compare figures of one invocation, not invocations with each other.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # bind loopback only (ENVIRONMENT.md)

import ray  # after the variables above, so every Ray code path sees them

from rllm.experimental.fully_async.api.step_messages import Batch, BatchRequest
from rllm.experimental.fully_async.api.trajectory import VersionedGroup, VersionedSequence, VersionedTrajectory
from rllm.experimental.fully_async.runtime.rollout.message_queue import MessageQueue

CALL_TIMEOUT_S = 60


def make_group(i: int, samples: int) -> VersionedGroup:
    """`samples` trajectories of a 6-token prompt and a 4-token answer, the addition task's shape."""
    seq = VersionedSequence([3, 4, 13, 5, 6, 14], [3, 7, 9, 1], [-0.5] * 4, [0] * 4)
    return VersionedGroup(f"e0/{i}", [VersionedTrajectory(f"e0/{i}/{k}", f"e0/{i}", [seq]) for k in range(samples)])


def in_process(groups_per_batch: int, samples: int, seconds: float) -> float:
    async def loop() -> float:
        queue = MessageQueue(max_groups=4 * groups_per_batch)
        batch = [make_group(i, samples) for i in range(groups_per_batch)]
        moved, started = 0, time.monotonic()
        while time.monotonic() - started < seconds:
            for group in batch:
                queue.put([group])  # the executor puts each group as it finishes
            moved += len((await queue.get_batch(groups_per_batch, CALL_TIMEOUT_S)).groups)
        return moved / (time.monotonic() - started)

    return asyncio.run(loop())


@ray.remote(num_cpus=0)
class _Serve:
    def __init__(self, groups: int, samples: int) -> None:
        self.groups = [make_group(i, samples) for i in range(groups)]

    async def take_batch(self, request: BatchRequest) -> Batch:
        return Batch(self.groups[: request.n_groups], "ok", 0, 0.0, {"queue/size": 0.0})


def over_ray(groups_per_batch: int, samples: int, seconds: float) -> float:
    actor = _Serve.remote(groups_per_batch, samples)
    try:
        request = BatchRequest(groups_per_batch, 0)
        ray.get(actor.take_batch.remote(request), timeout=CALL_TIMEOUT_S)  # warm up
        calls, started = 0, time.monotonic()
        while time.monotonic() - started < seconds:
            ray.get(actor.take_batch.remote(request), timeout=CALL_TIMEOUT_S)
            calls += 1
        return calls / (time.monotonic() - started)
    finally:
        ray.kill(actor)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16, help="groups per batch (required_samples)")
    parser.add_argument("--samples", type=int, default=4, help="samples per group (rollout.n)")
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each measurement")
    args = parser.parse_args()
    groups_per_s = in_process(args.groups, args.samples, args.seconds)
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        calls_per_s = over_ray(args.groups, args.samples, args.seconds)
    finally:
        ray.shutdown()
    print(f"in-process queue: {groups_per_s:,.0f} groups/s")
    print(f"take_batch over Ray ({args.groups} groups x {args.samples}): {calls_per_s:,.0f} calls/s")
    print(f"                  = {1000 / calls_per_s:.2f} ms per trainer step")


if __name__ == "__main__":
    main()
