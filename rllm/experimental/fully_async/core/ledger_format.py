"""The ledger's vocabulary and record format: sample states, the journal's JSON lines, and the audit that replays them.

Pure (no files): `core/ledger.py` writes these lines through a `LedgerJournal`;
`runtime/rollout/ledger_journal.py` reads them back from the file and hands them to `replay_journal`,
which checks every sample ended exactly once.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any

from rllm.experimental.fully_async.api.progress import RESUME_OUTCOMES
from rllm.experimental.fully_async.errors import FullyAsyncError

logger = logging.getLogger(__name__)

ISSUED = "issued"  # the journal's event for an issue; ends use the SampleState values
# Not a state: how a sample in flight at a resumed checkpoint went on (reason: api/progress.py's RESUME_OUTCOMES,
# "continued" from its saved tokens or restarted from the prompt and why), written before the sample's end.
RESUMED = "resumed"
REWRITE_CHUNK = 1000  # uids per line when a journal is rebuilt from a checkpoint (keeps lines short)
JournalRecord = tuple[str, str | None, list[str]]  # (event, reason, uids)


class SampleState(str, Enum):
    IN_FLIGHT = "in_flight"
    TRAINED = "trained"
    FILTERED = "filtered"
    DROPPED_STALE = "dropped_stale"
    FAILED = "failed"


ENDED_STATES = (SampleState.TRAINED, SampleState.FILTERED, SampleState.DROPPED_STALE, SampleState.FAILED)
_NEEDS_REASON = (SampleState.FILTERED, SampleState.FAILED)


class LedgerError(FullyAsyncError, ValueError):
    """An impossible transition (a sample issued twice, ended twice, or ended without being issued), or a
    checkpointed state or journal that is malformed or inconsistent."""


def replay_journal(
    lines: Iterable[bytes], name: str, resumed: dict[str, str] | None = None
) -> dict[str, tuple[SampleState, str | None]]:
    """Replay a ledger journal's lines (`name` is where they come from, for errors): each sample's final
    (state, reason), in issue order. `resumed`, when given, is filled with each resumed sample's outcome.

    The audit: raises `LedgerError` (naming the line) if a sample was issued twice (including after it ended),
    ended twice, or ended without being issued, if a "resumed" record names a sample not in flight or one already
    resumed, or if a line is malformed. A last line without its newline (the process died while writing it) is
    ignored with a warning.
    """
    history: dict[str, tuple[SampleState, str | None]] = {}
    outcomes: dict[str, str] = {} if resumed is None else resumed
    for number, raw in enumerate(lines, start=1):
        where = f"{name}:{number}"
        if not raw.endswith(b"\n"):
            logger.warning("%s: ignoring a torn last line (the writer died mid-record)", where)
            break
        event, reason, uids = _parse_line(raw, where)
        if event == RESUMED:
            for uid in uids:
                entry = history.get(uid)
                if entry is None or entry[0] is not SampleState.IN_FLIGHT:
                    raise LedgerError(f"{where}: {uid!r} resumed while not in flight")
                if uid in outcomes:
                    raise LedgerError(f"{where}: {uid!r} resumed twice ({outcomes[uid]}, then {reason})")
                outcomes[uid] = str(reason)
            continue
        if event == ISSUED:
            for uid in uids:
                if uid in history:
                    raise LedgerError(f"{where}: {uid!r} issued twice (it was {_describe(*history[uid])})")
                history[uid] = (SampleState.IN_FLIGHT, None)
            continue
        state = SampleState(event)
        for uid in uids:
            entry = history.get(uid)
            if entry is None:
                raise LedgerError(f"{where}: {uid!r} ended {state.value} without being issued")
            if entry[0] is not SampleState.IN_FLIGHT:
                raise LedgerError(f"{where}: {uid!r} ended twice ({_describe(*entry)}, then {state.value})")
            history[uid] = (state, reason)
    return history


def history_counts(history: Mapping[str, tuple[SampleState, str | None]]) -> dict[str, int]:
    """`SampleLedger.counts()` computed from a replayed journal (the two agree when the journal is complete)."""
    ended: Counter[str] = Counter()
    in_flight = 0
    for state, reason in history.values():
        if state is SampleState.IN_FLIGHT:
            in_flight += 1
            continue
        ended[state.value] += 1
        if reason is not None:
            ended[f"{state.value}/{reason}"] += 1
    return _format_counts(len(history), in_flight, ended)


def _format_counts(issued: int, in_flight: int, ended: Mapping[str, int]) -> dict[str, int]:
    result = {"issued": issued, SampleState.IN_FLIGHT.value: in_flight}
    result |= {state.value: ended.get(state.value, 0) for state in ENDED_STATES}
    result |= {key: ended[key] for key in sorted(ended) if "/" in key}
    return result


def journal_line(event: str, reason: str | None, uids: list[str]) -> bytes:
    """One journal record: `{"event": ..., ["reason": ...,] "uids": [...]}` as a JSON line."""
    record: dict[str, Any] = {"event": event}
    if reason is not None:
        record["reason"] = reason
    record["uids"] = uids
    return (json.dumps(record, separators=(",", ":")) + "\n").encode()


def _parse_line(raw: bytes, where: str) -> tuple[str, str | None, list[str]]:
    try:
        record = json.loads(raw)
    except ValueError as exc:
        raise LedgerError(f"{where}: not a JSON line ({exc})") from None
    if not isinstance(record, dict):
        raise LedgerError(f"{where}: not a JSON object")
    event, reason, uids = record.get("event"), record.get("reason"), record.get("uids")
    if event not in (ISSUED, RESUMED) and event not in {s.value for s in ENDED_STATES}:
        raise LedgerError(f"{where}: unknown event {event!r}")
    if not isinstance(uids, list) or not all(isinstance(uid, str) for uid in uids):
        raise LedgerError(f"{where}: 'uids' must be a list of strings")
    if event == RESUMED and reason not in RESUME_OUTCOMES:
        raise LedgerError(f"{where}: resumed with outcome {reason!r}, not one of {', '.join(RESUME_OUTCOMES)}")
    needs_reason = event == RESUMED or event in {s.value for s in _NEEDS_REASON}
    if needs_reason != (reason is not None) or (needs_reason and not _is_reason(reason)):
        raise LedgerError(f"{where}: event {event!r} with reason {reason!r}")
    if len(set(uids)) != len(uids):
        raise LedgerError(f"{where}: a uid appears twice in one record")
    return event, reason, uids


def _chunked_lines(records: Iterable[JournalRecord]) -> list[bytes]:
    return [
        journal_line(event, reason, uids[start : start + REWRITE_CHUNK])
        for event, reason, uids in records
        for start in range(0, len(uids), REWRITE_CHUNK)
    ]


def _is_reason(reason: Any) -> bool:
    return isinstance(reason, str) and bool(reason) and "/" not in reason


def _describe(state: SampleState, reason: str | None) -> str:
    return state.value if reason is None else f"{state.value}({reason})"
