"""SGLang 0.5.6 fidelity: the stand-in's quirks (as read from SGLang's source), the launcher's flags built from the
config, the per-run API key, and a schema check of every flag and JSON key against the wheel's own source text."""

from __future__ import annotations

import ast
import asyncio
import importlib
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_helpers import decode_hold, engine_command, stream_generate, sync_weights
from omegaconf import OmegaConf
from sglang_standin import STANDIN_DIR

from rllm.experimental.fully_async.engines import EngineLauncher, SGLangEngineCommand
from rllm.experimental.fully_async.engines.client import EngineClient, EngineHTTPError, GenerationResult
from rllm.experimental.fully_async.engines.embedded.server import parse_args as embedded_parse_args
from rllm.experimental.fully_async.engines.from_config import api_key_for, engine_launcher, sglang_extra_args
from rllm.experimental.fully_async.engines.http import EngineHTTP
from rllm.experimental.fully_async.run_spec import EngineLoRASpec, EnginesSpec, engines_spec

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

KEY = "secret-test-key"
LONG = {"temperature": 1.0, "max_new_tokens": 150, "ignore_eos": True}
SGLANG_PAUSE_POLL_S = 1.0  # tokenizer_manager.pause_generation's sleep between lock checks (0.5.6, lines 1264-1277)


@pytest.fixture(scope="module")
def standin(models, tmp_path_factory):
    """One SGLang stand-in decoding one request at a time (so a second one waits in the queue), with an API key."""
    cmd = engine_command("sglang_standin", models["a"][0], max_running_requests=1, api_key=KEY)
    with EngineLauncher(cmd, 1, log_dir=tmp_path_factory.mktemp("standin_logs")) as launcher:
        yield launcher.urls[0]


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_calls_without_the_api_key_are_refused_except_health(standin):
    assert httpx.get(f"{standin}/health").status_code == 200
    refused = httpx.get(f"{standin}/get_weight_version")
    assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}
    assert httpx.get(f"{standin}/get_weight_version", headers=auth("wrong")).status_code == 401
    assert httpx.get(f"{standin}/get_weight_version", headers=auth()).json() == {"weight_version": "0"}

    async def run() -> None:
        async with EngineClient([standin]) as client:
            with pytest.raises(EngineHTTPError) as err:
                await client.generate([3], {"max_new_tokens": 2})
            assert err.value.status == 401 and standin in str(err.value)
        async with EngineClient([standin], api_key=KEY) as client:
            assert len((await client.generate([3], {"max_new_tokens": 2, "ignore_eos": True})).output_ids) == 2

    asyncio.run(run())


def test_embedded_engine_honours_the_same_header(models, tmp_path):
    cmd = engine_command("embedded", models["a"][0], api_key=KEY)
    with EngineLauncher(cmd, 1, log_dir=tmp_path) as launcher:
        url = launcher.urls[0]
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.post(f"{url}/generate", json={"input_ids": [3]}).status_code == 401
        ok = httpx.post(
            f"{url}/generate", json={"input_ids": [3], "sampling_params": {"max_new_tokens": 1}}, headers=auth()
        )
        assert ok.status_code == 200


def test_a_load_while_paused_does_not_apply_weight_version_but_update_weight_version_does(standin, models):
    with httpx.Client(headers=auth(), timeout=60) as http:
        http.post(f"{standin}/pause_generation", json={"mode": "abort"}).raise_for_status()
        body = http.post(
            f"{standin}/update_weights_from_disk", json={"model_path": str(models["a"][0]), "weight_version": "5"}
        ).json()
        assert body["success"] is True
        assert http.get(f"{standin}/get_weight_version").json() == {"weight_version": "0"}
        answer = http.post(f"{standin}/update_weight_version", json={"new_version": "5", "abort_all_requests": False})
        assert answer.json()["new_version"] == "5"
        assert http.get(f"{standin}/weight_version").json() == http.get(f"{standin}/get_weight_version").json()
        assert http.get(f"{standin}/get_weight_version").json() == {"weight_version": "5"}
        http.post(f"{standin}/continue_generation", json={}).raise_for_status()
        # Unpaused, the version passed with the load is applied (SGLang's other branch).
        http.post(
            f"{standin}/update_weights_from_disk", json={"model_path": str(models["a"][0]), "weight_version": "0"}
        ).raise_for_status()
        assert http.get(f"{standin}/get_weight_version").json() == {"weight_version": "0"}


