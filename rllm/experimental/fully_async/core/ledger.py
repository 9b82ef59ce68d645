"""The sample ledger: every prompt sample issued ends in exactly one state, so nothing is lost silently.

docs/design.md#rule-nothing-lost-silently. A sample (one prompt drawn from the PromptIterator, identified by its
`prompt_uid`) is *issued* when the executor takes it, and then *ends* exactly once:

    trained          its group went into an optimizer step
    filtered(reason) its group was removed on purpose (e.g. all rewards equal, prompt too long)
    dropped_stale    its group was older than max_staleness at training time
    failed(reason)   the rollout or the reward failed

or it is still *in flight* (issued, not ended). The counts always add up:
in_flight + trained + filtered + dropped_stale + failed == issued.

What is kept where, and why. A run issues samples without end (the 30-minute CPU soak issued 740k), so memory
holds only what a long run needs to go on: the in-flight uids in issue order (bounded by the staleness budget),
the number issued, and one counter per ended state and per `state/reason`. The per-sample history, the proof that
every sample ended exactly once, goes to an optional append-only *journal* (JSON lines, one line per call, e.g.
`{"event":"failed","reason":"reward_error","uids":["e0/3/1"]}`), which `replay_journal` replays and audits. After a
resume, a sample that was in flight at the checkpoint also gets one `resumed` line before it ends, saying whether it
continued from its saved tokens or started again from the prompt (`mark_resumed`; api/progress.py), and the
ledger counts them by outcome (`resumed/<outcome>` in `counts()`, kept in its checkpoint so the tally covers every
crash of the run): what went on from saved work and what was generated again.
The state machine lives here and the line format in `core/ledger_format.py` (both pure); the file that holds the
lines is a `LedgerJournal` given by the runtime (`runtime/rollout/ledger_journal.py`: `JournalFile`, `read_journal`,
`journaled_ledger`).

Checks. Ending a sample that is not in flight (never issued, or already ended) and issuing one that is in flight
raise `LedgerError`: each is a bookkeeping bug upstream. Issuing a uid that has already *ended* cannot be seen in
memory any more (ended uids are forgotten); `read_journal` reports it as issued twice. Every call is
all-or-nothing: it checks all its uids before writing or changing anything.

Checkpoints. `state_dict()` is small (in-flight uids, counters, the journal's path and byte size) and fsyncs the
journal first, so the size it records is on disk. `load_state_dict()` truncates the journal to that size: what was
written after the checkpoint belongs to samples that are in flight again after the resume (or not yet issued) and
that will be issued or end again. After a restore, `in_flight_uids()` are the samples to run again (their
rollouts died with the process), in the order they were first issued.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from rllm.experimental.fully_async.api.progress import RESUME_OUTCOMES
from rllm.experimental.fully_async.core.ledger_format import (
    _NEEDS_REASON,
    ENDED_STATES,
    ISSUED,
    RESUMED,
    JournalRecord,
    LedgerError,
    SampleState,
    _chunked_lines,
    _format_counts,
    _is_reason,
    journal_line,
)

logger = logging.getLogger(__name__)

STATE_DICT_VERSION = 2


class LedgerJournal(Protocol):
    """Where the ledger's history goes: an append-only sequence of `journal_line`s (a file in the runtime)."""

    path: Any  # what the checkpoint records to recognise its journal (a file path), or None

    def append(self, line: bytes) -> None:
        """Add one record; it must survive the process being killed right after (flushed to the OS)."""

    def sync(self) -> int:
        """Make every record durable and return the journal's size in bytes (what a checkpoint records)."""

    def restore(self, recorded_path: Any, recorded_bytes: Any) -> bool:
        """Cut the journal back to a checkpoint's size; False when it is not that checkpoint's journal."""

    def rewrite(self, lines: Iterable[bytes]) -> None:
        """Replace the whole journal with `lines`."""

    def close(self) -> None: ...


