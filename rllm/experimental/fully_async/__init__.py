"""Fully-asynchronous PPO for large language models, built on verl 0.7.1.

Generation never stops: rollout engines keep producing trajectories with the newest weights they have, the
trainer takes one optimizer step per batch from a queue, and weights are pushed back every K steps. See
docs/design.md in the repository for the architecture and its rules, and `python -m rllm.experimental.fully_async
--help` for the command line.
"""

__version__ = "0.1.0"
