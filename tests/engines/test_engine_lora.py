"""LoRA through the engines' HTTP API, against the embedded engine and the SGLang stand-in (started with the LoRA
flags a run's config gives): adapters loaded and unloaded while requests run, each request generated start to
finish by the adapter it named, several adapters in one continuous batch, the client's record of what each result
used, and the embedded engine's extension that receives an adapter over the weight-update group.

Log-probs are held to peft's own forward pass over the same adapter folders (`PeftModel.from_pretrained`).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_helpers import (
    ENGINE_KINDS,
    LOGPROB_TOL,
    decode_hold,
    engine_command,
    max_abs_diff,
    reference_logprobs,
    wait_for_idle,
)
from lora_helpers import LORA, peft_reference, write_adapter
from peft.utils import load_peft_weights
from transformers import AutoModelForCausalLM

from rllm.experimental.fully_async.engines import EngineLauncher
from rllm.experimental.fully_async.engines.client import EngineClient, EngineHTTPError
from rllm.experimental.fully_async.engines.lora import adapter_name, adapter_version
from rllm.experimental.fully_async.runtime.sync.sender import LocalSender

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

LONG = {"temperature": 1.0, "max_new_tokens": 200, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(models, tmp_path_factory) -> dict[str, Path]:
    base, root = models["a"][0], tmp_path_factory.mktemp("engine_lora_adapters")
    return {
        "all4": write_adapter(base, root / "all4", seed=1),
        "qv8": write_adapter(base, root / "qv8", seed=2, rank=8, alpha=16, target_modules=["q_proj", "v_proj"]),
        "other": write_adapter(base, root / "other", seed=3),
        "rank16": write_adapter(base, root / "rank16", seed=4, rank=16),
        "rslora": write_adapter(base, root / "rslora", seed=5, use_rslora=True),
    }


@pytest.fixture(scope="module")
def references(models, adapters) -> dict[str | None, Any]:
    """peft's model per adapter folder; None: the base model."""
    base = models["a"][0]
    refs: dict[str | None, Any] = {k: peft_reference(base, p) for k, p in adapters.items() if k != "rank16"}
    refs[None] = AutoModelForCausalLM.from_pretrained(base).eval()
    return refs


@pytest.fixture(scope="module", params=ENGINE_KINDS)
def lora_engines(request, models, tmp_path_factory):
    """Two engines of one kind serving model A with LoRA enabled; yields (kind, urls)."""
    cmd = engine_command(request.param, models["a"][0], lora=LORA)
    with EngineLauncher(cmd, 2, log_dir=tmp_path_factory.mktemp("lora_engine_logs")) as launcher:
        yield request.param, launcher.urls


async def fresh(client: EngineClient, urls: list[str]) -> None:
    """Unload every adapter an earlier test left (engines are shared by the module's tests)."""
    for url in urls:
        await wait_for_idle(client, url)
        for name in await client.lora_adapters(url):
            await client.unload_lora_adapter(url, name)


def stats(client_url: str) -> dict[str, Any]:
    return httpx.get(f"{client_url}/get_server_info", timeout=30).json()["internal_states"][0]


def logprobs_of(answer: dict[str, Any]) -> list[float]:
    return [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]


async def until(predicate: Any, what: str, timeout_s: float = 60.0) -> None:
    """Poll another process's state (there is no event to wait on) until `await predicate()`."""
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:g}s")
        await asyncio.sleep(0.02)


