"""rLLM's import path for its protocol types (`from rllm.experimental.fully_async.protocol import Trajectory`), so
rollout functions written for rLLM's fully-async module import unchanged. This project's own messages live in
core/protocol.py; see compat/rllm_protocol.py for how the two map."""

from rllm.experimental.fully_async.compat.rllm_protocol import (
    OutputChunk,
    OutputWithVersion,
    Sequence,
    Trajectory,
    TrajectoryGroup,
)

__all__ = ["OutputChunk", "OutputWithVersion", "Sequence", "Trajectory", "TrajectoryGroup"]
