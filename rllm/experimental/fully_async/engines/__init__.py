"""Inference engines behind one HTTP API (SGLang 0.5.6's native subset; docs/design.md#rule-one-engine-api).

- `embedded/`: the CPU engine (aiohttp server, continuous batching in `scheduler`, model and KV cache in
  `model_runner`, sampling in `sampling`, weight updates into a recycled spare model in `weights`), started
  with `python -m ...engines.embedded.server`.
- `launcher`: start N engines as subprocesses on free loopback ports and stop them (any `EngineCommand`).
- `sglang`: the `EngineCommand` for SGLang servers on GPU hosts.
- `supervisor`: notice an engine process that died during a run and restart it, drop it or stop the run.

Only the launcher's names are imported here, so importing the package does not pull in torch.
"""

from rllm.experimental.fully_async.engines.launcher import (
    EmbeddedEngineCommand,
    EngineCommand,
    EngineLauncher,
    EngineProcess,
    EngineStartupError,
    free_port,
)
from rllm.experimental.fully_async.engines.sglang import SGLangEngineCommand

__all__ = [
    "EmbeddedEngineCommand",
    "EngineCommand",
    "EngineLauncher",
    "EngineProcess",
    "EngineStartupError",
    "SGLangEngineCommand",
    "free_port",
]
