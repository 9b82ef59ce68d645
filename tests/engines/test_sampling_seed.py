"""Per-request sampling seeds (SGLang 0.5.6's `sampling_params.sampling_seed`): one generation reproduced from the
same weights whatever else an engine runs.

The embedded engine honours a seed it is sent, always (an exact inverse-CDF draw keyed by seed and position:
engines/embedded/sampling.py), and with `--enable-deterministic-inference` runs each request alone so its log-probs
are bit-identical too. The SGLang stand-in does what SGLang does: it reads the seed only under that flag, where a
request without one gets the default 42, and draws with SGLang's own (biased) `multinomial_with_seed` rule. The client
derives a seed per request id from engines.sampling_seed.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess

import httpx
import pytest
import torch
from engine_helpers import engine_command
from run_helpers import addition_run_command

from rllm.experimental.fully_async.core.ids import sampling_seed_for
from rllm.experimental.fully_async.engines import EmbeddedEngineCommand, EngineLauncher
from rllm.experimental.fully_async.engines.client import EngineClient
from rllm.experimental.fully_async.engines.embedded.sampling import SamplingParams, seeded_draw, sglang_seeded_choice
from rllm.experimental.fully_async.engines.from_config import engine_command as configured_command
from rllm.experimental.fully_async.run_spec import build_run_spec
from rllm.experimental.fully_async.settings.loader import ConfigError, load_config

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

TARGET = [3, 4, 5, 6]
SAMPLED = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True}
# Other prompts of other lengths and settings, some seeded, some not: the batch the target shares
CROWD = [[7, 8, 9, 10, 11, 12, 13, 14, 15], [5, 5], [20], list(range(2, 20)), [9] * 6, [11, 12, 13]] * 4


def _launch(cmd, tmp_path_factory, name: str):
    return EngineLauncher(cmd, 1, log_dir=tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module")
def embedded(models, tmp_path_factory):
    """An embedded engine as a run starts it (continuous batching) and one with --enable-deterministic-inference."""
    path = str(models["a"][0])
    batching = EmbeddedEngineCommand(path, max_running_requests=64, num_threads=1, seed=3)
    alone = EmbeddedEngineCommand(path, max_running_requests=64, num_threads=1, seed=3, deterministic_inference=True)
    with _launch(batching, tmp_path_factory, "seed_batching") as a, _launch(alone, tmp_path_factory, "seed_alone") as b:
        yield {"batching": a.urls[0], "deterministic": b.urls[0]}


def _generate(url: str, prompts: list[list[int]], params: list[dict]) -> list[tuple[list[int], list[float]]]:
    """One SGLang batched /generate: all prompts arrive together and are prefilled in one pass."""
    body = {"input_ids": prompts, "sampling_params": params, "return_logprob": True}
    answer = httpx.post(f"{url}/generate", json=body, timeout=120)
    answer.raise_for_status()
    return [(out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]]) for out in answer.json()]


def _alone_and_in_a_crowd(url: str, seed: int | None) -> tuple[tuple, tuple]:
    target = {**SAMPLED, **({} if seed is None else {"sampling_seed": seed})}
    alone = _generate(url, [TARGET], [target])[0]
    crowd_params = [{**SAMPLED, "sampling_seed": i} if i % 2 else dict(SAMPLED, top_k=5) for i in range(len(CROWD))]
    busy = _generate(url, [*CROWD[:7], TARGET, *CROWD[7:]], [*crowd_params[:7], target, *crowd_params[7:]])
    return alone, busy[7]


def test_a_seeded_request_draws_the_same_tokens_alone_and_inside_a_busy_batch(embedded):
    (tokens, logprobs), (busy_tokens, busy_logprobs) = _alone_and_in_a_crowd(embedded["batching"], seed=1234)
    assert busy_tokens == tokens
    # Batched, a row's log-probs are rounded differently (a CPU matmul sums in another order for another number of
    # rows): equal to float32 precision, not bit for bit. --enable-deterministic-inference makes them exact (below).
    assert max(abs(a - b) for a, b in zip(logprobs, busy_logprobs, strict=True)) < 1e-4


def test_deterministic_inference_gives_bit_identical_tokens_and_logprobs_whatever_else_is_sent(embedded):
    alone, busy = _alone_and_in_a_crowd(embedded["deterministic"], seed=1234)
    assert busy == alone, "tokens and log-probs, bit for bit"
    # and they are the same draws as the batching engine's: a seed means the same tokens on either
    assert alone[0] == _alone_and_in_a_crowd(embedded["batching"], seed=1234)[0][0]
    info = httpx.get(f"{embedded['deterministic']}/get_server_info", timeout=10).json()["engine_stats"]
    assert info["deterministic"] is True and info["max_running_seen"] == 1, "each request ran alone"


def test_different_seeds_draw_different_tokens_and_no_seed_follows_the_engines_generator(embedded):
    seeded = _generate(embedded["batching"], [TARGET] * 8, [{**SAMPLED, "sampling_seed": s} for s in range(8)])
    assert len({tuple(tokens) for tokens, _ in seeded}) == 8
    again = _generate(embedded["batching"], [TARGET] * 8, [{**SAMPLED, "sampling_seed": s} for s in range(8)])
    assert [t for t, _ in again] == [t for t, _ in seeded]
    unseeded = _generate(embedded["batching"], [TARGET] * 8, [SAMPLED] * 8)
    assert len({tuple(tokens) for tokens, _ in unseeded}) > 1, "without a seed the rows share one generator"


def test_a_seeded_generation_resumed_from_its_tokens_continues_as_if_uninterrupted(embedded):
    url = embedded["deterministic"]
    params = {**SAMPLED, "sampling_seed": 99}
    ((whole, _),) = _generate(url, [TARGET], [params])
    ((head, _),) = _generate(url, [TARGET], [{**params, "max_new_tokens": 6}])
    ((tail, _),) = _generate(url, [TARGET + head], [{**params, "max_new_tokens": 10}])
    assert head + tail == whole, "a draw is keyed by its position, so the resumed piece picks up where it stopped"


def test_sampling_seed_must_be_an_int32():
    for bad in (1.5, True, "7", 2**31):
        with pytest.raises(ValueError, match="sampling_seed must be an integer"):
            SamplingParams.from_json({"sampling_seed": bad})
    assert SamplingParams.from_json({"sampling_seed": -(2**31)}).sampling_seed == -(2**31)


def test_a_seeded_draw_samples_the_distribution_and_depends_on_seed_and_position_only():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    n = 20000
    over_positions = seeded_draw(probs.expand(n, 4), torch.full((n,), 7, dtype=torch.int32), torch.arange(n))
    over_seeds = seeded_draw(probs.expand(n, 4), torch.arange(n, dtype=torch.int32), torch.full((n,), 5))
    for drawn in (over_positions, over_seeds):
        frequencies = torch.bincount(drawn, minlength=4).double() / n
        assert torch.allclose(frequencies, probs[0].double(), atol=0.015), frequencies  # 3 sigma ~ 0.011
    # one row alone or among others: the same column for the same (seed, position)
    rows = torch.cat([torch.rand(5, 4), probs])
    together = seeded_draw(rows, torch.tensor([1, 2, 3, 4, 5, 7], dtype=torch.int32), torch.tensor([3, 9, 1, 0, 2, 11]))
    assert together[-1] == seeded_draw(probs, torch.tensor([7], dtype=torch.int32), torch.tensor([11]))[0]


def test_sglangs_seeded_rule_is_reproduced_for_the_standin_and_it_is_biased():
    """SGLang 0.5.6's multinomial_with_seed, written out for one column; its columns' noise is correlated, so it
    does not draw from the distribution it is given (a quirk the stand-in keeps and the README warns about)."""
    weights = torch.rand(1, 6)
    for seed, position in ((7, 11), (-(2**31), 3), (2**31 - 1, 10**6)):
        scores = []
        for column in range(6):
            step = ((seed * 19349663 + 2**31) % 2**32 - 2**31) ^ (position * 73856093)  # int32 wraps, then int64
            hashed = ((step * 8589934591 + 2**63) % 2**64 - 2**63) ^ (column * 479001599)
            uniform = min(max((hashed % 2**24) / 2**24, 1e-10), 1 - 1e-10)
            scores.append(math.log(float(weights[0, column]) + 1e-10) - math.log(-math.log(uniform)))
        seeds, at = torch.tensor([seed], dtype=torch.int32), torch.tensor([position])
        assert int(sglang_seeded_choice(weights, seeds, at)) == scores.index(max(scores))
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    n = 20000
    drawn = sglang_seeded_choice(probs.expand(n, 4), torch.full((n,), 7, dtype=torch.int32), torch.arange(n))
    frequencies = torch.bincount(drawn, minlength=4).double() / n
    assert abs(frequencies[2] - 0.2) > 0.1, f"SGLang's rule draws {frequencies.tolist()} for [0.5, 0.3, 0.2, 0]"
    # on a 1000-token softmax (the README's figure): far from the distribution where the exact draw is within noise
    wide = torch.softmax(2 * torch.randn(1, 1000, generator=torch.Generator().manual_seed(0)), dim=-1)
    seeds, at = torch.full((n,), 7, dtype=torch.int32), torch.arange(n)
    sglang_tv, exact_tv = (
        0.5 * float((torch.bincount(rule(wide.expand(n, 1000), seeds, at), minlength=1000) / n - wide[0]).abs().sum())
        for rule in (sglang_seeded_choice, seeded_draw)
    )
    assert exact_tv < 0.06 < 0.15 < sglang_tv, (exact_tv, sglang_tv)  # sampling noise alone: ~0.04 at n = 20000


# ---------------------------------------------------------------- the SGLang stand-in and the client


@pytest.fixture(scope="module")
def standins(models, tmp_path_factory):
    path = models["a"][0]
    plain = engine_command("sglang_standin", path, max_running_requests=64)
    flagged = engine_command("sglang_standin", path, max_running_requests=64)
    flagged = type(flagged)(type(flagged.sglang)(**{**vars(flagged.sglang), "deterministic_inference": True}))
    with _launch(plain, tmp_path_factory, "standin_plain") as a, _launch(flagged, tmp_path_factory, "standin_det") as b:
        yield {"plain": a.urls[0], "deterministic": b.urls[0]}


def test_the_standin_reads_sampling_seed_only_under_deterministic_inference_as_sglang(standins):
    url = standins["deterministic"]
    alone, busy = _alone_and_in_a_crowd(url, seed=1234)
    assert busy == alone
    # SGLang's default seed 42 for a request that sends none: n such samples of one prompt are identical
    defaults = _generate(url, [TARGET] * 4, [SAMPLED] * 4)
    assert len({tuple(t) for t, _ in defaults}) == 1
    assert defaults[0] == _generate(url, [TARGET], [{**SAMPLED, "sampling_seed": 42}])[0]
    # without the flag the seed is accepted and ignored: the same seed four times, four different samples (almost
    # surely: 16 tokens each)
    ignored = _generate(standins["plain"], [TARGET] * 4, [{**SAMPLED, "sampling_seed": 5}] * 4)
    assert len({tuple(t) for t, _ in ignored}) > 1


def test_the_client_gives_each_request_id_its_own_seed_from_the_run_seed(embedded):
    url = embedded["deterministic"]

    async def run() -> tuple:
        async with EngineClient([url], sampling_seed=11) as client:
            first = await client.generate(TARGET, dict(SAMPLED), rid="e0/3/0")
            again = await client.generate(TARGET, dict(SAMPLED), rid="e0/3/0")
            other = await client.generate(TARGET, dict(SAMPLED), rid="e0/3/1")
            batch = await client.generate_batch([TARGET] * 2, dict(SAMPLED), rids=["e0/3/0", "e0/3/1"])
            own = await client.generate(TARGET, {**SAMPLED, "sampling_seed": 1234}, rid="e0/3/0")
        return first, again, other, batch, own

    first, again, other, batch, own = asyncio.run(run())
    assert first.output_ids == again.output_ids == batch[0].output_ids
    assert other.output_ids == batch[1].output_ids != first.output_ids
    direct = _generate(url, [TARGET], [{**SAMPLED, "sampling_seed": sampling_seed_for(11, "e0/3/0")}])[0]
    assert (first.output_ids, first.logprobs) == direct, "the seed sent is sampling_seed_for(run seed, rid)"
    assert own.output_ids == _generate(url, [TARGET], [{**SAMPLED, "sampling_seed": 1234}])[0][0], "its own seed wins"


def test_sampling_seed_keys_reach_the_engines_or_are_refused_where_an_engine_would_ignore_them():
    cfg = load_config(None, ["engines.sampling_seed=7", "engines.deterministic_inference=true"])
    spec = build_run_spec(cfg)
    assert spec.engines.sampling_seed == 7
    assert "--enable-deterministic-inference" in configured_command(spec.engines).build("127.0.0.1", 1, 0)
    plain = build_run_spec(load_config(None, ["engines.sampling_seed=7"]))
    assert "--enable-deterministic-inference" not in configured_command(plain.engines).build("127.0.0.1", 1, 0)
    with pytest.raises(ConfigError, match=r"n samples of a prompt would be identical: set engines\.sampling_seed"):
        load_config(None, ["engines.deterministic_inference=true"])
    sglang = ["engines.backend=sglang", "actor_rollout_ref.rollout.name=sglang", "engines.sampling_seed=7"]
    with pytest.raises(ConfigError, match=r"ignored by SGLang 0\.5\.6 unless .*set engines\.deterministic_inference"):
        load_config(None, sglang, check_host=False)
    gpu = build_run_spec(load_config(None, [*sglang, "engines.deterministic_inference=true"], check_host=False))
    assert "--enable-deterministic-inference" in configured_command(gpu.engines).build("127.0.0.1", 1, 0)


def _first_step_generations(tmp_path, addition_cache, name: str, *overrides: str) -> dict[str, list[int]]:
    """One training step of the addition task, its trajectories dumped: uid -> response tokens of the samples that
    the initial weights generated whole (version 0 throughout)."""
    run_dir = tmp_path / name
    command = addition_run_command(
        run_dir,
        addition_cache,
        "trainer.total_training_steps=1",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        f"trainer.rollout_data_dir={run_dir / 'dumps'}",
        # η=0: step 1 trains exactly the first batch of prompts. With η > 0 it trains whichever groups finished
        # first, which on a loaded machine can leave two runs with no sample in common.
        "async_training.max_staleness=0",
        *overrides,
    )
    env = dict(os.environ, RLLM_LOG_LEVEL="WARNING")
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # η=0 with K=1 is synchronous training, and a real run says so in one line at its start (issue 32).
    notices = [line for line in done.stdout.splitlines() if line.startswith("training synchronously")]
    assert len(notices) == 1 and "async_training.max_staleness=1" in notices[0], done.stdout[-2000:]
    generated = {}
    for line in (run_dir / "dumps" / "1.jsonl").read_text().splitlines():
        record = json.loads(line)
        (sequence,) = record["sequences"]
        if sequence["versions"] and set(sequence["versions"]) == {0}:
            generated[record["uid"]] = sequence["response_ids"]
    return generated


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_engines_sampling_seed_makes_a_runs_generations_repeat_and_another_seed_changes_them(tmp_path, addition_cache):
    """engines.sampling_seed observed in a whole run: two runs with the same seed generate the same tokens for each
    sample id from the same weights (whatever order the engines took them in), a third with another seed does not."""
    first = _first_step_generations(tmp_path, addition_cache, "seed7a", "engines.sampling_seed=7")
    again = _first_step_generations(tmp_path, addition_cache, "seed7b", "engines.sampling_seed=7")
    other = _first_step_generations(tmp_path, addition_cache, "seed8", "engines.sampling_seed=8")
    assert set(first) == set(again), "the same seed trained different samples at step 1"
    shared = sorted(first)
    assert len(shared) >= 8, "too few samples in the first batch to compare"
    assert [first[uid] for uid in shared] == [again[uid] for uid in shared]
    differing = [uid for uid in set(first) & set(other) if first[uid] != other[uid]]
    assert differing, "another seed drew the same tokens for every sample"
