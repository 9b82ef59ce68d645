"""The sample ledger: one end state per sample, counts that add up, impossible transitions rejected, checkpoints."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rllm.experimental.fully_async.ledger import LedgerError, SampleLedger, SampleState

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


def test_every_state_is_counted_with_reasons():
    ledger = SampleLedger()
    ledger.issue([f"e0/{i}" for i in range(8)])
    ledger.mark_trained(["e0/0", "e0/1"])
    ledger.mark_filtered(["e0/2"], "all_rewards_equal")
    ledger.mark_filtered(["e0/3"], "prompt_too_long")
    ledger.mark_dropped_stale(["e0/4"])
    ledger.mark_failed(["e0/5"], "reward_timeout")
    assert ledger.counts() == {
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
    assert ledger.in_flight_uids() == ["e0/6", "e0/7"]
    assert ledger.state("e0/3") is SampleState.FILTERED
    assert ledger.reason("e0/3") == "prompt_too_long"


@pytest.mark.parametrize("first", END_STATES)
@pytest.mark.parametrize("second", END_STATES)
def test_ending_a_sample_twice_raises(first, second):
    ledger = SampleLedger()
    ledger.issue(["a"])
    end(ledger, ["a"], first)
    with pytest.raises(LedgerError, match="already ended"):
        end(ledger, ["a"], second)
    assert ledger.state("a").value == first


@pytest.mark.parametrize("state", END_STATES)
def test_ending_an_unissued_sample_raises(state):
    with pytest.raises(LedgerError, match="never issued"):
        end(SampleLedger(), ["ghost"], state)


def test_a_failing_call_changes_nothing():
    ledger = SampleLedger()
    ledger.issue(["a", "b"])
    with pytest.raises(LedgerError):
        ledger.mark_trained(["a", "ghost"])
    assert ledger.state("a") is SampleState.IN_FLIGHT
    with pytest.raises(LedgerError, match="appears twice"):
        ledger.mark_trained(["b", "b"])
    assert ledger.state("b") is SampleState.IN_FLIGHT
    with pytest.raises(LedgerError, match="already in the ledger"):
        ledger.issue(["c", "a"])
    assert "c" not in ledger


def test_issuing_twice_and_bad_arguments_raise():
    ledger = SampleLedger()
    ledger.issue(["a"])
    with pytest.raises(LedgerError, match="already in the ledger as in_flight"):
        ledger.issue(["a"])
    with pytest.raises(TypeError, match="single string"):
        ledger.mark_trained("a")
    with pytest.raises(LedgerError, match="non-empty reason"):
        ledger.mark_filtered(["a"], "")
    with pytest.raises(LedgerError, match="without '/'"):
        ledger.mark_failed(["a"], "http/500")


def test_state_dict_round_trips_through_json_and_resume_reissues_in_flight_in_order():
    ledger = SampleLedger()
    ledger.issue(["x", "y", "z", "w"])
    ledger.mark_trained(["y"])
    ledger.mark_failed(["w"], "engine_error")
    restored = SampleLedger()
    restored.load_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert restored.counts() == ledger.counts()
    assert restored.in_flight_uids() == ["x", "z"]
    assert restored.reason("w") == "engine_error"
    restored.mark_trained(restored.in_flight_uids())  # the re-issued samples end normally after the resume
    assert restored.counts()["in_flight"] == 0


def test_inconsistent_state_dict_is_rejected():
    ledger = SampleLedger()
    ledger.issue(["a", "b"])
    ledger.mark_trained(["b"])
    state = ledger.state_dict()
    with pytest.raises(LedgerError, match="twice"):
        SampleLedger().load_state_dict(state | {"dropped_stale": ["b"]})
    with pytest.raises(LedgerError, match="issue_order"):
        SampleLedger().load_state_dict(state | {"issue_order": ["a"]})
    with pytest.raises(LedgerError, match="version"):
        SampleLedger().load_state_dict(state | {"version": 99})


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["issue", *END_STATES]),
            st.lists(st.integers(0, 30), min_size=1, max_size=4),
            st.sampled_from(["r1", "r2"]),
        ),
        max_size=80,
    )
)
def test_random_operations_keep_counts_consistent_with_a_reference_model(ops):
    ledger = SampleLedger()
    model: dict[str, tuple[str, str | None]] = {}
    for op, ids, reason in ops:
        uids = [f"u{i}" for i in ids]
        try:
            if op == "issue":
                ledger.issue(uids)
            else:
                end(ledger, uids, op, reason)
        except LedgerError:
            continue  # rejected calls must leave the ledger equal to the model, checked below
        for uid in uids:
            model[uid] = (
                ("in_flight", None) if op == "issue" else (op, reason if op in ("filtered", "failed") else None)
            )
        counts = ledger.counts()
        assert_counts_add_up(counts)
    assert {uid: (ledger.state(uid).value, ledger.reason(uid)) for uid in model} == model
    assert len(ledger) == len(model)
