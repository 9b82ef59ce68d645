"""The pure decisions of elastic engines (core/elastic.py): membership ids, control requests, who may register, the
no-engine clock and the engine_events.jsonl record."""

from __future__ import annotations

import pytest

from rllm.experimental.fully_async.core.elastic import (
    EVENT_FIELDS,
    ElasticError,
    Membership,
    NoEngineClock,
    SampleMoves,
    ServerAnswers,
    authorized,
    event_metrics,
    event_record,
    model_mismatch,
    parse_request,
    refusal_to_register,
)

MODEL = "/models/Qwen2.5-0.5B"
GOOD = ServerAnswers(None, 200, {"model_path": MODEL, "tokenizer_path": MODEL}, "0")


def test_engines_get_ids_in_join_order_and_a_restart_keeps_its_slot():
    table = Membership.launched(["http://a:1/", "http://b:2"])
    assert [(m.id, m.url, m.slot) for m in table.members.values()] == [("0", "http://a:1", 0), ("1", "http://b:2", 1)]
    joined = table.add("http://c:3", "registered")
    assert joined.id == "2" and joined.slot is None and table.by_url("http://c:3/") is joined
    table.drop("0")
    assert table.add("http://d:4", "launched", slot=2, state="starting").id == "3", "ids are never reused"
    assert [m.id for m in table.active] == ["1", "2"] and [m.id for m in table.starting] == ["3"]
    assert table.by_slot(2).id == "3"


def test_removing_an_unknown_id_names_the_engines_there_are():
    table = Membership.launched(["http://a:1"])
    with pytest.raises(ElasticError, match=r"no engine '7' in this run; its engines: 0 \(http://a:1\)"):
        table.get("7")


@pytest.mark.parametrize(
    "body, named",
    [
        ({"op": "grow"}, "unknown control operation 'grow'"),
        ([], "unknown control operation None"),
        ({"op": "add", "count": 0}, "N must be an integer from 1 to 64, got 0"),
        ({"op": "add", "count": 1000}, "got 1000"),
        ({"op": "add", "count": True}, "got True"),
        ({"op": "remove"}, "ID must be an engine id"),
        ({"op": "register", "url": "127.0.0.1:30000"}, "URL must be http://host:port"),
        ({"op": "register", "url": "http://h:1", "api_key": 5}, "the key must be a string"),
    ],
)
def test_a_malformed_request_is_one_line(body, named):
    with pytest.raises(ElasticError, match=named):
        parse_request(body)


def test_well_formed_requests_parse():
    assert parse_request({"op": "add", "count": 2}).count == 2
    assert parse_request({"op": "remove", "engine": "3"}).engine == "3"
    request = parse_request({"op": "register", "url": "http://h:1/", "api_key": ""})
    assert (request.url, request.api_key) == ("http://h:1", None)
    assert parse_request({"op": "list"}).op == "list"


def test_the_control_token_must_match_exactly():
    assert authorized("Bearer s3cret", "s3cret")
    assert not authorized("Bearer s3cre", "s3cret")
    assert not authorized("s3cret", "s3cret")
    assert not authorized(None, "s3cret")
    assert not authorized("Bearer ", "s3cret")


@pytest.mark.parametrize(
    "answers, named",
    [
        (ServerAnswers("ConnectError: refused"), "does not answer as an SGLang server (ConnectError: refused)"),
        (ServerAnswers(None, 401), "refused the API key (401 Unauthorized)"),
        (ServerAnswers(None, 404), "answered HTTP 404 to /get_model_info; it is not an SGLang 0.5.6 server"),
        (ServerAnswers(None, 200, {"model_path": "/models/Llama-3-8B"}), "serves model '/models/Llama-3-8B', not"),
    ],
)
def test_a_server_that_cannot_join_is_refused_in_one_line(answers, named):
    refusal = refusal_to_register("http://h:1", answers, expected_model=MODEL, membership=Membership())
    assert refusal is not None and "\n" not in refusal
    assert refusal.startswith("http://h:1 ")
    assert named in refusal, refusal


def test_an_engine_of_this_run_or_of_another_is_refused_before_it_is_asked_anything():
    table = Membership.launched(["http://h:1"])
    dead = ServerAnswers("unreachable")
    assert refusal_to_register("http://h:1/", dead, expected_model=MODEL, membership=table) == (
        "http://h:1 is already engine 0 of this run"
    )
    other = refusal_to_register("http://h:2", GOOD, expected_model=MODEL, membership=table, claimed_by="/runs/b")
    assert other == "http://h:2 belongs to another run (/runs/b); remove it there first"
    assert refusal_to_register("http://h:2", GOOD, expected_model=MODEL, membership=table) is None


def test_the_model_is_the_launch_path_a_hub_id_or_this_runs_own_weights():
    assert model_mismatch(MODEL, {"tokenizer_path": MODEL, "model_path": "/elsewhere/weights/v3"}) is None
    assert model_mismatch("Qwen/Qwen2.5-0.5B", {"model_path": MODEL}) is None, "hub id vs its downloaded folder"
    assert model_mismatch("/a/model", {"model_path": "/b/model"}) is not None, "two local folders: same path only"
    own = {"model_path": "/runs/r/weights/v5", "tokenizer_path": None}
    assert model_mismatch(MODEL, own, weights_dir="/runs/r/weights") is None
    assert model_mismatch(MODEL, own, weights_dir="/runs/other/weights") is not None


def test_the_no_engine_clock_starts_at_the_last_leave_and_stops_at_a_join():
    clock = NoEngineClock(timeout_s=30)
    assert not clock.update(2, now=0) and not clock.expired(100)
    assert clock.update(0, now=10), "the moment the last engine left is reported once"
    assert not clock.update(0, now=20) and not clock.expired(40) and clock.expired(41)
    assert not clock.update(1, now=41) and not clock.expired(1000), "an engine joined: the wait is over"
    assert "engines.no_engine_timeout_s" in clock.message()


def test_an_event_line_has_exactly_the_contract_fields():
    table = Membership.launched(["http://h:1"])
    moves = SampleMoves(samples=4, tokens_regenerated=1, samples_unanswered=2)
    record = event_record(time=1.5, step=3, event="move", member=table.get("0"), engines_active=2, moves=moves)
    assert tuple(record) == EVENT_FIELDS
    assert record == {
        "time": 1.5,
        "step": 3,
        "event": "move",
        "engine": "0",
        "url": "http://h:1",
        "samples_moved": 4,
        "tokens_regenerated": 1,
        "samples_unanswered": 2,
        "engines_active": 2,
        "source": "launched",
    }
    leave = event_record(time=1, step=1, event="leave", member=table.get("0"), engines_active=1)
    assert (leave["samples_moved"], leave["tokens_regenerated"], leave["samples_unanswered"]) == (0, 0, 0)
    with pytest.raises(ValueError, match="move lines only"):
        event_record(time=1, step=1, event="leave", member=table.get("0"), engines_active=1, moves=moves)
    with pytest.raises(ValueError, match="unknown engine event"):
        event_record(time=1, step=1, event="crash", member=table.get("0"), engines_active=1)  # type: ignore[arg-type]
    metrics = event_metrics({"join": 2, "leave": 1, "samples_moved": 9, "samples_unanswered": 2}, engines_active=3)
    assert metrics == {
        "engines/active": 3.0,
        "engines/joined": 2.0,
        "engines/left": 1.0,
        "engines/samples_moved": 9.0,
        "engines/tokens_regenerated": 0.0,
        "engines/samples_unanswered": 2.0,
    }
