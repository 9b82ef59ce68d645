"""Helpers shared by the engine, client and ParamSync tests: distinct test models and reference log-probs."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

LOGPROB_TOL = 1e-4


def sharpen(src: Path, dst: Path, seed: int) -> Path:
    """Copy an HF model with its matrices redrawn from N(0, 0.3): varied, non-degenerate greedy outputs, and two
    models whose log-probs clearly differ."""
    model = AutoModelForCausalLM.from_pretrained(src)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    model.save_pretrained(dst)
    return dst


def reference_logprobs(
    model: PreTrainedModel, prompt: list[int], output: list[int], temperature: float = 1.0
) -> list[float]:
    """log_softmax(logits / T) of each output token under `model`, from one forward pass over prompt + output."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return [logprobs[len(prompt) - 1 + i, tok].item() for i, tok in enumerate(output)]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)
