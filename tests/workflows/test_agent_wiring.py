"""Agents wired from config: rewards through the worker pool, step rewards on their spans, workflows built from
the config, trajectory dumps and the viewer. A scripted client stands in for the engine (test_multi_turn.py's)."""

from __future__ import annotations

import asyncio
import io
import json
import os

import pytest
from omegaconf import OmegaConf
from rich.console import Console
from workflow_helpers import ScriptedClient, datum

from rllm.experimental.fully_async.algorithms.advantages import compute_advantages
from rllm.experimental.fully_async.api.trajectory import (
    TrajectoryStatus,
    VersionedGroup,
    VersionedSequence,
    VersionedTrajectory,
)
from rllm.experimental.fully_async.core.batch import groups_to_dataproto
from rllm.experimental.fully_async.envs import EnvSpec
from rllm.experimental.fully_async.observe import viewer
from rllm.experimental.fully_async.observe.dumps import read_dump, write_training_batch
from rllm.experimental.fully_async.run_spec import build_run_spec
from rllm.experimental.fully_async.settings.loader import load_config
from rllm.experimental.fully_async.tasks.number_line import build_tokenizer
from rllm.experimental.fully_async.workers import WorkerPool
from rllm.experimental.fully_async.workflows import (
    IsolatedReward,
    MultiTurnWorkflow,
    SingleTurnWorkflow,
    build_workflow,
    load_reward_fn,
    score_safely,
)
from rllm.experimental.fully_async.workflows.rllm_compat import RllmRolloutWorkflow

REWARDS = """
import os, time

def hang_or_score(data_source, solution_str, ground_truth, extra_info=None):
    if "hang" in solution_str:
        time.sleep(3600)
    if "crash" in solution_str:
        os._exit(3)
    return 1.0

def pid(data_source, solution_str, ground_truth, extra_info=None):
    return float(os.getpid())

def shaped(data_source, solution_str, ground_truth, extra_info=None):
    # one step reward per turn: 0.1 for each turn, 1.0 on the last; the score is the env's success
    steps = extra_info["steps"]
    rewards = [{"step_index": s["index"], "reward": 1.0 if s["index"] == len(steps) - 1 else 0.1} for s in steps]
    return {"score": float(sum(extra_info["env_rewards"])), "step_rewards": rewards}

def out_of_range(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0, "step_rewards": [{"step_index": 9, "reward": 1.0}]}
"""


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "rewards.py"
    path.write_text(REWARDS)
    return path


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(max_workers=1) as p:
        yield p


def _cfg(*overrides: str):
    return load_config(None, list(overrides))


def _executor(cfg):
    return build_run_spec(cfg).executor


# --- rewards through the worker pool ------------------------------------------------------------------------------


def test_a_users_reward_runs_in_the_pool_and_a_hung_one_is_killed_with_its_reason(rewards_file, pool):
    cfg = _cfg(f"reward.custom_reward_function.path={rewards_file}", "reward.custom_reward_function.name=pid")
    reward = load_reward_fn(_executor(cfg), pool)
    assert isinstance(reward, IsolatedReward) and reward.reference == f"{rewards_file}:pid"

    def score(fn, text, timeout_s=5.0):
        return asyncio.run(
            score_safely(fn, timeout_s, data_source="d", solution_str=text, ground_truth="1", extra_info=None)
        )

    worker = score(reward, "x").reward
    assert worker != os.getpid(), "the reward ran in a worker process, not here"
    hang = IsolatedReward(f"{rewards_file}:hang_or_score", pool)
    outcome = score(hang, "hang", timeout_s=1.0)
    assert outcome.reward is None and outcome.failure.startswith("reward_timeout: no result within 1s (worker killed)")
    assert score(reward, "x").reward != worker, "the hung call's worker was killed and replaced"
    crashed = score(hang, "crash")
    assert crashed.failure.startswith("reward_error:") and "exit code 3" in crashed.failure
    assert score(hang, "fine").reward == 1.0


def test_built_in_task_rewards_stay_in_process_and_without_a_pool_nothing_is_isolated(rewards_file, pool):
    from rllm.experimental.fully_async.tasks import addition

    built_in = _cfg(f"reward.custom_reward_function.path={addition.__name__}")
    assert load_reward_fn(_executor(built_in), pool) is addition.compute_score
    user = _cfg(f"reward.custom_reward_function.path={rewards_file}", "reward.custom_reward_function.name=pid")
    assert not isinstance(load_reward_fn(_executor(user)), IsolatedReward)
    default = load_reward_fn(_executor(_cfg()), pool)
    assert isinstance(default, IsolatedReward) and default.reference.endswith(":default_compute_score")


# --- step rewards from a reward function --------------------------------------------------------------------------


