"""Failure injection on the rollout side: every failure is provoked for real and must end up in the ledger.

Real components throughout: embedded engine processes on 127.0.0.1 serving a random-init addition model, the
`EngineClient`, the `RolloutExecutor` core driven in the test's own event loop, `SingleTurnWorkflow` with the
addition task's reward, `PromptDataset`/`PromptIterator` over real parquet, the `SampleLedger`, and the
rollout service's in-process `MessageQueue`. Nothing of ours is mocked;
the injected faults are reward functions that misbehave for chosen prompts, SIGKILLed engines, sampling settings
that end a generation at once, and broken parquet files.

What every rollout test checks at the end (docs/design.md#rule-nothing-lost-silently): each issued sample is either
failed with the expected reason or sits in a queued group, and once the queued groups are reported trained, issued ==
in_flight + trained + filtered + dropped_stale + failed with nothing left in flight.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from engine_helpers import TEST_ONLY_ROUTES, decode_hold

from rllm.experimental.fully_async.algorithms.advantages import AdvantageConfig
from rllm.experimental.fully_async.api.trajectory import VersionedGroup
from rllm.experimental.fully_async.core.batch import groups_to_dataproto
from rllm.experimental.fully_async.core.ledger import SampleLedger
from rllm.experimental.fully_async.core.ledger_format import SampleState, history_counts
from rllm.experimental.fully_async.data.prompts import DataError, PromptDataset, PromptIterator
from rllm.experimental.fully_async.engines import EmbeddedEngineCommand, EngineLauncher
from rllm.experimental.fully_async.engines.client import EngineClient, GenerationResult
from rllm.experimental.fully_async.runtime.rollout.executor import (
    EnginesExhaustedError,
    ExecutorSettings,
    RolloutExecutor,
)
from rllm.experimental.fully_async.runtime.rollout.ledger_journal import journaled_ledger, read_journal
from rllm.experimental.fully_async.runtime.rollout.message_queue import MessageQueue
from rllm.experimental.fully_async.tasks.addition import (
    VOCAB,
    build_addition_model,
    build_addition_tokenizer,
    compute_score,
    write_addition_parquets,
)
from rllm.experimental.fully_async.workflows import SingleTurnWorkflow, score_safely
from rllm.experimental.fully_async.workflows import base as reward_workflows

pytestmark = pytest.mark.timeout(240)

RUN_TIMEOUT_S = 120.0  # bound on one executor run: a hang fails the test instead of stalling the suite
SHORT = {"temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True}


# --- fixtures and the harness ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return build_addition_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer) -> Path:
    """The addition task's tiny Qwen2, random init (no warm-up: failures do not need a good policy)."""
    path = tmp_path_factory.mktemp("addition_model")
    build_addition_model(seed=0).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tokenizer) -> PromptDataset:
    train, _ = write_addition_parquets(tmp_path_factory.mktemp("addition_data"), seed=0, num_train=40, num_val=1)
    return PromptDataset(train, tokenizer, max_prompt_length=16)


def launcher(model_dir: Path, num_engines: int, log_dir: Path) -> EngineLauncher:
    # One torch thread per engine: the machine has two cores and other tests running beside these.
    command = EmbeddedEngineCommand(str(model_dir), max_running_requests=64, num_threads=1, extra_args=TEST_ONLY_ROUTES)
    return EngineLauncher(command, num_engines, startup_timeout_s=180, log_dir=log_dir)


@pytest.fixture(scope="module")
def engine_urls(model_dir, tmp_path_factory) -> list[str]:
    """One engine shared by the tests that do not kill engines."""
    with launcher(model_dir, 1, tmp_path_factory.mktemp("engine_logs")) as engines:
        yield engines.urls


class LocalQueue(MessageQueue):
    """The rollout service's real queue, with two helpers for the tests that play the trainer."""

    def __init__(self, max_groups: int = 10_000) -> None:
        super().__init__(max_groups)

    async def wait_for_total(self, n: int, timeout_s: float) -> None:
        """Wait until n groups have been put in total (woken by each put: no polling)."""
        if not await self.wait_for(lambda: self.buffer.total_put >= n, timeout_s):
            raise TimeoutError(f"only {self.buffer.total_put} of {n} groups queued after {timeout_s:g}s")

    def drain(self) -> list[VersionedGroup]:
        return self.pop(len(self.buffer)) if len(self.buffer) else []


