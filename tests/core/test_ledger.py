"""The sample ledger: one end state per sample, counts that add up, impossible transitions rejected, memory bounded
by what is in flight, and a journal that proves every sample ended once, across checkpoints and resumes."""

from __future__ import annotations

import copy
import json
import logging
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rllm.experimental.fully_async.core.ledger import SampleLedger
from rllm.experimental.fully_async.core.ledger_format import LedgerError, SampleState, history_counts
from rllm.experimental.fully_async.runtime.rollout.ledger_journal import journaled_ledger, read_journal

END_STATES = ["trained", "filtered", "dropped_stale", "failed"]


def end(ledger: SampleLedger, uids: list[str], state: str, reason: str = "r") -> None:
    if state == "trained":
        ledger.mark_trained(uids)
    elif state == "filtered":
        ledger.mark_filtered(uids, reason)
    elif state == "dropped_stale":
        ledger.mark_dropped_stale(uids)
    else:
        ledger.mark_failed(uids, reason)


def assert_counts_add_up(counts: dict[str, int]) -> None:
    assert counts["issued"] == sum(counts[s.value] for s in SampleState)
    for state in ("filtered", "failed"):
        per_reason = sum(v for k, v in counts.items() if k.startswith(f"{state}/"))
        assert per_reason == counts[state]


def finals(history: dict[str, tuple[SampleState, str | None]]) -> dict[str, tuple[str, str | None]]:
    return {uid: (state.value, reason) for uid, (state, reason) in history.items()}


# --- counts and transitions --------------------------------------------------------------------------------------


def test_every_state_is_counted_with_reasons_and_the_journal_has_each_end(tmp_path):
    journal = tmp_path / "ledger.jsonl"
    ledger = journaled_ledger(journal)
    ledger.issue([f"e0/{i}" for i in range(8)])
    ledger.mark_trained(["e0/0", "e0/1"])
    ledger.mark_filtered(["e0/2"], "all_rewards_equal")
    ledger.mark_filtered(["e0/3"], "prompt_too_long")
    ledger.mark_dropped_stale(["e0/4"])
    ledger.mark_failed(["e0/5"], "reward_timeout")
    counts = ledger.counts()
    assert counts == {
        "issued": 8,
        "in_flight": 2,
        "trained": 2,
        "filtered": 2,
        "dropped_stale": 1,
        "failed": 1,
        "failed/reward_timeout": 1,
        "filtered/all_rewards_equal": 1,
        "filtered/prompt_too_long": 1,
    }
    # The order metrics and the progress line see: totals first, then the reasons sorted.
    assert list(counts)[:6] == ["issued", "in_flight", "trained", "filtered", "dropped_stale", "failed"]
    assert ledger.in_flight_uids() == ["e0/6", "e0/7"]
    # Read while the ledger is still open: every call's record reached the file (a killed process keeps them).
    history = read_journal(journal)
    assert history["e0/3"] == (SampleState.FILTERED, "prompt_too_long")
    assert history["e0/5"] == (SampleState.FAILED, "reward_timeout")
    assert history["e0/6"] == (SampleState.IN_FLIGHT, None)
    assert list(history) == [f"e0/{i}" for i in range(8)]  # issue order
    assert history_counts(history) == counts


def test_a_ledger_without_a_journal_keeps_exact_counts():
    ledger = SampleLedger()
    ledger.issue(["a", "b", "c"])
    ledger.mark_failed(["a"], "engine_error")
    assert ledger.counts()["failed/engine_error"] == 1 and ledger.counts()["in_flight"] == 2
    assert ledger.state_dict()["journal_bytes"] is None


@pytest.mark.parametrize("first", END_STATES)
@pytest.mark.parametrize("second", END_STATES)
def test_ending_a_sample_twice_raises_and_keeps_the_first_end(first, second, tmp_path):
    ledger = journaled_ledger(tmp_path / "ledger.jsonl")
    ledger.issue(["a"])
    end(ledger, ["a"], first)
    before = ledger.counts()
    with pytest.raises(LedgerError, match=r"not in flight .*already ended"):
        end(ledger, ["a"], second)
    assert ledger.counts() == before
    assert read_journal(tmp_path / "ledger.jsonl")["a"][0].value == first


@pytest.mark.parametrize("state", END_STATES)
def test_ending_an_unissued_sample_raises(state):
    with pytest.raises(LedgerError, match="not in flight \\(never issued"):
        end(SampleLedger(), ["ghost"], state)


