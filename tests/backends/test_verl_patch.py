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
from pathlib import Path
from typing import Any

import pytest
from verl_helpers import (
    BATCH_SIZE,
    REPO_ROOT,
    build_actor,
    make_batch,
    make_batch_copy,
    make_verl_copy,
    reference_gradient,
    set_old_log_probs,
)

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


# ----------------------------------------------------------------------------------------------------------------
# The tests: run the probe against a patched and a pristine copy of verl
# ----------------------------------------------------------------------------------------------------------------


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
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(root), str(REPO_ROOT / "tests" / "helpers"), str(REPO_ROOT)]),
            "OMP_NUM_THREADS": "1",
        }
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
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(root), str(REPO_ROOT / "tests" / "helpers"), str(REPO_ROOT)]),
        }
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
