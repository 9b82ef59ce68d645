"""Checkpoint, resume and shutdown, provoked for real: SIGKILL the whole run, resume it; Ctrl-C (SIGTERM while
training: test_startup_stop.py).

The runs train the addition task on a small prompt file (one epoch = a few steps) so a test can finish the
epoch and check, sample by sample in the run dir's ledger journal, that every prompt was trained exactly once
(the journal's audit refuses a second issue or end) and none was skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import psutil
import pytest
from run_helpers import QUICK_WARMUP_STEPS, leftover_processes

from rllm.experimental.fully_async.core.ledger_format import SampleState, history_counts
from rllm.experimental.fully_async.runtime.checkpoints.store import CheckpointManager
from rllm.experimental.fully_async.runtime.checkpoints.trainer_state import POLICY_SHARDS
from rllm.experimental.fully_async.runtime.rollout.ledger_journal import read_journal
from rllm.experimental.fully_async.runtime.trainer.record import Record
from rllm.experimental.fully_async.tasks.addition import WARMUP_STEPS, prepare_addition_assets

NUM_PROMPTS = 40
SAMPLES = 4
GROUPS_PER_STEP = 8


@pytest.fixture(scope="module")
def small_task(addition_cache, tmp_path_factory):
    return _small_task(addition_cache, tmp_path_factory, QUICK_WARMUP_STEPS)


@pytest.fixture(scope="module")
def warm_small_task(addition_cache, tmp_path_factory):
    """The same prompts on the default warm-up's model (test_replay's): it gets some sums right, so its groups have
    non-zero advantages and the weights move (a replay of weights that never moved would compare nothing)."""
    return _small_task(addition_cache, tmp_path_factory, WARMUP_STEPS)


def _small_task(addition_cache: Path, tmp_path_factory, warmup_steps: int) -> tuple[Path, Path, Path]:
    assets = prepare_addition_assets(addition_cache, seed=0, warmup_steps=warmup_steps)
    root = tmp_path_factory.mktemp("resume_data")
    train = root / "train.parquet"
    val = root / "val.parquet"
    pd.read_parquet(assets.train_parquet).head(NUM_PROMPTS).to_parquet(train, index=False)
    pd.read_parquet(assets.val_parquet).head(16).to_parquet(val, index=False)
    return assets.model_dir, train, val


def _command(model_dir: Path, train: Path, val: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rllm.experimental.fully_async",
        f"run.dir={run_dir}",
        "task.name=null",
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files={train}",
        f"data.val_files={val}",
        "reward.custom_reward_function.path=rllm.experimental.fully_async.tasks.addition",
        "reward.custom_reward_function.name=compute_score",
        f"async_training.required_samples={GROUPS_PER_STEP}",
        f"actor_rollout_ref.rollout.n={SAMPLES}",
        "async_training.max_staleness=1",
        "engines.num_engines=2",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        *extra,
    ]


def _start(command: list[str], cwd: Path) -> subprocess.Popen:
    env = dict(os.environ, RLLM_LOG_LEVEL="WARNING", PYTHONUNBUFFERED="1")
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout_s: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    proc.kill()
    pytest.fail(f"never saw {needle!r}:\n{''.join(lines)[-3000:]}")


def _sigkill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the driver and everything it started (engines in their own sessions, Ray's daemons)."""
    tree = [proc.pid, *(child.pid for child in psutil.Process(proc.pid).children(recursive=True))]
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _sigkill_at_a_checkpoint_where(
    proc: subprocess.Popen, checkpoints: CheckpointManager, wanted: Callable[[dict], bool], timeout_s: float
) -> None:
    """After each logged step, look at the latest checkpoint's rollout.json and SIGKILL everything once
    `wanted(rollout)` holds (a checkpoint is written per step, far slower than this check: the one read is almost
    always the one the resume starts from, and the caller checks the one it does)."""
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        latest = checkpoints.latest() if line.startswith("step ") else None
        if latest is not None and wanted(json.loads((latest / "rollout.json").read_text())):
            _sigkill_tree(proc)
            return
    proc.kill()
    pytest.fail(f"no checkpoint of the run met the condition:\n{''.join(lines)[-3000:]}")


