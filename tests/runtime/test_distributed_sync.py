"""ParamSync with the distributed transport (a gloo broadcast through SGLang's weight-update group) against real
embedded engines and the SGLang stand-in: same result as a disk sync, atomic under load, bucketing, failures."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from engine_helpers import (
    ENGINE_KINDS,
    assert_each_piece_has_one_versions_logprobs,
    engine_command,
    generate_while_syncing,
    max_abs_diff,
    reference_logprobs,
    restarted,
)

from rllm.experimental.fully_async.engines import EmbeddedEngineCommand, EngineLauncher
from rllm.experimental.fully_async.engines.client import EngineClient, GenerationResult
from rllm.experimental.fully_async.runtime.sync import sender as weight_sender
from rllm.experimental.fully_async.runtime.sync.distributed import plan_buckets
from rllm.experimental.fully_async.runtime.sync.param_sync import (
    DiskTransport,
    DistributedTransport,
    ParamSync,
    SyncError,
    module_state,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

# ~21 KB buckets: the tiny test model (~310 KB in fp32) travels in ~15 buckets, and each of its MLP matrices
# (32 KB in fp32) is larger than one bucket.
SMALL_BUCKET_MB = 0.02
PROMPTS = [[4, 5], [7], [3, 9, 2]]


def no_disk(path: str) -> None:
    raise AssertionError("the distributed transport must not write weights to disk")


def disk_writer(model_dir: Path):
    return lambda path: shutil.copytree(model_dir, path, dirs_exist_ok=True)


@pytest.fixture(scope="module", params=ENGINE_KINDS)
def engines(request, models, tmp_path_factory):
    """Two engines serving model A: embedded engines, then SGLang stand-ins."""
    cmd = engine_command(request.param, models["a"][0])
    with EngineLauncher(cmd, 2, log_dir=tmp_path_factory.mktemp("dist_engine_logs")) as launcher:
        yield launcher.urls


async def greedy(urls: list[str]) -> list[GenerationResult]:
    async with EngineClient(urls) as client:
        params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
        return [await client.generate(p, params) for p in PROMPTS for _ in urls]


async def versions(urls: list[str]) -> list[str]:
    async with EngineClient(urls) as client:
        return [await client.get_weight_version(u) for u in urls]


def test_a_distributed_sync_gives_the_versions_and_logprobs_of_a_disk_sync(engines, models, tmp_path):
    transport = DistributedTransport(module_state(models["b"][1]), bucket_mb=SMALL_BUCKET_MB)
    with ParamSync(engines, transport) as sync:
        report = sync.sync(no_disk, 1)
        assert report.location.startswith("broadcast: ") and int(report.location.split()[1]) >= 10
        assert report.nbytes == sum(p.numel() * 4 for p in models["b"][1].parameters())
        assert sync.engine_versions == dict.fromkeys(engines, 1)
        assert asyncio.run(versions(engines)) == ["1", "1"]
        over_wire = asyncio.run(greedy(engines))
    with ParamSync(engines, DiskTransport(tmp_path / "w")) as sync:
        sync.sync(disk_writer(models["a"][0]), 2)
        sync.sync(disk_writer(models["b"][0]), 3)
        from_disk = asyncio.run(greedy(engines))
        sync.sync(disk_writer(models["a"][0]), 4)  # leave model A behind for the other tests
    for wire, disk, prompt in zip(over_wire, from_disk, [p for p in PROMPTS for _ in engines], strict=True):
        assert wire.versions == [1] * 10 and disk.versions == [3] * 10
        assert wire.output_ids == disk.output_ids
        assert max_abs_diff(wire.logprobs, disk.logprobs) < 1e-5
        assert max_abs_diff(wire.logprobs, reference_logprobs(models["b"][1], prompt, wire.output_ids)) < 1e-4


def test_a_parameter_larger_than_a_bucket_travels_alone_and_intact(models):
    """The end-to-end case (an oversized matrix synced and served) is in the first test; here the packing."""
    state = module_state(models["b"][1])()
    bucket_bytes = int(SMALL_BUCKET_MB * 2**20)
    big = "model.layers.0.mlp.up_proj.weight"
    assert state[big].numel() * 4 > bucket_bytes > state[big].numel() * 2
    as_fp32 = plan_buckets(state, bucket_bytes, None)
    assert [n for b in as_fp32 for n in b.names] == list(state)  # every tensor once, in order
    (alone,) = [b for b in as_fp32 if big in b.names]
    assert alone.names == [big] and alone.dtypes == ["float32"]
    assert torch.equal(alone.flat.view(torch.float32).reshape(state[big].shape), state[big])
    assert all(b.flat.numel() <= bucket_bytes or len(b.names) == 1 for b in as_fp32)
    as_bf16 = plan_buckets(state, bucket_bytes, "bfloat16")  # sizes count after the cast: now every tensor fits
    assert all(b.flat.numel() <= bucket_bytes and set(b.dtypes) == {"bfloat16"} for b in as_bf16)
    assert len(as_bf16) < len(as_fp32)


def test_syncs_under_concurrent_generation_give_each_piece_exactly_one_versions_weights(engines, models):
    """Repeated multi-bucket syncs while generating: each piece's log-probs are one version's, in order."""

    def model_for(version: int):
        return models["b"][1] if version % 2 else models["a"][1]

    current = {"version": 2}
    transport = DistributedTransport(lambda: module_state(model_for(current["version"]))(), bucket_mb=SMALL_BUCKET_MB)

    def push(sync: ParamSync, version: int) -> None:
        current["version"] = version
        sync.sync(no_disk, version)

    with ParamSync(engines, transport) as sync:
        push(sync, 2)
        results = generate_while_syncing(engines, lambda version: push(sync, version), range(3, 7), workers=8)
        push(sync, 8)  # model A again for the other tests
    assert_each_piece_has_one_versions_logprobs(results, model_for)


def test_the_engines_apply_weight_version_as_sglang_does(engines, models, request):
    """SGLang applies `weight_version` of /update_weights_from_distributed only when not paused; the embedded
    engine always applies it. Unknown groups and missing fields are refused as SGLang refuses them."""
    standin = request.node.callspec.params["engines"] == "sglang_standin"
    transport = DistributedTransport(module_state(models["a"][1]), bucket_mb=SMALL_BUCKET_MB)

    async def load(version: int, paused: bool) -> tuple[list[str], list[tuple[int, object]]]:
        staged = transport.stage(no_disk, version)
        async with EngineClient(engines) as client:
            if paused:
                await asyncio.gather(*(client.pause_generation(u) for u in engines))
            failed = await transport.load_all(client, engines, staged, timeout_s=30)
            assert failed == {}
            if paused:
                await asyncio.gather(*(client.continue_generation(u) for u in engines))
            got = [await client.get_weight_version(u) for u in engines]
            http = client.pool.engine(engines[0]).http
            answers = []
            for payload in ({"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"}, {}):
                try:
                    answers.append((200, await http.request("POST", "/update_weights_from_distributed", payload, 10)))
                except Exception as exc:
                    answers.append((exc.status, exc.body))  # type: ignore[attr-defined]
            return got, answers

    before = asyncio.run(versions(engines))
    try:
        paused_versions, answers = asyncio.run(load(11, paused=True))
        running_versions, _ = asyncio.run(load(12, paused=False))
    finally:
        transport.close()
    assert paused_versions == (before if standin else ["11", "11"])
    assert running_versions == ["12", "12"]
    (status_unknown, body_unknown), (status_missing, _) = answers
    assert status_unknown == 400 and json.loads(body_unknown)["success"] is False
    assert status_missing == (422 if standin else 400)


@pytest.mark.slow  # waits out a broadcast timeout and an engine restart (~25 s on a busy 2-core machine)
@pytest.mark.parametrize("known_dead", [False, True], ids=["killed-as-rank-0-sends", "known-dead-before-it-sends"])
def test_an_engine_killed_mid_broadcast_fails_the_sync_in_time_and_its_restart_rejoins_through_a_new_group(
    models, tmp_path, monkeypatch, known_dead
):
    """Killed at the third bucket: SyncError within the timeout naming it and the version, the other engine gets
    the whole version through a group without it; the restarted engine catches up (a group of its own) and the
    next sync rebuilds the group over both. Killed as rank 0 sends, the survivor usually gets the bucket; known
    dead before, gloo's root raises at the dead peer without sending to the survivor, which must not wait out its
    timeout nor be blamed."""
    cmd = EmbeddedEngineCommand(str(models["a"][0]), num_threads=1)
    with EngineLauncher(cmd, 2, log_dir=tmp_path / "logs") as launcher:
        victim, survivor = launcher.urls
        victim_pid = launcher.processes[0].pid
        real_broadcast = weight_sender.dist.broadcast
        calls = {"n": 0}

        def broadcast_killing_at_the_third_bucket(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 3:  # its HTTP call for this bucket is in flight; buckets 1-2 are in, 3.. are not
                os.kill(victim_pid, signal.SIGKILL)
                if known_dead:
                    launcher.processes[0].process.wait()
                    time.sleep(1.0)  # rank 0's gloo pair reads the closed socket
            return real_broadcast(*args, **kwargs)

        monkeypatch.setattr(weight_sender.dist, "broadcast", broadcast_killing_at_the_third_bucket)
        timeout_s = 15.0
        transport = DistributedTransport(module_state(models["b"][1]), bucket_mb=SMALL_BUCKET_MB)
        with ParamSync(launcher.urls, transport, update_timeout_s=timeout_s, pause_timeout_s=5) as sync:
            start = time.monotonic()
            with pytest.raises(SyncError) as err:
                sync.sync(no_disk, 1)
            elapsed = time.monotonic() - start
            assert elapsed < timeout_s, f"the error took {elapsed:.1f}s"
            assert "version 1" in str(err.value) and victim in str(err.value)
            assert set(err.value.failures) == {victim} and err.value.unreachable == [victim]
            assert err.value.updated == [survivor]
            assert asyncio.run(versions([survivor])) == ["1"]
            (result, *_) = asyncio.run(greedy([survivor]))
            expected = reference_logprobs(models["b"][1], PROMPTS[0], result.output_ids)
            assert max_abs_diff(result.logprobs, expected) < 1e-4

            sync.remove_engine(victim)
            new_url = restarted(launcher, 0).url
            assert sync.replace_engine(victim, new_url) == 1
            assert transport.members == [new_url]
            sync.sync(no_disk, 2)
            assert sorted(transport.members) == sorted([new_url, survivor])
            assert asyncio.run(versions([new_url, survivor])) == ["2", "2"]
            for url in (new_url, survivor):
                for result, prompt in zip(asyncio.run(greedy([url])), PROMPTS, strict=True):
                    expected = reference_logprobs(models["b"][1], prompt, result.output_ids)
                    assert max_abs_diff(result.logprobs, expected) < 1e-4, url


def test_an_engine_joining_between_syncs_gets_the_kept_buckets_alone_then_takes_part_in_the_next_sync(
    engines, models, tmp_path
):
    """The choice for engines that join (docs/design.md#rule-engine-set-can-change): a group of its own for the
    catch-up, then the next sync rebuilds the group over every engine; an engine that left is in no later group."""
    first, joiner = engines
    transport = DistributedTransport(module_state(models["b"][1]), bucket_mb=SMALL_BUCKET_MB)
    with ParamSync([first], transport, pause_timeout_s=10) as sync:
        sync.sync(no_disk, 1)
        assert transport.members == [first]
        assert sync.add_engine(joiner) == 1
        assert transport.members == [joiner], "the joiner caught up through a group of its own"
        for result, prompt in zip(asyncio.run(greedy([joiner])), PROMPTS, strict=True):
            assert result.versions == [1] * 10
            assert max_abs_diff(result.logprobs, reference_logprobs(models["b"][1], prompt, result.output_ids)) < 1e-4
        sync.sync(no_disk, 2)
        assert sorted(transport.members) == sorted([first, joiner])
        assert asyncio.run(versions([first, joiner])) == ["2", "2"]
        sync.remove_engine(first)  # it leaves (still running): the next group is built without it
        sync.sync(no_disk, 3)
        assert transport.members == [joiner]
        assert asyncio.run(versions([first, joiner])) == ["2", "3"]
    with ParamSync(engines, DiskTransport(tmp_path / "w")) as sync:
        sync.sync(disk_writer(models["a"][0]), 4)  # leave model A behind for the other tests