def test_one_batch_mixes_adapters_and_the_base_model_each_row_with_pefts_logprobs(lora_engines, adapters, references):
    _kind, urls = lora_engines
    url = urls[0]

    async def run() -> tuple[list[dict], dict, dict]:
        async with EngineClient(urls) as client:
            await fresh(client, urls)
            assert await client.load_lora_adapter(url, "a", str(adapters["all4"])) == {"a": str(adapters["all4"])}
            await client.load_lora_adapter(url, "q", str(adapters["qv8"]))
            before = stats(url)
            async with httpx.AsyncClient(timeout=120) as http:
                body = {
                    "input_ids": [[3, 4, 5], [6, 7], [3, 4, 5]],
                    "sampling_params": {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True},
                    "return_logprob": True,
                    "lora_path": ["a", None, "q"],
                }
                answer = (await http.post(f"{url}/generate", json=body)).json()
            return answer, before, stats(url)

    answer, before, after = asyncio.run(run())
    for row, (prompt, adapter) in enumerate(zip([[3, 4, 5], [6, 7], [3, 4, 5]], ["all4", None, "qv8"], strict=True)):
        expected = reference_logprobs(references[adapter], prompt, answer[row]["output_ids"])
        assert max_abs_diff(logprobs_of(answer[row]), expected) < LOGPROB_TOL, f"row {row} ({adapter})"
        assert "lora_path" not in answer[row]["meta_info"], "SGLang's answer names no adapter"
    assert after["prefill_passes"] - before["prefill_passes"] == 1, "the three rows were prefilled together"
    assert after["forward_passes"] - before["forward_passes"] == 12, "and decoded together, one pass a token"
    assert after["max_adapters_in_pass"] >= 2


def test_loads_and_unloads_while_requests_run_pause_nothing_and_each_request_keeps_its_adapter(
    lora_engines, adapters, references
):
    """The LoRA sync protocol: version 2 loads while a version-1 request decodes, a version-2 request starts, then
    version 1 is unloaded: the unload answers only once the version-1 request is done, which never stopped. Each
    request's tokens all carry its adapter's version and peft's log-probs under that adapter."""
    _kind, urls = lora_engines
    url = urls[0]
    v1, v2 = adapter_name(1), adapter_name(2)

    async def run() -> tuple[Any, Any, dict, dict]:
        async with EngineClient(urls) as client:
            await fresh(client, urls)
            await client.load_lora_adapter(url, v1, str(adapters["all4"]))
            before = stats(url)
            # The load and the unload meet the version-1 request decoding: the engine holds it there (decode_hold).
            async with decode_hold(url, min_tokens=1, rid_prefix="v1/") as hold:
                first = asyncio.ensure_future(client.generate([3, 4], LONG, rid="v1/0", lora_path=v1))
                await hold.reached()
                await client.load_lora_adapter(url, v2, str(adapters["other"]))
                assert not first.done(), "the load returned while the version-1 request decodes"
                second = asyncio.ensure_future(client.generate([5, 6], LONG, lora_path=v2))
                unload = asyncio.ensure_future(client.unload_lora_adapter(url, v1, timeout_s=120))
                # Polled: unregistering has no event, and it lasts (the unload cannot end while the request is held).
                await until(lambda: _lists_not(client, url, v1), f"{v1} unregistered")
                assert not unload.done() and not first.done(), "the unload waits for the version-1 request"
            first_result, second_result = await asyncio.gather(first, second)
            remaining = await unload
            return first_result, second_result, remaining, {"before": before, "after": stats(url)}

    first, second, remaining, counters = asyncio.run(run())
    assert remaining == {v2: str(adapters["other"])}
    assert first.lora_path == v1 and first.versions == [1] * 200 and first.finish_reason == "length"
    assert second.lora_path == v2 and second.versions == [2] * 200 and second.num_resumes == first.num_resumes == 0
    assert max_abs_diff(first.logprobs, reference_logprobs(references["all4"], [3, 4], first.output_ids)) < LOGPROB_TOL
    assert (
        max_abs_diff(second.logprobs, reference_logprobs(references["other"], [5, 6], second.output_ids)) < LOGPROB_TOL
    )
    before, after = counters["before"], counters["after"]
    assert after["requests_aborted"] == before["requests_aborted"], "nothing was aborted"
    assert after["weight_updates"] == before["weight_updates"] and after["paused"] is None


async def _lists_not(client: EngineClient, url: str, name: str) -> bool:
    return name not in await client.lora_adapters(url)


