"""The rollout service's one-call contract: a trainer loop gets full batches with one `take_batch` per step that
acknowledges the previous one; stale groups are dropped inside (ledgered, budget freed) and never returned; every
sample ends trained exactly once (journal audit); a full queue back-pressures the executor; a timeout takes nothing.

Real components: the RolloutExecutor with its StalenessManager, the SampleLedger with its journal file, the
MessageQueue, the PromptIterator, and (last test) the Ray actor boundary. The workflow is a plug-in that generates
no text (no engine is needed to test the scheduling): each sample is one token tagged with the version the
"engine" holds, which the test moves as a trainer's weight syncs would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys

import pytest
import ray
import ray.cloudpickle
import rollout_helpers
from rollout_helpers import SAMPLES, WAIT_S, make_service, run

from rllm.experimental.fully_async.api.step_messages import Ack, BatchRequest
from rllm.experimental.fully_async.core.ledger_format import history_counts
from rllm.experimental.fully_async.runtime.rollout.ledger_journal import read_journal


def test_a_trainer_loop_gets_full_batches_and_every_sample_ends_trained_exactly_once(tmp_path):
    journal = tmp_path / "ledger.jsonl"

    async def scenario():
        service, workflow = make_service(12, journal=journal)
        rollouts = asyncio.create_task(service.run())
        version, ack, sizes = 0, Ack(), []
        while True:
            batch = await service.take_batch(BatchRequest(2, version, ack, timeout_s=WAIT_S))
            if batch.status == "closed":
                break
            assert batch.status == "ok" and batch.stale_groups == 0
            assert batch.metrics["ledger/issued"] >= batch.metrics["ledger/trained"]  # the report comes along
            sizes.append(len(batch.groups))
            ack = Ack.of(batch.groups)
            version += 1  # a weight sync after every step
            workflow.engine_version = version
        await rollouts
        return sizes, service.ledger.counts()

    sizes, counts = run(scenario())
    assert sizes == [2] * 6
    assert counts["trained"] == counts["issued"] == 12 * SAMPLES and counts["in_flight"] == 0
    assert history_counts(read_journal(journal)) == counts  # each sample issued once and ended once


def test_stale_groups_are_dropped_inside_ledgered_and_their_budget_freed():
    async def scenario():
        service, workflow = make_service(20, max_staleness=0, groups_per_version=2)
        rollouts = asyncio.create_task(service.run())
        # Budget at version 0: (0 + 0 + 1) * 2 groups; both finish and wait, tagged version 0.
        assert await service.queue.wait_for(lambda: len(service.queue) == 2, WAIT_S)
        workflow.engine_version = 2  # the trainer synced twice meanwhile (e.g. it resumed ahead)
        batch = await service.take_batch(BatchRequest(2, 2, Ack(), timeout_s=WAIT_S))
        counts, budget = service.ledger.counts(), service.executor.staleness.counts()
        service.stop()
        await rollouts
        return batch, counts, budget

    batch, counts, budget = run(scenario())
    assert batch.status == "ok" and batch.stale_groups == 2
    assert [g.min_version for g in batch.groups] == [2, 2]  # only fresh groups cross
    assert counts["dropped_stale"] == 2 * SAMPLES
    assert budget.discarded == 2  # their slots came back, so the replacements could start


def test_a_full_queue_back_pressures_the_executor_until_the_trainer_takes():
    async def scenario():
        service, _ = make_service(20, max_groups=2, max_staleness=50, max_concurrent=SAMPLES)
        rollouts = asyncio.create_task(service.run())
        assert await service.queue.wait_for(lambda: service.queue.backlog == 1, WAIT_S)
        await asyncio.sleep(0.2)  # time enough to start more, were it allowed
        started_while_full = service.executor.stats.groups_started
        batch = await service.take_batch(BatchRequest(2, 0, Ack(), timeout_s=WAIT_S))
        assert await service.queue.wait_for(lambda: service.queue.backlog == 1 and len(service.queue) == 2, WAIT_S)
        started_after = service.executor.stats.groups_started
        service.stop()
        await rollouts
        return started_while_full, len(batch.groups), started_after

    started_while_full, taken, started_after = run(scenario())
    assert started_while_full == 3  # 2 queued + 1 in the backlog, then nothing new
    assert taken == 2 and started_after == 5


def test_a_request_that_times_out_takes_nothing_but_its_acknowledgement_counts():
    async def scenario():
        service, _ = make_service(4)
        service.executor.set_paused(True)
        service.executor.ledger.issue(["e0/0/0"])
        service.executor.staleness.on_start()
        service.executor.staleness.on_finish(accepted=True)
        batch = await service.take_batch(BatchRequest(1, 0, Ack(("e0/0/0",), 1), timeout_s=0.1))
        return batch, service.ledger.counts()

    batch, counts = run(scenario())
    assert (batch.status, batch.groups) == ("timeout", [])
    assert counts["trained"] == 1


def test_an_interrupt_answers_the_waiting_request_at_once_and_takes_nothing():
    """A trainer waiting for a batch that will not come (generation paused: no engine left) is released by
    `interrupt()` within the wait, not after its timeout; the groups already queued stay queued for the checkpoint,
    and every later request is answered at once the same way."""

    async def scenario():
        service, _ = make_service(20)
        rollouts = asyncio.create_task(service.run())
        assert await service.queue.wait_for(lambda: len(service.queue) >= 2, WAIT_S)
        service.executor.set_paused(True)  # as with no engine: nothing more arrives
        queued = len(service.queue)
        started = asyncio.get_running_loop().time()
        waiting = asyncio.create_task(service.take_batch(BatchRequest(queued + 1, 0, Ack(), timeout_s=WAIT_S)))
        await asyncio.sleep(0.2)
        assert not waiting.done(), "the request waits while the queue cannot fill it"
        service.interrupt()
        batch = await asyncio.wait_for(waiting, 5.0)
        waited = asyncio.get_running_loop().time() - started
        later = await asyncio.wait_for(service.take_batch(BatchRequest(1, 0, Ack(), timeout_s=WAIT_S)), 5.0)
        left = len(service.queue)
        service.stop()
        service.executor.set_paused(False)
        await rollouts
        return batch, later, waited, queued, left

    batch, later, waited, queued, left = run(scenario())
    assert (batch.status, batch.groups) == ("interrupted", [])
    assert waited < WAIT_S / 2
    assert (later.status, later.groups) == ("interrupted", [])
    assert left == queued, "an interrupted request takes nothing"


@ray.remote(num_cpus=0)
class _ServiceOverRay:
    """The RolloutService in an async Ray actor, as RolloutServiceActor hosts it (that one builds from the run spec)."""

    def __init__(self, journal: str) -> None:
        # A budget that never makes a group stale here: this test is about the process boundary.
        self.service, self.workflow = make_service(10, max_staleness=10, groups_per_version=3, journal=journal)

    async def run(self) -> dict:
        return await self.service.run()

    async def take_batch(self, request: BatchRequest):
        self.workflow.engine_version = request.version
        return await self.service.take_batch(request)

    def acknowledge(self, ack: Ack) -> None:
        self.service.acknowledge(ack)

    def counts(self) -> dict:
        return self.service.ledger.counts()


def test_over_ray_one_call_per_step_moves_batches_and_acknowledgements(ray_session, tmp_path):
    from rllm.experimental.fully_async.runtime.trainer.actor import _RolloutServiceClient

    # The worker cannot import this test module or the helpers: ship their classes by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(rollout_helpers)
    journal = tmp_path / "ledger.jsonl"
    actor = _ServiceOverRay.remote(str(journal))
    try:
        run_ref = actor.run.remote()
        client = _RolloutServiceClient(actor, sync_gate_timeout_s=60.0)
        version, ack, steps = 0, Ack(), 0
        while True:
            batch = client.take_batch(BatchRequest(3, version, ack, timeout_s=WAIT_S))
            if batch.status == "closed":
                break
            ack, version, steps = Ack.of(batch.groups), version + 1, steps + 1
        ray.get(run_ref, timeout=WAIT_S)
        counts = ray.get(actor.counts.remote(), timeout=WAIT_S)
    finally:
        ray.kill(actor)
    assert steps == 4  # 3 + 3 + 3 + the short last batch of 1
    assert counts["trained"] == counts["issued"] == 10 * SAMPLES
    assert history_counts(read_journal(journal)) == counts


def test_the_real_actor_takes_every_setting_from_the_run_spec(ray_session, tmp_path):
    """RolloutServiceActor gets the frozen RunSpec, never the config: a spec changed after it was built (values no
    config file holds) is what the actor runs with."""
    import pandas as pd

    from rllm.experimental.fully_async.run_spec import build_run_spec
    from rllm.experimental.fully_async.runtime.rollout.actor import RolloutServiceActor
    from rllm.experimental.fully_async.settings.loader import load_config
    from rllm.experimental.fully_async.tasks import addition

    train, _ = addition.write_addition_parquets(tmp_path, seed=0, num_train=12, num_val=4)
    rows = pd.read_parquet(train)
    for i in range(0, 12, 3):  # every third prompt one character longer ("35+77=" -> "35+77+0=")
        content = rows.at[i, "prompt"][0]["content"]
        rows.at[i, "prompt"] = [{"role": "user", "content": content[:-1] + "+0="}]
    rows.to_parquet(train, index=False)
    addition.build_addition_tokenizer().save_pretrained(tmp_path / "tokenizer")
    overrides = [f"data.train_files={train}", "data.val_files=null", "data.max_prompt_length=64"]
    overrides += [f"actor_rollout_ref.model.path={tmp_path / 'tokenizer'}", f"run.dir={tmp_path / 'config_dir'}"]
    spec = build_run_spec(load_config(None, ["task.name=null", *overrides]))
    data = dataclasses.replace(spec.executor.data, max_prompt_length=6, overlong="filter")  # the longer ones go
    spec = dataclasses.replace(
        spec,
        executor=dataclasses.replace(spec.executor, data=data, queue_max_groups=7),
        run=dataclasses.replace(spec.run, dir=str(tmp_path / "spec_dir")),
    )
    actor = RolloutServiceActor.remote(spec, ["http://127.0.0.1:9"])  # no engine: nothing here generates
    try:
        counts = ray.get(actor.ledger_counts.remote(), timeout=WAIT_S)
        metrics = ray.get(actor.metrics.remote(), timeout=WAIT_S)
        ray.get(actor.aclose.remote(), timeout=WAIT_S)
    finally:
        ray.kill(actor)
    assert counts["issued"] == counts["filtered"] == 4  # the spec's prompt limit, not the config's 64
    assert metrics["queue/max_size"] == 7
    assert (tmp_path / "spec_dir" / "ledger.jsonl").exists() and not (tmp_path / "config_dir").exists()


@pytest.mark.parametrize("n", [0, 101])
def test_a_request_the_queue_can_never_fill_is_refused(n):
    service, _ = make_service(2)
    with pytest.raises(ValueError, match=r"must ask for 1\.\.100"):
        run(service.take_batch(BatchRequest(n, 0)))


def test_a_filter_that_drops_groups_still_yields_full_batches_and_reports_what_it_dropped():
    from rllm.experimental.fully_async.algorithms.filters import FilterConfig, build_group_filter

    async def scenario():
        service, workflow = make_service(30, max_staleness=0, groups_per_version=2)
        # Every third prompt gets equal rewards: the zero-variance filter drops it, and its budget slot comes back.
        original = workflow.run

        async def run_with_equal_rewards(client, tokenizer, datum, sample_index):
            trajectory = await original(client, tokenizer, datum, sample_index)
            if datum.record.index % 3 == 0:
                trajectory.reward = 1.0
            return trajectory

        workflow.run = run_with_equal_rewards
        service.executor.group_filter = build_group_filter(FilterConfig(drop_zero_variance=True))
        rollouts = asyncio.create_task(service.run())
        batches = []
        for version in range(3):
            workflow.engine_version = version  # the engines hold the trainer's weights (a sync per step)
            batch = await service.take_batch(BatchRequest(2, version, Ack.of(batches[-1].groups) if batches else Ack()))
            batches.append(batch)
        service.stop()
        await rollouts
        return batches, service.ledger.counts()

    batches, counts = run(scenario())
    assert [len(b.groups) for b in batches] == [2, 2, 2]
    assert all(len(set(g.rewards)) > 1 for b in batches for g in b.groups)
    dropped = sum(b.metrics.get("filter/dropped_trajectories/zero_reward_variance", 0.0) for b in batches)
    assert dropped == counts["filtered/zero_reward_variance"] > 0
