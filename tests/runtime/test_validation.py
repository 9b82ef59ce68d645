"""Validation beside training (runtime/rollout/validation.py):
pinned to one weight version, the trainer keeps going."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import subprocess

import pytest
from omegaconf import OmegaConf
from rich.console import Console
from run_helpers import addition_run_command
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb_records import history, offline_run_file, step_metrics

from rllm.experimental.fully_async.observe.metrics_sink import MetricsSink
from rllm.experimental.fully_async.observe.progress import Progress
from rllm.experimental.fully_async.runtime.rollout.validation import BackgroundValidation, SyncGate, pinned_version
from rllm.experimental.fully_async.runtime.run.driver import log_step


def test_a_sync_waits_for_the_running_validation_and_a_validation_for_the_running_sync():
    """Each party acts on an event the test sets, never on a sleep: the order below cannot depend on machine load."""

    async def scenario() -> list[str]:
        gate, events = SyncGate(), []
        validation_holds, release_validation = asyncio.Event(), asyncio.Event()
        sync_holds, release_sync = asyncio.Event(), asyncio.Event()

        async def validation() -> None:
            async with gate.validation(timeout_s=5):
                events.append("validation start")
                validation_holds.set()
                await release_validation.wait()
                events.append("validation end")

        async def sync() -> None:
            await validation_holds.wait()  # the validation holds the gate first
            await gate.begin_sync(timeout_s=5)
            events.append("sync start")
            sync_holds.set()
            await release_sync.wait()
            await gate.end_sync()
            events.append("sync end")

        async def late_validation() -> None:
            await sync_holds.wait()  # arrives while the sync holds the gate
            async with gate.validation(timeout_s=5):
                events.append("late validation start")

        async def settle() -> None:  # every task runs until it blocks (no wall clock involved)
            for _ in range(20):
                await asyncio.sleep(0)

        tasks = [asyncio.create_task(c()) for c in (validation, sync, late_validation)]
        await validation_holds.wait()
        await settle()
        assert events == ["validation start"]  # the sync is waiting for the validation
        release_validation.set()
        await sync_holds.wait()
        await settle()
        assert events[-1] == "sync start"  # the late validation is waiting for the sync
        release_sync.set()
        await asyncio.gather(*tasks)
        return events

    assert asyncio.run(scenario()) == [
        "validation start",
        "validation end",
        "sync start",
        "sync end",
        "late validation start",
    ]


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


def _offline_trackers(monkeypatch, where) -> None:
    """wandb offline and TensorBoard, both writing under `where` (verl's Tracking reads these variables)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(where))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("TENSORBOARD_DIR", str(where / "tb"))


def _tensorboard_points(log_dir, tag: str) -> list[tuple[int, float]]:
    points = []
    for events in sorted(log_dir.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        if tag in accumulator.Tags()["scalars"]:
            points += [(e.step, round(e.value, 6)) for e in accumulator.Scalars(tag)]
    return points


def test_a_validation_finishing_between_steps_is_logged_at_the_next_step_for_the_step_it_measured(
    tmp_path, monkeypatch
):
    """The driver's per-step path (Run.step: poll, then `log_step`) with the rollout service's BackgroundValidation,
    the real sink (metrics.jsonl, wandb offline, TensorBoard through verl's Tracking) and the progress line. Each
    validation is released by an event between two steps, so what is asserted does not depend on timing."""
    _offline_trackers(monkeypatch, tmp_path)
    cfg = OmegaConf.create(
        {"trainer": {"logger": ["console", "wandb", "tensorboard"], "project_name": "p", "experiment_name": "e"}}
    )
    sink = MetricsSink(cfg, tmp_path)
    out = io.StringIO()
    progress = Progress(6, Console(file=out, force_terminal=False, width=200))
    test_freq, total = 2, 6

    async def scenario() -> None:
        validations = BackgroundValidation()
        released = {2: asyncio.Event(), 4: asyncio.Event()}

        def validation_of(step: int):
            async def validate() -> dict[str, float]:
                await released[step].wait()
                return {"val/accuracy": step / 10, "val/step": float(step)}

            return validate

        for step in range(1, total + 1):
            if step == 3:  # the validation of step 2 finishes between steps 2 and 3, before the next is due
                released[2].set()
                await validations.wait()
            due = step % test_freq == 0 and step != total
            started, finished = validations.poll(validation_of(step) if due else None)
            assert started == due
            await asyncio.sleep(0)  # the started validation runs up to its wait, as in the service's event loop
            progress.update(step, log_step(sink, step, {"reward/mean": step / 100}, finished))
        # Run.stop: the validation of step 4, still running at the last step, then the final one (step 6)
        released[4].set()
        for result in await validations.drain():
            sink.log_validation(total, result)
        sink.log_validation(total, {"val/accuracy": 0.9}, extra={"ledger/trained": 48.0})

    asyncio.run(scenario())
    progress.close()
    sink.close()

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    vals = [(r["step"], r.get("val/logged_at_step"), r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    assert vals == [(2, 3.0, 0.2), (4, 6.0, 0.4), (6, None, 0.9)]  # at the step measured, with when it was logged
    lines = out.getvalue().splitlines()
    assert "val" not in lines[1] and "val 20.0%@2" in lines[2]  # shown at step 3, the first step after it finished

    wandb_file = offline_run_file(tmp_path)
    assert step_metrics(wandb_file)["val/*"] == "val/step"
    logged = history(wandb_file)
    assert [r["_step"] for r in logged if "reward/mean" in r] == [1, 2, 3, 4, 5, 6]  # training: nothing refused
    # every validation kept, each in the row it was logged at and drawn at the step it measured (val/step)
    assert [(r["_step"], r["val/step"], r["val/accuracy"]) for r in logged if "val/accuracy" in r] == [
        (3, 2, 0.2),
        (6, 4, 0.4),
        (7, 6, 0.9),  # the final validation, logged at step 6 too, takes the next row rather than overwrite
    ]
    # TensorBoard takes any step: there each validation is at the step it measured
    assert _tensorboard_points(tmp_path / "tb", "val/accuracy") == [(2, 0.2), (4, 0.4), (6, 0.9)]


@pytest.fixture(scope="module")
def validation_run(tmp_path_factory, addition_cache):
    """A 10-step CLI run validating every 2 steps beside training, logging to wandb offline through verl's Tracking
    (`trainer.logger=[console,wandb]`): (run dir, wandb dir, the run's stdout)."""
    root = tmp_path_factory.mktemp("validation_run")
    run_dir, wandb_dir = root / "run", root / "wandb_dir"
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
        "trainer.logger=[console,wandb]",
    )
    env = dict(os.environ, RLLM_LOG_LEVEL="WARNING", WANDB_MODE="offline", WANDB_DIR=str(wandb_dir))
    env |= {"WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}
    wandb_dir.mkdir()
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return run_dir, wandb_dir, proc.stdout


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_trainer_steps_while_a_validation_runs_and_every_answer_comes_from_the_pinned_version(validation_run):
    run_dir, _, _ = validation_run
    rows = _rows(run_dir)
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


@pytest.mark.slow
def test_every_validation_is_logged_by_the_step_after_it_finished_and_wandb_keeps_each_at_its_step(validation_run):
    """Read back from the run's own files: metrics.jsonl, the progress lines and the offline wandb run."""
    run_dir, wandb_dir, stdout = validation_run
    rows = _rows(run_dir)
    step_rows = {int(r["trainer/step"]): r for r in rows if "trainer/step" in r}
    mid_run = [r for r in rows if "val/logged_at_step" in r]
    # The first (step 2) is always started: nothing runs before it. A later one may be skipped (warned) if its
    # predecessor still runs, so only the ones started are expected: those in metrics.jsonl.
    assert [r["val/step"] for r in mid_run][:1] == [2.0]
    for val in mid_run:
        logged_at = int(val["val/logged_at_step"])
        # the first step logged after the validation finished (the driver collects before it writes the step)
        after = [s for s, r in sorted(step_rows.items()) if r["time"] >= val["val/finished_at"]]
        if after:
            assert logged_at <= after[0] + 1, f"finished before step {after[0]}'s line, logged at {logged_at}: {val}"
        else:  # finished after the last step's line: collected at the end of the run
            assert logged_at == max(step_rows)
        # on the progress line of the step it was logged at, or (collected after the last step) on a line after it
        shown = f"val {val['val/accuracy']:.1%}@{val['val/step']:.0f}"
        lines = stdout.splitlines()
        at = next(i for i, line in enumerate(lines) if re.match(rf"step +{logged_at}/10 ", line))
        assert shown in lines[at] or (
            logged_at == 10 and any(f"validation finished after the last step: {shown}" in x for x in lines[at:])
        ), (shown, lines[at:])

    wandb_file = offline_run_file(wandb_dir)
    assert step_metrics(wandb_file)["val/*"] == "val/step"
    logged = history(wandb_file)
    assert [r["_step"] for r in logged if "reward/mean" in r] == sorted(step_rows)  # no training row refused
    in_wandb = [(r["val/step"], r["val/accuracy"]) for r in logged if "val/accuracy" in r]
    in_jsonl = [(r.get("val/step", r["step"]), r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    # every validation, the initial (step 0), each mid-run one and the final (step 10), with the step it measured
    assert in_wandb == in_jsonl and in_wandb[0][0] == 0 and in_wandb[-1][0] == 10
    assert {s for s, _ in in_wandb} >= {float(r["val/step"]) for r in mid_run} and len(mid_run) >= 1
