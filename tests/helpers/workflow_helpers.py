"""Helpers shared by the workflow tests (the number-line and calculator tasks): a prompt as the workflows read it, and
a client that answers each turn with a scripted action instead of an engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rllm.experimental.fully_async.engines.client import GenerationResult


@dataclass
class Datum:
    """One prompt as `PromptIterator` yields it."""

    prompt_uid: str
    prompt_ids: list[int]
    extra_info: dict[str, Any]
    ground_truth: Any = "7"
    data_source: str = "test"


@dataclass
class ScriptedClient:
    """Answers the n-th generate with the n-th action's tokens then EOS (cut at max_new_tokens), log-prob
    -0.1 * position; `versions` gives each turn's per-token versions (default all 0). `calls` records the inputs."""

    tokenizer: Any
    actions: list[str]
    versions: list[list[int]] | None = None
    calls: list[list[int]] = field(default_factory=list)

    async def generate(self, input_ids, sampling_params, *, rid=None) -> GenerationResult:
        turn = len(self.calls)
        self.calls.append(list(input_ids))
        eos = self.tokenizer.eos_token_id
        ids = [*self.tokenizer.encode(self.actions[turn], add_special_tokens=False), eos]
        ids = ids[: sampling_params["max_new_tokens"]]
        versions = self.versions[turn] if self.versions else [0] * len(ids)
        return GenerationResult(
            output_ids=ids,
            logprobs=[-0.1 * (i + 1) for i in range(len(ids))],
            versions=versions,
            finish_reason="stop" if ids[-1] == eos else "length",
            num_resumes=len(set(versions)) - 1,
            prompt_tokens=len(input_ids),
        )


def datum(tok, start=3, target=7, uid="p0"):
    return Datum(uid, tok.encode("N", add_special_tokens=False), {"start": start, "target": target}, str(target))
