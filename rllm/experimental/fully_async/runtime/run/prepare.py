"""Before any process starts: the task's data and model prepared, and the prompt data checked.

`runtime/run/driver.py` calls these from `Run.start()`; they are here so the run's lifecycle reads on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from omegaconf import DictConfig
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

from rllm.experimental.fully_async.data.datasets import load_prompt_datasets
from rllm.experimental.fully_async.data.prompts import DataError
from rllm.experimental.fully_async.run_spec import data_spec
from rllm.experimental.fully_async.settings.loader import verl_base_config
from rllm.experimental.fully_async.settings.model_source import check_lora_adapter, check_model_source
from rllm.experimental.fully_async.tasks import apply_task
from rllm.experimental.fully_async.workflows import check_agent_fits_model

logger = logging.getLogger(__name__)


@contextmanager
def quiet_hf_progress_bars() -> Iterator[None]:
    """Hide transformers' own progress bars ("Writing model shards", "Loading weights") for the block, then restore.

    They flash by for sub-second saves and loads. The actors hide every tqdm bar through QUIET_LIBRARIES_ENV, but
    tqdm reads TQDM_DISABLE when it is imported, so the driver cannot do the same here. The one bar left is SmolLM2's
    first-run GGUF conversion (`tqdm.auto` inside transformers): 20-50 s of progress worth seeing.
    """

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def prepare_task(cfg: DictConfig) -> None:
    """Built-in tasks make their own data and warmed-up model; point the config at them."""
    with quiet_hf_progress_bars():
        _prepare_task(cfg)


def _prepare_task(cfg: DictConfig) -> None:

    apply_task(cfg, verl_base_config())


def check_data(cfg: DictConfig) -> int:
    """Read and validate the prompt data before any process starts, so a bad file or row is a one-line error
    (data.DataError) rather than an actor that dies during start-up. Returns the number of training prompts. The
    user's model is checked first (a missing folder, an unreachable Hub id: one ConfigError line, in well under 5 s)."""

    check_model_source(cfg)
    check_lora_adapter(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path)
    train, val = load_prompt_datasets(data_spec(cfg), tokenizer)

    if len(train) == 0:
        raise DataError(f"{cfg.data.train_files}: no prompt left after filtering (data.max_prompt_length?)")
    if val is not None and len(val) == 0:
        raise DataError(
            f"{cfg.data.val_files}: no held-out prompt left after filtering (data.max_prompt_length?); "
            "fix the file or set data.val_files=null"
        )

    check_agent_fits_model(cfg)
    return len(train)
