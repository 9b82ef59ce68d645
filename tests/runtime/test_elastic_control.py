"""The engines control endpoint and its refusals, through the real CLI client and real HTTP
(runtime/run/elastic.py, cli/engines.py; docs/design.md#rule-engine-set-can-change).

Each bad input gets one line and leaves the run as it was: a URL that does not answer, a server with another
model, a wrong API key, an engine already in this run or claimed by another run, an unknown ID, a wrong or missing
control token, no run at the run dir. The requests go to a real `ControlServer`; a thread plays the driver's watch
(it takes each request as it is queued and applies it with the real `ElasticEngines.apply`). A refused request makes
no actor call, so none is started here; what joins and leaves for real is tests/e2e/test_elastic_engines.py.
An engine `engines add` starts that exits or never gets healthy makes none either: the real supervisor and launcher
report it, and the watch turns that into its line and its `lost` event.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import stat
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from rllm.experimental.fully_async.cli.engines import NoRunError, RefusedError, main, send
from rllm.experimental.fully_async.core.elastic import CONTROL_FILE, EVENTS_FILE
from rllm.experimental.fully_async.engines import EmbeddedEngineCommand, EngineLauncher
from rllm.experimental.fully_async.engines.supervisor import EngineDiedError, EngineSupervisor
from rllm.experimental.fully_async.runtime.run.elastic import ElasticContext, ElasticEngines

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]

KEY = "the-servers-key"


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir, tmp_path_factory):
    """An SGLang-API server someone launched elsewhere: the embedded engine with --api-key, serving the tiny model."""
    command = EmbeddedEngineCommand(str(tiny_model_dir), num_threads=1, extra_args=("--api-key", KEY))
    with EngineLauncher(command, 1, log_dir=tmp_path_factory.mktemp("logs")) as launcher:
        yield launcher.urls[0]


def actorless_context(
    run_dir: Path,
    model: str,
    supervisor: EngineSupervisor | None = None,
    *,
    no_engine_timeout_s: float = 60,
    step: int = 0,
    message: Callable[[str], None] = lambda line: None,
) -> ElasticContext:
    """The driver's context where nothing joins or leaves for real: no trainer or rollout actor is ever called."""
    return ElasticContext(
        run_dir=run_dir,
        supervisor=supervisor,
        trainer=None,
        rollouts=None,
        model_path=model,
        weights_dir=str(run_dir / "weights"),
        no_engine_timeout_s=no_engine_timeout_s,
        sync_timeout_s=60,
        step=lambda: step,
        message=message,
    )


class Driver:
    """A run's ElasticEngines whose requests a thread applies as they arrive (the driver's watch, for refusals)."""

    def __init__(self, run_dir: Path, model: str, launched: list[str]) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.elastic = ElasticEngines(actorless_context(run_dir, model), launched)
        self.elastic.start()
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        while True:
            body, answer = self.elastic.control.requests.get()
            if body is None:
                return
            answer.set_result(self.elastic.apply(body))

    def close(self) -> None:
        self.elastic.control.requests.put((None, None))
        self._thread.join(timeout=10)
        self.elastic.close()


@pytest.fixture
def driver(tmp_path, tiny_model_dir):
    run = Driver(tmp_path / "run", str(tiny_model_dir), ["http://127.0.0.1:1"])
    yield run
    run.close()


def test_the_control_file_names_a_loopback_url_and_is_readable_by_its_owner_only(driver, tmp_path):
    path = tmp_path / "run" / CONTROL_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    control = json.loads(path.read_text())
    assert control["url"].startswith("http://127.0.0.1:") and len(control["token"]) >= 32
    assert control["pid"] == os.getpid()
    listing = send(tmp_path / "run", {"op": "list"})
    assert listing["engines"] == [
        {"id": "0", "url": "http://127.0.0.1:1", "source": "launched", "state": "active", "slot": 0}
    ]
    driver.close()
    assert not path.exists(), "the run's end removes the control file"


@pytest.mark.parametrize("token", ["not-the-token", ""])
def test_a_wrong_or_missing_control_token_is_refused(driver, tmp_path, token):
    with pytest.raises(RefusedError, match="wrong or missing control token"):
        send(tmp_path / "run", {"op": "list"}, token=token)


