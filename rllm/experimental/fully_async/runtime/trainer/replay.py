"""Replay: re-run a run's training from its batch record and check it against what the run logged and saved.

`replay(run_dir)` builds the trainer the run built (`actor.build_trainer`, from the config the record kept) with no
engines: its rollout source serves the recorded batches in order (`RecordedBatches`), restoring each step's RNG
states, and a weight sync only bumps the version, as the run's did. Each step's update quantities (`COMPARED`: the
losses, clip fractions, KL, grad norm, learning rate, advantages, correction statistics) are compared with the
run's `metrics.jsonl` line for that step, and the weights and optimizer state with every checkpoint the run kept,
bit for bit (`same_bits`: equal bytes, so -0.0 differs from 0.0 and a NaN equals itself).

Where it starts: a fresh start's initial weights (the model folder, whose hashes the record checks), or, when the
record begins at a resume, the checkpoint it resumed from. Where the run resumed (a new segment), the replay does
what the run did: writes its trainer state as a checkpoint (the same torch.distributed.checkpoint shards), builds
the trainer anew from the segment's config (which may change the world size or the LR horizon) and loads it. A
checkpoint that restores anything inexactly shows up as a difference after the resume.

What makes it exact on CPU: the same inputs (the record), the same code path, the same kernels (torch's build and
instruction set: a mismatch is said, not refused) and the same thread count (set from the record); fp32 CPU kernels
are deterministic for a given shape and thread count. A run with N trainer ranks replays with N ranks (gloo sums the
N shards' gradients in a fixed order); the same run at another world size sums them in another order and differs in
the last bits. On GPU see the README ("What is exact").
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from omegaconf import OmegaConf
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from rllm.experimental.fully_async.api.policy_backend import ShardedCheckpoint
from rllm.experimental.fully_async.api.step_messages import Ack, Batch, BatchRequest
from rllm.experimental.fully_async.backends.fsdp import CHECKPOINT_EXTRA
from rllm.experimental.fully_async.errors import EXIT_FAILED, FullyAsyncError
from rllm.experimental.fully_async.run_spec import build_run_spec
from rllm.experimental.fully_async.runtime.checkpoints.format import TRAINER_FILE
from rllm.experimental.fully_async.runtime.checkpoints.store import CheckpointError, CheckpointManager, load_checkpoint
from rllm.experimental.fully_async.runtime.checkpoints.trainer_state import (
    POLICY_SHARDS,
    load_trainer_part,
    write_trainer_part,
)
from rllm.experimental.fully_async.runtime.cluster.ray_session import init_ray
from rllm.experimental.fully_async.runtime.trainer.build import build_trainer
from rllm.experimental.fully_async.runtime.trainer.record import (
    Record,
    RecordedStep,
    RecordError,
    Segment,
    machine_description,
    read_json_lines,
    restore_step_rng,
    weights_fingerprint,
)
from rllm.experimental.fully_async.settings.loader import base_config

logger = logging.getLogger(__name__)

# The update's quantities compared step by step: what the step computed from its batch and weights. Timings,
# throughput and the rollout side's counters are not the trainer's to reproduce.
COMPARED_PREFIXES = ("actor/", "advantages/", "rollout_corr/", "off_policy/", "gigpo/", "critic/vf", "critic/vpred")
COMPARED_KEYS = frozenset(
    {"critic/grad_norm", "critic/lr", "critic/optimizer_step", "reward/mean", "batch/tokens", "trainer/version"}
)


_FIRST = frozenset({"actor/pg_loss", "critic/vf_loss"})  # named first when several quantities of a step differ
_COMPUTE_TIMINGS = ("timing/assemble_s", "timing/advantages_s", "timing/update_s")


def is_compared(key: str) -> bool:
    return key in COMPARED_KEYS or key.startswith(COMPARED_PREFIXES)


class ReplayMismatch(FullyAsyncError, RuntimeError):
    """The replay differs from the run; the message names the first differing step and quantity (exit 1)."""

    exit_code = EXIT_FAILED


@dataclass
class ReplayResult:
    """What a replay found: one verdict line per step range and per checkpoint compared, and its timing."""

    lines: list[str] = field(default_factory=list)
    steps: int = 0
    replay_s: float = 0.0  # the whole replay: steps, resumes and checkpoint comparisons
    step_s: float = 0.0  # the replayed trainer steps alone
    run_compute_s: float = 0.0  # the run's own time in those steps' assemble + advantages + update


class RecordedBatches:
    """The trainer's rollout source in a replay (api.step_messages.RolloutSource): the next recorded step's batch,
    after checking the trainer asks at the version the run did and restoring the RNG states the step drew from."""

    def __init__(self) -> None:
        self.backend: Any = None
        self.pending: RecordedStep | None = None

    def take_batch(self, request: BatchRequest) -> Batch:
        recorded, self.pending = self.pending, None
        if recorded is None:
            return Batch([], "closed", 0, 0.0)
        if request.version != recorded.version:
            raise ReplayMismatch(
                f"step {recorded.step}: trainer/version differs: the run trained it at policy version "
                f"{recorded.version}, the replay is at {request.version}"
            )
        restore_step_rng(recorded, self.backend)
        return Batch(recorded.groups, "ok", 0, 0.0)

    def acknowledge(self, ack: Ack) -> None:
        pass

    def begin_weight_sync(self) -> float:
        return 0.0

    def end_weight_sync(self) -> None:
        pass


def replay(run_dir: str | Path, *, say: Callable[[str], None] = print) -> ReplayResult:
    """Re-run `run_dir`'s recorded training and compare it (module docstring). Prints each verdict through `say`.
    Raises RecordError for a missing or damaged record (exit 2) and ReplayMismatch at the first difference."""
    run_dir = Path(run_dir)
    record = Record(run_dir)
    logged = logged_step_metrics(run_dir / "metrics.jsonl")
    checkpoints = _checkpoints_by_step(run_dir)
    here = machine_description()
    if record.machine and record.machine != here:
        say(f"note: recorded on {_machine(record.machine)}, replaying on {_machine(here)}: kernels may round "
            "differently, so bit-for-bit equality is not expected")  # fmt: skip
    first = record.load(record.steps[0])
    source = RecordedBatches()
    trainer = _start(record, record.segments[first.segment], source, record.steps[0] - 1)
    verdicts = _Verdicts(say, record.steps[0], record.segments[first.segment])
    started = time.monotonic()
    try:
        for step in record.steps:
            recorded = first if step == record.steps[0] else record.load(step)
            if recorded.segment != verdicts.segment.index:  # the run resumed here: so does the replay
                verdicts.close(step - 1)
                trainer = _resume(trainer, record, record.segments[recorded.segment], step - 1, source)
                verdicts.open(step, record.segments[recorded.segment])
            metrics = _replay_step(trainer, source, recorded, say, verdicts.result)
            if step in logged:
                try:
                    verdicts.compared += compare_step(step, logged[step], metrics)
                except ReplayMismatch:
                    verdicts.close(step - 1)  # what was equal before it
                    raise
                verdicts.result.run_compute_s += sum(float(logged[step].get(k, 0.0)) for k in _COMPUTE_TIMINGS)
            else:
                verdicts.unlogged.append(step)
            if step in checkpoints:  # a checkpoint closes a step range: the steps' verdict, then the weights'
                verdicts.close(step)
                verdicts.line(compare_checkpoint(trainer, checkpoints[step], step))
                verdicts.open(step + 1, verdicts.segment)
        verdicts.close(record.steps[-1])
    finally:
        _shutdown(trainer)
    verdicts.result.replay_s = time.monotonic() - started
    last_checkpoint = max((s for s in checkpoints if s <= record.steps[-1]), default=None)
    if last_checkpoint is None:
        verdicts.line(f"weights: no checkpoint of this run at or before step {record.steps[-1]} to compare with")
    elif last_checkpoint != record.steps[-1]:
        verdicts.line(
            f"weights: the run's last checkpoint is at step {last_checkpoint}; the record goes on to step "
            f"{record.steps[-1]} (the run stopped before saving it)"
        )
    return verdicts.result


def _replay_step(
    trainer: Any, source: RecordedBatches, recorded: RecordedStep, say: Callable[[str], None], result: ReplayResult
) -> dict[str, float]:
    """One recorded step through the trainer, on the thread count it ran with."""
    if recorded.device != str(getattr(trainer.backend, "device", "cpu")):
        say(f"note: step {recorded.step} ran on {recorded.device}; this replay runs on {trainer.backend.device}")
    if torch.get_num_threads() != recorded.threads:
        torch.set_num_threads(recorded.threads)  # a CPU matmul's summation order depends on it
    source.pending = recorded
    started = time.monotonic()
    metrics = trainer.train_step()
    result.step_s += time.monotonic() - started
    if metrics is None:
        raise ReplayMismatch(f"step {recorded.step}: the replayed trainer took no step")
    result.steps += 1
    return metrics


class _Verdicts:
    """The verdict lines as the replay goes: a step range (within one segment, up to a checkpoint) gets one line."""

    def __init__(self, say: Callable[[str], None], first_step: int, segment: Segment) -> None:
        self.say = say
        self.result = ReplayResult()
        self.open(first_step, segment)

    def open(self, first_step: int, segment: Segment) -> None:
        self.first, self.segment, self.compared, self.unlogged = first_step, segment, 0, []

    def close(self, last_step: int) -> None:
        """The line of the range that ends at `last_step` (nothing when it is empty)."""
        if last_step < self.first:
            return
        how = (
            "fresh start"
            if self.segment.start_step == 0
            else f"resumed from {Path(str(self.segment.resumed_from)).name}"
        )
        logged = last_step - self.first + 1 - len(self.unlogged)
        text = (
            f"steps {self.first}-{last_step} (segment {self.segment.index}, {how}): {self.compared} quantities over "
            f"{logged} logged steps equal bit for bit (losses, clip fraction, KL, grad norm, learning rate, advantages)"
        )
        if self.unlogged:
            text += f"; step(s) {', '.join(map(str, self.unlogged))} recorded but never logged (the run stopped first)"
        self.line(text)
        self.first = last_step + 1

    def line(self, text: str) -> None:
        self.result.lines.append(text)
        self.say(text)


# ---- the run's side: logged metrics and checkpoints ---------------------------------------------------------------


def logged_step_metrics(path: Path) -> dict[int, dict[str, Any]]:
    """Each training step's metrics line from metrics.jsonl; where a resume trained a step again, its last line."""
    if not path.is_file():
        raise RecordError(f"{path} is missing: replay compares against the run's logged metrics")
    out: dict[int, dict[str, Any]] = {}
    for line in read_json_lines(path):
        if "trainer/step" in line:  # a training step's line (validation lines carry val/* only)
            out[int(line["step"])] = line
    return out


