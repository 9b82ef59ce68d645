"""The batch record (`run.record_batches: true`): what a run's training depends on, kept so `replay` can re-run it.

A step of the trainer is a function of its inputs: the weights, optimizer moments and LR-schedule position it starts
from, the batch it takes (token ids, the engines' rollout log-probs, the version of every token, rewards), the
trainer's policy version (the correction and the staleness statistics read it), the RNG states (dropout, if a model
has any) and torch's thread count (a CPU matmul sums in another order with another number of threads). The record
keeps the batches and what goes with them, step by step; the weights it starts from are the model folder's (hashed
here) or a checkpoint's, and every later state follows from the steps.

Layout, under `RUN_DIR/record/`:

    segments.jsonl        one line per start of the trainer (segment): {segment, start_step, resumed_from,
                          started_at, config (the resolved config it ran with), initial_weights: {path,
                          files: {name: sha256}} for a fresh start}
    steps/00000001.pt     one file per optimizer step, torch.save of plain types (read back with weights_only):
                          {format, segment, step, version, threads, device, rng: {process, ranks},
                          groups: [the VersionedGroups as the trainer received them, as JSON objects
                          (checkpoints/store.py group_to_json: every float kept exactly)]}

A resume cuts the record at the checkpoint it resumed from (steps after it are trained again, as the ledger's
journal is cut), so the step files always hold one history, each tagged with the segment that trained it.

Why not verl's `trainer.rollout_data_dir` dumps: they are for reading (log-probs rounded to 5 digits, text), carry no
RNG state, version or thread count, and a run may keep them without wanting replay. The record is written by the
trainer itself when it has taken a step's batch, before the update (no extra process; no Ray call at world size 1,
one call per rank for its RNG at world size > 1), under a temporary name renamed into place so a reader never sees
half a file. It is not fsynced: losing the last step files in a power cut costs the replay of those steps, never
the run. Its size: see tests/bench/README.md.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rllm.experimental.fully_async.api.trajectory import VersionedGroup
from rllm.experimental.fully_async.errors import EXIT_BAD_INPUT, FullyAsyncError
from rllm.experimental.fully_async.runtime.checkpoints.format import file_sha256, group_from_json, group_to_json
from rllm.experimental.fully_async.runtime.checkpoints.trainer_state import capture_rng_state, restore_rng_state

logger = logging.getLogger(__name__)

RECORD_DIR = "record"
SEGMENTS_FILE = "segments.jsonl"
STEPS_DIR = "steps"
RECORD_FORMAT = 1
_STEP_FILE = re.compile(r"^(\d{8})\.pt$")
# What a model folder's weights are: the files hashed for a fresh start's initial weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".json")


class RecordError(FullyAsyncError, ValueError):
    """The record is missing, damaged or inconsistent; the message names the file and what to do (exit 2)."""

    exit_code = EXIT_BAD_INPUT


@dataclass(frozen=True)
class RecordTarget:
    """Where a trainer writes its steps: the record folder and its segment (crosses to the trainer actor)."""

    directory: str
    segment: int


@dataclass(frozen=True)
class Segment:
    """One start of the trainer: fresh (start_step 0) or resumed from the checkpoint at `start_step`."""

    index: int
    start_step: int
    resumed_from: str | None
    started_at: float
    config: dict[str, Any]
    initial_weights: dict[str, Any] | None


@dataclass(frozen=True)
class RecordedStep:
    """One optimizer step's inputs, as the trainer took them."""

    step: int
    segment: int
    version: int
    threads: int
    device: str
    rng: dict[str, Any]
    groups: list[VersionedGroup]


def step_file(directory: Path, step: int) -> Path:
    return Path(directory) / STEPS_DIR / f"{step:08d}.pt"


def recorded_steps(directory: Path) -> list[int]:
    """The steps that have a file in `directory`/steps, in order."""
    steps_dir = Path(directory) / STEPS_DIR
    if not steps_dir.is_dir():
        return []
    found = (_STEP_FILE.match(p.name) for p in steps_dir.iterdir())
    return sorted(int(m.group(1)) for m in found if m)


