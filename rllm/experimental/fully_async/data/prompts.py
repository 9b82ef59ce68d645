"""Prompt data: verl-format parquet in, tokenized prompts out, in a resumable deterministic order.

`PromptDataset` reads verl's RL dataset format — one row per prompt with columns `prompt` (a list of chat
messages), `data_source`, `reward_model` (a struct holding `ground_truth`) and optionally `extra_info` — checks
every row, and tokenizes each prompt with the tokenizer's chat template (the same call verl's RLHFDataset makes),
so any HF tokenizer with a chat template works, including the addition task's.

Bad data stops the program at load time with a `DataError` whose one line names the file, the row and the field;
a prompt that is merely too long is a decision, not an error: it is filtered (and listed in `rejected` with its
reason, for the sample ledger) or truncated, as configured.

`PromptIterator` walks the dataset epoch after epoch in a seeded shuffled order. Epoch e's order depends only on
(seed, e), so its checkpoint is two integers (epoch, position), and every datum carries a stable
`prompt_uid = f"e{epoch}/{index}"` (index = the row's position in the source files) that the ledger and the
trajectories use.

Tokenized once: the driver checks the data before anything starts and the rollout actor loads it again, so the
token ids of each file are cached next to it (`tokens_cache`) and the second load calls no tokenizer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow.parquet as pq

from rllm.experimental.fully_async.data import token_cache

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

Overlong = Literal["filter", "truncate_left", "truncate_right", "error"]
_TOKENIZE_CHUNK = 1024  # prompts per apply_chat_template call: one call per prompt costs ~10x more in Python


# Unusable prompt data. The message is one line: `<file>: row <i>: field '<name>' <problem>` (exit 2).
from rllm.experimental.fully_async.errors import DataError  # noqa: E402


@dataclass(frozen=True)
class PromptRecord:
    """One validated, tokenized prompt."""

    index: int  # position of the row in the source files (concatenated in the order given)
    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any] = field(default_factory=dict)
    truncated: bool = False
    row: dict[str, Any] | None = None  # an rLLM dataset row, given as it is to an rLLM rollout function (data/rows.py)


@dataclass(frozen=True)
class RejectedPrompt:
    """A row left out of the dataset on purpose (for the ledger: filtered with `reason`)."""

    index: int
    file: str
    row: int
    reason: str  # e.g. "prompt_too_long"
    prompt_length: int


class PromptDataset(Sequence[PromptRecord]):
    """Validated, tokenized prompts from one or more verl-format parquet files."""

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: PreTrainedTokenizerBase,
        max_prompt_length: int,
        overlong: Overlong = "filter",
    ) -> None:
        """`overlong` decides what happens to prompts longer than max_prompt_length tokens:
        "filter" drops them (listed in `rejected`), "truncate_left" keeps their last tokens (the end holds the
        question and the chat template's generation prompt), "truncate_right" keeps their first tokens, and
        "error" raises DataError.
        """
        if max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
        if overlong not in ("filter", "truncate_left", "truncate_right", "error"):
            raise ValueError(f"overlong must be filter, truncate_left, truncate_right or error, got {overlong!r}")
        paths = [Path(files)] if isinstance(files, (str, Path)) else [Path(f) for f in files]
        if not paths:
            raise DataError("no data files given")
        self.max_prompt_length = max_prompt_length
        self.records: list[PromptRecord] = []
        self.rejected: list[RejectedPrompt] = []
        offset = 0
        for path in paths:
            rows = _read_rows(path)
            parsed = [_validate_row(path, i, row) for i, row in enumerate(rows)]
            ids = cached_tokenize(tokenizer, [p["messages"] for p in parsed], path)
            for row_number, (p, prompt_ids) in enumerate(zip(parsed, ids, strict=True)):
                self._admit(path, row_number, offset + row_number, p, prompt_ids, overlong)
            offset += len(rows)
        logger.info(
            "loaded %d prompts from %s (%d rejected as longer than %d tokens)",
            len(self.records),
            ", ".join(str(p) for p in paths),
            len(self.rejected),
            max_prompt_length,
        )

    def _admit(
        self, path: Path, row: int, index: int, parsed: dict[str, Any], prompt_ids: list[int], overlong: Overlong
    ) -> None:
        length, truncated = len(prompt_ids), False
        if length > self.max_prompt_length:
            if overlong == "error":
                raise DataError(
                    f"{path}: row {row}: field 'prompt' is {length} tokens, longer than max_prompt_length="
                    f"{self.max_prompt_length}"
                )
            if overlong == "filter":
                self.rejected.append(RejectedPrompt(index, str(path), row, "prompt_too_long", length))
                return
            keep = self.max_prompt_length
            prompt_ids = prompt_ids[-keep:] if overlong == "truncate_left" else prompt_ids[:keep]
            truncated = True
        self.records.append(PromptRecord(index=index, prompt_ids=prompt_ids, truncated=truncated, **parsed))

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:  # type: ignore[override]
        return self.records[i]


def _read_rows(path: Path) -> list[dict[str, Any]]:

    if not path.is_file():
        raise DataError(f"{path}: file not found")
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types (ArrowInvalid, OSError, ...) for a corrupt file
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        raise DataError(f"{path}: cannot read as parquet ({type(exc).__name__}: {first_line})") from exc
    for column in ("prompt", "data_source", "reward_model"):
        if column not in table.column_names:
            raise DataError(f"{path}: row 0: field '{column}' is missing (no such column)")
    # to_pylist gives plain lists/dicts (pandas would give numpy arrays for list columns).
    return table.to_pylist()


def _validate_row(path: Path, row: int, data: dict[str, Any]) -> dict[str, Any]:
    def fail(name: str, problem: str) -> DataError:
        return DataError(f"{path}: row {row}: field '{name}' {problem}")

    messages = data.get("prompt")
    if messages is None:
        raise fail("prompt", "is missing")
    if isinstance(messages, np.ndarray):
        messages = messages.tolist()
    if not isinstance(messages, list) or not messages:
        raise fail("prompt", f"must be a non-empty list of chat messages, got {type(messages).__name__}")
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise fail(f"prompt[{j}].role", "is missing or not a string")
        if not isinstance(message.get("content"), str):
            raise fail(f"prompt[{j}].content", "is missing or not a string")
    data_source = data.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        raise fail("data_source", "is missing or not a non-empty string")
    reward_model = data.get("reward_model")
    if not isinstance(reward_model, dict):
        raise fail("reward_model", "is missing or not a struct")
    ground_truth = reward_model.get("ground_truth")
    if ground_truth is None:
        raise fail("reward_model.ground_truth", "is missing")
    extra_info = data.get("extra_info")
    if extra_info is None:
        extra_info = {}
    elif not isinstance(extra_info, dict):
        raise fail("extra_info", f"must be a struct, got {type(extra_info).__name__}")
    # Parquet structs come back with every key of the column's schema; drop the absent (None) ones.
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    return {
        "messages": messages,
        "data_source": data_source,
        "ground_truth": ground_truth,
        "extra_info": {k: v for k, v in extra_info.items() if v is not None},
    }


def cached_tokenize(tokenizer: PreTrainedTokenizerBase, conversations: list[list[dict]], path: Path) -> list[list[int]]:
    """`_tokenize`, through the token cache beside `path` (data/token_cache.py): a second load calls no tokenizer."""

    cache = token_cache.cache_path(path, tokenizer)
    ids = token_cache.load_ids(cache, len(conversations))
    if ids is None:
        ids = _tokenize(tokenizer, conversations, path)
        token_cache.store_ids(cache, ids)
    else:
        logger.info("%s: token ids from %s", path, cache)
    return ids


def _tokenize(tokenizer: PreTrainedTokenizerBase, conversations: list[list[dict]], path: Path) -> list[list[int]]:
    """Token ids of each conversation rendered with the chat template and the generation prompt."""
    out: list[list[int]] = []
    for start in range(0, len(conversations), _TOKENIZE_CHUNK):
        chunk = conversations[start : start + _TOKENIZE_CHUNK]
        try:
            # return_dict=False: transformers 5 returns a BatchEncoding by default, 4.x a list; ask for the list.
            ids = tokenizer.apply_chat_template(chunk, add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as exc:  # a template error names neither file nor row: find the row and say so
            for j, conversation in enumerate(chunk):
                try:
                    tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
                except Exception as row_exc:
                    raise DataError(
                        f"{path}: row {start + j}: field 'prompt' cannot be rendered by the chat template "
                        f"({type(row_exc).__name__}: {row_exc})"
                    ) from row_exc
            raise DataError(f"{path}: cannot tokenize prompts ({type(exc).__name__}: {exc})") from exc
        out.extend(list(map(int, row)) for row in ids)
    return out


# --- iteration --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptDatum:
    """One draw from the iterator: a prompt record in a given epoch."""

    prompt_uid: str  # f"e{epoch}/{index}": unique across epochs, stable across restarts
    epoch: int
    record: PromptRecord

    @property
    def prompt_ids(self) -> list[int]:
        return self.record.prompt_ids

    @property
    def ground_truth(self) -> Any:
        return self.record.ground_truth

    @property
    def data_source(self) -> str:
        return self.record.data_source

    @property
    def extra_info(self) -> dict[str, Any]:
        return self.record.extra_info

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.record.messages

    @property
    def row(self) -> dict[str, Any] | None:
        return self.record.row


class PromptIterator(Iterator[PromptDatum]):
    """Seeded shuffled epochs over a dataset, with a checkpointable position.

    Epoch e visits every record once in the order `np.random.default_rng([seed, e]).permutation(n)` (or file order
    when shuffle is off); `num_epochs=None` never ends. `state_dict()` after k draws, loaded into a fresh iterator
    over the same dataset, continues with draw k + 1.
    """

    def __init__(
        self, dataset: Sequence[PromptRecord], seed: int, num_epochs: int | None = 1, shuffle: bool = True
    ) -> None:
        if len(dataset) == 0:
            raise ValueError("PromptIterator needs a non-empty dataset")
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None, got {num_epochs}")
        self.dataset = dataset
        self.seed = seed
        self.num_epochs = num_epochs
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # draws taken from the current epoch
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    @property
    def exhausted(self) -> bool:
        return self.num_epochs is not None and self.epoch >= self.num_epochs

    def __next__(self) -> PromptDatum:
        if self.position >= len(self.dataset):
            self.epoch, self.position = self.epoch + 1, 0
            if not self.exhausted:
                self._order = self._epoch_order(self.epoch)
        if self.exhausted:
            raise StopIteration
        record = self.dataset[int(self._order[self.position])]
        self.position += 1
        return PromptDatum(prompt_uid=f"e{self.epoch}/{record.index}", epoch=self.epoch, record=record)

    def take(self, n: int) -> list[PromptDatum]:
        """Up to n next data (fewer only when the last epoch ends)."""
        out: list[PromptDatum] = []
        for datum in self:
            out.append(datum)
            if len(out) >= n:
                break
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_size": len(self.dataset),
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where the checkpointed iterator stopped; a different dataset or seed raises (not a resume)."""
        expected = {"seed": self.seed, "shuffle": self.shuffle, "dataset_size": len(self.dataset)}
        for key, value in expected.items():
            if state.get(key) != value:
                raise ValueError(f"iterator checkpoint has {key}={state.get(key)!r} but this iterator has {value!r}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.dataset):
            raise ValueError(f"iterator checkpoint position out of range: epoch={epoch}, position={position}")
        self.epoch, self.position = epoch, position
        self._order = self._epoch_order(epoch)
