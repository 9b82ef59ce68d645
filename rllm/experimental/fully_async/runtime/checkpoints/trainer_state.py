"""The trainer's part of a run checkpoint: `trainer.pt`, and the policy's torch.distributed.checkpoint shards.

Inside one checkpoint folder (store.py has the parts written into `.tmp-step_N-...`, then renames the
whole folder in, so the shards are committed, or lost, together with everything else):

    trainer.pt              step, version, RNG states (and a GAE run's critic); its "backend" entry is
                            {"shards": "policy_shards", "world_size": N} for an FSDP policy, or the backend's own
                            state dict for one without torch.distributed.checkpoint (Megatron, world size 1)
    policy_shards/          the FSDP policy, written by every rank at once (FSDPPolicyBackend.save_checkpoint)
      __<r>_0.distcp        the parameters and Adam moments rank r holds: no rank gathers another's
      .metadata             DCP's index of the shards (pickled by torch: resume only checkpoints you trust)
      extra.pt              LR schedule and optimizer step count (weights_only)

Every file is in the COMPLETE manifest ({bytes, sha256}; the ranks hash their shares of `policy_shards/` in
parallel), so a damaged shard is named when the checkpoint is loaded, before any rank reads it.

World size 1 writes the same format (one shard), for two reasons: one format for every FSDP trainer, and a resume
at another world size. A world-1 full state dict holds a plain optimizer's state keyed by parameter index, which
FSDP2's `set_state_dict` accepts without complaint and then fails on (KeyError at the next `get_state_dict`), while
DCP reshards cleanly in both directions.

Resuming at another world size (trainer.n_gpus_per_node x trainer.nnodes changed, which the run-dir check allows):
DCP reads the shards onto the new ranks through FSDP2's get/set_state_dict (2 -> 1 and 1 -> 2 are tested in
tests/runtime/test_trainer_ranks.py); the step's math does not depend on the world size (token-balanced split,
whole-batch
token mean). Checkpoints of the first format (format_version 1: the full state in trainer.pt, gathered on rank 0
when N > 1) still load where the full state fits: world size 1 into 1, and a gathered state into any N > 1
(broadcast from rank 0); between 1 and N > 1 they are refused in one line naming both world sizes.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rllm.experimental.fully_async.api.policy_backend import ShardedCheckpoint
from rllm.experimental.fully_async.runtime.checkpoints.format import manifest_entries
from rllm.experimental.fully_async.runtime.checkpoints.format import write_trainer_part as write_trainer_file
from rllm.experimental.fully_async.runtime.checkpoints.store import CheckpointError

logger = logging.getLogger(__name__)

__all__ = ["POLICY_SHARDS", "load_trainer_part", "write_trainer_part"]

POLICY_SHARDS = "policy_shards"


def write_trainer_part(directory: str | Path, trainer: Any) -> dict[str, dict[str, Any]]:
    """Write the trainer part of a checkpoint into `directory` (the save's temporary folder); return the manifest
    entries of every file written. `trainer` is a FullyAsyncTrainer (its `backend`, `state_dict`)."""
    directory = Path(directory)
    backend = trainer.backend
    if not isinstance(backend, ShardedCheckpoint):  # Megatron: its own per-rank state dict, world size 1
        return write_trainer_file(directory, trainer.state_dict())
    shards = backend.save_checkpoint(directory / POLICY_SHARDS)
    if shards is None:  # one process wrote every shard (world size 1); a rank group's ranks hashed theirs
        shards = manifest_entries(directory / POLICY_SHARDS)
    files = {f"{POLICY_SHARDS}/{name}": entry for name, entry in shards.items()}
    policy = {"shards": POLICY_SHARDS, "world_size": int(backend.world_size)}
    return files | write_trainer_file(directory, trainer.state_dict(policy))


def load_trainer_part(checkpoint_dir: str | Path, state: Mapping[str, Any], trainer: Any) -> None:
    """Restore the trainer from a checkpoint's trainer part (`state`: trainer.pt, already verified and loaded)."""
    policy = state["backend"]
    backend = trainer.backend
    world = int(getattr(backend, "world_size", 1))
    if isinstance(policy, Mapping) and "shards" in policy:
        if not isinstance(backend, ShardedCheckpoint):
            raise CheckpointError(
                f"checkpoint {checkpoint_dir} holds an FSDP policy's torch.distributed.checkpoint shards; "
                f"this trainer's {type(backend).__name__} cannot read them"
            )
        if int(policy["world_size"]) != world:
            logger.warning("resharding %s from %s trainer ranks to %d", checkpoint_dir, policy["world_size"], world)
        backend.load_checkpoint(Path(checkpoint_dir) / str(policy["shards"]))
    else:
        saved = _full_state_world(policy)
        if saved is not None and (saved == "1") != (world == 1):
            raise CheckpointError(
                f"checkpoint {checkpoint_dir} holds the full trainer state of world size {saved} (the first "
                f"checkpoint format), which does not load at world size {world}: resume it with "
                "trainer.n_gpus_per_node x trainer.nnodes as it was, and its next checkpoint will reshard"
            )
        backend.load_state_dict(policy)
    trainer.load_state_dict(dict(state), load_policy=False)


def _full_state_world(policy: Any) -> str | None:
    """The world size ("1" or "> 1") of an FSDP full state dict of the first format, told by how its optimizer
    names parameters: a plain optimizer (world size 1) by index, a state gathered from FSDP2 ranks by name. None:
    not that shape."""
    try:
        params = [p for group in policy["optimizer"]["param_groups"] for p in group["params"]]
    except (KeyError, TypeError):
        return None  # Megatron's state dict carries its own layout check
    if not params:
        return None
    return "1" if all(isinstance(p, int) for p in params) else "> 1"


def capture_rng_state() -> dict[str, Any]:
    """The python, numpy and torch (CPU and, if present, CUDA) global RNG states, in types that weights_only loads."""
    version, internal, gauss_next = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": [int(k) for k in np_state["state"]["key"]],
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what `capture_rng_state` returned, so the following random draws repeat."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": npy["bit_generator"],
            "state": {"key": np.asarray(npy["key"], dtype=np.uint32), "pos": npy["pos"]},
            "has_gauss": npy["has_gauss"],
            "gauss": npy["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    cuda_states = state.get("torch_cuda")
    if cuda_states and torch.cuda.is_available():
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            logger.warning(
                "CUDA RNG states for %d devices but %d visible: not restored",
                len(cuda_states),
                torch.cuda.device_count(),
            )
