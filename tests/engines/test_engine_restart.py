"""Engine failures under `engines.on_engine_failure`: restart, drop or stop, provoked with real SIGKILLs.

Real components throughout: embedded engine processes on 127.0.0.1 (`EngineLauncher`), the `EngineSupervisor`,
the `EngineClient`, `ParamSync` with the disk transport and, at the end, the whole CLI run. The only stand-ins
are two engine commands that never become healthy (a process that sleeps, one that exits at once), to provoke a
hung and a crash-looping restart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from engine_helpers import (
    TEST_ONLY_ROUTES,
    decode_hold,
    engine_command,
    max_abs_diff,
    reference_logprobs,
    restarted,
)
from lora_helpers import LORA, write_adapter
from run_helpers import addition_run_command, leftover_processes

from rllm.experimental.fully_async.engines import EmbeddedEngineCommand, EngineLauncher, EngineProcess
from rllm.experimental.fully_async.engines.client import EngineClient
from rllm.experimental.fully_async.engines.pool import EnginePool
from rllm.experimental.fully_async.engines.supervisor import (
    EngineDiedError,
    EngineLost,
    EngineReplaced,
    EngineSupervisor,
    decide_on_engine_death,
)
from rllm.experimental.fully_async.runtime.sync.param_sync import DiskTransport, ParamSync, SyncError

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_torch_thread")]

REPO = Path(__file__).resolve().parents[2]


def kill(proc: EngineProcess) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.process.wait(timeout=10)


def poll_until(supervisor: EngineSupervisor, done: Callable[[list], bool], timeout_s: float = 90.0) -> list:
    """Call poll() as the driver does between steps until `done(events so far)`."""
    events: list = []
    deadline = time.monotonic() + timeout_s
    while not done(events):
        if time.monotonic() > deadline:
            raise TimeoutError(f"supervisor events after {timeout_s:g}s: {events}")
        events += supervisor.poll()
        time.sleep(0.1)
    return events


@dataclass(frozen=True)
class NeverHealthy:
    """An engine command whose process never answers /health: it sleeps, or exits at once with code 3."""

    exits: bool

    def build(self, host: str, port: int, index: int) -> list[str]:
        code = "raise SystemExit(3)" if self.exits else "import time; time.sleep(600)"
        return [sys.executable, "-c", code]

    def env(self, index: int) -> dict[str, str]:
        return {}


@pytest.fixture
def engine_cmd(models) -> EmbeddedEngineCommand:
    return EmbeddedEngineCommand(
        str(models["a"][0]), max_running_requests=16, num_threads=1, extra_args=TEST_ONLY_ROUTES
    )


# --- the policy ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "used", "budget", "action"),
    [
        ("restart", 0, 3, "restart"),
        ("restart", 2, 3, "restart"),
        ("restart", 3, 3, "drop"),
        ("restart", 0, 0, "drop"),
        ("continue", 0, 3, "drop"),
        ("stop", 0, 3, "stop"),
    ],
)
def test_a_dead_engine_is_restarted_within_the_budget_else_dropped_or_the_run_stopped(policy, used, budget, action):
    assert decide_on_engine_death(policy, used, budget) == action


# --- the supervisor over real engine processes ---------------------------------------------------------------------


def test_a_killed_engine_is_restarted_on_a_new_port_and_reported_once_healthy(engine_cmd, tmp_path):
    with EngineLauncher(engine_cmd, 1, log_dir=tmp_path) as launcher:
        supervisor = EngineSupervisor(launcher, "restart", max_restarts=3)
        assert supervisor.poll() == []
        old = launcher.processes[0]
        kill(old)
        events = poll_until(supervisor, lambda ev: ev != [])
        assert len(events) == 1 and isinstance(events[0], EngineReplaced)
        replaced = events[0]
        assert replaced.index == 0 and replaced.old_url == old.url
        assert replaced.new_url == launcher.processes[0].url != old.url
        assert httpx.get(f"{replaced.new_url}/health", timeout=5).status_code == 200
        assert supervisor.metrics() == {
            "engines/alive": 1.0,
            "engines/starting": 0.0,
            "engines/lost": 0.0,
            "engines/restarts": 1.0,
        }
        assert supervisor.poll() == [], "a replacement is reported once"


@pytest.mark.slow  # engines killed past their restart budget (~15 s on a busy 2-core machine)
def test_past_the_restart_budget_an_engine_is_lost_and_losing_all_stops_the_run(engine_cmd, tmp_path):
    with EngineLauncher(engine_cmd, 2, log_dir=tmp_path) as launcher:
        supervisor = EngineSupervisor(launcher, "restart", max_restarts=0)
        first, second = launcher.processes
        kill(first)
        (lost,) = supervisor.poll()
        assert isinstance(lost, EngineLost) and lost.url == first.url
        assert "exited with code -9" in lost.reason and "restart budget of 0 used up" in lost.reason
        assert supervisor.metrics()["engines/alive"] == 1.0 and supervisor.restarts == 0
        kill(second)
        with pytest.raises(EngineDiedError, match="every inference engine is gone") as err:
            supervisor.poll()
    # The error names every engine, also the one lost at an earlier poll.
    assert first.url in str(err.value) and second.url in str(err.value)


def test_on_engine_failure_stop_raises_naming_the_engine_and_how_it_died(engine_cmd, tmp_path):
    with EngineLauncher(engine_cmd, 1, log_dir=tmp_path) as launcher:
        supervisor = EngineSupervisor(launcher, "stop")
        victim = launcher.processes[0]
        kill(victim)
        with pytest.raises(EngineDiedError) as err:
            supervisor.poll()
    message = str(err.value)
    assert victim.url in message and f"pid {victim.pid} exited with code -9" in message
    assert "on_engine_failure=stop" in message and "\n" not in message


@pytest.mark.parametrize("exits", [True, False], ids=["crash-loop", "hung-start"])
def test_a_restart_that_never_gets_healthy_uses_up_the_budget_and_leaves_no_process(engine_cmd, tmp_path, exits):
    with EngineLauncher(engine_cmd, 1, log_dir=tmp_path) as launcher:
        supervisor = EngineSupervisor(launcher, "restart", max_restarts=2, startup_timeout_s=1.0)
        launcher.command = NeverHealthy(exits=exits)  # every restart from now on fails
        kill(launcher.processes[0])
        with pytest.raises(EngineDiedError) as err:
            poll_until(supervisor, lambda ev: False, timeout_s=30)
        last = launcher.processes[0]
        assert supervisor.restarts == 2
        assert ("restart failed" if exits else "not healthy within 1s") in str(err.value)
        assert not last.alive(), "the failed replacement was killed (hung) or exited (crash loop)"


# --- the client and ParamSync take the replacement in --------------------------------------------------------------


@pytest.mark.slow  # an engine killed mid-request and restarted (~20 s on a busy 2-core machine)
def test_a_request_on_the_only_engine_waits_for_its_restart_and_finishes_there(engine_cmd, tmp_path):
    max_new = 200
    with EngineLauncher(engine_cmd, 1, log_dir=tmp_path) as launcher:
        old = launcher.processes[0]

        async def scenario():
            async with EngineClient(launcher.urls, wait_for_engine_s=90, backoff_base_s=0.01) as client:
                async with decode_hold(old.url, min_tokens=1) as hold:  # the kill meets the request decoding
                    request = asyncio.create_task(
                        client.generate([4, 5], {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 1.0})
                    )
                    await hold.reached()
                    kill(old)
                new = await asyncio.to_thread(restarted, launcher, 0)
                assert not request.done(), "with no engine alive the request waits instead of failing"
                client.replace_engine(old.url, new.url)
                return await asyncio.wait_for(request, timeout=90), new

        result, new = asyncio.run(scenario())
    assert len(result.output_ids) == max_new and result.finish_reason == "length"
    assert result.num_retries >= 1 and new.url != old.url


@pytest.mark.slow  # two engine restarts and syncs (~17 s on a busy 2-core machine)
def test_a_restarted_engine_gets_the_last_synced_weights_and_every_later_sync(engine_cmd, models, tmp_path):
    def writer(name: str) -> Callable[[str], None]:
        return lambda path: shutil.copytree(models[name][0], path, dirs_exist_ok=True)

    with (
        EngineLauncher(engine_cmd, 2, log_dir=tmp_path / "logs") as launcher,
        ParamSync(launcher.urls, DiskTransport(tmp_path / "weights"), pause_timeout_s=5) as sync,
    ):
        sync.sync(writer("b"), new_version=1)
        victim, survivor = launcher.processes
        kill(victim)
        with pytest.raises(SyncError) as err:  # the trainer drops unreachable engines from syncs on this error
            sync.sync(writer("b"), new_version=2)
        assert err.value.unreachable == [victim.url] and err.value.updated == [survivor.url]
        sync.remove_engine(victim.url)

        new = restarted(launcher, 0)  # serves model A, version 0, as launched
        assert sync.replace_engine(victim.url, new.url) == 2
        assert set(sync.engine_urls) == {new.url, survivor.url}

        async def on_new_engine():
            async with EngineClient([new.url]) as client:
                version = await client.get_weight_version(new.url)
                result = await client.generate([4, 5], {"max_new_tokens": 8, "ignore_eos": True})
                return version, result

        version, result = asyncio.run(on_new_engine())
        assert version == "2" and result.versions == [2] * 8
        assert max_abs_diff(result.logprobs, reference_logprobs(models["b"][1], [4, 5], result.output_ids)) < 1e-4

        sync.sync(writer("a"), new_version=3)
        assert sync.engine_versions == {new.url: 3, survivor.url: 3}


@pytest.mark.slow  # an engine killed under LoRA mid-request, restarted, four adapter syncs (~30 s on a busy machine)
def test_under_lora_a_restarted_engine_serves_the_kept_adapters_and_requests_keep_theirs(models, tmp_path):
    """docs/design.md#rule-one-version-per-lora-sample across a restart. ParamSync has loaded policy-v2 while the
    rollout client still names policy-v1 (the version bump has not reached it yet) and holds a policy-v0 request on
    the engine that dies. The restarted engine gets the versions the bound keeps (lora_keep = 2: policy-v1 and the
    newest, policy-v2), read back from it; the cut request finishes on the survivor under policy-v0; requests naming
    policy-v0 go to the survivor only (the restarted engine would refuse them: "never been loaded"); new ones name
    the client's version, then the newest once it hears of it, and run on the restarted engine too."""
    base = models["a"][0]
    folders = [write_adapter(base, tmp_path / f"adapter{v}", seed=v + 1) for v in range(4)]
    long = {"temperature": 1.0, "max_new_tokens": 60, "ignore_eos": True}
    short = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}

    def copying(version: int) -> Callable[[str], None]:
        return lambda path: shutil.copytree(folders[version], path, dirs_exist_ok=True) and None

    def finished(url: str) -> int:
        return httpx.get(f"{url}/get_server_info", timeout=30).json()["engine_stats"]["requests_finished"]

    with (
        EngineLauncher(engine_command("embedded", base, lora=LORA), 2, log_dir=tmp_path / "logs") as launcher,
        ParamSync(launcher.urls, DiskTransport(tmp_path / "weights", keep=3), lora_keep=2, pause_timeout_s=5) as sync,
    ):
        victim, survivor = launcher.processes

        async def pair(client: EngineClient, url: str, **kwargs: object) -> tuple[list, int]:
            """Two requests at once (least-loaded routing sends one to each engine that may take them), and how
            many of them the engine at `url` ran."""
            before = await asyncio.to_thread(finished, url)
            results = await asyncio.gather(*(client.generate([5, i], short, **kwargs) for i in range(2)))
            return [(r.lora_path, r.versions) for r in results], await asyncio.to_thread(finished, url) - before

        async def scenario() -> dict:
            async with EngineClient(launcher.urls, lora_keep=2, wait_for_engine_s=90, backoff_base_s=0.01) as client:
                for version in (0, 1, 2):
                    await asyncio.to_thread(sync.sync, copying(version), version)
                    client.use_policy_version(min(version, 1))  # the rollout side has not heard of 2 yet
                # Only the victim's adapters are known yet, so a request naming policy-v0 goes there; the kill meets
                # it decoding, and it finishes on the survivor, still on policy-v0.
                await client.lora_adapters(victim.url)
                async with decode_hold(victim.url, min_tokens=1) as hold:
                    cut = asyncio.ensure_future(client.generate([3, 4], long, lora_path="policy-v0"))
                    await hold.reached()
                    kill(victim)
                cut = await asyncio.wait_for(cut, 90)
                new = await asyncio.to_thread(restarted, launcher, 0)
                joined_at = await asyncio.to_thread(sync.replace_engine, victim.url, new.url)
                client.replace_engine(victim.url, new.url)
                known = await client.read_lora_adapters()  # what the rollout service does on a restart
                out = {"cut": cut, "new": new.url, "joined_at": joined_at, "known": known}
                out["older"] = await pair(client, new.url, lora_path="policy-v0")
                out["current"] = await pair(client, new.url)
                client.use_policy_version(2)
                out["newest"] = await pair(client, new.url)
                await asyncio.to_thread(sync.sync, copying(3), 3)
                client.use_policy_version(3)
                out["after_sync"] = await pair(client, new.url)
                return out

        seen = asyncio.run(scenario())
        versions_after = dict(sync.engine_versions)
    cut, new_url = seen["cut"], seen["new"]
    assert cut.lora_path == "policy-v0" and cut.versions == [0] * 60 and cut.num_retries >= 1
    assert seen["joined_at"] == 2 and seen["known"][new_url] == {"policy-v1", "policy-v2"}  # read back from it
    assert {"policy-v0", "policy-v1", "policy-v2"} <= seen["known"][survivor.url]
    assert seen["older"] == ([("policy-v0", [0] * 8)] * 2, 0), "policy-v0 requests ran on the survivor only"
    assert seen["current"] == ([("policy-v1", [1] * 8)] * 2, 1)
    assert seen["newest"] == ([("policy-v2", [2] * 8)] * 2, 1)
    assert seen["after_sync"] == ([("policy-v3", [3] * 8)] * 2, 1)
    assert versions_after == {new_url: 3, survivor.url: 3}


