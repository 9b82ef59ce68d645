"""The simulator's sync-bytes model (simulate/model.py ModelShape): what one weight sync moves, all weights or a LoRA
adapter alone, checked against the real thing (the HF model's parameters, peft's adapter, the folder the trainer
writes) and read from a project config (scenarios.sync_from_project: with LoRA no pause)."""

from __future__ import annotations

import json

import pytest
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rllm.experimental.fully_async.__main__ import main
from rllm.experimental.fully_async.settings.loader import load_config
from rllm.experimental.fully_async.simulate.model import ModelShape
from rllm.experimental.fully_async.simulate.scenarios import sync_from_project

# Qwen2.5-7B-Instruct's config.json (the model config/gpu_fsdp_sglang_lora.yaml names): 7,615,616,512 parameters
QWEN25_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}


def tiny_shape(tiny_model_dir) -> ModelShape:
    return ModelShape.from_hf_config(json.loads((tiny_model_dir / "config.json").read_text()))


def trainable(model, **lora) -> int:
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", bias="none", **lora))
    return sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


def test_the_parameter_counts_are_the_models_and_peft_adapters(tiny_model_dir):
    shape = tiny_shape(tiny_model_dir)
    assert shape.parameters() == AutoModelForCausalLM.from_pretrained(tiny_model_dir).num_parameters()
    model = lambda: AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # noqa: E731
    assert shape.lora_parameters(8) == trainable(model(), r=8, target_modules="all-linear")
    assert shape.lora_parameters(4, ("q_proj", "v_proj")) == trainable(
        model(), r=4, target_modules=["q_proj", "v_proj"]
    )
    assert ModelShape.from_hf_config(QWEN25_7B).parameters() == 7_615_616_512
    with pytest.raises(ValueError, match=r"LoRA target modules \['lm_head'\]"):
        shape.lora_parameters(8, ("lm_head",))


def test_a_lora_sync_moves_the_adapters_bytes_only(tiny_model_dir, tmp_path):
    """The adapter folder the trainer writes each sync (peft's save_pretrained) holds exactly the modelled bytes."""
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules="all-linear", bias="none"),
    )
    peft_model.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert tiny_shape(tiny_model_dir).sync_bytes(4, lora_rank=8) == sum(t.numel() * 4 for t in saved.values())
    # a 7B-class model in bf16: the full sync and the rank-32 adapter's
    big = ModelShape.from_hf_config(QWEN25_7B)
    assert big.sync_bytes(2) == 2 * 7_615_616_512 and big.sync_bytes(2, lora_rank=32) == 2 * 80_740_352


def test_a_lora_project_config_simulates_syncs_with_no_pause_and_the_adapters_bytes(tiny_model_dir, capsys):
    user = ["task.name=null", f"actor_rollout_ref.model.path={tiny_model_dir}", "data.train_files=unused.parquet"]
    shape = tiny_shape(tiny_model_dir)
    full = sync_from_project(load_config(None, user, check_host=False))
    lora = sync_from_project(load_config(None, [*user, "actor_rollout_ref.model.lora_rank=8"], check_host=False))
    assert full == {"nbytes": float(shape.sync_bytes(4))}  # fp32 on CPU; the pause is the timing model's
    assert lora == {"pause_s": 0.0, "nbytes": float(shape.sync_bytes(4, lora_rank=8))}
    assert lora["nbytes"] < full["nbytes"] / 4  # 4.7x on this tiny model, 94x for the 7B above at rank 32
    assert main(["simulate", *user, "actor_rollout_ref.model.lora_rank=8", "simulate.steps=4"]) == 0
    out = capsys.readouterr().out
    assert f"(pause 0s, {lora['nbytes'] / 1e6:,.4g} MB)" in out, out
