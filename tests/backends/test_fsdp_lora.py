"""FSDPPolicyBackend with LoRA (actor_rollout_ref.model.lora_rank > 0): peft's adapter over the frozen base, as verl
0.7.1's FSDP workers build it; observed by effect: a step moves only the adapter, the optimizer holds only its
parameters, the adapter folder is what the engines load, and a checkpoint restores adapter and optimizer state.
"""

from __future__ import annotations

import json

import torch
from backend_helpers import actor_cfg
from lora_helpers import peft_reference, write_adapter
from safetensors.torch import load_file
from verl_helpers import BATCH_SIZE, RESPONSE_LEN, make_batch, response_log_probs

from rllm.experimental.fully_async.backends.fsdp import FSDPPolicyBackend
from rllm.experimental.fully_async.engines.embedded.lora import build_adapter, read_adapter_folder
from rllm.experimental.fully_async.run_spec import build_run_spec
from rllm.experimental.fully_async.runtime.trainer.build import build_policy_backend
from rllm.experimental.fully_async.settings.loader import load_config
from rllm.experimental.fully_async.settings.model_source import check_lora_adapter

LORA = {"r": 4, "lora_alpha": 8.0, "target_modules": "all-linear", "exclude_modules": None, "bias": "none"}


def lora_backend(model_dir, **lora) -> FSDPPolicyBackend:
    return FSDPPolicyBackend(model_dir, actor_cfg(optim={"lr": 0.05}), lora={**LORA, **lora})


def trainer_batch(seed: int, backend: FSDPPolicyBackend):
    data = make_batch(seed)
    data.batch["response_mask"] = data.batch["response_mask"].float()
    noise = 0.3 * torch.randn(BATCH_SIZE, RESPONSE_LEN, generator=torch.Generator().manual_seed(seed))
    data.batch["old_log_probs"] = backend.compute_log_prob(data) + noise
    return data


def named(backend: FSDPPolicyBackend) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in backend.model.named_parameters()}


