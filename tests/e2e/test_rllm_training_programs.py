"""rLLM fully-async training programs (tests/fixtures/rllm_training_programs/, written the way rLLM's examples write
them)
trained here, unchanged, for a few steps on CPU: each runs as its own process with hydra overrides, as rLLM's launch
scripts run them.

- today's shape (deepresearch's train.py): data by DatasetRegistry name, val_rollout_fn, trajectory metadata;
- the DAPO example (dbb00c61 .. de802202^): a closure over config values the program added (+keys), dataset_name=;
- the DAPO example at 65147d41: verl parquet in data.train_files, the datum as verl's collated batch of one.

Checked: the run exits 0 after the configured steps with weight syncs, the ledger trained every sample, the datum is
what rLLM gives, the closure's captured values arrived, and the metadata metrics are in metrics.jsonl (and TensorBoard).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]
PROGRAMS = REPO / "tests" / "fixtures" / "rllm_training_programs"
STEPS = 3
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def addition(addition_cache):
    from run_helpers import QUICK_WARMUP_STEPS

    from rllm.experimental.fully_async.tasks.addition import prepare_addition_assets

    return prepare_addition_assets(addition_cache, seed=0, warmup_steps=QUICK_WARMUP_STEPS)


@pytest.fixture
def rllm_home(tmp_path, addition, monkeypatch):
    """A DatasetRegistry holding 'addition' (train: 200 rows, test: 8), registered as an rLLM program would."""
    from rllm.data import DatasetRegistry

    monkeypatch.setenv("RLLM_HOME", str(tmp_path / "rllm_home"))
    DatasetRegistry.register_dataset("addition", pq.read_table(addition.train_parquet).to_pylist()[:200], "train")
    DatasetRegistry.register_dataset("addition", pq.read_table(addition.val_parquet).to_pylist()[:8], "test")
    return tmp_path / "rllm_home"


def run_program(root: Path, program: str, model_dir: Path, *overrides: str, env: dict | None = None):
    """`python PROGRAM overrides...` in `root`, on a tiny CPU budget: 4 prompts x 4 samples a step, a weight push
    after every step, STEPS steps (rollout.total_rollout_steps / required_samples), one embedded engine."""
    command = [
        sys.executable,
        str(PROGRAMS / program),
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.n=4",
        "async_training.required_samples=4",
        "async_training.trigger_parameter_sync_step=1",
        f"rollout.total_rollout_steps={4 * STEPS}",
        "data.max_prompt_length=16",
        "data.max_response_length=4",
        "+engines.num_engines=1",
        f"+run.dir={root / 'run'}",
        *overrides,
    ]
    full_env = dict(os.environ, RLLM_LOG_LEVEL="WARNING", **(env or {}))
    proc = subprocess.run(command, cwd=root, env=full_env, capture_output=True, text=True, timeout=840)
    output = proc.stdout + proc.stderr
    metrics = root / "run" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    assert proc.returncode == 0, output[-4000:]
    steps = [r for r in rows if "trainer/step" in r]
    assert [r["trainer/step"] for r in steps] == [1.0, 2.0, 3.0]
    assert [r["trainer/version"] for r in steps] == [1.0, 2.0, 3.0]  # a weight push after every step
    ledger = next(r for r in reversed(rows) if "ledger/trained" in r)
    assert ledger["ledger/trained"] == STEPS * 4 * 4 and ledger["ledger/failed"] == 0
    return output, rows, steps


def test_todays_rllm_program_trains_on_a_registered_dataset(tmp_path, rllm_home, addition):
    spec = importlib.util.spec_from_file_location("read_scalars", REPO / "examples" / "tensorboard" / "read_scalars.py")
    read_scalars = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(read_scalars)
    _output, rows, steps = run_program(
        tmp_path,
        "search_style_train.py",
        addition.model_dir,
        "data.train_dataset_name=addition",
        "data.val_dataset_name=addition",
        "rollout.test_freq=2",
        "trainer.experiment_name=search_style",
        "trainer.logger=['console','tensorboard']",
        env={"RLLM_HOME": str(rllm_home), "TENSORBOARD_DIR": str(tmp_path / "tb")},
    )
    for row in steps:
        # the registered row itself: prompt, data_source, ability, reward_model, extra_info (nothing added)
        assert row["custom/row_fields/avg"] == 5.0
        assert 0.0 <= row["custom/is_correct/avg"] <= 1.0 and row["custom/is_correct/max"] <= 1.0
        assert row["fully_async/processing_time/avg"] > 0 and row["fully_async/processing_time/tp99"] > 0
        assert 0.0 <= row["fully_async/partial/partial_ratio"] <= 1.0
        assert row["fully_async/count/current_param_version"] == row["trainer/step"] - 1
        assert "custom/is_partial/avg" in row and "timing_s/agent_loop/tool_calls/mean" not in row  # no tool calls
    validations = [r for r in rows if "val/avg_reward" in r]
    assert len(validations) >= 2  # before training and at least once after
    for val in validations:
        assert val["val/validated_by_val_rollout_fn"] == 1.0 and val["val/num_samples"] == 8.0
        assert val["val/avg_reward"] == val["val/is_correct"]
    scalars = read_scalars.read_scalars(tmp_path / "tb")
    assert [step for step, _ in scalars["custom/is_correct/avg"]] == [1, 2, 3]


def test_the_dapo_examples_closure_carries_the_config_it_captured(tmp_path, rllm_home, addition):
    output, _rows, steps = run_program(
        tmp_path,
        "dapo_train.py",
        addition.model_dir,
        "+async_training.dataset_name=addition",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=2",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
        "trainer.val_before_train=False",
        "trainer.experiment_name=dapo",
        env={"RLLM_HOME": str(rllm_home)},
    )
    # main() read the +keys and the closure took them into the rollout service's process
    assert all(row["custom/overlong_penalty_factor/avg"] == 0.5 for row in steps)
    assert "left to the program, not read by the trainer (keys it added): reward_model.reward_kwargs" in output
    # DAPO's overlong penalty (responses beyond max_response_length - len = 2 tokens) went into the reward
    assert all(row["reward/mean"] < 1.0 for row in steps) and any(row["reward/mean"] < 0 for row in steps)


def test_the_batched_datum_form_of_rllms_dapo_example(tmp_path, addition):
    _output, _rows, steps = run_program(
        tmp_path,
        "dapo_batched_train.py",
        addition.model_dir,
        f"data.train_files={addition.train_parquet}",
        "data.val_files=null",
        "trainer.val_before_train=False",
        "trainer.experiment_name=dapo_batched",
    )
    # kwargs["index"][0]: the row's extra_info.index, through the batch-of-one arrays the function indexes
    assert all(0 <= row["custom/datum_index/min"] <= row["custom/datum_index/max"] for row in steps)
