"""`replay`: re-run a run's training from its batch record and say, step range by step range, whether it is exact.

`python -m rllm.experimental.fully_async replay RUN_DIR`

The run must have kept a record (`run.record_batches=true`: runtime/trainer/record.py); the replay itself is
runtime/trainer/replay.py. One line per step range (a fresh start or a resume) and per checkpoint compared, then the
time it took beside the run's own. Exit codes: 0 every compared quantity and checkpoint equal bit for bit, 1 a
difference (the line names the first differing step and quantity), 2 no record, or a damaged one (the line names
the file).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

PROG = "python -m rllm.experimental.fully_async replay"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory trained with run.record_batches=true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("RLLM_LOG_LEVEL", "WARNING"))
    # lazy: transformers and the trainer (~5 s) load after argparse, so a wrong argument is answered at once
    from transformers.utils import logging as hf_logging

    # lazy: the trainer's replay imports Ray, torch and verl (~5 s), like transformers above
    from rllm.experimental.fully_async.runtime.trainer.replay import ReplayMismatch, replay

    hf_logging.disable_progress_bar()  # a "Loading weights" bar per trainer built would split the verdict lines
    try:
        result = replay(args.run_dir, say=lambda line: print(line, flush=True))
    except ReplayMismatch as exc:
        print(f"MISMATCH {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    print(
        f"replay: {result.steps} steps bit for bit; their steps took {result.step_s:.1f} s (the run's own "
        f"assembling, advantages and updates: {result.run_compute_s:.1f} s), {result.replay_s:.1f} s with the "
        "resumes and checkpoint comparisons",
        flush=True,
    )
    return 0