def test_a_lora_step_moves_the_adapter_only_and_the_optimizer_holds_only_it(tiny_model_dir, one_torch_thread):
    backend = lora_backend(tiny_model_dir)
    facts = backend.describe()["lora"]
    adapter = {n for n, p in backend.model.named_parameters() if p.requires_grad}
    assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter)
    # all-linear: every linear layer of the decoder but the output head (peft's rule)
    assert set(facts["wrapped"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    optimized = [p for group in backend.optimizer.param_groups for p in group["params"]]
    assert sum(p.numel() for p in optimized) == facts["trained_parameters"]
    assert sum(p.numel() for n, p in backend.model.named_parameters() if n in adapter) == facts["trained_parameters"]

    before = named(backend)
    # peft starts lora_B at zero: the adapter is the base model until a step
    assert all(torch.count_nonzero(v) == 0 for n, v in before.items() if ".lora_B." in n)
    for seed in range(2):  # the first step moves B only (A's gradient is B^T..., zero), the second A too
        metrics = backend.update_policy(trainer_batch(seed, backend))
        assert metrics["actor/optimizer_step"] == 1.0
    after = named(backend)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed == adapter, f"moved outside the adapter: {sorted(changed - adapter)[:3]}"
    assert len(backend.optimizer.state) == len(adapter)  # AdamW's moments only for the adapter


def test_the_adapter_folder_is_what_the_engines_load(tiny_model_dir, tmp_path, one_torch_thread):
    backend = lora_backend(tiny_model_dir, target_modules=["q_proj", "v_proj"])
    backend.update_policy(trainer_batch(0, backend))
    backend.save_adapter(tmp_path / "a", dtype="bfloat16")
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and set(config["target_modules"]) == {"q_proj", "v_proj"}
    saved = load_file(tmp_path / "a" / "adapter_model.safetensors")
    assert all(k.startswith("base_model.model.") and ".lora_" in k for k in saved)
    assert {v.dtype for v in saved.values()} == {torch.bfloat16}
    state = backend.adapter_state()
    assert set(saved) == set(state)
    for key, value in state.items():
        torch.testing.assert_close(saved[key].float(), value.to(torch.bfloat16).float())
    # the embedded engine's reader maps every tensor onto the base model's linear layers
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    read_config, tensors = read_adapter_folder(str(tmp_path / "a"))
    built = build_adapter(
        lora_id="1", name="policy-v1", path=None, pinned=False, config=read_config, tensors=tensors, model=base
    )
    assert built.nbytes == sum(v.numel() * 4 for v in saved.values())  # every tensor, cast to the base's fp32


def test_a_checkpoint_restores_the_adapter_and_its_optimizer_state(tiny_model_dir, tmp_path, one_torch_thread):
    trained = lora_backend(tiny_model_dir)
    trained.update_policy(trainer_batch(0, trained))
    trained.save_checkpoint(tmp_path / "ckpt")
    resumed = lora_backend(tiny_model_dir)
    resumed.load_checkpoint(tmp_path / "ckpt")
    a, b = trained.adapter_state(), resumed.adapter_state()
    assert any(torch.count_nonzero(v) for k, v in a.items() if "lora_B" in k)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    # the next step is the same step: the moments and the schedule came back too
    batch = trainer_batch(1, trained)
    trained.update_policy(batch)
    resumed.update_policy(batch)
    a, b = trained.adapter_state(), resumed.adapter_state()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.optimizer_steps == trained.optimizer_steps == 2


def test_a_run_started_from_a_saved_adapter_trains_it_and_syncs_it_as_version_0(
    tiny_model_dir, tmp_path, one_torch_thread
):
    """actor_rollout_ref.model.lora_adapter_path (verl 0.7.1's key): the policy the trainer builds from the config is
    the saved adapter, loaded trainable as verl's FSDP workers load it (PeftModel.from_pretrained); the folder the
    version-0 sync writes (save_adapter: the driver loads it as policy-v0 before the first request) holds its
    tensors exactly; the optimizer holds them and a step moves them, nothing else."""
    start = write_adapter(tiny_model_dir, tmp_path / "start", seed=5, rank=4, alpha=8)
    overrides = [
        "task.name=null",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "data.train_files=unused.parquet",
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.model.lora_alpha=8",
        f"actor_rollout_ref.model.lora_adapter_path={start}",
        "actor_rollout_ref.actor.optim.lr=0.05",
    ]
    cfg = load_config(None, overrides)
    check_lora_adapter(cfg)
    backend, _ = build_policy_backend(build_run_spec(cfg).trainer)
    saved = load_file(start / "adapter_model.safetensors")
    state = backend.adapter_state()
    assert set(state) == set(saved) and all(torch.equal(state[k], saved[k]) for k in saved)
    assert any(torch.count_nonzero(v) for k, v in saved.items() if "lora_B" in k)  # not peft's fresh (zero) B
    # the trainer's log-probs are peft's own model of that adapter
    data = make_batch(0)
    with torch.no_grad():
        expected = response_log_probs(peft_reference(tiny_model_dir, start), data)
    mask = data.batch["response_mask"].bool()
    torch.testing.assert_close(backend.compute_log_prob(data)[mask], expected[mask], atol=1e-5, rtol=0)
    # version 0 is the start adapter, bit for bit
    backend.save_adapter(tmp_path / "v0")
    synced = load_file(tmp_path / "v0" / "adapter_model.safetensors")
    assert set(synced) == set(saved) and all(torch.equal(synced[k], saved[k]) for k in saved)
    # trained: the optimizer holds exactly the adapter's parameters, and a step moves them from the start values
    optimized = sum(p.numel() for group in backend.optimizer.param_groups for p in group["params"])
    assert optimized == sum(v.numel() for v in saved.values()) == backend.describe()["lora"]["trained_parameters"]
    before = named(backend)
    backend.update_policy(trainer_batch(0, backend))
    after = named(backend)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(".lora_A." in n or ".lora_B." in n for n in changed)
