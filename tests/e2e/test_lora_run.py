"""End to end with LoRA: the CLI trains the addition task's policy as a LoRA adapter (actor_rollout_ref.model.lora_rank)
with 2 embedded engines, each weight sync an adapter loaded as policy-v<N> with no pause; then a resume from its
checkpoint goes on from the adapter and optimizer state it saved.

Checked: every step's batch came from adapters the trainer sent (the trainer refuses any other; lora/* metrics),
versions advance one per sync, each trained sample's tokens carry the one version its adapter names (the trajectory
dumps' `lora_paths` and `versions`), no sync paused an engine or resumed a request, every weight folder holds an
adapter and no base weights, the ledger adds up exactly, and the resumed run continues at the checkpoint's version.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from run_helpers import addition_run_command, leftover_processes

from rllm.experimental.fully_async.engines.lora import adapter_version

pytestmark = pytest.mark.slow  # two CLI runs end to end, read by every test
STEPS, RESUMED_STEPS = 4, 6
GROUPS, N = 8, 4
LORA = ("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16")


def _run(command: list[str], cwd: Path) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, RLLM_LOG_LEVEL="WARNING")
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"the LoRA run did not finish in 600 s:\n{output[-3000:]}")
    return proc, output


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, addition_cache):
    root = tmp_path_factory.mktemp("e2e_lora")
    run_dir = root / "run"

    def command(steps: int) -> list[str]:
        return addition_run_command(
            run_dir,
            addition_cache,
            *LORA,
            "actor_rollout_ref.actor.optim.lr=5e-3",  # an adapter moves from zero: a rate it shows in a few steps
            "task.val_size=16",
            f"trainer.total_training_steps={steps}",
            "trainer.test_freq=2",
            "trainer.save_freq=2",
            f"trainer.rollout_data_dir={run_dir / 'dumps'}",
            f"data.train_batch_size={GROUPS}",
            f"async_training.required_samples={GROUPS}",
            "async_training.max_staleness=1",
            "async_training.trigger_parameter_sync_step=1",
            f"actor_rollout_ref.rollout.n={N}",
            "engines.num_engines=2",
        )

    first = _run(command(STEPS), root)
    rows = _rows(run_dir)
    resumed = _run(command(RESUMED_STEPS), root)  # the same run dir: resumes from its last checkpoint (step 4)
    return {"first": first, "resumed": resumed, "rows": rows, "all_rows": _rows(run_dir), "run_dir": run_dir}


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _steps(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "trainer/step" in r]


def test_a_lora_run_exits_zero_with_each_sync_an_adapter_and_no_pause(lora_runs):
    proc, output = lora_runs["first"]
    assert proc.returncode == 0, output[-3000:]
    steps = _steps(lora_runs["rows"])
    assert [int(r["trainer/step"]) for r in steps] == list(range(1, STEPS + 1))
    assert [int(r["trainer/version"]) for r in steps] == list(range(1, STEPS + 1))  # one adapter version per sync
    assert all(r["sync/pause_s"] == 0.0 for r in steps)
    # nothing was aborted, so nothing resumed or mixed versions
    assert sum(r["partial/resumed_samples"] for r in steps) == sum(r["partial/mixed_version_samples"] for r in steps)
    assert sum(r["partial/resumed_samples"] for r in steps) == 0
    # each batch came from adapters the trainer sent, at most one version behind the trainer's
    for row in steps:
        version_before = int(row["trainer/version"]) - 1
        assert version_before - 1 <= row["lora/adapter_min_version"] <= row["lora/adapter_max_version"]
        assert row["lora/adapter_max_version"] <= version_before
    assert steps[-1]["lora/adapter_max_version"] > steps[0]["lora/adapter_max_version"]  # the versions advanced


def test_every_trained_sample_names_the_adapter_whose_version_its_tokens_carry(lora_runs):
    dumps = sorted((lora_runs["run_dir"] / "dumps").glob("*.jsonl"))
    assert dumps
    names = set()
    for dump in dumps:
        for line in dump.read_text().splitlines():
            for seq in json.loads(line)["sequences"]:
                (name,) = seq["lora_paths"]
                names.add(name)
                assert set(seq["versions"]) == {adapter_version(name)}, (name, set(seq["versions"]))
    assert {"policy-v0", "policy-v1"} <= names


def test_each_validation_is_pinned_to_the_adapter_its_step_synced(lora_runs):
    """Validation beside training with LoRA: every answer from one adapter version, the newest every engine serves
    (read back), which is the version the step it measures synced, as a full-weights validation reads the engines'
    weight_version (tests/runtime/test_validation.py)."""
    rows = lora_runs["rows"]
    steps = {r["step"]: r for r in rows if "trainer/version" in r}
    validations = [r for r in rows if "val/step" in r]
    assert validations, "no validation result was logged"
    for val in validations:
        assert "val/failed" not in val, val
        assert val["val/off_version_answers"] == 0.0, f"answers from more than one adapter: {val}"
        assert val["val/pinned_version"] == steps[val["step"]]["trainer/version"], val
        assert val["val/version"] == val["val/pinned_version"], val


def test_only_adapters_travelled_and_the_base_never_moved(lora_runs):
    folders = sorted((lora_runs["run_dir"] / "weights").glob("v*"))
    assert folders
    for folder in folders:
        files = {p.name for p in folder.iterdir()}
        assert {"adapter_model.safetensors", "adapter_config.json"} <= files
        assert not any(f.startswith("model") for f in files), files  # no base-model weights
        assert json.loads((folder / "adapter_config.json").read_text())["r"] == 8


def test_the_ledger_is_exact(lora_runs):
    for row in lora_runs["rows"]:
        if "ledger/issued" in row:
            ended = sum(row[f"ledger/{k}"] for k in ("trained", "filtered", "dropped_stale", "failed"))
            assert row["ledger/in_flight"] + ended == row["ledger/issued"]
    assert lora_runs["rows"][-1]["ledger/trained"] == STEPS * GROUPS * N


def test_a_resumed_lora_run_continues_from_the_checkpoints_adapter(lora_runs):
    proc, output = lora_runs["resumed"]
    assert proc.returncode == 0, output[-3000:]
    assert f"at step {STEPS} (version {STEPS})" in output, output[-2000:]
    steps = _steps(lora_runs["all_rows"])
    later = [r for r in steps if r["trainer/step"] > STEPS]
    assert [int(r["trainer/step"]) for r in later] == list(range(STEPS + 1, RESUMED_STEPS + 1))
    assert [int(r["trainer/version"]) for r in later] == list(range(STEPS + 1, RESUMED_STEPS + 1))
    # the first batch after the resume came from the checkpoint's adapter (reloaded as policy-v4), not from v0
    assert later[0]["lora/adapter_min_version"] >= STEPS - 1


def test_no_engine_or_ray_process_is_left(lora_runs, addition_cache):
    for proc, _ in (lora_runs["first"], lora_runs["resumed"]):
        assert not leftover_processes(proc.pid, str(addition_cache))
