"""Megatron -> Hugging Face weights: the name mapping verl's Megatron worker uses, and an HF folder written from it.

Megatron -> Hugging Face weights (needs megatron-core and mbridge importable, no CUDA): the name mapping is verl's,
never re-written here. With `megatron.use_mbridge: true` (verl's default) the mbridge bridge verl builds
(`verl.models.mcore.mbridge.AutoBridge`, the one `MegatronWorker` keeps as `self.bridge`), otherwise verl's own
`McoreToHFWeightConverter*` (`verl.models.mcore.get_mcore_weight_converter`). Both split Megatron's fused tensors
(`linear_qkv` -> q/k/v, `linear_fc1` -> gate/up) and rename the rest. `hf_weights` picks one and turns one full
(TP-gathered) Megatron tensor into HF `(name, tensor)` pairs; verl's `bridge.export_weights` /
`per_tensor_generator` do the TP/PP gathering on GPU and call the same code. `write_hf_folder` writes such a stream
as an HF safetensors folder (config, weights, and the model folder's tokenizer and generation files), which is what
the disk transport hands to the engines; the distributed transport broadcasts the same `(name, tensor)` pairs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rllm.experimental.fully_async.backends import copy_model_folder_files

logger = logging.getLogger(__name__)


def build_name_converter(hf_config: Any, *, use_mbridge: bool = True, dtype: torch.dtype = torch.bfloat16) -> Any:
    """The Megatron -> HF converter verl's Megatron worker uses for `hf_config` (megatron.use_mbridge picks which).

    mbridge's bridge reads megatron-core's parallel state: initialise it first (a gloo world of one on CPU).
    """
    if use_mbridge:
        # lazy: Megatron is an optional GPU dependency (mbridge)
        from verl.models.mcore.mbridge import AutoBridge

        bridge = AutoBridge.from_config(hf_config, dtype=dtype)
        # mbridge 0.15.1 writes the tied-embedding entry into a class-level dict, so a tied model built earlier in
        # the process maps an untied one's output_layer to embed_tokens: give this bridge its own, correct copy.
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        mapping = dict(bridge._DIRECT_MAPPING)
        mapping["output_layer.weight"] = "model.embed_tokens.weight" if tied else "lm_head.weight"
        bridge._DIRECT_MAPPING = mapping
        return bridge
    # lazy: Megatron is an optional GPU dependency (verl.models.mcore imports megatron-core)
    from verl.models.mcore import get_mcore_weight_converter

    return get_mcore_weight_converter(hf_config, dtype)


def hf_weights(converter: Any, megatron_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One full Megatron tensor (global layer numbers, TP-gathered) as HF `(name, tensor)` pairs."""
    if hasattr(converter, "_weight_to_hf_format"):  # mbridge: what bridge.export_weights calls per tensor
        names, tensors = converter._weight_to_hf_format(megatron_name, tensor)
    else:  # verl's converter takes the tensor already split (per_tensor_generator's default_tp_concat_fn does it)
        names, tensors = converter.convert_param(megatron_name, _split_fused(converter, megatron_name, tensor))
    return list(zip(names, tensors, strict=True))


def megatron_to_hf_names(converter: Any, megatron_name: str) -> list[str]:
    """The HF names one Megatron parameter becomes (the name mapping alone, no tensor)."""
    if hasattr(converter, "_weight_name_mapping_mcore_to_hf"):
        return list(converter._weight_name_mapping_mcore_to_hf(megatron_name))
    pieces = 3 if _is_qkv(megatron_name) else 2 if "linear_fc1.weight" in megatron_name else 1
    names, _ = converter.convert_param(megatron_name, [torch.empty(0)] * pieces)
    return list(names)


def _is_qkv(name: str) -> bool:
    return "self_attention.linear_qkv." in name and "layer_norm" not in name


# What verl's Megatron worker passes to per_tensor_generator (megatron_workers.py, init_model).
LAYER_NAME_MAPPING = {"qkv_layer_name": "self_attention.linear_qkv.", "gate_proj_layer_name": "linear_fc1."}


def _split_fused(converter: Any, name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Megatron's fused tensors split by verl's own default_tp_concat_fn, as per_tensor_generator calls it
    (one shard: megatron-core's tensor-parallel size must be 1, the full tensor after gathering)."""
    # lazy: Megatron is an optional GPU dependency (verl's megatron_utils imports megatron-core)
    from verl.utils.megatron_utils import default_tp_concat_fn

    if not (_is_qkv(name) or "linear_fc1.weight" in name):
        return [tensor]  # per_tensor_generator passes every other tensor through unchanged
    hf = converter.hf_config
    parts = default_tp_concat_fn(LAYER_NAME_MAPPING, name, tensor, [tensor], hf, hf, True)
    return parts if isinstance(parts, list) else [parts]


def write_hf_folder(
    weights: Iterable[tuple[str, torch.Tensor]],
    out: str | os.PathLike[str],
    *,
    hf_config: Any,
    source_dir: str | os.PathLike[str] | None = None,
    dtype: str | None = None,
) -> list[str]:
    """Write `(hf_name, tensor)` pairs as an HF safetensors folder; returns the names written, in order.

    Floating-point tensors are cast to `dtype` (e.g. "bfloat16") when given. A name seen twice (the tied
    embedding: mbridge maps output_layer.weight to embed_tokens under tie_word_embeddings) is written once.
    Tokenizer and generation files are copied from `source_dir` when present. Names the HF model expects but
    the stream lacks are an error, so a half-exported model never reaches an engine.
    """
    target = getattr(torch, dtype) if dtype is not None else None
    state: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name in state:
            continue
        tensor = tensor.detach().to("cpu")
        if target is not None and tensor.is_floating_point():
            tensor = tensor.to(target)
        state[name] = tensor.contiguous()
    missing = sorted(set(expected_hf_names(hf_config)) - set(state))
    if missing:
        raise ValueError(f"the exported weights lack {len(missing)} HF tensors, e.g. {missing[:3]}")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf_config.save_pretrained(folder)
    if source_dir is not None:
        copy_model_folder_files(source_dir, folder)
    logger.info("wrote %d HF tensors to %s", len(state), folder)
    return list(state)


def expected_hf_names(hf_config: Any) -> Iterator[str]:
    """The parameter names of the HF model `hf_config` describes (built on the meta device: no memory)."""
    # lazy: transformers (~0.6 s) stays out of megatron_unusable_reason's import by settings/validate and the doctor
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    tied = getattr(hf_config, "tie_word_embeddings", False)
    for name, _ in model.named_parameters():
        if not (tied and name == "lm_head.weight"):
            yield name
