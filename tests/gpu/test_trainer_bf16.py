"""On a GPU host: one policy-gradient update on CUDA in bf16 autocast (fp32 master weights, as verl's actor runs)
matches the same update in fp32 on CPU within a bf16 tolerance."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build_tiny_qwen2
from transformers import AutoModelForCausalLM

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"), pytest.mark.timeout(300)]


def one_update(model: torch.nn.Module, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 32, (8, 24), generator=gen).to(device)
    advantages = torch.randn(8, generator=gen).to(device)
    with torch.autocast(device_type=device.split(":")[0], dtype=dtype, enabled=dtype != torch.float32):
        logits = model(ids).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -(advantages[:, None] * logp).mean()  # the on-policy PPO loss at ratio 1
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


def test_bf16_update_on_cuda_matches_fp32_reference(tmp_path):
    path = build_tiny_qwen2(tmp_path / "m")
    base = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    start = {k: v.detach().clone() for k, v in base.state_dict().items()}
    ref = one_update(copy.deepcopy(base), "cpu", torch.float32)
    got = one_update(copy.deepcopy(base), "cuda:0", torch.bfloat16)
    for name, value in ref.items():
        delta_ref, delta_got = value - start[name], got[name] - start[name]
        if delta_ref.abs().max() == 0:
            continue
        rel = (delta_got - delta_ref).norm() / delta_ref.norm()
        assert rel < 0.1, f"{name}: bf16 update differs from fp32 by {rel:.3f} (relative)"
