"""The SGLang 0.5.6 stand-in for tests: how to launch it through the project's real SGLang launcher command."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rllm.experimental.fully_async.engines.sglang import SGLangEngineCommand

STANDIN_DIR = str(Path(__file__).resolve().parent)  # holds the shadow `sglang` package


def standin_pythonpath() -> str:
    """PYTHONPATH under which `python -m sglang.launch_server` starts the stand-in."""
    return os.pathsep.join(p for p in (STANDIN_DIR, os.environ.get("PYTHONPATH", "")) if p)


@dataclass(frozen=True)
class StandinCommand:
    """`SGLangEngineCommand`'s exact command line, run with the shadow `sglang` package on the path."""

    sglang: SGLangEngineCommand

    def build(self, host: str, port: int, index: int) -> list[str]:
        return self.sglang.build(host, port, index)

    def env(self, index: int) -> dict[str, str]:
        return {**self.sglang.env(index), "PYTHONPATH": standin_pythonpath(), "CUDA_VISIBLE_DEVICES": ""}


def standin_command(model_path: str, **kwargs: object) -> StandinCommand:
    """A stand-in engine command for a CPU test model (float32, no memory fraction: GPU-only)."""
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("mem_fraction_static", None)
    return StandinCommand(SGLangEngineCommand(str(model_path), **kwargs))  # type: ignore[arg-type]