def make_executor(
    prompts: PromptIterator,
    workflow: Any,
    client: Any,
    tokenizer: Any,
    *,
    samples_per_prompt: int,
    max_concurrent_rollouts: int,
    journal: Path | None = None,
) -> tuple[RolloutExecutor, LocalQueue, SampleLedger]:
    """An executor whose staleness budget never binds (no trainer here): these tests are about failures.

    `journal`: where the ledger records each sample's issue and end, for tests that check per-sample outcomes."""
    settings = ExecutorSettings(
        samples_per_prompt=samples_per_prompt,
        max_staleness=0,
        groups_per_version=10_000,
        max_concurrent_rollouts=max_concurrent_rollouts,
    )
    queue, ledger = LocalQueue(), (journaled_ledger(journal) if journal is not None else SampleLedger())
    executor = RolloutExecutor(settings, prompts, workflow, client, tokenizer, queue, ledger=ledger)
    return executor, queue, ledger


def train_queued(executor: RolloutExecutor, queue: LocalQueue) -> list[VersionedGroup]:
    """Play the trainer: take every queued group and report its samples trained."""
    groups = queue.drain()
    executor.report_consumed([t.uid for g in groups for t in g.trajectories], len(groups), [], 0)
    return groups


def assert_ledger_adds_up(ledger: SampleLedger) -> dict[str, int]:
    """The counts add up and, where the ledger keeps a journal, its replay passes the audit and agrees with them."""
    counts = ledger.counts()
    ended = counts["trained"] + counts["filtered"] + counts["dropped_stale"] + counts["failed"]
    assert counts["issued"] == counts["in_flight"] + ended, counts
    if ledger.journal_path is not None:
        assert history_counts(read_journal(ledger.journal_path)) == counts
    return counts


def failed_reasons(journal: Path, uids: list[str]) -> dict[str, str | None]:
    """The failed samples among `uids` and their reasons, from the ledger's journal (which also audits it)."""
    history = read_journal(journal)
    return {uid: history[uid][1] for uid in uids if history[uid][0] is SampleState.FAILED}


def first_prompts(dataset: PromptDataset, n: int) -> PromptIterator:
    """The first n rows in file order, one epoch: prompt_uid e0/<row>, rows run in order."""
    return PromptIterator(dataset.records[:n], seed=0, num_epochs=1, shuffle=False)


# --- reward functions that fail ----------------------------------------------------------------------------------


class InjectedRewardError(RuntimeError):
    """Raised on purpose by the test's reward function."""