def test_a_request_whose_adapter_does_not_fit_the_batch_waits_for_a_slot(lora_engines, adapters, references):
    """--max-loras-per-batch 3 (the base model counting as one: scheduler.get_new_batch_prefill with
    validate_lora_batch): with the base model and two adapters decoding, a request of a third adapter waits until
    one of them ends, then runs. A single request naming 4 distinct adapters (None counts) exceeds
    --max-loaded-loras 3 and is refused before anything runs."""
    _kind, urls = lora_engines
    url = urls[0]

    async def run() -> tuple[list, dict, dict, httpx.Response]:
        async with EngineClient(urls) as client:
            await fresh(client, urls)
            for name, folder in (("a", "all4"), ("q", "qv8"), ("o", "other")):
                await client.load_lora_adapter(url, name, str(adapters[folder]))
            before = stats(url)
            short = {**LONG, "max_new_tokens": 30}
            # The four are admitted together once all have arrived (decode_hold): three adapters fill the batch
            # (the base model counting as one), the fourth waits for a slot while the others decode, held there.
            async with decode_hold(url, running=3, min_tokens=1, waiting=1, rid_prefix="fit/") as hold:
                sent = [
                    asyncio.ensure_future(client.generate(prompt, short, rid=f"fit/{i}", lora_path=lora))
                    for i, (prompt, lora) in enumerate(zip([[3], [4], [5], [6]], [None, "a", "q", "o"], strict=True))
                ]
                found = await hold.reached()
                assert len(found["running"]) == 3 and len(found["waiting"]) == 1
            results = await asyncio.gather(*sent)
            async with httpx.AsyncClient(timeout=60) as http:
                too_many = await http.post(
                    f"{url}/generate", json={"input_ids": [[3], [4], [5], [6]], "lora_path": ["a", "q", "o", None]}
                )
            return results, before, stats(url), too_many

    results, before, after, too_many = asyncio.run(run())
    assert after["lora_admission_waits"] > before["lora_admission_waits"]
    for prompt, adapter, result in zip([[3], [4], [5], [6]], [None, "all4", "qv8", "other"], results, strict=True):
        assert (
            max_abs_diff(result.logprobs, reference_logprobs(references[adapter], prompt, result.output_ids))
            < LOGPROB_TOL
        )
    assert too_many.status_code == 400
    assert too_many.json()["error"]["message"] == (
        "Received request with 4 unique loras requested but max loaded loras is 3"
    )


def test_an_unloaded_name_is_reloaded_by_the_next_request_and_a_name_never_loaded_fails(lora_engines, adapters):
    """tokenizer_manager.generate_request: "Reloading evicted adapter" for a name in lora_ref_cache; 400 with
    "Got LoRA adapter that has never been loaded" otherwise (http_server._create_error_response)."""
    _kind, urls = lora_engines
    url = urls[0]

    async def run() -> tuple[httpx.Response, httpx.Response, dict, dict]:
        async with EngineClient(urls) as client:
            await fresh(client, urls)
            await client.load_lora_adapter(url, "r", str(adapters["all4"]))
            await client.unload_lora_adapter(url, "r")
            assert await client.lora_adapters(url) == {}
            before = stats(url)
            async with httpx.AsyncClient(timeout=60) as http:
                body = {"input_ids": [3], "sampling_params": {"max_new_tokens": 2}}
                reloaded = await http.post(f"{url}/generate", json={**body, "lora_path": "r"})
                never = await http.post(f"{url}/generate", json={**body, "lora_path": "never"})
            return reloaded, never, before, await client.lora_adapters(url)

    reloaded, never, before, listed = asyncio.run(run())
    assert reloaded.status_code == 200 and listed == {"r": str(adapters["all4"])}
    assert stats(url)["lora_implicit_reloads"] == before["lora_implicit_reloads"] + 1
    assert never.status_code == 400
    assert never.json()["error"]["message"].startswith("Got LoRA adapter that has never been loaded: never\n")