class SampleLedger:
    """In-flight uids (in issue order) and counters in memory; the full history in an optional journal.

    `journal=None` keeps no history (pure tests): the counts stay exact, per-sample end states are not kept.
    With a journal, every call's record is appended as one line before the state changes; a new ledger's journal
    starts empty, `load_state_dict` instead keeps the checkpoint's part and appends after it.
    """

    def __init__(self, journal: LedgerJournal | None = None) -> None:
        self.journal = journal
        self._in_flight: dict[str, None] = {}  # a dict keeps insertion (= issue) order; resume relies on it
        self._issued = 0
        self._ended: Counter[str] = Counter()  # keys: each ended state's value, and "<state>/<reason>"
        self._resumed: Counter[str] = Counter()  # samples resumed from a checkpoint, by outcome (api/progress.py)

    @property
    def journal_path(self) -> Any:
        return self.journal.path if self.journal is not None else None

    # ---- transitions ------------------------------------------------------------------------------------------

    def issue(self, uids: Iterable[str]) -> None:
        """Record samples as in flight. A uid in flight raises; a uid that already ended is caught by the audit."""
        batch = _unique(uids, "issue")
        known = [uid for uid in batch if uid in self._in_flight]
        if known:
            raise LedgerError(f"cannot issue {known[0]!r}: it is already in flight ({len(known)} such)")
        self._record(ISSUED, None, batch)
        self._in_flight.update(dict.fromkeys(batch))
        self._issued += len(batch)

    def mark_resumed(self, uids: Iterable[str], outcome: str) -> None:
        """Journal how samples in flight at a resumed checkpoint went on (`api.progress.RESUME_OUTCOMES`: continued
        from their saved tokens, or restarted from the prompt and why). Not a state: they stay in flight."""
        if outcome not in RESUME_OUTCOMES:
            raise LedgerError(f"resumed needs one of {', '.join(RESUME_OUTCOMES)}, got {outcome!r}")
        batch = _unique(uids, "mark resumed")
        missing = [uid for uid in batch if uid not in self._in_flight]
        if missing:
            raise LedgerError(f"cannot mark {missing[0]!r} resumed: it is not in flight ({len(missing)} such)")
        self._record(RESUMED, outcome, batch)
        self._resumed[outcome] += len(batch)

    def mark_trained(self, uids: Iterable[str]) -> None:
        self._end(uids, SampleState.TRAINED, None)

    def mark_filtered(self, uids: Iterable[str], reason: str) -> None:
        self._end(uids, SampleState.FILTERED, reason)

    def mark_dropped_stale(self, uids: Iterable[str]) -> None:
        self._end(uids, SampleState.DROPPED_STALE, None)

    def mark_failed(self, uids: Iterable[str], reason: str) -> None:
        self._end(uids, SampleState.FAILED, reason)

    def _end(self, uids: Iterable[str], state: SampleState, reason: str | None) -> None:
        if state in _NEEDS_REASON and not _is_reason(reason):
            # The reason becomes a metric name ("filtered/<reason>"): it must be a non-empty word without '/'.
            raise LedgerError(f"{state.value} needs a non-empty reason without '/', got {reason!r}")
        batch = _unique(uids, f"mark {state.value}")
        missing = [uid for uid in batch if uid not in self._in_flight]
        if missing:
            raise LedgerError(
                f"cannot mark {missing[0]!r} {state.value}: it is not in flight (never issued, or already ended)"
                f" ({len(missing)} such)"
            )
        self._record(state.value, reason, batch)
        for uid in batch:
            del self._in_flight[uid]
        self._ended[state.value] += len(batch)
        if reason is not None:
            self._ended[f"{state.value}/{reason}"] += len(batch)

    # ---- queries ----------------------------------------------------------------------------------------------

    def __contains__(self, uid: object) -> bool:
        """Whether `uid` is in flight (ended samples are not kept in memory)."""
        return uid in self._in_flight

    def __len__(self) -> int:
        """The number of samples in flight: all the ledger holds per sample in memory."""
        return len(self._in_flight)

    def in_flight_uids(self) -> list[str]:
        """Issued samples that have not ended, in issue order (what a resumed run must issue again)."""
        return list(self._in_flight)

    def counts(self) -> dict[str, int]:
        """issued, in_flight, each ended state, and `filtered/<reason>`, `failed/<reason>` for every reason seen.

        in_flight + trained + filtered + dropped_stale + failed == issued; the per-reason counts of a state add up
        to that state's count. Then `resumed/<outcome>` for every resume outcome seen: samples in flight at a
        checkpoint the run resumed from, `resumed/continued` from their saved tokens, the others generated again
        (not states: such a sample is also counted in the state it is in).
        """
        resumed = {f"{RESUMED}/{outcome}": n for outcome, n in sorted(self._resumed.items())}
        return _format_counts(self._issued, len(self._in_flight), self._ended) | resumed

    # ---- checkpoint -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable and small: in-flight uids in issue order, the counters, and where the journal stands.

        The journal is flushed and fsynced first, so the `journal_bytes` recorded here are on disk.
        """
        return {
            "version": STATE_DICT_VERSION,
            "in_flight": list(self._in_flight),
            "issued": self._issued,
            "ended": dict(sorted(self._ended.items())),
            "resumed": dict(sorted(self._resumed.items())),
            "journal_path": str(self.journal_path) if self.journal_path is not None else None,
            "journal_bytes": self.journal.sync() if self.journal is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the ledger with a checkpointed one (version 2, or version 1 from before the journal).

        A malformed or inconsistent state raises `LedgerError` and changes nothing. The journal is then cut back
        to the checkpoint's size; if it is not the checkpoint's journal (another path, or shorter than recorded),
        a warning says so and it restarts with the in-flight samples' issues, so later records still audit.
        """
        version = state.get("version")
        if version == STATE_DICT_VERSION:
            in_flight, issued, ended = _parse_v2(state)
            resumed = _parse_resumed(state.get("resumed"))
            history: list[JournalRecord] | None = None
        elif version == 1:
            in_flight, issued, ended, history = _parse_v1(state)
            resumed = Counter()
        else:
            raise LedgerError(f"ledger state version {version!r} is not {STATE_DICT_VERSION} (or 1)")
        if self.journal is not None:
            if history is not None:
                # A version-1 state lists every sample's end: the journal is rebuilt from it, the audit covers all.
                self.journal.rewrite(_chunked_lines(history))
            elif not self.journal.restore(state.get("journal_path"), state.get("journal_bytes")):
                logger.warning(
                    "ledger journal %s is not the checkpoint's (%s, %s bytes): restarting it from the checkpoint; "
                    "the samples that ended before it are only counted, not listed",
                    self.journal.path,
                    state.get("journal_path"),
                    state.get("journal_bytes"),
                )
                self.journal.rewrite(_chunked_lines([(ISSUED, None, in_flight)]))
        self._in_flight = dict.fromkeys(in_flight)
        self._issued = issued
        self._ended = ended
        self._resumed = resumed

    def close(self) -> None:
        """Flush and close the journal (later records reopen it and append)."""
        if self.journal is not None:
            self.journal.close()

    def _record(self, event: str, reason: str | None, uids: list[str]) -> None:
        if self.journal is not None and uids:
            self.journal.append(journal_line(event, reason, uids))


