"""The user's model (task.name=null): a missing folder, an unreachable Hub id, a folder without config.json or
tokenizer each end the CLI in one line naming actor_rollout_ref.model.path, exit 2, before anything starts."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub import constants as hf_constants

from rllm.experimental.fully_async.errors import ConfigError
from rllm.experimental.fully_async.settings import model_source
from rllm.experimental.fully_async.settings.model_source import check_model, check_model_folder
from rllm.experimental.fully_async.tasks.addition import build_addition_model, build_addition_tokenizer

REPO = Path(__file__).resolve().parents[2]
KEY = "actor_rollout_ref.model.path"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A whole model folder (the addition task's model and tokenizer, untrained), one without its tokenizer files,
    one without config.json."""
    root = tmp_path_factory.mktemp("models")
    full = root / "full"
    build_addition_model().save_pretrained(full)
    build_addition_tokenizer().save_pretrained(full)
    no_tokenizer = root / "no_tokenizer"
    shutil.copytree(full, no_tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (no_tokenizer / name).unlink(missing_ok=True)
    no_config = root / "no_config"
    shutil.copytree(full, no_config)
    (no_config / "config.json").unlink()
    return {"full": full, "no_tokenizer": no_tokenizer, "no_config": no_config}


@pytest.fixture
def silent_hub():
    """A Hub endpoint on loopback that accepts connections and never answers: the probe's worst case."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


def _train(model: str, run_dir: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rllm.experimental.fully_async",
            "--config",
            "examples/own_data/config.yaml",
            f"{KEY}={model}",
            "data.train_files=unused.parquet",
            "data.val_files=null",
            f"run.dir={run_dir}",
        ],
        cwd=REPO,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow  # five CLI processes (~75 s on a busy 2-core machine)
def test_each_unloadable_model_is_one_line_naming_the_key_exit_2(folders, silent_hub, tmp_path):
    cases = {  # name: (model, environment, what the line says)
        "missing": ("/nonexistent/model", {}, "does not exist"),
        "hub id, Hub silent": ("Qwen/Qwen2.5-0.5B", {"HF_ENDPOINT": silent_hub}, "not in the local cache"),
        "hub id, offline": ("Qwen/Qwen2.5-0.5B", {"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
        "no tokenizer": (str(folders["no_tokenizer"]), {}, "has no tokenizer"),
        "no config.json": (str(folders["no_config"]), {}, "has no config.json"),
    }
    cache = {"HF_HUB_CACHE": str(tmp_path / "empty_cache")}  # not this machine's cache: the id is in none
    procs = {name: _train(model, tmp_path / "run", {**cache, **env}) for name, (model, env, _) in cases.items()}
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=300)
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert proc.returncode == 2, (name, stderr)
        assert len(lines) == 1 and "Traceback" not in stderr, (name, stderr)
        model, _, says = cases[name]
        assert lines[0].startswith(f"config error: '{KEY}={model}'") and says in lines[0], (name, lines[0])
    # How fast the Hub id is refused is bounded in-process (the next test): five CLIs on 2 cores take what they take.
    assert not (tmp_path / "run").exists()  # refused before the run directory was touched


def test_an_unreachable_hub_is_found_quickly_and_a_cached_id_is_then_read_offline(
    folders, silent_hub, tmp_path, monkeypatch
):
    monkeypatch.setattr(hf_constants, "ENDPOINT", silent_hub)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    started = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        check_model("Org/model", "'k=Org/model'")
    elapsed = time.monotonic() - started
    assert elapsed < 15, elapsed  # the probe's timeout is 3 s (HUB_PROBE_TIMEOUT_S); before: ~58 s of retries
    assert f"unreachable ({silent_hub}: " in str(caught.value) and "timeout" in str(caught.value).lower()
    assert "\n" not in str(caught.value)
    # The same id in the cache (huggingface_hub's layout): accepted, and later loads stay offline (no retries).
    repo = tmp_path / "hub" / "models--Org--model"
    shutil.copytree(folders["full"], repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    check_model("Org/model", "'k=Org/model'")
    assert hf_constants.HF_HUB_OFFLINE is True and os.environ["HF_HUB_OFFLINE"] == "1"  # monkeypatch restores both


def test_a_whole_folder_passes_and_a_file_or_relative_path_is_named(folders, tmp_path):
    check_model_folder(folders["full"], "'k'")
    check_model(str(folders["full"]), "'k'")
    weights = folders["full"] / "model.safetensors"
    with pytest.raises(ConfigError, match="is a file, not a model folder"):
        check_model(str(weights), "'k'")
    with pytest.raises(ConfigError, match="does not exist"):
        check_model(str(tmp_path / "models" / "m"), "'k'")  # absolute: no Hub id


def test_verl_default_model_path_is_named_as_such():
    from omegaconf import OmegaConf

    default = os.path.expanduser(model_source.VERL_DEFAULT_MODEL)  # as settings/paths.py leaves it
    cfg = OmegaConf.create({"task": {"name": None}, "actor_rollout_ref": {"model": {"path": default}}})
    with pytest.raises(ConfigError, match=r"\(verl's default: nothing set it\) does not exist"):
        model_source.check_model_source(cfg)
