"""Replay: a run's batch record (run.record_batches) re-runs its training bit for bit, or says where it differs.

The fast tests drive the record's writer and reader directly: every float of a batch comes back exactly, a resume
cuts the record at its checkpoint, and a damaged or incomplete record is refused in one line naming the file. The
slow ones train for real through the CLI (with a SIGKILL and a resume in the middle, and with LoRA), replay the run
directory and compare the per-step losses with metrics.jsonl and the weights with the checkpoints. Two trainer ranks
killed, resumed and replayed: test_resume.py's two-rank case.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from test_resume import _command, _learned_by, _replay, _sigkill_tree, _start, _wait_for_line

from rllm.experimental.fully_async.api.trajectory import (
    TrajectoryStatus,
    VersionedGroup,
    VersionedSequence,
    VersionedTrajectory,
)
from rllm.experimental.fully_async.runtime.checkpoints.trainer_state import capture_rng_state
from rllm.experimental.fully_async.runtime.trainer.record import (
    BatchRecorder,
    Record,
    RecordError,
    open_record,
    recorded_steps,
    step_file,
)
from rllm.experimental.fully_async.runtime.trainer.replay import ReplayMismatch, compare_step, is_compared, same_bits


class _Backend:  # the recorder asks a world-size-1 backend for nothing but its device
    device = "cpu"


def _group(prompt_uid: str, rewards: list[float]) -> VersionedGroup:
    trajectories = []
    for index, reward in enumerate(rewards):
        sequence = VersionedSequence(
            prompt_ids=[3, 4, 5],
            response_ids=[7, 8, 1],
            # log-probs as the engine's JSON gives them: float32 values read as Python floats, and one that is not
            response_logprobs=[float(torch.tensor(-0.1234567).item()), -2.000000000000001, -1e-30],
            response_versions=[2, 2, 3],
            num_resumes=1,
        )
        trajectories.append(
            VersionedTrajectory(f"{prompt_uid}/{index}", prompt_uid, [sequence], reward=reward, step_rewards=[reward])
        )
    trajectories[-1].status = TrajectoryStatus.FAILED
    trajectories[-1].failure_reason = "reward_timeout"
    return VersionedGroup(prompt_uid, trajectories, data_source="addition")


def _record(run_dir: Path, start_step: int = 0, resumed_from: Path | None = None, model: Path | None = None):
    model = model or run_dir / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "model.safetensors").write_bytes(b"weights")
    return open_record(
        run_dir, {"run": {"seed": 1}}, start_step=start_step, resumed_from=resumed_from, model_path=str(model)
    )


def test_a_recorded_step_comes_back_with_every_float_and_the_rng_state_it_had(tmp_path):
    target = _record(tmp_path)
    groups = [_group("e0/1", [1.0, 0.1 + 0.2]), _group("e0/2", [0.0, 1e-300])]
    torch.manual_seed(123)
    before = capture_rng_state()
    BatchRecorder(target, _Backend()).write(7, 3, groups)
    torch.rand(5)  # draws after the write do not change what was recorded

    step = Record(tmp_path).load(7)
    assert (step.step, step.segment, step.version, step.threads) == (7, 0, 3, torch.get_num_threads())
    assert step.groups == groups, "token ids, log-probs, versions, rewards, statuses: all exactly as taken"
    assert step.groups[0].trajectories[1].reward == 0.1 + 0.2  # not rounded through float32 or text
    assert torch.equal(step.rng["process"]["torch"], before["torch"])
    assert step.rng["ranks"] is None


def test_a_fresh_start_records_the_hash_of_the_weights_it_starts_from(tmp_path):
    _record(tmp_path)
    lines = [json.loads(x) for x in (tmp_path / "record" / "segments.jsonl").read_text().splitlines()]
    assert lines[0]["start_step"] == 0 and lines[0]["resumed_from"] is None
    assert lines[0]["initial_weights"]["files"]["model.safetensors"] == hashlib.sha256(b"weights").hexdigest()
    assert lines[0]["config"] == {"run": {"seed": 1}}


def test_a_resume_cuts_the_record_at_its_checkpoint_and_starts_a_segment(tmp_path):
    first = _record(tmp_path)
    recorder = BatchRecorder(first, _Backend())
    for step in range(1, 6):
        recorder.write(step, step // 2, [_group(f"e0/{step}", [1.0, 0.0])])
    second = _record(tmp_path, start_step=3, resumed_from=tmp_path / "checkpoints" / "step_00000003")
    assert second.segment == 1
    assert recorded_steps(tmp_path / "record") == [1, 2, 3], "steps 4 and 5 are trained again after the resume"
    BatchRecorder(second, _Backend()).write(4, 1, [_group("e0/9", [0.0, 0.0])])
    record = Record(tmp_path)
    assert [record.load(s).segment for s in record.steps] == [0, 0, 0, 1]
    assert record.segments[1].start_step == 3 and record.segments[1].initial_weights is None


def test_a_damaged_or_incomplete_record_is_refused_in_one_line_naming_the_file(tmp_path):
    with pytest.raises(RecordError, match=r"has no batch record .*run.record_batches=true"):
        Record(tmp_path)
    recorder = BatchRecorder(_record(tmp_path), _Backend())
    for step in (1, 2, 3):
        recorder.write(step, 0, [_group(f"e0/{step}", [1.0, 0.0])])
    path = step_file(tmp_path / "record", 2)
    path.write_bytes(path.read_bytes()[:100])  # truncated
    with pytest.raises(RecordError) as damaged:
        Record(tmp_path).load(2)
    message = str(damaged.value)
    assert "00000002.pt is damaged" in message and "cannot be replayed past step 1" in message
    assert "\n" not in message
    path.unlink()
    with pytest.raises(RecordError, match=r"no file for step 2 .*holds 1\.\.3.*cannot be replayed past step 1"):
        Record(tmp_path)


def test_a_step_file_of_another_step_or_segment_is_refused(tmp_path):
    recorder = BatchRecorder(_record(tmp_path), _Backend())
    recorder.write(1, 0, [_group("e0/1", [1.0, 0.0])])
    recorder.write(2, 0, [_group("e0/2", [1.0, 0.0])])
    shutil.copy(step_file(tmp_path / "record", 1), step_file(tmp_path / "record", 2))
    with pytest.raises(RecordError, match="holds step 1, not 2"):
        Record(tmp_path).load(2)


def test_steps_compare_bit_for_bit_and_name_the_first_quantity_that_differs():
    logged = {"actor/pg_loss": 0.25, "actor/ppo_kl": float("nan"), "timing/update_s": 1.0, "trainer/version": 3.0}
    assert compare_step(5, logged, {"actor/pg_loss": 0.25, "actor/ppo_kl": float("nan"), "trainer/version": 3.0}) == 3
    with pytest.raises(
        ReplayMismatch, match=r"step 5: actor/pg_loss differs: logged 0.25, replayed 0.25000000000000006"
    ):
        compare_step(5, logged, {"actor/pg_loss": 0.25000000000000006, "actor/ppo_kl": float("nan")})
    assert not is_compared("timing/update_s") and is_compared("advantages/adv_mean") and is_compared("actor/lr")
    assert same_bits(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, float("nan")]))
    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0])), "bitwise, not numerically, equal"
    assert not same_bits(torch.tensor([1.0]), torch.tensor([1.0 + 2**-23]))


# ---- end to end: a real run, killed and resumed, replayed -------------------------------------------------------

RUN_STEPS = 6
# The default's warm-up (tasks/addition.py WARMUP_STEPS: 43% held out, greedy), not the session's quick one (60 steps:
# 0.9%), on which 6-step runs had no gradient at any step (no sample right): the weights then never move and any
# replay "matches". Sampled at temperature 1 it is right 3-9% of the time, enough for most steps to have a gradient;
# each run checks that some did (`_learned_by`).


def test_replay_of_a_run_without_a_record_says_how_to_keep_one_and_exits_2(tmp_path):
    """The CLI on a run directory trained without `run.record_batches`: one line naming the folder and the key."""
    replayed = _replay(tmp_path)
    assert replayed.returncode == 2, replayed.stderr[-2000:]
    lines = replayed.stderr.strip().splitlines()
    assert len(lines) == 1, replayed.stderr
    assert str(tmp_path) in lines[0] and "no batch record" in lines[0] and "run.record_batches=true" in lines[0]


@pytest.fixture(scope="module")
def small_task(addition_cache, tmp_path_factory):
    """The addition task's model and 40 of its prompts (the resume tests' shape: 8 groups of 4 a step)."""
    from rllm.experimental.fully_async.tasks.addition import WARMUP_STEPS, prepare_addition_assets

    assets = prepare_addition_assets(addition_cache, seed=0, warmup_steps=WARMUP_STEPS)
    root = tmp_path_factory.mktemp("replay_data")
    train, val = root / "train.parquet", root / "val.parquet"
    pd.read_parquet(assets.train_parquet).head(40).to_parquet(train, index=False)
    pd.read_parquet(assets.val_parquet).head(16).to_parquet(val, index=False)
    return assets.model_dir, train, val


@pytest.fixture(scope="module")
def resumed_run(small_task, tmp_path_factory):
    """A recorded run of 6 steps (a checkpoint every 2), SIGKILLed after step 3 and resumed from step 2 to the end."""
    model_dir, train, val = small_task
    root = tmp_path_factory.mktemp("replay")
    run_dir = root / "run"
    command = _command(
        model_dir,
        train,
        val,
        run_dir,
        f"trainer.total_training_steps={RUN_STEPS}",
        "trainer.save_freq=2",
        "run.record_batches=true",
    )
    first = _start(command, root)
    _wait_for_line(first, "step    3/", timeout_s=400)
    _sigkill_tree(first)
    second = _start(command, root)
    output, _ = second.communicate(timeout=600)
    assert second.returncode == 0, output[-3000:]
    assert "resumed from" in output and "step_00000002" in output, output[-3000:]
    return run_dir


@pytest.mark.slow
def test_a_killed_and_resumed_run_replays_bit_for_bit_across_its_resume(resumed_run):
    assert _learned_by(resumed_run, 4), "no step had a gradient: the weights never moved, nothing to check"
    replayed = _replay(resumed_run)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr[-3000:]
    lines = replayed.stdout.splitlines()
    ranges = [line for line in lines if line.startswith("steps ")]
    assert ranges[0].startswith("steps 1-2 (segment 0, fresh start):"), lines
    assert ranges[1].startswith("steps 3-4 (segment 1, resumed from step_00000002):"), lines
    assert ranges[2].startswith("steps 5-6 (segment 1, resumed from step_00000002):"), lines
    assert all("equal bit for bit" in line for line in ranges)
    # every logged step compared its losses (33 quantities a step on this config; none skipped)
    assert all(" over 2 logged steps " in line for line in ranges), ranges
    weights = [line for line in lines if line.startswith("weights at step")]
    assert [line.split()[3] for line in weights] == ["4", "6"], "the two checkpoints the run kept"
    assert all("equal bit for bit" in line for line in weights)
    assert lines[-1].startswith(f"replay: {RUN_STEPS} steps bit for bit")
    # the record cut the steps the killed run trained after its checkpoint: one history, two segments
    record = Record(resumed_run)
    assert [record.load(step).segment for step in record.steps] == [0, 0, 1, 1, 1, 1]


@pytest.mark.slow
def test_a_changed_batch_is_named_by_its_step_and_quantity(resumed_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(resumed_run, copy)
    path = step_file(copy / "record", 5)
    doc = torch.load(path, weights_only=True)
    doc["groups"][0]["trajectories"][0]["sequences"][0]["response_logprobs"][0] += 1e-6  # one token, one ulp-ish
    torch.save(doc, path)
    replayed = _replay(copy)
    assert replayed.returncode == 1
    assert replayed.stderr.strip().startswith("MISMATCH step 5: "), replayed.stderr[-2000:]
    assert " differs: logged " in replayed.stderr and len(replayed.stderr.strip().splitlines()) == 1
    assert "steps 3-4 (segment 1" in replayed.stdout, "what was equal before it is still said"


@pytest.mark.slow
def test_a_damaged_record_or_changed_initial_weights_give_one_line_and_exit_2(resumed_run, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(resumed_run, damaged)
    path = step_file(damaged / "record", 3)
    path.write_bytes(path.read_bytes()[:200])
    replayed = _replay(damaged)
    assert replayed.returncode == 2
    assert replayed.stderr.strip().splitlines() == [
        f"error: {path} is damaged ({replayed.stderr.split('is damaged (')[1].split(')')[0]}): the record cannot be "
        "replayed past step 2"
    ]

    moved = tmp_path / "moved"
    shutil.copytree(resumed_run, moved)
    segments = moved / "record" / "segments.jsonl"
    lines = [json.loads(line) for line in segments.read_text().splitlines()]
    name = next(iter(lines[0]["initial_weights"]["files"]))
    lines[0]["initial_weights"]["files"][name] = "0" * 64  # the run started from other weights than the folder's now
    segments.write_text("".join(json.dumps(line) + "\n" for line in lines))
    replayed = _replay(moved)
    assert replayed.returncode == 2
    assert replayed.stderr.strip().endswith(
        f"{name} has changed (sha256 {replayed.stderr.split('sha256 ')[1][:12]}, "
        "was 000000000000): replay needs the weights the run started from"
    )


@pytest.mark.slow
def test_a_lora_run_replays_bit_for_bit(small_task, tmp_path):
    """LoRA (actor_rollout_ref.model.lora_rank): the replay rebuilds peft's adapter over the frozen base from the
    run's config and re-trains the recorded batches; losses equal the logged ones and the checkpoint (adapter,
    its moments, the LR schedule) the replayed one, bit for bit."""
    model_dir, train, val = small_task
    run_dir = tmp_path / "run"
    command = _command(
        model_dir,
        train,
        val,
        run_dir,
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.actor.optim.lr=5e-3",
        "run.record_batches=true",
    )
    run = _start(command, tmp_path)
    output, _ = run.communicate(timeout=600)
    assert run.returncode == 0, output[-3000:]
    assert _learned_by(run_dir, 4), "no step had a gradient: the adapter never moved, nothing to check"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["lora/adapter_max_version"] >= 0 for r in rows if "trainer/step" in r)  # a LoRA run's batches
    replayed = _replay(run_dir)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr[-3000:]
    lines = replayed.stdout.splitlines()
    assert any(line.startswith("steps 1-2 (segment 0, fresh start):") and "equal bit for bit" in line for line in lines)
    weights = [line for line in lines if line.startswith("weights at step")]
    assert [line.split()[3] for line in weights] == ["2", "4"] and all("equal bit for bit" in w for w in weights)
    assert lines[-1].startswith("replay: 4 steps bit for bit"), lines
