"""End to end: a LoRA run whose adapter load fails on one engine stops with one line naming the engine and the
version, or, when the engine dies in the load, recovers by restarting it; it never trains on samples of the base
model or of an adapter the engines did not all take (docs/design.md#rule-one-version-per-lora-sample).

The fault is the SGLang stand-in's test-only `--test-only-fail-lora-*` flags (tests/standins/sglang_standin/
lora_fault.py), passed by the run's own `engines.extra_args`: the load of policy-v2 (the sync after step 2) fails on
one engine (the first of the run's engines to get it; a restarted one then loads normally), answered as SGLang
answers a failed load (400, success false: two engines, the other takes it) or by the process ending as the load
arrives (one engine, so that no rollout runs, and the run cannot end, before its restart).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import psutil
import pytest
from run_helpers import addition_run_command, leftover_processes
from sglang_standin import standin_pythonpath

from rllm.experimental.fully_async.engines.lora import adapter_version

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # CLI runs end to end on the stand-in
STEPS, GROUPS, N = 5, 8, 4
FAILING = "policy-v2"


def _run(run_dir: Path, cache: Path, how: str, *overrides: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, RLLM_LOG_LEVEL="WARNING", PYTHONPATH=standin_pythonpath())
    command = addition_run_command(
        run_dir,
        cache,
        "engines.backend=sglang",
        "actor_rollout_ref.rollout.name=sglang",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.actor.optim.lr=5e-3",
        "task.val_size=16",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=0",
        f"trainer.total_training_steps={STEPS}",
        f"trainer.rollout_data_dir={run_dir / 'dumps'}",
        f"data.train_batch_size={GROUPS}",
        f"async_training.required_samples={GROUPS}",
        "async_training.max_staleness=1",
        "async_training.trigger_parameter_sync_step=1",
        f"actor_rollout_ref.rollout.n={N}",
        "data.max_response_length=16",
        f"engines.extra_args.test_only_fail_lora_load={FAILING}",
        f"engines.extra_args.test_only_fail_lora_how={how}",
        f"engines.extra_args.test_only_fail_lora_once={run_dir.parent / 'fault-claimed'}",  # the restart loads
        *overrides,
    )
    proc = subprocess.Popen(command, cwd=run_dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = proc.communicate(timeout=840)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"the run did not end in 840 s:\n{output.decode()[-3000:]}")
    return proc, output.decode()


def _left(proc: subprocess.Popen, cache: Path) -> list[str]:
    """Stand-in engines or Ray daemons the run left behind."""
    engines = [
        " ".join(p.info["cmdline"] or [])
        for p in psutil.process_iter(["cmdline"])
        if "sglang.launch_server" in " ".join(p.info["cmdline"] or [])
        and str(cache) in " ".join(p.info["cmdline"] or [])
    ]
    return engines + leftover_processes(proc.pid, str(cache))


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if "trainer/step" in r]


def _trained_adapters(run_dir: Path) -> set[str]:
    """Every trained sample's adapter, checked to be one policy-v<N> whose version all its tokens carry."""
    names = set()
    for dump in sorted((run_dir / "dumps").glob("*.jsonl")):
        for line in dump.read_text().splitlines():
            for seq in json.loads(line)["sequences"]:
                (name,) = seq["lora_paths"]
                assert set(seq["versions"]) == {adapter_version(name)}, (name, set(seq["versions"]))
                names.add(name)
    return names


def _faulted_engine_port(run_dir: Path) -> int:
    """The port of the engine whose log says it took the fault."""
    (log,) = [p for p in (run_dir / "engines").glob("*.log") if "test-only fault" in p.read_text()]
    return int(re.search(r"standin:(\d+) ", log.read_text()).group(1))


def test_a_failed_adapter_load_stops_the_run_with_one_line_naming_the_engine_and_version(tmp_path, addition_cache):
    run_dir = tmp_path / "run"
    proc, output = _run(run_dir, addition_cache, "error", "engines.num_engines=2")
    assert proc.returncode != 0, output[-3000:]
    port = _faulted_engine_port(run_dir)
    lines = [line for line in output.splitlines() if "weight sync to version 2 failed on 1 engine(s)" in line]
    assert lines, output[-3000:]
    assert all(f"http://127.0.0.1:{port}" in line and FAILING in line for line in lines), lines
    # stopped at the failed sync: nothing trained after it, and everything trained came from adapters every engine
    # took (policy-v0 and policy-v1), none from the base model
    steps = _steps(run_dir)
    assert [int(r["trainer/version"]) for r in steps] == [1]  # step 2's sync failed: its step is not logged
    assert _trained_adapters(run_dir) <= {"policy-v0", "policy-v1"}
    assert not _left(proc, addition_cache)


def test_an_engine_killed_in_an_adapter_load_is_restarted_at_the_newest_and_training_goes_on(tmp_path, addition_cache):
    run_dir = tmp_path / "run"
    # One engine: no rollout runs until its restart, so the run cannot end before the restart has been proven.
    proc, output = _run(run_dir, addition_cache, "exit", "engines.num_engines=1", "engines.on_engine_failure=restart")
    assert proc.returncode == 0, output[-3000:]
    port = _faulted_engine_port(run_dir)
    assert f"http://127.0.0.1:{port}" in output and "left out of weight syncs until restarted" in output
    restart = re.search(r"engine \d restarted at http://127\.0\.0\.1:\d+ \(weight version (\d+)\)", output)
    assert restart and int(restart.group(1)) >= 2, output[-3000:]  # it joined at the newest adapter, not at v0
    steps = _steps(run_dir)
    assert [int(r["trainer/version"]) for r in steps] == list(range(1, STEPS + 1))
    assert steps[-1]["engines/restarts"] == 1.0 and steps[-1]["engines/alive"] == 1.0
    assert all(r["sync/pause_s"] == 0.0 for r in steps if "sync/pause_s" in r)
    # every trained sample came from one adapter the trainer sent, its tokens all that version (the trainer's
    # provenance check passed every batch: the run did not stop); versions from 2 on ran on the restarted engine only
    versions = {adapter_version(name) for name in _trained_adapters(run_dir)}
    assert max(versions) >= STEPS - 2, versions  # the last batch is within the bound: from v3 or v4
    last = steps[-1]
    ended = sum(last[f"ledger/{k}"] for k in ("in_flight", "trained", "filtered", "dropped_stale", "failed"))
    assert last["ledger/issued"] == ended and last["ledger/failed"] == 0
    assert not _left(proc, addition_cache)
