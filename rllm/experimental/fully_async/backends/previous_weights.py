"""A module's weights from before its last optimizer step, kept on the CPU: the proximal policy of the correction's
``prox_log_probs=previous`` (algorithms/correction_config.py), recomputed rather than interpolated.

`PreviousWeights` holds each rank's own parameter tensors (its shards under FSDP2, whose parameters are DTensors),
in `module.parameters()` order. The backend takes a `snapshot` before each update and `keep`s it once a step was
taken; `in_place` puts the copy into the parameters for a forward pass and the current values back after. Before
the first step there is no copy, and the current weights are what `in_place` leaves in place. Cost: one device-to-CPU
copy of the parameters per step, and two more per forward pass under the previous weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

__all__ = ["PreviousWeights", "local_tensor"]


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of a parameter: its shard under FSDP2 (a DTensor), the parameter itself otherwise."""
    to_local = getattr(param, "to_local", None)
    return to_local() if to_local is not None else param


class PreviousWeights:
    """The parameters of `module` as they were before its last optimizer step (None until one was kept)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.tensors: list[torch.Tensor] | None = None

    def snapshot(self) -> list[torch.Tensor]:
        """A CPU copy of this rank's parameters now, in `parameters()` order (to `keep` once the step is taken)."""
        return [local_tensor(param).detach().to("cpu", copy=True) for param in self.module.parameters()]

    def keep(self, tensors: list[torch.Tensor] | None) -> None:
        """Make `tensors` (a `snapshot`, or None for none) the previous weights."""
        self.tensors = tensors

    @contextlib.contextmanager
    def in_place(self) -> Iterator[None]:
        """The previous weights in the parameters for the block, the current ones back after."""
        if self.tensors is None:
            yield
            return
        current = self.snapshot()
        self._copy_into_parameters(self.tensors)
        try:
            yield
        finally:
            self._copy_into_parameters(current)

    def model_state(self) -> dict[str, torch.Tensor]:
        """The previous weights (the current ones if none yet) as a state dict of copies sharded as the parameters:
        what a torch.distributed.checkpoint save writes, and the template a load reads into."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        with self.in_place():
            return {name: tensor.detach().clone() for name, tensor in get_model_state_dict(self.module).items()}

    def keep_model_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Keep the weights of a `model_state` read back from a checkpoint (this rank's shards, on the CPU)."""
        self.tensors = [
            local_tensor(state[name]).detach().to("cpu", copy=True) for name, _ in self.module.named_parameters()
        ]

    def _copy_into_parameters(self, tensors: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for param, value in zip(self.module.parameters(), tensors, strict=True):
                local_tensor(param).copy_(value)
