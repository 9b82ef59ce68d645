"""The sample ledger's journal as a file: append-only JSON lines in the run dir, its audit, and a ledger that writes it.

The state machine and the line format are pure (`core/ledger.py`, `core/ledger_format.py`); this module is the
file under them. Each record is one write flushed to the OS, so a killed process loses none of it; only `sync()`
(called by the ledger's `state_dict()` for a checkpoint) pays for an fsync. A new journal is started at its first
record, overwriting a file an earlier run left in the same place; a restored one is cut back to the checkpoint's
size (what was written after it belongs to samples that will be issued or end again).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from rllm.experimental.fully_async.core.ledger import SampleLedger
from rllm.experimental.fully_async.core.ledger_format import SampleState, replay_journal


class JournalFile:
    """A `LedgerJournal` (core/ledger.py) on a local file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        # Absolute, so a checkpoint can tell whether the journal it recorded is the one this ledger writes.
        self.path = Path(path).absolute()
        self._file: IO[bytes] | None = None
        self._started = False  # False: the first open truncates (a new ledger has no history yet)

    def _handle(self) -> IO[bytes]:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("ab" if self._started else "wb")
            self._started = True
        return self._file

    def append(self, line: bytes) -> None:
        handle = self._handle()
        handle.write(line)
        handle.flush()  # to the OS: a SIGKILLed process keeps the record (sync() fsyncs to the disk)

    def sync(self) -> int:
        handle = self._handle()
        handle.flush()
        os.fsync(handle.fileno())
        return os.fstat(handle.fileno()).st_size

    def restore(self, recorded_path: Any, recorded_bytes: Any) -> bool:
        self.close()
        size = self.path.stat().st_size if self.path.exists() else 0
        if recorded_path != str(self.path) or not isinstance(recorded_bytes, int) or size < recorded_bytes:
            return False
        with self.path.open("r+b") as f:
            f.truncate(recorded_bytes)  # later records: samples that will be issued or end again
        self._started = True
        return True

    def rewrite(self, lines: Iterable[bytes]) -> None:
        self.close()
        self._started = False
        handle = self._handle()
        for line in lines:
            handle.write(line)
        handle.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def journaled_ledger(path: str | os.PathLike[str]) -> SampleLedger:
    """A SampleLedger whose history goes to the journal file at `path`."""
    return SampleLedger(JournalFile(path))


def read_journal(
    path: str | os.PathLike[str], resumed: dict[str, str] | None = None
) -> dict[str, tuple[SampleState, str | None]]:
    """Replay and audit a journal file (`core.ledger_format.replay_journal`): each sample's final (state, reason);
    `resumed`, when given, gets each resumed sample's outcome (continued, or why it restarted from the prompt)."""
    with open(path, "rb") as f:
        return replay_journal(f, str(path), resumed)
