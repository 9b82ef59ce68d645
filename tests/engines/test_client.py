"""EngineClient against real embedded-engine processes: routing, partial-rollout resume, failures, timeouts."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from engine_helpers import (
    ENGINE_KINDS,
    LOGPROB_TOL,
    decode_hold,
    engine_command,
    load_weights,
    max_abs_diff,
    reference_logprobs,
    sync_weights,
    wait_for_idle,
)

from rllm.experimental.fully_async.api.progress import GenerationProgress
from rllm.experimental.fully_async.core.engine_activity import Interval, IntervalMeter
from rllm.experimental.fully_async.engines import EngineLauncher
from rllm.experimental.fully_async.engines.client import (
    EngineClient,
    EngineTimeoutError,
    GenerationResult,
    NoHealthyEngineError,
)
from rllm.experimental.fully_async.engines.pool import EnginePool

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]

LONG = {"temperature": 1.0, "max_new_tokens": 200, "ignore_eos": True}


@pytest.fixture(scope="module", params=ENGINE_KINDS)
def engine_launcher(request, models, tmp_path_factory):
    """Two engines serving model A: embedded engines, then SGLang stand-ins (every test runs against both)."""
    cmd = engine_command(request.param, models["a"][0])
    with EngineLauncher(cmd, 2, log_dir=tmp_path_factory.mktemp("client_engine_logs")) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def engines(engine_launcher):
    return engine_launcher.urls


def test_result_has_aligned_tokens_logprobs_and_versions(engines, models):
    async def run() -> GenerationResult:
        async with EngineClient(engines) as client:
            return await client.generate([3, 4, 5], {"temperature": 1.0, "max_new_tokens": 30, "ignore_eos": True})

    result = asyncio.run(run())
    assert len(result.output_ids) == len(result.logprobs) == len(result.versions) == 30
    assert result.versions == [0] * 30
    assert result.finish_reason == "length" and result.num_resumes == 0 and result.prompt_tokens == 3
    assert max_abs_diff(result.logprobs, reference_logprobs(models["a"][1], [3, 4, 5], result.output_ids)) < 1e-4
    seq = result.to_sequence([3, 4, 5])
    assert seq.response_versions == result.versions and seq.min_version == 0


def test_requests_are_spread_over_engines_by_load(engines):
    async def run() -> dict[str, int]:
        async with EngineClient(engines) as client:
            before = {u: (await client.get_server_info(u))["internal_states"][0]["requests_finished"] for u in engines}
            await asyncio.gather(
                *(client.generate([2 + i], {"max_new_tokens": 20, "ignore_eos": True}) for i in range(16))
            )
            assert client.in_flight() == dict.fromkeys(engines, 0)
            after = {u: (await client.get_server_info(u))["internal_states"][0]["requests_finished"] for u in engines}
            return {u: after[u] - before[u] for u in engines}

    served = asyncio.run(run())
    assert sum(served.values()) == 16
    assert min(served.values()) >= 6, f"least-loaded routing should split 16 requests about evenly: {served}"


def test_aborted_generation_is_resumed_across_a_weight_update_and_stitched(engines, models):
    """Pause mid-generation, update to model B as version 1, continue: one stitched sequence, two versions."""
    url = engines[0]
    (path_a, model_a), (path_b, model_b) = models["a"], models["b"]
    prompt = [5, 6, 7]

    async def run() -> GenerationResult:
        async with EngineClient([url]) as client:
            # The sync meets the request at its 3rd token: the engine holds it there (decode_hold).
            async with decode_hold(url, min_tokens=3, rid_prefix="stitch/") as hold:
                task = asyncio.ensure_future(client.generate(prompt, LONG, rid="stitch/0"))
                await hold.reached()
                await sync_weights(client, url, path_b, "1")
            result = await asyncio.wait_for(task, 60)
            await load_weights(client, url, path_a, "0")  # restore for other tests
            return result

    result = asyncio.run(run())
    assert result.finish_reason == "length" and result.num_resumes == 1
    assert len(result.output_ids) == len(result.logprobs) == len(result.versions) == 200
    split = result.versions.index(1)
    assert split == 3 and result.versions == [0] * split + [1] * (200 - split)
    # Old tokens are model A's; tokens after the update are model B's, conditioned on everything before them.
    ref_a = reference_logprobs(model_a, prompt, result.output_ids)
    ref_b = reference_logprobs(model_b, prompt, result.output_ids)
    assert max_abs_diff(result.logprobs[:split], ref_a[:split]) < LOGPROB_TOL
    assert max_abs_diff(result.logprobs[split:], ref_b[split:]) < LOGPROB_TOL
    assert max_abs_diff(result.logprobs[split:], ref_a[split:]) > 1e-2


def test_the_pool_counts_each_pieces_tokens_when_it_returns_beside_its_busy_time(engines, models):
    """A generation aborted by a weight sync at its 3rd token: the aborted piece's tokens land in the interval in
    which it came back, beside the engine's busy time there, not when the whole generation ends
    (core/engine_activity.py); the intervals add up to the tokens generated."""
    url = engines[0]
    path_a, path_b = models["a"][0], models["b"][0]

    async def run() -> tuple[GenerationResult, list[Interval]]:
        async with EngineClient([url]) as client:
            meter = IntervalMeter(time.monotonic())
            async with decode_hold(url, min_tokens=3, rid_prefix="meter/") as hold:
                task = asyncio.ensure_future(client.generate([5, 6, 7], LONG, rid="meter/0"))
                await hold.reached()
                await sync_weights(client, url, path_b, "1")  # the piece comes back aborted with its tokens
            during = meter.read(time.monotonic(), *client.pool.activities())
            result = await asyncio.wait_for(task, 60)
            after = meter.read(time.monotonic(), *client.pool.activities())
            await load_weights(client, url, path_a, "0")  # restore for other tests
            return result, [during, after]

    result, (during, after) = asyncio.run(run())
    assert result.num_resumes == 1 and len(result.output_ids) == 200
    assert during.tokens >= 3 and during.idle_frac < 1.0  # the aborted piece, before the sample finished
    assert after.tokens > 0 and after.idle_frac < 1.0
    assert during.tokens + after.tokens == 200


def test_without_partial_rollout_an_interrupted_generation_restarts_on_the_new_weights(engines, models):
    """partial_rollout=False: the tokens of the interrupted piece are discarded and the whole sequence is generated
    again from the prompt by the new weights, so it carries one version."""
    url = engines[0]
    (path_a, _), (path_b, model_b) = models["a"], models["b"]
    prompt = [6, 7]

    async def run() -> GenerationResult:
        async with EngineClient([url], partial_rollout=False) as client:
            async with decode_hold(url, min_tokens=3, rid_prefix="restart/") as hold:
                task = asyncio.ensure_future(client.generate(prompt, LONG, rid="restart/0"))
                await hold.reached()
                await sync_weights(client, url, path_b, "1")
            result = await asyncio.wait_for(task, 60)
            await load_weights(client, url, path_a, "0")
            return result

    result = asyncio.run(run())
    assert result.num_resumes == 1 and result.discarded_tokens == 3, "the 3 tokens the sync met are thrown away"
    assert result.versions == [1] * 200 and result.finish_reason == "length"
    ref_b = reference_logprobs(model_b, prompt, result.output_ids)
    assert max_abs_diff(result.logprobs, ref_b) < LOGPROB_TOL


def test_a_batch_is_aborted_by_a_weight_update_and_each_prompt_is_resumed_on_its_own_tokens(engines, models):
    """generate_batch sends a group as SGLang's batched /generate; a weight update mid-batch aborts every prompt,
    and the next round re-sends each with its own tokens so far: every sequence is stitched across two versions,
    each conditioned on its own prompt (the logprobs say which), in the order of the prompts."""
    url = engines[0]
    (path_a, model_a), (path_b, model_b) = models["a"], models["b"]
    prompts = [[5, 6, 7], [8], [9, 10]]

    async def counts(client: EngineClient) -> tuple[int, int]:
        state = (await client.get_server_info(url))["internal_states"][0]
        return state["requests_finished"], state["requests_aborted"]

    async def run() -> tuple[list[GenerationResult], tuple[int, int]]:
        async with EngineClient([url]) as client:
            await wait_for_idle(client, url)  # the engine is the module's: its counters then count this test alone
            before = await counts(client)
            async with decode_hold(url, running=3, min_tokens=3, rid_prefix="g/") as hold:
                task = asyncio.ensure_future(client.generate_batch(prompts, LONG, rids=["g/0", "g/1", "g/2"]))
                await hold.reached()
                assert client.in_flight() == {url: 3}, "a batch counts each of its prompts toward the engine's load"
                await sync_weights(client, url, path_b, "1")
            results = await asyncio.wait_for(task, 60)
            after = await counts(client)
            assert client.in_flight() == {url: 0}
            await load_weights(client, url, path_a, "0")  # restore for other tests
            return results, (after[0] - before[0], after[1] - before[1])

    results, (finished, aborted) = asyncio.run(run())
    assert (finished, aborted) == (3, 3), "round 1: three prompts aborted by the pause; round 2: all three finish"
    for prompt, result in zip(prompts, results, strict=True):
        assert result.num_resumes == 1 and result.finish_reason == "length" and result.prompt_tokens == len(prompt)
        split = result.versions.index(1)
        assert split == 3 and result.versions == [0] * split + [1] * (200 - split), "one prefill: 3 tokens each"
        ref_a = reference_logprobs(model_a, prompt, result.output_ids)
        ref_b = reference_logprobs(model_b, prompt, result.output_ids)
        assert max_abs_diff(result.logprobs[:split], ref_a[:split]) < LOGPROB_TOL
        assert max_abs_diff(result.logprobs[split:], ref_b[split:]) < LOGPROB_TOL


def test_a_batch_without_partial_rollout_restarts_every_interrupted_prompt(engines, models):
    url = engines[0]
    (path_a, _), (path_b, model_b) = models["a"], models["b"]
    prompts = [[6, 7], [11]]

    async def run() -> list[GenerationResult]:
        async with EngineClient([url], partial_rollout=False) as client:
            async with decode_hold(url, running=2, min_tokens=3, rid_prefix="h/") as hold:
                task = asyncio.ensure_future(client.generate_batch(prompts, LONG, rids=["h/0", "h/1"]))
                await hold.reached()
                await sync_weights(client, url, path_b, "1")
            results = await asyncio.wait_for(task, 60)
            await load_weights(client, url, path_a, "0")
            return results

    for prompt, result in zip(prompts, asyncio.run(run()), strict=True):
        assert result.num_resumes == 1 and result.discarded_tokens == 3 and result.versions == [1] * 200
        assert max_abs_diff(result.logprobs, reference_logprobs(model_b, prompt, result.output_ids)) < LOGPROB_TOL


def test_a_paused_engine_that_outlasts_the_request_timeout_raises_a_clear_error(engines):
    url = engines[1]

    async def run() -> None:
        async with EngineClient([url], request_timeout_s=0.5) as client:
            await client.pause_generation(url, "abort")
            try:
                with pytest.raises(EngineTimeoutError, match=rf"{url}/generate did not answer within 0.5s"):
                    await client.generate([3], {"max_new_tokens": 4})
            finally:
                await client.continue_generation(url)
            result = await client.generate([3], {"max_new_tokens": 4, "ignore_eos": True})
            assert len(result.output_ids) == 4

    asyncio.run(run())


def test_tokens_collected_at_a_checkpoint_pause_are_the_start_of_each_finished_sequence(engines, models):
    """Token-level resume, the collection: with generations running (one alone, two in a batch), pausing the engines
    through `tokens_collected` brings every call in flight back, so each progress record holds its tokens so far
    (all of version 0, no call left out); after the engines continue, each sequence finishes from those very tokens
    (a prefix of the result, log-probs included), on the same weights."""
    url = engines[0]
    model_a = models["a"][1]
    prompts = [[5, 6, 7], [8], [9, 10]]

    async def run() -> tuple[list[list[int]], list[list[float]], list[GenerationResult], bool]:
        async with EngineClient([url]) as client:
            records = [GenerationProgress() for _ in prompts]
            # The pause meets all three decoding: the engine holds once each has 3 tokens (decode_hold).
            async with decode_hold(url, running=3, min_tokens=3, rid_prefix="c/") as hold:
                alone = asyncio.ensure_future(client.generate(prompts[0], LONG, rid="c/0", progress=records[0]))
                batch = asyncio.ensure_future(
                    client.generate_batch(prompts[1:], LONG, rids=["c/1", "c/2"], progress=records[1:])
                )
                await hold.reached()
                async with client.tokens_collected(timeout_s=30) as complete:
                    collected = [list(r.output_ids) for r in records]
                    logprobs = [list(r.logprobs) for r in records]
                    assert [r.versions == [0] * len(r) for r in records] == [True] * 3
            results = [await asyncio.wait_for(alone, 60), *await asyncio.wait_for(batch, 60)]
            return collected, logprobs, results, complete

    collected, logprobs, results, complete = asyncio.run(run())
    assert complete, "every call in flight came back while the engines were paused"
    for prompt, tokens, lps, result in zip(prompts, collected, logprobs, results, strict=True):
        assert 3 <= len(tokens) < 200, "collected mid-generation"
        assert result.output_ids[: len(tokens)] == tokens and result.logprobs[: len(tokens)] == lps
        assert len(result.output_ids) == 200 and result.num_resumes >= 1 and result.versions == [0] * 200
        assert max_abs_diff(result.logprobs, reference_logprobs(model_a, prompt, result.output_ids)) < LOGPROB_TOL


def test_a_call_held_by_a_paused_engine_is_not_waited_for_past_the_collections_timeout(engines, request):
    """A call that reaches an engine after its pause is held there, not aborted by the pause; it has generated
    nothing since it was sent, so its record is complete. Here the call is sent while the engine is already paused.
    The embedded engine aborts held calls on /abort_request, so the collection completes at once (the call is
    re-sent); SGLang (the stand-in) holds them before its scheduler, out of an abort's reach, so the collection ends
    at its timeout, incomplete, without waiting for the continue. Either way the record holds nothing new and the
    sequence finishes once the engines continue."""
    url = engines[0]
    timeout_s = 5.0

    async def run() -> tuple[bool, float, list[int], GenerationResult]:
        async with EngineClient([url]) as client:
            await client.pause_generation(url, "abort")
            record = GenerationProgress()
            held = asyncio.ensure_future(client.generate([5, 6, 7], LONG, rid="held/0", progress=record))
            # The call is out before the collection starts (a state that lasts until the continue, so this wait
            # cannot miss it). Its arrival at the engine has no event; none is needed: the collection re-aborts what
            # the embedded engine holds until its timeout, and the stand-in holds it out of reach either way.
            while client.in_flight()[url] == 0:
                await asyncio.sleep(0.01)
            started = time.monotonic()
            async with client.tokens_collected(timeout_s=timeout_s) as complete:
                waited = time.monotonic() - started
                collected = list(record.output_ids)
            return complete, waited, collected, await asyncio.wait_for(held, 60)

    complete, waited, collected, result = asyncio.run(run())
    if request.node.callspec.params["engine_launcher"] == "embedded":
        assert complete and waited < timeout_s, f"waited {waited:.1f}s"
    else:
        assert not complete and timeout_s <= waited < timeout_s + 5, f"waited {waited:.1f}s"
    assert collected == [], "a held call has generated nothing"
    assert len(result.output_ids) == 200 and result.finish_reason == "length"


def test_a_generation_restored_from_saved_tokens_is_continued_from_them(engines, models):
    """A record restored from a checkpoint: the engine is sent prompt + saved tokens with the budget that is left,
    so the result starts with the saved tokens and what follows is conditioned on them (the reference log-probs of
    the whole sequence match); a finished record is returned without calling any engine."""
    url = engines[0]
    model_a = models["a"][1]
    prompt, params = [4, 5], {"temperature": 1.0, "max_new_tokens": 30, "ignore_eos": True}

    async def run() -> tuple[GenerationResult, GenerationResult, GenerationResult]:
        async with EngineClient([url]) as client:
            first = await client.generate(prompt, params)
            saved = GenerationProgress(first.output_ids[:12], first.logprobs[:12], first.versions[:12], 1)
            continued = await client.generate(prompt, params, progress=saved)
        finished = GenerationProgress(first.output_ids, first.logprobs, first.versions, 0, "length")
        async with EngineClient(["http://127.0.0.1:9"], connect_retries=0) as nowhere:  # no engine listens there
            returned = await nowhere.generate(prompt, params, progress=finished)
        return first, continued, returned

    first, continued, returned = asyncio.run(run())
    assert continued.output_ids[:12] == first.output_ids[:12] and len(continued.output_ids) == 30
    assert continued.logprobs[:12] == first.logprobs[:12] and continued.num_resumes == 1
    assert max_abs_diff(continued.logprobs, reference_logprobs(model_a, prompt, continued.output_ids)) < LOGPROB_TOL
    assert returned.output_ids == first.output_ids and returned.finish_reason == "length"


# Keep this test last in the module: it SIGKILLs the module's engines (saving two engine start-ups); the
# fixture's teardown copes with dead processes.
def test_killed_engine_is_routed_around_and_only_an_empty_fleet_raises(engine_launcher):
    victim, survivor = engine_launcher.processes

    async def run() -> None:
        async with EngineClient(engine_launcher.urls, backoff_base_s=0.01, request_timeout_s=60) as client:
            # Both engines given requests; SIGKILL one while it holds some decoding: they finish on the other. The
            # victim holds its requests from their first token until the kill (decode_hold).
            async with decode_hold(victim.url, min_tokens=1) as hold:
                tasks = [asyncio.ensure_future(client.generate([2 + i], LONG)) for i in range(6)]
                await hold.reached()
                os.kill(victim.pid, signal.SIGKILL)
            results = await asyncio.gather(*tasks)
            assert all(len(r.output_ids) == len(r.logprobs) == len(r.versions) == 200 for r in results)
            assert sum(r.num_retries for r in results) >= 1
            assert await client.health() == {victim.url: False, survivor.url: True}
            assert client.alive_urls == [survivor.url]
            more = await asyncio.gather(*(client.generate([3], {"max_new_tokens": 5}) for _ in range(4)))
            assert all(r.output_ids for r in more)

            os.kill(survivor.pid, signal.SIGKILL)
            with pytest.raises(NoHealthyEngineError) as err:
                await client.generate([3], {"max_new_tokens": 5})
            assert victim.url in str(err.value) and survivor.url in str(err.value)

    asyncio.run(run())


def test_an_engine_that_leaves_or_is_replaced_keeps_its_activity_readable():
    """Its calls may still return tokens after it left: the meter must see them beside its busy time."""
    pool = EnginePool(["http://127.0.0.1:1", "http://127.0.0.1:2"])
    leaving, replaced = (pool.engine(u) for u in pool.urls)
    leaving.begin_request()
    pool.remove_engine(leaving.url)
    pool.replace_engine(replaced.url, "http://127.0.0.1:3")
    leaving.end_request(tokens=9)
    serving, retired = pool.activities()
    assert serving == [pool.engine("http://127.0.0.1:3").activity]
    assert retired == [leaving.activity, replaced.activity] and leaving.activity.tokens == 9
