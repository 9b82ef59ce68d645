"""A run dir's lifecycle: a finished run says so and starts nothing, a fresh start moves the old run aside, a resume
refuses config changes that would corrupt it and allows safe ones."""

from __future__ import annotations

import json
import time

import pytest
import torch
from omegaconf import OmegaConf

from rllm.experimental.fully_async.run_spec import build_run_spec
from rllm.experimental.fully_async.runtime.checkpoints.store import CheckpointManager
from rllm.experimental.fully_async.runtime.run.run_dir import (
    ResumeConfigError,
    RunFinished,
    is_safe_key,
    mark_finished,
    refused_changes,
    settle_run_dir,
)
from rllm.experimental.fully_async.settings.loader import load_config


def config(run_dir, *overrides):
    return load_config(None, [f"run.dir={run_dir}", "task.name=null", "data.train_files=t.parquet", *overrides])


def finished_run(run_dir, step: int, *overrides: str):
    """A run dir as a run leaves it: config.yaml, metrics, a checkpoint at `step`."""
    cfg = config(run_dir, *overrides)
    settle_run_dir(cfg)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    CheckpointManager(run_dir / "checkpoints").save(
        step, trainer={"w": torch.zeros(2)}, rollout={"version": step}, queue=[], meta={"version": step}
    )
    return cfg


def test_a_run_at_its_total_steps_says_so_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    finished_run(run_dir, 2, "trainer.total_training_steps=2")
    with pytest.raises(RunFinished) as info:
        settle_run_dir(config(run_dir, "trainer.total_training_steps=2"))
    message = str(info.value)
    assert "\n" not in message
    assert str(run_dir) in message and "already finished" in message and "trainer.resume_mode=disable" in message
    with pytest.raises(RunFinished):  # a lower target is finished too
        settle_run_dir(config(run_dir, "trainer.total_training_steps=1"))
    settle_run_dir(config(run_dir, "trainer.total_training_steps=5"))  # more steps: it goes on
    assert OmegaConf.load(run_dir / "config.yaml").trainer.total_training_steps == 5


def test_a_run_whose_data_ran_out_is_finished_until_more_epochs_are_asked(tmp_path):
    run_dir = tmp_path / "run"
    cfg = finished_run(run_dir, 3, "trainer.total_training_steps=null", "trainer.total_epochs=1")
    mark_finished(run_dir, 3, build_run_spec(cfg))
    with pytest.raises(RunFinished, match="exhausted at step 3"):
        settle_run_dir(config(run_dir, "trainer.total_training_steps=null", "trainer.total_epochs=1"))
    settle_run_dir(config(run_dir, "trainer.total_training_steps=null", "trainer.total_epochs=2"))
    # A marker from an older step (the run was resumed past it) does not count.
    mark_finished(run_dir, 2, build_run_spec(cfg))
    settle_run_dir(config(run_dir, "trainer.total_training_steps=null", "trainer.total_epochs=1"))


def test_resume_mode_disable_moves_the_previous_run_aside_and_deletes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    finished_run(run_dir, 2, "trainer.total_training_steps=2")
    (run_dir / "notes.txt").write_text("mine")
    settle_run_dir(config(run_dir, "trainer.total_training_steps=2", "trainer.resume_mode=disable", "run.seed=9"))
    (previous,) = run_dir.glob("previous-*")
    assert f"moved to {previous}" in capsys.readouterr().out
    assert sorted(p.name for p in previous.iterdir()) == ["checkpoints", "config.yaml", "metrics.jsonl"]
    assert CheckpointManager(previous / "checkpoints").latest() is not None
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "notes.txt", previous.name]
    assert CheckpointManager(run_dir / "checkpoints").latest() is None
    assert OmegaConf.load(run_dir / "config.yaml").run.seed == 9


def test_a_fresh_start_over_a_run_without_checkpoint_moves_it_aside_too(tmp_path):
    run_dir = tmp_path / "run"
    settle_run_dir(config(run_dir))
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "engine_events.jsonl").write_text('{"event": "join"}\n')
    settle_run_dir(config(run_dir))  # auto, no checkpoint: its metrics and engine events must not be appended to
    (previous,) = run_dir.glob("previous-*")
    assert (previous / "metrics.jsonl").exists() and not (run_dir / "metrics.jsonl").exists()
    assert (previous / "engine_events.jsonl").exists() and not (run_dir / "engine_events.jsonl").exists()
    settle_run_dir(config(run_dir))  # nothing but config.yaml: moved again, into a second folder
    assert len(list(run_dir.glob("previous-*"))) == 2


