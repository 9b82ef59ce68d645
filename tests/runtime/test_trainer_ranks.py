"""The trainer's worker group on CPU: two gloo ranks as Ray actors behind FSDPPolicyBackend's interface.

One 2-rank group (dynamic micro-batching, a 7-row batch with uneven token counts, so it is padded and split by
tokens) is judged against one in-process rank on the same batch: log-probs, the optimizer step, the HF export, and
a torch.distributed.checkpoint written by 2 ranks resumed by a fresh 2-rank group and by 1 rank. The run's checkpoint
(trainer.pt plus every rank's shard, committed by the checkpoint store) resumes 2 -> 2, 2 -> 1 and 1 -> 2; the first
format's full state is refused where it cannot fit. A killed rank fails the next call with one line.
"""

from __future__ import annotations

import pytest
import torch
from backend_helpers import actor_cfg
from test_trainer import LocalRollouts, _advantages, _settings
from transformers import AutoModelForCausalLM
from verl import DataProto
from verl_helpers import BATCH_SIZE, RESPONSE_LEN, make_batch, response_log_probs

from rllm.experimental.fully_async.backends.fsdp import FSDPPolicyBackend
from rllm.experimental.fully_async.runtime.checkpoints.format import TRAINER_FILE, file_sha256, write_rollout_part
from rllm.experimental.fully_async.runtime.checkpoints.store import (
    Checkpoint,
    CheckpointError,
    CheckpointManager,
    load_checkpoint,
)
from rllm.experimental.fully_async.runtime.checkpoints.trainer_state import (
    POLICY_SHARDS,
    load_trainer_part,
    write_trainer_part,
)
from rllm.experimental.fully_async.runtime.trainer.fully_async_trainer import FullyAsyncTrainer
from rllm.experimental.fully_async.runtime.trainer.ranks import (
    DistributedPolicyBackend,
    RankFailedError,
    split_by_tokens,
)

# A budget of 9 tokens (the longest row) cuts several dynamic micro-batches per rank, of different counts.
CFG = actor_cfg(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=9, ppo_infer_max_token_len_per_gpu=9)
TIMEOUTS = {"call_timeout_s": 120.0, "setup_timeout_s": 180.0}


def odd_batch(seed: int, backend: FSDPPolicyBackend) -> DataProto:
    """7 rows (6 + 1: not divisible by 2 ranks) with old_log_probs off the current policy by some noise."""
    data = DataProto.concat([make_batch(seed), make_batch(seed + 100)[:1]])
    data.batch["response_mask"] = data.batch["response_mask"].float()
    noise = 0.3 * torch.randn(len(data), RESPONSE_LEN, generator=torch.Generator().manual_seed(seed))
    data.batch["old_log_probs"] = backend.compute_log_prob(data) + noise
    return data


def full_params(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in state["model"].items()}


