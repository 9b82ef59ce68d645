"""rLLM dataset rows: read from their files and handed to an rLLM rollout function as they are stored.

rLLM's fully-async executor loads `DatasetRegistry.load_dataset(name, split)` and iterates a DataLoader with batch size
1 and an identity collate, so its rollout function is called as `rollout_fn(client, tokenizer, **row)` with the
registered row itself: any columns, nothing checked, nothing added, the prompt not tokenized (the function renders it).
`RowDataset` is that, in the shape `PromptIterator` walks (a sequence of `PromptRecord`s with stable indexes, so the
ledger, checkpoints and resume work as for verl-format data); each record keeps its row in `PromptRecord.row`.

Selected by `workflow.rllm_rows` (set when the data come by name: data.train_dataset_name, settings/rllm_yaml.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rllm.data.dataset import read_rows
from rllm.experimental.fully_async.data.prompts import PromptRecord, RejectedPrompt
from rllm.experimental.fully_async.errors import DataError

logger = logging.getLogger(__name__)


class RowDataset(Sequence[PromptRecord]):
    """The rows of one or more dataset files (.parquet, .arrow, .json, .jsonl, .csv), in file order."""

    def __init__(self, files: str | Path | Sequence[str | Path]) -> None:

        paths = [Path(files)] if isinstance(files, (str, Path)) else [Path(f) for f in files]
        if not paths:
            raise DataError("no data files given")
        self.records: list[PromptRecord] = []
        self.rejected: list[RejectedPrompt] = []  # nothing is left out: rLLM filters no row
        for path in paths:
            if not path.is_file():
                raise DataError(f"{path}: file not found")
            try:
                rows = read_rows(path)
            except Exception as exc:  # pyarrow / json raise several types for a corrupt file
                first_line = str(exc).splitlines()[0] if str(exc) else ""
                raise DataError(f"{path}: cannot read its rows ({type(exc).__name__}: {first_line})") from exc
            for number, row in enumerate(rows):
                if not isinstance(row, dict):
                    raise DataError(f"{path}: row {number}: is a {type(row).__name__}, not a mapping of fields")
                self.records.append(_record(len(self.records), row))
        logger.info("loaded %d rLLM dataset rows from %s", len(self.records), ", ".join(map(str, paths)))

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:  # type: ignore[override]
        return self.records[i]


def _record(index: int, row: dict[str, Any]) -> PromptRecord:
    """The row, with the few fields the rest of the run reads (the dumps' data source) taken from it when present."""
    reward_model = row.get("reward_model")
    ground_truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else row.get("ground_truth")
    return PromptRecord(
        index=index,
        prompt_ids=[],
        messages=[],
        data_source=str(row.get("data_source", "")),
        ground_truth=ground_truth,
        row=row,
    )
