"""Ray's session inside a run: started quietly on loopback or joined on a cluster (`init_ray`), with a start-up that no
interrupt cuts in half and a stop that leaves no Ray process (`ray_lifetime`).

Two facts about Ray 2.60 shape it (tests/e2e/test_startup_stop.py provokes both):

- **An interrupt inside `ray.init` can crash the driver at exit.** Ray's `ray.init` installs a SIGTERM handler
  that calls `sys.exit` wherever the main thread is. A SIGTERM that lands inside `CoreWorker.__cinit__` (the C++
  core worker already runs its threads, `ray.init` has not yet kept the handle) leaves a core worker that
  `ray.shutdown()` cannot see; at exit its C++ destructor frees it while its io thread still records metrics,
  and the driver dies with SIGSEGV (core dump: `CoreWorkerProcess::HandleAtExit` in the main thread,
  `TaskManager::RecordMetrics` jumping into freed memory in the io thread). So `ray_lifetime` holds SIGINT and
  SIGTERM while Ray starts (a few seconds) and delivers them when `ray.init` returns, with Ray kept from
  installing its own SIGTERM handler meanwhile; the run then stops through `ray.shutdown()` like any other.
- **Some of Ray's processes outlive `ray.shutdown()`.** The raylet always starts DashboardAgent and
  RuntimeEnvAgent (its command line requires both, `include_dashboard=False` or not); they and gcs_server catch
  SIGTERM and can stay up, and a raylet killed as it starts leaves them with no parent. So every process
  started for this Ray carries a marker in its environment (RAY_PROCESS_MARKER_ENV=<uuid>, set only while
  `ray.init` runs: the daemons inherit it, and the agents and workers inherit it from the raylet, as does
  anything they start); after `ray.shutdown()` whichever still carries it is SIGKILLed after a grace period.
  The marker, not ancestry or names, says which processes are this run's: orphans are found too, and another
  run's Ray on the same machine (or the engines, started before Ray) is never touched.

It also keeps Ray's C++ core from replacing the driver's signal handlers (`keep_python_signal_handlers`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import ray
from ray._private import ray_constants
from ray._private import utils as ray_utils

from rllm.experimental.fully_async.engines.launcher import interrupts_deferred

logger = logging.getLogger(__name__)

RAY_EXIT_GRACE_S = 5.0  # after ray.shutdown, how long Ray's own processes get to exit before SIGKILL
RAY_PROCESS_MARKER_ENV = "RLLM_RAY_PROCESS_MARKER"


@contextlib.contextmanager
def ray_lifetime(init: Callable[[], None]) -> Iterator[None]:
    """Run `init()` (which starts Ray) with interrupts held, then the block; on any exit, shut down the Ray that
    `init` started and stop every process it started (and whatever they started), SIGKILL after RAY_EXIT_GRACE_S.

    A SIGINT or SIGTERM during `init` is delivered when it returns (as KeyboardInterrupt with the driver's
    handlers), so it is raised here with Ray fully started, and the stop below runs on a whole session.
    The stop also runs with interrupts held, so a second Ctrl-C cannot cut it short and leave orphans.
    """

    marker = uuid.uuid4().hex
    ours = not ray.is_initialized()  # a Ray this process already had is not this block's to shut down
    try:
        keep_python_signal_handlers()
        with interrupts_deferred(), _ray_leaves_sigterm_alone(), _environment(RAY_PROCESS_MARKER_ENV, marker):
            init()
        yield
    finally:
        with interrupts_deferred():
            if ours:
                _shutdown_ray()
            stop_marked_processes(marker, RAY_EXIT_GRACE_S)


def keep_python_signal_handlers() -> None:
    """Stop Ray's C++ core from replacing this process's SIGTERM handler when `ray.init` connects it.

    Ray installs absl's failure signal handler in every core worker, the driver included: after that a SIGTERM
    prints a C++ stack and aborts the driver (exit -6) instead of raising KeyboardInterrupt, so no `finally` runs.
    Ray reads `ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER` (from the environment, at import) when it
    connects: set it for this process and, through the environment, for Ray's workers, which then stop on
    SIGTERM like any process. Python's faulthandler still prints a crash's stack.
    """

    os.environ["RAY_DISABLE_FAILURE_SIGNAL_HANDLER"] = "1"
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True


def marked_processes(marker: str) -> list[psutil.Process]:
    """Every process (but this one) whose environment carries RAY_PROCESS_MARKER_ENV=`marker`.

    Zombies read as an empty environment (they are dead already) and other users' processes cannot be read:
    neither is listed.
    """
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error, OSError):
            if proc.environ().get(RAY_PROCESS_MARKER_ENV) == marker:
                found.append(proc)
    return found


def stop_marked_processes(marker: str, grace_s: float) -> list[int]:
    """Wait up to `grace_s` for the processes carrying `marker` to exit, SIGKILL the rest (and any found later:
    a dying raylet may have been starting a worker), reap them; returns the pids killed."""
    killed: list[int] = []
    alive = _wait_gone(marked_processes(marker), grace_s)
    for _ in range(3):  # a process started as its parent was killed shows up on the next look
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                logger.warning("Ray left pid %d (%s) running after shutdown; killing it", proc.pid, _name(proc))
                proc.kill()
                killed.append(proc.pid)
        still = _wait_gone(alive, grace_s)
        for proc in still:
            logger.error("pid %d (%s) survived SIGKILL for %.0fs", proc.pid, _name(proc), grace_s)
        alive = [p for p in marked_processes(marker) if p not in still]
        if not alive:
            break
    return killed


def _wait_gone(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Those of `processes` still running after up to `timeout_s` (our children are reaped; a zombie whose parent
    has not reaped it yet is dead, not running)."""
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return [p for p in alive if _status(p) not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD, None)]


def _status(proc: psutil.Process) -> str | None:
    try:
        return proc.status()
    except psutil.Error:
        return None


@contextlib.contextmanager
def _ray_leaves_sigterm_alone() -> Iterator[None]:
    """Keep `ray.init` from installing its SIGTERM handler (`sys.exit(15)`, from whatever line the main thread
    is on: the interrupt `ray_lifetime` holds until Ray has started). Ray 2.60 installs it through this one
    module function, from `ray.init` and `Node`; nothing else of Ray's changes."""

    original = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = original


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """`name=value` in this process's environment for the block (for the processes started in it), then back."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _shutdown_ray() -> None:

    try:
        ray.shutdown()
    except Exception:  # a half-started session can fail to shut down; its processes are killed next
        logger.warning("ray.shutdown failed; killing Ray's processes", exc_info=True)


def _name(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:120] or proc.name()
    except psutil.Error:
        return "?"


QUIET_LIBRARIES_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TQDM_DISABLE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def init_ray(num_cpus: int | None = None, num_gpus: int | None = None, address: str | None = None) -> None:
    """Loopback-only Ray with a small footprint (ENVIRONMENT.md); with `address`, join that running cluster
    instead (its operator sized it: no resources are declared)."""

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
