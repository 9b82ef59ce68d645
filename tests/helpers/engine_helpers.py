"""Helpers shared by the engine, client and ParamSync tests: distinct test models, reference log-probs, the engines'
test-only decode hold (how a test acts while requests decode), streamed generation, and the generate-while-syncing
scenario both weight transports are held to.

A test that must act while a request decodes (abort, pause, sync, checkpoint, kill) arms `decode_hold` before the
requests are sent and acts once `hold.reached()` answers: the engine itself stopped its forward passes at the first
step boundary where the requests were decoding, so nothing they do can outrun the test (the engines' counters, polled,
could: a loaded machine missed the window). Engines a test holds are started with `TEST_ONLY_ROUTES`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from rllm.experimental.fully_async.engines.client import EngineClient

LOGPROB_TOL = 1e-4
# The embedded engine's flag for its test-only /test_only/* routes (engines/embedded/decode_hold.py); the SGLang
# stand-in serves them always.
TEST_ONLY_ROUTES = ("--enable-test-only-routes",)


# Every client and ParamSync test runs against both; the inner loop (-m "not slow") against the embedded engine only,
# since each kind costs two engine starts per module (test_engine_sglang checks the stand-in's own protocol there).
ENGINE_KINDS = ["embedded", pytest.param("sglang_standin", marks=pytest.mark.slow)]


def engine_command(
    kind: str, model_path: Path, *, max_running_requests: int = 64, api_key: str | None = None, lora: Any = None
) -> Any:
    """The launch command of one engine kind serving `model_path`: the embedded engine, or the SGLang stand-in
    started through the project's real `SGLangEngineCommand` (tests/standins/sglang_standin). `lora`: an
    `EngineLoRASpec` (LoRA flags), as a run's config gives it."""
    from rllm.experimental.fully_async.engines import EmbeddedEngineCommand

    if kind == "embedded":
        extra = ("--api-key", api_key) if api_key else ()
        return EmbeddedEngineCommand(
            str(model_path),
            max_running_requests=max_running_requests,
            num_threads=1,
            lora=lora,
            extra_args=TEST_ONLY_ROUTES + extra,
        )
    from sglang_standin import standin_command

    return standin_command(str(model_path), max_running_requests=max_running_requests, api_key=api_key, lora=lora)


def sharpen(src: Path, dst: Path, seed: int) -> Path:
    """Copy an HF model with its matrices redrawn from N(0, 0.3): varied, non-degenerate greedy outputs, and two
    models whose log-probs clearly differ."""
    model = AutoModelForCausalLM.from_pretrained(src)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    model.save_pretrained(dst)
    return dst