# ---- writing: the driver opens a segment, the trainer writes its steps --------------------------------------------


def open_record(
    run_dir: str | Path,
    config: Mapping[str, Any],
    *,
    start_step: int,
    resumed_from: str | Path | None,
    model_path: str,
) -> RecordTarget:
    """Start a segment of `run_dir`'s record: cut the steps after `start_step` (they are trained again), append the
    segment's line (with the initial weights' hashes on a fresh start), and say where the trainer writes."""
    directory = Path(run_dir) / RECORD_DIR
    (directory / STEPS_DIR).mkdir(parents=True, exist_ok=True)
    cut = [step for step in recorded_steps(directory) if step > start_step]
    for step in cut:
        step_file(directory, step).unlink()
    if cut:
        logger.info("record: steps %d..%d cut (the run resumes from step %d)", cut[0], cut[-1], start_step)
    index = len(read_segment_lines(directory))
    line = {
        "segment": index,
        "start_step": int(start_step),
        "resumed_from": None if resumed_from is None else str(resumed_from),
        "started_at": time.time(),
        "config": dict(config),
        "initial_weights": weights_fingerprint(model_path) if start_step == 0 else None,
        "machine": machine_description(),
    }
    with open(directory / SEGMENTS_FILE, "a", encoding="utf-8") as file:
        file.write(json.dumps(line, default=str) + "\n")
    return RecordTarget(str(directory), index)


def weights_fingerprint(model_path: str | Path) -> dict[str, Any]:
    """{path, files: {name: sha256}} of a model folder's weight and config files: what a fresh start trained from."""
    folder = Path(model_path)
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    return {"path": str(folder), "files": {p.name: file_sha256(p) for p in files}}


