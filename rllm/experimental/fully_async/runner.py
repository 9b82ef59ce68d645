"""rLLM's runner at rLLM's path: `AsyncAgentTrainer(config, rollout_fn, ...).train()` runs this project's training.

An rLLM fully-async program (rllm-org/rllm: `examples/fully_async/deepresearch/train.py`, the DAPO example
`rllm/experimental/fully_async/train_dapo_example.py` in its history) is written like this, and runs here unchanged:

    @hydra.main(config_path="pkg://rllm.experimental.fully_async.config", config_name="fully_async_ppo_trainer",
                version_base=None)
    def main(config):
        async def rollout_fn(client, tokenizer, **datum): ...          # often a closure over config values
        AsyncAgentTrainer(config=config, rollout_fn=rollout_fn, val_rollout_fn=None).train()

What `.train()` does here, in rLLM's terms:
- the config: rLLM's config package is shipped at the same path (`config/fully_async_ppo_trainer.yaml`); what the
  program changed in it is mapped onto this project's settings or refused in one line (settings/rllm_program.py,
  settings/rllm_yaml.py), then trained by the same driver as the command line (runtime/run/driver.py);
- the data: `data.train_dataset_name` / `val_dataset_name` (+ `_split`), `async_training.dataset_name` or the
  `dataset_name=` argument name a dataset registered with `rllm.data.DatasetRegistry` (or a data file), and each
  row is given to the rollout function as `**row`, as rLLM's executor does (data/rows.py);
- the functions: `rollout_fn` (and `val_rollout_fn`, which plays the validation data; without it `rollout_fn` does)
  are cloudpickled here and unpickled in the rollout service's process, so a closure travels by value with the
  values it captured, as it does when rLLM hands it to its Ray executor (api/rollout_functions.py);
  `client` is the engine client's rLLM face (workflows/rllm_compat.py, client.py);
- the metrics: the trajectories' metadata (`is_correct`, `processing_time`, `param_version_start/end`, ...) under
  rLLM's names (workflows/rllm_metrics.py), in RUN_DIR/metrics.jsonl and the `trainer.logger` backends.

Signatures accepted: today's `(config, rollout_fn, val_rollout_fn=None)`; the DAPO example's
`(config, dataset_name=..., rollout_fn=...)`; and the older `(config, train_dataset=None, val_dataset=None,
rollout_fn=...)`, whose data came from `data.train_files` through verl's collate as a batch of one (so it selects
`workflow.rllm_batched`, rLLM's DAPO function of that time indexing `kwargs["raw_prompt"][0]`).
"""

from __future__ import annotations

import inspect
import logging
import sys
import time
from typing import Any

import cloudpickle

from rllm.experimental.fully_async.api.rollout_functions import RolloutFunctions
from rllm.experimental.fully_async.errors import FullyAsyncError, error_lines
from rllm.experimental.fully_async.runtime.run.driver import train
from rllm.experimental.fully_async.runtime.run.run_dir import RunFinished
from rllm.experimental.fully_async.settings.rllm_program import program_config

__all__ = ["AsyncAgentTrainer"]

logger = logging.getLogger(__name__)

_NOT_GIVEN: Any = object()


class AsyncAgentTrainer:
    """rLLM's fully-async trainer entry point (module docstring)."""

    def __init__(
        self,
        config: Any,
        rollout_fn: Any = None,
        val_rollout_fn: Any = None,
        dataset_name: str | None = None,
        *,
        train_dataset: Any = _NOT_GIVEN,
        val_dataset: Any = _NOT_GIVEN,
    ) -> None:
        if rollout_fn is None:
            raise ValueError("Use create_task_runner_with_rollout_fn to pass in a rollout_fn")  # rLLM's message
        for name, fn in (("rollout_fn", rollout_fn), ("val_rollout_fn", val_rollout_fn)):
            if fn is not None and not inspect.iscoroutinefunction(fn):
                raise TypeError(
                    f"{name} must be an async function (defined with 'async def'), but got {type(fn).__name__}. "
                    "Only async functions are supported."
                )
        for name, given in (("train_dataset", train_dataset), ("val_dataset", val_dataset)):
            if given is not _NOT_GIVEN and given is not None:
                raise ValueError(
                    f"AsyncAgentTrainer({name}=...) takes only None (rLLM read data.train_files / data.val_files "
                    "instead); register the rows with rllm.data.DatasetRegistry and pass dataset_name"
                )
        self.config = config
        self.rollout_fn = rollout_fn
        self.val_rollout_fn = val_rollout_fn
        self.dataset_name = dataset_name
        # rLLM's signature with train_dataset / val_dataset: datum = verl's collated batch of one
        self.batched_datum = train_dataset is not _NOT_GIVEN or val_dataset is not _NOT_GIVEN

    def train(self) -> Any:
        """Train to the end (`trainer.total_training_steps`, or `rollout.total_rollout_steps` prompts); returns the
        run's summary. A configuration or data error prints one line and exits with status 2, as the CLI does."""

        if not hasattr(self.config, "async_training"):
            raise RuntimeError("must set async_training config")  # rLLM's check
        started = time.time()
        try:
            cfg = program_config(self.config, dataset_name=self.dataset_name, batched_datum=self.batched_datum)
            # Under @hydra.main the root logger is at INFO; this run's libraries log at run.log_level, as on the CLI.
            logging.getLogger().setLevel(str(cfg.run.log_level))
            functions = RolloutFunctions(
                train=cloudpickle.dumps(self.rollout_fn),
                val=None if self.val_rollout_fn is None else cloudpickle.dumps(self.val_rollout_fn),
            )
            summary = train(cfg, functions)
        except RunFinished as exc:  # the run directory holds a finished run: say so, start nothing
            print(exc)
            return None
        except FullyAsyncError as exc:
            first, *others = error_lines(exc)  # others: further refused keys of the config
            print("\n".join([f"error: {first}", *(f"  {line}" for line in others)]), file=sys.stderr)
            raise SystemExit(exc.exit_code) from exc
        logger.info("total time: %.2f seconds", time.time() - started)
        return summary
