"""examples/: your own parquet data, your own reward function, TensorBoard tracking, run for real.

One short training run (2 steps) uses all three through examples/own_data/config.yaml exactly as the README's
"Bringing your own" says: prompts built by make_parquet.py, the example reward loaded through
`reward.custom_reward_function.path/name` (wrapped to record each call), and `trainer.logger=[console,tensorboard]`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
DATA_SOURCE = "examples/sums"
STEPS = 2


def _load(relative: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(Path(relative).stem, EXAMPLES / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_parquet = _load("own_data/make_parquet.py")
reward = _load("own_reward/reward.py")
read_scalars = _load("tensorboard/read_scalars.py")


def _write_problems(path: Path, count: int) -> Path:
    rng = random.Random(3)
    with path.open("w") as handle:
        for _ in range(count):
            a, b = rng.randrange(100), rng.randrange(100)
            handle.write(json.dumps({"prompt": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}", "level": 2}) + "\n")
    return path


def test_make_parquet_writes_verl_rows_split_train_and_val(tmp_path):
    problems = _write_problems(tmp_path / "p.jsonl", 50)
    assert make_parquet.main([str(problems), str(tmp_path / "out"), "--val-fraction", "0.2", "--data-source", "x"]) == 0
    train = pd.read_parquet(tmp_path / "out" / "train.parquet")
    val = pd.read_parquet(tmp_path / "out" / "val.parquet")
    assert (len(train), len(val)) == (40, 10)
    row = train.iloc[0]
    assert list(row["prompt"][0]) == ["role", "content"] and row["prompt"][0]["role"] == "user"
    assert row["data_source"] == "x" and row["reward_model"]["style"] == "rule"
    assert row["extra_info"]["split"] == "train" and row["extra_info"]["level"] == 2
    prompts = set(train["prompt"].map(lambda p: p[0]["content"])) | set(val["prompt"].map(lambda p: p[0]["content"]))
    assert len(prompts) == len({json.loads(line)["prompt"] for line in problems.read_text().splitlines()})


def test_make_parquet_names_a_line_without_an_answer(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: each line needs 'prompt' and 'answer'"):
        make_parquet.read_problems(bad)


def test_example_reward_grades_numbers_with_a_format_bonus():
    assert reward.compute_score("s", "046", "046") == 1.0
    assert reward.compute_score("s", "The sum is 46.", "46", {"index": 0}) == 1.0
    assert reward.compute_score("s", "047", "046") == 0.1
    assert reward.compute_score("s", "no idea", "046") == 0.0


@pytest.fixture(scope="module")
def example_run(tmp_path_factory, addition_cache):
    """2 steps with examples/own_data/config.yaml on parquet from make_parquet.py, the example reward, TensorBoard."""
    from run_helpers import QUICK_WARMUP_STEPS

    from rllm.experimental.fully_async.tasks.addition import prepare_addition_assets

    root = tmp_path_factory.mktemp("examples")
    model_dir = prepare_addition_assets(addition_cache, seed=0, warmup_steps=QUICK_WARMUP_STEPS).model_dir
    problems = _write_problems(root / "problems.jsonl", 120)
    subprocess.run(
        [sys.executable, str(EXAMPLES / "own_data/make_parquet.py"), str(problems), "data/my_task",
         "--data-source", DATA_SOURCE],
        cwd=root, check=True, timeout=60,
    )  # fmt: skip
    calls = root / "calls.jsonl"
    # Records each call, then answers with the example's function: proves the configured function is the one used.
    (root / "recording_reward.py").write_text(
        "import importlib.util, json\n"
        f"spec = importlib.util.spec_from_file_location('example_reward', {str(EXAMPLES / 'own_reward/reward.py')!r})\n"
        "example = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(example)\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    score = example.compute_score(data_source, solution_str, ground_truth, extra_info)\n"
        f"    with open({str(calls)!r}, 'a') as f:\n"
        "        f.write(json.dumps([data_source, solution_str, ground_truth, score]) + '\\n')\n"
        "    return score\n"
    )
    command = [
        sys.executable, "-m", "rllm.experimental.fully_async", "--config", str(EXAMPLES / "own_data/config.yaml"),
        f"actor_rollout_ref.model.path={model_dir}",
        f"reward.custom_reward_function.path={root / 'recording_reward.py'}",
        f"trainer.total_training_steps={STEPS}", "trainer.val_before_train=false", "run.dir=run",
    ]  # fmt: skip
    env = dict(os.environ, TENSORBOARD_DIR=str(root / "tb"), PYTHONPATH=str(REPO))
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root


@pytest.mark.slow  # reads a CLI run end to end (example_run)
def test_example_reward_function_scored_the_rollouts_of_our_parquet(example_run):
    calls = [json.loads(line) for line in (example_run / "calls.jsonl").read_text().splitlines()]
    assert len(calls) >= STEPS * 16 * 4  # required_samples x n per step, from examples/own_data/config.yaml
    train = pd.read_parquet(example_run / "data/my_task/train.parquet")
    truths = set(train["reward_model"].map(lambda r: r["ground_truth"]))
    assert {source for source, *_ in calls} == {DATA_SOURCE}
    assert {truth for _, _, truth, _ in calls} <= truths | set(
        pd.read_parquet(example_run / "data/my_task/val.parquet")["reward_model"].map(lambda r: r["ground_truth"])
    )
    assert {score for *_, score in calls} <= {0.0, 0.1, 1.0}
    assert any(score == 0.1 for *_, score in calls)  # the example's format bonus, which no built-in reward gives


@pytest.mark.slow  # reads a CLI run end to end (example_run)
def test_tensorboard_event_files_hold_the_runs_scalars(example_run):
    scalars = read_scalars.read_scalars(example_run / "tb")
    metrics = [json.loads(line) for line in (example_run / "run/metrics.jsonl").read_text().splitlines()]
    logged = [(m["step"], m["reward/mean"]) for m in metrics if "reward/mean" in m]
    assert [step for step, _ in scalars["reward/mean"]] == [step for step, _ in logged] == [1, 2]
    assert [value for _, value in scalars["reward/mean"]] == pytest.approx([v for _, v in logged], rel=1e-6)
