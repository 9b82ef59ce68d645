"""Helpers shared by the engine, client and ParamSync tests: distinct test models, reference log-probs, and the
generate-while-syncing scenario both weight transports are held to."""

from __future__ import annotations

import asyncio
import contextlib
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
            str(model_path), max_running_requests=max_running_requests, num_threads=1, lora=lora, extra_args=extra
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


async def wait_for_engine_state(
    client: Any, url: str, done: Callable[[dict[str, Any]], bool], what: str, timeout_s: float = 60.0
) -> dict[str, Any]:
    """Poll the engine's counters (`/get_server_info`: another process, there is no event to wait on) until
    `done(counters)`; returns them. `client` is an `EngineClient`; `what` names the awaited state for the timeout."""
    deadline = time.monotonic() + timeout_s
    while not done(state := (await client.get_server_info(url))["internal_states"][0]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}: no {what} within {timeout_s:g}s (counters: {state})")
        await asyncio.sleep(0.02)
    return state


@contextlib.asynccontextmanager
async def slowed_down(url: str, step_s: float = 0.05, headers: dict[str, str] | None = None) -> AsyncIterator[None]:
    """While inside, the engine at `url` sleeps `step_s` before every step (SGLang's `/slow_down`, which the
    embedded engine and the stand-in serve). The tiny test models decode 240 tokens in 0.2 s: a test that must act
    while a request decodes (abort it, pause, sync) misses that window when a loaded machine stalls it that long,
    and at 0.05 s a step the window is 12 s. Leave before waiting for the requests to finish; an engine killed
    inside has nothing left to lift."""
    async with httpx.AsyncClient(headers=headers, timeout=30) as http:
        (await http.post(f"{url}/slow_down", json={"forward_sleep_time": step_s})).raise_for_status()
        try:
            yield
        finally:
            with contextlib.suppress(httpx.TransportError):
                (await http.post(f"{url}/slow_down", json={"forward_sleep_time": None})).raise_for_status()


async def wait_for_running(client: Any, url: str, n: int, timeout_s: float = 60.0) -> None:
    """Until n requests are decoding."""
    await wait_for_engine_state(client, url, lambda s: s["num_running"] >= n, f"{n} requests decoding", timeout_s)


async def wait_for_decoding(client: Any, url: str, timeout_s: float = 60.0) -> None:
    """Until a request is decoding."""
    await wait_for_running(client, url, 1, timeout_s)


async def wait_for_idle(client: Any, url: str, timeout_s: float = 60.0) -> None:
    """Until nothing runs or waits on the engine: on an engine shared by a module's tests, the requests of a test
    that stopped its callers may still be decoding (nothing aborts them), and a count of running requests taken then
    would count theirs."""
    await wait_for_engine_state(
        client, url, lambda s: s["num_running"] == 0 and s["num_waiting"] == 0, "idle engine", timeout_s
    )


async def wait_for_decode_passes(client: Any, url: str, n: int, timeout_s: float = 60.0) -> None:
    """Until the engine has run `n` more decode passes than now: a request that is decoding has produced tokens by
    then (a fixed sleep assumed so, and failed on a loaded machine)."""

    def decode_passes(state: dict[str, Any]) -> int:
        return state["forward_passes"] - state["prefill_passes"]

    target = decode_passes((await client.get_server_info(url))["internal_states"][0]) + n
    await wait_for_engine_state(client, url, lambda s: decode_passes(s) >= target, f"{n} decode passes", timeout_s)


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
    least one request. Returns (prompt, GenerationResult) for every completion."""
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
