"""The checkpoint store: lossless round trip, retention, atomicity under real crashes, damage reporting, resume modes.

The crash tests run a real child process that saves a checkpoint and dies part-way: SIGKILL while it is parked
inside a chosen system call of the save (reached through a hook the child installs on `os.fsync`/`os.rename`),
or the kernel's SIGXFSZ in the middle of writing the weights file (a file-size limit). The parent then checks,
with the real store, that the previous checkpoint is still the latest and still loads.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from verl.utils.torch_functional import get_cosine_schedule_with_warmup

from rllm.experimental.fully_async.api.trajectory import (
    TrajectoryStatus,
    VersionedGroup,
    VersionedSequence,
    VersionedTrajectory,
)
from rllm.experimental.fully_async.runtime.checkpoints.format import (
    COMPLETE_MARKER,
    FORMAT_VERSION,
    QUEUE_FILE,
    ROLLOUT_FILE,
    TRAINER_FILE,
)
from rllm.experimental.fully_async.runtime.checkpoints.store import (
    CheckpointError,
    CheckpointManager,
    config_hash,
    find_resume_checkpoint,
)
from rllm.experimental.fully_async.runtime.checkpoints.trainer_state import capture_rng_state, restore_rng_state

REPO_ROOT = Path(__file__).resolve().parents[2]


# ---- builders ------------------------------------------------------------------------------------------------------


def make_policy(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """A small model, AdamW and verl's cosine schedule, as the FSDP backend builds them (world size 1)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=20)
    return model, optimizer, scheduler


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(5, 8, generator=generator)
    loss = model(inputs).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()


def trainer_part(model, optimizer, scheduler, step: int) -> dict:
    """What the trainer hands to save: the backend's state_dict shape, step, version and RNG states."""
    return {
        "backend": {
            "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": scheduler.state_dict(),
            "optimizer_steps": step,
        },
        "step": step,
        "version": step // 2,
        "rng": capture_rng_state(),
    }


def make_queue() -> list[VersionedGroup]:
    multi_turn = VersionedTrajectory(
        uid="p1/0",
        prompt_uid="p1",
        sequences=[
            VersionedSequence([1, 2], [3, 4, 5], [-0.5, -1.25, -0.1], [3, 3, 4], loss_mask=[1, 0, 1], num_resumes=1),
            VersionedSequence([1, 2, 3, 4, 5], [6], [-2.0], [4], finish_reason="length"),
        ],
        reward=1.0,
        step_rewards=[0.0, 1.0],
        step_state_hashes=["a1", "b2"],
        metadata={"reward_extra": {"acc": 1.0, "notes": ["x", None]}, "turns": 2},
        created_at=1234.5,
    )
    failed = VersionedTrajectory(
        uid="p1/1",
        prompt_uid="p1",
        sequences=[VersionedSequence([1, 2], [7], [-math.inf], [3])],
        status=TrajectoryStatus.FAILED,
        failure_reason="reward_error: ZeroDivisionError",
    )
    single = VersionedTrajectory(
        uid="p2/0", prompt_uid="p2", sequences=[VersionedSequence([9], [8, 1], [-0.3, -0.01], [5, 5])]
    )
    return [
        VersionedGroup("p1", [multi_turn, failed], data_source="addition", metadata={"k": [1, 2]}),
        VersionedGroup("p2", [single], created_at=99.0),
    ]


def rollout_part(step: int) -> dict:
    return {
        "version": step // 2,
        "prompts": {"seed": 7, "shuffle": True, "dataset_size": 100, "epoch": 0, "position": 10 + step},
        "ledger": {
            "version": 2,
            "in_flight": ["p3"],
            "issued": 3,
            "ended": {"trained": 2},
            "journal_path": "/runs/demo/ledger.jsonl",
            "journal_bytes": 72,
        },
        "staleness": {"accepted": 5, "consumed": 3, "rejected": 0, "discarded": 0, "started": 6},
    }


