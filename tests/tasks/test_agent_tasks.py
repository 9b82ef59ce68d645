"""The number-line task end to end on a REAL embedded engine: warm-up, data, environment in the worker pool,
multi-turn workflow, GiGPO step groups from repeated states, and a weight sync in the middle of a turn."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from engine_helpers import TEST_ONLY_ROUTES, decode_hold
from run_helpers import QUICK_WARMUP_STEPS
from transformers import AutoTokenizer

from rllm.experimental.fully_async.algorithms.gigpo import compute_gigpo
from rllm.experimental.fully_async.api.trajectory import TrajectoryStatus, VersionedGroup
from rllm.experimental.fully_async.core.batch import groups_to_dataproto
from rllm.experimental.fully_async.data.prompts import PromptDataset, PromptIterator
from rllm.experimental.fully_async.engines import EmbeddedEngineCommand, EngineLauncher
from rllm.experimental.fully_async.engines.client import EngineClient
from rllm.experimental.fully_async.envs import EnvSpec
from rllm.experimental.fully_async.tasks.number_line import MAX_TURNS, prepare_number_line_assets
from rllm.experimental.fully_async.workers import WorkerPool
from rllm.experimental.fully_async.workflows.multi_turn import MultiTurnWorkflow

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]
GROUP = 8


@pytest.fixture(scope="module")
def assets(number_line_cache):
    return prepare_number_line_assets(number_line_cache, seed=0, warmup_steps=QUICK_WARMUP_STEPS)  # the session's


@pytest.fixture(scope="module")
def engine(assets, tmp_path_factory):
    cmd = EmbeddedEngineCommand(
        str(assets.model_dir), max_running_requests=64, num_threads=1, extra_args=TEST_ONLY_ROUTES
    )
    with EngineLauncher(cmd, 1, log_dir=tmp_path_factory.mktemp("agent_engine_logs")) as launcher:
        yield launcher.urls[0]


@pytest.fixture(scope="module")
def tokenizer(assets):
    return AutoTokenizer.from_pretrained(assets.model_dir)


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(max_workers=1) as p:
        yield p


def first_datum(assets, tokenizer):
    dataset = PromptDataset([str(assets.train_parquet)], tokenizer, 16, "error")
    return next(iter(PromptIterator(dataset, seed=0, num_epochs=1, shuffle=False)))


def test_warmup_gives_a_policy_with_room_to_improve(assets):
    assert 0.05 < assets.warmup_val_success < 0.9


def test_group_of_episodes_on_a_real_engine_forms_gigpo_step_groups(assets, engine, tokenizer, pool):
    datum = first_datum(assets, tokenizer)
    workflow = MultiTurnWorkflow(
        EnvSpec(name="number_line", max_turns=MAX_TURNS), {"max_new_tokens": 3, "temperature": 1.0}, pool=pool
    )

    async def group():
        async with EngineClient([engine]) as client:
            return await asyncio.gather(*(workflow.run(client, tokenizer, datum, i) for i in range(GROUP)))

    trajectories = asyncio.run(group())
    assert all(t.status == TrajectoryStatus.OK for t in trajectories), [t.failure_reason for t in trajectories]
    reasons = {t.metadata["end_reason"] for t in trajectories}
    assert reasons <= {"done", "max_turns"}
    for t in trajectories:
        assert len(t.sequences) == len(t.step_rewards) == len(t.step_state_hashes) == t.metadata["num_turns"]
        assert t.reward == sum(t.step_rewards) == (1.0 if t.metadata["end_reason"] == "done" else 0.0)
        for seq, step in zip(t.sequences, t.metadata["steps"], strict=True):
            assert len(seq.prompt_ids) == step["start"] and step["end"] - step["start"] == len(seq.response_ids)
            assert all(v == 0 for v in seq.response_versions) and all(lp <= 0 for lp in seq.response_logprobs)
        # Token in, token out: each step's prompt extends the previous step's prompt + response.
        for prev, nxt in zip(t.sequences, t.sequences[1:], strict=False):
            assert (
                nxt.prompt_ids[: len(prev.prompt_ids) + len(prev.response_ids)] == prev.prompt_ids + prev.response_ids
            )
    data = groups_to_dataproto([VersionedGroup(datum.prompt_uid, trajectories)], pad_token_id=0, temperature=1.0)
    nt = data.non_tensor_batch
    out = compute_gigpo(
        data.batch["token_level_rewards"],
        data.batch["response_mask"],
        nt["uid"],
        nt["traj_uid"],
        nt["step_index"],
        nt["state_hash"],
    )
    _, counts = np.unique(nt["state_hash"].astype(str), return_counts=True)
    assert counts.max() >= GROUP  # every trajectory's first step acts on the same start state
    assert out.stats.mean_step_group_size > 1.0 and out.stats.singleton_step_fraction < 1.0
    # Rows of one step group share the state they acted on, and only such rows are grouped together.
    for group_id in np.unique(out.step_group_ids):
        assert len(set(nt["state_hash"][out.step_group_ids == group_id])) == 1


def test_weight_sync_in_the_middle_of_a_turn_resumes_it_with_new_versions(assets, engine, tokenizer, pool):
    datum = first_datum(assets, tokenizer)
    # Long, EOS-ignoring turns so that the pause lands inside one; the action is then invalid, which is fine.
    workflow = MultiTurnWorkflow(
        EnvSpec(name="number_line", max_turns=2, max_total_tokens=256),
        {"max_new_tokens": 200, "ignore_eos": True, "temperature": 1.0},
        pool=pool,
    )

    async def scenario():
        async with EngineClient([engine]) as client:
            # The pause lands inside the first turn, at its 3rd token: the engine holds there (decode_hold).
            async with decode_hold(engine, min_tokens=3) as hold:
                task = asyncio.ensure_future(workflow.run(client, tokenizer, datum, 0))
                await hold.reached()
                await client.pause_generation(engine, "abort")
            await client.update_weights_from_disk(engine, str(assets.model_dir), weight_version="1")
            await client.continue_generation(engine)
            trajectory = await asyncio.wait_for(task, 120)
            await client.update_weights_from_disk(engine, str(assets.model_dir), weight_version="0")
            return trajectory

    t = asyncio.run(scenario())
    # The second turn used up env.max_total_tokens (256): the episode ended by length.
    assert t.status == TrajectoryStatus.OK and t.metadata["end_reason"] == "length"
    first, second = t.sequences
    assert first.num_resumes == 1 and len(first.response_ids) == 200
    split = first.response_versions.index(1)
    assert split == 3 and first.response_versions == [0] * split + [1] * (200 - split)
    assert set(second.response_versions) == {1} and t.min_version == 0
    assert len(first.prompt_ids) + 200 + 4 + len(second.response_ids) == t.metadata["context_tokens"] == 256
    # The second turn's prompt holds the first turn's tokens exactly, then the observation.
    assert second.prompt_ids[: len(first.prompt_ids) + 200] == first.prompt_ids + first.response_ids


def test_rllm_rollout_function_runs_unchanged_through_the_adapter(assets, engine, tokenizer):
    from pathlib import Path

    from rllm.experimental.fully_async.workers.pool import resolve_reference
    from rllm.experimental.fully_async.workflows.rllm_compat import RllmRolloutWorkflow

    example = Path(__file__).resolve().parents[2] / "examples" / "agents" / "rllm_number_line.py"
    workflow = RllmRolloutWorkflow(resolve_reference(f"{example}:rollout_fn"))
    datum = first_datum(assets, tokenizer)

    async def group():
        async with EngineClient([engine]) as client:
            return await asyncio.gather(*(workflow.run(client, tokenizer, datum, i) for i in range(4)))

    for t in asyncio.run(group()):
        assert t.status == TrajectoryStatus.OK, t.failure_reason
        assert t.reward in (0.0, 1.0) and t.metadata["rllm"]["param_version_end"] == 0
        for seq in t.sequences:
            assert len(seq.response_ids) == len(seq.response_versions) == len(seq.loss_mask) > 0
            assert set(seq.response_versions) == {0} and seq.loss_mask[0] == 1
