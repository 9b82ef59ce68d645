"""A module's weights of the previous policy version, kept on the CPU: the proximal policy of the correction's
``prox_log_probs=previous`` and of its synchronous control (algorithms/correction_config.py), recomputed rather
than interpolated.

Versions are weight syncs (core/versions.py): the engines serve version V, the weights the trainer pushed at its last
sync. The previous weights are version V - 1's, those pushed at the sync before. With K = 1 (a sync after every
optimizer step) they are the weights before the last step; with K > 1 they are K or more steps back, whatever steps
the trainer took since its last sync.

`PreviousWeights` holds each rank's own parameter tensors (its shards under FSDP2, whose parameters are DTensors),
in `module.parameters()` order, twice: `published` (version V, copied at the last sync; at first the initial
weights, version 0) and `tensors` (version V - 1; None before the first sync). The backend calls `publish` when its
weights become a new version; `in_place` puts `tensors` into the parameters for a forward pass and the current
values back after. Before the first sync there is no previous version, and the current weights are what `in_place`
leaves in place. Cost: one device-to-CPU copy of the parameters per sync (per step with K = 1), two CPU copies
held, and two more copies per forward pass under the previous weights (tests/bench/bench_previous_weights.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

__all__ = ["PreviousWeights", "local_tensor"]


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of a parameter: its shard under FSDP2 (a DTensor), the parameter itself otherwise."""
    to_local = getattr(param, "to_local", None)
    return to_local() if to_local is not None else param


class PreviousWeights:
    """The parameters of `module` at its last two versions: `published` (V) and `tensors` (V - 1, None until the
    first `publish`)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.tensors: list[torch.Tensor] | None = None
        self.published: list[torch.Tensor] = self.snapshot()  # version 0: the weights the engines start from

    def snapshot(self) -> list[torch.Tensor]:
        """A CPU copy of this rank's parameters now, in `parameters()` order."""
        return [local_tensor(param).detach().to("cpu", copy=True) for param in self.module.parameters()]

    def publish(self) -> None:
        """The current weights become the new version: the last published ones become the previous version's."""
        self.tensors, self.published = self.published, self.snapshot()

    def published_is_current(self) -> bool:
        """Whether the parameters still hold the published version's values (no step since the last sync)."""
        return all(
            torch.equal(local_tensor(param).detach().cpu(), value)
            for param, value in zip(self.module.parameters(), self.published, strict=True)
        )

    @contextlib.contextmanager
    def in_place(self, tensors: list[torch.Tensor] | None = None) -> Iterator[None]:
        """The previous version's weights (or `tensors`) in the parameters for the block, the current ones back
        after."""
        tensors = self.tensors if tensors is None else tensors
        if tensors is None:
            yield
            return
        current = self.snapshot()
        self._copy_into_parameters(tensors)
        try:
            yield
        finally:
            self._copy_into_parameters(current)

    def model_state(self, which: str = "previous") -> dict[str, torch.Tensor]:
        """The previous (or the published) version's weights, the current ones if there is none, as a state dict of
        copies sharded as the parameters: what a torch.distributed.checkpoint save writes, and the template a load
        reads into."""

        tensors = self.tensors if which == "previous" else self.published
        with self.in_place(tensors):
            return {name: tensor.detach().clone() for name, tensor in get_model_state_dict(self.module).items()}

    def keep_model_state(self, state: Mapping[str, torch.Tensor], which: str = "previous") -> None:
        """Keep the weights of a `model_state` read back from a checkpoint (this rank's shards, on the CPU) as the
        previous (or the published) version's."""
        names = [name for name, _ in self.module.named_parameters()]
        tensors = [local_tensor(state[name]).detach().to("cpu", copy=True) for name in names]
        if which == "previous":
            self.tensors = tensors
        else:
            self.published = tensors

    def _copy_into_parameters(self, tensors: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for param, value in zip(self.module.parameters(), tensors, strict=True):
                local_tensor(param).copy_(value)