def save_simple(manager: CheckpointManager, step: int, fill: float = 0.0) -> Path:
    return manager.save(
        step,
        trainer={"weights": torch.full((4,), fill), "step": step},
        rollout={"step": step},
        queue=[],
        meta={"version": step},
    )


def rewrite_part(checkpoint: Path, name: str, data: bytes) -> None:
    """Replace one file and fix up the manifest, so the damage reaches the part's own decoder."""
    import hashlib

    (checkpoint / name).write_bytes(data)
    marker = json.loads((checkpoint / COMPLETE_MARKER).read_text())
    marker["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / COMPLETE_MARKER).write_text(json.dumps(marker))


class NotAllowedInWeightsOnly:
    """A class torch.load(weights_only=True) must refuse to construct."""


def assert_state_equal(actual, expected, where: str = "state") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), where
        for key in expected:
            assert_state_equal(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_state_equal(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, where


# ---- round trip --------------------------------------------------------------------------------------------------


def test_round_trip_restores_every_part(tmp_path):
    model, optimizer, scheduler = make_policy()
    for seed in range(3):
        train_step(model, optimizer, scheduler, seed)
    trainer = trainer_part(model, optimizer, scheduler, step=3)
    queue = make_queue()
    manager = CheckpointManager(tmp_path / "ckpt")
    meta = {"version": 1, "config_hash": config_hash({"a": 1})}

    path = manager.save(3, trainer=trainer, rollout=rollout_part(3), queue=queue, meta=meta)
    loaded = manager.load(path)

    assert path == tmp_path / "ckpt" / "step_00000003"
    assert loaded.step == 3 and loaded.path == path
    assert_state_equal(loaded.trainer, trainer, "trainer")
    assert loaded.rollout == rollout_part(3)
    assert loaded.queue == queue  # dataclass equality: every field, nested sequences included
    for group in loaded.queue:
        for trajectory in group.trajectories:
            assert type(trajectory.status) is TrajectoryStatus
            assert all(type(s) is VersionedSequence for s in trajectory.sequences)
    assert loaded.queue[0].trajectories[1].status is TrajectoryStatus.FAILED
    assert loaded.queue[0].trajectories[0].sequences[0].loss_mask == [1, 0, 1]
    assert loaded.queue[0].trajectories[1].sequences[0].response_logprobs == [-math.inf]
    assert loaded.meta["version"] == 1 and loaded.meta["config_hash"] == meta["config_hash"]
    assert loaded.meta["format_version"] == FORMAT_VERSION and loaded.meta["step"] == 3
    assert isinstance(loaded.meta["saved_at"], float)


def test_restored_optimizer_and_schedule_continue_identically(tmp_path):
    model, optimizer, scheduler = make_policy(seed=1)
    for seed in range(3):
        train_step(model, optimizer, scheduler, seed)
    manager = CheckpointManager(tmp_path)
    path = manager.save(3, trainer=trainer_part(model, optimizer, scheduler, 3), rollout={}, queue=[], meta={})

    restored_model, restored_optimizer, restored_scheduler = make_policy(seed=2)  # different init on purpose
    backend = manager.load(path).trainer["backend"]
    restored_model.load_state_dict(backend["model"])
    restored_optimizer.load_state_dict(backend["optimizer"])
    restored_scheduler.load_state_dict(backend["lr_scheduler"])
    for seed in (10, 11):
        train_step(model, optimizer, scheduler, seed)
        train_step(restored_model, restored_optimizer, restored_scheduler, seed)

    assert restored_scheduler.get_last_lr() == scheduler.get_last_lr()
    for (name, expected), actual in zip(model.state_dict().items(), restored_model.state_dict().values(), strict=True):
        assert torch.equal(actual, expected), name


def test_rng_restore_repeats_the_same_draws_after_a_save_and_load(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's state, which must come back too
    manager = CheckpointManager(tmp_path)
    path = manager.save(1, trainer={"rng": capture_rng_state()}, rollout={}, queue=[], meta={})

    def draws() -> tuple:
        return random.random(), random.gauss(0, 1), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()

    first = draws()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert draws() != first
    restore_rng_state(manager.load(path).trainer["rng"])
    assert draws() == first


# ---- retention and discovery --------------------------------------------------------------------------------------


def test_retention_keeps_the_newest_complete_checkpoints(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in range(1, 5):
        save_simple(manager, step)
    assert [p.name for p in manager.complete_checkpoints()] == ["step_00000003", "step_00000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]  # no debris left

    only_one = CheckpointManager(tmp_path / "one", keep_last=1)
    save_simple(only_one, 5)
    save_simple(only_one, 6)
    assert [p.name for p in only_one.complete_checkpoints()] == ["step_00000006"]
    assert only_one.load(only_one.latest()).step == 6


def test_keep_last_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)


def test_latest_ignores_half_written_directories_and_next_save_cleans_them(tmp_path):
    manager = CheckpointManager(tmp_path)
    assert manager.latest() is None
    save_simple(manager, 2)
    half = tmp_path / "step_00000009"  # e.g. an interrupted copy: files but no marker
    half.mkdir()
    (half / TRAINER_FILE).write_bytes(b"partial")
    leftover = tmp_path / ".tmp-step_00000003-123-abcd"
    leftover.mkdir()
    (leftover / TRAINER_FILE).write_bytes(b"partial")

    assert manager.latest() == tmp_path / "step_00000002"
    with pytest.raises(CheckpointError, match="incomplete"):
        manager.load(half)
    save_simple(manager, 3)
    assert not leftover.exists()
    assert manager.latest() == tmp_path / "step_00000003"


def test_saving_an_existing_step_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 4, fill=1.0)
    path = save_simple(manager, 4, fill=2.0)
    assert torch.equal(manager.load(path).trainer["weights"], torch.full((4,), 2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004"]


def test_saving_an_older_step_sets_newer_checkpoints_of_the_abandoned_run_aside(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        save_simple(manager, step, fill=float(step))
    # a run resumed from step 1 saves step 2 again: auto-resume must now find this run, not the old step 3
    save_simple(manager, 2, fill=20.0)
    assert manager.latest() == tmp_path / "step_00000002"
    assert torch.equal(manager.load(manager.latest()).trainer["weights"], torch.full((4,), 20.0))
    abandoned = [p for p in tmp_path.iterdir() if p.name.startswith("abandoned-step_00000003")]
    assert len(abandoned) == 1 and manager.load(abandoned[0]).step == 3  # kept, and still loadable


# ---- save-time validation -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parts", "where"),
    [
        ({"trainer": {"backend": {"extra": np.zeros(2)}}}, r"trainer\['backend'\]\['extra'\]"),
        ({"trainer": {"w": torch.zeros(1), "fn": frozenset()}}, r"trainer\['fn'\]"),
        ({"rollout": {"position": (1, 2)}}, r"rollout\['position'\]"),
        ({"rollout": {"counts": {3: 1}}}, r"non-string key 3"),
        ({"meta": {"version": np.int64(3)}}, r"meta\['version'\]"),
    ],
)
def test_values_that_would_not_come_back_unchanged_are_rejected_before_writing(tmp_path, parts, where):
    args = {"trainer": {}, "rollout": {}, "queue": [], "meta": {}} | parts
    with pytest.raises(TypeError, match=where):
        CheckpointManager(tmp_path / "ckpt").save(1, **args)
    assert not (tmp_path / "ckpt").exists()


def test_queue_metadata_that_json_would_change_is_rejected_with_its_place(tmp_path):
    queue = make_queue()
    queue[1].trajectories[0].metadata["pair"] = (1, 2)
    with pytest.raises(TypeError, match=r"queue\[1\]\['trajectories'\]\[0\]\['metadata'\]\['pair'\]"):
        CheckpointManager(tmp_path).save(1, trainer={}, rollout={}, queue=queue, meta={})


# ---- damage ------------------------------------------------------------------------------------------------------


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "file", "message"),
    [
        (lambda p: _truncate(p / TRAINER_FILE), TRAINER_FILE, "damaged"),
        (lambda p: _flip_byte(p / QUEUE_FILE), QUEUE_FILE, "sha256"),
        (lambda p: (p / COMPLETE_MARKER).write_text("{not json"), COMPLETE_MARKER, "not valid JSON"),
        (lambda p: rewrite_part(p, ROLLOUT_FILE, b'{"position": 1'), ROLLOUT_FILE, "not valid JSON"),
        (lambda p: rewrite_part(p, QUEUE_FILE, b'[{"prompt_uid": "p", "bogus": 1}]'), QUEUE_FILE, "bogus"),
        (lambda p: (p / TRAINER_FILE).unlink(), TRAINER_FILE, "cannot be read"),
    ],
    ids=["truncated-weights", "flipped-queue-byte", "bad-marker", "bad-rollout-json", "unknown-field", "missing"],
)
def test_damaged_checkpoint_raises_one_line_error_naming_the_file(tmp_path, damage, file, message):
    manager = CheckpointManager(tmp_path)
    path = manager.save(1, trainer={"w": torch.arange(1000.0)}, rollout={"a": 1}, queue=make_queue(), meta={})
    damage(path)
    with pytest.raises(CheckpointError, match=message) as excinfo:
        manager.load(path)
    text = str(excinfo.value)
    assert str(path / file) in text and "\n" not in text


def test_trainer_file_with_arbitrary_objects_is_refused_not_executed(tmp_path):
    manager = CheckpointManager(tmp_path)
    path = save_simple(manager, 1)
    import io

    buffer = io.BytesIO()
    torch.save({"evil": NotAllowedInWeightsOnly()}, buffer)
    rewrite_part(path, TRAINER_FILE, buffer.getvalue())
    with pytest.raises(CheckpointError, match=f"{TRAINER_FILE} cannot be loaded"):
        manager.load(path)


def test_newer_format_is_refused(tmp_path):
    manager = CheckpointManager(tmp_path)
    path = save_simple(manager, 1)
    marker = json.loads((path / COMPLETE_MARKER).read_text())
    marker["format_version"] = FORMAT_VERSION + 1
    (path / COMPLETE_MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match="format_version"):
        manager.load(path)


def save_with_shard(manager: CheckpointManager, step: int, shard_name: str = "policy_shards/__0_0.distcp") -> Path:
    """A checkpoint whose trainer part has a file beside trainer.pt, as the policy's shards are (begin/commit, as
    the run writes them; runtime/checkpoints/trainer_state.py)."""
    from rllm.experimental.fully_async.runtime.checkpoints.format import (
        manifest_entry,
        write_bytes,
        write_rollout_part,
        write_trainer_part,
    )

    tmp = manager.begin(step)
    (tmp / "policy_shards").mkdir()
    data = bytes(range(256)) * 16
    write_bytes(tmp / "policy_shards" / "__0_0.distcp", data)
    files = {shard_name: manifest_entry(data)}
    files |= write_trainer_part(tmp, {"backend": {"shards": "policy_shards", "world_size": 1}, "step": step})
    files |= write_rollout_part(tmp, {"step": step}, [])
    return manager.commit(tmp, step, files, {"version": step})


def test_a_damaged_or_missing_policy_shard_is_named_when_the_checkpoint_loads(tmp_path):
    manager = CheckpointManager(tmp_path)
    path = save_with_shard(manager, 1)
    assert manager.load(path).trainer["backend"]["shards"] == "policy_shards"
    shard = path / "policy_shards" / "__0_0.distcp"
    _flip_byte(shard)
    with pytest.raises(CheckpointError, match="sha256") as excinfo:
        manager.load(path)
    assert str(shard) in str(excinfo.value) and "\n" not in str(excinfo.value)
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard} cannot be read"):
        manager.load(path)


@pytest.mark.parametrize("name", ["../outside.bin", "/etc/passwd", "policy_shards/../../x", ""])
def test_a_manifest_naming_a_file_outside_the_checkpoint_is_refused(tmp_path, name):
    manager = CheckpointManager(tmp_path)
    path = save_with_shard(manager, 1, shard_name=name)
    with pytest.raises(CheckpointError, match="not a file inside the checkpoint") as excinfo:
        manager.load(path)
    assert "\n" not in str(excinfo.value)


def test_a_first_format_checkpoint_still_loads(tmp_path):
    """This round's first format (the full trainer state in trainer.pt) is read; resuming it is
    runtime/checkpoints/trainer_state.py's call (tests/runtime/test_trainer_ranks.py)."""
    manager = CheckpointManager(tmp_path)
    path = save_simple(manager, 1)
    meta = json.loads((path / "meta.json").read_text())
    rewrite_part(path, "meta.json", json.dumps(meta | {"format_version": 1}).encode())
    marker = json.loads((path / COMPLETE_MARKER).read_text())
    (path / COMPLETE_MARKER).write_text(json.dumps(marker | {"format_version": 1}))
    assert FORMAT_VERSION == 2
    loaded = manager.load(path)
    assert loaded.meta["format_version"] == 1 and torch.equal(loaded.trainer["weights"], torch.zeros(4))


def test_damaged_newest_checkpoint_is_an_error_not_a_silent_fallback(tmp_path):
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 1)
    newest = save_simple(manager, 2)
    _truncate(newest / TRAINER_FILE)
    resume = find_resume_checkpoint(tmp_path, "auto", None)
    assert resume == newest
    with pytest.raises(CheckpointError, match="step_00000002"):
        manager.load(resume)


# ---- resume modes ------------------------------------------------------------------------------------------------


def test_resume_auto_picks_newest_complete_or_none(tmp_path):
    assert find_resume_checkpoint(tmp_path / "missing", "auto", None) is None
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 1)
    save_simple(manager, 2)
    (tmp_path / "step_00000007").mkdir()  # incomplete: ignored
    assert find_resume_checkpoint(tmp_path, "auto", None) == tmp_path / "step_00000002"


