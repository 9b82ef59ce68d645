"""End to end: engines join and leave a running CLI run (docs/design.md#rule-engine-set-can-change).

One real run (the addition task, Ray, the patched verl actor) starts with 1 embedded engine; through the
`engines` command's client, the test adds 2, removes the first (its in-flight samples move to the others), SIGKILLs
one (the supervisor restarts it), and registers two servers launched outside the run by URL with their API key:
an embedded engine and the SGLang 0.5.6 stand-in; the registered embedded one is stopped (the run's health checks
find it lost); then every engine leaves (generation waits) and one is added.
Each step waits for the run's own record of it (RUN_DIR/engine_events.jsonl), never for a clock. Then the run is
stopped with SIGTERM (a checkpoint, every process ended) and checked: the event lines carry exactly the contract's
fields, the ledger journal audits clean (no sample issued or ended twice, nothing lost: issued = in flight + ended,
none failed), and the engines/* metrics counted the joins and leaves. That a moved sample continues from exactly its
saved tokens is held on real engines in tests/engines/test_engine_membership.py, where the decode hold can catch
requests decoding. A second, shorter run loses its only engine (SIGKILL, no restart left): generation waits for one to
join instead of the run ending; SIGTERM then, while the trainer waits for a batch, checkpoints its last step and ends
the run in seconds.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from omegaconf import OmegaConf
from run_helpers import addition_run_command, leftover_processes
from sglang_standin import standin_command

from rllm.experimental.fully_async.cli.engines import send
from rllm.experimental.fully_async.core.elastic import CONTROL_FILE, EVENT_FIELDS, EVENTS_FILE
from rllm.experimental.fully_async.core.ledger_format import history_counts
from rllm.experimental.fully_async.engines import EmbeddedEngineCommand, EngineLauncher
from rllm.experimental.fully_async.runtime.rollout.ledger_journal import read_journal

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ONE_ENGINE_RUN = (  # both runs: one engine, small batches, ended by the test (SIGTERM)
    "engines.num_engines=1",
    "trainer.total_training_steps=2000",
    "trainer.val_before_train=false",
    "trainer.test_freq=0",
    "task.val_size=8",
    "data.train_batch_size=16",
    "async_training.required_samples=16",
    "actor_rollout_ref.rollout.n=4",
)
KEY = "outside-key"
WAIT_S = 300.0


def wait_for(what: str, done, proc: subprocess.Popen, timeout_s: float = WAIT_S):
    """Until `done()` is truthy: a state the run writes and keeps (a file, an event line), so a slow machine only
    waits longer. Fails at once, with the run's output, if the run exited."""
    deadline = time.monotonic() + timeout_s
    while not (result := done()):
        if proc.poll() is not None:
            pytest.fail(f"the run exited ({proc.returncode}) while waiting for {what}:\n{proc.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout_s:g}s")
        time.sleep(0.2)
    return result


def events(run_dir: Path) -> list[dict]:
    path = run_dir / EVENTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def has_event(run_dir: Path, event: str, engine: str):
    return lambda: next((e for e in events(run_dir) if e["event"] == event and e["engine"] == engine), None)


def two_more_steps(run_dir: Path, proc: subprocess.Popen) -> None:
    lines = lambda: len((run_dir / "metrics.jsonl").read_text().splitlines())  # noqa: E731
    then = lines()
    wait_for("two more steps", lambda: lines() >= then + 2, proc)


def engine_pid(url: str) -> int:
    port = url.rsplit(":", 1)[1]
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "rllm.experimental.fully_async.engines.embedded.server" in cmd and port in cmd:
            return int(proc.info["pid"])
    raise AssertionError(f"no engine process listens on {url}")


