"""ParamSync with the disk transport against real embedded engines: reports, resume, failures, atomicity."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from engine_helpers import (
    ENGINE_KINDS,
    assert_each_piece_has_one_versions_logprobs,
    engine_command,
    generate_while_syncing,
    max_abs_diff,
    reference_logprobs,
)

from rllm.experimental.fully_async.engines import EngineLauncher, free_port
from rllm.experimental.fully_async.engines.client import EngineClient, GenerationResult
from rllm.experimental.fully_async.runtime.sync.param_sync import DiskTransport, ParamSync, SyncError, SyncReport

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]


def writer(model_dir: Path) -> Callable[[str], None]:
    """Stand-in for the trainer's `save_hf(path)`: writes an HF safetensors folder."""

    def write(path: str) -> None:
        shutil.copytree(model_dir, path, dirs_exist_ok=True)

    return write


@pytest.fixture(scope="module", params=ENGINE_KINDS)
def engines(request, models, tmp_path_factory):
    """Two engines serving model A: embedded engines, then SGLang stand-ins (every test runs against both)."""
    cmd = engine_command(request.param, models["a"][0])
    with EngineLauncher(cmd, 2, log_dir=tmp_path_factory.mktemp("sync_engine_logs")) as launcher:
        yield launcher.urls


async def versions_and_pause_state(urls: list[str]) -> list[tuple[str, object]]:
    async with EngineClient(urls) as client:
        out = []
        for url in urls:
            stats = (await client.get_server_info(url))["internal_states"][0]
            out.append((await client.get_weight_version(url), stats["paused"]))
        return out


def test_sync_reports_timings_and_leaves_engines_resumed_on_the_new_version(engines, models, tmp_path):
    with ParamSync(engines, DiskTransport(tmp_path / "weights")) as sync:
        report = sync.sync(writer(models["b"][0]), new_version=1)
        assert isinstance(report, SyncReport)
        assert report.version == 1 and report.num_engines == 2
        assert report.nbytes > 0 and Path(report.location) == tmp_path / "weights" / "v1"
        assert 0 < report.update_s <= report.pause_s < report.total_s
        assert report.write_s > 0
        assert sync.engine_versions == dict.fromkeys(engines, 1)
        assert asyncio.run(versions_and_pause_state(engines)) == [("1", None), ("1", None)]

        async def generate_on_each() -> list[GenerationResult]:
            async with EngineClient(engines) as client:
                return await asyncio.gather(
                    *(client.generate([4, 5], {"max_new_tokens": 8, "ignore_eos": True}) for _ in range(4))
                )

        for result in asyncio.run(generate_on_each()):
            assert result.versions == [1] * 8
            assert max_abs_diff(result.logprobs, reference_logprobs(models["b"][1], [4, 5], result.output_ids)) < 1e-4
        sync.sync(writer(models["a"][0]), new_version=2)  # leave model A behind for the other tests


def test_disk_transport_keeps_only_the_newest_folders(engines, models, tmp_path):
    root = tmp_path / "weights"
    with ParamSync(engines, DiskTransport(root, keep=2)) as sync:
        for version in range(1, 5):
            sync.sync(writer(models["a"][0]), new_version=version)
    assert sorted(p.name for p in root.iterdir()) == ["v3", "v4"]