def test_a_failing_call_changes_nothing_in_memory_or_in_the_journal(tmp_path):
    journal = tmp_path / "ledger.jsonl"
    ledger = journaled_ledger(journal)
    ledger.issue(["a", "b"])
    size, counts = journal.stat().st_size, ledger.counts()
    with pytest.raises(LedgerError):
        ledger.mark_trained(["a", "ghost"])
    with pytest.raises(LedgerError, match="appears twice"):
        ledger.mark_trained(["b", "b"])
    with pytest.raises(LedgerError, match="already in flight"):
        ledger.issue(["c", "a"])
    with pytest.raises(LedgerError, match="non-empty reason"):
        ledger.mark_filtered(["a"], "")
    assert ledger.counts() == counts and ledger.in_flight_uids() == ["a", "b"] and "c" not in ledger
    assert journal.stat().st_size == size


def test_issuing_twice_and_bad_arguments_raise():
    ledger = SampleLedger()
    ledger.issue(["a"])
    with pytest.raises(LedgerError, match="already in flight"):
        ledger.issue(["a"])
    with pytest.raises(TypeError, match="single string"):
        ledger.mark_trained("a")
    with pytest.raises(LedgerError, match="non-empty reason"):
        ledger.mark_filtered(["a"], "")
    with pytest.raises(LedgerError, match="without '/'"):
        ledger.mark_failed(["a"], "http/500")


def test_reissuing_an_ended_sample_is_not_seen_in_memory_but_the_audit_catches_it(tmp_path):
    """Ended uids are forgotten (that is what bounds the memory), so only the journal can tell."""
    journal = tmp_path / "ledger.jsonl"
    ledger = journaled_ledger(journal)
    ledger.issue(["a"])
    ledger.mark_trained(["a"])
    ledger.issue(["a"])  # accepted: the bug this would be upstream is the audit's to find
    with pytest.raises(LedgerError, match=r"ledger.jsonl:3: 'a' issued twice \(it was trained\)"):
        read_journal(journal)


# --- memory ------------------------------------------------------------------------------------------------------