def test_resume_disable_ignores_checkpoints_on_disk(tmp_path):
    save_simple(CheckpointManager(tmp_path), 1)
    assert find_resume_checkpoint(tmp_path, "disable", str(tmp_path / "step_00000001")) is None


def test_resume_path_returns_that_checkpoint_resolving_relative_paths(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 1)
    save_simple(manager, 2)
    monkeypatch.chdir(tmp_path)
    assert find_resume_checkpoint("elsewhere", "resume_path", "step_00000001") == tmp_path / "step_00000001"


@pytest.mark.parametrize(
    ("target", "message"),
    [(None, "needs trainer.resume_from_path"), ("nope", "does not exist"), ("half", "not a complete checkpoint")],
)
def test_resume_path_must_name_a_complete_checkpoint(tmp_path, target, message):
    (tmp_path / "half").mkdir()
    resume_from = None if target is None else str(tmp_path / target)
    with pytest.raises(CheckpointError, match=message):
        find_resume_checkpoint(tmp_path, "resume_path", resume_from)


def test_unknown_resume_mode_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="resume_mode"):
        find_resume_checkpoint(tmp_path, "latest", None)  # type: ignore[arg-type]


# ---- real crashes ------------------------------------------------------------------------------------------------

CRASHING_SAVER = textwrap.dedent(
    """
    import os, resource, signal, sys, time
    from pathlib import Path
    import torch
    from rllm.experimental.fully_async.runtime.checkpoints.store import CheckpointManager

    root, stage = Path(sys.argv[1]), sys.argv[2]
    manager = CheckpointManager(root, keep_last=2)

    def save(step, fill, numel):
        weights = torch.full((numel,), fill)
        manager.save(step, trainer={"weights": weights}, rollout={"step": step}, queue=[], meta={"fill": fill})

    save(1, 1.0, 16)  # the previous, complete checkpoint
    if stage == "replace":
        save(2, 2.0, 16)  # the copy a re-save of step 2 must not lose

    def park(what):
        sys.stdout.write(f"parked {what}\\n")
        sys.stdout.flush()
        time.sleep(600)  # the parent SIGKILLs us here

    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("trainer.pt"):
            park("fsync trainer.pt")  # written to the page cache, not yet on disk, nothing else written
        real_fsync(fd)

    def rename(src, dst):
        if Path(src).name.startswith(".tmp-"):
            park("commit rename")  # every file and the COMPLETE marker written, not yet renamed
        real_rename(src, dst)

    if stage == "fsync":
        os.fsync = fsync
    elif stage in ("commit", "replace"):
        os.rename = rename
    elif stage == "file_size_limit":
        # CPython ignores SIGXFSZ; restore the default so the kernel kills us in the middle of a write
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, resource.RLIM_INFINITY))
    save(2, 3.0, 8 << 20)  # 32 MiB of weights
    sys.stdout.write("finished\\n")
    """
)