def test_resume_refuses_changes_that_corrupt_the_run_naming_each_key(tmp_path):
    run_dir = tmp_path / "run"
    finished_run(run_dir, 2, "trainer.total_training_steps=10")
    changed = config(
        run_dir,
        "trainer.total_training_steps=10",
        "actor_rollout_ref.rollout.n=4",
        "async_training.max_staleness=3",
        "actor_rollout_ref.model.path=other",
        "run.seed=1",
    )
    with pytest.raises(ResumeConfigError) as info:
        settle_run_dir(changed)
    message = str(info.value)
    assert "\n" not in message and str(run_dir) in message
    for key in ("actor_rollout_ref.rollout.n", "async_training.max_staleness", "actor_rollout_ref.model.path"):
        assert key in message
    assert "run.seed 0 -> 1" in message
    assert "trainer.resume_mode=disable" in message
    assert OmegaConf.load(run_dir / "config.yaml").actor_rollout_ref.rollout.n != 4, "the saved config is kept"


def test_resume_allows_safe_changes_and_saves_the_new_config(tmp_path):
    run_dir = tmp_path / "run"
    finished_run(run_dir, 2, "trainer.total_training_steps=10")
    safe = (
        "trainer.total_training_steps=20",
        "trainer.test_freq=5",
        "trainer.save_freq=3",
        "trainer.logger=[console]",
        "run.log_level=DEBUG",
        "engines.num_engines=1",
        "engines.request_timeout_s=7",
        "param_sync.timeout_s=9",
        "async_training.queue_get_timeout_s=11",
        "data.val_files=v.parquet",
    )
    settle_run_dir(config(run_dir, *safe))
    saved = OmegaConf.load(run_dir / "config.yaml")
    assert (saved.trainer.total_training_steps, saved.engines.num_engines, saved.run.log_level) == (20, 1, "DEBUG")