def _epoch_command(small_task: tuple[Path, Path, Path], run_dir: Path) -> list[str]:
    """One epoch of the small prompt file, a checkpoint every step."""
    model_dir, train, val = small_task
    return _command(
        model_dir,
        train,
        val,
        run_dir,
        "trainer.total_training_steps=null",
        "trainer.total_epochs=1",
        "trainer.save_freq=1",
        # Every sample trained needs a bound no group can pass: the epoch is 5 versions. At η=1 a sample started at
        # version 0 and continued after the resume was trained at version 2 and dropped as stale (once in the last
        # 9 whole suites).
        "async_training.max_staleness=8",
    )


@pytest.fixture(scope="module")
def killed_run(warm_small_task, tmp_path_factory) -> Callable[[int], Path]:
    """`killed_run(ranks)`: the run dir of an epoch run with `ranks` trainer ranks, SIGKILLed after its step 3, as
    the kill left it. Run once per rank count in a module (the two-rank run is resumed both by two ranks and by one:
    a CLI run fewer, ~45 s on a loaded 2-core machine) and kept as a copy, which each call puts back at the run's
    own path: a resume elsewhere would find the checkpoint's ledger journal at another path and restart it."""
    made: dict[int, tuple[Path, Path]] = {}

    def killed(ranks: int) -> Path:
        if ranks not in made:
            root = tmp_path_factory.mktemp(f"killed_{ranks}_ranks")
            command = [*_epoch_command(warm_small_task, root / "run"), *TWO_RANK_RUN]
            first = _start([*command, f"trainer.n_gpus_per_node={ranks}"], root)
            _wait_for_line(first, "step    3/", timeout_s=400)
            _sigkill_tree(first)
            shutil.copytree(root / "run", root / "as_killed")
            made[ranks] = (root / "run", root / "as_killed")
        run_dir, as_killed = made[ranks]
        shutil.rmtree(run_dir)
        shutil.copytree(as_killed, run_dir)
        return run_dir

    return killed


# Two trainer ranks (gloo, one rank actor each): each rank writes its own shard of the policy through
# torch.distributed.checkpoint into the checkpoint being saved, and the resumed group reads them back. The second
# case resumes the two ranks' checkpoint with one rank (DCP reshards; runtime/checkpoints/trainer_state.py). One rank
# killed and resumed with one is the token-level resume test below (the same checks, on one run pair fewer).
# The weights reach the engines by broadcast (param_sync.transport=distributed, small buckets), in both runs: a
# weight group of the ranks and the two engines, built again by the resumed run; nothing goes to disk.
TWO_RANK_RUN = ("run.record_batches=true", "param_sync.transport=distributed", "param_sync.bucket_mb=1")


