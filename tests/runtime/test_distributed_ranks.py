"""The distributed weight transport with two FSDP trainer ranks (gloo rank actors on Ray) and real embedded engines.

Trainer rank 0 is rank 0 of the weight-update group and broadcasts bucket by bucket; rank 1 only takes part in
gathering the full parameters. After a training step the engines' versions read back, and their log-probs equal those
after a disk sync of the same weights (the 2-rank HF export). An engine killed mid-broadcast fails the sync in time
and neither rank is left waiting (the next sync and the next training call go through). A whole CLI run with two
ranks and `param_sync.transport=distributed` is tests/e2e/test_resume.py's two-rank kill and resume (every step synced
by broadcast, in both runs; nothing written to disk).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch
from engine_helpers import max_abs_diff, reference_logprobs, restarted
from test_distributed_sync import PROMPTS, greedy, versions
from test_trainer_ranks import CFG, TIMEOUTS, odd_batch
from transformers import AutoModelForCausalLM

from rllm.experimental.fully_async.engines import EmbeddedEngineCommand, EngineLauncher
from rllm.experimental.fully_async.runtime.sync import sender as weight_sender
from rllm.experimental.fully_async.runtime.sync.param_sync import (
    DiskTransport,
    ParamSync,
    SyncError,
    transport_from_config,
)
from rllm.experimental.fully_async.runtime.sync.sender import RankZeroSender
from rllm.experimental.fully_async.runtime.trainer.ranks import DistributedPolicyBackend
from rllm.experimental.fully_async.settings.loader import load_config

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_torch_thread")]

SMALL_BUCKET_MB = 0.02  # ~21 KB: the tiny model (~310 KB in fp32) travels in ~15 buckets


def no_disk(path: str) -> None:
    raise AssertionError("the distributed transport must not write weights to disk")


def distributed_config(**overrides: str):
    cfg = load_config(
        None, ["param_sync.transport=distributed", *(f"param_sync.{k}={v}" for k, v in overrides.items())]
    )
    return cfg.param_sync


@pytest.fixture(scope="module")
def two_ranks(ray_session, models):
    """Two gloo ranks holding model B in FSDP2 shards, one step trained: weights no folder holds."""
    group = DistributedPolicyBackend(models["b"][0], CFG, world=2, device="cpu", **TIMEOUTS)
    group.update_policy(odd_batch(3, group))
    yield group
    group.shutdown()


@pytest.mark.slow  # two gloo rank actors and two engines (~40 s on a busy 2-core machine)
def test_two_ranks_broadcast_what_a_disk_sync_of_the_same_weights_gives(two_ranks, models, tmp_path):
    cmd = EmbeddedEngineCommand(str(models["a"][0]), num_threads=1)
    with EngineLauncher(cmd, 2, log_dir=tmp_path / "logs") as launcher:
        engines = launcher.urls
        transport = transport_from_config(distributed_config(bucket_mb=SMALL_BUCKET_MB), two_ranks, "float32")
        assert isinstance(transport.sender, RankZeroSender) and transport.backend == "gloo"
        with ParamSync(engines, transport) as sync:
            report = sync.sync(no_disk, 1)
            assert int(report.location.split()[1]) >= 10  # "broadcast: N bucket(s)"
            assert report.nbytes == sum(p.numel() * 4 for p in models["b"][1].parameters())
            assert sync.engine_versions == dict.fromkeys(engines, 1)
            assert asyncio.run(versions(engines)) == ["1", "1"]
            over_wire = asyncio.run(greedy(engines))
            assert len(transport.members) == 2 and transport.group_name is not None
        with ParamSync(engines, DiskTransport(tmp_path / "w")) as sync:
            sync.sync(two_ranks.save_hf, 2)  # the 2-rank HF export, written by rank 0
            assert asyncio.run(versions(engines)) == ["2", "2"]
            from_disk = asyncio.run(greedy(engines))
            trained = AutoModelForCausalLM.from_pretrained(tmp_path / "w" / "v2").eval()
    changed = max(
        float((a - b).detach().abs().max())
        for a, b in zip(trained.parameters(), models["b"][1].parameters(), strict=True)
    )
    assert changed > 0, "the training step changed the weights, so model B's folder would not do"
    for wire, disk, prompt in zip(over_wire, from_disk, [p for p in PROMPTS for _ in engines], strict=True):
        assert wire.versions == [1] * 10 and disk.versions == [2] * 10
        assert wire.output_ids == disk.output_ids
        assert max_abs_diff(wire.logprobs, disk.logprobs) < 1e-5
        assert max_abs_diff(wire.logprobs, reference_logprobs(trained, prompt, wire.output_ids)) < 1e-4


@pytest.mark.slow  # two gloo rank actors, an engine killed and restarted (~30 s on a busy 2-core machine)
def test_an_engine_killed_mid_broadcast_leaves_no_rank_waiting(two_ranks, models, tmp_path, monkeypatch):
    """Rank 0 broadcasts in its own actor, so the kill happens from the engine's side: SIGKILL before the second
    bucket's broadcast, which starts once rank 0 can know the engine is dead (gloo's root then raises at that peer
    before it sends to the next: CI once saw the survivor wait out its timeout and fail too). The sync fails in time
    naming the dead engine alone and the survivor gets the version through a group without it; the next sync and a
    training call on both ranks go through: no rank waits in a collective for the dead engine. Its restart catches
    up and the next sync rebuilds the group over both."""
    cmd = EmbeddedEngineCommand(str(models["a"][0]), num_threads=1)
    with EngineLauncher(cmd, 2, log_dir=tmp_path / "logs") as launcher:
        victim, survivor = launcher.urls
        victim_pid = launcher.processes[0].pid
        transport = transport_from_config(distributed_config(bucket_mb=SMALL_BUCKET_MB), two_ranks, "float32")
        real_broadcast = transport.sender.broadcast
        calls = {"n": 0}

        def broadcast_killing_at_the_second_bucket(name: str, version: int, index: int) -> None:
            calls["n"] += 1
            if calls["n"] == 2:
                os.kill(victim_pid, signal.SIGKILL)
                launcher.processes[0].process.wait()
                time.sleep(1.0)  # rank 0's gloo pair reads the closed socket
            real_broadcast(name, version, index)

        monkeypatch.setattr(transport.sender, "broadcast", broadcast_killing_at_the_second_bucket)
        timeout_s = 20.0
        with ParamSync(launcher.urls, transport, update_timeout_s=timeout_s, pause_timeout_s=5) as sync:
            start = time.monotonic()
            with pytest.raises(SyncError) as err:
                sync.sync(no_disk, 1)
            assert time.monotonic() - start < 2 * timeout_s + 10
            assert "version 1" in str(err.value) and set(err.value.failures) == {victim}
            assert err.value.updated == [survivor]
            sync.remove_engine(victim)
            sync.sync(no_disk, 2)
            assert asyncio.run(versions([survivor])) == ["2"]
            two_ranks.compute_log_prob(odd_batch(5, two_ranks))  # both ranks still answer collectives
            # The restarted engine catches up from rank 0's kept buckets through a group of its own.
            new_url = restarted(launcher, 0).url
            assert sync.replace_engine(victim, new_url) == 2
            assert transport.members == [new_url]
            sync.sync(no_disk, 3)
            assert sorted(transport.members) == sorted([new_url, survivor])
            assert asyncio.run(versions([new_url, survivor])) == ["3", "3"]


def test_bucket_packing_streams_and_a_rank_other_than_zero_keeps_nothing(models):
    tensors = list(weight_sender.module_tensors(models["b"][1]))
    assert len({n for n, _ in tensors}) == len(tensors)
    drained: list[str] = []

    def stream():
        for name, tensor in tensors:
            drained.append(name)
            yield name, tensor

    assert weight_sender.plan_buckets(stream(), 2**14, "bfloat16", keep=False) == []
    assert drained == [n for n, _ in tensors]  # every tensor's collective ran, none was kept
    kept = weight_sender.plan_buckets(iter(tensors), 2**14, "bfloat16")
    assert [n for b in kept for n in b.names] == [n for n, _ in tensors]
    assert {d for b in kept for d in b.dtypes} == {"bfloat16"}
    first = kept[0]
    assert torch.equal(
        first.flat[: first.header.nbytes].view(torch.bfloat16)[: tensors[0][1].numel()],
        tensors[0][1].detach().to(torch.bfloat16).reshape(-1),
    )


def test_the_transport_takes_each_backends_own_source_of_full_tensors(models):
    """One FSDP process: its module, tensor by tensor; Megatron (CUDA only, so a stand-in with its method): the
    HF-named `hf_weight_stream`, streamed into buckets without a whole-model dict. Several ranks: the first test."""

    class MegatronStandIn:
        def __init__(self) -> None:
            self.drained = 0

        def hf_weight_stream(self):
            for name, tensor in models["b"][1].state_dict().items():
                self.drained += 1
                yield name, tensor

    class OneProcess:
        model = models["a"][1]

    megatron = MegatronStandIn()
    state_b = models["b"][1].state_dict()  # tied lm_head included: the stream sends what it yields
    as_streamed = (list(state_b), sum(t.numel() * 2 for t in state_b.values()))
    # one process: tied weights once (module_tensors), every tensor cast to bf16
    as_module = (
        [n for n, _ in weight_sender.module_tensors(models["a"][1])],
        sum(p.numel() * 2 for p in models["a"][1].parameters()),
    )
    for backend, (expected_names, expected_bytes) in ((megatron, as_streamed), (OneProcess(), as_module)):
        transport = transport_from_config(distributed_config(bucket_mb=SMALL_BUCKET_MB), backend, "bfloat16")
        assert isinstance(transport.sender, weight_sender.LocalSender)
        staged = transport.stage(no_disk, 4)
        headers = transport._staged[1]
        names = [n for h in headers for n in h.names]
        assert names == expected_names and staged.nbytes == expected_bytes
        transport.close()
    assert megatron.drained == len(state_b)