def test_step_rewards_from_the_reward_function_land_on_their_turns_rows(tok, rewards_file, pool):
    shaped = IsolatedReward(f"{rewards_file}:shaped", pool)
    workflow = MultiTurnWorkflow(EnvSpec(name="number_line", max_turns=4), {"max_new_tokens": 3}, reward_fn=shaped)
    traj = asyncio.run(workflow.run(ScriptedClient(tok, ["+1", "+1", "+2"]), tok, datum(tok, 3, 7), 0))
    assert traj.status == TrajectoryStatus.OK and traj.metadata["end_reason"] == "done"
    assert traj.step_rewards == [0.1, 0.1, 1.0] and traj.reward == 1.0
    data = groups_to_dataproto([VersionedGroup("p0", [traj])], pad_token_id=0, temperature=1.0)
    scores = data.batch["token_level_rewards"]
    for row, seq in enumerate(traj.sequences):
        # each turn's reward on its own row, on the last token of that turn's span
        assert scores[row, len(seq.response_ids) - 1] == pytest.approx(traj.step_rewards[row])
        assert scores[row].sum() == pytest.approx(traj.step_rewards[row])
        span = traj.metadata["steps"][row]
        assert seq.prompt_ids == traj.sequences[-1].prompt_ids[: span["start"]] or row == len(traj.sequences) - 1

    bad = MultiTurnWorkflow(
        EnvSpec(name="number_line"),
        {"max_new_tokens": 3},
        reward_fn=IsolatedReward(f"{rewards_file}:out_of_range", pool),
    )
    failed = asyncio.run(bad.run(ScriptedClient(tok, ["+3", "+1"]), tok, datum(tok, 3, 7), 0))
    assert failed.status == TrajectoryStatus.FAILED
    assert failed.failure_reason.startswith("reward_bad_step_rewards: ValueError: step_index 9 outside")


def test_a_score_only_reward_sits_on_the_last_turn(tok):
    def score(data_source, solution_str, ground_truth, extra_info=None):
        return 0.5 if solution_str.endswith("7>7:") or extra_info["end_reason"] == "done" else 0.0

    workflow = MultiTurnWorkflow(EnvSpec(name="number_line"), {"max_new_tokens": 3}, reward_fn=score)
    traj = asyncio.run(workflow.run(ScriptedClient(tok, ["+3", "+1"]), tok, datum(tok, 3, 7), 0))
    assert traj.step_rewards == [0.0, 0.5] and traj.reward == 0.5


# --- workflows built from the config ------------------------------------------------------------------------------


AGENT = ["workflow.name=multi_turn", "env.name=number_line", "env.max_turns=3", "env.max_total_tokens=48"]


def test_the_config_builds_multi_turn_single_turn_and_rllm_workflows(tmp_path, pool):
    cfg = _cfg(*AGENT, "workflow.layout=concat", "tools.functions={c: calculator}", "tools.format=compact")
    workflow = build_workflow(_executor(cfg), reward_fn=None, pool=pool)
    assert isinstance(workflow, MultiTurnWorkflow) and workflow.pool is pool and workflow.layout == "concat"
    assert workflow.env.max_turns == 3 and workflow.env.max_total_tokens == 48 and workflow.reward_fn is None
    assert workflow.tools.format == "compact" and set(workflow.tools.functions) == {"c"}
    assert isinstance(build_workflow(_executor(_cfg()), reward_fn=len), SingleTurnWorkflow)
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "agents", "rllm_number_line.py")
    rllm = build_workflow(
        _executor(_cfg(f"workflow.path={example}", "workflow.name=rollout_fn", "workflow.rllm_batched=true")), None
    )
    assert isinstance(rllm, RllmRolloutWorkflow) and rllm.batched


def test_an_episode_longer_than_the_models_context_is_refused_before_start(tmp_path):
    from rllm.experimental.fully_async.errors import ConfigError
    from rllm.experimental.fully_async.tasks.number_line import MODEL_CONFIG, build_model
    from rllm.experimental.fully_async.workflows import check_agent_fits_model

    model_dir = tmp_path / "m"
    build_model().save_pretrained(model_dir)
    context = MODEL_CONFIG["max_position_embeddings"]
    own = ("task.name=null", f"actor_rollout_ref.model.path={model_dir}", "data.train_files=unused.parquet")
    fits = _cfg(*AGENT[:-1], f"env.max_total_tokens={context}", *own)
    check_agent_fits_model(fits)
    fits.env.max_total_tokens = context + 1
    with pytest.raises(ConfigError, match=rf"'env.max_total_tokens' \({context + 1}\) exceeds .* set env"):
        check_agent_fits_model(fits)


# --- dumps and the viewer -----------------------------------------------------------------------------------------