def test_a_run_saved_with_unexpanded_paths_resumes_with_expanded_ones(tmp_path, monkeypatch):
    """Runs saved before `~` was expanded at load time hold "~/..." paths; the same config now loads them expanded."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    run_dir = tmp_path / "run"
    finished_run(run_dir, 1, "task.cache_dir=~/cache", "trainer.total_training_steps=3")
    saved = OmegaConf.load(run_dir / "config.yaml")
    assert saved.task.cache_dir == str(tmp_path / "home" / "cache")
    saved.task.cache_dir = "~/cache"  # as an earlier version wrote it
    OmegaConf.save(saved, run_dir / "config.yaml")
    settle_run_dir(config(run_dir, "task.cache_dir=~/cache", "trainer.total_training_steps=3"))  # no refusal
    with pytest.raises(ResumeConfigError, match=r"task\.cache_dir"):  # a real change is still refused
        settle_run_dir(config(run_dir, "task.cache_dir=~/other", "trainer.total_training_steps=3"))


def test_the_safe_list_is_the_documented_one():
    for key in ("trainer.total_training_steps", "trainer.logger", "engines.num_engines", "workflow.reward_timeout_s"):
        assert is_safe_key(key), key
    # the trainer's world size: its checkpoint's shards reshard (tests/e2e/test_resume.py resumes 2 ranks with 1)
    assert is_safe_key("trainer.n_gpus_per_node") and is_safe_key("trainer.nnodes")
    for key in (
        "actor_rollout_ref.model.path",
        "data.train_files",
        "actor_rollout_ref.rollout.n",
        "async_training.required_samples",
        "async_training.max_staleness",
        "algorithm.adv_estimator",
        "actor_rollout_ref.actor.optim.lr",
        "run.seed",
        "data.seed",
        "task.seed",
    ):
        assert not is_safe_key(key), key
    assert refused_changes({"a": {"b": [1, 2]}}, {"a": {"b": [1, 3]}}) == [("a.b", "[1, 2]", "[1, 3]")]
    assert refused_changes({"a": 1}, {"a": 1, "c": 2}) == [("c", "'<unset>'", "2")]


def test_a_key_added_since_the_run_was_saved_is_compared_with_its_default():
    saved = {"a": 1}
    defaults = {"a": 1, "new": {"enable": False}}
    assert refused_changes(saved, {"a": 1, "new": {"enable": False}}, defaults=defaults) == []
    assert refused_changes(saved, {"a": 1, "new": {"enable": True}}, defaults=defaults) == [
        ("new.enable", "'<unset>'", "True")
    ]
    # a key this build no longer has cannot be set: logged, not refused
    assert refused_changes({"a": 1, "gone": 3}, {"a": 1}, defaults=defaults) == []


def test_a_run_saved_before_a_section_existed_resumes(tmp_path):
    run_dir = tmp_path / "run"
    finished_run(run_dir, 2, "trainer.total_training_steps=10")
    saved = OmegaConf.load(run_dir / "config.yaml")
    del saved.async_training["adaptive_staleness"]  # as written by a build before adaptive staleness
    OmegaConf.save(saved, run_dir / "config.yaml")
    settle_run_dir(config(run_dir, "trainer.total_training_steps=20"))
    assert OmegaConf.load(run_dir / "config.yaml").trainer.total_training_steps == 20


def test_the_cli_on_a_finished_run_dir_prints_one_line_and_exits_0_without_ray(
    tmp_path, addition_cache, capsys, monkeypatch
):
    from run_helpers import QUICK_WARMUP_STEPS

    from rllm.experimental.fully_async.runtime.run import build as run_module

    def must_not_start(*args, **kwargs):
        raise AssertionError("a finished run directory must not start engines or Ray")

    # Another test of this session may have started Ray in this process: check that nothing here starts it.
    monkeypatch.setattr(run_module, "engine_launcher", must_not_start)
    monkeypatch.setattr(run_module, "init_ray", must_not_start)

    from rllm.experimental.fully_async.__main__ import main

    run_dir = tmp_path / "run"
    args = [f"run.dir={run_dir}", f"task.cache_dir={addition_cache}", f"task.warmup_steps={QUICK_WARMUP_STEPS}"]
    args.append("trainer.total_training_steps=2")
    cfg = load_config(None, args)
    from rllm.experimental.fully_async.runtime.run.prepare import prepare_task

    prepare_task(cfg)  # config.yaml as the run saved it: with the task's paths filled in
    settle_run_dir(cfg)
    CheckpointManager(run_dir / "checkpoints").save(2, trainer={}, rollout={}, queue=[], meta={})
    capsys.readouterr()
    started = time.monotonic()
    assert main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith(f"run dir {run_dir} already finished"), out
    assert time.monotonic() - started < 30
    assert json.loads((run_dir / "checkpoints" / "step_00000002" / "meta.json").read_text())["step"] == 2


@pytest.mark.slow
def test_a_run_without_validation_files_validates_nothing_then_a_rerun_says_it_finished(tmp_path, addition_cache):
    """val_before_train=true with data.val_files=null used to crash formatting None; the rerun starts nothing."""
    import os
    import subprocess

    from run_helpers import addition_run_command

    from rllm.experimental.fully_async.tasks.addition import prepare_addition_assets

    assets = prepare_addition_assets(addition_cache, seed=0, warmup_steps=60)
    run_dir = tmp_path / "run"
    command = addition_run_command(
        run_dir,
        addition_cache,
        "task.name=null",
        f"actor_rollout_ref.model.path={assets.model_dir}",
        f"data.train_files={assets.train_parquet}",
        "data.val_files=null",
        "reward.custom_reward_function.path=rllm.experimental.fully_async.tasks.addition",
        "reward.custom_reward_function.name=compute_score",
        "trainer.val_before_train=true",
        "trainer.total_training_steps=1",
        "async_training.required_samples=8",
    )
    env = dict(os.environ, RLLM_LOG_LEVEL="WARNING")
    first = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    assert "run finished: 1 steps" in first.stdout
    engine_logs = sorted((run_dir / "engines").glob("engine-*.log"))
    started = time.monotonic()
    again = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert again.stdout.strip().splitlines()[-1].startswith(f"run dir {run_dir} already finished")
    assert sorted((run_dir / "engines").glob("engine-*.log")) == engine_logs, "no engine was started"
    assert time.monotonic() - started < 60