def test_memory_holds_only_the_samples_in_flight_after_100k_samples(tmp_path):
    journal = tmp_path / "ledger.jsonl"
    ledger = journaled_ledger(journal)
    in_flight = 64
    for group in range(100_000 // 8):
        ledger.issue([f"e0/{group}/{i}" for i in range(8)])
        if group >= in_flight // 8:  # keep the last 64 samples in flight, as a staleness budget would
            done = group - in_flight // 8
            end(ledger, [f"e0/{done}/{i}" for i in range(8)], END_STATES[done % 4], reason="x")
    assert len(ledger) == in_flight == len(ledger.in_flight_uids())
    assert len(ledger._in_flight) == in_flight  # the one per-sample structure in memory
    assert set(ledger._ended) == {"trained", "filtered", "dropped_stale", "failed", "filtered/x", "failed/x"}
    counts = ledger.counts()
    assert counts["issued"] == 100_000 and counts["in_flight"] == in_flight
    state = ledger.state_dict()
    assert len(json.dumps(state)) < 3_000, "the checkpoint holds the in-flight uids and counters, not the history"
    assert state["journal_bytes"] == journal.stat().st_size
    history = read_journal(journal)
    assert len(history) == 100_000 and history_counts(history) == counts


# --- checkpoints -------------------------------------------------------------------------------------------------


def test_state_dict_round_trips_through_json_and_resume_reissues_in_flight_in_order(tmp_path):
    journal = tmp_path / "ledger.jsonl"
    ledger = journaled_ledger(journal)
    ledger.issue(["x", "y", "z", "w"])
    ledger.mark_trained(["y"])
    ledger.mark_failed(["w"], "engine_error")
    state = json.loads(json.dumps(ledger.state_dict()))
    assert state["version"] == 2 and state["in_flight"] == ["x", "z"] and state["issued"] == 4
    restored = journaled_ledger(journal)
    restored.load_state_dict(state)
    assert restored.counts() == ledger.counts()
    assert restored.in_flight_uids() == ["x", "z"]
    restored.mark_trained(restored.in_flight_uids())  # the re-issued samples end normally after the resume
    assert restored.counts()["in_flight"] == 0
    assert finals(read_journal(journal)) == {
        "x": ("trained", None),
        "y": ("trained", None),
        "z": ("trained", None),
        "w": ("failed", "engine_error"),
    }


def test_resume_truncates_the_journal_to_the_checkpoint_so_replayed_work_is_recorded_once(tmp_path):
    """What happened after the checkpoint happens again after the resume: the journal must not hold it twice."""
    journal = tmp_path / "ledger.jsonl"
    first = journaled_ledger(journal)
    first.issue(["a", "b", "c"])
    first.mark_trained(["a"])
    state = first.state_dict()
    assert state["journal_bytes"] == journal.stat().st_size  # on disk when the checkpoint records it
    first.mark_trained(["b"])  # lost with the crash: b is in flight again after the resume
    first.issue(["d"])  # the prompt iterator rewinds too: d will be issued again
    assert journal.stat().st_size > state["journal_bytes"]

    resumed = journaled_ledger(journal)
    resumed.load_state_dict(state)
    assert journal.stat().st_size == state["journal_bytes"]
    assert resumed.in_flight_uids() == ["b", "c"]
    resumed.mark_trained(["b", "c"])
    resumed.issue(["d"])
    resumed.mark_filtered(["d"], "all_rewards_equal")
    history = read_journal(journal)  # no double end of b, no double issue of d
    assert finals(history) == {
        "a": ("trained", None),
        "b": ("trained", None),
        "c": ("trained", None),
        "d": ("filtered", "all_rewards_equal"),
    }
    assert history_counts(history) == resumed.counts()


def test_a_new_ledger_starts_its_journal_empty_over_a_leftover_file(tmp_path):
    journal = tmp_path / "ledger.jsonl"
    old = journaled_ledger(journal)
    old.issue(["a"])
    old.close()
    fresh = journaled_ledger(journal)  # a fresh run in the same dir: "a" is not this run's
    fresh.issue(["a"])
    assert finals(read_journal(journal)) == {"a": ("in_flight", None)}
    fresh.close()
    fresh.mark_trained(["a"])  # reopening after close appends
    assert finals(read_journal(journal)) == {"a": ("trained", None)}


@pytest.mark.parametrize("damage", ["shorter", "missing", "moved"])
def test_a_journal_that_is_not_the_checkpoints_is_restarted_with_a_warning(tmp_path, caplog, damage):
    journal = tmp_path / "ledger.jsonl"
    ledger = journaled_ledger(journal)
    ledger.issue(["a", "b", "c"])
    ledger.mark_trained(["a"])
    state = ledger.state_dict()
    ledger.close()
    target = journal
    if damage == "shorter":
        journal.write_bytes(journal.read_bytes()[:10])
    elif damage == "missing":
        journal.unlink()
    else:
        target = tmp_path / "elsewhere" / "ledger.jsonl"  # a resume from another run dir's checkpoint
    resumed = journaled_ledger(target)
    with caplog.at_level(logging.WARNING, logger="rllm.experimental.fully_async.core.ledger"):
        resumed.load_state_dict(state)
    assert "is not the checkpoint's" in caplog.text
    assert resumed.counts() == ledger.counts()  # the counts stay exact
    resumed.mark_trained(["b", "c"])
    # The restarted journal lists the in-flight samples' issues, so what ends after the resume still audits.
    assert finals(read_journal(target)) == {"b": ("trained", None), "c": ("trained", None)}


def test_a_checkpoint_without_a_journal_loads_into_a_ledger_with_one(tmp_path, caplog):
    plain = SampleLedger()
    plain.issue(["a", "b"])
    plain.mark_dropped_stale(["a"])
    resumed = journaled_ledger(tmp_path / "ledger.jsonl")
    with caplog.at_level(logging.WARNING, logger="rllm.experimental.fully_async.core.ledger"):
        resumed.load_state_dict(plain.state_dict())
    assert "is not the checkpoint's" in caplog.text
    assert resumed.counts() == plain.counts() and resumed.in_flight_uids() == ["b"]


def test_a_version_1_state_loads_and_rebuilds_the_journal(tmp_path):
    """Checkpoints written before the journal existed list every uid by state; they still resume."""
    v1 = {
        "version": 1,
        "issue_order": ["p1", "p2", "p3", "p4", "p5", "p6"],
        "in_flight": ["p3", "p6"],
        "trained": ["p1"],
        "dropped_stale": ["p4"],
        "filtered": {"all_rewards_equal": ["p2"]},
        "failed": {"reward_error": ["p5"]},
    }
    journal = tmp_path / "ledger.jsonl"
    journal.write_text("left over from the crashed run\n")
    ledger = journaled_ledger(journal)
    ledger.load_state_dict(v1)
    assert ledger.in_flight_uids() == ["p3", "p6"]
    assert ledger.counts() == {
        "issued": 6,
        "in_flight": 2,
        "trained": 1,
        "filtered": 1,
        "dropped_stale": 1,
        "failed": 1,
        "failed/reward_error": 1,
        "filtered/all_rewards_equal": 1,
    }
    ledger.mark_trained(["p3", "p6"])
    assert finals(read_journal(journal)) == {
        "p1": ("trained", None),
        "p2": ("filtered", "all_rewards_equal"),
        "p3": ("trained", None),
        "p4": ("dropped_stale", None),
        "p5": ("failed", "reward_error"),
        "p6": ("trained", None),
    }
    assert ledger.state_dict()["version"] == 2


def test_the_checkpoint_fixtures_version_1_ledger_loads_without_the_empty_states():
    ledger = SampleLedger()
    ledger.load_state_dict(
        {"version": 1, "issue_order": ["p1", "p2", "p3"], "in_flight": ["p3"], "trained": ["p1", "p2"]}
    )
    assert ledger.counts()["trained"] == 2 and ledger.in_flight_uids() == ["p3"]


def _v2_state() -> dict:
    ledger = SampleLedger()
    ledger.issue(["a", "b", "c"])
    ledger.mark_trained(["b"])
    ledger.mark_failed(["c"], "engine_error")
    return ledger.state_dict()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 99}, "version"),
        ({"issued": 4}, "does not add up"),
        ({"issued": -1}, "non-negative"),
        ({"in_flight": ["a", "a"]}, "lists a uid twice"),
        ({"in_flight": "a"}, "list of uid strings"),
        ({"ended": {"trained": 1, "failed": 1}}, "failed reasons add up to 0"),
        ({"ended": {"trained": 1, "failed": 1, "failed/engine_error": 1, "trained/x": 0}}, "invalid entry"),
        ({"ended": {"trained": 1, "failed": 1, "failed/engine_error": 1, "lost": 0}}, "invalid entry"),
        ({"ended": {"trained": 1.0, "failed": 1, "failed/engine_error": 1}}, "invalid entry"),
        ({"journal_bytes": -5}, "journal_bytes"),
    ],
)
def test_an_inconsistent_version_2_state_is_rejected_and_changes_nothing(tmp_path, change, message):
    journal = tmp_path / "ledger.jsonl"
    ledger = journaled_ledger(journal)
    ledger.issue(["z"])
    size, counts = journal.stat().st_size, ledger.counts()
    with pytest.raises(LedgerError, match=message):
        ledger.load_state_dict(_v2_state() | change)
    assert ledger.counts() == counts and ledger.in_flight_uids() == ["z"] and journal.stat().st_size == size