def run_crashing_saver(tmp_path: Path, stage: str) -> tuple[int, str]:
    """Run the saver until it parks (then SIGKILL it) or dies on its own; return its exit code and last line."""
    script = tmp_path / "crashing_saver.py"
    script.write_text(CRASHING_SAVER)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "ckpt"), stage],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    watchdog = threading.Timer(120, proc.kill)  # a hung child fails the test instead of hanging it
    watchdog.start()
    try:
        line = proc.stdout.readline().strip()  # blocks until the child parks, or EOF when it dies
        if line.startswith("parked"):
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        stderr = proc.stderr.read()
    finally:
        watchdog.cancel()
        proc.stdout.close()
        proc.stderr.close()
    assert line != "finished", "the save completed: the crash was not mid-save"
    return proc.returncode, line or stderr[-2000:]


@pytest.mark.parametrize(
    ("stage", "signal_number", "parked"),
    [
        ("fsync", signal.SIGKILL, "parked fsync trainer.pt"),
        ("commit", signal.SIGKILL, "parked commit rename"),
        ("file_size_limit", signal.SIGXFSZ, None),
    ],
    ids=["sigkill-before-fsync", "sigkill-before-commit-rename", "sigxfsz-mid-weights-write"],
)
def test_crash_mid_save_leaves_the_previous_checkpoint_latest_and_loadable(tmp_path, stage, signal_number, parked):
    returncode, line = run_crashing_saver(tmp_path, stage)
    assert returncode == -signal_number, line
    if parked is not None:
        assert line == parked
    root = tmp_path / "ckpt"
    leftovers = [p for p in root.iterdir() if p.name.startswith(".tmp-step_00000002")]
    assert len(leftovers) == 1  # proof the crash hit the save of step 2
    if stage == "commit":
        assert (leftovers[0] / COMPLETE_MARKER).exists()  # fully written, only the commit was missing
    if stage == "file_size_limit":
        assert (leftovers[0] / TRAINER_FILE).stat().st_size == 4 << 20  # cut off mid-file
        assert not (leftovers[0] / COMPLETE_MARKER).exists()

    manager = CheckpointManager(root)
    assert manager.latest() == root / "step_00000001"
    loaded = manager.load(manager.latest())
    assert torch.equal(loaded.trainer["weights"], torch.full((16,), 1.0)) and loaded.rollout == {"step": 1}

    save_simple(manager, 2, fill=5.0)  # the next save works and clears the debris
    assert not leftovers[0].exists()
    assert manager.load(manager.latest()).step == 2


def test_crash_while_replacing_a_step_keeps_the_old_copy(tmp_path):
    returncode, line = run_crashing_saver(tmp_path, "replace")
    assert returncode == -signal.SIGKILL and line == "parked commit rename"
    root = tmp_path / "ckpt"
    assert not (root / "step_00000002").exists()  # killed between setting the old copy aside and the new one in

    manager = CheckpointManager(root)
    survivor = manager.latest()
    assert survivor is not None and survivor.name.startswith(".replaced-step_00000002")
    loaded = manager.load(survivor)
    assert loaded.step == 2 and loaded.meta["fill"] == 2.0  # the old copy, intact

    save_simple(manager, 3)  # the next save puts the old copy back under its name
    assert [p.name for p in manager.complete_checkpoints()] == ["step_00000002", "step_00000003"]
    assert manager.load(root / "step_00000002").meta["fill"] == 2.0