# ---- helpers ----------------------------------------------------------------------------------------------------


def _parse_v2(state: Mapping[str, Any]) -> tuple[list[str], int, Counter[str]]:
    in_flight = _uid_list(state.get("in_flight"), "in_flight")
    issued = state.get("issued")
    if not _is_count(issued):
        raise LedgerError(f"ledger state's 'issued' must be a non-negative integer, got {issued!r}")
    raw_ended = state.get("ended")
    if not isinstance(raw_ended, Mapping):
        raise LedgerError("ledger state's 'ended' must be a mapping of counters")
    ended: Counter[str] = Counter()
    for key, n in raw_ended.items():
        if not (isinstance(key, str) and _is_ended_key(key) and _is_count(n)):
            raise LedgerError(f"ledger state's 'ended' has an invalid entry {key!r}: {n!r}")
        ended[key] = n
    for state_name in (s.value for s in _NEEDS_REASON):
        per_reason = sum(n for key, n in ended.items() if key.startswith(f"{state_name}/"))
        if per_reason != ended[state_name]:
            raise LedgerError(f"ledger state's {state_name} reasons add up to {per_reason}, not {ended[state_name]}")
    total = len(in_flight) + sum(ended[s.value] for s in ENDED_STATES)
    if total != issued:
        raise LedgerError(f"ledger state does not add up: in_flight + ended = {total}, issued = {issued}")
    journal_bytes = state.get("journal_bytes")
    if journal_bytes is not None and not _is_count(journal_bytes):
        raise LedgerError(f"ledger state's 'journal_bytes' must be a non-negative integer, got {journal_bytes!r}")
    return in_flight, issued, ended


