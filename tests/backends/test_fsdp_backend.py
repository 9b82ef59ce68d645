"""FSDPPolicyBackend: log-probs, one PPO step per batch, the LR schedule, HF export and checkpoints, on CPU.

Uses the patched verl of the venv (the backend refuses anything else) and the session's tiny random Qwen2.
The patch's own numbers are proven in test_verl_patch.py; here the backend around it is judged.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from backend_helpers import LR, actor_cfg
from transformers import AutoModelForCausalLM
from verl import DataProto
from verl_helpers import BATCH_SIZE, RESPONSE_LEN, TEMPERATURE, make_batch, make_verl_copy, response_log_probs

from rllm.experimental.fully_async.backends.fsdp import FULLY_ASYNC_FLAG, FSDPPolicyBackend, build_actor_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny model plus a tokenizer file, so save_hf has something to carry over."""
    path = tmp_path_factory.mktemp("model_with_tokenizer")
    shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    return path


def trainer_batch(seed: int, backend: FSDPPolicyBackend, empty: bool = False) -> DataProto:
    """A batch as the trainer builds it: float response_mask, old_log_probs from the backend itself, plus noise."""
    data = make_batch(seed, empty_rows=tuple(range(BATCH_SIZE)) if empty else ())
    data.batch["response_mask"] = data.batch["response_mask"].float()
    noise = 0.1 * torch.randn(BATCH_SIZE, RESPONSE_LEN, generator=torch.Generator().manual_seed(seed))
    data.batch["old_log_probs"] = backend.compute_log_prob(data) + noise
    return data


def params(backend: FSDPPolicyBackend) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in backend.model.parameters()])


def test_fully_async_flag_is_set_on_verls_actor_config(model_dir):
    config = build_actor_config({"ppo_micro_batch_size_per_gpu": 4, "optim": {"lr": 0.5}})
    assert getattr(config, FULLY_ASYNC_FLAG) is True
    assert type(config.optim).__name__ == "FSDPOptimizerConfig" and config.optim.lr == 0.5
    # verl's own flattened defaults (what config.py starts from) build too, with the flag switched on.
    import verl
    from omegaconf import OmegaConf

    generated = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    section = generated.actor_rollout_ref.actor
    section.ppo_micro_batch_size_per_gpu = 8
    config = build_actor_config(section)
    assert config.fully_async is True and config.ppo_micro_batch_size_per_gpu == 8

    backend = FSDPPolicyBackend(model_dir, actor_cfg())
    assert backend.actor.config.fully_async is True and backend.world_size == 1


def test_compute_log_prob_equals_a_plain_forward_at_the_batch_temperature(model_dir):
    reference_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    data = make_batch(seed=5)
    with torch.no_grad():
        expected = response_log_probs(reference_model, data)  # divides logits by TEMPERATURE
    for micro in (1, 4):
        backend = FSDPPolicyBackend(model_dir, actor_cfg(ppo_micro_batch_size_per_gpu=micro))
        got = backend.compute_log_prob(data)
        assert got.shape == (BATCH_SIZE, RESPONSE_LEN) and got.dtype == torch.float32
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert data.meta_info["temperature"] == TEMPERATURE and "micro_batch_size" not in data.meta_info


def test_update_policy_takes_one_step_and_follows_the_warmup_schedule(model_dir):
    backend = FSDPPolicyBackend(model_dir, actor_cfg(optim={"lr": LR, "lr_warmup_steps": 2}))
    lrs = []
    for step in range(4):
        before = params(backend)
        metrics = backend.update_policy(trainer_batch(step, backend))
        assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values()), metrics
        assert metrics["actor/optimizer_step"] == 1.0 and metrics["actor/grad_norm"] > 0
        if step > 0:  # verl's warmup starts at lr 0, so the first step cannot move anything
            assert (params(backend) - before).abs().max() > 0
        lrs.append(metrics["actor/lr"])
    assert lrs == pytest.approx([0.0, LR / 2, LR, LR])
    assert backend.optimizer_steps == 4


