"""Token-level resume below the CLI: a checkpoint of the rollout side holds every generating sample's tokens so far
(an agent's episode too), consistent with its ledger and queue, and a rollout side restored from it continues each
sample from them instead of generating it again; the journal says which went on and which restarted.

Real components: embedded engines, the EngineClient, the RolloutService with its executor, queue and journaled
ledger, the single-turn and multi-turn workflows and the number-line environment. The agent tests drive the
multi-turn workflow with a scripted client that honours progress records as the engine client does. The CLI runs
(SIGKILL between checkpoints, then resume) are in tests/e2e/test_resume.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from engine_helpers import TEST_ONLY_ROUTES, decode_hold, wait_for_idle
from workflow_helpers import Datum

from rllm.experimental.fully_async.api.progress import (
    CONTINUED,
    ENV_NOT_RESTORED,
    NOTHING_SAVED,
    PARTIAL_ROLLOUT_OFF,
    PROGRESS_NOT_SAVED,
    WORKFLOW_NOT_RESUMABLE,
    GenerationProgress,
    SampleProgress,
)
from rllm.experimental.fully_async.api.step_messages import Ack, BatchRequest
from rllm.experimental.fully_async.api.trajectory import TrajectoryStatus
from rllm.experimental.fully_async.core.ledger import SampleLedger
from rllm.experimental.fully_async.data.prompts import PromptDataset, PromptIterator
from rllm.experimental.fully_async.engines import EmbeddedEngineCommand, EngineLauncher
from rllm.experimental.fully_async.engines.client import EngineClient, GenerationResult
from rllm.experimental.fully_async.envs import EnvSpec
from rllm.experimental.fully_async.envs.session import EnvError, IsolatedEnv
from rllm.experimental.fully_async.observe.metrics_sink import RunSummary, summary_lines
from rllm.experimental.fully_async.observe.summary import RunTotals
from rllm.experimental.fully_async.runtime.rollout.executor import ExecutorSettings, RolloutExecutor
from rllm.experimental.fully_async.runtime.rollout.ledger_journal import journaled_ledger, read_journal
from rllm.experimental.fully_async.runtime.rollout.message_queue import MessageQueue
from rllm.experimental.fully_async.runtime.rollout.service import RolloutService
from rllm.experimental.fully_async.runtime.rollout.validation import SyncGate
from rllm.experimental.fully_async.tasks.addition import (
    build_addition_model,
    build_addition_tokenizer,
    compute_score,
    write_addition_parquets,
)
from rllm.experimental.fully_async.tasks.number_line import VOCAB, build_tokenizer
from rllm.experimental.fully_async.workflows import SingleTurnWorkflow
from rllm.experimental.fully_async.workflows.multi_turn import MultiTurnWorkflow
from rllm.experimental.fully_async.workflows.rllm_compat import RllmRolloutWorkflow

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

SAMPLES = 2
WAIT_S = 120.0
# ignore_eos: every sample decodes 48 tokens (the model's context is 64), so samples are surely mid-generation
# when the checkpoint is taken.
LONG = {"temperature": 1.0, "max_new_tokens": 48, "ignore_eos": True}


# --- single-turn, through the rollout service and a real engine -------------------------------------------------------


@pytest.fixture(scope="module")
def addition(tmp_path_factory):
    tokenizer = build_addition_tokenizer()
    model_dir = tmp_path_factory.mktemp("addition_model")
    build_addition_model(seed=0).save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    train, _ = write_addition_parquets(tmp_path_factory.mktemp("addition_data"), seed=0, num_train=40, num_val=1)
    command = EmbeddedEngineCommand(str(model_dir), max_running_requests=64, num_threads=1, extra_args=TEST_ONLY_ROUTES)
    with EngineLauncher(command, 1, startup_timeout_s=180, log_dir=tmp_path_factory.mktemp("engine_logs")) as eng:
        yield eng.urls, PromptDataset(train, tokenizer, max_prompt_length=16), tokenizer


def make_service(
    urls, dataset, tokenizer, journal, workflow=None, max_staleness=20, partial_rollout=True
) -> RolloutService:
    queue = MessageQueue(100)
    settings = ExecutorSettings(SAMPLES, max_staleness, 2, max_concurrent_rollouts=8, partial_rollout=partial_rollout)
    executor = RolloutExecutor(
        settings,
        PromptIterator(dataset, seed=0, num_epochs=1, shuffle=False),
        workflow or SingleTurnWorkflow(compute_score, dict(LONG)),
        EngineClient(urls, partial_rollout=partial_rollout),
        tokenizer,
        queue,
        ledger=journaled_ledger(journal),
    )
    return RolloutService(executor, queue)


async def checkpoint_mid_generation(service: RolloutService) -> tuple[dict, list]:
    """Run the service until samples are mid-generation, take its checkpoint state as `write_checkpoint` does (the
    engines paused to collect the tokens in flight), and stop it: the crash."""
    client = service.executor.client
    await wait_for_idle(client, client.urls[0])  # so the requests the hold counts are this service's
    # The checkpoint's pause meets the samples of the first prefill decoding: the engine holds at their first token
    # (decode_hold); samples sent later wait in its queue, unstarted.
    async with decode_hold(client.urls[0], min_tokens=1) as hold:
        rollouts = asyncio.create_task(service.run())
        await hold.reached()
        state, queued = await service.collected_checkpoint_state()
    service.stop()
    await rollouts
    await client.aclose()
    return json.loads(json.dumps(state)), queued  # as rollout.json gives it back


async def resume_until(service: RolloutService, state: dict, queued: list, uids: set[str]) -> dict:
    """Restore the checkpoint into a new service and take batches until every sample in `uids` came through;
    returns their trajectories by uid."""
    service.executor.load_state_dict(state, queued)
    service.queue.put(queued)
    rollouts = asyncio.create_task(service.run())
    seen, ack = {}, Ack()
    while not uids <= set(seen):
        batch = await service.take_batch(BatchRequest(1, 0, ack, timeout_s=WAIT_S))
        assert batch.status == "ok"
        seen |= {t.uid: t for g in batch.groups for t in g.trajectories}
        ack = Ack.of(batch.groups)
    service.acknowledge(ack)
    service.stop()
    await rollouts
    await service.executor.client.aclose()
    return seen


def test_a_checkpoint_holds_each_generating_samples_tokens_and_the_resumed_service_continues_them(addition, tmp_path):
    urls, dataset, tokenizer = addition
    journal = tmp_path / "ledger.jsonl"

    async def scenario():
        state, queued = await checkpoint_mid_generation(make_service(urls, dataset, tokenizer, journal))
        saved = state["in_flight_progress"]
        resumed = await resume_until(make_service(urls, dataset, tokenizer, journal), state, queued, set(saved))
        return state, queued, resumed

    state, queued, resumed = asyncio.run(asyncio.wait_for(scenario(), WAIT_S))
    saved = state["in_flight_progress"]
    # Consistent with the ledger and the queue: every saved sample is in flight and not queued.
    queued_uids = {t.uid for g in queued for t in g.trajectories}
    assert saved and set(saved) <= set(state["ledger"]["in_flight"]) - queued_uids
    assert any(0 < len(doc["generation"]["output_ids"]) < 48 for doc in saved.values()), "caught mid-generation"
    for uid, doc in saved.items():
        generation, sequence = doc["generation"], resumed[uid].sequences[0]
        n = len(generation["output_ids"])
        assert sequence.response_ids[:n] == generation["output_ids"], f"{uid} starts with its saved tokens"
        assert sequence.response_logprobs[:n] == generation["logprobs"]
        assert sequence.response_versions[:n] == generation["versions"] and len(sequence.response_ids) == 48
    outcomes: dict[str, str] = {}
    history = read_journal(journal, outcomes)  # the audit: every sample issued and ended at most once
    assert {uid for uid, outcome in outcomes.items() if outcome == CONTINUED} == set(saved)
    unsaved = set(state["ledger"]["in_flight"]) - queued_uids - set(saved)
    assert all(outcomes[uid] == NOTHING_SAVED for uid in unsaved if uid in outcomes)
    assert all(history[uid][0].value == "trained" for uid in saved)


def test_a_continued_sample_too_stale_to_train_is_dropped_and_counted_as_any(addition, tmp_path):
    """The saved tokens keep their versions: resumed by a trainer two versions on (η = 1), the continued samples'
    groups are too stale and are dropped inside the service, ledgered dropped_stale after `continued`."""
    urls, dataset, tokenizer = addition
    journal = tmp_path / "ledger.jsonl"

    async def scenario():
        state, queued = await checkpoint_mid_generation(make_service(urls, dataset, tokenizer, journal))
        service = make_service(urls, dataset, tokenizer, journal, max_staleness=1)
        service.executor.load_state_dict(state, queued)
        service.queue.put(queued)
        rollouts = asyncio.create_task(service.run())
        # Batches are asked for until the continued samples have ended (however long their tokens take on a busy
        # machine): each take_batch waits on the queue's changes and drops what comes stale.
        stale_groups, fresh = 0, []
        while set(state["in_flight_progress"]) & set(service.executor.ledger.in_flight_uids()):
            batch = await service.take_batch(BatchRequest(1, 2, Ack(), timeout_s=0.5))
            stale_groups, fresh = stale_groups + batch.stale_groups, fresh + batch.groups
        service.stop()
        await rollouts
        await service.executor.client.aclose()
        return state, stale_groups, fresh

    state, stale_groups, fresh = asyncio.run(asyncio.wait_for(scenario(), WAIT_S))
    saved = state["in_flight_progress"]
    assert stale_groups >= 1 and all(g.min_version == 2 for g in fresh)
    outcomes: dict[str, str] = {}
    history = read_journal(journal, outcomes)
    assert all(outcomes[uid] == CONTINUED and history[uid][0].value == "dropped_stale" for uid in saved)


def test_without_partial_rollout_a_resumed_unfinished_generation_restarts_from_its_prompt(addition, tmp_path):
    """partial_rollout off, as after a weight sync: a saved generation that had not finished is thrown away and the
    sample generated again from the prompt (journaled partial_rollout_off, its tokens counted as discarded); one
    that had finished is kept."""
    urls, dataset, tokenizer = addition
    journal = tmp_path / "ledger.jsonl"

    async def scenario():
        state, queued = await checkpoint_mid_generation(make_service(urls, dataset, tokenizer, journal))
        saved = state["in_flight_progress"]
        second = make_service(urls, dataset, tokenizer, journal, partial_rollout=False)
        await resume_until(second, state, queued, set(saved))
        return saved, second.executor.stats

    saved, stats = asyncio.run(asyncio.wait_for(scenario(), WAIT_S))
    unfinished = {uid for uid, doc in saved.items() if doc["generation"]["finish_reason"] is None}
    assert unfinished
    outcomes: dict[str, str] = {}
    read_journal(journal, outcomes)
    assert {uid for uid in saved if outcomes[uid] == PARTIAL_ROLLOUT_OFF} == unfinished
    assert stats.resumed_tokens_discarded == sum(len(saved[uid]["generation"]["output_ids"]) for uid in unfinished)


def test_a_workflow_that_records_no_progress_restarts_its_samples_and_says_so(addition, tmp_path, caplog):
    """An rLLM rollout function is arbitrary user code: nothing of it is checkpointed, and its samples in flight
    restart from the prompt, journaled `workflow_not_resumable` and logged."""
    urls, dataset, tokenizer = addition

    async def rollout_fn(client, tokenizer, **datum):
        from rllm.experimental.fully_async.protocol import Trajectory

        output = await client.generate(datum["prompt_ids"], dict(LONG))
        return Trajectory(sequences=[output.to_sequence()], reward=0.0)

    journal = tmp_path / "ledger.jsonl"

    async def scenario():
        first = make_service(urls, dataset, tokenizer, journal, RllmRolloutWorkflow(rollout_fn))
        state, queued = await checkpoint_mid_generation(first)
        in_flight = set(state["ledger"]["in_flight"]) - {t.uid for g in queued for t in g.trajectories}
        second = make_service(urls, dataset, tokenizer, journal, RllmRolloutWorkflow(rollout_fn))
        await resume_until(second, state, queued, in_flight)
        return state, in_flight, second.executor.stats.resumed

    with caplog.at_level("WARNING", logger="rllm.experimental.fully_async.runtime.rollout.executor"):
        state, in_flight, counted = asyncio.run(asyncio.wait_for(scenario(), WAIT_S))
    assert state["in_flight_progress"] == {} and in_flight
    assert counted == {WORKFLOW_NOT_RESUMABLE: len(in_flight)}
    outcomes: dict[str, str] = {}
    read_journal(journal, outcomes)
    assert outcomes == dict.fromkeys(in_flight, WORKFLOW_NOT_RESUMABLE)
    assert f"its {len(in_flight)} samples in flight restart from the prompt" in caplog.text


class UnsaveableAgent:
    """A resumable workflow whose episode JSON cannot hold (a tuple in a step's info, as an environment may return):
    it records two tokens and that episode, then waits for the crash. `fail=True`: the resumed run's version, which
    records what it was given and fails the sample at once."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.started: list[str] = []
        self.given: dict[str, tuple[str | None, int, Any]] = {}

    async def run(self, client, tokenizer, datum, sample_index, progress=None):
        if self.fail:
            self.given[progress.uid] = (progress.outcome, len(progress.generation), progress.episode)
            raise RuntimeError("resumed run: fail fast")
        progress.episode = {"turn": 1, "steps": [{"info": (1, 2)}], "generated_tokens": 3}
        progress.generation.output_ids += [5, 6]
        progress.generation.logprobs += [-0.5, -0.5]
        progress.generation.versions += [0, 0]
        self.started.append(progress.uid)
        await asyncio.Event().wait()


def test_progress_a_checkpoint_cannot_hold_is_named_there_and_its_sample_restarts_counted_and_logged(tmp_path, caplog):
    """An episode JSON cannot store is not silently lost: the checkpoint names the sample and its tokens
    (`in_flight_unsaved`), the resumed run starts it from the prompt, journals `progress_not_saved`, counts its
    tokens as discarded and the ledger tallies it."""
    tokenizer = build_addition_tokenizer()
    train, _ = write_addition_parquets(tmp_path, seed=0, num_train=8, num_val=1)
    dataset = PromptDataset(train, tokenizer, max_prompt_length=16)
    journal = tmp_path / "ledger.jsonl"

    def executor(workflow):
        settings = ExecutorSettings(SAMPLES, 20, 2, max_concurrent_rollouts=4)
        prompts = PromptIterator(dataset, seed=0, num_epochs=1, shuffle=False)
        return RolloutExecutor(
            settings, prompts, workflow, None, tokenizer, MessageQueue(100), ledger=journaled_ledger(journal)
        )

    async def crash(first):
        run = asyncio.create_task(first.run())
        while len(first.workflow.started) < 4:
            await asyncio.sleep(0.01)
        state = json.loads(json.dumps(first.state_dict()))  # as rollout.json holds it
        first.stop()
        await run
        return state

    first = executor(UnsaveableAgent())
    with caplog.at_level("WARNING", logger="rllm.experimental.fully_async.runtime.rollout.executor"):
        state = asyncio.run(asyncio.wait_for(crash(first), WAIT_S))
        assert "is not checkpointed and restarts from the prompt" in caplog.text and "tuple" in caplog.text
        assert state["in_flight_progress"] == {}
        assert set(state["in_flight_unsaved"]) == set(first.workflow.started)
        assert all(doc["tokens"] == 2 + 3 for doc in state["in_flight_unsaved"].values())

        second = executor(UnsaveableAgent(fail=True))
        second.load_state_dict(state, [])
        assert "4 progress_not_saved" in caplog.text
        stats = asyncio.run(asyncio.wait_for(second.run(), WAIT_S))
    restarted = set(state["in_flight_unsaved"])
    assert {uid: second.workflow.given[uid] for uid in restarted} == dict.fromkeys(
        restarted, (PROGRESS_NOT_SAVED, 0, None)
    ), "started from the prompt"
    assert stats.resumed == {PROGRESS_NOT_SAVED: 4} and stats.resumed_tokens_discarded == 4 * 5
    assert second.ledger.counts()["resumed/progress_not_saved"] == 4
    outcomes: dict[str, str] = {}
    read_journal(journal, outcomes)
    assert outcomes == dict.fromkeys(restarted, PROGRESS_NOT_SAVED)


def test_the_ledger_tally_of_continued_and_regenerated_samples_reaches_the_metrics_and_the_run_summary():
    """After a resume the run's metrics carry `ledger/resumed/<outcome>` and the end-of-run summary says how many
    samples went on from their saved tokens and how many were generated again, and why."""
    ledger = SampleLedger()
    ledger.issue([f"e0/{i}/0" for i in range(6)])
    ledger.mark_resumed(["e0/0/0", "e0/1/0", "e0/2/0"], CONTINUED)
    ledger.mark_resumed(["e0/3/0"], NOTHING_SAVED)
    ledger.mark_resumed(["e0/4/0", "e0/5/0"], ENV_NOT_RESTORED)
    totals = RunTotals()
    totals.observe({"step": 7, **{f"ledger/{k}": v for k, v in ledger.counts().items()}})
    lines = summary_lines(RunSummary(7, None, None, None, {}, "run", totals=totals))
    resumed = [line for line in lines if line.startswith("resumed")]
    assert resumed == [
        "resumed (samples in flight at a checkpoint resumed from): 3 continued from their saved tokens; generated "
        "again from the prompt: 2 env_not_restored, 1 nothing_saved"
    ]
    totals.observe({"step": 8, "ledger/issued": 6, "ledger/in_flight": 6})  # a run never resumed: no such line
    assert not [
        line for line in summary_lines(RunSummary(8, None, None, None, {}, "run", totals=totals)) if "resumed" in line
    ]


def test_a_weight_sync_waits_for_a_checkpoint_pause_and_a_checkpoint_for_a_sync():
    """The engines' pause for collecting tokens and a weight sync's pause must not interleave (one would continue
    the engines under the other's feet); a validation does not stop a checkpoint's pause."""

    async def scenario() -> list[str]:
        gate, order = SyncGate(), []
        async with gate.collecting(5):
            sync = asyncio.create_task(gate.begin_sync(5))
            await asyncio.sleep(0.05)
            assert not sync.done()
            order.append("collected")
        await sync
        order.append("synced")
        collect = asyncio.create_task(gate.collecting(5).__aenter__())
        await asyncio.sleep(0.05)
        assert not collect.done()
        await gate.end_sync()
        await collect
        return order

    assert asyncio.run(scenario()) == ["collected", "synced"]


# --- agents: the multi-turn workflow ----------------------------------------------------------------------------------

EOS = VOCAB["<eos>"]


@dataclass
class ProgressClient:
    """Scripted actions (one per turn, by the turn in the request id) that honour a progress record as the engine
    client does: tokens already in it are kept and only the rest is "generated" (at version 1); at `hang_at` a turn
    stops after its first token and never returns, like a generation in flight at a crash."""

    tokenizer: Any
    actions: list[str]
    hang_at: int | None = None
    calls: list[tuple[int, int]] = field(default_factory=list)  # (turn, tokens already in the record)
    hanging: asyncio.Event = field(default_factory=asyncio.Event)

    async def generate(self, input_ids, sampling_params, *, rid=None, progress=None) -> GenerationResult:
        turn = int(rid.rsplit("turn", 1)[1])
        record = progress if progress is not None else GenerationProgress()
        self.calls.append((turn, len(record)))
        ids = [*self.tokenizer.encode(self.actions[turn], add_special_tokens=False), EOS]
        assert record.output_ids == ids[: len(record)], "a restored record holds the start of this turn's action"
        if turn == self.hang_at:
            record.output_ids.append(ids[len(record)])
            record.logprobs.append(-0.5)
            record.versions.append(0)
            self.hanging.set()
            await asyncio.Event().wait()
        rest = ids[len(record) :]
        record.output_ids += rest
        record.logprobs += [-0.25] * len(rest)
        record.versions += [1] * len(rest)
        record.finish_reason = "stop"
        return GenerationResult(
            list(record.output_ids),
            list(record.logprobs),
            list(record.versions),
            "stop",
            record.num_resumes,
            len(input_ids),
        )


async def crash_during_turn(workflow: MultiTurnWorkflow, client: ProgressClient, tok, d) -> dict:
    """Run an episode until its generation at `client.hang_at` is in flight, checkpoint its record, kill it."""
    progress = SampleProgress("p0/0")
    episode = asyncio.create_task(workflow.run(client, tok, d, 0, progress=progress))
    await asyncio.wait_for(client.hanging.wait(), 10)
    doc = json.loads(json.dumps(progress.to_json()))  # what the checkpoint's rollout.json holds
    episode.cancel()
    return doc


def test_an_agent_episode_checkpointed_mid_turn_goes_on_from_that_turn_with_its_environment():
    tok = build_tokenizer()
    workflow = MultiTurnWorkflow(EnvSpec(name="number_line", max_turns=4), {"max_new_tokens": 3})
    d = Datum("p0", tok.encode("N", add_special_tokens=False), {"start": 0, "target": 4})
    doc = asyncio.run(crash_during_turn(workflow, ProgressClient(tok, ["+1", "+1", "+2"], hang_at=2), tok, d))
    episode = doc["episode"]
    assert episode["turn"] == 2 and len(episode["turns"]) == 2 and episode["generated_tokens"] == 6
    assert doc["generation"]["output_ids"] == tok.encode("+", add_special_tokens=False)  # turn 2's first token

    restored = SampleProgress.from_json(doc, "test")
    assert restored.restored_tokens == 7
    client = ProgressClient(tok, ["+1", "+1", "+2"])
    trajectory = asyncio.run(workflow.run(client, tok, d, 0, progress=restored))
    # No reset and no earlier turn again: the first call is turn 2, continued from its saved token.
    assert client.calls == [(2, 1)]
    assert trajectory.status == TrajectoryStatus.OK and trajectory.metadata["end_reason"] == "done"
    turns = [s.response_ids for s in trajectory.sequences]
    assert [tok.decode(t) for t in turns] == ["+1<eos>", "+1<eos>", "+2<eos>"]
    assert trajectory.sequences[2].response_versions == [0, 1, 1]  # the saved token keeps its version
    # The environment went on from its saved state (position 2): "+2" reaches the target 4.
    assert trajectory.step_rewards == [0.0, 0.0, 1.0] and restored.outcome is None


def test_an_environment_that_cannot_be_pickled_fails_at_reset_so_no_episode_of_it_is_ever_in_flight(tmp_path):
    """Between calls the environment exists only as pickled bytes: one holding an unpicklable object (a lock) fails
    its first call, naming why, so there is never an episode in flight whose environment a checkpoint cannot save."""
    path = tmp_path / "locked_env.py"
    path.write_text(
        "import threading\n"
        "class LockedEnv:\n"
        "    def __init__(self):\n"
        "        self.lock = threading.Lock()\n"
        "    def reset(self, seed, task):\n"
        "        return 'start'\n"
        "    def step(self, action):\n"
        "        return 'obs', 0.0, True, {}\n"
    )
    env = IsolatedEnv(EnvSpec(name="LockedEnv", path=str(path)), pool=None)
    with pytest.raises(EnvError, match=r"env reset raised TypeError: cannot pickle '_thread\.lock'"):
        asyncio.run(env.reset(0, {}))
    assert env.state is None


def test_an_agent_whose_environment_does_not_load_back_restarts_its_episode_counted(caplog):
    """The environment lives as pickled bytes between calls (envs/session.py), so one that cannot be pickled never
    runs; one whose saved pickle does not load back in the resumed run restarts its episode, logged, with its saved
    tokens counted as discarded and the outcome the executor journals and tallies."""
    tok = build_tokenizer()
    workflow = MultiTurnWorkflow(EnvSpec(name="number_line", max_turns=4), {"max_new_tokens": 3})
    d = Datum("p0", tok.encode("N", add_special_tokens=False), {"start": 0, "target": 4})
    doc = asyncio.run(crash_during_turn(workflow, ProgressClient(tok, ["+1", "+1", "+2"], hang_at=1), tok, d))
    doc["episode"]["env"] = base64.b64encode(b"not a pickle").decode()
    restored = SampleProgress.from_json(doc, "test")
    restored.outcome = CONTINUED  # as the executor restores it
    client = ProgressClient(tok, ["+2", "+2"])
    with caplog.at_level("WARNING", logger="rllm.experimental.fully_async.workflows.multi_turn"):
        trajectory = asyncio.run(workflow.run(client, tok, d, 0, progress=restored))
    assert "sample p0/0: its environment could not be restored" in caplog.text
    assert restored.outcome == ENV_NOT_RESTORED and restored.discarded_tokens == 3 + 1
    assert client.calls[0] == (0, 0), "the episode starts over from the prompt"
    assert trajectory.status == TrajectoryStatus.OK and len(trajectory.sequences) == 2