def test_refusals_and_their_http_codes(lora_engines, adapters, references):
    """A rank above --max-lora-rank and a name already loaded: 400 with success false and SGLang's message; a body
    without lora_name: 422 on the stand-in (FastAPI), 400 on the embedded engine; a batch with fewer lora_path
    entries than prompts: 500 on the stand-in (as SGLang), 400 naming the problem on the embedded engine. An adapter
    trained with use_rslora: SGLang serves it with alpha / r (the stand-in does), the embedded engine refuses it."""
    kind, urls = lora_engines
    url = urls[0]

    async def run() -> dict[str, httpx.Response]:
        async with EngineClient(urls) as client:
            await fresh(client, urls)
            await client.load_lora_adapter(url, "a", str(adapters["all4"]))
            with pytest.raises(EngineHTTPError) as refused:
                await client.load_lora_adapter(url, "a", str(adapters["other"]))
            assert refused.value.status == 400 and "because it is already loaded" in refused.value.body
        async with httpx.AsyncClient(timeout=60) as http:
            return {
                "rank16": await http.post(
                    f"{url}/load_lora_adapter", json={"lora_name": "big", "lora_path": str(adapters["rank16"])}
                ),
                "no_name": await http.post(f"{url}/unload_lora_adapter", json={}),
                "short_list": await http.post(f"{url}/generate", json={"input_ids": [[3], [4]], "lora_path": ["a"]}),
                "rslora": await http.post(
                    f"{url}/load_lora_adapter", json={"lora_name": "rs", "lora_path": str(adapters["rslora"])}
                ),
            }

    answers = asyncio.run(run())
    big = answers["rank16"].json()
    assert answers["rank16"].status_code == 400 and big["success"] is False
    assert big["error_message"].startswith("LoRA adapter big with rank 16 is incompatible")
    assert answers["no_name"].status_code == (422 if kind == "sglang_standin" else 400)
    # SGLang indexes lora_path per prompt (GenerateReqInput.__getitem__): a short list is an uncaught IndexError
    assert answers["short_list"].status_code == (500 if kind == "sglang_standin" else 400)
    if kind == "embedded":
        assert answers["rslora"].status_code == 400 and "use_rslora=True" in answers["rslora"].json()["error_message"]
    else:
        assert answers["rslora"].status_code == 200  # served as SGLang serves it: alpha / r, not peft's
        answer = httpx.post(
            f"{url}/generate",
            json={"input_ids": [3, 4], "sampling_params": LONG | {"max_new_tokens": 8}, "return_logprob": True,
                  "lora_path": "rs"},
            timeout=60,
        ).json()  # fmt: skip
        peft_says = reference_logprobs(references["rslora"], [3, 4], answer["output_ids"])
        assert max_abs_diff(logprobs_of(answer), peft_says) > 1e-3, "SGLang's alpha / r is not peft's alpha / sqrt(r)"


def test_requests_go_to_an_engine_that_serves_their_adapter(lora_engines, adapters):
    """The client records what each engine serves from its own load/unload/list calls and routes a request naming
    an adapter to an engine that serves it (an engine that does not would fail it, or reload a name it unloaded)."""
    _kind, urls = lora_engines

    async def run() -> tuple[list[int], dict]:
        async with EngineClient(urls) as client:
            await fresh(client, urls)
            await client.load_lora_adapter(urls[1], adapter_name(7), str(adapters["all4"]))
            before = [stats(u)["requests_finished"] for u in urls]
            params = {"max_new_tokens": 3, "ignore_eos": True}
            results = await asyncio.gather(
                *(client.generate([3 + i], params, lora_path=adapter_name(7)) for i in range(6))
            )
            assert all(r.versions == [7, 7, 7] and r.lora_path == adapter_name(7) for r in results)
            after = [stats(u)["requests_finished"] for u in urls]
            return [a - b for a, b in zip(after, before, strict=True)], client.pool.lora_adapters()

    finished, known = asyncio.run(run())
    assert finished == [0, 6]
    assert known == {urls[0]: frozenset(), urls[1]: frozenset({adapter_name(7)})}