def _checkpoints_by_step(run_dir: Path) -> dict[int, Path]:

    root = run_dir / "checkpoints"
    if not root.is_dir():
        return {}
    return {int(p.name.rsplit("_", 1)[-1]): p for p in CheckpointManager(root).complete_checkpoints()}


def compare_step(step: int, logged: Mapping[str, Any], replayed: Mapping[str, float]) -> int:
    """Raise ReplayMismatch at the first compared quantity that differs; returns how many were compared."""
    keys = sorted((k for k in logged if is_compared(k)), key=lambda k: (k not in _FIRST, k))
    for key in keys:
        if key not in replayed:
            raise ReplayMismatch(f"step {step}: {key} was logged by the run but the replay did not compute it")
        before, after = float(logged[key]), float(replayed[key])
        if not (before == after or (math.isnan(before) and math.isnan(after))):
            raise ReplayMismatch(
                f"step {step}: {key} differs: logged {before!r}, replayed {after!r} "
                f"(relative difference {_relative(before, after):.2e}; every earlier step and quantity was equal)"
            )
    return len(keys)


def compare_checkpoint(trainer: Any, checkpoint: Path, step: int) -> str:
    """The replayed trainer's policy (weights, optimizer moments, LR schedule) against a checkpoint's, bit for bit;
    a verdict line, or ReplayMismatch naming the first tensor that differs."""

    backend = trainer.backend
    if not isinstance(backend, ShardedCheckpoint):
        return f"weights at step {step}: not compared (the {type(backend).__name__} writes no sharded checkpoint)"
    with tempfile.TemporaryDirectory(prefix="rllm_replay_") as tmp:
        mine = Path(tmp) / POLICY_SHARDS
        backend.save_checkpoint(mine)
        ours = _policy_state(mine)
        theirs = _policy_state(checkpoint / POLICY_SHARDS)
    tensors = 0
    for name in sorted(set(ours) | set(theirs)):
        if name not in ours or name not in theirs:
            where = "the checkpoint" if name not in theirs else "the replay"
            raise ReplayMismatch(f"weights at step {step}: {name} is missing from {where}")
        a, b = theirs[name], ours[name]
        if isinstance(a, torch.Tensor):
            tensors += 1
            if not same_bits(a, b):
                raise ReplayMismatch(f"weights at step {step}: {name} differs ({_tensor_difference(a, b)})")
        elif a != b:
            raise ReplayMismatch(f"weights at step {step}: {name} differs: checkpoint {a!r}, replay {b!r}")
    return (
        f"weights at step {step} ({checkpoint.name}): model, optimizer moments and LR schedule equal bit for bit "
        f"({tensors} tensors)"
    )


