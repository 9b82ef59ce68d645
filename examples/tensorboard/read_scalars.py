"""Print the scalars a run logged to TensorBoard: check a `trainer.logger=[console,tensorboard]` run without a UI.

verl's Tracking writes event files to $TENSORBOARD_DIR (default: ./tensorboard_log/<project_name>/<experiment_name>).

    python examples/tensorboard/read_scalars.py tensorboard_log/rllm_fully_async/tiny_cpu [--tag reward/mean]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from every event file under `log_dir`."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(log_dir.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})  # 0: keep every point
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return scalars


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log_dir", type=Path)
    parser.add_argument("--tag", default=None, help="print only this scalar (e.g. reward/mean)")
    args = parser.parse_args(argv)
    scalars = read_scalars(args.log_dir)
    if not scalars:
        print(f"no scalars under {args.log_dir}", file=sys.stderr)
        return 1
    for tag, points in sorted(scalars.items()):
        if args.tag is None or tag == args.tag:
            print(f"{tag}: " + ", ".join(f"{step}={value:.4g}" for step, value in points))
    return 0


if __name__ == "__main__":
    sys.exit(main())
