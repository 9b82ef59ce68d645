"""Turn your own prompts and answers into verl-format parquet files that the trainer reads.

Input: a JSONL file, one problem per line: {"prompt": "...", "answer": "..."} (extra keys go to `extra_info`).
Output: OUT_DIR/train.parquet and OUT_DIR/val.parquet, rows in verl's RL dataset format:

    prompt        [{"role": "user", "content": <prompt>}]   rendered with the model's chat template
    data_source   --data-source (passed to the reward function as its first argument)
    ability       --ability (free text)
    reward_model  {"style": "rule", "ground_truth": <answer>}  (the reward function's `ground_truth`)
    extra_info    {"index": i, "split": "train" | "val", ...}   (the reward function's `extra_info`)

Usage (then train with examples/own_data/config.yaml, see README "Bringing your own"):

    python examples/own_data/make_parquet.py problems.jsonl data/my_task --val-fraction 0.1
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import pandas as pd


def read_problems(path: Path) -> list[dict[str, Any]]:
    problems = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or "prompt" not in row or "answer" not in row:
                raise ValueError(f"{path}:{number}: each line needs 'prompt' and 'answer', got {line.strip()[:80]}")
            problems.append(row)
    return problems


def to_verl_rows(problems: list[dict[str, Any]], split: str, data_source: str, ability: str) -> list[dict]:
    rows = []
    for index, problem in enumerate(problems):
        extra = {k: v for k, v in problem.items() if k not in ("prompt", "answer")}
        rows.append(
            {
                "prompt": [{"role": "user", "content": str(problem["prompt"])}],
                "data_source": data_source,
                "ability": ability,
                "reward_model": {"style": "rule", "ground_truth": str(problem["answer"])},
                "extra_info": {"index": index, "split": split, **extra},
            }
        )
    return rows


def write_parquets(
    problems: list[dict[str, Any]], out_dir: Path, val_fraction: float, data_source: str, ability: str, seed: int
) -> tuple[Path, Path]:
    """Shuffle (fixed seed), split, write train.parquet and val.parquet; returns their paths."""
    shuffled = list(problems)
    random.Random(seed).shuffle(shuffled)
    num_val = max(1, round(len(shuffled) * val_fraction))
    if num_val >= len(shuffled):
        raise ValueError(f"{len(shuffled)} problems leave nothing to train on with --val-fraction {val_fraction}")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, part in (("train", shuffled[num_val:]), ("val", shuffled[:num_val])):
        path = out_dir / f"{split}.parquet"
        pd.DataFrame(to_verl_rows(part, split, data_source, ability)).to_parquet(path, index=False)
        paths.append(path)
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("problems", type=Path, help="JSONL: one {'prompt': ..., 'answer': ...} per line")
    parser.add_argument("out_dir", type=Path, help="where train.parquet and val.parquet go")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="share held out for validation")
    parser.add_argument("--data-source", default="my_task", help="data_source column (the reward sees it)")
    parser.add_argument("--ability", default="custom", help="ability column (free text)")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed for the split")
    args = parser.parse_args(argv)
    train, val = write_parquets(
        read_problems(args.problems), args.out_dir, args.val_fraction, args.data_source, args.ability, args.seed
    )
    print(f"{train}\n{val}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
