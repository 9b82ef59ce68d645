"""The embedded engine, through its HTTP API, in a real subprocess on loopback.

Reference numbers come from `transformers` in this process: greedy `generate` for tokens, a full forward pass
for log-probs. The fixture model is re-initialised with larger weights ("sharpened") because the random tiny
model echoes its last token, which would make token-equality checks vacuous.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from engine_helpers import (
    LOGPROB_TOL,
    TEST_ONLY_ROUTES,
    decode_hold,
    max_abs_diff,
    reference_logprobs,
    stream_generate,
)
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from rllm.experimental.fully_async.engines import (
    EmbeddedEngineCommand,
    EngineLauncher,
    EngineStartupError,
    SGLangEngineCommand,
)
from rllm.experimental.fully_async.engines.embedded import server
from rllm.experimental.fully_async.engines.embedded.model_runner import ModelRunner, load_model
from rllm.experimental.fully_async.engines.embedded.sampling import SamplingParams
from rllm.experimental.fully_async.engines.embedded.scheduler import Scheduler
from rllm.experimental.fully_async.engines.embedded.weights import WeightLoader

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]

EOS = 1


def greedy_tokens(model: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    """Argmax continuation of `prompt` for exactly n tokens (no eos handling), one full forward per token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.02) -> None:
    """Poll another process's state (there is no event to wait on) until `predicate()` or fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


@pytest.fixture(scope="module")
def engine(models, tmp_path_factory):
    """One engine process serving model A (stopped at the end of the module)."""
    cmd = EmbeddedEngineCommand(
        str(models["a"][0]), max_running_requests=64, num_threads=1, seed=3, extra_args=TEST_ONLY_ROUTES
    )
    with EngineLauncher(cmd, 1, log_dir=tmp_path_factory.mktemp("engine_logs")) as launcher:
        yield launcher.urls[0]


def post(url: str, path: str, payload: dict, timeout: float = 60.0) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=payload, timeout=timeout)


def stats(url: str) -> dict:
    return httpx.get(f"{url}/get_server_info", timeout=10).json()["engine_stats"]


def decode_passes(engine_stats: dict) -> int:
    return engine_stats["forward_passes"] - engine_stats["prefill_passes"]


async def generate_many(url: str, payloads: list[dict], timeout: float = 120.0) -> list[dict]:
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=256)) as http:
        responses = await asyncio.gather(*(http.post(f"{url}/generate", json=p) for p in payloads))
    for r in responses:
        r.raise_for_status()
    return [r.json() for r in responses]


def logprobs_of(response: dict) -> list[float]:
    entries = response["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == response["output_ids"]
    return [e[0] for e in entries]


# Mixed lengths; under model A the greedy continuations of [8], [27] and [20] hit eos within 24 tokens.
PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11, 12, 13], [8], list(range(5, 18)), [27], [9] * 5, [20]]


# ---------------------------------------------------------------- correctness against transformers
def test_greedy_output_matches_transformers_generate_and_logprobs_match_forward(engine, models):
    _, model_a = models["a"]
    payloads = [
        {"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 24}, "return_logprob": True}
        for p in PROMPTS
    ]
    # Sent concurrently, so the engine pads and batches them; the reference runs each prompt alone.
    responses = asyncio.run(generate_many(engine, payloads))
    finish_types = set()
    for prompt, resp in zip(PROMPTS, responses, strict=True):
        ref = model_a.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=EOS, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert resp["output_ids"] == ref, f"prompt {prompt}"
        ftype = resp["meta_info"]["finish_reason"]["type"]
        finish_types.add(ftype)
        assert ftype == ("stop" if ref[-1] == EOS else "length")
        assert resp["meta_info"]["completion_tokens"] == len(ref)
        assert resp["meta_info"]["prompt_tokens"] == len(prompt)
        assert resp["meta_info"]["weight_version"] == "0"
        assert max_abs_diff(logprobs_of(resp), reference_logprobs(model_a, prompt, ref)) < LOGPROB_TOL
    assert finish_types == {"stop", "length"}, "the prompts should exercise both eos and length endings"


def test_sampled_logprobs_are_those_of_the_temperature_scaled_distribution(engine, models):
    _, model_a = models["a"]
    temperature = 0.7
    payloads = [
        {
            "input_ids": p,
            "sampling_params": {"temperature": temperature, "top_p": 0.9, "top_k": 20, "max_new_tokens": 20},
            "return_logprob": True,
        }
        for p in PROMPTS
    ]
    for prompt, resp in zip(PROMPTS, asyncio.run(generate_many(engine, payloads)), strict=True):
        out = resp["output_ids"]
        assert out
        expected = reference_logprobs(model_a, prompt, out, temperature)
        assert max_abs_diff(logprobs_of(resp), expected) < LOGPROB_TOL
        # ...and not those of the untempered distribution.
        assert max_abs_diff(logprobs_of(resp), reference_logprobs(model_a, prompt, out, 1.0)) > 1e-3


def test_stop_token_ids_end_generation_unless_ignore_eos(engine, models):
    _, model_a = models["a"]
    prompt = PROMPTS[1]
    expected = greedy_tokens(model_a, prompt, 24)
    stop_at = expected[3]  # a token the model emits 4th
    cut = next(i for i, tok in enumerate(expected) if tok in (stop_at, EOS)) + 1
    params = {"temperature": 0, "max_new_tokens": 24, "stop_token_ids": [stop_at]}
    resp = post(engine, "/generate", {"input_ids": prompt, "sampling_params": params}).json()
    assert resp["output_ids"] == expected[:cut]
    assert resp["meta_info"]["finish_reason"] == {"type": "stop", "matched": expected[cut - 1]}
    # ignore_eos also disables stop_token_ids (SGLang's check_finished).
    params |= {"ignore_eos": True}
    resp = post(engine, "/generate", {"input_ids": prompt, "sampling_params": params}).json()
    assert resp["output_ids"] == expected
    assert resp["meta_info"]["finish_reason"] == {"type": "length", "length": 24}


def test_batch_request_returns_one_result_per_prompt(engine):
    body = {
        "input_ids": PROMPTS[:3],
        "sampling_params": [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (1, 5, 9)],
        "rid": ["r-a", "r-b", "r-c"],
    }
    resp = post(engine, "/generate", body).json()
    assert [len(r["output_ids"]) for r in resp] == [1, 5, 9]
    assert [r["meta_info"]["id"] for r in resp] == ["r-a", "r-b", "r-c"]
    assert all("output_token_logprobs" not in r["meta_info"] for r in resp)


# ---------------------------------------------------------------- batching
def test_64_concurrent_requests_of_mixed_lengths_share_forward_passes(engine):
    before = stats(engine)
    lengths = [1 + (i * 37) % 48 for i in range(64)]
    payloads = [
        {
            "input_ids": [2 + i % 29] * (1 + i % 11),
            "sampling_params": {"temperature": 1.0, "max_new_tokens": n, "ignore_eos": True},
            "return_logprob": True,
        }
        for i, n in enumerate(lengths)
    ]
    responses = asyncio.run(generate_many(engine, payloads))
    assert [len(r["output_ids"]) for r in responses] == lengths
    assert all(len(logprobs_of(r)) == n for r, n in zip(responses, lengths, strict=True))
    after = stats(engine)
    tokens = after["generated_tokens"] - before["generated_tokens"]
    passes = after["forward_passes"] - before["forward_passes"]
    assert tokens == sum(lengths)
    # One request at a time would need one pass per token; shared passes need about max(lengths) + prefills.
    assert passes * 4 < tokens, f"{passes} forward passes for {tokens} tokens: requests were not batched"
    assert after["max_running_seen"] > 8


# ---------------------------------------------------------------- pause / abort / continue
def test_pause_abort_returns_partial_output_and_holds_new_requests_until_continue(engine):
    long_params = {"temperature": 1.0, "max_new_tokens": 240, "ignore_eos": True}

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            try:
                async with decode_hold(engine, min_tokens=3, rid_prefix="pause/") as hold:
                    body = {"input_ids": [4, 5, 6], "sampling_params": long_params, "rid": "pause/0"}
                    first = asyncio.ensure_future(http.post(f"{engine}/generate", json=body))
                    assert (await hold.reached())["running"] == [{"rid": "pause/0", "output_tokens": 3}]
                    await http.post(f"{engine}/pause_generation", json={"mode": "abort"})
                partial = (await asyncio.wait_for(first, 30)).json()
                assert partial["meta_info"]["finish_reason"]["type"] == "abort"
                assert len(partial["output_ids"]) == 3, "aborted with the tokens it had when the pause met it"

                held = asyncio.ensure_future(
                    http.post(f"{engine}/generate", json={"input_ids": [4, 5, 6], "sampling_params": long_params})
                )
                assert stats(engine)["paused"] == "abort"
                # A check of absence: a slow machine makes it weaker, never wrong.
                done, _ = await asyncio.wait([held], timeout=0.5)
                assert not done, "a request sent while paused must wait for /continue_generation"
                assert stats(engine)["num_running"] == 0
            finally:  # the engine is the module's: a failure here must not leave it paused for the next tests
                await http.post(f"{engine}/continue_generation", json={})
            resumed = (await asyncio.wait_for(held, 30)).json()
            assert resumed["meta_info"]["finish_reason"]["type"] == "length"
            assert len(resumed["output_ids"]) == 240

    asyncio.run(scenario())


def test_abort_request_by_rid_ends_only_that_request(engine):
    params = {"temperature": 1.0, "max_new_tokens": 240, "ignore_eos": True}

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=60) as http:

            def send(rid: str) -> asyncio.Future:
                body = {"input_ids": [3], "sampling_params": params, "rid": rid}
                return asyncio.ensure_future(http.post(f"{engine}/generate", json=body))

            async with decode_hold(engine, running=2, min_tokens=3, rid_prefix="abort/") as hold:
                victim, other = send("abort/victim"), send("abort/other")
                await hold.reached()
                await http.post(f"{engine}/abort_request", json={"rid": "abort/victim"})
            aborted, finished = (await victim).json(), (await other).json()
            assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
            assert 3 <= len(aborted["output_ids"]) < 240
            assert finished["meta_info"]["finish_reason"]["type"] == "length"
            assert len(finished["output_ids"]) == 240

    asyncio.run(scenario())


def test_slow_down_sleeps_before_every_step_until_it_is_lifted(engine):
    """SGLang's /slow_down {forward_sleep_time}: a sleep before each forward pass, null lifts it; bad bodies refused."""

    def timed_generation() -> float:
        started = time.monotonic()
        body = post(
            engine, "/generate", {"input_ids": [3], "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}}
        )
        assert len(body.json()["output_ids"]) == 20
        return time.monotonic() - started

    slowed = post(engine, "/slow_down", {"forward_sleep_time": 0.05})
    assert slowed.status_code == 200 and slowed.json() is None  # SGLang's handler returns None
    try:
        assert timed_generation() >= 20 * 0.05  # a prefill and 19 decode passes, each after its sleep
    finally:
        post(engine, "/slow_down", {"forward_sleep_time": None}).raise_for_status()
    assert timed_generation() < 20 * 0.05, "the sleep outlived /slow_down null"
    assert post(engine, "/slow_down", {}).status_code == 400
    assert "forward_sleep_time" in post(engine, "/slow_down", {"forward_sleep_time": "1s"}).json()["error"]["message"]


def test_an_engine_started_with_a_forward_sleep_is_slowed_from_its_first_request(models, tmp_path):
    """engines.forward_sleep_s (`--forward-sleep-time`): the engine sleeps before every forward pass from the start,
    as after POST /slow_down, which lifts it as usual."""
    cmd = EmbeddedEngineCommand(str(models["a"][0]), max_running_requests=8, num_threads=1, forward_sleep_s=0.05)
    with EngineLauncher(cmd, 1, log_dir=tmp_path) as launcher:
        url = launcher.urls[0]

        def timed_generation() -> float:
            started = time.monotonic()
            body = post(
                url, "/generate", {"input_ids": [3], "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}}
            )
            assert len(body.json()["output_ids"]) == 20
            return time.monotonic() - started

        assert timed_generation() >= 20 * 0.05  # a prefill and 19 decode passes, each after its sleep
        post(url, "/slow_down", {"forward_sleep_time": None}).raise_for_status()
        assert timed_generation() < 20 * 0.05, "the start-up sleep is the /slow_down one: null lifts it"


def test_a_client_that_disconnects_frees_its_row(engine):
    """The handler is cancelled on disconnect, so an abandoned request stops occupying the batch."""
    params = {"temperature": 1.0, "max_new_tokens": 240, "ignore_eos": True}

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=2.0) as impatient:
            async with decode_hold(engine, min_tokens=1, rid_prefix="impatient/") as hold:
                body = {"input_ids": [3], "sampling_params": params, "rid": "impatient/0"}
                request = asyncio.ensure_future(impatient.post(f"{engine}/generate", json=body))
                await hold.reached()
                post(engine, "/pause_generation", {"mode": "in_place"})  # keeps it running but never finishing
            try:
                with pytest.raises(httpx.ReadTimeout):
                    await request
                # Polled: the drop follows the disconnect inside the engine, with no event a test can see; it is a
                # state that lasts, so a slow machine only waits longer.
                await asyncio.to_thread(
                    wait_until, lambda: stats(engine)["num_running"] == 0, 10, "the abandoned row to be dropped"
                )
            finally:
                post(engine, "/continue_generation", {})

    asyncio.run(scenario())


# ---------------------------------------------------------------- streaming (SGLang's stream: true)
async def read_stream(http: httpx.AsyncClient, url: str, body: dict, chunks: list[dict]) -> None:
    """Collect a streamed /generate's chunks into `chunks` as they come."""
    async for chunk in stream_generate(http, url, body):
        chunks.append(chunk)


def assert_cumulative(chunks: list[dict], finish_type: str) -> None:
    """SGLang's chunks without --stream-output: each holds the request so far (output_ids, its log-probs and
    completion_tokens growing; an abort's last chunk may add none), finish_reason null and no e2e_latency until the
    last."""
    for before, after in itertools.pairwise(chunks):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        assert len(after["output_ids"]) > len(before["output_ids"]) or (after is chunks[-1] and finish_type == "abort")
    for chunk in chunks:
        meta = chunk["meta_info"]
        assert meta["completion_tokens"] == len(chunk["output_ids"]) and meta["id"] == chunks[0]["meta_info"]["id"]
        if "output_token_logprobs" in meta:
            assert [e[1] for e in meta["output_token_logprobs"]] == chunk["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None and "e2e_latency" not in c["meta_info"] for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == finish_type and "e2e_latency" in chunks[-1]["meta_info"]


def test_a_streamed_request_sends_the_request_so_far_while_it_decodes_and_ends_as_the_plain_one(engine):
    """stream: true answers Server-Sent Events: a chunk while the request decodes (the hold proves it arrived before
    the end), cumulative chunks, the last one the same answer as without stream (greedy), then data: [DONE]."""
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    body = {"input_ids": PROMPTS[1], "sampling_params": params, "return_logprob": True, "rid": "stream/0"}

    async def scenario() -> tuple[dict, list[dict], dict]:
        chunks: list[dict] = []
        async with httpx.AsyncClient(timeout=60) as http:
            stream = stream_generate(http, engine, body)
            async with decode_hold(engine, min_tokens=2, rid_prefix="stream/") as hold:
                while len((chunk := await anext(stream))["output_ids"]) < 2:
                    chunks.append(chunk)
                chunks.append(chunk)  # it came while the engine held the request at its 2nd token
                assert (await hold.reached())["running"] == [{"rid": "stream/0", "output_tokens": 2}]
            chunks += [c async for c in stream]
            plain = (await http.post(f"{engine}/generate", json={**body, "rid": "plain/0"})).json()
        return chunk, chunks, plain

    mid, chunks, plain = asyncio.run(scenario())
    assert mid["meta_info"]["finish_reason"] is None and len(mid["output_ids"]) == 2, "sent while still decoding"
    assert_cumulative(chunks, "length")
    last = chunks[-1]
    assert last["output_ids"] == plain["output_ids"] and len(last["output_ids"]) == 12
    assert last["meta_info"]["output_token_logprobs"] == plain["meta_info"]["output_token_logprobs"]
    assert last["meta_info"]["weight_version"] == "0" and last["meta_info"]["prompt_tokens"] == len(PROMPTS[1])
    assert "index" not in last, "a single prompt's chunks carry no index"


def test_a_streamed_batch_interleaves_its_prompts_chunks_by_index(engine):
    body = {
        "input_ids": [[3], [4, 5], [6]],
        "sampling_params": [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (3, 9, 6)],
        "rid": ["sb/0", "sb/1", "sb/2"],
    }

    async def scenario() -> list[dict]:
        chunks: list[dict] = []
        async with httpx.AsyncClient(timeout=60) as http:
            await read_stream(http, engine, body, chunks)
        return chunks

    chunks = asyncio.run(scenario())
    by_index = {i: [c for c in chunks if c["index"] == i] for i in range(3)}
    assert sorted(by_index) == [0, 1, 2] and all("index" in c for c in chunks)
    for i, n in enumerate((3, 9, 6)):
        assert {c["meta_info"]["id"] for c in by_index[i]} == {f"sb/{i}"}
        assert_cumulative(by_index[i], "length")
        assert len(by_index[i][-1]["output_ids"]) == n


def test_an_abort_ends_a_stream_with_the_abort_and_the_tokens_so_far(engine):
    params = {"temperature": 1.0, "max_new_tokens": 240, "ignore_eos": True}
    body = {"input_ids": [4, 5], "sampling_params": params, "rid": "sa/0", "return_logprob": True}

    async def scenario() -> list[dict]:
        chunks: list[dict] = []
        async with httpx.AsyncClient(timeout=60) as http, decode_hold(engine, min_tokens=4, rid_prefix="sa/") as hold:
            reader = asyncio.ensure_future(read_stream(http, engine, body, chunks))
            await hold.reached()
            await http.post(f"{engine}/abort_request", json={"rid": "sa/0"})
            await asyncio.wait_for(reader, 30)  # the abort ends the stream while the engine still holds
        return chunks

    chunks = asyncio.run(scenario())
    assert_cumulative(chunks, "abort")
    assert len(chunks[-1]["output_ids"]) == 4 and len(chunks[-1]["meta_info"]["output_token_logprobs"]) == 4


def test_a_streamed_request_that_is_invalid_answers_an_error_chunk_then_done(engine):
    """SGLang turns a ValueError raised inside the stream into `data: {"error": {"message"}}` (status 200)."""

    async def scenario() -> list[dict]:
        async with httpx.AsyncClient(timeout=60) as http:
            return [c async for c in stream_generate(http, engine, {"input_ids": [3, 99]})]

    chunks = asyncio.run(scenario())
    assert len(chunks) == 1 and "input_ids" in chunks[0]["error"]["message"]
    # Refused before any stream starts: the body itself is malformed.
    assert post(engine, "/generate", {"input_ids": [3], "stream": "yes"}).status_code == 400


def test_a_stream_whose_reader_goes_away_frees_its_row(engine):
    params = {"temperature": 1.0, "max_new_tokens": 240, "ignore_eos": True}

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=60) as http, decode_hold(engine, min_tokens=1, rid_prefix="gone/") as hold:
            body = {"input_ids": [3], "sampling_params": params, "rid": "gone/0"}
            async with contextlib.aclosing(stream_generate(http, engine, body)) as stream:
                assert (await anext(stream))["meta_info"]["finish_reason"] is None
            # closed: the reader is gone
            await hold.reached()
            # Polled (as the disconnect test above): a state that lasts once reached, with no event to wait on.
            await asyncio.to_thread(
                wait_until, lambda: stats(engine)["num_running"] == 0, 10, "the abandoned row to be dropped"
            )

    asyncio.run(scenario())


# ---------------------------------------------------------------- the test-only decode hold
def test_the_test_only_routes_are_refused_without_their_flag_and_check_their_input(models):
    """/test_only/* is not SGLang's API: an engine started without --enable-test-only-routes refuses it (403, the
    flag named); with it, a malformed hold is refused with the keys to use."""

    async def scenario() -> None:
        model, info = load_model(str(models["a"][0]), "float32")
        for flag, status in (([], 403), (list(TEST_ONLY_ROUTES), 200)):
            scheduler = Scheduler(ModelRunner(model, info), weight_loader=WeightLoader("float32"))
            args = server.parse_args(["--model-path", str(models["a"][0]), "--port", "1", *flag])
            async with TestClient(TestServer(server.build_app(scheduler, args))) as client:
                answer = await client.post("/test_only/hold_decoding", json={"running": 1})
                assert answer.status == status, await answer.text()
                if status == 403:
                    assert "--enable-test-only-routes" in (await answer.json())["error"]["message"]
                    continue
                bad = await client.post("/test_only/hold_decoding", json={"tokens": 3})
                assert bad.status == 400 and "min_tokens" in (await bad.json())["error"]["message"]
                waited = await client.post("/test_only/wait_for_hold", json={"timeout_s": 0.1})
                assert waited.status == 504 and "not reached" in (await waited.json())["error"]["message"]
                assert (await client.post("/test_only/release_hold")).status == 200

    asyncio.run(scenario())


# ---------------------------------------------------------------- weight updates
def test_weight_update_switches_version_and_weights_and_reports_them(engine, models):
    (path_a, model_a), (path_b, model_b) = models["a"], models["b"]
    prompt = PROMPTS[3]
    params = {"temperature": 0, "max_new_tokens": 16}
    try:
        resp = post(engine, "/update_weights_from_disk", {"model_path": str(path_b), "weight_version": "7"})
        assert resp.status_code == 200 and resp.json()["success"] is True
        assert httpx.get(f"{engine}/get_weight_version").json() == {"weight_version": "7"}
        assert httpx.get(f"{engine}/get_model_info").json()["weight_version"] == "7"
        out = post(engine, "/generate", {"input_ids": prompt, "sampling_params": params, "return_logprob": True})
        out = out.json()
        expected = model_b.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=EOS)
        assert out["output_ids"] == expected[0, len(prompt) :].tolist()
        assert out["meta_info"]["weight_version"] == "7"
        assert max_abs_diff(logprobs_of(out), reference_logprobs(model_b, prompt, out["output_ids"])) < LOGPROB_TOL
        assert max_abs_diff(logprobs_of(out), reference_logprobs(model_a, prompt, out["output_ids"])) > 1e-2
    finally:
        restore = post(engine, "/update_weights_from_disk", {"model_path": str(path_a), "weight_version": "0"})
        assert restore.json()["success"] is True
    # The update to B built a model (the engine had no spare yet); the restore refilled the retired one in place.
    assert stats(engine)["weight_loads_in_place"] >= 1


