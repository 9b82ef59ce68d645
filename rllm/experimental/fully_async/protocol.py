"""rLLM fully-async protocol types, re-implemented so rLLM rollout functions run here unchanged
(docs/design.md#rule-rllm-names-public).

rLLM's module (`rllm/experimental/fully_async/protocol.py` in rllm-org/rllm) defines what a rollout function
sees and returns; the names, fields and methods below match it:

- `OutputChunk(response_ids, response_logprobs, version, response_text="")`: one piece of a generation, produced
  by one policy version.
- `OutputWithVersion(prompt_ids, output_chunks, finish_reason)`: what `client.generate` returns; `to_sequence()`,
  `all_response_ids()`, `all_tokens()`, `num_output_tokens`, `response_text`.
- `Sequence(prompt_ids, response_ids, response_logprobs, response_masks, start_version, end_version)` with
  `input_ids`, `total_length`, `is_prefix`, `merge`; and `Trajectory(sequences, reward, metadata)` with
  `append` and `merge` (consecutive sequences where one extends the other are merged into one; the tokens in
  between are padded with mask 0 and log-prob 0).

Token ids given to these types (`prompt_ids`, `response_ids`) may be a list, a tuple, a numpy array, a torch
tensor or a `BatchEncoding` (what transformers 5's `apply_chat_template(..., tokenize=True)` returns); they are
stored as lists of ints, and anything else is refused in one line (api/token_ids.py).

One addition: `Sequence.response_versions` (default None). rLLM keeps only a sequence's first and last version;
this project needs every token's version (staleness and corrections are per token), so sequences made by
`to_sequence()` carry them, and `merge` keeps them. A Sequence a user builds by hand has none; the adapter then
gives every token the sequence's `start_version` (the oldest, so staleness is never under-counted).

A second one, for LoRA runs: `OutputWithVersion.lora_path` (the adapter the client's request named, `policy-v<N>`)
and `Sequence.lora_paths` (one entry per generation behind it; `to_sequence()` sets it, `merge` joins them). The
trainer refuses a LoRA batch whose sequences carry no such record (runtime/trainer/fully_async_trainer.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rllm.experimental.fully_async.api.token_ids import token_ids


@dataclass
class OutputChunk:
    response_ids: list[int]
    response_logprobs: list[float]
    version: int
    response_text: str = ""

    def __post_init__(self) -> None:
        self.response_ids = token_ids(self.response_ids, "OutputChunk.response_ids")

    @property
    def num_output_tokens(self) -> int:
        return len(self.response_ids)


@dataclass
class OutputWithVersion:
    prompt_ids: list[int]
    output_chunks: list[OutputChunk]
    finish_reason: str = "Not Finish"
    prompt_text: str = ""
    lora_path: str | None = None  # this project's addition (module docstring)

    def __post_init__(self) -> None:
        self.prompt_ids = token_ids(self.prompt_ids, "OutputWithVersion.prompt_ids")

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_output_tokens for c in self.output_chunks)

    @property
    def response_text(self) -> str:
        return self.output_chunks[-1].response_text if self.output_chunks else ""

    @property
    def all_text(self) -> str:
        return self.prompt_text + self.response_text

    def append(self, chunk: OutputChunk) -> None:
        self.output_chunks.append(chunk)

    def all_response_ids(self) -> list[int]:
        return [t for c in self.output_chunks for t in c.response_ids]

    def all_tokens(self) -> list[int]:
        return list(self.prompt_ids) + self.all_response_ids()

    def to_sequence(self) -> Sequence:
        ids = self.all_response_ids()
        versions = [c.version for c in self.output_chunks for _ in c.response_ids]
        return Sequence(
            prompt_ids=list(self.prompt_ids),
            response_ids=ids,
            response_logprobs=[lp for c in self.output_chunks for lp in c.response_logprobs],
            response_masks=[1] * len(ids),
            start_version=self.output_chunks[0].version if self.output_chunks else None,
            end_version=self.output_chunks[-1].version if self.output_chunks else None,
            response_versions=versions,
            lora_paths=None if self.lora_path is None else [self.lora_path],
        )


def _joined(first: list[str | None] | None, second: list[str | None] | None) -> list[str | None] | None:
    """Sequence.lora_paths of two sequences merged: None when neither has one (no LoRA), else both, a missing
    record as None."""
    return None if first is None and second is None else [*(first or [None]), *(second or [None])]


@dataclass
class Sequence:
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    response_masks: list[int]
    start_version: int | None = None
    end_version: int | None = None
    response_versions: list[int] | None = None  # this project's addition (module docstring)
    lora_paths: list[str | None] | None = None  # this project's addition, LoRA runs (module docstring)

    def __post_init__(self) -> None:
        self.prompt_ids = token_ids(self.prompt_ids, "Sequence.prompt_ids")
        self.response_ids = token_ids(self.response_ids, "Sequence.response_ids")

    @property
    def input_ids(self) -> list[int]:
        return list(self.prompt_ids) + list(self.response_ids)

    @property
    def total_length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def is_prefix(self, other: Sequence) -> bool:
        return self.input_ids == other.input_ids[: self.total_length]

    def merge(self, other: Sequence) -> Sequence:
        """`other` extends this sequence: one sequence with this prompt; `other`'s prompt tokens beyond this
        sequence's end (observations, tool results) join the response with mask 0."""
        if not self.is_prefix(other):
            raise ValueError("merge: this sequence is not a prefix of the other")
        gap = max(0, len(other.prompt_ids) - self.total_length)
        skip = max(0, self.total_length - len(other.prompt_ids))  # other's response tokens already in self
        versions = None
        if self.response_versions is not None and other.response_versions is not None:
            fill = self.response_versions[-1] if self.response_versions else (other.start_version or 0)
            versions = self.response_versions + [fill] * gap + other.response_versions[skip:]
        return Sequence(
            prompt_ids=list(self.prompt_ids),
            response_ids=other.input_ids[len(self.prompt_ids) :],
            response_logprobs=self.response_logprobs + [0.0] * gap + other.response_logprobs[skip:],
            response_masks=self.response_masks + [0] * gap + other.response_masks[skip:],
            start_version=self.start_version if self.start_version is not None else other.start_version,
            end_version=other.end_version if other.end_version is not None else self.end_version,
            response_versions=versions,
            lora_paths=_joined(self.lora_paths, other.lora_paths),
        )

    def resize_prompt_length(self, max_prompt_length: int) -> Sequence:
        """At most `max_prompt_length` prompt tokens: the rest of the prompt joins the response with mask 0 and
        log-prob 0 (conditioned on, never trained)."""
        cut = len(self.prompt_ids) - max_prompt_length
        if cut <= 0:
            return self
        versions = None
        if self.response_versions is not None:
            versions = [self.start_version or 0] * cut + list(self.response_versions)
        return Sequence(
            prompt_ids=self.prompt_ids[:max_prompt_length],
            response_ids=self.prompt_ids[max_prompt_length:] + list(self.response_ids),
            response_logprobs=[0.0] * cut + list(self.response_logprobs),
            response_masks=[0] * cut + list(self.response_masks),
            start_version=self.start_version,
            end_version=self.end_version,
            response_versions=versions,
            lora_paths=self.lora_paths,
        )


@dataclass
class Trajectory:
    sequences: list[Sequence]
    reward: float = 0.0
    metadata: dict[str, Any] | None = field(default=None)

    def append(self, sequence: Sequence) -> None:
        self.sequences.append(sequence)

    def merge(self) -> list[Sequence]:
        merged: list[Sequence] = []
        for seq in self.sequences:
            if merged and merged[-1].is_prefix(seq):
                merged[-1] = merged[-1].merge(seq)
            else:
                merged.append(seq)
        return merged


@dataclass
class TrajectoryGroup:
    trajectories: list[Trajectory]
