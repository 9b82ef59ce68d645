"""Environments: the number-line built-in, user environments by path, and isolation of hung or crashing steps."""

from __future__ import annotations

import asyncio
import time

import pytest

from rllm.experimental.fully_async.envs import EnvError, EnvSpec, IsolatedEnv, NumberLineEnv, state_hash
from rllm.experimental.fully_async.envs.number_line import parse_action
from rllm.experimental.fully_async.workers import WorkerPool

USER_ENV = '''
import os, time

class Flaky:
    """Counts steps; the action "hang" never returns, "crash" kills the process, "boom" raises."""

    def __init__(self, limit=3):
        self.limit = limit
        self.count = 0

    def reset(self, seed, task):
        self.count = 0
        return f"count {self.count}"

    def step(self, action):
        if action == "hang":
            while True:
                time.sleep(1)
        if action == "crash":
            os._exit(3)
        if action == "boom":
            raise RuntimeError("boom")
        self.count += 1
        return f"count {self.count}", float(self.count == self.limit), self.count >= self.limit, {}
'''


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(max_workers=1, kill_grace_s=10.0) as p:
        yield p


def test_number_line_reaches_target_with_reward_one_and_clips_at_the_ends():
    env = NumberLineEnv(size=10, max_step=3)
    assert env.reset(0, {"start": 2, "target": 7}) == "2>7:"
    assert env.step("+3") == ("5>7:", 0.0, False, {"invalid": False, "position": 5})
    obs, reward, done, info = env.step("+2")
    assert (obs, reward, done) == ("7>7:", 1.0, True)
    env.reset(0, {"start": 1, "target": 5})
    assert env.step("-3")[0] == "0>5:"  # clipped at 0
    obs, reward, done, info = env.step("+7")  # magnitude above max_step: invalid, position unchanged
    assert (obs, reward, done, info["invalid"]) == ("0>5:", 0.0, False, True)


def test_parse_action_accepts_only_signed_steps_within_range():
    assert parse_action("+1", 3) == 1 and parse_action(" -3 ", 3) == -3
    assert parse_action("3", 3) is None and parse_action("+0", 3) is None and parse_action("+4", 3) is None
    assert parse_action("+1+1", 3) is None


def test_spec_refuses_unknown_names_and_keys():
    with pytest.raises(ValueError, match="unknown environment 'grid'"):
        EnvSpec(name="grid")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['max_steps'\]"):
        EnvSpec.from_config({"name": "number_line", "max_steps": 3})
    spec = EnvSpec.from_config({"name": "number_line", "kwargs": {"size": 8}, "max_turns": 4})
    assert spec.reference.endswith("number_line:NumberLineEnv") and spec.kwargs == {"size": 8}


def test_builtin_env_runs_in_the_pool_and_identical_states_hash_equal(pool):
    async def episode(actions):
        env = IsolatedEnv(EnvSpec(name="number_line"), pool)
        hashes = [(await env.reset(0, {"start": 4, "target": 6}))[1]]
        for action in actions:
            hashes.append((await env.step(action))[4])
        return hashes

    a = asyncio.run(episode(["+1", "+1"]))
    b = asyncio.run(episode(["+2"]))
    assert a[0] == b[0] == state_hash("4>6:")
    assert a[2] == b[1] == state_hash("6>6:")
    assert a[1] not in (b[0], b[1])


def test_user_env_by_path_and_hung_step_is_killed_by_its_timeout(pool, tmp_path):
    path = tmp_path / "flaky_env.py"
    path.write_text(USER_ENV)
    spec = EnvSpec(name="Flaky", path=str(path), kwargs={"limit": 2}, step_timeout_s=1.0)

    async def scenario():
        env = IsolatedEnv(spec, pool)
        assert (await env.reset(0, {}))[0] == "count 0"
        assert (await env.step("go"))[:3] == ("count 1", 0.0, False)
        start = time.monotonic()
        with pytest.raises(EnvError) as info:
            await env.step("hang")
        assert info.value.kind == "timeout" and "within 1s" in info.value.reason
        assert time.monotonic() - start < 6.0
        # The state before the hung step survived in the parent; a fresh worker continues from it.
        assert (await env.step("go"))[:3] == ("count 2", 1.0, True)

    asyncio.run(scenario())


def test_crash_and_exception_in_a_step_are_env_errors(pool, tmp_path):
    path = tmp_path / "flaky_env2.py"
    path.write_text(USER_ENV)
    spec = EnvSpec(name="Flaky", path=str(path), step_timeout_s=20.0)

    async def scenario():
        env = IsolatedEnv(spec, pool)
        await env.reset(0, {})
        with pytest.raises(EnvError) as crash:
            await env.step("crash")
        assert crash.value.kind == "env_error" and "exit code 3" in crash.value.reason
        with pytest.raises(EnvError) as boom:
            await env.step("boom")
        assert boom.value.kind == "env_error" and "RuntimeError: boom" in boom.value.reason

    asyncio.run(scenario())