def _parse_resumed(raw: Any) -> Counter[str]:
    """The resume tally of a version-2 state (absent from checkpoints taken before token-level resume)."""
    if raw is None:
        return Counter()
    if not isinstance(raw, Mapping):
        raise LedgerError("ledger state's 'resumed' must be a mapping of outcomes to counts")
    for outcome, n in raw.items():
        if outcome not in RESUME_OUTCOMES or not _is_count(n):
            raise LedgerError(f"ledger state's 'resumed' has an invalid entry {outcome!r}: {n!r}")
    return Counter(dict(raw))


def _parse_v1(
    state: Mapping[str, Any],
) -> tuple[list[str], int, Counter[str], list[JournalRecord]]:
    """A version-1 state (every uid by state, and `issue_order`) as in-flight uids, counters and a history."""
    assigned: dict[str, tuple[SampleState, str | None]] = {}

    def put(uids: Any, entry: tuple[SampleState, str | None], field: str) -> None:
        for uid in _uid_list(uids, field):
            if uid in assigned:
                raise LedgerError(f"ledger state lists {uid!r} twice")
            assigned[uid] = entry

    put(state.get("in_flight", []), (SampleState.IN_FLIGHT, None), "in_flight")
    for simple in (SampleState.TRAINED, SampleState.DROPPED_STALE):
        put(state.get(simple.value, []), (simple, None), simple.value)
    for with_reason in _NEEDS_REASON:
        groups = state.get(with_reason.value, {})
        if not isinstance(groups, Mapping):
            raise LedgerError(f"ledger state's {with_reason.value!r} must map reasons to uid lists")
        for reason, uids in groups.items():
            if not _is_reason(reason):
                raise LedgerError(f"ledger state's {with_reason.value} reason {reason!r} is invalid")
            put(uids, (with_reason, reason), f"{with_reason.value}/{reason}")
    order = _uid_list(state.get("issue_order"), "issue_order")
    if len(order) != len(assigned) or set(order) != set(assigned):
        raise LedgerError("ledger state's issue_order does not list exactly the uids in its states")
    ended: Counter[str] = Counter()
    ends: dict[tuple[str, str | None], list[str]] = {}
    for uid in order:
        sample_state, reason = assigned[uid]
        if sample_state is SampleState.IN_FLIGHT:
            continue
        ended[sample_state.value] += 1
        if reason is not None:
            ended[f"{sample_state.value}/{reason}"] += 1
        ends.setdefault((sample_state.value, reason), []).append(uid)
    history = [(ISSUED, None, order), *((event, reason, uids) for (event, reason), uids in ends.items())]
    in_flight = [uid for uid in order if assigned[uid][0] is SampleState.IN_FLIGHT]
    return in_flight, len(order), ended, history


def _uid_list(value: Any, field: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(uid, str) for uid in value):
        raise LedgerError(f"ledger state's {field!r} must be a list of uid strings")
    if len(set(value)) != len(value):
        raise LedgerError(f"ledger state's {field!r} lists a uid twice")
    return value


def _is_ended_key(key: str) -> bool:
    """An ended state's value, or `<state>/<reason>` for a state that takes a reason."""
    state_name, slash, reason = key.partition("/")
    if not slash:
        return state_name in {s.value for s in ENDED_STATES}
    return state_name in {s.value for s in _NEEDS_REASON} and _is_reason(reason)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _unique(uids: Iterable[str], action: str) -> list[str]:
    if isinstance(uids, str):
        # A bare string is iterable too; treating "e0/1" as four uids would corrupt the ledger without an error.
        raise TypeError(f"{action} takes an iterable of uids, not a single string {uids!r}")
    batch = list(uids)
    if len(set(batch)) != len(batch):
        duplicate = next(uid for uid, n in Counter(batch).items() if n > 1)
        raise LedgerError(f"cannot {action}: {duplicate!r} appears twice in one call")
    return batch
