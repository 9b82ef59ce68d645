"""What the embedded engine's scheduler holds and returns per request, so the HTTP layer shares the types only.

A generate request's record while it is queued or running (`_Request`) and its result, or a streamed snapshot of it,
in the shape of SGLang's `/generate` (`GenerateOutput`); and the error a weight update that cannot be applied raises
(`WeightUpdateError`). The scheduler (`scheduler.py`) and its weight-update protocol (`weights.py`) do the work.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rllm.experimental.fully_async.engines.embedded.lora import LoRAAdapter
from rllm.experimental.fully_async.engines.embedded.sampling import SamplingParams


class WeightUpdateError(RuntimeError):
    """A weight update could not be applied; the engine keeps serving the old weights."""


@dataclass(frozen=True)
class GenerateOutput:
    """A finished request, in the shape SGLang's `/generate` reports it; or, streamed, the request so far (its
    `finish_reason` and `e2e_latency` None until the last chunk, as SGLang's)."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: dict[str, Any] | None  # {"type": "stop", "matched": id} | {"type": "length", "length": n} | abort
    prompt_tokens: int
    weight_version: str
    e2e_latency: float | None


@dataclass(eq=False)
class _Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # params.max_new_tokens clipped to the context length
    future: asyncio.Future[GenerateOutput]
    arrived: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_version: str | None = None
    held: bool = False  # waiting for /continue_generation, not yet queued
    done: bool = False
    adapter: LoRAAdapter | None = None  # the LoRA adapter it holds from admission to its end (None: base model)
    on_token: Callable[[_Request], None] | None = None  # a streamed request's listener: called after each new token

    @property
    def lora_id(self) -> str | None:
        return None if self.adapter is None else self.adapter.lora_id