def _policy_state(shards: Path) -> dict[str, Any]:
    """A policy_shards/ folder (torch.distributed.checkpoint, any world size) as one flat dict of full tensors,
    with its extra.pt (LR schedule, optimizer step count) under `extra.`."""

    with tempfile.TemporaryDirectory(prefix="rllm_replay_full_") as tmp:
        full = Path(tmp) / "full.pt"
        dcp_to_torch_save(shards, full)
        state = torch.load(full, map_location="cpu", weights_only=True)
    flat = dict(_flatten(state, ""))
    extra = torch.load(shards / CHECKPOINT_EXTRA, map_location="cpu", weights_only=True)
    flat.update(_flatten(extra, "extra."))
    return flat


def _flatten(tree: Any, prefix: str) -> Iterable[tuple[str, Any]]:
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _flatten(value, f"{prefix}{key}.")
    elif isinstance(tree, (list, tuple)) and not all(isinstance(x, (int, float, str, bool, type(None))) for x in tree):
        for index, value in enumerate(tree):
            yield from _flatten(value, f"{prefix}{index}.")
    else:
        yield prefix[:-1], tree


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (bitwise: -0.0 != 0.0, a NaN equals the same NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _tensor_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"checkpoint {a.dtype} {tuple(a.shape)}, replay {b.dtype} {tuple(b.shape)}"
    if not a.is_floating_point():
        return f"{int((a != b).sum())} of {a.numel()} values"
    diff = (a.double() - b.double()).abs()
    return f"{int((diff > 0).sum())} of {a.numel()} values, largest difference {float(diff.max()):.3e}"


def _relative(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


# ---- building and resuming the trainer ----------------------------------------------------------------------------


def _start(record: Record, segment: Segment, source: RecordedBatches, start_step: int) -> Any:
    """The trainer at the record's first step: a fresh start's initial weights, or the checkpoint it resumed from."""
    if segment.start_step != start_step:
        raise RecordError(
            f"the record's first step is {start_step + 1} but its segment {segment.index} starts after step "
            f"{segment.start_step}: the record is inconsistent"
        )
    if start_step == 0:
        _check_initial_weights(segment)
        return _build(segment, source)

    if segment.resumed_from is None or not Path(segment.resumed_from).is_dir():
        raise RecordError(
            f"the record starts at step {start_step + 1}, after a resume from {segment.resumed_from}, which is gone: "
            "replay needs the checkpoint a record starts from (record from the first step to keep it self-contained)"
        )
    try:
        checkpoint = load_checkpoint(segment.resumed_from)
    except CheckpointError as exc:
        raise RecordError(f"the record starts from {segment.resumed_from}, which cannot be loaded: {exc}") from exc
    trainer = _build(segment, source)
    _load(trainer, checkpoint.path, checkpoint.trainer)
    return trainer


def _resume(trainer: Any, record: Record, segment: Segment, step: int, source: RecordedBatches) -> Any:
    """What the run did at a resume after `step`: its trainer state written as a checkpoint, the trainer built anew
    from the segment's config, the state loaded, the weights 'synced' without a version bump."""

    if segment.start_step != step:
        raise RecordError(
            f"step {step + 1} was trained by segment {segment.index}, which resumed after step {segment.start_step}, "
            f"not {step}: the record is inconsistent"
        )
    with tempfile.TemporaryDirectory(prefix="rllm_replay_resume_") as tmp:
        write_trainer_part(Path(tmp), trainer)
        state = torch.load(Path(tmp) / TRAINER_FILE, map_location="cpu", weights_only=True)
        _shutdown(trainer)
        trainer = _build(segment, source)
        _load(trainer, Path(tmp), state)
    return trainer


def _load(trainer: Any, directory: Path, state: Mapping[str, Any]) -> None:

    load_trainer_part(directory, state, trainer)
    trainer.sync_weights(bump=False)  # as the driver after a resume: no engines here, the version stays


def _build(segment: Segment, source: RecordedBatches) -> Any:

    # Onto today's defaults: a key this build added since the run was recorded takes its default, as it would have
    megatron = segment.config.get("actor_rollout_ref", {}).get("actor", {}).get("strategy") == "megatron"
    spec = build_run_spec(OmegaConf.merge(base_config(megatron), OmegaConf.create(segment.config)))
    if spec.trainer.world_size > 1:
        _ensure_ray()
    trainer = build_trainer(spec, source)
    source.backend = trainer.backend
    return trainer


def _ensure_ray() -> None:

    if not ray.is_initialized():
        init_ray()


def _shutdown(trainer: Any) -> None:
    if hasattr(trainer.backend, "shutdown"):
        trainer.backend.shutdown()


def _check_initial_weights(segment: Segment) -> None:
    """The model folder a fresh start trained from must hold the same files now."""
    recorded = segment.initial_weights or {}
    path = recorded.get("path")
    if not path or not Path(path).is_dir():
        raise RecordError(f"the run started from the weights in {path}, which are gone: replay needs them")
    now = weights_fingerprint(path)["files"]
    for name, digest in sorted(recorded.get("files", {}).items()):
        if now.get(name) != digest:
            state = "is missing" if name not in now else f"has changed (sha256 {now[name][:12]}, was {digest[:12]})"
            raise RecordError(f"{Path(path) / name} {state}: replay needs the weights the run started from")


def _machine(desc: Mapping[str, Any]) -> str:
    return f"torch {desc.get('torch')} {desc.get('machine')}/{desc.get('cpu_capability')}"