def test_weight_update_from_a_bad_folder_fails_and_keeps_serving(engine, tmp_path, models):
    bad = tmp_path / "bad"
    shutil.copytree(models["a"][0], bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    resp = post(engine, "/update_weights_from_disk", {"model_path": str(bad), "weight_version": "99"})
    assert resp.status_code == 400
    assert resp.json()["success"] is False and str(bad) in resp.json()["message"]
    assert httpx.get(f"{engine}/get_weight_version").json()["weight_version"] == "0"
    out = post(engine, "/generate", {"input_ids": [3], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    assert len(out.json()["output_ids"]) == 3


def test_weight_update_is_atomic_under_concurrent_load(engine, models):
    """Updates without a pause drain running requests first, so every response is one version's output."""
    (path_a, model_a), (path_b, model_b) = models["a"], models["b"]
    by_version = {"0": model_a, "1": model_b, "2": model_a, "3": model_b, "4": model_a}

    async def scenario() -> list[tuple[list[int], dict]]:
        results: list[tuple[list[int], dict]] = []
        updates_done = asyncio.Event()
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=128)) as http:

            async def worker(i: int) -> None:
                # Keep requests coming until the updates are over, so they straddle every swap.
                n = 0
                while not updates_done.is_set() or n == 0:
                    prompt = [2 + (i + n) % 29, 3 + i % 7]
                    params = {"temperature": 1.0, "max_new_tokens": 5 + (i * 7 + n) % 25, "ignore_eos": True}
                    body = {"input_ids": prompt, "sampling_params": params, "return_logprob": True}
                    r = await http.post(f"{engine}/generate", json=body)
                    results.append((prompt, r.json()))
                    n += 1

            async def updates() -> None:
                try:
                    for version in range(1, 5):
                        path = path_b if version % 2 else path_a
                        r = await http.post(
                            f"{engine}/update_weights_from_disk",
                            json={"model_path": str(path), "weight_version": str(version)},
                        )
                        assert r.json()["success"] is True
                finally:
                    updates_done.set()

            await asyncio.gather(updates(), *(worker(i) for i in range(24)))
        return results

    try:
        results = asyncio.run(scenario())
        versions_seen = set()
        for prompt, resp in results:
            version = resp["meta_info"]["weight_version"]
            versions_seen.add(version)
            other = model_a if by_version[version] is model_b else model_b
            lp = logprobs_of(resp)
            assert max_abs_diff(lp, reference_logprobs(by_version[version], prompt, resp["output_ids"])) < LOGPROB_TOL
            assert max_abs_diff(lp, reference_logprobs(other, prompt, resp["output_ids"])) > 1e-2
        assert len(versions_seen) >= 3, f"the load should straddle updates, saw versions {versions_seen}"
    finally:
        post(engine, "/update_weights_from_disk", {"model_path": str(path_a), "weight_version": "0"})


# ---------------------------------------------------------------- API edges
def test_invalid_requests_are_rejected_with_a_message(engine):
    cases = [
        ({"input_ids": [3, 99]}, "input_ids"),
        ({"text": "hello"}, "input_ids"),
        ({"input_ids": [3], "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
        ({"input_ids": [3], "sampling_params": {"bogus": 1}}, "bogus"),
        ({"input_ids": [3] * 300}, "context length"),
    ]
    for payload, needle in cases:
        resp = post(engine, "/generate", payload)
        assert resp.status_code == 400, payload
        assert needle in resp.json()["error"]["message"]


def test_without_enable_lora_a_lora_path_is_refused_and_the_lora_routes_say_so(engine):
    """SGLang would silently run such a request on the base model (the stand-in reproduces that); the embedded
    engine refuses it, so a sample is never labelled with an adapter that did not generate it."""
    refused = post(engine, "/generate", {"input_ids": [3], "lora_path": "policy-v1"})
    assert refused.status_code == 400 and "--enable-lora" in refused.json()["error"]["message"]
    load = post(engine, "/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"})
    assert load.status_code == 400 and load.json()["error_message"].startswith("LoRA is not enabled.")
    cards = httpx.get(f"{engine}/v1/models").json()["data"]
    assert len(cards) == 1 and cards[0]["parent"] is None and cards[0]["max_model_len"] == 256


def test_flush_cache_health_and_model_info(engine, models):
    assert httpx.get(f"{engine}/health").status_code == 200
    assert httpx.post(f"{engine}/flush_cache").status_code == 200
    info = httpx.get(f"{engine}/get_model_info").json()
    assert info["model_path"] == str(models["a"][0])
    assert info["eos_token_ids"] == [EOS] and info["vocab_size"] == 32


# ---------------------------------------------------------------- model support and launcher
def test_runner_serves_a_llama_architecture_like_transformers(tmp_path):
    """SmolLM2 is a Llama: check the batched cache against transformers for that architecture too."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=2, pad_token_id=0, bos_token_id=None,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0, 0.3)
    model.save_pretrained(tmp_path / "llama")
    served, info = load_model(tmp_path / "llama")
    runner = ModelRunner(served, info)
    prompts = [[5, 6, 7], [9] * 9, [11, 12]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    outputs = [[t] for t in runner.prefill(prompts, [greedy] * 3).token_ids]
    for _ in range(11):
        step = runner.decode([o[-1] for o in outputs], [greedy] * 3)
        for out, tok in zip(outputs, step.token_ids, strict=True):
            out.append(tok)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out == greedy_tokens(model, prompt, 12)
    assert runner.forward_passes == 12


def test_sampling_is_reproducible_for_a_seed_and_top_k_1_is_greedy(models):
    path_a, _ = models["a"]
    model, info = load_model(path_a)
    prompts = [[3, 4], [9] * 6, [20]]

    def run(seed: int, params: SamplingParams) -> list[list[int]]:
        runner = ModelRunner(model, info, seed=seed)
        outputs = [[t] for t in runner.prefill(prompts, [params] * 3).token_ids]
        for _ in range(15):
            for out, tok in zip(outputs, runner.decode([o[-1] for o in outputs], [params] * 3).token_ids, strict=True):
                out.append(tok)
        return outputs

    sampled = SamplingParams(temperature=1.0, max_new_tokens=16)
    assert run(5, sampled) == run(5, sampled)
    assert run(5, sampled) != run(6, sampled)
    top1 = SamplingParams(temperature=1.0, top_k=1, max_new_tokens=16)
    assert run(5, top1) == run(6, top1) == run(0, SamplingParams(temperature=0.0, max_new_tokens=16))


class ScriptCommand:
    """An EngineCommand running a small Python script (cheap stand-ins for failing or stubborn engines)."""

    def __init__(self, script: str) -> None:
        self.script = script

    def build(self, host: str, port: int, index: int) -> list[str]:
        return [sys.executable, "-c", self.script.format(host=host, port=port)]

    def env(self, index: int) -> dict[str, str]:
        return {}


def is_running(pid: int) -> bool:
    """True if `pid` exists and is not a zombie (an orphan's zombie may linger until init reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def test_launcher_reports_an_engine_that_fails_to_start_and_leaves_no_process(tmp_path):
    # Each "engine" starts a child, records its pid and dies: the error must carry the log tail, and the
    # children must die with their process groups.
    script = (
        "import subprocess, sys\n"
        "child = subprocess.Popen(['sleep', '60'])\n"
        f"open({str(tmp_path)!r} + '/child-{{port}}', 'w').write(str(child.pid))\n"
        "print('model folder not found', flush=True)\n"
        "sys.exit(3)\n"
    )
    launcher = EngineLauncher(ScriptCommand(script), 2, log_dir=tmp_path, startup_timeout_s=60)
    with pytest.raises(EngineStartupError, match="exited with code 3") as err:
        launcher.start()
    assert "model folder not found" in str(err.value)
    assert launcher.processes == []
    child_pids = [int(p.read_text()) for p in tmp_path.glob("child-*")]
    assert child_pids
    wait_until(lambda: not any(is_running(pid) for pid in child_pids), 10, "the engines' children to exit")


def test_launcher_stop_kills_an_engine_that_ignores_sigterm(tmp_path):
    """The process-group SIGKILL fallback: a child that ignores SIGTERM is still gone after stop()."""
    script = (
        "import signal, http.server\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        "http.server.HTTPServer(('{host}', {port}), H).serve_forever()\n"
    )
    launcher = EngineLauncher(ScriptCommand(script), 1, log_dir=tmp_path, stop_timeout_s=1.0)
    launcher.start()
    pid = launcher.processes[0].pid
    launcher.stop()
    assert not is_running(pid)


def test_sglang_command_line_has_the_flags_fully_async_needs():
    cmd = SGLangEngineCommand(
        "/models/qwen", tp_size=2, gpu_ids=(4, 5, 6, 7), seed=5, max_running_requests=128, python="python"
    )
    argv = cmd.build("127.0.0.1", 30001, index=1)
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--model-path"] == "/models/qwen"
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "30001"
    assert flags["--tp-size"] == "2"
    assert flags["--weight-version"] == "0"  # SGLang's default "default" is not an integer version
    assert flags["--random-seed"] == "6"
    assert flags["--max-running-requests"] == "128"
    assert cmd.env(1) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    with pytest.raises(ValueError, match="gpu_ids"):
        cmd.env(2)


@pytest.mark.slow  # converts SmolLM2-135M from its GGUF wheel (~20-30 s) and serves it
def test_engine_serves_a_real_pretrained_model_like_transformers(tmp_path, real_model_dir):
    model_dir = real_model_dir
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365], [1, 504, 3458, 282, 4649, 314], [2683, 359]]
    prompts = [[t % model.config.vocab_size for t in p] for p in prompts]
    cmd = EmbeddedEngineCommand(str(model_dir), num_threads=1)
    with EngineLauncher(cmd, 1, log_dir=tmp_path) as launcher:
        payloads = [
            {"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 16}, "return_logprob": True}
            for p in prompts
        ]
        responses = asyncio.run(generate_many(launcher.urls[0], payloads, timeout=300))
    eos = model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
    for prompt, resp in zip(prompts, responses, strict=True):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt) :].tolist()
        ends = [i for i, tok in enumerate(ref) if tok in eos_ids]
        ref = ref[: ends[0] + 1] if ends else ref  # generate pads after eos; the engine stops there
        assert resp["output_ids"] == ref
        assert max_abs_diff(logprobs_of(resp), reference_logprobs(model, prompt, ref)) < LOGPROB_TOL
