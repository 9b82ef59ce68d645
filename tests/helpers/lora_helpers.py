"""LoRA adapters for the engine tests, written the way peft writes them (`get_peft_model` + `save_pretrained`), and
peft's own forward pass as the reference an engine's log-probs are held to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel

from rllm.experimental.fully_async.run_spec import EngineLoRASpec

# engines.lora as settings/derive.py gives it for η_max = 1 (3 versions loaded: 2 admitted, 1 retiring), rank 8,
# all-linear: what the engine and sync tests serve.
LORA = EngineLoRASpec(
    max_lora_rank=8,
    target_modules=("all",),
    max_loras_per_batch=3,
    max_loaded_loras=3,
    eviction_policy="lru",
    backend="csgmv",
)

# verl 0.7.1's FSDP workers wrap the actor with these LoraConfig fields (target_modules defaults to all-linear).
DEFAULT_TARGETS: Any = "all-linear"


def write_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    seed: int,
    rank: int = 4,
    alpha: int = 8,
    target_modules: Any = DEFAULT_TARGETS,
    scale: float = 0.3,
    **config: Any,
) -> Path:
    """A peft LoRA adapter of the model at `base_dir`, saved at `out_dir` (adapter_config.json +
    adapter_model.safetensors). lora_B is drawn from N(0, scale) (peft starts it at zero, which would make the
    adapter the base model) so that adapters of different seeds clearly change the log-probs."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    peft_config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=target_modules, bias="none", task_type="CAUSAL_LM", **config
    )
    peft_model = get_peft_model(model, peft_config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    peft_model.save_pretrained(out_dir)
    return out_dir


def peft_reference(base_dir: Path, adapter_dir: Path) -> PreTrainedModel:
    """The base model with the adapter applied by peft itself (the reference an engine must reproduce)."""
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    return PeftModel.from_pretrained(model, adapter_dir).eval()