# --- the whole run -------------------------------------------------------------------------------------------------


def _engine_children(driver_pid: int) -> list:
    import psutil

    children = psutil.Process(driver_pid).children(recursive=True)
    return [p for p in children if "engines.embedded.server" in " ".join(p.cmdline())]


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_for(what: str, check: Callable[[], object], proc: subprocess.Popen, log: Path, timeout_s: float = 180):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if proc.poll() is not None or time.monotonic() > deadline:
            state = "exited" if proc.poll() is not None else "timed out"
            pytest.fail(f"run {state} waiting for {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return value


@pytest.mark.slow
def test_training_goes_on_after_an_engine_is_killed_and_its_restart_serves_the_current_weights(
    addition_cache, tmp_path
):
    run_dir, log = tmp_path / "run", tmp_path / "output.log"
    command = addition_run_command(
        run_dir,
        addition_cache,
        "task.val_size=16",
        "trainer.val_before_train=false",
        "trainer.total_training_steps=100000",  # ended by SIGINT once the restart is proven
        "trainer.test_freq=0",
        "trainer.save_freq=0",
        "data.train_batch_size=8",
        "async_training.required_samples=8",
        "async_training.max_staleness=1",
        "actor_rollout_ref.rollout.n=4",
        "engines.num_engines=2",
        "engines.on_engine_failure=restart",
    )
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for("step 3", lambda: len(_rows(run_dir)) >= 3, proc, log)
        victim = sorted(_engine_children(proc.pid), key=lambda p: p.pid)[0]
        victim.kill()
        pattern = re.compile(r"engine (\d) restarted at (http://127\.0\.0\.1:\d+) \(weight version (\d+)\)")
        match = _wait_for("the restart", lambda: pattern.search(log.read_text()), proc, log)
        new_url, joined_at = match.group(2), int(match.group(3))

        def served_and_synced() -> bool:
            stats = httpx.get(f"{new_url}/get_server_info", timeout=10).json()["engine_stats"]
            version = int(httpx.get(f"{new_url}/get_weight_version", timeout=10).json()["weight_version"])
            return stats["requests_finished"] > 0 and version > joined_at

        # The restarted engine serves rollouts and takes the syncs after the one it joined at.
        _wait_for("rollouts and a sync on the restarted engine", served_and_synced, proc, log)
        steps_at_restart = len(_rows(run_dir))
        _wait_for("two more steps", lambda: len(_rows(run_dir)) >= steps_at_restart + 2, proc, log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    output = log.read_text()
    assert proc.returncode == 130, output[-3000:]  # interrupted: checkpoint, then a clean stop

    rows = _rows(run_dir)
    last = rows[-1]
    assert last["engines/restarts"] == 1.0 and last["engines/alive"] == 2.0 and last["engines/lost"] == 0.0
    assert all(r["trainer/step"] == i + 1 for i, r in enumerate(rows)), "every step trained, none skipped"
    assert last["ledger/failed"] == 0, "the killed engine's requests were re-sent, not failed"
    ended = sum(last[f"ledger/{k}"] for k in ("in_flight", "trained", "filtered", "dropped_stale", "failed"))
    assert last["ledger/issued"] == ended
    assert leftover_processes(proc.pid, str(addition_cache)) == []


def test_an_outage_is_reported_once_however_many_requests_wait(caplog):
    """Requests finding no live engine wait for a restart; the outage is one warning, not one per request (with
    hundreds in flight, or engines stopped under them by Ctrl-C, per-request lines buried the log), and a later
    outage, after an engine came back, is reported again."""

    async def outage(pool: EnginePool) -> None:
        waiters = [asyncio.create_task(pool.pick(set())) for _ in range(20)]
        await asyncio.sleep(0.05)
        pool.replace_engine(pool.urls[0], "http://127.0.0.1:9")  # a restarted engine: every waiter goes on
        picked = await asyncio.gather(*waiters)
        assert {engine.url for engine in picked} == {"http://127.0.0.1:9"}

    async def main() -> None:
        pool = EnginePool(["http://127.0.0.1:8"], wait_for_engine_s=30)
        pool.engine("http://127.0.0.1:8").dead = True
        await outage(pool)
        pool.engine("http://127.0.0.1:9").dead = True
        await outage(pool)

    with caplog.at_level(logging.WARNING, logger="rllm.experimental.fully_async.engines.pool"):
        asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if "no live inference engine" in r.getMessage()]
    assert len(warnings) == 2, warnings