class FaultyReward:
    """compute_score, except for the prompt rows in `modes` (extra_info["index"]), which fail as named.

    "hang" blocks its worker thread until `release` is set (the test sets it when it ends, so no thread outlives
    the test); "raise_once" fails the first sample of its prompt that is scored and scores the others.
    """

    def __init__(self, modes: dict[int, str]) -> None:
        self.modes = modes
        self.release = threading.Event()
        self._lock = threading.Lock()
        self._raised: set[int] = set()

    def __call__(self, data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> Any:
        row = int((extra_info or {})["index"])
        mode = self.modes.get(row)
        if mode == "raise":
            raise InjectedRewardError(f"row {row}")
        if mode == "raise_once":
            with self._lock:
                first = row not in self._raised
                self._raised.add(row)
            if first:
                raise InjectedRewardError(f"row {row}, first call")
        if mode == "hang":
            self.release.wait(timeout=RUN_TIMEOUT_S)
        if mode == "nan":
            return float("nan")
        if mode == "string":
            return "1.0"
        return compute_score(data_source, solution_str, ground_truth, extra_info)


def test_failing_rewards_fail_only_their_samples_with_reasons_and_the_rest_is_queued(
    engine_urls, dataset, tokenizer, tmp_path
):
    modes = {0: "raise", 1: "hang", 2: "nan", 3: "string", 4: "raise_once"}  # rows 5-7 score normally
    reward = FaultyReward(modes)
    workflow = SingleTurnWorkflow(reward, SHORT, reward_timeout_s=2.0)

    async def scenario() -> tuple[RolloutExecutor, LocalQueue, SampleLedger]:
        async with EngineClient(engine_urls, request_timeout_s=RUN_TIMEOUT_S) as client:
            # Two groups at a time, rows in order: the failing rows run first and the good ones after them.
            executor, queue, ledger = make_executor(
                first_prompts(dataset, 8),
                workflow,
                client,
                tokenizer,
                samples_per_prompt=2,
                max_concurrent_rollouts=4,
                journal=tmp_path / "ledger.jsonl",
            )
            try:
                await asyncio.wait_for(executor.run(), RUN_TIMEOUT_S)
            finally:
                reward.release.set()
            return executor, queue, ledger

    executor, queue, ledger = asyncio.run(scenario())
    uids = [f"e0/{row}/{i}" for row in range(8) for i in range(2)]
    assert executor.stats.groups_started == 8, "the executor went on past the failures to the end of the data"

    reasons = failed_reasons(tmp_path / "ledger.jsonl", uids)
    expected = {
        **{f"e0/0/{i}": "reward_error" for i in range(2)},
        **{f"e0/1/{i}": "reward_timeout" for i in range(2)},
        **{f"e0/2/{i}": "reward_not_finite" for i in range(2)},
        **{f"e0/3/{i}": "reward_not_a_number" for i in range(2)},
    }
    flaky = {uid: reason for uid, reason in reasons.items() if uid.startswith("e0/4/")}
    assert list(flaky.values()) == ["reward_error"], f"exactly one sample of the flaky prompt fails: {flaky}"
    assert {uid: r for uid, r in reasons.items() if uid not in flaky} == expected

    groups = train_queued(executor, queue)
    queued = sorted(t.uid for g in groups for t in g.trajectories)
    assert queued == sorted(set(uids) - set(reasons)), "every sample that did not fail was queued"
    assert [g.prompt_uid for g in groups if len(g.trajectories) == 1] == ["e0/4"]  # the flaky group, one short
    assert all(math.isfinite(t.reward) and t.reward in (0.0, 1.0) for g in groups for t in g.trajectories)

    counts = assert_ledger_adds_up(ledger)
    assert counts["issued"] == 16 and counts["in_flight"] == 0
    assert counts["failed"] == 9 and counts["trained"] == 7
    assert counts["failed/reward_error"] == 3 and counts["failed/reward_timeout"] == 2
    assert counts["failed/reward_not_finite"] == 2 and counts["failed/reward_not_a_number"] == 2
    assert executor.stats.samples_failed == 9 and executor.stats.groups_queued == 4


def test_hung_reward_threads_do_not_make_later_rewards_time_out(engine_urls, dataset, tokenizer, tmp_path):
    """Every abandoned hung reward keeps a worker of the pool `asyncio.to_thread` uses (asyncio's default executor,
    min(32, cpus + 4) threads). Once that many have hung, a later reward waits for a free worker past its timeout:
    healthy samples fail as reward_timeout for the rest of the run. Fails until score_safely runs each synchronous
    reward call in a thread of its own (a daemon thread settling an asyncio future), so an abandoned call holds
    only its own thread."""
    # ThreadPoolExecutor's default max_workers (Python 3.13+ counts the CPUs this process may use).
    pool_size = min(32, (getattr(os, "process_cpu_count", os.cpu_count)() or 1) + 4)
    samples = 2
    hang_rows = math.ceil(pool_size / samples)
    good_rows = list(range(hang_rows, hang_rows + 2))
    reward = FaultyReward(dict.fromkeys(range(hang_rows), "hang"))
    workflow = SingleTurnWorkflow(reward, SHORT, reward_timeout_s=2.0)

    async def scenario() -> SampleLedger:
        async with EngineClient(engine_urls, request_timeout_s=RUN_TIMEOUT_S) as client:
            # All hanging groups run together; the good rows start only after those have timed out.
            executor, _, ledger = make_executor(
                first_prompts(dataset, hang_rows + len(good_rows)),
                workflow,
                client,
                tokenizer,
                samples_per_prompt=samples,
                max_concurrent_rollouts=hang_rows * samples,
                journal=tmp_path / "ledger.jsonl",
            )
            try:
                await asyncio.wait_for(executor.run(), RUN_TIMEOUT_S)
            finally:
                reward.release.set()
            return ledger

    ledger = asyncio.run(scenario())
    good_uids = [f"e0/{row}/{i}" for row in good_rows for i in range(samples)]
    assert failed_reasons(tmp_path / "ledger.jsonl", good_uids) == {}, (
        "healthy samples scored after the hangs must not fail"
    )
    assert ledger.counts()["failed/reward_timeout"] == hang_rows * samples


def test_reward_threads_are_reused_and_a_hung_one_is_never_handed_another_call(monkeypatch):
    """Synchronous rewards run on daemon threads that are reused (a thread start per sample was ~10% of the rollout
    service's CPU) but never shared: while one call hangs, later calls still answer, on other threads.

    The pool is the process's, so the test gets a fresh one: a call left hanging by an earlier test in this worker
    can return mid-test and go idle, and the next call may then take that thread (CI saw two threads here)."""
    monkeypatch.setattr(reward_workflows, "_REWARD_THREADS", reward_workflows._DaemonThreads())
    release = threading.Event()
    threads: list[str] = []

    def reward(data_source, solution_str, ground_truth, extra_info=None):
        threads.append(threading.current_thread().name + str(threading.get_ident()))
        if solution_str == "hang":
            release.wait(30)
        return 1.0

    async def scenario() -> tuple[list, list]:
        kwargs = {"data_source": "d", "ground_truth": "1", "extra_info": None}
        sequential = [await score_safely(reward, 5.0, solution_str="ok", **kwargs) for _ in range(20)]
        hung = asyncio.ensure_future(score_safely(reward, 5.0, solution_str="hang", **kwargs))
        await asyncio.sleep(0.05)
        during = await asyncio.wait_for(
            asyncio.gather(*(score_safely(reward, 5.0, solution_str="ok", **kwargs) for _ in range(3))), 5.0
        )
        release.set()
        return [*sequential, await hung], during

    before = threading.active_count()
    done, during = asyncio.run(scenario())
    assert all(o.reward == 1.0 for o in done + during)
    assert len(set(threads[:20])) == 1, "twenty calls one after another run on one reused thread"
    hung_thread = threads[20]
    assert hung_thread not in threads[21:], "no call is handed to the thread of a call that has not returned"
    assert threading.active_count() - before <= 4


@pytest.mark.parametrize("score", [np.float32(1.0), np.float64(0.0), np.int64(1)], ids=lambda s: type(s).__name__)
def test_numpy_scalar_rewards_are_numbers_not_failures(score):
    """verl reward functions often return numpy scalars (verl's reward manager accepts them); np.float32 and
    np.int64 are not Python floats/ints but are real numbers and must score, not fail the sample."""

    def reward(data_source, solution_str, ground_truth, extra_info=None):
        return score

    outcome = asyncio.run(
        score_safely(reward, 10.0, data_source="d", solution_str="046", ground_truth="046", extra_info=None)
    )
    assert outcome.failure is None and outcome.reward == float(score)


# --- engines that die ----------------------------------------------------------------------------------------------


class RetryCountingClient:
    """The real EngineClient, noting how many connection failures each finished generation survived."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.retries: list[int] = []

    async def generate(self, input_ids: list[int], sampling_params: dict, *, rid: str | None = None, progress=None):
        result: GenerationResult = await self.client.generate(input_ids, sampling_params, rid=rid, progress=progress)
        self.retries.append(result.num_retries)
        return result

    async def generate_batch(self, prompts: list[list[int]], sampling_params: dict, *, rids: list[str], progress=None):
        results: list[GenerationResult] = await self.client.generate_batch(
            prompts, sampling_params, rids=rids, progress=progress
        )
        self.retries += [r.num_retries for r in results]
        return results


@pytest.mark.slow  # two engines killed under load (~15 s on a busy 2-core machine)
def test_a_killed_engine_has_its_requests_resent_and_losing_the_last_engine_stops_the_run(
    model_dir, dataset, tokenizer, tmp_path
):
    """SIGKILL one of two engines mid-generation: the client re-sends its requests to the other, nothing fails and
    groups keep coming. Then SIGKILL the other: run() raises EnginesExhaustedError instead of hanging."""
    # ignore_eos: every request decodes 48 tokens; the victim holds its requests decoding until it dies (decode_hold).
    workflow = SingleTurnWorkflow(compute_score, {"temperature": 1.0, "max_new_tokens": 48, "ignore_eos": True})
    with launcher(model_dir, 2, tmp_path / "engine_logs") as engines:
        victim, survivor = engines.processes

        async def scenario() -> tuple[RolloutExecutor, LocalQueue, SampleLedger, BaseException | None]:
            async with EngineClient(engines.urls, backoff_base_s=0.01, request_timeout_s=RUN_TIMEOUT_S) as real:
                client = RetryCountingClient(real)
                prompts = PromptIterator(dataset, seed=0, num_epochs=None)  # endless: only a failure ends the run
                executor, queue, ledger = make_executor(
                    prompts,
                    workflow,
                    client,
                    tokenizer,
                    samples_per_prompt=2,
                    max_concurrent_rollouts=8,
                    journal=tmp_path / "ledger.jsonl",
                )
                run = asyncio.create_task(executor.run())
                try:
                    async with decode_hold(victim.url, min_tokens=1) as hold:  # the kill meets requests decoding
                        await hold.reached()
                        os.kill(victim.pid, signal.SIGKILL)
                    await queue.wait_for_total(queue.buffer.total_put + 8, RUN_TIMEOUT_S)
                    # The survivor served everything since the kill, the re-sent requests included.
                    assert real.alive_urls == [survivor.url]
                    assert sum(client.retries) >= 1, "some request hit the dead engine and was re-sent"
                    assert ledger.counts()["failed"] == 0, ledger.counts()

                    os.kill(survivor.pid, signal.SIGKILL)
                    done, _ = await asyncio.wait({run}, timeout=RUN_TIMEOUT_S)
                    assert done, "run() must end when no engine is left, not hang"
                    error = run.exception()
                finally:
                    if not run.done():
                        executor.stop()
                        await asyncio.gather(run, return_exceptions=True)
                return executor, queue, ledger, error

        executor, queue, ledger, error = asyncio.run(scenario())

    assert isinstance(error, EnginesExhaustedError), repr(error)
    assert victim.url in str(error) and survivor.url in str(error), "the error names every engine it lost"

    # Nothing lost: each issued sample either sits in a queued group or failed when the last engine died.
    history = read_journal(tmp_path / "ledger.jsonl")
    issued = set(history)
    queued = {t.uid for g in queue.buffer.snapshot() for t in g.trajectories}
    failed = {uid for uid, (state, _) in history.items() if state is SampleState.FAILED}
    assert failed, "the samples running when the last engine died failed"
    assert {history[uid][1] for uid in failed} == {"workflow_error"}
    assert queued | failed == issued and not queued & failed
    assert set(ledger.in_flight_uids()) == queued
    assert executor.stats.groups_queued == len(queue.buffer.snapshot()) >= 8

    train_queued(executor, queue)
    counts = assert_ledger_adds_up(ledger)
    assert counts["in_flight"] == 0 and counts["trained"] == len(queued) and counts["failed"] == len(failed)


# --- generations that end at once --------------------------------------------------------------------------------


@dataclass
class PerSampleWorkflow:
    """Sample i of every prompt runs workflows[i]: one group mixes generation settings."""

    workflows: list[SingleTurnWorkflow]

    async def run(self, client: Any, tokenizer: Any, datum: Any, sample_index: int):
        return await self.workflows[sample_index].run(client, tokenizer, datum, sample_index)


def test_empty_and_one_token_generations_assemble_into_a_batch_without_nan(engine_urls, dataset, tokenizer):
    """max_new_tokens=0 gives an empty response; a stop token that fires on the first step gives a response of
    exactly that token (SGLang keeps the matched stop token in output_ids). Both are trained as what they are: an
    all-zero mask row and a one-token row, next to normal rows, with finite advantages."""
    every_token = sorted(VOCAB.values())
    workflow = PerSampleWorkflow(
        [
            SingleTurnWorkflow(compute_score, {"temperature": 1.0, "max_new_tokens": 0}),
            SingleTurnWorkflow(compute_score, {"temperature": 1.0, "max_new_tokens": 8, "stop_token_ids": every_token}),
            SingleTurnWorkflow(compute_score, SHORT),
        ]
    )

    async def scenario() -> tuple[RolloutExecutor, LocalQueue, SampleLedger]:
        async with EngineClient(engine_urls, request_timeout_s=RUN_TIMEOUT_S) as client:
            executor, queue, ledger = make_executor(
                first_prompts(dataset, 4), workflow, client, tokenizer, samples_per_prompt=3, max_concurrent_rollouts=12
            )
            await asyncio.wait_for(executor.run(), RUN_TIMEOUT_S)
            return executor, queue, ledger

    executor, queue, ledger = asyncio.run(scenario())
    assert ledger.counts()["failed"] == 0
    groups = train_queued(executor, queue)
    assert len(groups) == 4
    by_index: dict[str, list] = {"0": [], "1": [], "2": []}
    for group in groups:
        for trajectory in group.trajectories:
            by_index[trajectory.uid.rsplit("/", 1)[1]].append(trajectory.sequences[0])
    assert all(s.response_ids == [] and s.finish_reason == "length" for s in by_index["0"])
    assert all(len(s.response_ids) == 1 and s.finish_reason == "stop" for s in by_index["1"])
    assert all(len(s.response_ids) == 4 for s in by_index["2"])

    data = groups_to_dataproto(groups, pad_token_id=tokenizer.pad_token_id, temperature=1.0)
    data = AdvantageConfig(adv_estimator="grpo").compute(data)
    mask = data.batch["response_mask"]
    expected_lengths = {"0": 0, "1": 1, "2": 4}
    for row, sample_uid in enumerate(data.non_tensor_batch["sample_uid"]):
        assert mask[row].sum().item() == expected_lengths[sample_uid.rsplit("/", 1)[1]], sample_uid
    empty_rows = [i for i, uid in enumerate(data.non_tensor_batch["sample_uid"]) if uid.endswith("/0")]
    assert len(empty_rows) == 4 and not mask[empty_rows].any()
    prompt_len = data.batch["prompts"].shape[1]
    assert not data.batch["attention_mask"][empty_rows, prompt_len:].any(), "an empty response attends to nothing"
    for name, tensor in data.batch.items():
        if tensor.is_floating_point():
            assert torch.isfinite(tensor).all(), f"{name} has NaN or inf"
    assert not data.batch["advantages"][empty_rows].any()

    counts = assert_ledger_adds_up(ledger)
    assert counts["issued"] == counts["trained"] == 12


# --- malformed data ------------------------------------------------------------------------------------------------


def verl_row(index: int) -> dict:
    return {
        "prompt": [{"role": "user", "content": "12+34="}],
        "data_source": "fully_async/addition",
        "reward_model": {"style": "rule", "ground_truth": "046"},
        "extra_info": {"index": index, "split": "train"},
    }


def without_ground_truth(row: dict) -> dict:
    return row | {"reward_model": {"style": "rule"}}


def without_prompt(row: dict) -> dict:
    return row | {"prompt": None}


def assert_one_line_naming(error: DataError, *parts: str) -> None:
    message = str(error)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"


@pytest.mark.parametrize(
    ("spoil", "field"),
    [(without_ground_truth, "reward_model.ground_truth"), (without_prompt, "prompt")],
    ids=["missing_ground_truth", "missing_prompt"],
)
def test_a_malformed_row_stops_loading_with_a_line_naming_file_row_and_field(tmp_path, tokenizer, spoil, field):
    rows = [verl_row(i) for i in range(4)]
    rows[2] = spoil(rows[2])
    path = tmp_path / "train.parquet"
    pd.DataFrame(rows).to_parquet(path, index=False)
    with pytest.raises(DataError) as err:
        PromptDataset(path, tokenizer, max_prompt_length=16)
    assert_one_line_naming(err.value, str(path), "row 2", f"field '{field}'", "missing")


def test_a_file_without_a_prompt_column_names_the_field(tmp_path, tokenizer):
    path = tmp_path / "train.parquet"
    pd.DataFrame([{k: v for k, v in verl_row(i).items() if k != "prompt"} for i in range(3)]).to_parquet(path)
    with pytest.raises(DataError) as err:
        PromptDataset(path, tokenizer, max_prompt_length=16)
    assert_one_line_naming(err.value, str(path), "field 'prompt'", "missing")


@pytest.mark.parametrize(
    "spoil",
    [
        lambda data: b"this is not parquet\n" * 10,
        lambda data: data[: len(data) // 2],  # a copy cut short
        lambda data: data[:-8] + b"\0" * 8,  # the footer (length + magic) overwritten
    ],
    ids=["garbage", "truncated", "bad_footer"],
)
def test_an_unreadable_parquet_stops_loading_with_a_line_naming_the_file(tmp_path, tokenizer, spoil: Callable):
    good = tmp_path / "good.parquet"
    pd.DataFrame([verl_row(i) for i in range(8)]).to_parquet(good, index=False)
    path = tmp_path / "train.parquet"
    path.write_bytes(spoil(good.read_bytes()))
    with pytest.raises(DataError) as err:
        PromptDataset([good, path], tokenizer, max_prompt_length=16)
    assert_one_line_naming(err.value, str(path), "cannot read as parquet")