def test_sync_to_a_dead_engine_raises_naming_it_and_resumes_the_live_ones(engines, models, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    sync = ParamSync([*engines, dead], DiskTransport(tmp_path / "weights"), pause_timeout_s=5)
    with sync, pytest.raises(SyncError) as err:
        sync.sync(writer(models["a"][0]), new_version=7)
    assert dead in str(err.value) and "version 7" in str(err.value)
    assert err.value.failures.keys() == {dead}
    assert sorted(err.value.updated) == sorted(engines)
    assert asyncio.run(versions_and_pause_state(engines)) == [("7", None), ("7", None)]


def test_a_failed_load_raises_and_leaves_engines_resumed_on_the_old_version(engines, tmp_path, models):
    def write_corrupt(path: str) -> None:
        shutil.copytree(models["a"][0], path, dirs_exist_ok=True)
        (Path(path) / "model.safetensors").write_bytes(b"truncated")

    before = asyncio.run(versions_and_pause_state(engines))
    with ParamSync(engines, DiskTransport(tmp_path / "weights")) as sync:
        with pytest.raises(SyncError) as err:
            sync.sync(write_corrupt, new_version=99)
        assert set(err.value.failures) == set(engines) and "version 99" in str(err.value)
        assert sync.engine_versions == dict.fromkeys(engines)
    assert asyncio.run(versions_and_pause_state(engines)) == before
    assert all(paused is None for _, paused in before)


def test_updates_under_concurrent_load_give_each_piece_exactly_one_versions_weights(engines, models, tmp_path):
    """Repeated syncs while generating: each resumed piece's log-probs are one version's, stitched in order."""
    path_for = {v: models["b"][0] if v % 2 else models["a"][0] for v in range(0, 7)}
    with ParamSync(engines, DiskTransport(tmp_path / "weights")) as sync:
        sync.sync(writer(path_for[2]), 2)  # a known starting version on both engines
        results = generate_while_syncing(
            engines, lambda version: sync.sync(writer(path_for[version]), version), range(3, 7), workers=12
        )
    assert_each_piece_has_one_versions_logprobs(results, lambda v: models["b"][1] if v % 2 else models["a"][1])


def test_an_engine_that_does_not_read_back_the_pushed_version_fails_the_sync_naming_it(engines, models, tmp_path):
    """ParamSync reads each engine's version back after setting it; a transport whose engine ends on another
    version (here: it sets a wrong one after loading) is a SyncError naming that engine."""

    class WrongVersion(DiskTransport):
        async def load(self, client, url, staged, *, timeout_s):
            await super().load(client, url, staged, timeout_s=timeout_s)
            if url == engines[1]:
                client_set = client.update_weight_version
                client.update_weight_version = lambda u, v, **kw: client_set(u, "41" if u == engines[1] else v, **kw)

    with ParamSync(engines, WrongVersion(tmp_path / "weights")) as sync, pytest.raises(SyncError) as err:
        sync.sync(writer(models["a"][0]), new_version=42)
    assert set(err.value.failures) == {engines[1]} and "'41'" in err.value.failures[engines[1]]
    assert err.value.updated == [engines[0]]
    assert asyncio.run(versions_and_pause_state(engines)) == [("42", None), ("41", None)]
    with ParamSync(engines, DiskTransport(tmp_path / "weights2")) as sync:
        sync.sync(writer(models["a"][0]), new_version=43)  # a clean sync repairs it
    assert asyncio.run(versions_and_pause_state(engines)) == [("43", None), ("43", None)]


def test_weights_travel_in_the_configured_dtype(engines, models, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from rllm.experimental.fully_async.runtime.sync.param_sync import resolve_sync_dtype

    assert resolve_sync_dtype("auto", "cuda", "torch.float32") == "bfloat16"
    assert resolve_sync_dtype("auto", "cpu", "torch.float32") == "float32"
    assert resolve_sync_dtype("float32", "cuda", "torch.bfloat16") == "float32"
    with pytest.raises(ValueError, match=r"param_sync\.dtype"):
        resolve_sync_dtype("fp8", "cuda", "torch.float32")

    seen: list[str | None] = []

    def write(path: str, dtype: str | None = None) -> None:  # the backend's save_hf signature
        seen.append(dtype)
        model = AutoModelForCausalLM.from_pretrained(models["a"][0])
        state = {k: v.to(getattr(torch, dtype)) for k, v in model.state_dict().items()}
        model.save_pretrained(path, state_dict=state)

    import torch

    with ParamSync(engines, DiskTransport(tmp_path / "weights"), weights_dtype="bfloat16") as sync:
        report = sync.sync(write, new_version=8)
    assert seen == ["bfloat16"]
    with safe_open(str(Path(report.location) / "model.safetensors"), "pt") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict) == {"torch.bfloat16"}
    assert asyncio.run(versions_and_pause_state(engines)) == [("8", None), ("8", None)]


def test_sync_and_http_errors_survive_the_trip_between_processes():
    """A Ray actor's exception crosses processes by pickle; these two have constructors of their own."""
    import pickle

    from rllm.experimental.fully_async.engines.http import EngineHTTPError
    from rllm.experimental.fully_async.runtime.sync.param_sync import SyncError

    http = EngineHTTPError("http://127.0.0.1:1", "/update_weights_from_disk", 500, "boom")
    sync = SyncError(3, {"http://127.0.0.1:1": str(http)}, ["http://127.0.0.1:2"], ["http://127.0.0.1:1"])
    for error in (http, sync):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)
    assert pickle.loads(pickle.dumps(sync)).unreachable == ["http://127.0.0.1:1"]
