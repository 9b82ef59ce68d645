"""Trajectory dumps: each step's trajectories as JSONL, one file per step (`{step}.jsonl`), as verl's keys say.

`trainer.rollout_data_dir` (null: off): the trainer writes every trajectory it trained at a step, with the
advantages it computed (`write_training_batch`, called from runtime/trainer/fully_async_trainer.py).
`trainer.validation_data_dir` (null: off): the rollout service writes every held-out episode of a validation
(`write_episodes`), without advantages.

One line per trajectory:

    {"step", "uid", "prompt_uid", "status", "failure_reason", "reward", "end_reason", "step_rewards",
     "state_hashes", "metadata": {...}, "sequences": [
        {"step_index", "prompt_ids", "response_ids", "loss_mask", "versions", "logprobs", "advantages",
         "prompt_text", "response_tokens", "lora_paths" (LoRA runs only)}, ...]}

`advantages` is the per-token advantage over the response (null in validation dumps or for rows not trained);
`response_tokens` is each response token as text and `prompt_text` the decoded prompt (present when a tokenizer
was given), so `python -m rllm.experimental.fully_async view DIR` needs no model to show a dump.
verl's own dump (`ray_trainer._dump_generations`) writes decoded input/output/score per row; this one keeps the
token ids, masks and versions that the fully-async trainer trains on.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rllm.experimental.fully_async.api.trajectory import TrajectoryStatus, VersionedGroup, VersionedTrajectory

logger = logging.getLogger(__name__)


def trajectory_record(
    trajectory: VersionedTrajectory,
    step: int,
    tokenizer: Any = None,
    advantages: dict[int, list[float]] | None = None,
) -> dict[str, Any]:
    """One JSON-ready line (module docstring). `advantages`: step_index -> per-token advantages of that row."""
    sequences = []
    for index, seq in enumerate(trajectory.sequences):
        row: dict[str, Any] = {
            "step_index": index,
            "prompt_ids": list(seq.prompt_ids),
            "response_ids": list(seq.response_ids),
            "loss_mask": list(seq.loss_mask or []),
            "versions": list(seq.response_versions),
            "logprobs": [round(float(x), 5) for x in seq.response_logprobs],
            "advantages": None if advantages is None else advantages.get(index),
            "finish_reason": seq.finish_reason,
            "num_resumes": seq.num_resumes,
        }
        if seq.lora_paths is not None:
            row["lora_paths"] = list(seq.lora_paths)  # LoRA: the adapter each call named (policy-v<version>)
        if tokenizer is not None:
            row["prompt_text"] = tokenizer.decode(list(seq.prompt_ids), skip_special_tokens=False)
            row["response_tokens"] = [tokenizer.decode([t], skip_special_tokens=False) for t in seq.response_ids]
        sequences.append(row)
    metadata = {
        k: v for k, v in trajectory.metadata.items() if k in ("end_reason", "num_turns", "steps", "rllm", "rllm_rows")
    }
    return {
        "step": step,
        "uid": trajectory.uid,
        "prompt_uid": trajectory.prompt_uid,
        "status": trajectory.status.value,
        "failure_reason": trajectory.failure_reason,
        "reward": float(trajectory.reward),
        "end_reason": trajectory.metadata.get("end_reason"),
        "step_rewards": trajectory.step_rewards,
        "state_hashes": trajectory.step_state_hashes,
        "metadata": metadata,
        "sequences": sequences,
    }


def write_jsonl(directory: Path, step: int, records: Iterable[dict[str, Any]]) -> Path:
    """Write `{directory}/{step}.jsonl` atomically (a reader never sees half a file); returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{step}.jsonl"
    tmp = directory / f".{step}.jsonl.{os.getpid()}.tmp"
    with tmp.open("w") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
    os.replace(tmp, path)
    return path


def write_episodes(directory: Path, step: int, episodes: Iterable[VersionedTrajectory], tokenizer: Any = None) -> Path:
    """Validation dump: every episode, without advantages."""
    return write_jsonl(directory, step, (trajectory_record(t, step, tokenizer) for t in episodes))


def write_training_batch(
    directory: Path, step: int, groups: list[VersionedGroup], data: Any, tokenizer: Any = None
) -> Path:
    """Training dump: the batch's trajectories with the advantages of their rows (`data` is the DataProto the
    trainer assembled with core/batch.py, advantages written). Rows are matched by (traj_uid, step_index)."""
    per_row: dict[tuple[str, int], list[float]] = {}
    if "advantages" in data.batch.keys():  # noqa: SIM118 (a TensorDict)
        advantages = data.batch["advantages"]
        mask = data.batch["response_mask"]
        traj_uids = data.non_tensor_batch["traj_uid"]
        step_indices = data.non_tensor_batch["step_index"]
        lengths = data.batch["attention_mask"][:, -mask.shape[1] :].sum(-1).tolist()
        for row, (uid, index) in enumerate(zip(traj_uids, step_indices, strict=True)):
            per_row[(str(uid), int(index))] = [round(float(a), 5) for a in advantages[row, : int(lengths[row])]]
    records = []
    for group in groups:
        for trajectory in group.trajectories:
            trained = trajectory.status == TrajectoryStatus.OK
            rows = {i: per_row.get((trajectory.uid, i)) for i in range(len(trajectory.sequences))} if trained else None
            records.append(trajectory_record(trajectory, step, tokenizer, rows))
    return write_jsonl(directory, step, records)


def read_dump(directory: Path, step: int | None = None) -> tuple[int, list[dict[str, Any]]]:
    """The records of `{step}.jsonl` (the latest step when None) and the step read."""
    steps = sorted(int(p.stem) for p in directory.glob("*.jsonl") if p.stem.isdigit())
    if not steps:
        raise FileNotFoundError(f"no {{step}}.jsonl dump in {directory}")
    chosen = steps[-1] if step is None else step
    path = directory / f"{chosen}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no dump for step {chosen} in {directory} (steps: {steps[0]}..{steps[-1]})")
    return chosen, [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
