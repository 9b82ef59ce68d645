"""The device every test here runs on, as a parameter: "cpu" always, "cuda" where CUDA is.

A GPU test's own logic (what it builds, steps, counts and compares) runs on CPU too, so a mistake in it shows on a
machine without a GPU; only what needs CUDA (a CUDA-only key's effect, bf16 kernels on the GPU, NCCL, Megatron's
forward, real SGLang) is skipped on CPU, each with its reason.

On a CUDA host the "cpu" variant must not drift onto the GPU: verl picks its device from a flag it reads once at import
(`verl.utils.device.is_cuda_available`), so the fixture turns it off for that test. Both variants build backends in
this one process, whose world of one is then started with a backend for each device.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import verl.utils.device

NEEDS_CUDA = "needs CUDA"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NEEDS_CUDA))]


@pytest.fixture(scope="session", autouse=True)
def world_for_both_devices():
    """The policy backends start a world of one on first use, with gloo on CPU or NCCL on CUDA; here both devices
    share the process, so on a CUDA host it is started with both (a CPU test first would leave gloo alone)."""
    if torch.cuda.is_available() and not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch) -> str:
    """The device the test runs on; with "cpu" on a CUDA host, verl (and the backends, through it) pick the CPU."""
    if request.param == "cpu" and torch.cuda.is_available():
        monkeypatch.setattr(verl.utils.device, "is_cuda_available", False)
    return request.param
