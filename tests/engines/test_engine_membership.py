"""Engines join and leave a client and a ParamSync while requests run (docs/design.md#rule-engine-set-can-change).

Real engine processes on 127.0.0.1 (the embedded engine, and the SGLang stand-in in the slow tier), the real
`EngineClient` and `ParamSync` with the disk transport. "While requests are in flight" is the engine's test-only
decode hold: the leaving engine stops its forward passes once the requests decode, so the leave meets them with the
tokens the hold found, however loaded the machine.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from collections.abc import Callable

import pytest
from aiohttp import web
from engine_helpers import ENGINE_KINDS, decode_hold, engine_command, max_abs_diff, reference_logprobs

from rllm.experimental.fully_async.api.progress import GenerationProgress
from rllm.experimental.fully_async.core.elastic import SampleMoves
from rllm.experimental.fully_async.engines import EngineLauncher
from rllm.experimental.fully_async.engines.client import EngineClient, NoHealthyEngineError
from rllm.experimental.fully_async.engines.pool import EnginePool
from rllm.experimental.fully_async.runtime.sync.param_sync import DiskTransport, ParamSync

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_torch_thread")]

MAX_NEW = 24
HELD_TOKENS = 3


@pytest.fixture(scope="module", params=ENGINE_KINDS)
def two_engines(request, models, tmp_path_factory):
    """Two engines of one kind serving model A (the first leaves, the second takes its samples)."""
    command = engine_command(request.param, models["a"][0], max_running_requests=16)
    with EngineLauncher(command, 2, log_dir=tmp_path_factory.mktemp("engine_logs")) as launcher:
        yield launcher


def test_a_leaving_engines_samples_continue_on_the_joined_one_from_their_saved_tokens(two_engines):
    """Start on engine A alone; two requests decode there (held). B joins; A leaves: both requests come back aborted
    with their tokens and finish on B, their first tokens exactly those A had produced, none regenerated."""
    leaving, joining = two_engines.urls
    sampling = {"temperature": 1.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}

    async def scenario():
        async with EngineClient([leaving], backoff_base_s=0.01, request_timeout_s=120) as client:
            records = [GenerationProgress(), GenerationProgress()]
            # The joiner holds the moved requests once each decoded a token there: the records then hold exactly
            # what came back from the leaving engine, the tokens the move continues from.
            async with decode_hold(joining, running=2, min_tokens=1) as on_joiner:
                async with decode_hold(leaving, running=2, min_tokens=HELD_TOKENS) as on_leaving:
                    tasks = [
                        asyncio.create_task(client.generate([4, 5, 6], sampling, rid=f"move-{i}", progress=records[i]))
                        for i in range(2)
                    ]
                    held = await on_leaving.reached()
                    client.add_engine(joining)
                    moved = await client.drain_engine(leaving, timeout_s=60)
                await on_joiner.reached()
                saved = [list(r.output_ids) for r in records]
            results = await asyncio.gather(*tasks)
            return held, saved, moved, results, client.urls, client.sample_moves(leaving)

    held, saved, moved, results, urls, moves = asyncio.run(scenario())
    assert moved == 2 and moves == SampleMoves(samples=2, tokens_regenerated=0, samples_unanswered=0)
    assert urls == [joining], "the leaving engine is out of routing once its samples moved"
    assert sorted(len(s) for s in saved) == sorted(r["output_tokens"] for r in held["running"])
    for before, result in zip(saved, results, strict=True):
        assert len(before) >= HELD_TOKENS, "each request came back from the leaving engine with its tokens"
        assert result.output_ids[: len(before)] == before, "the moved sample continued from its saved tokens"
        assert len(result.output_ids) == MAX_NEW, "no token was regenerated or lost across the move"
        assert result.num_resumes == 1 and result.finish_reason == "length"


def test_a_drain_out_of_time_cuts_the_leaving_engines_calls_off_and_they_finish_elsewhere_from_their_tokens(
    two_engines,
):
    """The leaving engine stops answering (SIGSTOP) while two requests decode there, each already holding tokens from
    an earlier piece. The drain's abort gets no answer; at the drain's timeout the calls are cut off and sent to the
    joined engine with the input they were sent with: both finish there from exactly their saved tokens, the drain
    counts them moved, and the leaving engine is out of routing. (What it generated after the saved tokens never
    came back: those tokens are generated again, the only ones.)"""
    leaving, joining = two_engines.urls
    sampling = {"temperature": 1.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}

    async def scenario():
        async with EngineClient([joining], backoff_base_s=0.01, request_timeout_s=120) as client:
            # Each sample's first piece, on the other engine: the tokens the cut-off calls must continue from.
            first = [
                await client.generate([4, 5, 6], {**sampling, "max_new_tokens": HELD_TOKENS}, rid=f"first-{i}")
                for i in range(2)
            ]
        records = [
            GenerationProgress(list(r.output_ids), list(r.logprobs), list(r.versions), num_resumes=1) for r in first
        ]
        saved = [list(r.output_ids) for r in records]
        async with EngineClient([leaving], backoff_base_s=0.01, request_timeout_s=120) as client:
            async with decode_hold(leaving, running=2, min_tokens=1) as on_leaving:
                tasks = [
                    asyncio.create_task(client.generate([4, 5, 6], sampling, rid=f"cut-{i}", progress=records[i]))
                    for i in range(2)
                ]
                await on_leaving.reached()
                os.kill(two_engines.processes[0].pid, signal.SIGSTOP)  # it hangs: no answer to anything
                try:
                    client.add_engine(joining)
                    began = time.monotonic()
                    moved = await client.drain_engine(leaving, timeout_s=2.0)
                    drain_s = time.monotonic() - began
                    results = await asyncio.gather(*tasks)
                finally:
                    os.kill(two_engines.processes[0].pid, signal.SIGCONT)
            return saved, moved, drain_s, results, client.urls, client.sample_moves(leaving)

    saved, moved, drain_s, results, urls, moves = asyncio.run(scenario())
    assert moved == 2 and moves == SampleMoves(samples=2, tokens_regenerated=0, samples_unanswered=2)
    assert drain_s < 30, "the drain ended at its timeout, not at the requests' own"
    assert urls == [joining]
    for before, result in zip(saved, results, strict=True):
        assert len(before) == HELD_TOKENS
        assert result.output_ids[: len(before)] == before, "the cut-off sample continued from its saved tokens"
        assert len(result.output_ids) == MAX_NEW and result.finish_reason == "length"


def test_with_every_engine_gone_a_request_waits_for_one_to_join_and_finishes_there(two_engines):
    """The last engine leaves: generation pauses (a request waits in the pool) instead of failing, and goes on
    once an engine joins. With no engine and no wait allowed, the request fails naming the outage."""
    first, second = two_engines.urls

    async def scenario():
        async with EngineClient([first], wait_for_engine_s=120, request_timeout_s=120) as client:
            assert await client.drain_engine(first, timeout_s=30) == 0
            assert client.urls == []
            task = asyncio.create_task(client.generate([4, 5], {"max_new_tokens": 4, "ignore_eos": True}))
            await asyncio.sleep(0)  # the request is sent into an empty pool (it waits there; nothing races)
            assert not task.done()
            client.add_engine(second)
            return await task

    result = asyncio.run(scenario())
    assert len(result.output_ids) == 4

    async def no_wait():
        async with EngineClient([first], wait_for_engine_s=0) as client:
            await client.drain_engine(first, timeout_s=30)
            await client.generate([4, 5], {"max_new_tokens": 4})

    with pytest.raises(NoHealthyEngineError, match="no healthy inference engine"):
        asyncio.run(no_wait())


def test_a_joining_engine_loads_the_last_synced_weights_before_it_is_synced_to(two_engines, models, tmp_path):
    """ParamSync.add_engine: the joiner (serving model A, as launched) gets the weights last synced (B, version 1)
    before anything is routed to it, and takes part in every later sync; removing every engine leaves syncs that
    only stage the weights, and the next joiner gets those."""

    def writer(name: str) -> Callable[[str], None]:
        return lambda path: shutil.copytree(models[name][0], path, dirs_exist_ok=True)

    first, second = two_engines.urls
    with ParamSync([first], DiskTransport(tmp_path / "weights"), pause_timeout_s=10) as sync:
        sync.sync(writer("b"), new_version=1)
        assert sync.add_engine(second) == 1
        assert sync.engine_versions == {first: 1, second: 1}

        async def on_joiner():
            async with EngineClient([second]) as client:
                return await client.generate([4, 5], {"max_new_tokens": 8, "ignore_eos": True})

        result = asyncio.run(on_joiner())
        assert result.versions == [1] * 8
        assert max_abs_diff(result.logprobs, reference_logprobs(models["b"][1], [4, 5], result.output_ids)) < 1e-4

        with pytest.raises(ValueError, match="already synced to"):
            sync.add_engine(second)
        sync.remove_engine(first, allow_none_left=True)
        sync.remove_engine(second, allow_none_left=True)
        report = sync.sync(writer("a"), new_version=2)  # no engine: staged only, nothing waited for
        assert report.num_engines == 0
        assert sync.add_engine(first) == 2
        assert sync.engine_versions == {first: 2}


def test_tokens_an_abort_does_not_hand_back_are_counted_regenerated_on_the_move():
    """An abort can cut SGLang's log-prob stream one token short of `output_ids` (`resumable.parse_piece` keeps only
    tokens with a log-prob). A draining engine answers its two held requests aborted: one whole (5 generated, 5 handed
    back), one short (`completion_tokens` 5, 4 log-probs): the move costs exactly 1 token generated again."""
    answered = asyncio.Event()

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        await answered.wait()  # held until the pool drains this engine
        short = body["rid"].startswith("short")
        entries = [[-0.5, t, None] for t in range(10, 15)]
        meta = {
            "id": body["rid"],
            "finish_reason": {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
            "prompt_tokens": 3,
            "completion_tokens": 5,
            "weight_version": "0",
            "output_token_logprobs": entries[:4] if short else entries,
        }
        return web.json_response({"text": "", "output_ids": list(range(10, 15)), "meta_info": meta})

    async def scenario() -> tuple[SampleMoves, int]:
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        pool = EnginePool([url])
        try:
            calls = [
                asyncio.create_task(pool.post_generate({"input_ids": [1, 2, 3]}, rid, timeout_s=30))
                for rid in ("whole", "short")
            ]
            while pool.engine(url).in_flight < 2:
                await asyncio.sleep(0.01)
            pool.begin_drain(url)
            answered.set()
            await asyncio.gather(*calls)
            return pool.sample_moves(url), pool.moves(url)
        finally:
            await pool.aclose()
            await runner.cleanup()

    moves, moved = asyncio.run(scenario())
    assert moves == SampleMoves(samples=2, tokens_regenerated=1, samples_unanswered=0) and moved == 2
