"""SGLang servers on GPU hosts, started through the same `EngineLauncher` as the embedded engine.

`SGLangEngineCommand` builds `python -m sglang.launch_server ...` for the SGLang that verl 0.7.1 pins
(`sglang[srt,openai]==0.5.6`). SGLang cannot be installed on the CPU development machines, so only the command
line is tested there; the HTTP API it serves is the one the embedded engine mirrors.

Choices that matter for fully-async RL:
- `--weight-version` is set (default "0"), because SGLang's own default is the string "default" and the client
  turns the version into an int for every token.
- Each engine gets its own contiguous block of `tp_size` GPUs through `CUDA_VISIBLE_DEVICES`, so N engines on one
  host never share a device.
- `--random-seed` differs per engine (seed + index), so replicas do not sample identical streams.
- `--enable-deterministic-inference` (engines.deterministic_inference): batch-invariant kernels, the pytorch sampling
  backend and each request's `sampling_seed` (default 42); without it SGLang 0.5.6 ignores `sampling_seed`.
- LoRA (actor_rollout_ref.model.lora_rank > 0): `--enable-lora` with `--max-lora-rank`, `--lora-target-modules`,
  `--max-loras-per-batch`, `--max-loaded-loras`, `--lora-eviction-policy`, `--lora-backend` from engines.lora.*
  (engines/lora.py), sized so an engine holds every adapter version the staleness bound admits.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rllm.experimental.fully_async.engines.lora import lora_flags

if TYPE_CHECKING:  # run_spec imports verl (~4 s) through algorithms/; an engine process needs only the type
    from rllm.experimental.fully_async.run_spec import EngineLoRASpec


@dataclass(frozen=True)
class SGLangEngineCommand:
    """Command line of one SGLang 0.5.6 server per engine (implements launcher.EngineCommand)."""

    model_path: str
    tp_size: int = 1  # GPUs per engine (tensor parallel)
    gpu_ids: tuple[int, ...] | None = None  # GPUs this host may use; None = 0..(num_engines * tp_size - 1)
    dtype: str = "bfloat16"
    mem_fraction_static: float | None = 0.8  # share of GPU memory for weights + KV cache
    max_running_requests: int | None = None  # None: SGLang sizes it from the KV cache
    context_length: int | None = None
    seed: int = 0
    weight_version: str = "0"
    log_level: str = "info"
    skip_server_warmup: bool = False
    api_key: str | None = None  # per-run secret for engines reachable beyond loopback (`--api-key`)
    deterministic_inference: bool = False  # `--enable-deterministic-inference` (module docstring)
    lora: EngineLoRASpec | None = None  # LoRA adapters served: `--enable-lora` and its limits (engines/lora.py)
    extra_args: tuple[str, ...] = ()  # anything else, passed through verbatim
    python: str = sys.executable

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")

    def build(self, host: str, port: int, index: int) -> list[str]:
        cmd = [
            self.python,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(self.model_path),
            "--host",
            host,
            "--port",
            str(port),
            "--tp-size",
            str(self.tp_size),
            "--dtype",
            self.dtype,
            "--random-seed",
            str(self.seed + index),
            "--weight-version",
            str(self.weight_version),
            "--log-level",
            self.log_level,
        ]
        if self.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.max_running_requests is not None:
            cmd += ["--max-running-requests", str(self.max_running_requests)]
        if self.context_length is not None:
            cmd += ["--context-length", str(self.context_length)]
        if self.skip_server_warmup:
            cmd.append("--skip-server-warmup")
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        if self.deterministic_inference:
            cmd.append("--enable-deterministic-inference")
        return cmd + lora_flags(self.lora, sglang=True) + list(self.extra_args)

    def gpus_for(self, index: int) -> list[int]:
        """The block of `tp_size` GPUs engine `index` runs on."""
        start = index * self.tp_size
        if self.gpu_ids is None:
            return list(range(start, start + self.tp_size))
        block = list(self.gpu_ids[start : start + self.tp_size])
        if len(block) != self.tp_size:
            raise ValueError(
                f"engine {index} needs GPUs {start}..{start + self.tp_size - 1} of gpu_ids {list(self.gpu_ids)}, "
                f"but only {len(self.gpu_ids)} are listed"
            )
        return block

    def env(self, index: int) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in self.gpus_for(index))}