@pytest.fixture(scope="module")
def elastic_run(tmp_path_factory, addition_cache):
    root = tmp_path_factory.mktemp("elastic")
    run_dir = root / "run"
    command = addition_run_command(
        run_dir,
        addition_cache,
        *ONE_ENGINE_RUN,
        # Long generations decoded two at a time: requests are in flight whenever the test acts.
        "actor_rollout_ref.rollout.ignore_eos=true",
        "data.max_response_length=32",
        "engines.max_running_requests=2",
        "engines.no_engine_timeout_s=120",
    )
    env = dict(os.environ, RLLM_LOG_LEVEL="WARNING")
    proc = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outside: list[EngineLauncher] = []
    answers: dict[str, dict] = {}
    try:
        wait_for("control file", lambda: (run_dir / CONTROL_FILE).exists(), proc)
        model = str(OmegaConf.load(run_dir / "config.yaml").actor_rollout_ref.model.path)
        # Two servers someone launched outside the run, serving its model, each with its own API key.
        for name, cmd in {
            "embedded": EmbeddedEngineCommand(model, num_threads=1, extra_args=("--api-key", KEY)),
            "standin": standin_command(model, api_key=KEY),
        }.items():
            launcher = EngineLauncher(cmd, 1, log_dir=root / f"outside-{name}")
            outside.append(launcher)
            launcher.start()

        answers["add"] = send(run_dir, {"op": "add", "count": 2})
        wait_for("engine 1 joining", has_event(run_dir, "join", "1"), proc)
        wait_for("engine 2 joining", has_event(run_dir, "join", "2"), proc)

        answers["remove"] = send(run_dir, {"op": "remove", "engine": "0"})  # the first engine, mid-generation
        assert has_event(run_dir, "leave", "0")(), "the answer comes once it has left"

        victim = next(e for e in send(run_dir, {"op": "list"})["engines"] if e["id"] == "1")
        os.kill(engine_pid(victim["url"]), signal.SIGKILL)
        wait_for("engine 1's restart", has_event(run_dir, "restart", "1"), proc)

        for launcher in outside:
            answers[f"register {launcher.urls[0]}"] = send(
                run_dir, {"op": "register", "url": launcher.urls[0], "api_key": KEY}
            )
        answers["list"] = send(run_dir, {"op": "list"})
        two_more_steps(run_dir, proc)  # the run trains on with its new set

        # The registered embedded server dies: no process of the run to watch, so its failed health checks say so.
        outside[0].stop()
        wait_for("engine 3 lost", has_event(run_dir, "lost", "3"), proc)

        # Every engine leaves: generation waits (engines.no_engine_timeout_s) instead of the run ending, and goes on
        # once one joins.
        for engine in ("1", "2", "4"):
            send(run_dir, {"op": "remove", "engine": engine})
        answers["empty"] = send(run_dir, {"op": "list"})
        send(run_dir, {"op": "add", "count": 1})
        wait_for("engine 5 joining", has_event(run_dir, "join", "5"), proc)
        two_more_steps(run_dir, proc)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for launcher in outside:
            launcher.stop()
    return proc, output, run_dir, answers, model


def test_each_change_is_answered_in_one_line_and_the_engines_are_the_new_set(elastic_run):
    proc, output, _, answers, _ = elastic_run
    assert proc.returncode == 130, output[-3000:]  # stopped by SIGTERM, after its checkpoint
    assert answers["add"]["message"].startswith("starting 2 engine(s): 1, 2")
    assert answers["remove"]["message"].startswith("engine 0 (")
    registered = [a for k, a in answers.items() if k.startswith("register")]
    assert [a["message"].split(" (")[0] for a in registered] == ["engine 3", "engine 4"]
    listing = answers["list"]["engines"]
    assert [(e["id"], e["source"], e["state"]) for e in listing] == [
        ("1", "launched", "active"),
        ("2", "launched", "active"),
        ("3", "registered", "active"),
        ("4", "registered", "active"),
    ]
    assert answers["empty"]["engines"] == []
    for line in (
        "engine 1 joined at",
        "engine 0 left (",
        "engine 1 restarted at",
        "engine 4 joined at",
        "engine 3 lost (",
        "no inference engine left: generation waits up to 120s (engines.no_engine_timeout_s)",
        "engine 5 joined at",
    ):
        assert line in output, line


def test_every_event_is_one_line_with_the_contract_fields_in_order(elastic_run):
    _, _, run_dir, _, _ = elastic_run
    lines = events(run_dir)
    assert all(tuple(e) == EVENT_FIELDS for e in lines), lines
    kinds = [(e["event"], e["engine"], e["engines_active"], e["source"]) for e in lines if e["event"] != "move"]
    # `engines add 2` launches both at once and each joins once it is healthy: either may be first.
    assert sorted(kinds[:2], key=lambda k: k[1]) in (
        [("join", "1", 2, "launched"), ("join", "2", 3, "launched")],
        [("join", "1", 3, "launched"), ("join", "2", 2, "launched")],
    ), kinds[:2]
    assert kinds[2:] == [
        ("leave", "0", 2, "launched"),
        ("restart", "1", 2, "launched"),
        ("join", "3", 3, "registered"),
        ("join", "4", 4, "registered"),
        ("lost", "3", 3, "registered"),
        ("leave", "1", 2, "launched"),
        ("leave", "2", 1, "launched"),
        ("leave", "4", 0, "registered"),
        ("join", "5", 1, "launched"),
    ]
    moves = [e for e in lines if e["event"] == "move"]
    assert all(e["samples_moved"] > 0 for e in moves) and all(
        e["samples_moved"] == e["tokens_regenerated"] == e["samples_unanswered"] == 0
        for e in lines
        if e["event"] != "move"
    )
    # What each move cost: an abort hands every token back (none to generate again); the calls on an engine that
    # died or stopped answering got no answer at all.
    for move, then in itertools.pairwise(lines):
        if move["event"] == "move":
            assert then["engine"] == move["engine"] and then["event"] in ("leave", "lost", "restart"), (move, then)
            assert move["tokens_regenerated"] == 0, move
            if then["event"] in ("lost", "restart"):
                assert move["samples_unanswered"] == move["samples_moved"], move
    assert [e["time"] for e in lines] == sorted(e["time"] for e in lines)


