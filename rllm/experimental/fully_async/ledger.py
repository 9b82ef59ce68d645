"""The sample ledger: every prompt sample issued ends in exactly one state, so nothing is lost silently.

DESIGN rule 5. A sample (one prompt drawn from the PromptIterator, identified by its `prompt_uid`) is *issued*
when the executor takes it, and then *ends* exactly once:

    trained          its group went into an optimizer step
    filtered(reason) its group was removed on purpose (e.g. all rewards equal, prompt too long)
    dropped_stale    its group was older than max_staleness at training time
    failed(reason)   the rollout or the reward failed

or it is still *in flight* (issued, not ended). The counts always add up:
in_flight + trained + filtered + dropped_stale + failed == issued. Ending a sample twice, ending one that was
never issued, or issuing one twice raises `LedgerError`: each is a bookkeeping bug upstream, and a ledger that
tolerated it could no longer prove that nothing was lost. Every call is all-or-nothing: it checks all its uids
before changing anything.

Pure code (no I/O). The checkpoint holds `state_dict()`; after a restore, `in_flight_uids()` are the samples to
issue again (their rollouts died with the process), in the order they were first issued.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any

STATE_DICT_VERSION = 1


class SampleState(str, Enum):
    IN_FLIGHT = "in_flight"
    TRAINED = "trained"
    FILTERED = "filtered"
    DROPPED_STALE = "dropped_stale"
    FAILED = "failed"


ENDED_STATES = (SampleState.TRAINED, SampleState.FILTERED, SampleState.DROPPED_STALE, SampleState.FAILED)
_NEEDS_REASON = (SampleState.FILTERED, SampleState.FAILED)


class LedgerError(ValueError):
    """An impossible transition: a sample issued twice, ended twice, or ended without being issued."""


class SampleLedger:
    """uid -> (state, reason). Insertion order is issue order (dicts keep it), which resume relies on."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[SampleState, str | None]] = {}

    def issue(self, uids: Iterable[str]) -> None:
        """Record samples as in flight. A uid already in the ledger (in flight or ended) raises."""
        batch = _unique(uids, "issue")
        known = [uid for uid in batch if uid in self._entries]
        if known:
            state = self._entries[known[0]][0].value
            raise LedgerError(f"cannot issue {known[0]!r}: already in the ledger as {state} ({len(known)} such)")
        for uid in batch:
            self._entries[uid] = (SampleState.IN_FLIGHT, None)

    def mark_trained(self, uids: Iterable[str]) -> None:
        self._end(uids, SampleState.TRAINED, None)

    def mark_filtered(self, uids: Iterable[str], reason: str) -> None:
        self._end(uids, SampleState.FILTERED, reason)

    def mark_dropped_stale(self, uids: Iterable[str]) -> None:
        self._end(uids, SampleState.DROPPED_STALE, None)

    def mark_failed(self, uids: Iterable[str], reason: str) -> None:
        self._end(uids, SampleState.FAILED, reason)

    def _end(self, uids: Iterable[str], state: SampleState, reason: str | None) -> None:
        if state in _NEEDS_REASON and (not isinstance(reason, str) or not reason or "/" in reason):
            # The reason becomes a metric name ("filtered/<reason>"): it must be a non-empty word without '/'.
            raise LedgerError(f"{state.value} needs a non-empty reason without '/', got {reason!r}")
        batch = _unique(uids, f"mark {state.value}")
        for uid in batch:
            entry = self._entries.get(uid)
            if entry is None:
                raise LedgerError(f"cannot mark {uid!r} {state.value}: it was never issued")
            if entry[0] is not SampleState.IN_FLIGHT:
                raise LedgerError(f"cannot mark {uid!r} {state.value}: it already ended as {_describe(*entry)}")
        for uid in batch:
            self._entries[uid] = (state, reason)

    def state(self, uid: str) -> SampleState:
        """The sample's state; KeyError if it was never issued."""
        return self._entries[uid][0]

    def reason(self, uid: str) -> str | None:
        """The reason a filtered or failed sample ended with (None for other states)."""
        return self._entries[uid][1]

    def __contains__(self, uid: object) -> bool:
        return uid in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def in_flight_uids(self) -> list[str]:
        """Issued samples that have not ended, in issue order (what a resumed run must issue again)."""
        return [uid for uid, (state, _) in self._entries.items() if state is SampleState.IN_FLIGHT]

    def counts(self) -> dict[str, int]:
        """issued, in_flight, each ended state, and `filtered/<reason>`, `failed/<reason>` for every reason seen.

        in_flight + trained + filtered + dropped_stale + failed == issued; the per-reason counts of a state add up
        to that state's count.
        """
        by_state: Counter[SampleState] = Counter()
        by_reason: Counter[str] = Counter()
        for state, reason in self._entries.values():
            by_state[state] += 1
            if reason is not None:
                by_reason[f"{state.value}/{reason}"] += 1
        result = {"issued": len(self._entries)}
        result |= {state.value: by_state[state] for state in SampleState}
        result |= dict(sorted(by_reason.items()))
        return result

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable: uids grouped by state (and reason), each list in issue order."""
        in_flight: list[str] = []
        trained: list[str] = []
        dropped_stale: list[str] = []
        filtered: dict[str, list[str]] = {}
        failed: dict[str, list[str]] = {}
        order: list[str] = []
        for uid, (state, reason) in self._entries.items():
            order.append(uid)
            if state is SampleState.IN_FLIGHT:
                in_flight.append(uid)
            elif state is SampleState.TRAINED:
                trained.append(uid)
            elif state is SampleState.DROPPED_STALE:
                dropped_stale.append(uid)
            elif state is SampleState.FILTERED:
                filtered.setdefault(str(reason), []).append(uid)
            else:
                failed.setdefault(str(reason), []).append(uid)
        return {
            "version": STATE_DICT_VERSION,
            "issue_order": order,
            "in_flight": in_flight,
            "trained": trained,
            "dropped_stale": dropped_stale,
            "filtered": filtered,
            "failed": failed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the ledger with a checkpointed one; a malformed or inconsistent state raises and changes nothing."""
        if state.get("version") != STATE_DICT_VERSION:
            raise LedgerError(f"ledger state version {state.get('version')!r} is not {STATE_DICT_VERSION}")
        assigned: dict[str, tuple[SampleState, str | None]] = {}

        def put(uids: Iterable[str], entry: tuple[SampleState, str | None]) -> None:
            for uid in uids:
                if uid in assigned:
                    raise LedgerError(f"ledger state lists {uid!r} twice")
                assigned[uid] = entry

        put(state["in_flight"], (SampleState.IN_FLIGHT, None))
        put(state["trained"], (SampleState.TRAINED, None))
        put(state["dropped_stale"], (SampleState.DROPPED_STALE, None))
        for reason, uids in state["filtered"].items():
            put(uids, (SampleState.FILTERED, reason))
        for reason, uids in state["failed"].items():
            put(uids, (SampleState.FAILED, reason))
        order = list(state["issue_order"])
        if len(order) != len(assigned) or set(order) != set(assigned):
            raise LedgerError("ledger state's issue_order does not list exactly the uids in its states")
        self._entries = {uid: assigned[uid] for uid in order}


def _unique(uids: Iterable[str], action: str) -> list[str]:
    if isinstance(uids, str):
        # A bare string is iterable too; treating "e0/1" as four uids would corrupt the ledger without an error.
        raise TypeError(f"{action} takes an iterable of uids, not a single string {uids!r}")
    batch = list(uids)
    if len(set(batch)) != len(batch):
        duplicate = next(uid for uid, n in Counter(batch).items() if n > 1)
        raise LedgerError(f"cannot {action}: {duplicate!r} appears twice in one call")
    return batch


def _describe(state: SampleState, reason: str | None) -> str:
    return state.value if reason is None else f"{state.value}({reason})"