def test_no_run_at_the_run_dir_is_one_line(tmp_path, capsys):
    with pytest.raises(NoRunError, match="the directory does not exist"):
        send(tmp_path / "nowhere", {"op": "list"})
    (tmp_path / "idle").mkdir()
    with pytest.raises(NoRunError, match=r"no control\.json"):
        send(tmp_path / "idle", {"op": "list"})
    (tmp_path / "idle" / CONTROL_FILE).write_text(json.dumps({"url": "http://127.0.0.1:1", "token": "t"}))
    with pytest.raises(NoRunError, match="no run answers at"):
        send(tmp_path / "idle", {"op": "list"})


def test_bad_requests_are_refused_in_one_line_and_the_run_is_unchanged(driver, tmp_path, keyed_server, capsys):
    run_dir = tmp_path / "run"
    before = send(run_dir, {"op": "list"})["engines"]
    refusals = {
        "unknown id": ({"op": "remove", "engine": "9"}, "no engine '9' in this run; its engines: 0"),
        "dead url": ({"op": "register", "url": "http://127.0.0.1:9"}, "does not answer as an SGLang server"),
        "in this run": ({"op": "register", "url": "http://127.0.0.1:1/"}, "is already engine 0 of this run"),
        "no key": ({"op": "register", "url": keyed_server}, "refused the API key (401 Unauthorized)"),
        "wrong key": ({"op": "register", "url": keyed_server, "api_key": "nope"}, "refused the API key"),
        "add zero": ({"op": "add", "count": 0}, "N must be an integer from 1 to 64"),
    }
    for what, (body, named) in refusals.items():
        with pytest.raises(RefusedError) as err:
            send(run_dir, body)
        assert named in str(err.value) and "\n" not in str(err.value), what
    assert send(run_dir, {"op": "list"})["engines"] == before, "every refusal left the run as it was"

    # Through the command line: the line on stderr, exit code 2 (__main__ prints a FullyAsyncError's line).
    with pytest.raises(RefusedError, match="no engine '9'"):
        main(["remove", "9", "--run-dir", str(run_dir)])


def test_a_server_with_another_model_is_refused(tmp_path, keyed_server):
    run = Driver(tmp_path / "run", "/models/some-other-model", [])
    try:
        with pytest.raises(RefusedError, match=r"serves model .* not this run's '/models/some-other-model'"):
            send(tmp_path / "run", {"op": "register", "url": keyed_server, "api_key": KEY})
    finally:
        run.close()


def test_an_engine_another_live_run_claims_is_refused_while_that_run_holds_it(tmp_path, tiny_model_dir, keyed_server):
    first = Driver(tmp_path / "first", str(tiny_model_dir), [keyed_server])  # claims it, as at its start
    second = Driver(tmp_path / "second", str(tiny_model_dir), [])
    try:
        with pytest.raises(RefusedError, match=f"belongs to another run \\({tmp_path / 'first'}\\)"):
            send(tmp_path / "second", {"op": "register", "url": keyed_server, "api_key": KEY})
        first.close()  # the first run ended: its claims go with it
        assert send(tmp_path / "second", {"op": "list"})["engines"] == []
    finally:
        first.close()
        second.close()


