"""The policy backend contract: what the trainer calls on the model it trains (`FullyAsyncTrainer.backend`).

Implementations: backends/fsdp.py (`FSDPPolicyBackend`: verl's DataParallelPPOActor, one process, plain or FSDP2),
backends/megatron.py (`MegatronPolicyBackend`: verl's Megatron worker) and runtime/trainer/ranks.py
(`DistributedPolicyBackend`: N FSDP rank actors behind the same calls). `data` is a verl `DataProto` batch; each
method says which keys it reads.

Beyond `PolicyBackend`, a backend may offer capabilities the runtime looks for (`isinstance` on the runtime-checkable
protocols below), each with a fallback:
- `ShardedCheckpoint`: every rank writes its own torch.distributed.checkpoint shard (FSDP); without it the
  checkpoint holds the backend's `state_dict` (Megatron: this rank's shard, same layout on resume).
- `HFWeightStream`: the weights as HF-named `(name, tensor)` pairs for the distributed transport (Megatron's
  export); without it the transport walks `backend.model`'s tensors, or asks a rank group's `weight_sender`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable


class PolicyBackend(Protocol):
    """The policy, its optimizer and verl's (patched) PPO update: one optimizer step per `update_policy` call."""

    world_size: int  # trainer ranks behind this backend (1: one process)

    def compute_log_prob(self, data: Any, weights: str = "current") -> Any:
        """Log-probs of `responses` under the current policy, (batch, response_length), float32, on CPU.
        Reads input_ids, attention_mask, position_ids, responses. `weights="previous"`: under the weights of the
        previous version (prox_log_probs=previous; FSDP backends built with keep_previous_weights, which also offer
        `weights_synced()`: the trainer calls it when its weights become a new version)."""
        ...

    def update_policy(self, data: Any) -> dict[str, float]:
        """Exactly one optimizer step on the whole batch (none for a batch without response tokens); the actor's
        metrics. Reads the log-prob keys plus response_mask, old_log_probs, advantages (and rollout_log_probs,
        rollout_is_weights when present)."""
        ...

    def save_hf(self, path: str | os.PathLike[str], dtype: str | None = None) -> None:
        """Write the current weights as an HF safetensors folder an engine loads (the disk transport), floating
        tensors cast to `dtype` when given; collective with several ranks."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and LR-schedule state (tensors on CPU), for a checkpoint or a comparison."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        ...


@runtime_checkable
class ShardedCheckpoint(Protocol):
    """A backend whose ranks write and read their own checkpoint shards (torch.distributed.checkpoint)."""

    def save_checkpoint(self, directory: str | os.PathLike[str]) -> Mapping[str, dict[str, Any]] | None:
        """Write every rank's shard into `directory` (collective). Returns the files' manifest entries ({bytes,
        sha256} by name) when the ranks hashed them (in parallel), or None: the caller hashes them."""
        ...

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> None:
        """Read a `save_checkpoint` folder back, written at any world size (collective)."""
        ...


@runtime_checkable
class HFWeightStream(Protocol):
    """A backend that exports its weights as HF-named tensors itself (Megatron: fused tensors split, TP gathered)."""

    def hf_weight_stream(self) -> Iterator[tuple[str, Any]]:
        """The full weights as `(hf_name, tensor)` pairs, one at a time (collective with several ranks)."""
        ...