def _mixed_version_group(tok) -> VersionedGroup:
    """Two episodes of one prompt; the first's second turn was resumed across a weight sync (versions 0 -> 1)."""
    trajectories = []
    for index, (second, versions) in enumerate((("+1", [0, 1, 1]), ("+2", [1, 1, 1]))):
        first_prompt = tok.encode("N3>7:", add_special_tokens=False)
        first = tok.encode("+3<eos>", add_special_tokens=False)
        observation = tok.encode("6>7:", add_special_tokens=False)
        sequences = [
            VersionedSequence(first_prompt, first, [-0.1] * 3, [0, 0, 0]),
            VersionedSequence(first_prompt + first + observation, tok.encode(f"{second}<eos>"), [-0.2] * 3, versions),
        ]
        trajectory = VersionedTrajectory(f"p0/{index}", "p0", sequences, reward=float(index == 0))
        trajectory.step_rewards = [0.0, float(index == 0)]
        trajectory.step_state_hashes = ["a", "b"]
        trajectory.metadata["end_reason"] = "done" if index == 0 else "max_turns"
        trajectories.append(trajectory)
    return VersionedGroup("p0", trajectories)


def test_training_dump_holds_tokens_masks_versions_rewards_and_advantages_per_step(tmp_path, tok):
    group = _mixed_version_group(tok)
    data = groups_to_dataproto([group], pad_token_id=0, temperature=1.0)
    data = compute_advantages(data, "gigpo")
    write_training_batch(tmp_path, 7, [group], data, tok)
    step, records = read_dump(tmp_path)
    assert step == 7 and [r["uid"] for r in records] == ["p0/0", "p0/1"]
    first = records[0]
    assert first["step_rewards"] == [0.0, 1.0] and first["end_reason"] == "done" and first["state_hashes"] == ["a", "b"]
    turn = first["sequences"][1]
    assert turn["versions"] == [0, 1, 1] and turn["loss_mask"] == [1, 1, 1] and turn["response_tokens"][-1] == "<eos>"
    rows = {
        (u, i): r
        for r, (u, i) in enumerate(
            zip(data.non_tensor_batch["traj_uid"], data.non_tensor_batch["step_index"], strict=True)
        )
    }
    for record in records:
        for seq in record["sequences"]:
            row = rows[(record["uid"], seq["step_index"])]
            assert seq["advantages"] == pytest.approx(data.batch["advantages"][row, :3].tolist(), abs=1e-4)
    # the winning episode's second turn (state "b" shared by both) beats the other's: GiGPO's step term
    assert records[0]["sequences"][1]["advantages"][0] > records[1]["sequences"][1]["advantages"][0]
    assert not (tmp_path / ".7.jsonl.tmp").exists() and json.loads((tmp_path / "7.jsonl").read_text().splitlines()[0])


def test_viewer_prints_turns_coloured_by_mask_and_version_and_plain_text_off_a_terminal(tmp_path, tok, capsys):
    group = _mixed_version_group(tok)
    data = compute_advantages(groups_to_dataproto([group], pad_token_id=0, temperature=1.0), "gigpo")
    write_training_batch(tmp_path, 3, [group], data, tok)
    assert viewer.main([str(tmp_path)]) == 0  # captured stdout is not a terminal: plain text
    plain = capsys.readouterr().out
    assert "\x1b[" not in plain
    assert "p0/0  reward 1  end done" in plain
    # turn 0: the prompt masked, then v0 tokens; turn 1: only the new observation masked, then v0 -> v1 inside a turn
    assert "{N3>7:}[v0]+3<eos>" in plain and "{6>7:}[v0]+[v1]1<eos>" in plain
    assert "turn 1  step reward 1  advantage +" in plain

    terminal = io.StringIO()
    console = Console(file=terminal, force_terminal=True, color_system="standard", width=120)
    assert viewer.main([str(tmp_path), "--step", "3", "--limit", "1"], console=console) == 0
    coloured = terminal.getvalue()
    assert "\x1b[" in coloured and "[v0]" not in coloured and "{" not in coloured.split("legend")[1].split("\n", 1)[1]
    assert viewer.main([str(tmp_path), "--step", "4"]) == 2
    assert "no dump for step 4" in capsys.readouterr().err


def test_view_is_a_cli_command(tmp_path, tok):
    from rllm.experimental.fully_async.__main__ import COMMANDS, main

    assert "view" in COMMANDS
    group = _mixed_version_group(tok)
    write_training_batch(tmp_path, 1, [group], groups_to_dataproto([group], pad_token_id=0, temperature=1.0), tok)
    assert main(["view", str(tmp_path), "--limit", "1"]) == 0


def test_validation_sampling_comes_from_val_kwargs():
    from rllm.experimental.fully_async.run_spec import validation_sampling_spec

    cfg = _cfg(
        *AGENT,
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0.7",
        "actor_rollout_ref.rollout.val_kwargs.n=5",
    )
    spec = validation_sampling_spec(cfg)
    assert spec.n == 5 and spec.temperature == 0.7
    assert validation_sampling_spec(_cfg(*AGENT)).temperature == 0.0
    assert OmegaConf.select(cfg, "workflow.name") == "multi_turn"
