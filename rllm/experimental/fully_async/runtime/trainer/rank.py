"""One trainer rank's process: `build_rank_backend` wires it (its torch.distributed process group and the
FSDPPolicyBackend holding its shard), and `PolicyRank` is the Ray actor shell around it that the worker group
(ranks.py) creates, one per device.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import logging
import os
import socket
from typing import Any

import ray
import torch.distributed as dist

from rllm.experimental.fully_async.runtime.checkpoints.format import manifest_entries
from rllm.experimental.fully_async.runtime.checkpoints.trainer_state import capture_rng_state, restore_rng_state
from rllm.experimental.fully_async.runtime.sync.sender import LocalSender, backend_tensors

logger = logging.getLogger(__name__)


def build_rank_backend(
    rank: int,
    world: int,
    device: str,
    rendezvous: dict,
    model_path: str,
    actor_cfg: dict,
    kwargs: dict,
    timeout_s: float,
) -> Any:
    """One rank of the trainer's worker group: join its torch.distributed group (NCCL on GPU, gloo on CPU), then
    build the FSDPPolicyBackend that holds this rank's shard.

    Rendezvous: `{"store_path"}` on one machine (a FileStore in a private folder; gloo/NCCL sockets kept on the
    loopback interface), `{"address", "port"}` across machines (TCP at rank 0's node).
    """
    # Imported here, not at the top: verl reads torch.cuda.is_available() when it is imported
    # (verl/utils/device.py), and this module is imported in the rank's process before PolicyRank.__init__ sets the
    # rank's CUDA_VISIBLE_DEVICES.
    from rllm.experimental.fully_async.backends.fsdp import FSDPPolicyBackend

    backend = "nccl" if device == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "store_path" in rendezvous:
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(var, "lo")  # one machine: nothing leaves loopback
        store = dist.FileStore(rendezvous["store_path"], world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        init = f"tcp://{rendezvous['address']}:{rendezvous['port']}"
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=timeout)
    # verl's actor prints its settings ("Actor use_remove_padding=False", ...) from rank 0; Ray would forward
    # them to the console between progress lines. Keep them in the debug log instead.
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        policy = FSDPPolicyBackend(model_path, actor_cfg, **kwargs)
    if printed.getvalue().strip():
        logger.debug("rank %d: %s", rank, printed.getvalue().strip())
    return policy


# "weights": rank 0's end of the distributed weight transport (runtime/sync/sender.py), beside the training calls,
# which keep the default group (one at a time, in order, as their collectives need).
@ray.remote(concurrency_groups={"weights": 4})
class PolicyRank:
    """One rank: joins the process group, then holds an FSDPPolicyBackend and forwards calls to it."""

    def __init__(self, rank: int, world: int, device: str, visible_devices: str | None = None) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.backend: Any = None
        self.weights: Any = None  # LocalSender of the distributed weight transport, built at the first stage
        os.environ["LOCAL_RANK"] = "0"  # Ray shows each rank only its own GPU, as device 0
        if device == "cpu":
            os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CUDA initialises lazily: verl then picks the CPU
        elif visible_devices is not None:
            # A cluster placement names the device (runtime/cluster/multi_node.py); Ray's own pick is by count.
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices

    def placement(self) -> dict[str, Any]:
        """Where this rank runs: its node id and the devices it sees (for tests and logs)."""
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def node_address(self) -> str:
        return ray.util.get_node_ip_address()

    def setup(self, rendezvous: dict, model_path: str, actor_cfg: dict, kwargs: dict, timeout_s: float) -> int:
        """Join the process group and build this rank's backend (`build_rank_backend`); returns this process's pid."""
        self.backend = build_rank_backend(
            self.rank, self.world, self.device, rendezvous, model_path, actor_cfg, kwargs, timeout_s
        )
        return os.getpid()

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.backend, method)(*args)

    def rng_state(self) -> dict[str, Any]:
        """This rank's python, numpy and torch RNG states (the batch record keeps them for replay)."""

        return capture_rng_state()

    def set_rng_state(self, state: dict[str, Any]) -> None:

        restore_rng_state(state)

    def save_checkpoint(self, directory: str) -> dict[str, dict[str, Any]]:
        """This rank's shard (a collective: every rank's files are on disk when it returns), then the manifest
        entries of this rank's share of the folder's files, so the ranks hash in parallel."""

        self.backend.save_checkpoint(directory)
        return manifest_entries(directory, rank=self.rank, world=self.world)

    def stage_weights(
        self, bucket_mb: float, dtype: str | None, backend: str, master_address: str, version: int
    ) -> list[Any]:
        """Every rank gathers the full tensors one at a time (a collective); rank 0 keeps them as buckets and
        answers their headers (runtime/sync/sender.py)."""

        if self.weights is None:
            self.weights = LocalSender(
                lambda: backend_tensors(self.backend),
                bucket_mb=bucket_mb,
                dtype=dtype,
                backend=backend,
                master_address=master_address,
                keep=self.rank == 0,
            )
        return self.weights.stage(version)

    @ray.method(concurrency_group="weights")
    def weights_call(self, method: str, *args: Any) -> Any:
        """Rank 0's weight-update group: open_store, join, broadcast, leave, close (sender.LocalSender)."""
        return None if self.weights is None else getattr(self.weights, method)(*args)

    def free_port(self) -> int:

        with socket.socket() as sock:
            sock.bind(("", 0))
            return int(sock.getsockname()[1])

    def teardown(self) -> None:

        if dist.is_initialized():
            dist.destroy_process_group()