def machine_description() -> dict[str, Any]:
    """What a CPU result depends on beyond the inputs: torch's build and the instruction set its kernels use."""
    return {
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


class BatchRecorder:
    """The trainer's side: `write(step, version, groups)` as soon as it has taken a step's batch, before anything of
    the step draws from an RNG or could change the groups (so a step that crashes is in the record too)."""

    def __init__(self, target: RecordTarget, backend: Any) -> None:
        self.directory = Path(target.directory)
        self.segment = target.segment
        self.backend = backend

    def rng_state(self) -> dict[str, Any]:
        """The RNG states the step draws from: this process's (the policy at world size 1, the critic) and each
        trainer rank's (`DistributedPolicyBackend.rng_states`: one call to every rank)."""
        ranks = self.backend.rng_states() if hasattr(self.backend, "rng_states") else None
        return {"process": capture_rng_state(), "ranks": ranks}

    def write(self, step: int, version: int, groups: list[VersionedGroup]) -> Path:
        """One step's file (module docstring), written under a temporary name and renamed into place."""
        doc = {
            "format": RECORD_FORMAT,
            "segment": self.segment,
            "step": int(step),
            "version": int(version),
            "threads": torch.get_num_threads(),
            "device": str(getattr(self.backend, "device", "cpu")),
            "rng": self.rng_state(),
            "groups": [group_to_json(group) for group in groups],
        }
        path = step_file(self.directory, step)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save(doc, tmp)
        os.replace(tmp, path)
        return path


# ---- reading ---------------------------------------------------------------------------------------------------------


def read_segment_lines(directory: Path) -> list[dict[str, Any]]:
    path = Path(directory) / SEGMENTS_FILE
    if not path.is_file():
        return []
    return read_json_lines(path, damaged="the record is damaged")


def read_json_lines(path: Path, damaged: str = "") -> list[dict[str, Any]]:
    """The JSON documents of a JSONL file (blank lines skipped); a line that is not JSON is a RecordError naming
    file:line (and `damaged`, what that means)."""
    lines = []
    for number, text in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not text.strip():
            continue
        try:
            lines.append(json.loads(text))
        except ValueError as exc:
            what = f": {damaged}" if damaged else ""
            raise RecordError(f"{path}:{number} is not JSON ({exc}){what}") from exc
    return lines


class Record:
    """A run's record, checked on opening: its segments, and one step file for every step from the first to the
    last (the steps a replay re-runs). A step's file is read only when `load(step)` asks for it."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.directory = self.run_dir / RECORD_DIR
        if not self.directory.is_dir():
            raise RecordError(
                f"{self.run_dir} has no batch record ({RECORD_DIR}/): train with run.record_batches=true to keep one"
            )
        self.segments = {}
        for doc in read_segment_lines(self.directory):
            try:
                segment = Segment(
                    index=int(doc["segment"]),
                    start_step=int(doc["start_step"]),
                    resumed_from=doc["resumed_from"],
                    started_at=float(doc["started_at"]),
                    config=dict(doc["config"]),
                    initial_weights=doc.get("initial_weights"),
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise RecordError(
                    f"{self.directory / SEGMENTS_FILE}: a line lacks {exc}: the record is damaged"
                ) from exc
            self.segments[segment.index] = segment
        if not self.segments:
            raise RecordError(f"{self.directory / SEGMENTS_FILE} is missing or empty: the record is damaged")
        self.machine = read_segment_lines(self.directory)[-1].get("machine") or {}
        self.steps = recorded_steps(self.directory)
        if not self.steps:
            raise RecordError(f"{self.directory / STEPS_DIR} holds no step: the run recorded nothing to replay")
        expected = list(range(self.steps[0], self.steps[-1] + 1))
        if self.steps != expected:
            missing = sorted(set(expected) - set(self.steps))
            raise RecordError(
                f"{self.directory / STEPS_DIR} has no file for step {missing[0]} (it holds {self.steps[0]}.."
                f"{self.steps[-1]}): the record is incomplete and cannot be replayed past step {missing[0] - 1}"
            )

    def load(self, step: int) -> RecordedStep:
        """Read one step's file; a damaged or inconsistent one raises RecordError naming it."""
        path = step_file(self.directory, step)
        try:
            doc = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises several kinds for a truncated or foreign file
            detail = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
            raise RecordError(
                f"{path} is damaged ({detail}): the record cannot be replayed past step {step - 1}"
            ) from exc
        where = f"{path}"
        if not isinstance(doc, dict) or doc.get("format") != RECORD_FORMAT:
            got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise RecordError(f"{where} is not a step of record format {RECORD_FORMAT} (format {got!r})")
        if doc.get("step") != step:
            raise RecordError(f"{where} holds step {doc.get('step')!r}, not {step}: the record's files were mixed")
        if doc.get("segment") not in self.segments:
            raise RecordError(f"{where} names segment {doc.get('segment')!r}, which {SEGMENTS_FILE} does not list")
        try:
            groups = [group_from_json(item, f"{where} groups[{i}]") for i, item in enumerate(doc["groups"])]
            return RecordedStep(
                step=step,
                segment=int(doc["segment"]),
                version=int(doc["version"]),
                threads=int(doc["threads"]),
                device=str(doc["device"]),
                rng=dict(doc["rng"]),
                groups=groups,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"{where} is malformed ({exc}): the record is damaged") from exc


def restore_step_rng(recorded: RecordedStep, backend: Any) -> None:
    """Put back the RNG states the step drew from (this process's, and each rank's when the run had ranks)."""
    restore_rng_state(recorded.rng["process"])
    ranks = recorded.rng.get("ranks")
    if ranks is not None:
        if not hasattr(backend, "set_rng_states") or len(ranks) != backend.world_size:
            raise RecordError(
                f"step {recorded.step} was trained by {len(ranks)} trainer ranks; this replay has "
                f"{getattr(backend, 'world_size', 1)}"
            )
        backend.set_rng_states(ranks)