def test_the_command_line_prints_one_line_and_exits_2_refused_or_1_no_run(driver, tmp_path, capsys):
    from rllm.experimental.fully_async.__main__ import main as cli_main

    assert cli_main(["engines", "remove", "9", "--run-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: no engine '9' in this run; its engines: 0 (http://127.0.0.1:1) (see `engines list`)"
    ]
    assert cli_main(["engines", "list", "--run-dir", str(tmp_path / "nowhere")]) == 1
    assert capsys.readouterr().err.strip() == f"error: no run at {tmp_path / 'nowhere'}: the directory does not exist"
    assert cli_main(["engines", "list", "--run-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "1 engine(s) active, 0 starting" and out[2].split() == [
        "0",
        "active",
        "launched",
        "http://127.0.0.1:1",
    ]


# --- an engine `engines add` starts that never serves ------------------------------------------------------------


@dataclass(frozen=True)
class FirstOnly:
    """The run's engine command for slot 0; every slot added later runs a process that exits at once with code 3,
    or sleeps and never answers /health (the only stand-ins here: an engine launch that fails)."""

    first: EmbeddedEngineCommand
    exits: bool

    def build(self, host: str, port: int, index: int) -> list[str]:
        if index == 0:
            return self.first.build(host, port, index)
        return [sys.executable, "-c", "raise SystemExit(3)" if self.exits else "import time; time.sleep(600)"]

    def env(self, index: int) -> dict[str, str]:
        return self.first.env(index) if index == 0 else {}


@pytest.mark.parametrize("exits", [True, False], ids=["dies", "never-healthy"])
def test_an_added_engine_that_does_not_start_is_reported_lost_and_the_run_keeps_its_engines(
    tmp_path, tiny_model_dir, exits
):
    """`engines add 1` answers at once; the engine's start fails (it exits, or is not healthy within the
    supervisor's startup timeout). The driver's watch reports it in one line and one `lost` event, spends no restart
    and, even under `on_engine_failure=stop`, does not end the run: engine 0 stays the run's only engine."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    command = FirstOnly(EmbeddedEngineCommand(str(tiny_model_dir), num_threads=1), exits)
    with EngineLauncher(command, 1, log_dir=tmp_path / "logs") as launcher:
        supervisor = EngineSupervisor(launcher, "stop", startup_timeout_s=3.0, stop_when_all_lost=False)
        lines: list[str] = []
        # nothing is synced or routed: the engine never joins
        ctx = actorless_context(run_dir, str(tiny_model_dir), supervisor, step=7, message=lines.append)
        elastic = ElasticEngines(ctx, launcher.urls)
        elastic.start()
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                answer = pool.submit(send, run_dir, {"op": "add", "count": 1})
                deadline = time.monotonic() + 60
                while not (run_dir / EVENTS_FILE).exists():  # the driver's watch, as between steps
                    assert time.monotonic() < deadline, f"no event within 60s; lines {lines}"
                    elastic.watch()
                    time.sleep(0.1)
                added = answer.result(timeout=10)
            elastic.watch()  # the run goes on: nothing raises, engine 0 stays
            listing = send_applied(elastic, run_dir, {"op": "list"})
        finally:
            elastic.close()
        failed = launcher.processes[1]
        assert not failed.alive(), "the engine that did not start is not left running"

    assert added["message"].startswith("starting 1 engine(s): 1;")
    (event,) = [json.loads(line) for line in (run_dir / EVENTS_FILE).read_text().splitlines()]
    assert (event["event"], event["engine"], event["step"], event["samples_moved"], event["engines_active"]) == (
        "lost",
        "1",
        7,
        0,
        1,
    )
    (line,) = lines
    assert line.startswith(f"engine 1 ({failed.url}) could not join: ") and "\n" not in line
    assert ("start failed" if exits else "start not healthy within 3s") in line
    assert line.endswith("; continuing with 1 engine(s)")
    assert supervisor.restarts == 0 and supervisor.num_alive == 1
    assert [(e["id"], e["state"]) for e in listing["engines"]] == [("0", "active")]


def send_applied(elastic: ElasticEngines, run_dir: Path, body: dict) -> dict:
    """`send` from a thread while this one plays the driver's watch until the answer comes."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(send, run_dir, body)
        while not answer.done():
            elastic.watch()
            time.sleep(0.05)
        return answer.result()


def test_with_no_engine_left_the_watch_waits_then_stops_the_run_in_one_line_at_the_timeout(tmp_path, tiny_model_dir):
    """No engine left (the membership is empty; the supervisor has nothing to report): the watch says once that
    generation waits, keeps waiting while the clock is under `engines.no_engine_timeout_s`, and past it raises the
    one line the run stops with, naming the key (the driver then checkpoints and ends: RunFailedError)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    now = [100.0]
    lines: list[str] = []
    with EngineLauncher(EmbeddedEngineCommand(str(tiny_model_dir), num_threads=1), 1, log_dir=tmp_path / "logs") as la:
        supervisor = EngineSupervisor(la, "restart", stop_when_all_lost=False)
        ctx = actorless_context(
            run_dir, str(tiny_model_dir), supervisor, no_engine_timeout_s=30, step=4, message=lines.append
        )
        elastic = ElasticEngines(ctx, [], clock=lambda: now[0])
        try:
            elastic.watch()
            now[0] += 29.0
            elastic.watch()  # still within the timeout: the run waits
            assert lines == [
                "no inference engine left: generation waits up to 30s (engines.no_engine_timeout_s) for one to join "
                "(`engines add N` or `engines register URL`)"
            ]
            now[0] += 2.0
            with pytest.raises(EngineDiedError) as stopped:
                elastic.watch()
        finally:
            elastic.close()
    message = str(stopped.value)
    assert "\n" not in message and "engines.no_engine_timeout_s" in message and "30s" in message, message