def test_the_ledger_is_exact_through_every_change(elastic_run):
    _, _, run_dir, _, _ = elastic_run
    history = read_journal(run_dir / "ledger.jsonl")  # raises on a sample issued or ended twice
    counts = history_counts(history)
    ended = sum(counts[k] for k in ("trained", "filtered", "dropped_stale", "failed"))
    assert counts["issued"] == counts["in_flight"] + ended > 0
    assert counts["failed"] == 0, "no sample failed for an engine leaving, dying or joining"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "engines/active" in r][-1]
    assert last["engines/active"] == 1 and last["engines/joined"] == 5 and last["engines/left"] == 4
    assert last["engines/samples_moved"] == sum(e["samples_moved"] for e in events(run_dir))
    # The staleness bound held through every change: no step trained a token older than η versions.
    trained = [r for r in rows if "staleness/max" in r]
    assert trained and all(r["staleness/max"] <= r["rollout/max_staleness"] for r in trained)
    assert last["engines/tokens_regenerated"] == 0


def test_nothing_is_left_running(elastic_run):
    proc, _, run_dir, _, model = elastic_run
    assert not (run_dir / CONTROL_FILE).exists()
    assert leftover_processes(proc.pid, model) == []


def test_losing_the_only_engine_pauses_generation_and_sigterm_then_checkpoints_the_step_at_once(
    tmp_path, addition_cache
):
    """The run's only engine is SIGKILLed with its restarts used up (`engines.max_restarts=0`): it is lost, and
    generation waits for an engine to join (engines.no_engine_timeout_s) instead of the run ending. The trainer then
    waits for a batch that cannot come; SIGTERM saves a checkpoint at the last step and ends the run in seconds.
    Before, the trainer's checkpoint call queued behind that wait: the run waited 300 s, then stopped with no new
    checkpoint. (Removing the last engine, rather than losing it, is the long run above.)"""
    run_dir = tmp_path / "run"
    command = addition_run_command(
        run_dir,
        addition_cache,
        *ONE_ENGINE_RUN,
        "data.max_response_length=16",
        "engines.no_engine_timeout_s=600",  # the run would wait this long for an engine; the test stops it first
        "engines.on_engine_failure=restart",
        "engines.max_restarts=0",
    )
    env = dict(os.environ, RLLM_LOG_LEVEL="WARNING")
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for("control file", lambda: (run_dir / CONTROL_FILE).exists(), proc)
        rows = lambda: [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
        wait_for("a first step", lambda: (run_dir / "metrics.jsonl").exists() and rows(), proc)
        (only,) = send(run_dir, {"op": "list"})["engines"]
        os.kill(engine_pid(only["url"]), signal.SIGKILL)
        wait_for("engine 0 lost", has_event(run_dir, "lost", "0"), proc)
        # Each control answer comes from one of the driver's watches (between its waits), so the second is answered
        # by a watch after the one that found the engine lost: that one has printed its no-engine line by then.
        for _ in range(2):
            assert send(run_dir, {"op": "list"})["engines"] == []
        assert proc.poll() is None, "losing the last engine does not end the run"

        # The engine is gone (its event is written once it is out): from now on no group can be made, so the
        # trainer either finishes a step on what is queued or waits for a batch that cannot come. SIGTERM in either
        # case must checkpoint the last step at once; before the fix the waiting case took 300 s and saved nothing.
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        output, _ = proc.communicate(timeout=240)
        stopped_s = time.monotonic() - started
        last_step = int([r for r in rows() if "trainer/step" in r][-1]["trainer/step"])  # a step may end meanwhile
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, output[-3000:]
    assert "restart budget of 0 used up" in output and "continuing with 0 engine(s)" in output, output[-3000:]
    assert "no inference engine left: generation waits up to 600s (engines.no_engine_timeout_s)" in output
    assert f"checkpoint at step {last_step} saved" in output, output[-3000:]
    assert stopped_s < 120, f"the run took {stopped_s:.0f}s to stop"
    assert (run_dir / "checkpoints" / f"step_{last_step:08d}").is_dir(), list((run_dir / "checkpoints").iterdir())