def test_an_inconsistent_version_1_state_is_rejected():
    state = {"version": 1, "issue_order": ["a", "b"], "in_flight": ["a"], "trained": ["b"]}
    with pytest.raises(LedgerError, match="twice"):
        SampleLedger().load_state_dict(state | {"dropped_stale": ["b"]})
    with pytest.raises(LedgerError, match="issue_order"):
        SampleLedger().load_state_dict(state | {"issue_order": ["a"]})
    with pytest.raises(LedgerError, match="reason"):
        SampleLedger().load_state_dict(state | {"failed": {"": ["c"]}, "issue_order": ["a", "b", "c"]})


# --- the audit ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"event":"trained","uids":["a"]}'], "'a' ended trained without being issued"),
        (
            [
                '{"event":"issued","uids":["a"]}',
                '{"event":"trained","uids":["a"]}',
                '{"event":"dropped_stale","uids":["a"]}',
            ],
            ":3: 'a' ended twice \\(trained, then dropped_stale\\)",
        ),
        (['{"event":"issued","uids":["a"]}', '{"event":"issued","uids":["a"]}'], ":2: 'a' issued twice"),
        (['{"event":"issued","uids":["a","a"]}'], "appears twice in one record"),
        (['{"event":"lost","uids":["a"]}'], "unknown event"),
        (['{"event":"failed","uids":["a"]}'], "with reason None"),
        (['{"event":"trained","reason":"x","uids":["a"]}'], "with reason 'x'"),
        (['{"event":"issued","uids":"a"}'], "list of strings"),
        (["not json"], ":1: not a JSON line"),
        (['{"event":"resumed","reason":"continued","uids":["a"]}'], "'a' resumed while not in flight"),
        (
            [
                '{"event":"issued","uids":["a"]}',
                '{"event":"trained","uids":["a"]}',
                '{"event":"resumed","reason":"continued","uids":["a"]}',
            ],
            ":3: 'a' resumed while not in flight",
        ),
        (
            [
                '{"event":"issued","uids":["a"]}',
                '{"event":"resumed","reason":"continued","uids":["a"]}',
                '{"event":"resumed","reason":"nothing_saved","uids":["a"]}',
            ],
            ":3: 'a' resumed twice \\(continued, then nothing_saved\\)",
        ),
        (['{"event":"issued","uids":["a"]}', '{"event":"resumed","reason":"lucky","uids":["a"]}'], "outcome 'lucky'"),
    ],
)
def test_the_audit_rejects_an_impossible_history(tmp_path, lines, message):
    journal = tmp_path / "ledger.jsonl"
    journal.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(LedgerError, match=message):
        read_journal(journal)


