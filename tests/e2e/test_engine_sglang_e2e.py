"""End to end with the SGLang stand-in as the engine backend: the CLI's real `engines.backend=sglang` path
(SGLangEngineCommand, ParamSync's set-and-read-back version protocol) trains, and versions advance on the engine."""

from __future__ import annotations

import json
import os
import subprocess

import psutil
import pytest
from run_helpers import addition_run_command
from sglang_standin import standin_pythonpath

STEPS = 3
pytestmark = [pytest.mark.slow, pytest.mark.timeout(660)]  # a CLI run end to end


def test_cli_trains_against_the_sglang_standin_and_engine_versions_advance(tmp_path, addition_cache):
    run_dir = tmp_path / "run"
    # The shadow `sglang` package makes `python -m sglang.launch_server` start the stand-in; the launcher, the
    # client and ParamSync run unchanged.
    env = dict(os.environ, RLLM_LOG_LEVEL="WARNING", PYTHONPATH=standin_pythonpath())
    command = addition_run_command(
        run_dir,
        addition_cache,
        "engines.backend=sglang",
        "actor_rollout_ref.rollout.name=sglang",
        "engines.num_engines=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",  # verl's default is 2; the stand-in runs 1
        "task.val_size=16",
        f"trainer.total_training_steps={STEPS}",
        "trainer.test_freq=-1",
        "data.train_batch_size=8",
        "async_training.required_samples=8",
        "async_training.max_staleness=1",
        "async_training.trigger_parameter_sync_step=1",
        "actor_rollout_ref.rollout.n=4",
        "data.max_response_length=16",
    )
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "trainer/step" in r]
    assert [int(r["trainer/version"]) for r in steps] == list(range(1, STEPS + 1))
    # Groups stayed within the staleness bound: the engine reported the versions ParamSync set (with SGLang's
    # paused-load quirk and no read-back, tokens would stay at version 0 and every group would go stale).
    assert max(r["staleness/max"] for r in steps) <= 1
    logs = sorted((run_dir / "engines").glob("*.log"))
    assert logs and "SGLang stand-in ready" in logs[0].read_text()
    left = [
        " ".join(p.info["cmdline"] or [])
        for p in psutil.process_iter(["cmdline"])
        if "sglang.launch_server" in " ".join(p.info["cmdline"] or [])
        and str(addition_cache) in " ".join(p.info["cmdline"] or [])
    ]
    assert not left
