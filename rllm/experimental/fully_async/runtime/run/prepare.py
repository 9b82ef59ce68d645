"""Before any process starts: the task's data and model prepared, the prompt data checked, and Ray started quietly.

`runtime/run/driver.py` calls these from `Run.start()`; they are here so the run's lifecycle reads on its own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from omegaconf import DictConfig

logger = logging.getLogger(__name__)

QUIET_LIBRARIES_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TQDM_DISABLE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@contextmanager
def quiet_hf_progress_bars() -> Iterator[None]:
    """Hide transformers' own progress bars ("Writing model shards", "Loading weights") for the block, then restore.

    They flash by for sub-second saves and loads. The actors hide every tqdm bar through QUIET_LIBRARIES_ENV, but
    tqdm reads TQDM_DISABLE when it is imported, so the driver cannot do the same here. The one bar left is SmolLM2's
    first-run GGUF conversion (`tqdm.auto` inside transformers): 20-50 s of progress worth seeing.
    """
    from transformers.utils import logging as hf_logging

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
    from rllm.experimental.fully_async.settings.loader import verl_base_config
    from rllm.experimental.fully_async.tasks import apply_task

    apply_task(cfg, verl_base_config())


def check_data(cfg: DictConfig) -> int:
    """Read and validate the prompt data before any process starts, so a bad file or row is a one-line error
    (data.DataError) rather than an actor that dies during start-up. Returns the number of training prompts."""
    from transformers import AutoTokenizer

    from rllm.experimental.fully_async.run_spec import data_spec
    from rllm.experimental.fully_async.runtime.trainer.actor import load_prompt_datasets

    tokenizer = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path)
    train, val = load_prompt_datasets(data_spec(cfg), tokenizer)
    from rllm.experimental.fully_async.data.prompts import DataError

    if len(train) == 0:
        raise DataError(f"{cfg.data.train_files}: no prompt left after filtering (data.max_prompt_length?)")
    if val is not None and len(val) == 0:
        raise DataError(
            f"{cfg.data.val_files}: no held-out prompt left after filtering (data.max_prompt_length?); "
            "fix the file or set data.val_files=null"
        )
    from rllm.experimental.fully_async.workflows import check_agent_fits_model

    check_agent_fits_model(cfg)
    return len(train)


def init_ray(num_cpus: int | None = None, num_gpus: int | None = None, address: str | None = None) -> None:
    """Loopback-only Ray with a small footprint (ENVIRONMENT.md); with `address`, join that running cluster
    instead (its operator sized it: no resources are declared)."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Ray turns token authentication on by default (generating ~/.ray/auth_token) and logs a notice saying so at
    # every start. The default stays; the notice goes (setting RAY_AUTH_MODE here would be too late: Ray reads it
    # when it is imported). Its other warnings (auth disabled, bad token) still show.
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
        lambda record: "is enabled for this Ray cluster" not in record.getMessage()
    )
    # gcs_server keeps an event record per actor call (~500 B) up to 100k calls, then remembers each evicted call
    # as "dropped" up to 1M more: a long run grew it by 38 MB in 30 min (tests/bench/README.md, Soak). 2k of each
    # bounds it to a few MB, reached within minutes (10k took 9 and 18 minutes of the default run to fill), and
    # still shows the latest calls in `ray list tasks`. Set before Ray starts, as gcs_server reads them from its
    # environment; an exported value wins.
    os.environ.setdefault("RAY_task_events_max_num_task_in_gcs", "2000")
    os.environ.setdefault("RAY_task_events_max_dropped_task_attempts_tracked_per_job_in_gcs", "2000")
    if ray.is_initialized():
        return
    if address is not None:
        # A cluster's operator sized it: nothing is declared.
        ray.init(address=address, configure_logging=False, log_to_driver=True, runtime_env=_quiet_runtime_env())
        return
    if os.environ.get("RAY_ADDRESS", "local") not in ("", "local"):
        logger.warning(
            "RAY_ADDRESS is set, but this run uses one node (trainer.nnodes=1): it starts its own Ray on this machine"
        )
    # Always a private instance: with address=None Ray would join any Ray already running on this machine (another
    # user's `ray start`, another run's cluster) and then refuse the resources declared here.
    ray.init(
        address="local",
        num_cpus=num_cpus or max(4, os.cpu_count() or 1),
        num_gpus=num_gpus,  # None: Ray detects them; a GPU run declares the plan's trainer GPUs (cluster/one_host.py)
        include_dashboard=False,
        object_store_memory=1_000_000_000,
        configure_logging=False,
        log_to_driver=True,
        runtime_env=_quiet_runtime_env(),
    )


def _quiet_runtime_env() -> dict[str, Any]:
    # Library progress bars and notices in the actors would interleave with the progress line.
    return {"env_vars": QUIET_LIBRARIES_ENV}