def test_the_embedded_engine_receives_an_adapter_over_the_weight_update_group(models, adapters, references, tmp_path):
    """The extension (/load_lora_adapter_from_distributed, not SGLang's): the trainer side is the runtime's own
    LocalSender (one flattened bucket over gloo), the engine receives it as /update_weights_from_distributed does
    and serves it as the peft folder it came from."""
    config = json.loads((adapters["qv8"] / "adapter_config.json").read_text())
    tensors = load_peft_weights(str(adapters["qv8"]))
    cmd = engine_command("embedded", models["a"][0], lora=LORA)
    with EngineLauncher(cmd, 1, log_dir=tmp_path) as launcher:
        url = launcher.urls[0]

        async def run() -> dict:
            sender = LocalSender(lambda: tensors, bucket_mb=64, backend="gloo")
            (header,) = sender.stage(3)
            port = sender.open_store("lora", 2, 60)
            group = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                     "group_name": "lora", "backend": "gloo"}  # fmt: skip
            async with EngineClient([url]) as client, httpx.AsyncClient(timeout=120) as http:
                joined, _ = await asyncio.gather(
                    http.post(f"{url}/init_weights_update_group", json=group),
                    asyncio.to_thread(sender.join, "lora", 2, 60),
                )
                assert joined.json()["success"]
                loaded, _ = await asyncio.gather(
                    client.load_lora_adapter_from_distributed(
                        url,
                        adapter_name(3),
                        config,
                        names=header.names,
                        dtypes=header.dtypes,
                        shapes=header.shapes,
                        group_name="lora",
                        load_format="flattened_bucket",
                    ),
                    asyncio.to_thread(sender.broadcast, "lora", 3, 0),
                )
                sender.close()
                assert loaded == {adapter_name(3): None}
                result = await client.generate([3, 4], LONG | {"max_new_tokens": 10}, lora_path=adapter_name(3))
                return {"result": result, "listed": await client.lora_adapters(url)}

        out = asyncio.run(run())
    result = out["result"]
    assert result.versions == [3] * 10 and out["listed"] == {adapter_name(3): None}
    assert max_abs_diff(result.logprobs, reference_logprobs(references["qv8"], [3, 4], result.output_ids)) < LOGPROB_TOL


def test_versioned_adapter_names_round_trip_and_other_names_carry_no_version():
    assert adapter_name(12) == "policy-v12" and adapter_version("policy-v12") == 12
    assert adapter_version("my-adapter") is None and adapter_version(None) is None
    assert adapter_version("policy-v3.bak") is None
    with pytest.raises(ValueError, match="policy version"):
        adapter_name(-1)


def test_adapters_stay_served_over_new_base_weights_after_a_full_weight_update(lora_engines, models, adapters):
    """A full weight update swaps in another model object (the engine double-buffers models): the adapters' hooks
    follow it, so a request naming an adapter then gets peft's log-probs over the NEW base weights."""
    _kind, urls = lora_engines
    url = urls[0]

    async def run() -> Any:
        async with EngineClient(urls) as client:
            await fresh(client, urls)
            await client.load_lora_adapter(url, "a", str(adapters["all4"]))
            try:
                for folder in (models["b"][0], models["a"][0], models["b"][0]):  # the third lands on a recycled model
                    await client.update_weights_from_disk(url, str(folder), "0")
                return await client.generate([3, 4], LONG | {"max_new_tokens": 10}, lora_path="a")
            finally:
                await client.update_weights_from_disk(url, str(models["a"][0]), "0")

    result = asyncio.run(run())
    over_b = peft_reference(models["b"][0], adapters["all4"])
    assert max_abs_diff(result.logprobs, reference_logprobs(over_b, [3, 4], result.output_ids)) < LOGPROB_TOL