def assert_same_params(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def assert_same_state(got: dict, expected: dict) -> None:
    """Model, Adam moments and step counts, LR schedule: bit for bit (same world size, nothing recomputed)."""
    assert_same_params(full_params(got), full_params(expected))
    assert got["optimizer_steps"] == expected["optimizer_steps"] and got["lr_scheduler"] == expected["lr_scheduler"]
    exp_state, got_state = expected["optimizer"]["state"], got["optimizer"]["state"]
    assert set(got_state) == set(exp_state) and exp_state
    for name, moments in exp_state.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(got_state[name][key], moments[key], rtol=0, atol=0, msg=f"{name}.{key}")


def test_split_is_balanced_by_tokens_with_masked_padding():
    data = DataProto.concat([make_batch(1), make_batch(2)[:1]])
    shards, parts, rows = split_by_tokens(data, 2)
    assert rows == 7 and sorted(i for p in parts for i in p) == list(range(8))
    assert [len(s) for s in shards] == [4, 4]
    tokens = [int(s.batch["attention_mask"].sum()) for s in shards]
    assert abs(tokens[0] - tokens[1]) <= 9, tokens  # within one row's length
    holder = next(r for r, p in enumerate(parts) if 7 in p)
    assert shards[holder].batch["response_mask"][parts[holder].index(7)].sum() == 0  # the padding row adds no loss
    assert data.batch["response_mask"][0].sum() > 0  # the caller's batch is untouched


@pytest.fixture(scope="module")
def two_ranks(ray_session, tiny_model_dir):
    group = DistributedPolicyBackend(tiny_model_dir, CFG, world=2, device="cpu", **TIMEOUTS)
    yield group
    group.shutdown()


@pytest.mark.slow  # two gloo rank actors (~25 s on a busy 2-core machine)
def test_two_ranks_match_one_rank_then_resume_from_their_checkpoint(two_ranks, tiny_model_dir, tmp_path):
    single = FSDPPolicyBackend(tiny_model_dir, CFG)
    data = odd_batch(11, single)

    # log-probs come back in the batch's row order, padding dropped
    torch.testing.assert_close(two_ranks.compute_log_prob(data), single.compute_log_prob(data), rtol=1e-5, atol=1e-5)

    # one optimizer step across both ranks equals the whole-batch step of one rank
    single_metrics, group_metrics = single.update_policy(data), two_ranks.update_policy(data)
    assert group_metrics["actor/optimizer_step"] == single_metrics["actor/optimizer_step"] == 1.0
    assert group_metrics["actor/grad_norm"] == pytest.approx(single_metrics["actor/grad_norm"], rel=1e-5)
    assert group_metrics["actor/pg_loss"] == pytest.approx(single_metrics["actor/pg_loss"], rel=1e-4, abs=1e-7)
    group_state = two_ranks.state_dict()
    assert_same_params(full_params(group_state), single.state_dict()["model"])

    # full HF weights from rank 0 load into transformers and give the same log-probs
    two_ranks.save_hf(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, attn_implementation="sdpa")
    probe = make_batch(seed=9)
    with torch.no_grad():
        torch.testing.assert_close(response_log_probs(loaded, probe), single.compute_log_prob(probe))

    # a checkpoint written shard by shard resumes into one rank: the next step lands where the group's does,
    # so the Adam moments and the schedule came along
    files = two_ranks.save_checkpoint(tmp_path / "dcp")
    # each rank wrote its own shard (nothing gathered); the ranks' hashes cover every file of the folder
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "extra.pt"} == set(files)
    assert set(files) == {entry.name for entry in (tmp_path / "dcp").iterdir()}
    for name, entry in files.items():
        assert entry == {
            "bytes": (tmp_path / "dcp" / name).stat().st_size,
            "sha256": file_sha256(tmp_path / "dcp" / name),
        }
    resumed = FSDPPolicyBackend(tiny_model_dir, CFG, seed=5)
    resumed.load_checkpoint(tmp_path / "dcp")
    assert resumed.optimizer_steps == 1
    assert_same_params(resumed.state_dict()["model"], full_params(group_state))
    second = odd_batch(12, single)
    resumed.update_policy(second)
    two_ranks.update_policy(second)
    assert_same_params(resumed.state_dict()["model"], full_params(two_ranks.state_dict()))
    assert BATCH_SIZE == 6  # odd_batch's 7 rows assume it


@pytest.mark.slow  # two more gloo rank actors (~25 s on a busy 2-core machine)
def test_two_ranks_keep_the_previous_version_at_each_sync_as_one_rank_does(ray_session, tiny_model_dir):
    """prox_log_probs=previous over a rank group: `weights_synced` reaches every rank, each keeps its shard of the
    version it retires, and the log-probs under it equal one rank's after the same steps and syncs (K = 2 here)."""
    single = FSDPPolicyBackend(tiny_model_dir, CFG, keep_previous_weights=True)
    group = DistributedPolicyBackend(tiny_model_dir, CFG, world=2, device="cpu", keep_previous_weights=True, **TIMEOUTS)
    try:
        probe = odd_batch(20, single)
        for seed in (21, 22, 23):
            batch = odd_batch(seed, single)  # old log-probs from the weights both hold before this step
            for backend in (single, group):
                backend.update_policy(batch)
                if seed != 22:  # syncs after the first and the third step
                    backend.weights_synced()
        previous = single.compute_log_prob(probe, weights="previous")
        torch.testing.assert_close(group.compute_log_prob(probe, weights="previous"), previous, rtol=1e-5, atol=1e-5)
        assert (previous - single.compute_log_prob(probe)).abs().max() > 1e-4  # two steps back: not the current
    finally:
        group.shutdown()


def _trainer(backend, step: int = 0, version: int = 0) -> FullyAsyncTrainer:
    return FullyAsyncTrainer(_settings(), backend, LocalRollouts([]), None, _advantages(), step=step, version=version)


def _run_checkpoint(trainer: FullyAsyncTrainer, root) -> Checkpoint:
    """The trainer part through the run's checkpoint store: written into the save's temporary folder (the trainer
    actor's `write_checkpoint`), committed by one rename, loaded and verified as a resume does."""
    manager = CheckpointManager(root)
    tmp = manager.begin(trainer.step)
    files = write_trainer_part(tmp, trainer) | write_rollout_part(tmp, {}, [])
    return load_checkpoint(manager.commit(tmp, trainer.step, files, {}))


