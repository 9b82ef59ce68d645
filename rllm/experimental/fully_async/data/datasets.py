"""The run's prompt datasets: the train and (optional) validation sets a data spec names, read as verl-format
prompts (prompts.py) or as rLLM dataset rows (rows.py). The rollout service and the driver's data check read them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rllm.experimental.fully_async.data.prompts import PromptDataset
from rllm.experimental.fully_async.data.rows import RowDataset

if TYPE_CHECKING:
    from rllm.experimental.fully_async.run_spec import DataSpec


def load_prompt_datasets(data: DataSpec, tokenizer: Any) -> tuple[Any, Any]:
    """The train and (optional) validation datasets `data` names: verl-format PromptDatasets, or rLLM dataset rows
    (RowDataset) when `data.rows`; DataError names file, row, field."""

    def read(files: tuple[str, ...]) -> Any:
        if data.rows:
            return RowDataset(list(files))
        return PromptDataset(list(files), tokenizer, data.max_prompt_length, data.overlong)

    return read(data.train_files), read(data.val_files) if data.val_files else None
