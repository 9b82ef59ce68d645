"""The trainer's worker group: N FSDP2 ranks as Ray actors behind FSDPPolicyBackend's interface.

`DistributedPolicyBackend` answers the calls the trainer makes on its `backend` (`compute_log_prob`,
`update_policy`, `save_hf`, `save_checkpoint`/`load_checkpoint`, `state_dict`/`load_state_dict`) by fanning each
one out to N `PolicyRank` actors at once. Each rank holds an
`FSDPPolicyBackend` on one device (`num_gpus=1` on GPU, CPU only otherwise) in one torch.distributed group (NCCL on
GPU, gloo on CPU), so one call is one optimizer step across all ranks: FSDP2 averages the gradients and verl's
patched actor weights every micro-batch by its share of the global token count (patches/README.md).

Per call the batch is split BALANCED BY TOKENS: verl's `get_seqlen_balanced_partitions` (Karmarkar-Karp on
`attention_mask` sums, equal row counts per rank, as verl's own `_balance_batch`). Equal row counts matter: with
static micro-batching every rank then cuts the same number of micro-batches, and with `use_dynamic_bsz` the patch
agrees the count (all-reduce MAX), which only works if no rank has fewer rows than that count. A batch whose row
count does not divide by N is padded (verl's `pad_dataproto_to_divisor`) with copies of its first rows whose
`response_mask` is zeroed: they add nothing to the loss, and their log-probs are dropped.

For the distributed weight transport, rank 0 is also rank 0 of the engines' weight-update group: every rank gathers
the full parameters, rank 0 keeps and broadcasts them (`stage_weights`, `weights_call`; runtime/sync/sender.py).

Checkpoints: `save_checkpoint` has every rank write its own shard through torch.distributed.checkpoint (the run's
checkpoint puts them in its temporary folder, runtime/checkpoints/trainer_state.py); nothing is gathered, and each rank
hashes its share of the files for the manifest. `load_checkpoint` reads them back at any world size (DCP reshards).
`state_dict` gathers the full state on rank 0: for tests, and for loading this round's first checkpoint format.
Several nodes must see the checkpoint folder at the same path (a shared filesystem), as with verl's checkpoints.

Rendezvous: one machine uses a FileStore in a private temporary folder and keeps gloo/NCCL sockets on the loopback
interface; several machines rendezvous over TCP at rank 0's node address. Every wait has a timeout naming the rank
and the call; a rank that died fails the call with one line, and the group refuses further calls (its process group
is broken: the run restarts from its last checkpoint).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
import torch
from omegaconf import DictConfig, OmegaConf
from verl.protocol import pad_dataproto_to_divisor
from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

from rllm.experimental.fully_async.errors import FullyAsyncError
from rllm.experimental.fully_async.runtime.sync.sender import RankZeroSender
from rllm.experimental.fully_async.runtime.trainer.rank import PolicyRank

logger = logging.getLogger(__name__)

__all__ = ["DistributedPolicyBackend", "RankFailedError", "split_by_tokens"]

SETUP_TIMEOUT_S = 600.0  # model load + FSDP2 sharding + first collective, per rank
CALL_TIMEOUT_S = 1800.0  # one PPO step on a large batch; also torch.distributed's own collective timeout


class RankFailedError(FullyAsyncError, RuntimeError):
    """A trainer rank died, raised or did not answer in time; the worker group cannot take further steps."""


def split_by_tokens(data: Any, world: int) -> tuple[list[Any], list[list[int]], int]:
    """Split a DataProto into `world` shards of equal row count and balanced token count.

    Returns (shards, row indices of each shard in the padded batch, rows in the original batch). Rows past the
    original count are padding with an all-zero `response_mask` (see the module docstring).
    """

    rows = len(data)
    if rows == 0:
        raise ValueError("the batch is empty: nothing to split across trainer ranks")
    padded, pad = pad_dataproto_to_divisor(data, world)
    if pad and "response_mask" in padded.batch.keys():  # noqa: SIM118 (a TensorDict refuses `in`)
        padded.batch["response_mask"][rows:] = 0  # concat made new tensors: the caller's batch is untouched
    seqlens = padded.batch["attention_mask"].sum(dim=-1).tolist()
    partitions = get_seqlen_balanced_partitions(seqlens, world, equal_size=True)
    return [padded[list(part)] for part in partitions], [list(part) for part in partitions], rows


class DistributedPolicyBackend:
    """FSDPPolicyBackend's interface over `world` rank actors; see the module docstring."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        actor_cfg: Mapping[str, Any],
        *,
        world: int,
        device: str = "cpu",
        nnodes: int = 1,
        seed: int = 0,
        attn_implementation: str = "sdpa",
        enable_gradient_checkpointing: bool = False,
        keep_previous_weights: bool = False,
        lora: Mapping[str, Any] | None = None,
        call_timeout_s: float = CALL_TIMEOUT_S,
        setup_timeout_s: float = SETUP_TIMEOUT_S,
        rank_options: list[dict[str, Any]] | None = None,
        rank_devices: list[str] | None = None,
    ) -> None:
        """Start `world` ranks on `device` ("cuda" or "cpu") and build the policy on each.

        `rank_options` (one dict per rank, e.g. a placement-group scheduling strategy from the placement plan) is
        passed to Ray's `.options`; by default each rank asks for one GPU (cuda) or one CPU slot (cpu).
        `rank_devices` (one per rank): the `CUDA_VISIBLE_DEVICES` each rank sets (a cluster placement's devices).
        """

        if device not in ("cuda", "cpu"):
            raise ValueError(f"trainer.device must be cuda or cpu, got {device!r}")
        if world < 1:
            raise ValueError(f"the trainer needs at least one rank, got world={world}")
        self.model_path = Path(model_path)
        self.world, self.device, self.call_timeout_s = world, device, float(call_timeout_s)
        self._broken: str | None = None
        cfg = OmegaConf.to_container(actor_cfg, resolve=True) if isinstance(actor_cfg, DictConfig) else dict(actor_cfg)
        resources = {"num_gpus": 1, "num_cpus": 1} if device == "cuda" else {"num_cpus": 1}
        options = rank_options or [{} for _ in range(world)]
        if len(options) != world:
            raise ValueError(f"rank_options has {len(options)} entries for {world} ranks")
        devices = rank_devices or [None] * world
        if len(devices) != world:
            raise ValueError(f"rank_devices has {len(devices)} entries for {world} ranks")
        self._ranks = [
            PolicyRank.options(**(resources | options[r])).remote(r, world, device, devices[r]) for r in range(world)
        ]
        self._store_dir: tempfile.TemporaryDirectory | None = None
        if nnodes == 1:
            self._store_dir = tempfile.TemporaryDirectory(prefix="rllm_trainer_ranks_")
            rendezvous: dict[str, Any] = {"store_path": str(Path(self._store_dir.name) / "store")}
        else:
            rendezvous = {
                "address": self._wait([self._ranks[0].node_address.remote()], "node_address", setup_timeout_s)[0],
                "port": self._wait([self._ranks[0].free_port.remote()], "free_port", setup_timeout_s)[0],
            }
        kwargs = {
            "seed": seed,
            "attn_implementation": attn_implementation,
            "enable_gradient_checkpointing": enable_gradient_checkpointing,
            "keep_previous_weights": keep_previous_weights,
            "lora": dict(lora) if lora is not None else None,
        }
        started = time.monotonic()
        refs = [
            rank.setup.remote(rendezvous, str(model_path), cfg, kwargs, self.call_timeout_s) for rank in self._ranks
        ]
        pids = self._wait(refs, "setup", setup_timeout_s)
        logger.info(
            "trainer worker group: %d %s ranks (pids %s) up in %.1f s", world, device, pids, time.monotonic() - started
        )

    # ------------------------------------------------------------------------------------------------------------
    # FSDPPolicyBackend's interface
    # ------------------------------------------------------------------------------------------------------------

    def compute_log_prob(self, data: Any, weights: str = "current") -> Any:
        """log-probs [B, R] float32 on CPU, rows in the batch's order, under the current or the previous weights
        (see FSDPPolicyBackend.compute_log_prob)."""

        shards, parts, rows = split_by_tokens(data, self.world)
        results = self._fan_out("compute_log_prob", [(shard, weights) for shard in shards])
        out = torch.empty(sum(len(p) for p in parts), *results[0].shape[1:], dtype=results[0].dtype)
        for part, log_probs in zip(parts, results, strict=True):
            out[part] = log_probs
        return out[:rows]

    def update_policy(self, data: Any) -> dict[str, float]:
        """One optimizer step across all ranks on the whole batch; metrics averaged over ranks.

        The patched actor reports each rank's loss as its token share times `world` / global tokens, so the mean
        over ranks is the whole-batch token mean; grad_norm, lr and optimizer_step are the same on every rank.
        """
        shards, _, _ = split_by_tokens(data, self.world)
        results = self._fan_out("update_policy", [(shard,) for shard in shards])
        keys = set().union(*results)
        return {k: sum(r[k] for r in results if k in r) / sum(1 for r in results if k in r) for k in sorted(keys)}

    def weights_synced(self) -> None:
        """Every rank's weights became the new version (FSDPPolicyBackend.weights_synced: each copies its shard)."""
        self._fan_out("weights_synced", [()] * self.world)

    def save_hf(self, path: str | os.PathLike[str], dtype: str | None = None) -> None:
        """Full HF weights written by rank 0 (every rank takes part in gathering them), floating-point tensors cast
        to `dtype` when given (param_sync.dtype), as FSDPPolicyBackend.save_hf."""
        self._fan_out("save_hf", [(str(path), dtype)] * self.world)

    def save_adapter(self, path: str | os.PathLike[str], dtype: str | None = None) -> None:
        """The LoRA adapter as a peft folder (every rank gathers its shards, rank 0 writes), as
        FSDPPolicyBackend.save_adapter."""
        self._fan_out("save_adapter", [(str(path), dtype)] * self.world)

    def describe(self) -> list[dict[str, Any]]:
        """Each rank's FSDPPolicyBackend.describe(), in rank order: what each rank actually built."""
        return self._fan_out("describe", [()] * self.world)

    @property
    def world_size(self) -> int:
        return self.world

    def state_dict(self) -> dict[str, Any]:
        """Full (unsharded) model, optimizer and schedule state, gathered on rank 0 and returned from it (tests and
        comparisons; the run's checkpoints use `save_checkpoint`, which gathers nothing)."""
        return self._fan_out("state_dict", [()] * self.world)[0]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict` gathered from a group (any world size > 1): rank 0's copy is broadcast to the
        others. A world-1 state dict (a plain optimizer's, keyed by parameter index) does not fit; see
        runtime/checkpoints/trainer_state.py, which refuses it."""
        ref = ray.put(dict(state))  # one copy in the object store, read by every rank
        self._fan_out("load_state_dict", [(ref,)] * self.world)

    def save_checkpoint(self, directory: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
        """Each rank writes its own shard with torch.distributed.checkpoint (FSDPPolicyBackend.save_checkpoint);
        returns the manifest entries of every file in `directory`, hashed by the ranks in parallel."""
        shares = self._fan_out("save_checkpoint", [(str(directory),)] * self.world, on_rank=True)
        return {name: entry for share in shares for name, entry in share.items()}

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> None:
        """Each rank reads its shard of a `save_checkpoint` folder written by any world size."""
        self._fan_out("load_checkpoint", [(str(directory),)] * self.world)

    def rng_states(self) -> list[dict[str, Any]]:
        """Every rank's RNG states, in rank order (runtime/trainer/record.py keeps them for replay)."""
        return self._fan_out("rng_state", [()] * self.world, on_rank=True)

    def set_rng_states(self, states: list[dict[str, Any]]) -> None:
        """Put back what `rng_states` returned, rank by rank."""
        self._fan_out("set_rng_state", [(state,) for state in states], on_rank=True)

    # ------------------------------------------------------------------------------------------------------------
    # The distributed weight transport (runtime/sync/sender.py)
    # ------------------------------------------------------------------------------------------------------------

    def weight_sender(self, *, bucket_mb: float, dtype: str | None, master_address: str) -> Any:
        """Rank 0's end of the weight-update group, as `DistributedTransport(sender=...)` drives it."""

        return RankZeroSender(self, bucket_mb=bucket_mb, dtype=dtype, master_address=master_address)

    @property
    def rank_zero(self) -> Any:
        return self._ranks[0]

    def rank_zero_address(self) -> str:
        """The IP of the node trainer rank 0 runs on (Ray's)."""
        return self._wait([self._ranks[0].node_address.remote()], "node_address", self.call_timeout_s)[0]

    def on_every_rank(self, method: str, args: tuple) -> list[Any]:
        """Call the rank actors' own `method` on every rank at once (a collective); results in rank order."""
        if self._broken is not None:
            raise RankFailedError(f"trainer worker group is down since: {self._broken}")
        return self._wait([getattr(rank, method).remote(*args) for rank in self._ranks], method, self.call_timeout_s)

    def shutdown(self) -> None:
        """Leave the process group and end the rank actors (after a failure, just end them)."""
        if self._broken is None:
            try:
                self._wait([rank.teardown.remote() for rank in self._ranks], "teardown", 60.0)
            except RankFailedError as exc:
                logger.warning("trainer ranks: %s", exc)
        for rank in self._ranks:
            ray.kill(rank)
        if self._store_dir is not None:
            self._store_dir.cleanup()

    # ------------------------------------------------------------------------------------------------------------

    def _fan_out(self, method: str, args_per_rank: list[tuple], *, on_rank: bool = False) -> list[Any]:
        """Call `method` of every rank's backend (or, `on_rank`, of the rank actor itself) and wait for all."""
        if self._broken is not None:
            raise RankFailedError(f"trainer worker group is down since: {self._broken}")
        pairs = zip(self._ranks, args_per_rank, strict=True)
        if on_rank:
            refs = [getattr(rank, method).remote(*args) for rank, args in pairs]
        else:
            refs = [rank.call.remote(method, *args) for rank, args in pairs]
        return self._wait(refs, method, self.call_timeout_s)

    def _wait(self, refs: list[Any], call: str, timeout_s: float) -> list[Any]:
        """Results in rank order. The first rank to fail fails the call at once (the others would wait in a
        collective for it until their own timeout); a deadline names every rank still running."""
        deadline = time.monotonic() + timeout_s
        index = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                ranks = sorted(index[ref] for ref in pending)
                self._fail(f"trainer rank(s) {ranks} of {len(refs)} gave no answer to {call} within {timeout_s:.0f} s")
            rank = index[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except ray.exceptions.RayActorError as exc:
                self._fail(f"trainer rank {rank} of {len(refs)} died during {call}: {_first_line(exc)}")
            except ray.exceptions.RayTaskError as exc:
                self._fail(f"trainer rank {rank} of {len(refs)} raised in {call}: {_first_line(exc.cause or exc)}")
        return [results[rank] for rank in range(len(refs))]

    def _fail(self, message: str) -> None:
        self._broken = message
        raise RankFailedError(message)


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0] if text else type(exc).__name__
