"""Validation beside training (runtime/rollout/validation.py):
pinned to one weight version, the trainer keeps going."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess

import pytest
from run_helpers import addition_run_command

from rllm.experimental.fully_async.runtime.rollout.validation import SyncGate, pinned_version


def test_a_sync_waits_for_the_running_validation_and_a_validation_for_the_running_sync():
    waits: list[float] = []

    async def scenario() -> list[str]:
        gate, events = SyncGate(), []

        async def validation() -> None:
            async with gate.validation(timeout_s=5):
                events.append("validation start")
                await asyncio.sleep(0.2)
                events.append("validation end")

        async def sync() -> None:
            await asyncio.sleep(0.05)  # the validation holds the gate first
            waits.append(await gate.begin_sync(timeout_s=5))
            events.append("sync start")
            await asyncio.sleep(0.1)
            await gate.end_sync()
            events.append("sync end")

        async def late_validation() -> None:
            await asyncio.sleep(0.25)  # arrives while the sync holds the gate
            async with gate.validation(timeout_s=5):
                events.append("late validation start")

        await asyncio.gather(validation(), sync(), late_validation())
        return events

    assert asyncio.run(scenario()) == [
        "validation start",
        "validation end",
        "sync start",
        "sync end",
        "late validation start",
    ]
    assert waits[0] >= 0.1  # the sync asked 0.05 s in and the validation held the gate until 0.2 s


def test_waits_are_bounded_and_name_what_they_waited_for():
    async def sync_behind_a_hung_validation() -> None:
        gate = SyncGate()
        async with gate.validation(timeout_s=1):
            await gate.begin_sync(timeout_s=0.05)

    with pytest.raises(TimeoutError, match=re.escape("weight sync waited 0.05s for the running validation")):
        asyncio.run(sync_behind_a_hung_validation())

    async def validation_behind_a_hung_sync() -> None:
        gate = SyncGate()
        await gate.begin_sync(timeout_s=1)
        async with gate.validation(timeout_s=0.05):
            pass

    with pytest.raises(TimeoutError, match=re.escape("validation waited 0.05s for a weight sync")):
        asyncio.run(validation_behind_a_hung_sync())


def test_the_pinned_version_is_the_one_every_engine_reports():
    assert pinned_version({"a": "3", "b": "3"}) == 3
    with pytest.raises(ValueError, match="disagree"):
        pinned_version({"a": "3", "b": "4"})


@pytest.mark.slow
def test_the_trainer_steps_while_a_validation_runs_and_every_answer_comes_from_the_pinned_version(
    tmp_path, addition_cache
):
    run_dir = tmp_path / "run"
    command = addition_run_command(
        run_dir,
        addition_cache,
        "task.val_size=1000",  # long enough (~1-2 s of greedy decoding) to overlap training steps
        "trainer.total_training_steps=10",
        "trainer.test_freq=2",
        "async_training.required_samples=16",
        "actor_rollout_ref.rollout.n=4",
        "async_training.max_staleness=1",
        "async_training.trigger_parameter_sync_step=2",  # a step without a sync can run to its end beside it
    )
    env = dict(os.environ, RLLM_LOG_LEVEL="WARNING")
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "trainer/version" in r}
    validations = [r for r in rows if "val/step" in r]
    assert validations, "no validation result was logged"
    for val in validations:
        assert "val/failed" not in val, val
        assert val["step"] == val["val/step"] and val["val/logged_at_step"] > val["val/step"]
        assert val["val/off_version_answers"] == 0.0, f"answers from more than one version: {val}"
        assert val["val/pinned_version"] == steps[val["step"]]["trainer/version"]
    # The trainer finished steps (an optimizer step each) while some validation was generating.
    overlapping = [
        s
        for s, r in steps.items()
        for val in validations
        if val["val/started_at"] < r["time"] - r["timing/step_s"] + r["timing/update_s"] < val["val/finished_at"]
    ]
    assert overlapping, "no optimizer step happened while a validation ran"
