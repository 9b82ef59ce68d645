"""Crash-safe checkpoint store: the trainer, rollout and queue state of one step, written atomically.

On-disk layout (one directory per step under `root`):

    root/
      step_00000012/          a complete checkpoint; the directory name is the commit
        trainer.pt            torch.save of the trainer part (step, version, RNG states, and the policy: a
                              reference to policy_shards/, or a backend's full state dict); loaded with
                              weights_only=True, so the file cannot run code when it is read
        policy_shards/        the FSDP policy as torch.distributed.checkpoint shards, one per trainer rank,
                              written by the ranks themselves (runtime/checkpoints/trainer_state.py)
        rollout.json          the rollout part (iterator position, sample ledger, staleness counters, version, and
                              each generating sample's progress: tokens so far, an agent's episode; or, where JSON
                              cannot hold it, its token count under in_flight_unsaved; executor.py)
        queue.json            the queued VersionedGroups as JSON (dataclasses.asdict), rebuilt into dataclasses
        meta.json             format_version, step, saved_at (wall time), plus the caller's meta (version,
                              config_hash, ...)
        COMPLETE              written last: the manifest {file: {bytes, sha256}} of every file above (shards as
                              `policy_shards/<name>`)
      .tmp-step_00000013-...  a save in progress, or one a crash interrupted (the next save removes it)
      abandoned-step_...      a newer checkpoint of a run that was not resumed from it (see "Steps" below)

Commit protocol of `save` and why it is crash-safe:

1. every part is written into a temporary sibling directory `.tmp-step_N-<pid>-<random>` and each file is
   fsynced; then `COMPLETE` (the manifest) is written and fsynced, then the temporary directory itself;
2. `os.rename(tmp, step_N)`, then the root directory is fsynced so that the rename survives a power loss.

`latest()` only considers directories named `step_N` that hold a `COMPLETE` file. A crash (SIGKILL, OOM,
power loss) before the rename leaves only a `.tmp-` directory, which `latest()` never looks at, so the previous
checkpoint stays the latest. rename() is atomic on a POSIX filesystem, so after it `step_N` exists with all its
files. The fsyncs before the rename are what make that true after a power loss too: without them the rename
could reach the disk before the file contents (ext4 delayed allocation), leaving a committed directory of empty
files. The `COMPLETE` marker is a second, independent guard: a `step_N` directory produced by a non-atomic path
(a `cp -r` or rsync of a checkpoint, a filesystem whose directory rename is copy-then-delete) is not taken for a
complete one, and its manifest lets `load` detect a truncated or corrupted file and name it.

Deleting an old checkpoint (retention) first renames it to `.trash-...` and only then removes it, so a crash in
the middle of the removal never leaves a half-deleted `step_N` that still looks complete. Saving a step that
already exists (a final save landing on a periodic one) sets the old copy aside as `.replaced-step_N-...`
before renaming the new one in (rename cannot replace a non-empty directory); a crash between the two renames
leaves the old copy complete, `latest()` still returns it, and the next save puts it back before it starts.

Steps: `latest()` is the complete checkpoint with the highest step. A run started fresh (resume_mode=disable)
or resumed from an older checkpoint (resume_mode=resume_path) in a root that holds newer checkpoints would
otherwise have `latest()` point, after its next crash, at the abandoned run. So `save(step)` first renames every
complete checkpoint with a higher step to `abandoned-step_N-...` (kept, never deleted, with a warning). This is
verl's behaviour too: its tracker file always names the last checkpoint saved.

A corrupted checkpoint is an error, not a fallback: `load` raises `CheckpointError` naming the bad file, and
`latest()` (which only checks for the marker) does not skip a complete checkpoint whose files are damaged.
Silently resuming from an older step would re-train steps and re-issue samples the operator believes trained;
the message says how to choose (move the damaged directory away, or resume_mode=resume_path).

One writer per root: a save removes every `.tmp-` directory it finds, so two processes must not save into the
same root at once (only the trainer's driver saves).

What goes into the files, and how it is checked and hashed, is `format.py`'s. The trainer part carries the global
RNG state (trainer_state.py's `capture_rng_state` / `restore_rng_state`), and meta the run's `config_hash`.

Reading back (`load_checkpoint`) verifies each file's size and sha256 against the `COMPLETE` manifest before parsing
it, so damage is a `CheckpointError` naming the file. That includes the files it does not parse itself: the policy's
torch.distributed.checkpoint shards (`policy_shards/...`), which the trainer's ranks read after this check. The
trainer part's policy shards, and resuming them at another world size, are `trainer_state.py`'s: it knows the policy
backends, this module knows none.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from rllm.experimental.fully_async.api.trajectory import (
    VersionedGroup,
)
from rllm.experimental.fully_async.errors import FullyAsyncError
from rllm.experimental.fully_async.runtime.checkpoints.format import (
    COMPLETE_MARKER,
    FORMAT_VERSION,
    META_FILE,
    PART_FILES,
    QUEUE_FILE,
    ROLLOUT_FILE,
    TRAINER_FILE,
    check_torch_safe,
    encode_rollout_part,
    file_sha256,
    group_from_json,
    json_bytes,
    write_bytes,
    write_torch,
)

__all__ = [
    "RESUME_MODES",
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "config_hash",
    "find_resume_checkpoint",
    "load_checkpoint",
]

logger = logging.getLogger(__name__)

RESUME_MODES = ("auto", "disable", "resume_path")


_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_REPLACED_DIR = re.compile(r"^\.replaced-step_(\d{8,})-[0-9a-f]+$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"


class CheckpointError(FullyAsyncError, RuntimeError):
    """A checkpoint that cannot be used (missing, incomplete, corrupted, unknown format); the message is one line."""


@dataclass(frozen=True)
class Checkpoint:
    """One loaded checkpoint: the three parts as they were given to `save`, and its meta."""

    path: Path
    step: int
    meta: dict[str, Any]  # format_version, step, saved_at and the caller's keys (version, config_hash, ...)
    trainer: dict[str, Any]  # as given to save; tensors on CPU
    rollout: dict[str, Any]
    queue: list[VersionedGroup]


class CheckpointManager:
    """Saves checkpoints under `root` atomically, finds the newest complete one, loads one, applies retention.

    Guarantees (see the module docstring for why they hold): a crash at any point of `save` leaves the previous
    checkpoint loadable and `latest()` never returns a partial one; retention keeps the newest `keep_last`
    complete checkpoints and never deletes the one just written; a damaged checkpoint raises `CheckpointError`.
    """

    def __init__(self, root: str | Path, keep_last: int = 2) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be an integer >= 1, got {keep_last!r}")
        self.root = Path(root)
        self.keep_last = keep_last  # 2: one spare in case the newest turns out to be damaged

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def complete_checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest step first (a `.replaced-` copy stands in for a step it was set aside from)."""
        found = _scan_complete(self.root)
        return [found[step] for step in sorted(found)]

    def latest(self) -> Path | None:
        """The complete checkpoint with the highest step, or None. Half-written directories are never returned."""
        found = _scan_complete(self.root)
        return found[max(found)] if found else None

    def save(
        self,
        step: int,
        *,
        trainer: dict[str, Any],
        rollout: dict[str, Any],
        queue: list[VersionedGroup],
        meta: dict[str, Any],
    ) -> Path:
        """Write one checkpoint atomically and return its directory `root/step_{step:08d}`.

        Everything is checked before the disk is touched: a trainer value torch.load(weights_only=True) could not
        read back, or a rollout/queue/meta value JSON would not return unchanged (a tuple, a non-string key, an
        object), raises TypeError naming where it is.
        """
        check_torch_safe(trainer, "trainer")
        parts = encode_rollout_part(rollout, queue)
        json_bytes(_meta_doc(step, meta), "meta")
        tmp = self.begin(step)
        try:
            files = {TRAINER_FILE: write_torch(tmp / TRAINER_FILE, trainer)}
            files |= {name: write_bytes(tmp / name, data) for name, data in parts.items()}
            return self.commit(tmp, step, files, meta)
        except BaseException:
            self.abort(tmp)
            raise

    def begin(self, step: int) -> Path:
        """Start saving `step`: clean up after crashed saves and return a fresh temporary directory.

        The parts are written into it by their owners (the trainer's weights by the trainer's process, the
        rollout state by the rollout service: `write_trainer_part` / `write_rollout_part`), then
        `commit` writes the meta and the manifest and renames it into place, or `abort` removes it.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_debris()
        self._set_aside_newer_than(step)
        tmp = self.root / f"{_TMP_PREFIX}step_{step:08d}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, step: int, files: Mapping[str, Any], meta: dict[str, Any]) -> Path:
        """Write meta.json and the COMPLETE manifest (the parts' entries in `files`), then commit `tmp` as step_N.
        On any error `tmp` is removed and the previous checkpoint stays the latest."""
        try:
            missing = [name for name in PART_FILES if name != META_FILE and name not in files]
            if missing:
                raise ValueError(f"checkpoint parts missing before commit: {', '.join(missing)}")
            manifest = dict(files) | {
                META_FILE: write_bytes(tmp / META_FILE, json_bytes(_meta_doc(step, meta), "meta"))
            }
            marker = {"format_version": FORMAT_VERSION, "files": manifest}
            write_bytes(tmp / COMPLETE_MARKER, json.dumps(marker, indent=1).encode())  # last: the marker
            _fsync_dir(tmp)
            final = self._commit(tmp, step)
        except BaseException:
            self.abort(tmp)
            raise
        self._apply_retention(step)
        logger.info("checkpoint saved: %s", final)
        return final

    def abort(self, tmp: Path) -> None:
        """Remove a save in progress (a failed save leaves nothing behind)."""
        shutil.rmtree(tmp, ignore_errors=True)

    def load(self, path: str | Path) -> Checkpoint:
        """Load and verify one checkpoint directory; anything missing or damaged raises CheckpointError."""
        return load_checkpoint(path)

    # ---- commit and housekeeping -----------------------------------------------------------------------------

    def _commit(self, tmp: Path, step: int) -> Path:
        final = self.step_dir(step)
        replaced = None
        if final.exists():
            # rename() cannot replace a non-empty directory; until the new copy is in, the old one stays complete
            # under a name latest() still understands (and the next save restores).
            replaced = self.root / f".replaced-step_{step:08d}-{secrets.token_hex(4)}"
            logger.warning("checkpoint %s exists; replacing it", final)
            os.rename(final, replaced)
        try:
            os.rename(tmp, final)  # the commit point
        except BaseException:
            if replaced is not None:
                os.rename(replaced, final)
            raise
        _fsync_dir(self.root)  # make the rename durable before anything older is deleted
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        return final

    def _remove_debris(self) -> None:
        """Clean up after saves that crashed: temp and trash directories go; a stranded old copy goes back."""
        for entry in _entries(self.root):
            if entry.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                logger.info("removing %s left by an interrupted save", entry)
                shutil.rmtree(entry, ignore_errors=True)
            elif match := _REPLACED_DIR.match(entry.name):
                final = self.step_dir(int(match.group(1)))
                if not final.exists() and (entry / COMPLETE_MARKER).is_file():
                    logger.warning("restoring %s to %s (a save crashed while replacing it)", entry, final)
                    os.rename(entry, final)
                else:
                    shutil.rmtree(entry, ignore_errors=True)
        _fsync_dir(self.root)

    def _set_aside_newer_than(self, step: int) -> None:
        for newer_step, path in _scan_complete(self.root).items():
            if newer_step > step:
                aside = self.root / f"abandoned-{path.name}-{secrets.token_hex(4)}"
                logger.warning(
                    "saving step %d while %s exists: it belongs to a run that was not resumed from it; moved to %s",
                    step,
                    path,
                    aside,
                )
                os.rename(path, aside)

    def _apply_retention(self, saved_step: int) -> None:
        found = _scan_complete(self.root)
        keep = set(sorted(found)[-self.keep_last :]) | {saved_step}
        for step, path in found.items():
            if step not in keep:
                trash = self.root / f"{_TRASH_PREFIX}{path.name}-{secrets.token_hex(4)}"
                try:
                    os.rename(path, trash)  # out of latest()'s sight in one atomic step, then delete at leisure
                except OSError as exc:
                    # the new checkpoint is already committed; failing the save now would only lose the run
                    logger.warning("retention: could not remove %s: %s", path, exc)
                    continue
                shutil.rmtree(trash, ignore_errors=True)
                logger.info("retention: removed %s (keep_last=%d)", path, self.keep_last)


def find_resume_checkpoint(
    root: str | Path, mode: Literal["auto", "disable", "resume_path"], resume_from_path: str | None
) -> Path | None:
    """The checkpoint to resume from, with verl's `trainer.resume_mode` semantics.

    auto: the newest complete checkpoint under `root`, or None (train from scratch); disable: None, whatever is on
    disk; resume_path: `resume_from_path` (relative to the working directory, as in verl), which must be a
    complete checkpoint directory, else CheckpointError. An unknown mode raises ValueError.
    """
    if mode not in RESUME_MODES:
        raise ValueError(f"trainer.resume_mode must be one of {', '.join(RESUME_MODES)}, got {mode!r}")
    if mode == "disable":
        return None
    if mode == "auto":
        found = CheckpointManager(root).latest()
        logger.info("resume_mode=auto: %s", f"resuming from {found}" if found else f"no checkpoint in {root}")
        return found
    if not resume_from_path:
        raise CheckpointError("trainer.resume_mode=resume_path needs trainer.resume_from_path (a step_* directory)")
    path = Path(os.path.abspath(resume_from_path))
    if not path.is_dir():
        raise CheckpointError(f"trainer.resume_from_path {path} does not exist or is not a directory")
    if not (path / COMPLETE_MARKER).is_file():
        raise CheckpointError(
            f"trainer.resume_from_path {path} is not a complete checkpoint (no {COMPLETE_MARKER}); "
            "point it at a step_XXXXXXXX directory"
        )
    return path


# ---- parts -------------------------------------------------------------------------------------------------------


def _meta_doc(step: int, meta: Mapping[str, Any]) -> dict[str, Any]:
    if meta.get("step", step) != step:
        raise ValueError(f"meta['step']={meta['step']!r} disagrees with step={step}")
    clashing = [key for key in ("format_version", "saved_at") if key in meta]
    if clashing:
        raise ValueError(f"meta keys {clashing} are set by the checkpoint store; leave them out")
    return {"format_version": FORMAT_VERSION, "step": step, "saved_at": time.time(), **meta}


# ---- file I/O ----------------------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    """fsync a directory so that the names created or renamed in it are on disk (POSIX; a no-op elsewhere)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _entries(root: Path) -> list[Path]:
    try:
        return [entry for entry in root.iterdir() if entry.is_dir()]
    except FileNotFoundError:
        return []


def _scan_complete(root: Path) -> dict[int, Path]:
    """step -> directory of every complete checkpoint; a `.replaced-` copy counts only where its step_N is missing."""
    found: dict[int, Path] = {}
    stranded: dict[int, Path] = {}
    for entry in _entries(root):
        if not (entry / COMPLETE_MARKER).is_file():
            continue
        if match := _STEP_DIR.match(entry.name):
            found[int(match.group(1))] = entry
        elif match := _REPLACED_DIR.match(entry.name):
            stranded[int(match.group(1))] = entry
    for step, entry in stranded.items():
        found.setdefault(step, entry)
    return found


# ---- meta and RNG ----------------------------------------------------------------------------------------------


def config_hash(config: Mapping[str, Any]) -> str:
    """A short stable hash of a (nested) config mapping for meta['config_hash']; key order does not matter."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---- reading back ----------------------------------------------------------------------------------------------


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Load and verify one checkpoint directory; anything missing or damaged raises CheckpointError."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    marker_path = path / COMPLETE_MARKER
    if not marker_path.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: no {COMPLETE_MARKER} marker (its save did not finish)")
    marker = _parse_json(_read_verified(marker_path, None), marker_path)
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict) or any(not isinstance(files.get(name), dict) for name in PART_FILES):
        raise CheckpointError(f"{marker_path} is not a valid manifest: it must list {', '.join(PART_FILES)}")
    _check_format(marker.get("format_version"), marker_path)

    for name, expected in files.items():
        if name not in PART_FILES:  # the policy's shards: checked here, read by the trainer's ranks
            _verify(_inside(path, name, marker_path), expected if isinstance(expected, dict) else {})
    meta = _parse_json(_read_verified(path / META_FILE, files[META_FILE]), path / META_FILE)
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise CheckpointError(f"{path / META_FILE} has no integer 'step'")
    _check_format(meta.get("format_version"), path / META_FILE)
    rollout = _parse_json(_read_verified(path / ROLLOUT_FILE, files[ROLLOUT_FILE]), path / ROLLOUT_FILE)
    queue_doc = _parse_json(_read_verified(path / QUEUE_FILE, files[QUEUE_FILE]), path / QUEUE_FILE)
    queue = _queue_from_json(queue_doc, path / QUEUE_FILE)

    trainer_path = path / TRAINER_FILE
    _verify(trainer_path, files[TRAINER_FILE])  # streamed: the trainer part can be larger than spare memory
    try:
        trainer = torch.load(trainer_path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{trainer_path} cannot be loaded: {_one_line(exc)}") from exc
    if not isinstance(trainer, dict) or not isinstance(rollout, dict):
        raise CheckpointError(f"checkpoint {path}: the trainer and rollout parts must be dicts")
    return Checkpoint(path=path, step=meta["step"], meta=meta, trainer=trainer, rollout=rollout, queue=queue)


def _queue_from_json(doc: Any, file: Path) -> list[VersionedGroup]:
    if not isinstance(doc, list):
        raise CheckpointError(f"{file} must hold a list of groups")
    try:
        return [group_from_json(item, f"queue[{index}]") for index, item in enumerate(doc)]
    except (TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{file}: {_one_line(exc)}") from exc


def _read_verified(path: Path, expected: Mapping[str, Any] | None) -> bytes:
    """Read a whole (small) file, after checking it against its manifest entry when there is one."""
    if expected is not None:
        _verify(path, expected)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read: {_one_line(exc)}") from exc


def _verify(path: Path, expected: Mapping[str, Any]) -> None:
    """Check a file's size and sha256 against the manifest, so that any damage is reported with the file's name."""
    try:
        size = path.stat().st_size
        if size != expected.get("bytes"):
            raise CheckpointError(f"{path} is damaged: {size} bytes, the manifest says {expected.get('bytes')}")
        digest = file_sha256(path)
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read: {_one_line(exc)}") from exc
    if digest != expected.get("sha256"):
        raise CheckpointError(f"{path} is damaged: its sha256 does not match the manifest")


def _inside(path: Path, name: Any, marker_path: Path) -> Path:
    """A manifest name as a file of the checkpoint; a name that could reach outside it is refused."""
    parts = Path(name).parts if isinstance(name, str) else ()
    if not parts or Path(name).is_absolute() or any(part in ("", ".", "..") for part in parts):
        raise CheckpointError(f"{marker_path} lists {name!r}, which is not a file inside the checkpoint")
    return path.joinpath(*parts)


def _parse_json(data: bytes, path: Path) -> Any:
    try:
        return json.loads(data)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        raise CheckpointError(f"{path} is not valid JSON: {_one_line(exc)}") from exc


def _check_format(version: Any, path: Path) -> None:
    if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise CheckpointError(f"{path} has format_version {version!r}; this code reads 1..{FORMAT_VERSION}")


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}"