def reference_logprobs(
    model: PreTrainedModel, prompt: list[int], output: list[int], temperature: float = 1.0
) -> list[float]:
    """log_softmax(logits / T) of each output token under `model`, from one forward pass over prompt + output."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return [logprobs[len(prompt) - 1 + i, tok].item() for i, tok in enumerate(output)]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


class DecodeHold:
    """An armed decode hold on one engine (`decode_hold`)."""

    def __init__(self, http: httpx.AsyncClient, url: str, timeout_s: float) -> None:
        self._http, self.url, self.timeout_s = http, url, timeout_s
        self.found: dict[str, Any] | None = None

    async def reached(self) -> dict[str, Any]:
        """Wait until the engine holds (an event on the engine's side: no polling); what it found there,
        {"running": [{"rid", "output_tokens"}], "waiting": [rid]}. The error names the condition on a timeout."""
        answer = await self._http.post(
            f"{self.url}/test_only/wait_for_hold", json={"timeout_s": self.timeout_s}, timeout=self.timeout_s + 30
        )
        if answer.status_code != 200:
            raise TimeoutError(f"{self.url}: {answer.text}")
        self.found = answer.json()
        return self.found

    async def release(self) -> None:
        """Let forward passes go on (done on leaving `decode_hold` too)."""
        (await self._http.post(f"{self.url}/test_only/release_hold")).raise_for_status()


@contextlib.asynccontextmanager
async def decode_hold(
    url: str,
    *,
    running: int = 1,
    min_tokens: int = 3,
    waiting: int = 0,
    rid_prefix: str = "",
    headers: dict[str, str] | None = None,
    timeout_s: float = 60.0,
) -> AsyncIterator[DecodeHold]:
    """Arm the engine's test-only decode hold (engines/embedded/decode_hold.py): the engine admits nothing until
    `running + waiting` requests (rid starting with `rid_prefix`) have arrived, and once `running` of them each have
    `min_tokens` tokens and `waiting` more wait in its queue, it runs no forward pass until released. Send the
    requests inside, await `hold.reached()`, then act: the requests are decoding, and stay as the hold found them
    whatever the machine's load. Leaving releases the hold (an engine killed inside has nothing left to release)."""
    condition = {"running": running, "min_tokens": min_tokens, "waiting": waiting, "rid_prefix": rid_prefix}
    async with httpx.AsyncClient(headers=headers, timeout=30) as http:
        (await http.post(f"{url}/test_only/hold_decoding", json=condition)).raise_for_status()
        try:
            yield DecodeHold(http, url, timeout_s)
        finally:
            with contextlib.suppress(httpx.TransportError):
                (await http.post(f"{url}/test_only/release_hold")).raise_for_status()


async def stream_generate(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """POST /generate with `stream: true` and yield each Server-Sent Event's JSON as it arrives (SGLang's
    `data: {json}\\n\\n` chunks), stopping at `data: [DONE]`; raises if the stream ends without it."""
    async with http.stream("POST", f"{url}/generate", json={**body, "stream": True}) as response:
        response.raise_for_status()
        assert response.headers["content-type"].startswith("text/event-stream"), response.headers
        async for line in response.aiter_lines():
            if not line:
                continue  # the blank line that ends an event
            assert line.startswith("data: "), f"not a Server-Sent Event: {line!r}"
            if line == "data: [DONE]":
                return
            yield json.loads(line[len("data: ") :])
    raise AssertionError(f"{url}/generate: the stream ended without data: [DONE]")


async def wait_for_idle(client: Any, url: str, timeout_s: float = 60.0) -> None:
    """Until nothing runs or waits on the engine: on an engine shared by a module's tests, the requests of a test
    that stopped its callers may still be decoding (nothing aborts them), and counters read then would count theirs.

    A poll, and the one kept: idleness has no event, and once nothing new is sent it is a state that lasts, so a
    slow machine only waits longer; it cannot miss it."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = (await client.get_server_info(url))["internal_states"][0]
        if state["num_running"] == 0 and state["num_waiting"] == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}: not idle within {timeout_s:g}s (counters: {state})")
        await asyncio.sleep(0.02)


def restarted(launcher: Any, index: int) -> Any:
    """Restart slot `index` of an EngineLauncher and wait until it is healthy (what the supervisor does over
    several polls); its new EngineProcess."""
    launcher.restart(index)
    deadline = time.monotonic() + 90
    while not launcher.probe(index):
        assert time.monotonic() < deadline, "restarted engine not healthy within 90 s"
        time.sleep(0.1)
    return launcher.processes[index]


def generate_while_syncing(
    urls: list[str], push: Callable[[int], None], versions: range, *, workers: int
) -> list[tuple[list[int], Any]]:
    """`workers` clients sample one-token-prompt completions of varied lengths on `urls` without pause while
    `push(version)` (a weight sync, run in a thread) runs for each of `versions` in turn; each worker finishes at
    least one request. Every push meets a request decoding on `urls[0]` (the engine is held there until the push is
    done, `decode_hold`), so every sync interrupts one. Returns (prompt, GenerationResult) for every completion."""
    from rllm.experimental.fully_async.engines.client import EngineClient

    async def scenario() -> list[tuple[list[int], Any]]:
        results: list[tuple[list[int], Any]] = []
        done = asyncio.Event()
        async with EngineClient(urls) as client:

            async def worker(i: int) -> None:
                n = 0
                while not done.is_set() or n == 0:
                    prompt = [2 + (i + n) % 29]
                    params = {"temperature": 1.0, "max_new_tokens": 40 + 13 * i % 60, "ignore_eos": True}
                    results.append((prompt, await client.generate(prompt, params)))
                    n += 1

            async def syncs() -> None:
                try:
                    for version in versions:
                        async with decode_hold(urls[0], running=1, min_tokens=1) as hold:
                            await hold.reached()
                            await asyncio.to_thread(push, version)
                finally:
                    done.set()

            await asyncio.gather(syncs(), *(worker(i) for i in range(workers)))
        return results

    return asyncio.run(scenario())


def assert_each_piece_has_one_versions_logprobs(
    results: list[tuple[list[int], Any]], model_for: Callable[[int], PreTrainedModel]
) -> None:
    """Every completion's tokens carry non-decreasing versions, and each run of one version has that version's
    log-probs (`model_for(version)` recomputes them); at least one completion was interrupted by a sync and
    resumed, so the check saw a piece boundary."""
    resumed = 0
    for prompt, result in results:
        assert len(result.output_ids) == len(result.logprobs) == len(result.versions)
        assert result.versions == sorted(result.versions), "versions never go backwards within a sequence"
        resumed += result.num_resumes
        start = 0
        for version in sorted(set(result.versions)):
            end = start + result.versions.count(version)
            expected = reference_logprobs(model_for(version), prompt, result.output_ids)[start:end]
            assert max_abs_diff(result.logprobs[start:end], expected) < LOGPROB_TOL, f"version {version} piece"
            start = end
    assert resumed >= 1, "some generation should have been interrupted by a sync and resumed"


async def load_weights(client: EngineClient, url: str, path: object, version: str) -> None:
    """ParamSync's protocol: SGLang ignores weight_version on a load while paused, so it is set after the load."""
    await client.update_weights_from_disk(url, str(path), weight_version=version)
    await client.update_weight_version(url, version)


async def sync_weights(client: EngineClient, url: str, path: object, version: str) -> None:
    """A weight sync as ParamSync makes it: pause (in-flight requests return aborted), load, continue."""
    await client.pause_generation(url, "abort")
    await load_weights(client, url, path, version)
    await client.continue_generation(url)