@pytest.mark.slow  # CLI runs end to end
@pytest.mark.parametrize(("ranks", "resume_ranks"), [(2, 2), (2, 1)], ids=["two-ranks", "two-ranks-resumed-by-one"])
def test_sigkill_then_resume_trains_every_prompt_of_the_epoch_exactly_once(
    warm_small_task, killed_run, tmp_path, ranks, resume_ranks
):
    run_dir = killed_run(ranks)
    command = [*_epoch_command(warm_small_task, run_dir), *TWO_RANK_RUN]
    killed_at = CheckpointManager(run_dir / "checkpoints").latest()
    assert killed_at is not None
    # every rank's shard is in the checkpoint (and its manifest, which the resume verifies); trainer.pt refers to them
    shards = {path.name for path in (killed_at / POLICY_SHARDS).iterdir()}
    assert shards == {*(f"__{rank}_0.distcp" for rank in range(ranks)), ".metadata", "extra.pt"}
    trainer_part = CheckpointManager(run_dir / "checkpoints").load(killed_at).trainer
    assert trainer_part["backend"] == {"shards": POLICY_SHARDS, "world_size": ranks}

    second = _start([*command, f"trainer.n_gpus_per_node={resume_ranks}"], tmp_path)
    output, _ = second.communicate(timeout=600)
    assert second.returncode == 0, output[-3000:]
    assert f"resumed from {killed_at}" in output
    assert "prompt data exhausted" in output

    # The journal holds the first run up to the checkpoint resumed from (the resume cut off what came after it)
    # and the second run: replaying it raises on any sample issued or ended twice across the two.
    history = read_journal(run_dir / "ledger.jsonl")
    expected = {f"e0/{index}/{sample}" for index in range(NUM_PROMPTS) for sample in range(SAMPLES)}
    assert set(history) == expected, "nothing else was issued, nothing was skipped"
    states = {uid: state for uid, (state, _) in history.items()}
    assert set(states.values()) == {SampleState.TRAINED}, {u: s for u, s in states.items() if s != SampleState.TRAINED}
    # The final checkpoint's counters agree with the journal (and its state is small: no per-sample history).
    final = CheckpointManager(run_dir / "checkpoints").load(CheckpointManager(run_dir / "checkpoints").latest())
    ledger_state = final.rollout["ledger"]
    assert ledger_state["version"] == 2 and ledger_state["in_flight"] == []
    counts = history_counts(history)
    assert counts["issued"] == counts["trained"] == ledger_state["issued"] == len(expected)
    # Every step synced by broadcast, to the end: the final validation ran on engines that read back the last
    # version (the last broadcast arrived), and the disk transport's param_sync.weights_dir was never made.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "trainer/step" in r]
    assert steps and all("sync/pause_s" in r for r in steps)
    assert steps[-1]["trainer/version"] == NUM_PROMPTS // GROUPS_PER_STEP
    assert [r["val/min_version"] for r in rows if "val/min_version" in r][-1] == steps[-1]["trainer/version"]
    assert not (run_dir / "weights").exists(), "weights went to disk"
    if resume_ranks == ranks:
        # The batch record (run.record_batches) replays the two ranks' training bit for bit across the resume
        # (FSDP2 over gloo: each rank's gradient over its token-balanced shard, the two added in a fixed order).
        assert len(Record(run_dir).load(1).rng["ranks"]) == ranks, "each rank's RNG state is in the record"
        assert _learned_by(run_dir, NUM_PROMPTS // GROUPS_PER_STEP), "the weights never moved: nothing to check"
        replayed = _replay(run_dir)
        assert replayed.returncode == 0, replayed.stdout + replayed.stderr[-3000:]
        lines = replayed.stdout.splitlines()
        assert any("resumed from" in line and "equal bit for bit" in line for line in lines), lines
        weights = [line for line in lines if line.startswith("weights at step")]
        assert weights and all("model, optimizer moments and LR schedule equal bit for bit" in w for w in weights)


def _learned_by(run_dir: Path, step: int) -> bool:
    """Some step up to `step` had a non-zero gradient (so the weights compared there moved)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return any(line.get("actor/grad_norm", 0.0) > 0 for line in lines if 0 < line["step"] <= step)


def _replay(run_dir: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "rllm.experimental.fully_async", "replay", str(run_dir)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def _dumped(directory: Path) -> dict[str, dict]:
    """The trained trajectories a run dumped (trainer.rollout_data_dir), by uid."""
    records = (json.loads(line) for path in directory.glob("*.jsonl") for line in path.read_text().splitlines())
    return {record["uid"]: record for record in records}


@pytest.mark.slow
def test_sigkill_between_checkpoints_continues_every_sample_in_flight_from_its_saved_tokens(small_task, tmp_path):
    """Token-level resume end to end: the checkpoint the run is resumed from holds the tokens of the samples that
    were generating; after the resume each of them continues from its saved tokens (its trained tokens start with
    them, versions and log-probs included; the journal says `continued`, none regenerated), and every sample of
    the epoch ends in exactly one ledger state, trained or dropped as stale."""
    model_dir, train, val = small_task
    run_dir = tmp_path / "run"
    command = _command(
        model_dir,
        train,
        val,
        run_dir,
        "trainer.total_training_steps=null",
        "trainer.total_epochs=1",
        "trainer.save_freq=1",
        # A sample is mid-generation at a checkpoint only while the staleness budget has room: a checkpoint taken
        # with the budget full of finished groups has nothing in flight. At η=8 the budget (9 batches) exceeds the
        # epoch (5 batches), so the one engine, running one 80-token request at a time, is generating at every
        # checkpoint until it has generated the whole epoch, however fast it is next to the trainer (at η=1 the
        # budget filled before the first checkpoint on a machine whose engine outpaced its trainer by a quarter).
        "async_training.max_staleness=8",
        "actor_rollout_ref.rollout.ignore_eos=true",
        "data.max_response_length=80",  # the epoch takes ~13 s of generation at CI's 1,000 tok/s
        "engines.num_engines=1",
        "engines.max_running_requests=1",
    )
    first = _start([*command, f"trainer.rollout_data_dir={tmp_path / 'dumps_first'}"], tmp_path)
    checkpoints = CheckpointManager(run_dir / "checkpoints")

    def mid_generation(rollout: dict) -> bool:  # a checkpoint may fall between two requests
        return any(doc["generation"]["output_ids"] for doc in rollout["in_flight_progress"].values())

    _sigkill_at_a_checkpoint_where(first, checkpoints, mid_generation, timeout_s=400)
    killed_at = checkpoints.latest()
    assert killed_at is not None
    saved = checkpoints.load(killed_at).rollout["in_flight_progress"]
    assert any(doc["generation"]["output_ids"] for doc in saved.values()), "samples were mid-generation"
    # one rank's shard of the policy in the checkpoint (and its manifest, which the resume verifies)
    assert {path.name for path in (killed_at / POLICY_SHARDS).iterdir()} == {"__0_0.distcp", ".metadata", "extra.pt"}
    assert checkpoints.load(killed_at).trainer["backend"] == {"shards": POLICY_SHARDS, "world_size": 1}

    second = _start([*command, f"trainer.rollout_data_dir={tmp_path / 'dumps'}"], tmp_path)
    output, _ = second.communicate(timeout=600)
    assert second.returncode == 0, output[-3000:]
    assert f"resumed from {killed_at}" in output
    assert "prompt data exhausted" in output
    assert f"{len(saved)} continue from their saved tokens" in output

    outcomes: dict[str, str] = {}
    history = read_journal(run_dir / "ledger.jsonl", outcomes)  # the audit: issued and ended exactly once each
    expected = {f"e0/{index}/{sample}" for index in range(NUM_PROMPTS) for sample in range(SAMPLES)}
    assert set(history) == expected
    states = {uid: state for uid, (state, _) in history.items()}
    assert set(states.values()) <= {SampleState.TRAINED, SampleState.DROPPED_STALE}
    assert {uid: outcomes[uid] for uid in saved} == dict.fromkeys(saved, "continued"), "none regenerated"
    trained = _dumped(tmp_path / "dumps")
    checked = 0
    for uid, doc in saved.items():
        if states[uid] is SampleState.DROPPED_STALE:
            continue  # too stale by the time it was trained: dropped and counted, as any sample
        sequence, generation = trained[uid]["sequences"][0], doc["generation"]
        n = len(generation["output_ids"])
        assert sequence["response_ids"][:n] == generation["output_ids"], uid
        assert sequence["versions"][:n] == generation["versions"], uid
        assert sequence["logprobs"][:n] == pytest.approx(generation["logprobs"], abs=1e-5), uid
        checked += 1
    assert checked, "at least one continued sample was trained"
    final = checkpoints.load(checkpoints.latest()).rollout["ledger"]
    assert final["ended"].get("dropped_stale", 0) == sum(s is SampleState.DROPPED_STALE for s in states.values())
    # The final checkpoint's counters agree with the journal (and its state is small: no per-sample history).
    assert final["version"] == 2 and final["in_flight"] == []
    assert history_counts(history)["issued"] == final["issued"] == len(expected)


@pytest.mark.slow
def test_sigkill_with_agent_episodes_in_flight_continues_each_episode_from_its_saved_turns(number_line_cache, tmp_path):
    """The agent config (config/agent_cpu.yaml, scaled down): the checkpoint holds the episodes in flight (their
    finished turns and the environment's state); after the resume each goes on from its saved turn: its trained
    turns start with the saved ones (tokens and versions), the journal says `continued`, and every sample ends in
    exactly one ledger state."""
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "rllm.experimental.fully_async",
        "--config",
        str(Path(__file__).resolve().parents[2] / "config" / "agent_cpu.yaml"),
        f"run.dir={run_dir}",
        f"task.cache_dir={number_line_cache}",
        "task.warmup_steps=60",
        "trainer.total_training_steps=10",
        "trainer.save_freq=1",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        # Episodes are mid-way at a checkpoint only while the staleness budget has room: with the budget full, a
        # checkpoint (taken right after the trainer's acknowledgement, before freed capacity is used) finds every
        # episode in flight finished and queued, and there is nothing to continue. At η=8 the budget (9 steps of
        # 32 episodes, run one request at a time) fills within the run's 10 steps only if rollouts outpace training
        # about twofold; at η=1 it filled before the first checkpoint where they outpaced it by a tenth.
        "async_training.max_staleness=8",
        "async_training.required_samples=8",
        "actor_rollout_ref.rollout.n=4",
        "engines.max_running_requests=1",
    ]
    first = _start([*command, f"trainer.rollout_data_dir={tmp_path / 'dumps_first'}"], tmp_path)
    checkpoints = CheckpointManager(run_dir / "checkpoints")

    def mid_episode(rollout: dict) -> bool:
        return any(doc["episode"] and doc["episode"]["turns"] for doc in rollout["in_flight_progress"].values())

    # An episode may sit between turns or be queued unstarted at a given checkpoint: kill at the first checkpoint
    # that has one mid-way.
    _sigkill_at_a_checkpoint_where(first, checkpoints, mid_episode, timeout_s=400)
    killed_at = checkpoints.latest()
    assert killed_at is not None
    saved = checkpoints.load(killed_at).rollout["in_flight_progress"]
    episodes = {uid: doc for uid, doc in saved.items() if doc["episode"] and doc["episode"]["turns"]}
    assert episodes, "some episodes had finished turns at the checkpoint"
    assert all(doc["episode"]["env"] for doc in episodes.values()), "with the environment's state"

    second = _start([*command, f"trainer.rollout_data_dir={tmp_path / 'dumps'}"], tmp_path)
    output, _ = second.communicate(timeout=600)
    assert second.returncode == 0, output[-3000:]
    outcomes: dict[str, str] = {}
    history = read_journal(run_dir / "ledger.jsonl", outcomes)  # the audit: issued and ended exactly once each
    assert {uid: outcomes[uid] for uid in saved} == dict.fromkeys(saved, "continued")
    states = {uid: state for uid, (state, _) in history.items()}
    assert all(states[uid] is not SampleState.IN_FLIGHT for uid in saved)
    trained = _dumped(tmp_path / "dumps")
    checked = 0
    for uid, doc in episodes.items():
        if states[uid] is not SampleState.TRAINED:
            continue  # dropped as stale (or failed): ended and counted, as any sample
        rows = trained[uid]["sequences"]
        for turn, row in zip(doc["episode"]["turns"], rows, strict=False):
            assert row["response_ids"] == turn["output_ids"] and row["versions"] == turn["versions"], uid
        current, generation = rows[len(doc["episode"]["turns"]) :], doc["generation"]
        if generation["output_ids"]:
            n = len(generation["output_ids"])
            assert current[0]["response_ids"][:n] == generation["output_ids"], uid
        checked += 1
    assert checked, "at least one continued episode was trained"


@pytest.mark.slow  # a CLI run end to end
def test_ctrl_c_checkpoints_and_stops_everything_within_30s(small_task, tmp_path):
    """SIGINT, as Ctrl-C sends it (SIGTERM while training: test_startup_stop's `training` moment)."""
    model_dir, train, val = small_task
    run_dir = tmp_path / "run"
    proc = _start(
        _command(model_dir, train, val, run_dir, "trainer.total_training_steps=1000", "trainer.total_epochs=100"),
        tmp_path,
    )
    _wait_for_line(proc, "step    2/", timeout_s=400)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    elapsed = time.monotonic() - sent
    assert elapsed < 30, f"took {elapsed:.1f}s to stop"
    assert proc.returncode == 130, output[-3000:]
    assert "Traceback" not in output.split("interrupted at step")[-1]
    latest = CheckpointManager(run_dir / "checkpoints").latest()
    assert latest is not None and int(latest.name.split("_")[-1]) >= 2
    assert not leftover_processes(proc.pid, str(model_dir))


def test_a_run_started_with_sigint_ignored_says_how_to_stop_it(caplog):
    """`nohup ... &` from a script starts the driver with SIGINT ignored: Ctrl-C cannot stop it, so it says so."""
    from rllm.experimental.fully_async.runtime.run.driver import _install_signal_handlers

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with caplog.at_level("WARNING", logger="rllm.experimental.fully_async.runtime.run.driver"):
            _install_signal_handlers()
        assert f"stop the run with SIGTERM (kill {os.getpid()})" in caplog.text
        with pytest.raises(KeyboardInterrupt):  # SIGTERM still unwinds like Ctrl-C
            signal.raise_signal(signal.SIGTERM)
        caplog.clear()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _install_signal_handlers()
        assert "SIGINT is ignored" not in caplog.text
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