def test_batch_without_response_tokens_changes_nothing(model_dir):
    backend = FSDPPolicyBackend(model_dir, actor_cfg())
    backend.update_policy(trainer_batch(0, backend))
    before, lr_before = params(backend), backend.lr_scheduler.get_last_lr()
    metrics = backend.update_policy(trainer_batch(1, backend, empty=True))
    assert metrics["actor/optimizer_step"] == 0.0 and "actor/grad_norm" not in metrics
    assert all(math.isfinite(v) for v in metrics.values())
    assert torch.equal(params(backend), before)
    assert backend.optimizer_steps == 1 and backend.lr_scheduler.get_last_lr() == lr_before


def test_rollout_is_weights_scale_the_loss(model_dir):
    losses = []
    for weight in (None, 2.0):
        backend = FSDPPolicyBackend(model_dir, actor_cfg())
        data = trainer_batch(7, backend)
        if weight is not None:
            data.batch["rollout_is_weights"] = torch.full((BATCH_SIZE, RESPONSE_LEN), weight)
        losses.append(backend.update_policy(data)["actor/pg_loss"])
    assert losses[1] == pytest.approx(2 * losses[0], rel=1e-5)


def test_missing_inputs_are_named(model_dir):
    backend = FSDPPolicyBackend(model_dir, actor_cfg())
    data = trainer_batch(0, backend)
    without_old = DataProto(batch=data.batch.exclude("old_log_probs"), meta_info=dict(data.meta_info))
    with pytest.raises(KeyError, match="old_log_probs"):
        backend.update_policy(without_old)
    with pytest.raises(KeyError, match="temperature"):
        backend.compute_log_prob(DataProto(batch=data.batch, meta_info={}))


def test_save_hf_writes_a_loadable_model_with_the_tokenizer_files(model_dir, tmp_path):
    backend = FSDPPolicyBackend(model_dir, actor_cfg())
    backend.update_policy(trainer_batch(0, backend))
    backend.update_policy(trainer_batch(1, backend))
    out = tmp_path / "weights_v2"
    backend.save_hf(out)
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa")
    data = make_batch(seed=9)
    with torch.no_grad():
        torch.testing.assert_close(response_log_probs(loaded, data), backend.compute_log_prob(data))


def test_state_dict_restores_model_optimizer_and_schedule(model_dir):
    cfg = actor_cfg(optim={"lr": LR, "lr_warmup_steps": 3})
    original = FSDPPolicyBackend(model_dir, cfg)
    original.update_policy(trainer_batch(0, original))
    state = original.state_dict()

    restored = FSDPPolicyBackend(model_dir, cfg, seed=123)
    restored.load_state_dict(state)
    assert restored.optimizer_steps == 1 and torch.equal(params(restored), params(original))
    # One more step from the same state must land on the same weights: Adam moments and the LR warmup came along.
    batch = trainer_batch(1, original)
    m_original = original.update_policy(batch)
    m_restored = restored.update_policy(batch)
    assert m_restored["actor/lr"] == m_original["actor/lr"] == pytest.approx(LR * 1 / 3)
    torch.testing.assert_close(params(restored), params(original), rtol=0, atol=1e-7)


def test_previous_weights_answer_as_the_model_before_the_last_step_and_travel_in_checkpoints(model_dir, tmp_path):
    """prox_log_probs=previous with a sync after every step (K = 1): log-probs under the previous version's weights,
    those before the last optimizer step, equal to a plain forward of a copy of the model taken before it; the
    current weights are untouched by asking; a checkpoint carries them."""
    import copy

    with pytest.raises(ValueError, match="keep_previous_weights"):
        FSDPPolicyBackend(model_dir, actor_cfg()).compute_log_prob(make_batch(seed=1), weights="previous")
    backend = FSDPPolicyBackend(model_dir, actor_cfg(), keep_previous_weights=True)
    probe = make_batch(seed=7)
    torch.testing.assert_close(backend.compute_log_prob(probe, weights="previous"), backend.compute_log_prob(probe))
    for step in range(2):
        before = copy.deepcopy(backend.model)
        backend.update_policy(trainer_batch(step, backend))
        backend.weights_synced()
        current = params(backend)
        with torch.no_grad():
            expected = response_log_probs(before, probe)
        got = backend.compute_log_prob(probe, weights="previous")
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(params(backend), current), "asking for the previous weights put them back"
        assert (got - backend.compute_log_prob(probe)).abs().max() > 1e-4, "the step moved the log-probs"

    backend.save_checkpoint(tmp_path / "ckpt")
    restored = FSDPPolicyBackend(model_dir, actor_cfg(), keep_previous_weights=True)
    restored.load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(params(restored), params(backend))
    torch.testing.assert_close(restored.compute_log_prob(probe, weights="previous"), got, rtol=0, atol=0)
    in_memory = FSDPPolicyBackend(model_dir, actor_cfg(), keep_previous_weights=True)
    in_memory.load_state_dict(backend.state_dict())
    torch.testing.assert_close(in_memory.compute_log_prob(probe, weights="previous"), got, rtol=0, atol=0)


