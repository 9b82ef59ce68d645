"""Fully-asynchronous PPO for large language models, built on verl 0.7.1.

Generation never stops: rollout engines keep producing trajectories with the newest weights they have, the
trainer takes one optimizer step per batch from a queue, and weights are pushed back every K steps. See
docs/design.md in the repository for the architecture and its rules, and `python -m rllm.experimental.fully_async
--help` for the command line.

This package cannot share an environment with rLLM itself (the distribution `rllm`): both install the top-level
package `rllm` (rLLM's names at rLLM's paths are this package's public API), so installing one overwrites the
other's files, and rLLM's training extra pins verl 0.8.0 where this package needs verl 0.7.1 (0.8 removed the actor
its patch targets). Importing it where `rllm` is installed refuses in one line; the installers run that import
from the source tree before they install anything (install/install_cpu.sh, install/_lib.sh).
"""

from importlib import metadata as _metadata

__version__ = "0.1.0"


def _refuse_beside_rllm() -> None:
    """ImportError naming the installed rLLM distribution, if there is one (a name lookup: well under 1 ms)."""
    try:
        other = _metadata.distribution("rllm")
    except _metadata.PackageNotFoundError:
        return
    raise ImportError(
        f"rllm-fully-async cannot share an environment with rLLM (distribution 'rllm' {other.version} is installed "
        "here): both install the top-level package 'rllm', so one overwrites the other, and rLLM's training extra "
        "pins verl 0.8.0 where this needs 0.7.1; install rllm-fully-async into a virtual environment of its own "
        "(bash install/install_cpu.sh makes .venv), or `pip uninstall rllm` here"
    )


_refuse_beside_rllm()
