"""Paths in a config: `~` expanded once when the config loads (settings/paths.py), the same for every reader (the
trainer's spec, the engine launcher's command line, `plan`); environment variables refused naming OmegaConf's resolver,
as verl expands neither."""

from __future__ import annotations

from pathlib import Path

import pytest

from rllm.experimental.fully_async.run_spec import build_run_spec
from rllm.experimental.fully_async.settings.loader import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]


def test_model_path_tilde_is_expanded_for_every_reader(tmp_path, monkeypatch, capsys):
    """`~` in actor_rollout_ref.model.path: the trainer's spec, the engine launcher's command line and `plan` all
    get the same absolute path (settings/paths.py, applied once by load_config)."""
    from rllm.experimental.fully_async.cli.plan import run_plan
    from rllm.experimental.fully_async.engines.from_config import engine_command

    monkeypatch.setenv("HOME", str(tmp_path))
    overrides = ["task.name=null", "actor_rollout_ref.model.path=~/models/m", "data.train_files=~/d/train.parquet"]
    cfg = load_config(None, overrides)
    expected = str(tmp_path / "models" / "m")
    spec = build_run_spec(cfg)
    assert spec.trainer.model_path == expected and spec.engines.model_path == expected
    argv = engine_command(spec.engines).build("127.0.0.1", 30000, 0)
    assert argv[argv.index("--model-path") + 1] == expected
    assert run_plan(cfg) == 0
    assert f"--model-path {expected}" in capsys.readouterr().out
    assert spec.executor.data.train_files == (str(tmp_path / "d" / "train.parquet"),)
    sglang = load_config(REPO / "config" / "gpu_fsdp_sglang.yaml", ["trainer.device=cpu"])
    assert build_run_spec(sglang).engines.model_path == str(tmp_path / "models" / "Qwen2.5-1.5B-Instruct")


def test_environment_variables_in_paths_are_refused_naming_the_resolver(monkeypatch):
    monkeypatch.setenv("MODELS", "/models")
    with pytest.raises(ConfigError, match=r"oc\.env:MODELS") as info:
        load_config(None, ["task.name=null", "actor_rollout_ref.model.path=$MODELS/m", "data.train_files=t.parquet"])
    assert "\n" not in str(info.value)
    cfg = load_config(
        None, ["task.name=null", "actor_rollout_ref.model.path=${oc.env:MODELS}/m", "data.train_files=t.parquet"]
    )
    assert build_run_spec(cfg).trainer.model_path == "/models/m"  # OmegaConf's resolver is the way, as in verl
