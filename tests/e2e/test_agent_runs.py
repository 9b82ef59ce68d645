"""Agents end to end through the CLI: config/agent_cpu.yaml (multi_turn, GiGPO) for a few steps with a user reward
that hangs on some episodes, and an rLLM rollout function plugged in by path, each trained for a few steps.

Checked: the runs exit 0 and train every step; hung rewards were killed by their timeout and ledgered
failed/reward_timeout while the run went on; the dumps hold every trained trajectory with per-token versions and
masks that line up and no token older than max_staleness; validation episodes are dumped; `view` reads them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from run_helpers import QUICK_WARMUP_STEPS

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # CLI runs end to end

USER_REWARD = """
import time

def shaped(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["start"] == 0:  # a reward that hangs on some episodes: killed by workflow.reward_timeout_s
        time.sleep(3600)
    steps = extra_info["steps"]
    step_rewards = [{"step_index": s["index"], "reward": s["reward"]} for s in steps]
    return {"score": float(sum(extra_info["env_rewards"])), "step_rewards": step_rewards}
"""


def _run(root: Path, cache: Path, *overrides: str, config: Path = REPO / "config" / "agent_cpu.yaml"):
    command = [
        sys.executable,
        "-m",
        "rllm.experimental.fully_async",
        "--config",
        str(config),
        f"run.dir={root / 'run'}",
        f"task.cache_dir={cache}",
        f"task.warmup_steps={QUICK_WARMUP_STEPS}",
        f"trainer.total_training_steps={STEPS}",
        "trainer.test_freq=2",
        "async_training.required_samples=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.val_kwargs.n=2",
        f"trainer.rollout_data_dir={root / 'dumps'}",
        f"trainer.validation_data_dir={root / 'val'}",
        *overrides,
    ]
    env = dict(os.environ, RLLM_LOG_LEVEL="WARNING", PYTHONPATH=str(REPO))
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=540)
    output = proc.stdout + proc.stderr
    metrics = root / "run" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return proc.returncode, output, rows


def _dumped(directory: Path) -> list[dict]:
    return [json.loads(line) for p in sorted(directory.glob("*.jsonl")) for line in p.read_text().splitlines()]


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory, number_line_cache):
    root = tmp_path_factory.mktemp("agent_run")
    (root / "reward.py").write_text(USER_REWARD)
    code, output, rows = _run(
        root,
        number_line_cache,
        f"reward.custom_reward_function.path={root / 'reward.py'}",
        "reward.custom_reward_function.name=shaped",
        "workflow.reward_timeout_s=1.0",
    )
    return code, output, rows, root


def test_agent_config_trains_every_step_with_gigpo_step_groups(agent_run):
    code, output, rows, _ = agent_run
    assert code == 0, output[-3000:]
    steps = [r for r in rows if "trainer/step" in r]
    assert len(steps) == STEPS
    assert all(r["gigpo/num_steps"] > r["gigpo/num_trajectories"] for r in steps), "multi-step rows reached GiGPO"
    assert any(r["gigpo/mean_step_group_size"] > 1 for r in steps), "identical states formed step groups"
    assert "validation accuracy" in output and any("val/accuracy" in r for r in rows)


def test_hung_user_rewards_are_killed_and_ledgered_while_the_run_goes_on(agent_run):
    _, _, rows, root = agent_run
    final = rows[-1]
    assert final.get("ledger/failed/reward_timeout", 0) >= 1, final
    assert final["ledger/trained"] >= STEPS * 4 * 4 * 0.5
    assert not any(r["start"] == 0 for r in _starts(_dumped(root / "dumps"))), "hung episodes were never trained"


def _starts(records: list[dict]) -> list[dict]:
    return [{"start": int(r["sequences"][0]["prompt_text"][1])} for r in records if r["sequences"]]


def test_dumps_hold_every_trained_turn_with_versions_and_masks_lined_up(agent_run):
    _, _, rows, root = agent_run
    records = _dumped(root / "dumps")
    assert sorted(int(p.stem) for p in (root / "dumps").glob("*.jsonl")) == list(range(1, STEPS + 1))
    trained = [r for r in records if r["status"] == "ok"]
    assert len(trained) == sum(r["batch/samples"] for r in rows if "batch/samples" in r)
    for record in trained:
        assert len(record["step_rewards"]) == len(record["sequences"]) == len(record["state_hashes"])
        assert record["end_reason"] in ("done", "max_turns", "length")
        for seq in record["sequences"]:
            n = len(seq["response_ids"])
            assert len(seq["versions"]) == len(seq["loss_mask"]) == len(seq["advantages"]) == n
            assert seq["versions"] == sorted(seq["versions"]), "a resumed turn's versions only go up"
            assert record["step"] - 1 - min(seq["versions"]) <= 1, "no token older than max_staleness"
    assert _dumped(root / "val"), "validation episodes were dumped"
    view = subprocess.run(
        [sys.executable, "-m", "rllm.experimental.fully_async", "view", str(root / "dumps"), "--limit", "2"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=120,
    )
    assert view.returncode == 0 and f"step {STEPS}" in view.stdout and "turn 0" in view.stdout


def test_an_rllm_rollout_function_trains_unchanged(tmp_path, number_line_cache):
    code, output, rows = _run(
        tmp_path,
        number_line_cache,
        f"workflow.path={REPO / 'examples' / 'agents' / 'rllm_number_line.py'}",  # the YAML's is relative
        config=REPO / "examples" / "agents" / "rllm_number_line.yaml",
    )
    assert code == 0, output[-3000:]
    assert len([r for r in rows if "trainer/step" in r]) == STEPS
    records = [r for r in _dumped(tmp_path / "dumps") if r["status"] == "ok"]
    assert len(records) == sum(r["batch/samples"] for r in rows if "batch/samples" in r)
    for record in records:
        for seq in record["sequences"]:
            assert len(seq["versions"]) == len(seq["loss_mask"]) == len(seq["response_ids"]) == len(seq["advantages"])
    # rLLM's merge() joins turns whose ids extend the previous turn (the observation then has loss mask 0) and
    # keeps the others as separate sequences (one training row each): both happen with this chat template.
    assert any(0 in s["loss_mask"] for r in records for s in r["sequences"])
    assert any(len(r["sequences"]) > 1 for r in records)
