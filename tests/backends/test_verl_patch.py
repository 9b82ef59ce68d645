"""Proof that patches/verl_dp_actor.patch gives verl's update_policy the fully-async rules, and that it matters.

Every observable is measured twice by the same probe (`measure`), each time in a fresh interpreter whose
PYTHONPATH puts a private copy of verl first: one copy with the patch applied, one pristine (the patch reversed).
The copies are made from whatever verl the venv has, so these tests judge the patch file itself, not the state of
the shared venv. The patched numbers are compared with a reference written here in plain torch; the pristine
numbers must differ from it, or the patch would not be needed.

Run as a script (`python tests/backends/test_verl_patch.py MODEL_DIR`) the module prints the probe's measurements as
JSON.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PATCH_FILE = REPO_ROOT / "patches" / "verl_dp_actor.patch"

BATCH_SIZE = 6
PROMPT_LEN = 4
RESPONSE_LEN = 5
PROMPT_LENGTHS = (4, 3, 2, 4, 1, 3)  # left-padded prompts
RESPONSE_LENGTHS = (5, 3, 1, 4, 2, 5)  # right-padded responses: 20 response tokens in all
TEMPERATURE = 0.8  # not 1, so a probe that ignored meta_info["temperature"] would show
CLIP = 0.2
# Splits of the 6-row batch: static micro-batch sizes (6 = one micro-batch, 4 = uneven 4 + 2, 1 = one row each) and
# dynamic token budgets (a row is at most 9 tokens: 9 puts one row in each micro-batch, 14 about two, 100 all).
SPLITS = {
    "static-6": {"micro_batch_size": 6},
    "static-4": {"micro_batch_size": 4},
    "static-1": {"micro_batch_size": 1},
    "dynamic-9": {"dynamic_max_tokens": 9},
    "dynamic-14": {"dynamic_max_tokens": 14},
    "dynamic-100": {"dynamic_max_tokens": 100},
}
MINI_BATCH_SIZES = (1, 2, 6)


# ----------------------------------------------------------------------------------------------------------------
# The probe: runs inside the subprocess, against whichever verl is first on sys.path
# ----------------------------------------------------------------------------------------------------------------


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


def _finite_metrics(metrics: dict[str, Any]) -> bool:
    values = [v for value in metrics.values() for v in (value if isinstance(value, list) else [value])]
    return all(math.isfinite(float(v)) for v in values)


def measure(model_path: str, patched: bool) -> dict[str, Any]:
    """Every observable the tests judge, as JSON-able numbers."""
    import torch
    import verl

    out: dict[str, Any] = {"verl_file": verl.__file__}

    # 1. Gradient of one update_policy call against the whole-batch token-mean reference, per split.
    data = make_batch(seed=1)
    set_old_log_probs(model_path, data, shift=0.0, seed=1)
    reference = reference_gradient(model_path, data)
    # The second pass keeps old_log_probs in pristine verl too, which isolates the micro-batch weighting.
    for key, keep_old in (("grad_rel_err", False), ("grad_rel_err_keep_old", True)):
        out[key] = {}
        for name, split in SPLITS.items():
            actor, _, record = build_actor(model_path, patched=patched, use_rollout_log_probs=keep_old, **split)
            actor.update_policy(make_batch_copy(data))
            got = record["grads"][0]
            out[key][name] = float((got - reference).abs().max() / reference.abs().max())

    # 2. Optimizer steps per call, whatever ppo_mini_batch_size says.
    out["steps"] = {}
    for mini in MINI_BATCH_SIZES:
        actor, _, record = build_actor(model_path, patched=patched, micro_batch_size=1, mini_batch_size=mini)
        actor.update_policy(make_batch_copy(data))
        out["steps"][str(mini)] = record["steps"]

    # 3. old_log_probs are used: the same batch with old_log_probs shifted by +0.5 (an older policy).
    out["ppo_kl"], out["clipfrac"] = [], []
    for shift in (0.0, 0.5):
        shifted = make_batch(seed=2)
        set_old_log_probs(model_path, shifted, shift=shift, seed=2)
        actor, _, _ = build_actor(model_path, patched=patched)
        metrics = actor.update_policy(shifted)
        out["ppo_kl"].append(float(torch.tensor(metrics["actor/ppo_kl"]).mean()))
        out["clipfrac"].append(float(torch.tensor(metrics["actor/pg_clipfrac"]).mean()))

    # 4a. An all-masked micro-batch (rows 0 and 1, micro-batches of 2) inside a batch that has tokens elsewhere.
    partly = make_batch(seed=3, empty_rows=(0, 1))
    set_old_log_probs(model_path, partly, shift=0.0, seed=3)
    reference = reference_gradient(model_path, partly)
    actor, _, record = build_actor(model_path, patched=patched, micro_batch_size=2)
    metrics = actor.update_policy(partly)
    got = record["grads"][0]
    out["empty_micro"] = {
        "pg_loss": metrics["actor/pg_loss"],
        "metrics_finite": _finite_metrics(metrics),
        "grad_finite": bool(torch.isfinite(got).all()),
        "grad_rel_err": float((got - reference).abs().max() / reference.abs().max()),
    }

    # 4b. A batch without a single response token: AdamW with weight decay moves parameters on any step.
    empty = make_batch(seed=4, empty_rows=tuple(range(BATCH_SIZE)))
    set_old_log_probs(model_path, empty, shift=0.0, seed=4)
    actor, model, record = build_actor(model_path, patched=patched, lr=1e-2, weight_decay=0.1)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    metrics = actor.update_policy(empty)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    out["empty_batch"] = {
        "steps": record["steps"],
        "param_max_change": float((after - before).abs().max()),
        "metrics_finite": _finite_metrics(metrics),
    }
    return out


def make_batch_copy(data: Any) -> Any:
    """update_policy may move or select tensors: give every call its own copy."""
    from verl import DataProto

    return DataProto.from_dict({k: v.clone() for k, v in data.batch.items()}, meta_info=dict(data.meta_info))


# ----------------------------------------------------------------------------------------------------------------
# The tests: run the probe against a patched and a pristine copy of verl
# ----------------------------------------------------------------------------------------------------------------


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


@pytest.fixture(scope="module")
def verl_copies(tmp_path_factory) -> dict[str, Path]:
    """Folders holding a patched and a pristine copy of the installed verl (as `<folder>/verl`)."""
    return {
        state: make_verl_copy(tmp_path_factory.mktemp(f"verl_{state}"), patched=state == "patched")
        for state in ("patched", "pristine")
    }


@pytest.fixture(scope="module")
def observations(verl_copies, tiny_model_dir) -> dict[str, dict[str, Any]]:
    """The probe's measurements for both copies, run side by side (about 15 s on two cores)."""
    procs = {}
    for state, root in verl_copies.items():
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO_ROOT)]), "OMP_NUM_THREADS": "1"}
        procs[state] = (
            root,
            subprocess.Popen(
                [sys.executable, __file__, str(tiny_model_dir), state],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
    results = {}
    for state, (root, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{state} probe failed:\n{stderr[-4000:]}"
        results[state] = json.loads(stdout.strip().splitlines()[-1])
        assert results[state]["verl_file"].startswith(str(root)), "the probe imported the wrong verl"
    return results


def test_gradient_is_whole_batch_token_mean_for_every_split(observations):
    patched, pristine = observations["patched"]["grad_rel_err"], observations["pristine"]["grad_rel_err"]
    for name in SPLITS:
        assert patched[name] < 1e-5, f"{name}: patched gradient off the reference by {patched[name]:.2e}"
    # Pristine verl takes a single mini-batch for on-policy and replaces old_log_probs: every split is off.
    assert all(pristine[name] > 1e-2 for name in SPLITS), pristine


def test_gradient_does_not_depend_on_micro_batch_weighting(observations):
    """With old_log_probs kept (use_rollout_log_probs), what is left in pristine verl is the weighting."""
    patched = observations["patched"]["grad_rel_err_keep_old"]
    pristine = observations["pristine"]["grad_rel_err_keep_old"]
    assert all(patched[name] < 1e-5 for name in SPLITS), patched
    # One micro-batch holding the whole batch is the whole-batch token mean in pristine verl too ...
    assert pristine["static-6"] < 1e-5 and pristine["dynamic-100"] < 1e-5
    # ... but a mean of per-micro-batch token means (static) or row-weighted means (dynamic) is not.
    for name in ("static-4", "static-1", "dynamic-9", "dynamic-14"):
        assert pristine[name] > 1e-2, (name, pristine)


def test_one_optimizer_step_per_call_whatever_the_mini_batch_size(observations):
    assert observations["patched"]["steps"] == {str(m): 1 for m in MINI_BATCH_SIZES}
    assert observations["pristine"]["steps"] == {str(m): BATCH_SIZE // m for m in MINI_BATCH_SIZES}


def test_old_log_probs_from_the_batch_are_used(observations):
    kl, clipfrac = observations["patched"]["ppo_kl"], observations["patched"]["clipfrac"]
    assert kl[1] - kl[0] == pytest.approx(0.5, abs=1e-4)  # ppo_kl = mean(old - new) moves with the shift
    assert clipfrac[1] > clipfrac[0]
    # Pristine: a single mini-batch with one epoch is taken for on-policy and old_log_probs are thrown away.
    kl, clipfrac = observations["pristine"]["ppo_kl"], observations["pristine"]["clipfrac"]
    assert kl == pytest.approx([0.0, 0.0], abs=1e-6)
    assert clipfrac == [0.0, 0.0]


def test_all_masked_micro_batch_adds_nothing(observations):
    patched = observations["patched"]["empty_micro"]
    assert math.isfinite(patched["pg_loss"]) and patched["metrics_finite"] and patched["grad_finite"]
    assert patched["grad_rel_err"] < 1e-5
    assert not math.isfinite(observations["pristine"]["empty_micro"]["pg_loss"])


def test_all_masked_batch_makes_no_step_and_leaves_parameters(observations):
    patched = observations["patched"]["empty_batch"]
    assert patched == {"steps": 0, "param_max_change": 0.0, "metrics_finite": True}
    pristine = observations["pristine"]["empty_batch"]
    assert pristine["steps"] == 1 and pristine["param_max_change"] > 0 and not pristine["metrics_finite"]


# ----------------------------------------------------------------------------------------------------------------
# Patch-state detection (backends/verl_patch.py), on the same copies
# ----------------------------------------------------------------------------------------------------------------


def test_patch_status_reads_each_state(verl_copies, tmp_path):
    from rllm.experimental.fully_async.backends.verl_patch import PatchState, patch_status

    assert patch_status(verl_copies["patched"] / "verl").state is PatchState.APPLIED
    assert patch_status(verl_copies["pristine"] / "verl").state is PatchState.NOT_APPLIED

    edited = tmp_path / "edited"
    shutil.copytree(verl_copies["pristine"] / "verl", edited / "verl")
    dp_actor = edited / "verl" / "workers" / "actor" / "dp_actor.py"
    dp_actor.write_text(dp_actor.read_text().replace("on_policy = len(mini_batches) == 1", "on_policy = False"))
    status = patch_status(edited / "verl")
    assert status.state is PatchState.CONFLICT and "dp_actor.py" in status.detail

    (edited / "verl" / "version" / "version").write_text("0.8.0\n")
    status = patch_status(edited / "verl")
    assert status.state is PatchState.WRONG_VERSION and status.verl_version == "0.8.0"
    assert "pip install" in status.fix_command()


def test_trainer_refuses_unpatched_verl_with_the_fixing_command(verl_copies):
    probe = "from rllm.experimental.fully_async.backends.verl_patch import require_patched_verl; require_patched_verl()"
    results = {}
    for state, root in verl_copies.items():
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO_ROOT)])}
        results[state] = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
        )
    assert results["patched"].returncode == 0, results["patched"].stderr
    failed = results["pristine"]
    assert failed.returncode != 0
    message = failed.stderr.strip().splitlines()[-1]
    assert message.startswith("rllm.experimental.fully_async.backends.verl_patch.UnpatchedVerlError: ")
    assert "not applied" in message
    assert message.endswith(f"fix: VERL_PYTHON={sys.executable} bash {REPO_ROOT / 'install' / 'apply_verl_patch.sh'}")


if __name__ == "__main__":
    # Probe mode, used by the fixture above: `python tests/backends/test_verl_patch.py MODEL_DIR patched|pristine`.
    print(json.dumps(measure(sys.argv[1], patched=sys.argv[2] == "patched")))