def test_a_resume_outcome_is_journaled_for_a_sample_in_flight_and_leaves_its_state_alone(tmp_path):
    """How a sample in flight at a resumed checkpoint went on is a journal record, not a state: the sample stays in
    flight until it ends, the state counts do not change (the outcomes are tallied apart), and the audit hands the
    outcomes back."""
    journal = tmp_path / "ledger.jsonl"
    ledger = journaled_ledger(journal)
    ledger.issue(["a", "b", "c"])
    ledger.mark_resumed(["a", "b"], "continued")
    ledger.mark_resumed(["c"], "env_not_restored")
    assert ledger.counts() == {
        "issued": 3,
        "in_flight": 3,
        "trained": 0,
        "filtered": 0,
        "dropped_stale": 0,
        "failed": 0,
        "resumed/continued": 2,
        "resumed/env_not_restored": 1,
    }
    ledger.mark_trained(["a", "c"])
    ledger.mark_dropped_stale(["b"])
    with pytest.raises(LedgerError, match="not in flight"):
        ledger.mark_resumed(["a"], "continued")
    with pytest.raises(LedgerError, match="resumed needs one of"):
        ledger.mark_resumed(["a"], "regenerated")
    ledger.close()
    outcomes: dict[str, str] = {}
    history = read_journal(journal, outcomes)
    assert outcomes == {"a": "continued", "b": "continued", "c": "env_not_restored"}
    assert {uid: state for uid, (state, _) in history.items()} == {
        "a": SampleState.TRAINED,
        "b": SampleState.DROPPED_STALE,
        "c": SampleState.TRAINED,
    }


def test_the_resume_tally_is_checkpointed_so_it_covers_every_crash_of_the_run(tmp_path):
    """`resumed/<outcome>` counts survive a checkpoint round trip (what a second crash resumes from), add up over
    crashes, restart from the checkpoint's tally (what was marked after it is marked again), and a bad tally is
    refused; a checkpoint from before token-level resume has none."""
    ledger = SampleLedger()
    ledger.issue(["a", "b", "c", "d"])
    ledger.mark_resumed(["a"], "continued")
    ledger.mark_resumed(["b"], "nothing_saved")
    state = json.loads(json.dumps(ledger.state_dict()))
    ledger.mark_resumed(["c"], "continued")  # after the checkpoint: lost with the crash, journaled again later

    resumed = SampleLedger()
    resumed.load_state_dict(state)
    assert {k: v for k, v in resumed.counts().items() if k.startswith("resumed/")} == {
        "resumed/continued": 1,
        "resumed/nothing_saved": 1,
    }
    resumed.mark_resumed(["c", "d"], "continued")
    assert resumed.counts()["resumed/continued"] == 3

    old = {k: v for k, v in state.items() if k != "resumed"}
    before = SampleLedger()
    before.load_state_dict(old)
    assert not any(k.startswith("resumed/") for k in before.counts())
    for bad in ({"regenerated": 1}, {"continued": -1}, ["continued"]):
        with pytest.raises(LedgerError, match="'resumed'"):
            before.load_state_dict(state | {"resumed": bad})
    assert before.counts()["in_flight"] == 4 and "resumed/continued" not in before.counts(), "nothing changed"


