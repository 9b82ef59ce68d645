"""verl's side of the backend tests: batches shaped as the trainer sends them, a plain-torch reference, verl's actor
built the way the trainer builds it, and private copies of verl with the patch applied or reversed.

Imported by module name (tests/helpers is on pytest's pythonpath; the probes' subprocesses put it on PYTHONPATH),
inside the probe's fresh interpreter too: whatever verl comes first on sys.path is the one these functions use.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


PATCH_FILE = REPO_ROOT / "patches" / "verl_dp_actor.patch"


BATCH_SIZE = 6


PROMPT_LEN = 4


RESPONSE_LEN = 5


PROMPT_LENGTHS = (4, 3, 2, 4, 1, 3)  # left-padded prompts


RESPONSE_LENGTHS = (5, 3, 1, 4, 2, 5)  # right-padded responses: 20 response tokens in all


TEMPERATURE = 0.8  # not 1, so a probe that ignored meta_info["temperature"] would show


CLIP = 0.2


def make_batch(seed: int, empty_rows: tuple[int, ...] = ()) -> Any:
    """A DataProto shaped as the trainer sends it; `empty_rows` get an all-zero response_mask."""
    import torch
    from verl import DataProto

    gen = torch.Generator().manual_seed(seed)
    prompts = torch.zeros(BATCH_SIZE, PROMPT_LEN, dtype=torch.long)
    prompt_mask = torch.zeros(BATCH_SIZE, PROMPT_LEN, dtype=torch.long)
    responses = torch.zeros(BATCH_SIZE, RESPONSE_LEN, dtype=torch.long)
    response_mask = torch.zeros(BATCH_SIZE, RESPONSE_LEN, dtype=torch.long)
    for row, (p, r) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, strict=True)):
        prompts[row, PROMPT_LEN - p :] = torch.randint(2, 32, (p,), generator=gen)
        prompt_mask[row, PROMPT_LEN - p :] = 1
        responses[row, :r] = torch.randint(2, 32, (r,), generator=gen)
        response_mask[row, :r] = 0 if row in empty_rows else 1
    attention_mask = torch.cat([prompt_mask, (responses != 0).long()], dim=1)
    position_ids = torch.clamp(attention_mask.cumsum(-1) - 1, min=0)
    # Group-style advantages: one value per row, positive and negative, spread over its tokens.
    advantages = torch.randn(BATCH_SIZE, 1, generator=gen).expand(-1, RESPONSE_LEN) * response_mask
    batch = {
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": responses,
        "response_mask": response_mask,
        "advantages": advantages.contiguous().float(),
    }
    return DataProto.from_dict(batch, meta_info={"temperature": TEMPERATURE})


def response_log_probs(model: Any, data: Any) -> Any:
    """log pi(response token | prefix) / temperature-scaled, in plain torch: the reference's own forward."""
    import torch

    b = data.batch
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    logits = logits[:, -RESPONSE_LEN - 1 : -1, :].float() / TEMPERATURE
    return torch.log_softmax(logits, dim=-1).gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)


def set_old_log_probs(model_path: str, data: Any, shift: float, seed: int) -> None:
    """old_log_probs = current log-probs plus noise in [-0.4, 0.4] (some ratios clipped) plus `shift`."""
    import torch

    model = load_model(model_path)
    with torch.no_grad():
        current = response_log_probs(model, data)
    gen = torch.Generator().manual_seed(seed + 1000)
    noise = (torch.rand(current.shape, generator=gen) - 0.5) * 0.8
    data.batch["old_log_probs"] = current + noise + shift