def test_http_error_codes_are_sglangs(standin):
    with httpx.Client(headers=auth(), timeout=30) as http:
        assert http.post(f"{standin}/update_weights_from_disk", json={}).status_code == 422
        assert http.post(f"{standin}/update_weight_version", json={}).status_code == 422
        assert http.post(f"{standin}/pause_generation", json={"mode": "sideways"}).status_code == 422
        assert http.post(f"{standin}/slow_down", json={}).status_code == 422
        lifted = http.post(f"{standin}/slow_down", json={"forward_sleep_time": None})
        assert lifted.status_code == 200 and lifted.json() is None
        bad = http.post(f"{standin}/update_weights_from_disk", json={"model_path": "/nonexistent"})
        assert bad.status_code == 400 and bad.json()["success"] is False
        aborted = http.post(f"{standin}/abort_request", json={"rid": "nobody"})
        assert aborted.status_code == 200 and aborted.text == ""


def test_requests_sent_while_paused_are_held_and_waiting_queue_aborts_carry_no_version(standin):
    async def run() -> tuple[dict, dict]:
        async with httpx.AsyncClient(headers=auth(), timeout=60) as http:
            body = {"sampling_params": LONG, "return_logprob": True}
            # The pause meets one decoding and one in the waiting queue (one running slot): the engine holds there.
            async with decode_hold(standin, min_tokens=1, waiting=1, rid_prefix="pw/", headers=auth()) as hold:
                sent = {
                    rid: asyncio.ensure_future(
                        http.post(f"{standin}/generate", json={"input_ids": [3 + i], "rid": rid, **body})
                    )
                    for i, rid in enumerate(("pw/0", "pw/1"))
                }
                found = await hold.reached()
                await http.post(f"{standin}/pause_generation", json={"mode": "abort"})
            running, waiting = (await sent[found["running"][0]["rid"]]).json(), (await sent[found["waiting"][0]]).json()
            held = asyncio.ensure_future(http.post(f"{standin}/generate", json={"input_ids": [5], **body}))
            # A check of absence: a slow machine makes it weaker (the request may not have arrived), never wrong.
            await asyncio.sleep(0.5)
            assert not held.done(), "a request sent while paused must be held, not answered"
            await http.post(f"{standin}/continue_generation", json={})
            assert (await held).status_code == 200
            return running, waiting

    running, waiting = asyncio.run(run())
    assert running["meta_info"]["finish_reason"]["type"] == "abort"
    assert running["meta_info"]["weight_version"] == "0" and "prompt_tokens" in running["meta_info"]
    meta = waiting["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] == 0
    assert "weight_version" not in meta and "prompt_tokens" not in meta


def test_a_pause_polls_a_second_while_a_request_is_in_flight_and_returns_at_once_without_one(standin):
    """SGLang 0.5.6's pause (mode abort) aborts, then re-checks the model-update lock after a 1 s sleep while a
    request still holds it (tokenizer_manager.pause_generation): the stand-in's pause costs what SGLang's does."""

    async def timed_pause(http: httpx.AsyncClient) -> float:
        started = time.monotonic()
        (await http.post(f"{standin}/pause_generation", json={"mode": "abort"})).raise_for_status()
        elapsed = time.monotonic() - started
        (await http.post(f"{standin}/continue_generation", json={})).raise_for_status()
        return elapsed

    async def run() -> tuple[float, float, dict]:
        async with httpx.AsyncClient(headers=auth(), timeout=60) as http:
            idle = await timed_pause(http)
            async with decode_hold(standin, min_tokens=1, rid_prefix="pp/", headers=auth()) as hold:
                body = {"input_ids": [3], "sampling_params": LONG, "rid": "pp/0"}
                running = asyncio.ensure_future(http.post(f"{standin}/generate", json=body))
                await hold.reached()  # the pause meets it decoding
                busy = await timed_pause(http)
            return idle, busy, (await running).json()

    idle, busy, answer = asyncio.run(run())
    assert answer["meta_info"]["finish_reason"]["type"] == "abort"
    assert busy >= 0.95 * SGLANG_PAUSE_POLL_S, f"a pause with a request in flight took {busy:.2f}s: SGLang sleeps 1 s"
    assert idle < 0.5 * SGLANG_PAUSE_POLL_S, f"a pause with nothing in flight took {idle:.2f}s: SGLang returns at once"


def test_waiting_queue_aborts_are_resumed_as_unstarted_pieces(standin, models):
    async def run() -> list:
        async with EngineClient([standin], api_key=KEY) as client:
            # The sync meets one decoding and one in the waiting queue (one running slot): the engine holds there.
            async with decode_hold(standin, min_tokens=1, waiting=1, rid_prefix="wq/", headers=auth()) as hold:
                tasks = {
                    rid: asyncio.ensure_future(client.generate([3 + i], LONG, rid=rid))
                    for i, rid in enumerate(("wq/0", "wq/1"))
                }
                found = await hold.reached()
                await sync_weights(client, standin, models["a"][0], "1")
            results = await asyncio.gather(*tasks.values())
            await client.update_weight_version(standin, "0")
            # the client suffixes each piece's rid: "wq/0-0" is the first piece of wq/0
            running_first = found["running"][0]["rid"].startswith("wq/0-")
            return results if running_first else results[::-1]

    started, queued = asyncio.run(run())
    assert len(started.output_ids) == len(queued.output_ids) == 150
    assert started.versions[0] == 0 and started.versions[-1] == 1 and started.num_resumes == 1
    assert queued.versions == [1] * 150 and queued.num_resumes == 1


def test_a_batch_answers_a_list_and_its_waiting_prompts_are_resumed_as_unstarted_pieces(standin, models):
    """SGLang's batched /generate (input_ids a list of lists, one rid per prompt) answers the list of outputs when
    the last prompt ends. With one running slot, the second prompt of the batch waits; a pause aborts both, the
    waiting one without weight_version, and the next round re-sends each from where it stood."""

    async def run() -> tuple[list, list[GenerationResult]]:
        async with httpx.AsyncClient(headers=auth(), timeout=60) as http:
            raw = await http.post(
                f"{standin}/generate",
                json={
                    "input_ids": [[3], [4, 5]],
                    "rid": ["b0", "b1"],
                    "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},  # a sampled eos ends one early
                },
            )
            one_rid = await http.post(f"{standin}/generate", json={"input_ids": [[3], [4]], "rid": "c"})
            assert [r["meta_info"]["id"] for r in one_rid.json()] == ["c_0", "c_1"], "SGLang's _normalize_rid"
        async with EngineClient([standin], api_key=KEY) as client:
            # The sync meets the first prompt decoding and the second waiting (one running slot; a batch queues its
            # prompts in order): the engine holds there.
            async with decode_hold(standin, min_tokens=1, waiting=1, rid_prefix="w/", headers=auth()) as hold:
                task = asyncio.ensure_future(client.generate_batch([[3], [4]], LONG, rids=["w/0", "w/1"]))
                found = await hold.reached()
                assert found["running"][0]["rid"].startswith("w/0-") and found["waiting"][0].startswith("w/1-")
                await sync_weights(client, standin, models["a"][0], "1")
            results = await asyncio.wait_for(task, 60)
            await client.update_weight_version(standin, "0")
            return raw.json(), results

    raw, (started, queued) = asyncio.run(run())
    assert [r["meta_info"]["id"] for r in raw] == ["b0", "b1"]
    assert [r["meta_info"]["prompt_tokens"] for r in raw] == [1, 2] and all(len(r["output_ids"]) == 4 for r in raw)
    assert len(started.output_ids) == len(queued.output_ids) == 150
    assert started.versions[0] == 0 and started.versions[-1] == 1 and started.num_resumes == 1
    assert queued.versions == [1] * 150 and queued.num_resumes == 1


# ---------------------------------------------------------------- streaming (stream: true)
# What SGLang 0.5.6 sends, read from http_server.generate_request, tokenizer_manager._wait_one_response,
# _handle_batch_output, _handle_batch_request and _handle_abort_req (checked against the wheel's text at the end).
RUNNING_CHUNK_KEYS = {
    "id",
    "finish_reason",
    "prompt_tokens",
    "weight_version",
    "total_retractions",
    "completion_tokens",
    "cached_tokens",
}


def assert_sglang_chunks(chunks: list[dict], finish: dict | str, return_logprob: bool = True) -> None:
    """A request's chunks as SGLang streams them without --stream-output: each the request so far (cumulative text,
    output_ids and output_token_logprobs), finish_reason null until the last, which alone has e2e_latency; the first
    alone has response_sent_to_client_ts."""
    logprob_keys = {"output_token_logprobs"} if return_logprob else set()
    so_far: list[int] = []
    for i, chunk in enumerate(chunks):
        meta, last = chunk["meta_info"], i == len(chunks) - 1
        assert chunk["text"] == "" and meta["completion_tokens"] == len(chunk["output_ids"])
        assert chunk["output_ids"][: len(so_far)] == so_far, "cumulative output_ids"
        so_far = chunk["output_ids"]
        assert ("response_sent_to_client_ts" in meta) == (i == 0) and ("e2e_latency" in meta) == last
        if not last:
            assert meta["finish_reason"] is None and meta["weight_version"] == "0"
            assert set(meta) - {"response_sent_to_client_ts"} == RUNNING_CHUNK_KEYS | logprob_keys
            if return_logprob:
                assert [e[1] for e in meta["output_token_logprobs"]] == chunk["output_ids"]
    last = chunks[-1]["meta_info"]["finish_reason"]
    assert last == finish if isinstance(finish, dict) else last["type"] == finish


def test_a_stream_sends_sglangs_chunks_while_the_request_decodes_then_done(standin):
    body = {"input_ids": [3, 4], "sampling_params": LONG, "return_logprob": True, "rid": "st/0"}

    async def run() -> tuple[dict, list[dict]]:
        async with httpx.AsyncClient(headers=auth(), timeout=60) as http:
            chunks: list[dict] = []
            stream = stream_generate(http, standin, body)
            async with decode_hold(standin, min_tokens=2, rid_prefix="st/", headers=auth()) as hold:
                while len((chunk := await anext(stream))["output_ids"]) < 2:
                    chunks.append(chunk)
                chunks.append(chunk)  # sent while the engine holds the request at its 2nd token
                await hold.reached()
            chunks += [c async for c in stream]
            return chunk, chunks

    mid, chunks = asyncio.run(run())
    assert mid["meta_info"]["finish_reason"] is None and len(mid["output_ids"]) == 2
    assert_sglang_chunks(chunks, {"type": "length", "length": 150})
    assert len(chunks[-1]["output_ids"]) == 150 and "index" not in chunks[-1]


def test_a_stream_sent_while_paused_has_its_headers_at_once_and_its_tokens_after_the_continue(standin):
    """Starlette sends a StreamingResponse's status and headers before the body's generator runs, and the pause
    gate is inside it (tokenizer_manager.generate_request): the client sees 200 while the request is held."""

    async def run() -> list[dict]:
        async with httpx.AsyncClient(headers=auth(), timeout=60) as http:
            (await http.post(f"{standin}/pause_generation", json={"mode": "abort"})).raise_for_status()
            try:
                body = {"input_ids": [5], "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}, "stream": True}
                async with http.stream("POST", f"{standin}/generate", json=body) as response:
                    assert response.status_code == 200  # the headers came while the engine is paused
                    (await http.post(f"{standin}/continue_generation", json={})).raise_for_status()
                    lines = [line async for line in response.aiter_lines() if line]
            finally:
                await http.post(f"{standin}/continue_generation", json={})
        assert lines[-1] == "data: [DONE]"
        return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]

    chunks = asyncio.run(run())
    assert_sglang_chunks(chunks, "length", return_logprob=False)
    assert len(chunks[-1]["output_ids"]) == 6


def test_a_pause_ends_a_running_stream_with_finish_abort_and_a_waiting_one_with_its_abort_chunk(standin):
    """A running request ends with FINISH_ABORT's JSON and its tokens; one aborted in the waiting queue with
    _handle_abort_req's chunk: 'Abort in waiting queue', its last token as output_ids (none: it never ran), no
    weight_version nor prompt_tokens."""

    async def run() -> tuple[list[dict], list[dict]]:
        async with httpx.AsyncClient(headers=auth(), timeout=60) as http:
            got: dict[str, list[dict]] = {"sp/0": [], "sp/1": []}

            async def read(rid: str, prompt: list[int]) -> None:
                body = {"input_ids": prompt, "sampling_params": LONG, "rid": rid, "return_logprob": True}
                got[rid] += [c async for c in stream_generate(http, standin, body)]

            async with decode_hold(standin, min_tokens=3, waiting=1, rid_prefix="sp/", headers=auth()) as hold:
                readers = [asyncio.ensure_future(read(rid, [3 + i])) for i, rid in enumerate(got)]
                found = await hold.reached()
                await http.post(f"{standin}/pause_generation", json={"mode": "abort"})
            await http.post(f"{standin}/continue_generation", json={})
            await asyncio.gather(*readers)
            return got[found["running"][0]["rid"]], got[found["waiting"][0]]

    running, waiting = asyncio.run(run())
    assert_sglang_chunks(running, {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None})
    assert len(running[-1]["output_ids"]) == 3, "aborted with the tokens it had when the pause met it"
    assert len(waiting) == 1, "never ran: the abort is its only chunk"
    meta = waiting[0]["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert waiting[0]["output_ids"] == [] and meta["completion_tokens"] == 0 and meta["output_token_logprobs"] == []
    assert set(meta) == {
        "id",
        "finish_reason",
        "completion_tokens",
        "output_token_logprobs",
        "response_sent_to_client_ts",
    }


def test_a_streamed_batch_tags_each_chunk_with_its_prompts_index_and_an_error_is_a_chunk(standin):
    async def run() -> tuple[list[dict], list[dict]]:
        async with httpx.AsyncClient(headers=auth(), timeout=60) as http:
            params = {"max_new_tokens": 4, "ignore_eos": True}
            body = {"input_ids": [[3], [4, 5]], "rid": "sb", "sampling_params": params}
            batch = [c async for c in stream_generate(http, standin, body)]
            too_long = [c async for c in stream_generate(http, standin, {"input_ids": [3] * 300})]
            return batch, too_long

    batch, too_long = asyncio.run(run())
    for index in (0, 1):
        mine = [c for c in batch if c["index"] == index]
        assert {c["meta_info"]["id"] for c in mine} == {f"sb_{index}"}  # _normalize_rid
        assert_sglang_chunks(mine, "length", return_logprob=False)
        assert len(mine[-1]["output_ids"]) == 4 and mine[-1]["meta_info"]["prompt_tokens"] == index + 1
    assert len(too_long) == 1 and set(too_long[0]) == {"error"} and too_long[0]["error"]["message"]


def test_the_streamed_wire_format_is_the_one_in_sglangs_source(sglang_wheel_source):
    """The strings the stand-in streams are SGLang 0.5.6's own (read from the wheel, never imported)."""
    http_server = sglang_wheel_source["entrypoints/http_server.py"]
    manager = sglang_wheel_source["managers/tokenizer_manager.py"]
    batch = sglang_wheel_source["managers/schedule_batch.py"]
    assert 'yield b"data: [DONE]\\n\\n"' in http_server and 'media_type="text/event-stream"' in http_server
    assert 'yield b"data: " + orjson.dumps(' in http_server and 'out = {"error": {"message": str(e)}}' in http_server
    for key in (*RUNNING_CHUNK_KEYS, "e2e_latency", "response_sent_to_client_ts", "text", "output_ids"):
        assert f'"{key}"' in manager, key
    assert 'result["index"] = rid_to_index[result["meta_info"]["id"]]' in manager
    assert 'abort_message = recv_obj.abort_message or "Abort in waiting queue"' in manager
    assert "output_ids = [output_ids[-1]] if len(output_ids) > 0 else []" in manager  # a stream's abort chunk
    assert "output_token_ids = state.output_ids.copy()" in manager  # cumulative without --stream-output
    assert 'self.message = message or "Aborted"' in batch and '"status_code": self.status_code' in batch
    assert "stream_output: bool = False" in sglang_wheel_source["server_args.py"]


# ---------------------------------------------------------------- command line from the config


def sglang_cfg(**extra_args: object) -> EnginesSpec:
    """The engines part of a run spec built from a config, as the run builds it (run_spec.py)."""
    cfg = OmegaConf.create(
        {
            "engines": {
                "backend": "sglang",
                "max_running_requests": 64,
                "dtype": "bfloat16",
                "num_engines": 2,
                "startup_timeout_s": 10,
                "request_timeout_s": 60,
                "torch_threads": 1,
                "on_engine_failure": "fail",
                "max_restarts": 0,
                "extra_args": extra_args,
                "sampling_seed": None,
                "deterministic_inference": False,
                "forward_sleep_s": 0.0,
                "no_engine_timeout_s": 600.0,
            },
            "actor_rollout_ref": {
                "model": {"path": "/models/qwen"},
                "rollout": {"tensor_model_parallel_size": 2, "gpu_memory_utilization": 0.55},
            },
            "run": {"seed": 3, "log_level": "INFO"},
        }
    )
    return engines_spec(cfg)


def test_sglang_command_takes_tp_and_memory_from_the_config_and_bools_are_bare_flags(tmp_path):
    launcher = engine_launcher(
        sglang_cfg(enable_torch_compile=True, disable_radix_cache=False, chunked_prefill_size=4096), tmp_path
    )
    cmd = launcher.command.build("127.0.0.1", 30000, 1)
    assert cmd[cmd.index("--tp-size") + 1] == "2" and cmd[cmd.index("--mem-fraction-static") + 1] == "0.55"
    assert cmd[cmd.index("--random-seed") + 1] == "4" and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert "--enable-torch-compile" in cmd and not any("disable-radix" in a for a in cmd)
    assert "--chunked-prefill-size=4096" in cmd and not any(a.endswith("=True") for a in cmd)
    assert launcher.command.env(1) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert launcher.api_key is None and "--api-key" not in cmd  # loopback: no key
    with pytest.raises(ValueError, match=r"engines\.extra_args\.tp_size"):
        sglang_extra_args({"tp_size": 4})


def test_engines_beyond_loopback_get_a_per_run_api_key(tmp_path):
    assert api_key_for("127.0.0.1") is None and api_key_for("localhost") is None and api_key_for("::1") is None
    first = engine_launcher(sglang_cfg(), tmp_path, host="10.0.0.5")
    second = engine_launcher(sglang_cfg(), tmp_path, host="10.0.0.5")
    assert first.api_key and len(first.api_key) >= 32 and first.api_key != second.api_key
    cmd = first.command.build("10.0.0.5", 30000, 0)
    assert cmd[cmd.index("--api-key") + 1] == first.api_key


# ---------------------------------------------------------------- schema check against the wheel's source


@pytest.fixture(scope="session")
def sglang_wheel_source() -> dict[str, str]:
    """server_args.py, io_struct.py and the files the stream's format comes from, of sglang==0.5.6, as text, from
    its wheel (downloaded once into a cache)."""
    cache = Path.home() / ".cache" / "rllm_fully_async" / "wheels"
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("sglang-0.5.6-*.whl"))
    if not wheels:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "sglang==0.5.6", "-d", str(cache)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        wheels = sorted(cache.glob("sglang-0.5.6-*.whl"))
        if not wheels:
            pytest.skip(f"pip could not download sglang==0.5.6 from the registry: {proc.stderr.strip()[-300:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        return {
            name: wheel.read(f"sglang/srt/{name}").decode()
            for name in (
                "server_args.py",
                "managers/io_struct.py",
                "sampling/sampling_params.py",
                "entrypoints/http_server.py",
                "managers/tokenizer_manager.py",
                "managers/schedule_batch.py",
            )
        }


def dataclass_fields(source: str, class_name: str) -> set[str]:
    """Annotated fields of `class_name` and of BaseReq (rid), read from the source text (never imported)."""
    fields: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name in (class_name, "BaseReq"):
            fields |= {
                s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
    return fields


def test_every_flag_the_launcher_emits_exists_in_sglangs_server_args(sglang_wheel_source):
    source = sglang_wheel_source["server_args.py"]
    known = {n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    lora = EngineLoRASpec(8, ("q_proj", "v_proj"), 4, 4, "fifo", "triton")
    cmd = SGLangEngineCommand(
        "/m", max_running_requests=8, context_length=512, skip_server_warmup=True, api_key="k",
        deterministic_inference=True, lora=lora,
        extra_args=sglang_extra_args({"enable_torch_compile": True, "chunked_prefill_size": 4096}),
    ).build("127.0.0.1", 30000, 0)  # fmt: skip
    flags = [a.split("=")[0] for a in cmd if a.startswith("--")]
    assert len(flags) >= 22 and "--enable-deterministic-inference" in flags and "--max-loaded-loras" in flags
    assert [f for f in flags if f not in known] == []
    # the LoRA choices the launcher may emit are SGLang's (server_args: --lora-eviction-policy, LORA_BACKEND_CHOICES)
    assert 'choices=["lru", "fifo"]' in source and 'LORA_BACKEND_CHOICES = ["triton", "csgmv", "ascend"]' in source
    assert cmd[cmd.index("--lora-target-modules") + 1 : cmd.index("--max-loras-per-batch")] == ["q_proj", "v_proj"]


GENERATED = {  # one token, as SGLang answers (the client parses it)
    "output_ids": [5],
    "meta_info": {
        "finish_reason": {"type": "length", "length": 1},
        "output_token_logprobs": [[-0.5, 5, None]],
        "weight_version": "0",
        "prompt_tokens": 1,
    },
}


def test_every_json_key_the_client_and_param_sync_send_exists_in_io_struct(sglang_wheel_source):
    source = sglang_wheel_source["managers/io_struct.py"]
    sent: list[tuple[str, dict]] = []

    async def record(self, method, path, payload, timeout_s):
        sent.append((path, payload or {}))
        if path == "/generate" and isinstance(payload["input_ids"][0], int):
            return GENERATED
        if path == "/generate" and isinstance(payload.get("rid"), list):  # the client's batches carry one rid each
            return [GENERATED] * len(payload["input_ids"])
        return {"success": True, "weight_version": "1", "output_ids": [], "meta_info": {}}

    async def run() -> None:
        http = EngineHTTP("http://x", lambda: None)  # type: ignore[arg-type,return-value]
        http.request = record.__get__(http)  # type: ignore[method-assign]
        await http.generate(
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 3}, "return_logprob": True, "rid": "r"}, 1
        )
        await http.pause_generation("abort", 1)
        await http.continue_generation(1)
        await http.abort_request("r", False, 1)
        await http.abort_request(None, True, 1)
        await http.update_weights_from_disk("/m", "1", flush_cache=True, abort_all_requests=False, timeout_s=1)
        await http.update_weight_version("1", 1)
        await http.init_weights_update_group(
            master_address="a", master_port=1, rank_offset=1, world_size=2, group_name="g", backend="nccl", timeout_s=1
        )
        await http.update_weights_from_distributed(
            names=["w"],
            dtypes=["bfloat16"],
            shapes=[[1]],
            group_name="g",
            weight_version="1",
            flush_cache=True,
            timeout_s=1,
        )
        await http.load_lora_adapter("policy-v1", "/adapters/v1", False, 1)
        await http.unload_lora_adapter("policy-v1", 1)
        async with EngineClient(["http://x"]) as client:
            client.pool.engine("http://x").http.request = http.request  # type: ignore[method-assign]
            await client.generate([1], {"max_new_tokens": 1}, lora_path="policy-v1")
            await client.generate_batch([[1], [2]], {"max_new_tokens": 1}, rids=["a", "b"], lora_path="policy-v1")

    asyncio.run(run())
    request_class = {
        "/generate": "GenerateReqInput",
        "/pause_generation": "PauseGenerationReqInput",
        "/continue_generation": "ContinueGenerationReqInput",
        "/abort_request": "AbortReq",
        "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
        "/update_weight_version": "UpdateWeightVersionReqInput",
        "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
        "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
        "/load_lora_adapter": "LoadLoRAAdapterReqInput",
        "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
    }
    assert sum(1 for path, payload in sent if path == "/generate" and payload.get("lora_path") == "policy-v1") == 2
    assert {path for path, _ in sent} == set(request_class)
    for path, payload in sent:
        fields = dataclass_fields(source, request_class[path])
        assert fields, f"{request_class[path]} not found in io_struct.py"
        assert set(payload) <= fields, f"{path} sends {sorted(set(payload) - fields)} unknown to SGLang 0.5.6"
    sampling = sglang_wheel_source["sampling/sampling_params.py"]
    # sampling_seed: engines.sampling_seed (engines/resumable.py), an int32 with SGLang's default 42
    assert "sampling_seed: int = 42" in sampling
    for key in ("max_new_tokens", "temperature", "top_p", "top_k", "ignore_eos", "stop_token_ids", "sampling_seed"):
        assert f"{key}:" in sampling or f"self.{key} =" in sampling, key


# ---------------------------------------------------------------- LoRA without --enable-lora, and the LoRA flags


def test_without_enable_lora_a_lora_path_is_ignored_and_the_lora_routes_refuse(standin):
    """tokenizer_manager.generate_request resolves adapters only `if self.server_args.enable_lora and
    obj.lora_path`: the request runs on the base model. load/unload answer 400 with SGLang's message
    (tokenizer_communicator_mixin.load_lora_adapter); /v1/models lists the served model alone."""
    with httpx.Client(headers=auth(), timeout=60) as http:
        body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
        assert http.post(f"{standin}/generate", json={**body, "lora_path": "never-loaded"}).status_code == 200
        refused = http.post(f"{standin}/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
        assert refused.status_code == 400
        assert refused.json()["error_message"] == "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
        assert refused.json()["success"] is False and refused.json()["loaded_adapters"] is None
        assert http.post(f"{standin}/load_lora_adapter", json={"lora_name": "a"}).status_code == 422
        cards = http.get(f"{standin}/v1/models").json()["data"]
        assert [c["parent"] for c in cards] == [None] and cards[0]["owned_by"] == "sglang"


@pytest.fixture
def standin_parse_args(monkeypatch) -> Any:
    """The stand-in's flag parser, imported here as its launcher imports it (its folder on sys.path)."""
    monkeypatch.syspath_prepend(STANDIN_DIR)
    return importlib.import_module("standin_server").parse_args


@pytest.mark.parametrize("server", ["embedded", "standin"])
def test_the_lora_flags_are_checked_as_sglangs_check_lora_server_args(server, request):
    """server_args.check_lora_server_args: --lora-paths enable LoRA; without them --max-lora-rank and
    --lora-target-modules are both required; --max-loaded-loras >= --max-loras-per-batch and >= the paths;
    'all' alone; LoRAPathAction's PATH | NAME=PATH | JSON forms."""
    parse_args = embedded_parse_args if server == "embedded" else request.getfixturevalue("standin_parse_args")
    base = ["--model-path", "/m", "--port", "1"]
    ok = parse_args([*base, "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all"])
    assert ok.enable_lora and ok.lora_target_modules == frozenset({"qkv_proj", "gate_up_proj", "o_proj", "down_proj"})
    paths = parse_args([*base, "--lora-paths", "/a", "b=/b", '{"lora_name": "c", "lora_path": "/c", "pinned": true}'])
    assert paths.enable_lora is True, "--lora-paths turn LoRA on"
    assert paths.lora_refs == [("/a", "/a", False), ("b", "/b", False), ("c", "/c", True)]
    assert not parse_args(base).enable_lora
    for bad in (
        ["--enable-lora", "--max-lora-rank", "8"],  # no target modules, no paths
        ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all", "q_proj"],
        ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all", "--max-loaded-loras", "4"],
        ["--lora-paths", "/a", "/b", "--max-loras-per-batch", "1", "--max-loaded-loras", "1"],
        ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "embed_tokens"],
    ):
        with pytest.raises(SystemExit):
            parse_args([*base, *bad])
    if server == "embedded":  # GPU-only flags: the embedded engine has no kernels or buffer slots to choose
        with pytest.raises(SystemExit):
            parse_args([*base, "--enable-lora", "--lora-backend", "triton"])
    else:
        assert (
            parse_args([*base, "--lora-eviction-policy", "fifo", "--lora-backend", "triton"]).lora_backend == "triton"
        )