def test_the_audit_ignores_a_torn_last_line(tmp_path, caplog):
    journal = tmp_path / "ledger.jsonl"
    journal.write_text('{"event":"issued","uids":["a"]}\n{"event":"trained","ui')
    with caplog.at_level(logging.WARNING, logger="rllm.experimental.fully_async.core.ledger_format"):
        assert finals(read_journal(journal)) == {"a": ("in_flight", None)}
    assert "torn last line" in caplog.text


# --- the model test ----------------------------------------------------------------------------------------------


class Model:
    """What the ledger and its journal should hold, kept the obvious way: every uid's state forever."""

    def __init__(self) -> None:
        self.final: dict[str, tuple[str, str | None]] = {}
        self.in_flight: dict[str, None] = {}
        self.issued = 0
        self.ended: Counter[str] = Counter()
        self.reissued_an_ended_uid = False  # the one bug only the audit can see

    def counts(self) -> dict[str, int]:
        return (
            {"issued": self.issued, "in_flight": len(self.in_flight)}
            | {s: self.ended[s] for s in END_STATES}
            | {k: v for k, v in self.ended.items() if "/" in k}
        )

    def apply(self, op: str, uids: list[str], reason: str) -> bool:
        """Whether the ledger must accept the call; applies it if so."""
        if len(set(uids)) != len(uids):
            return False
        if op == "issue":
            if any(uid in self.in_flight for uid in uids):
                return False
            self.reissued_an_ended_uid |= any(uid in self.final for uid in uids)
            self.in_flight.update(dict.fromkeys(uids))
            self.issued += len(uids)
            self.final.update(dict.fromkeys(uids, ("in_flight", None)))
            return True
        if any(uid not in self.in_flight for uid in uids):
            return False
        kept_reason = reason if op in ("filtered", "failed") else None
        for uid in uids:
            del self.in_flight[uid]
            self.final[uid] = (op, kept_reason)
        self.ended[op] += len(uids)
        if kept_reason is not None:
            self.ended[f"{op}/{reason}"] += len(uids)
        return True


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["issue", "issue", *END_STATES, "checkpoint", "restore"]),
            st.lists(st.integers(0, 15), min_size=1, max_size=4),
            st.sampled_from(["r1", "r2"]),
        ),
        max_size=80,
    )
)
def test_random_operations_with_crashes_keep_ledger_and_journal_equal_to_a_reference_model(ops):
    """Random calls, checkpoints and restores (a crash back to the last checkpoint): after each step the counts
    and in-flight order match the model, and at the end the replayed journal holds exactly the model's history."""
    with tempfile.TemporaryDirectory() as tmp:
        journal = Path(tmp) / "ledger.jsonl"
        ledger, model = journaled_ledger(journal), Model()
        checkpoint: tuple[dict, Model] | None = None
        for op, ids, reason in ops:
            uids = [f"u{i}" for i in ids]
            if op == "checkpoint":
                checkpoint = (json.loads(json.dumps(ledger.state_dict())), copy.deepcopy(model))
            elif op == "restore" and checkpoint is not None:
                ledger.close()
                ledger = journaled_ledger(journal)
                ledger.load_state_dict(checkpoint[0])
                model = copy.deepcopy(checkpoint[1])
            elif op not in ("checkpoint", "restore"):
                accepted = model.apply(op, uids, reason)
                try:
                    if op == "issue":
                        ledger.issue(uids)
                    else:
                        end(ledger, uids, op, reason)
                except LedgerError:
                    assert not accepted, (op, uids)
                else:
                    assert accepted, (op, uids)
            counts = ledger.counts()
            assert_counts_add_up(counts)
            assert counts == model.counts()
            assert ledger.in_flight_uids() == list(model.in_flight)
        ledger.state_dict()  # the last checkpoint: starts the journal even if nothing was recorded
        if model.reissued_an_ended_uid:
            with pytest.raises(LedgerError, match="issued twice"):
                read_journal(journal)
        else:
            history = read_journal(journal)
            assert finals(history) == model.final
            assert history_counts(history) == model.counts()
        ledger.close()