def reference_gradient(model_path: str, data: Any) -> Any:
    """Gradient of the whole-batch token-mean PPO-clip loss, written from the paper (Schulman et al. 2017, eq. 7).

    L = sum_t m_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps, 1 + eps)) / sum_t m_t, with r_t = exp(logp_t - old_t).
    verl's dual clip (ratio bound 3 for negative advantages) never binds here: every ratio is below 1.5.
    """
    import torch

    model = load_model(model_path)
    b = data.batch
    mask = b["response_mask"].float()
    ratio = torch.exp(response_log_probs(model, data) - b["old_log_probs"])
    assert float(ratio.max()) < 3.0
    adv = b["advantages"]
    per_token = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP, 1 + CLIP))
    loss = (per_token * mask).sum() / mask.sum()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def load_model(model_path: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")


def build_actor(
    model_path: str,
    *,
    patched: bool,
    micro_batch_size: int = 2,
    mini_batch_size: int = BATCH_SIZE,
    dynamic_max_tokens: int | None = None,
    lr: float = 0.0,
    weight_decay: float = 0.0,
    use_rollout_log_probs: bool = False,
) -> tuple[Any, Any, dict[str, Any]]:
    """A DataParallelPPOActor on a plain module; the returned record holds every optimizer step's gradient."""
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.actor.dp_actor import DataParallelPPOActor

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = {
        "_target_": "verl.workers.config.FSDPActorConfig",
        "strategy": "fsdp",
        "rollout_n": 1,
        "ppo_mini_batch_size": mini_batch_size,
        "ppo_micro_batch_size_per_gpu": micro_batch_size,
        "use_dynamic_bsz": dynamic_max_tokens is not None,
        "ppo_max_token_len_per_gpu": dynamic_max_tokens or 16384,
        "clip_ratio": CLIP,
        "clip_ratio_low": CLIP,
        "clip_ratio_high": CLIP,
        "loss_agg_mode": "token-mean",
        "use_torch_compile": False,
        "grad_clip": 1e6,  # never clips: the recorded gradient is the raw one
        "use_rollout_log_probs": use_rollout_log_probs,  # pristine verl's own switch off the on-policy shortcut
        "fsdp_config": {"_target_": "verl.workers.config.FSDPEngineConfig", "dtype": "bfloat16"},
    }
    if patched:
        cfg["fully_async"] = True  # the switch the patch adds; pristine verl's config has no such field
    config = omega_conf_to_dataclass(OmegaConf.create(cfg))
    model = load_model(model_path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    record: dict[str, Any] = {"steps": 0, "grads": []}

    def before_step(opt: Any, args: Any, kwargs: Any) -> None:
        record["steps"] += 1
        record["grads"].append(torch.cat([p.grad.flatten().clone() for p in model.parameters()]))

    optimizer.register_step_pre_hook(before_step)
    actor = DataParallelPPOActor(config, model, optimizer)
    # fsdp_config.dtype only admits bf16/fp16 (autocast dtypes for GPUs); on CPU compute in fp32 so gradients can
    # be compared at 1e-5. A float32 autocast on CPU disables itself with a warning.
    actor.param_dtype = torch.float32
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
    return actor, model, record


def make_batch_copy(data: Any) -> Any:
    """update_policy may move or select tensors: give every call its own copy."""
    from verl import DataProto

    return DataProto.from_dict({k: v.clone() for k, v in data.batch.items()}, meta_info=dict(data.meta_info))


def _git_apply(verl_root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # Stop git at the copy's parent: the copy must be patched as plain files, whatever repository holds /tmp.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(verl_root.parent)}
    return subprocess.run(
        ["git", "apply", *args, str(PATCH_FILE)], cwd=verl_root, env=env, capture_output=True, text=True, timeout=60
    )


def make_verl_copy(dest: Path, *, patched: bool) -> Path:
    """Copy the installed verl under dest/verl and bring it to the patched or pristine state."""
    from rllm.experimental.fully_async.backends.verl_patch import verl_package_dir

    source = verl_package_dir()
    assert source is not None, "verl is not installed"
    shutil.copytree(source, dest / "verl", ignore=shutil.ignore_patterns("__pycache__"))
    is_patched = _git_apply(dest, "--reverse", "--check").returncode == 0
    if is_patched != patched:
        result = _git_apply(dest, *([] if patched else ["--reverse"]))
        assert result.returncode == 0, result.stderr
    return dest