def test_with_several_steps_per_sync_the_previous_weights_are_the_version_before_the_last_sync(model_dir, tmp_path):
    """K = 2: the proximal policy is the weights the engines held before the last sync (version V - 1), not the
    weights one optimizer step back; between syncs it stays put, and a checkpoint taken between two syncs gives back
    both the previous version and the version the next sync will retire."""
    import copy

    backend = FSDPPolicyBackend(model_dir, actor_cfg(), keep_previous_weights=True)
    probe = make_batch(seed=7)

    def log_probs_of(model: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return response_log_probs(model, probe)

    version = [copy.deepcopy(backend.model)]  # version 0: the initial weights
    step = 0
    for _ in range(2):  # two syncs, K = 2 steps each
        for _ in range(2):
            backend.update_policy(trainer_batch(step, backend))
            step += 1
        backend.weights_synced()
        version.append(copy.deepcopy(backend.model))
    # version 2 is in force: pi_prox is version 1's, the weights 2 steps back, not the weights 1 step back
    torch.testing.assert_close(backend.compute_log_prob(probe, weights="previous"), log_probs_of(version[1]))
    one_step_back = copy.deepcopy(backend.model)
    backend.update_policy(trainer_batch(step, backend))  # a step between syncs moves nothing of it
    expected = log_probs_of(version[1])
    torch.testing.assert_close(backend.compute_log_prob(probe, weights="previous"), expected)
    assert (expected - log_probs_of(one_step_back)).abs().max() > 1e-4, "the versions differ: not vacuous"

    backend.save_checkpoint(tmp_path / "ckpt")  # between syncs: the published version 2 is not the current weights
    restored = FSDPPolicyBackend(model_dir, actor_cfg(), keep_previous_weights=True)
    restored.load_checkpoint(tmp_path / "ckpt")
    got = backend.compute_log_prob(probe, weights="previous")
    torch.testing.assert_close(restored.compute_log_prob(probe, weights="previous"), got, rtol=0, atol=0)
    for resumed in (backend, restored):  # the next sync retires version 2 into the previous version
        resumed.weights_synced()
        torch.testing.assert_close(resumed.compute_log_prob(probe, weights="previous"), log_probs_of(version[2]))


# ----------------------------------------------------------------------------------------------------------------
# World size 2: FSDP2 over a gloo CPU mesh, each rank holding half the batch
# ----------------------------------------------------------------------------------------------------------------

_FSDP2_WORKER = r"""
import json, sys, datetime, torch, torch.distributed as dist
from verl_helpers import make_batch
from backend_helpers import actor_cfg
from rllm.experimental.fully_async.backends.fsdp import FSDPPolicyBackend

rank, world = int(sys.argv[1]), int(sys.argv[2])
store_path, model_dir, out = sys.argv[3:6]
spec = json.loads(sys.argv[6])
# gloo honours the timeout: a collective left waiting by the other rank raises instead of hanging
timeout = datetime.timedelta(seconds=60)
dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world, timeout=timeout)
keep = spec["keep_previous"]
backend = FSDPPolicyBackend(model_dir, actor_cfg(**spec["cfg"]), keep_previous_weights=keep, lora=spec["lora"])
data = make_batch(seed=11)
data.batch["response_mask"] = data.batch["response_mask"].float()
data.batch["old_log_probs"] = torch.load(out + ".old.pt")
shard = data[spec["rows"][rank]]  # each rank holds a different part of the batch
log_probs = backend.compute_log_prob(shard)
metrics = backend.update_policy(shard)
if spec["lora"]:
    backend.save_adapter(out + ".adapter")  # collective: the adapter's shards gathered, rank 0 writes
if keep:  # the weights before the step (a sync after it), from this rank's shard copy, and from a checkpoint of it
    backend.weights_synced()
    torch.save(backend.compute_log_prob(shard, weights="previous"), f"{out}.prev{rank}.pt")
    backend.save_checkpoint(out + ".ckpt")
    restored = FSDPPolicyBackend(model_dir, actor_cfg(**spec["cfg"]), keep_previous_weights=True)
    restored.load_checkpoint(out + ".ckpt")
    torch.save(restored.compute_log_prob(shard, weights="previous"), f"{out}.prevckpt{rank}.pt")
state = backend.state_dict()["model"]  # collective; full tensors on rank 0
torch.save(log_probs, f"{out}.logp{rank}.pt")
if rank == 0:
    torch.save({k: v.float() for k, v in state.items()}, out)
    json.dump({"metrics": metrics, "rows": len(shard)}, open(out + ".json", "w"))
dist.destroy_process_group()
"""

WORLD_TIMEOUT_S = 240.0


def _run_world(
    rows: list[list[int]],
    model_dir: Path,
    tmp_path: Path,
    old_log_probs: torch.Tensor,
    keep_previous: bool = False,
    lora: dict | None = None,
    **cfg,
) -> tuple[dict, dict, list[torch.Tensor]]:
    """Run _FSDP2_WORKER on one process per entry of `rows` (a FileStore rendezvous: no ports).

    Returns rank 0's full weights, its report and every rank's log-probs of its rows (before the step).
    """
    world = len(rows)
    out = tmp_path / f"world{world}.pt"
    torch.save(old_log_probs, f"{out}.old.pt")
    store = tmp_path / f"store{world}"
    tests_dir = Path(__file__).resolve().parent
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(tests_dir), str(tests_dir.parent / "helpers"), str(tests_dir.parents[1])]),
    }
    args = [
        str(store),
        str(model_dir),
        str(out),
        json.dumps({"rows": rows, "cfg": cfg, "keep_previous": keep_previous, "lora": lora}),
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _FSDP2_WORKER, str(rank), str(world), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    try:
        for rank, proc in enumerate(procs):
            try:
                _, stderr = proc.communicate(timeout=WORLD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} of {world} still running after {WORLD_TIMEOUT_S:.0f} s: a collective hung")
            assert proc.returncode == 0, stderr[-4000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    log_probs = [torch.load(f"{out}.logp{rank}.pt") for rank in range(world)]
    return torch.load(out), json.loads(Path(f"{out}.json").read_text()), log_probs


def _single_process_step(
    model_dir: Path, lora: dict | None = None, **cfg
) -> tuple[FSDPPolicyBackend, torch.Tensor, torch.Tensor, dict]:
    """The reference: one process, the whole batch. Returns the backend, old_log_probs, log-probs, metrics."""
    single = FSDPPolicyBackend(model_dir, actor_cfg(**cfg), lora=lora)
    data = make_batch(seed=11)
    data.batch["response_mask"] = data.batch["response_mask"].float()
    noise = 0.3 * torch.randn(BATCH_SIZE, RESPONSE_LEN, generator=torch.Generator().manual_seed(0))
    log_probs = single.compute_log_prob(data)
    data.batch["old_log_probs"] = log_probs + noise
    metrics = single.update_policy(data)
    return single, data.batch["old_log_probs"], log_probs, metrics


def _assert_same_step(single: FSDPPolicyBackend, single_metrics: dict, sharded: dict, sharded_metrics: dict) -> None:
    assert single_metrics["actor/optimizer_step"] == sharded_metrics["actor/optimizer_step"] == 1.0
    assert sharded_metrics["actor/grad_norm"] == pytest.approx(single_metrics["actor/grad_norm"], rel=1e-5)
    single_state = single.state_dict()["model"]
    assert set(single_state) == set(sharded)
    for name, value in single_state.items():
        torch.testing.assert_close(sharded[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow  # two gloo ranks in their own processes (~40-60 s on a busy 2-core machine)
def test_fsdp2_world_of_two_takes_the_same_step_as_one_process(model_dir, tmp_path):
    """Half the batch on each of two ranks (FSDP2, gloo) must give the whole-batch step of a single process. Each
    rank also keeps its shard of the weights before the step (prox_log_probs=previous): the log-probs under them are
    those before the step, and a checkpoint written at world size 2 gives them back."""
    single, old, _, single_metrics = _single_process_step(model_dir)
    rows = [list(range(0, BATCH_SIZE, 2)), list(range(1, BATCH_SIZE, 2))]
    sharded, report, before = _run_world(rows, model_dir, tmp_path, old, keep_previous=True)
    assert report["rows"] == BATCH_SIZE // 2
    _assert_same_step(single, single_metrics, sharded, report["metrics"])
    for rank in range(2):
        previous = torch.load(tmp_path / f"world2.pt.prev{rank}.pt")
        torch.testing.assert_close(previous, before[rank], rtol=0, atol=1e-6)
        torch.testing.assert_close(torch.load(tmp_path / f"world2.pt.prevckpt{rank}.pt"), previous, rtol=0, atol=0)


@pytest.mark.slow  # two gloo ranks in their own processes (~40-60 s on a busy 2-core machine)
def test_fsdp2_world_of_two_trains_the_same_lora_adapter_as_one_process(model_dir, tmp_path):
    """LoRA at world size 2 (peft before FSDP2): the step equals one process's, only the adapter moved (the base
    weights are bit-identical to the model folder's), and the adapter folder gathered from the shards is one
    process's adapter."""
    from safetensors.torch import load_file

    lora = {"r": 4, "lora_alpha": 8.0, "target_modules": "all-linear", "exclude_modules": None, "bias": "none"}
    initial = FSDPPolicyBackend(model_dir, actor_cfg(), lora=lora).state_dict()["model"]
    single, old, _, single_metrics = _single_process_step(model_dir, lora=lora, optim={"lr": 0.05})
    rows = [list(range(0, BATCH_SIZE, 2)), list(range(1, BATCH_SIZE, 2))]
    sharded, report, _ = _run_world(rows, model_dir, tmp_path, old, lora=lora, optim={"lr": 0.05})
    _assert_same_step(single, single_metrics, sharded, report["metrics"])
    moved = {name for name, value in sharded.items() if not torch.equal(value, initial[name].float())}
    assert moved and all(".lora_" in name for name in moved), sorted(moved)[:3]
    adapter = load_file(tmp_path / "world2.pt.adapter" / "adapter_model.safetensors")
    expected = single.adapter_state()
    assert set(adapter) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(adapter[name], value, rtol=1e-5, atol=1e-6, msg=name)


# Rows 0, 3, 5 hold 25 tokens, rows 1, 2, 4 hold 12 (PROMPT_LENGTHS + RESPONSE_LENGTHS): with a budget of 9 tokens
# (the longest row) rank 0 alone would cut 3 dynamic micro-batches and rank 1 alone 2.
UNBALANCED_ROWS = [[0, 3, 5], [1, 2, 4]]
DYNAMIC = {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 9, "ppo_infer_max_token_len_per_gpu": 9}


@pytest.mark.slow  # two gloo ranks in their own processes (~40-60 s on a busy 2-core machine)
def test_fsdp2_dynamic_micro_batches_with_unbalanced_tokens_finish_and_match(model_dir, tmp_path):
    """use_dynamic_bsz on two FSDP2 ranks whose token counts differ: the patch agrees the micro-batch count, so
    every forward/backward has its partner on the other rank; the step and the log-probs equal one process's."""
    single, old, single_log_probs, single_metrics = _single_process_step(model_dir, **DYNAMIC)
    sharded, report, log_probs = _run_world(UNBALANCED_ROWS, model_dir, tmp_path, old, **DYNAMIC)
    for rank, rows in enumerate(UNBALANCED_ROWS):
        torch.testing.assert_close(log_probs[rank], single_log_probs[rows], rtol=1e-5, atol=1e-5)
    _assert_same_step(single, single_metrics, sharded, report["metrics"])


_COUNT_WORKER = r"""
import datetime, json, sys, torch.distributed as dist
import verl.workers.actor.dp_actor as dp_actor
from verl_helpers import build_actor, make_batch, make_batch_copy, set_old_log_probs

rank, world = int(sys.argv[1]), 2
store_path, model_dir, state, rows = sys.argv[2:6]
timeout = datetime.timedelta(seconds=60)
dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world, timeout=timeout)
counts = []
original = dp_actor.prepare_dynamic_batch


def counting(*args, **kwargs):
    micro_batches, index = original(*args, **kwargs)
    counts.append(len(micro_batches))
    return micro_batches, index


dp_actor.prepare_dynamic_batch = counting
data = make_batch(seed=1)
set_old_log_probs(model_dir, data, shift=0.0, seed=1)
shard = data[json.loads(rows)[rank]]
# A plain module, not FSDP: nothing here is collective except what the actor itself does, so the pristine copy
# shows its micro-batch counts instead of hanging.
actor, _, _ = build_actor(model_dir, patched=state == "patched", dynamic_max_tokens=9)
shard.meta_info.update(micro_batch_size=1, use_dynamic_bsz=True, max_token_len=9)
actor.compute_log_prob(make_batch_copy(shard))
actor.update_policy(make_batch_copy(shard))
print(json.dumps({"counts": counts, "verl_file": dp_actor.__file__}))
dist.destroy_process_group()
"""


@pytest.mark.slow  # two gloo ranks in their own processes (~40-60 s on a busy 2-core machine)
def test_dynamic_micro_batch_counts_agree_across_ranks_only_with_the_patch(tmp_path, tiny_model_dir):
    """The same two unbalanced ranks against a patched and a pristine copy of verl: pristine verl cuts 3 and 2
    micro-batches (under FSDP the rank with 2 would leave the other's third all-gather waiting forever)."""
    tests_dir = Path(__file__).resolve().parent
    counts = {}
    for state in ("patched", "pristine"):
        root = make_verl_copy(tmp_path / state, patched=state == "patched")
        path = os.pathsep.join(
            [str(root), str(tests_dir), str(tests_dir.parent / "helpers"), str(tests_dir.parents[1])]
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
        args = [str(tmp_path / f"store_{state}"), str(tiny_model_dir), state, json.dumps(UNBALANCED_ROWS)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _COUNT_WORKER, str(rank), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        reports = []
        for proc in procs:
            try:
                stdout, stderr = proc.communicate(timeout=WORLD_TIMEOUT_S)
            finally:
                if proc.poll() is None:
                    proc.kill()
            assert proc.returncode == 0, stderr[-4000:]
            reports.append(json.loads(stdout.strip().splitlines()[-1]))
            assert reports[-1]["verl_file"].startswith(str(root)), "the worker imported the wrong verl"
        counts[state] = [report["counts"] for report in reports]
    # [compute_log_prob, update_policy] on each rank
    assert counts["patched"] == [[3, 3], [3, 3]], counts
    assert counts["pristine"] == [[3, 3], [2, 2]], counts


def test_an_exported_folder_gets_the_model_folder_files_the_export_did_not_write(tmp_path):
    """One list for both backends (it had drifted: only Megatron's copied generation_config.json). FSDP's
    save_pretrained writes its own generation_config.json, which stays; a Megatron export writes none and gets the
    model folder's."""
    from rllm.experimental.fully_async.backends import copy_model_folder_files

    source, fsdp_out, megatron_out = tmp_path / "model", tmp_path / "fsdp", tmp_path / "megatron"
    for folder in (source, fsdp_out, megatron_out):
        folder.mkdir()
    (source / "tokenizer.json").write_text("{}")
    (source / "generation_config.json").write_text('{"from": "model folder"}')
    (source / "model.safetensors").write_bytes(b"old weights")
    (fsdp_out / "generation_config.json").write_text('{"from": "save_pretrained"}')

    assert copy_model_folder_files(source, fsdp_out) == ["tokenizer.json"]
    assert json.loads((fsdp_out / "generation_config.json").read_text()) == {"from": "save_pretrained"}
    assert copy_model_folder_files(source, megatron_out) == ["tokenizer.json", "generation_config.json"]
    assert json.loads((megatron_out / "generation_config.json").read_text()) == {"from": "model folder"}
    assert not (megatron_out / "model.safetensors").exists()  # weights come from the export, never the source