@pytest.mark.slow  # two gloo rank actors (~20 s on a busy 2-core machine)
def test_run_checkpoint_holds_every_ranks_shard_and_resumes_at_two_or_one_rank(two_ranks, tiny_model_dir, tmp_path):
    single = FSDPPolicyBackend(tiny_model_dir, CFG)
    two_ranks.update_policy(odd_batch(14, single))
    saved = _run_checkpoint(_trainer(two_ranks, step=3, version=2), tmp_path / "two")
    at_checkpoint = two_ranks.state_dict()

    # trainer.pt refers to the shards, one per rank, inside the committed checkpoint and in its manifest
    assert saved.trainer["backend"] == {"shards": POLICY_SHARDS, "world_size": 2}
    shards = {p.name for p in (saved.path / POLICY_SHARDS).iterdir()}
    assert shards == {"__0_0.distcp", "__1_0.distcp", ".metadata", "extra.pt"}
    manifest = (saved.path / "COMPLETE").read_text()
    assert all(f'"{POLICY_SHARDS}/{name}"' in manifest for name in shards)
    shard_bytes = sum(p.stat().st_size for p in (saved.path / POLICY_SHARDS).iterdir())
    assert (saved.path / TRAINER_FILE).stat().st_size < shard_bytes / 20  # no weights or moments in trainer.pt
    two_ranks.update_policy(odd_batch(15, single))  # the group moves on: a resume must bring back the checkpoint

    fresh = DistributedPolicyBackend(tiny_model_dir, CFG, world=2, device="cpu", seed=7, **TIMEOUTS)
    try:
        # 2 -> 2: each rank reads its shard; weights, Adam moments and schedule bit for bit
        resumed = _trainer(fresh)
        load_trainer_part(saved.path, saved.trainer, resumed)
        assert (resumed.step, resumed.version) == (3, 2)
        assert_same_state(fresh.state_dict(), at_checkpoint)

        # 2 -> 1: one rank reads both shards (DCP reshards); the next step lands where the group's does
        one = _trainer(FSDPPolicyBackend(tiny_model_dir, CFG, seed=5))
        load_trainer_part(saved.path, saved.trainer, one)
        assert one.backend.optimizer_steps == at_checkpoint["optimizer_steps"]
        assert_same_params(one.backend.state_dict()["model"], full_params(at_checkpoint))
        batch = odd_batch(16, single)
        one.backend.update_policy(batch)
        fresh.update_policy(batch)
        assert_same_params(one.backend.state_dict()["model"], full_params(fresh.state_dict()))

        # 1 -> 2: a one-rank run's checkpoint (one shard) resumes into the group, Adam moments included
        saved_one = _run_checkpoint(_trainer(one.backend, step=5, version=4), tmp_path / "one")
        assert saved_one.trainer["backend"] == {"shards": POLICY_SHARDS, "world_size": 1}
        load_trainer_part(saved_one.path, saved_one.trainer, resumed)
        assert (resumed.step, resumed.version) == (5, 4)
        batch = odd_batch(17, single)
        one.backend.update_policy(batch)
        fresh.update_policy(batch)
        assert_same_params(full_params(fresh.state_dict()), one.backend.state_dict()["model"])

        # the first format: a state gathered from 2 ranks loads into 2 ranks; a world-1 full state cannot, and
        # says so in one line naming both world sizes
        gathered = _trainer(two_ranks, step=6, version=5).state_dict()
        load_trainer_part(tmp_path, gathered, resumed)
        assert_same_state(fresh.state_dict(), gathered["backend"])
        with pytest.raises(
            CheckpointError, match=r"world size 1 \(the first checkpoint format\).* world size 2"
        ) as info:
            load_trainer_part(tmp_path, _trainer(one.backend).state_dict(), resumed)
        assert "\n" not in str(info.value)
        with pytest.raises(CheckpointError, match=r"world size > 1 \(the first checkpoint format\).* world size 1"):
            load_trainer_part(tmp_path, gathered, one)

        import ray

        ray.kill(fresh._ranks[1])
        with pytest.raises(RankFailedError, match=r"^trainer rank 1 of 2 died during update_policy: ") as info:
            fresh.update_policy(odd_batch(13, single))
        assert "\n" not in str(info.value)
        with pytest.raises(RankFailedError, match="down since: trainer rank 1"):
            fresh.compute_log_prob(odd_batch(13, single))
    finally:
        fresh.shutdown()
