"""Benchmark (issue 34): an engine joins a running run, and one leaves with requests in flight.

    PYTHONPATH=. .venv/bin/python tests/bench/bench_elastic.py [--configs default default-long]
        [--steps-before 4] [--steps-after 6] [--poll-s 0.05] [--out DIR] [-- key=value ...]

One run per config (`default`: the embedded default, `python -m rllm.experimental.fully_async train`,
config/tiny_cpu.yaml; `default-long`: the same with long generations, so that requests are running when an engine
leaves), each with `engines.num_engines=1` and no validation (`trainer.test_freq=0 trainer.val_before_train=false`: it
does not change what the engines do). After `--steps-before` steps the script runs `engines add 1` against it (the CLI's
client, `cli/engines.py`) and watches the joiner from outside, every `--poll-s` seconds, through its `/get_server_info`
counters (`engine_stats`: `weight_updates`, `generated_tokens`); once the joiner has served `--steps-after` steps it
waits until engine 0 has requests running (its `num_running`) and runs `engines remove 0`, waits two more steps and
stops the run with SIGTERM (checkpoint, every process ended; `_runs.sweep` stops any leftover).

Printed side by side:
- add -> first generated token of the joiner: from the `add` command to the first poll that sees
  `generated_tokens > 0` on it (late by at most one poll), split into add -> healthy (the first poll its server
  answers: process start, imports, model), healthy -> weights loaded (`weight_updates` first >= 1: the driver
  noticing it between steps, then ParamSync's load), the `join` line of RUN_DIR/engine_events.jsonl (weights
  loaded, routing on) and the first token;
- the joiner's weight load as the run measured it (the driver's `engine N joined at ... loaded in X s` line: the
  trainer's `add_engine` call, load and version read-back);
- throughput before and after the join: trained samples/s (`batch/samples` over the steps' span, from
  metrics.jsonl's `time`) and the mean `rollout/tokens_per_s`, over the `--steps-before` steps before the add and
  the `--steps-after` steps after the joiner's first token (not the `join` line: the requests issued before the
  join wait on engine 0, so the joiner's first request is one issued after it);
- the leave: samples in flight that moved (the `move` line's `samples_moved`), the tokens their move made another
  engine generate again (`tokens_regenerated`: what engine 0 reported generating for the aborted pieces,
  `completion_tokens`, beyond what it handed back; 0 expected) and the moved samples whose call got no answer
  (`samples_unanswered`: cut off at the drain's timeout, their engine's tokens not known), and the ledger audit after
  the run (`read_journal`: no sample issued or ended twice; issued = in flight + ended, none failed). That a moved
  sample continues from exactly its tokens is held on real engines in tests/engines/test_engine_membership.py.

Written to OUT (default runs/bench/bench_elastic/<timestamp>/): each config's run dir and `results.json`. On a
2-core host the joiner shares the cores with the trainer and the first engine, so more engines need not mean more
throughput: compare the windows of one invocation, and note the load average printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _runs
import httpx

from rllm.experimental.fully_async.cli.engines import send
from rllm.experimental.fully_async.core.elastic import CONTROL_FILE, EVENTS_FILE
from rllm.experimental.fully_async.core.ledger_format import history_counts
from rllm.experimental.fully_async.runtime.rollout.ledger_journal import read_journal

CONFIGS = {
    "default": [],  # config/tiny_cpu.yaml as shipped
    # The same with long generations (40 tokens, EOS ignored, two requests at a time per engine): generation is
    # slower than training, so requests are running on the engine that leaves (as bench_resume_tokens.py's).
    "default-long": [
        "actor_rollout_ref.rollout.ignore_eos=true",
        "data.max_response_length=40",
        "engines.max_running_requests=2",
    ],
}
RUN_OVERRIDES = (
    "engines.num_engines=1",
    "trainer.total_training_steps=100000",  # ended by SIGTERM once the scenario is done
    "trainer.val_before_train=false",
    "trainer.test_freq=0",
)
WAIT_S = 300.0  # any one wait (start-up, a join, steps); a run that takes longer is stuck, not slow
JOIN_LINE = re.compile(r"engine (\d+) joined at \S+ \(weight version (\d+) loaded in ([\d.]+)s")


# ---------------------------------------------------------------------------------------------------- pure


def events_of(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def throughput(rows: list[dict[str, Any]], after: float, count: int) -> dict[str, float | int | None]:
    """Trained samples/s and mean generated tokens/s over the first `count` step rows whose time is > `after`.

    A step row's `time` is when it ended, so the span starts at the row before the window's first (or `after`
    itself when the window starts at the first step) and ends at its last row."""
    steps = [r for r in rows if "batch/samples" in r and "time" in r]
    window = [r for r in steps if r["time"] > after][:count]
    if not window:
        return {"steps": 0, "samples_per_s": None, "tokens_per_s": None, "span_s": None}
    earlier = [r["time"] for r in steps if r["time"] <= after]
    start = earlier[-1] if earlier else after
    span = window[-1]["time"] - start
    tokens = [r["rollout/tokens_per_s"] for r in window if "rollout/tokens_per_s" in r]
    return {
        "steps": len(window),
        "span_s": span,
        "samples_per_s": sum(r["batch/samples"] for r in window) / span if span > 0 else None,
        "tokens_per_s": sum(tokens) / len(tokens) if tokens else None,
    }


def join_timeline(t_add: float, seen: dict[str, float], join_time: float | None) -> dict[str, float | None]:
    """Seconds from the `add` command to each thing the joiner did (None: not seen)."""

    def since(t: float | None) -> float | None:
        return None if t is None else t - t_add

    return {
        "add_to_healthy_s": since(seen.get("healthy")),
        "add_to_weights_s": since(seen.get("weights")),
        "add_to_join_event_s": since(join_time),
        "add_to_first_token_s": since(seen.get("first_token")),
    }


def table(results: list[dict[str, Any]]) -> str:
    """One column per config: the join's timeline, the weight load, throughput before -> after, the leave."""

    def row(label: str, cell) -> str:
        return f"{label:<52}" + "".join(f"{cell(r):>28}" for r in results)

    def per_s(key: str, spec: str):
        return lambda r: f"{_runs.fmt(r['before'][key], spec)} -> {_runs.fmt(r['after'][key], spec)}"

    lines = [
        row("", lambda r: r["config"]),
        row("add -> joiner answers (s)", lambda r: _runs.fmt(r["join"]["add_to_healthy_s"], ".1f")),
        row("add -> joiner has the weights (s)", lambda r: _runs.fmt(r["join"]["add_to_weights_s"], ".1f")),
        row("add -> `join` event (s)", lambda r: _runs.fmt(r["join"]["add_to_join_event_s"], ".1f")),
        row("add -> joiner's first generated token (s)", lambda r: _runs.fmt(r["join"]["add_to_first_token_s"], ".1f")),
        row("joiner's weight load, as the run measured it (s)", lambda r: _runs.fmt(r["weight_load_s"], ".2f")),
        row("steps before -> after the join", lambda r: f"{r['before']['steps']} -> {r['after']['steps']}"),
        row("trained samples/s, 1 -> 2 engines", per_s("samples_per_s", ".0f")),
        row("generated tokens/s, 1 -> 2 engines", per_s("tokens_per_s", ".0f")),
        row("`engines remove 0`: requests running when sent", lambda r: str(r["leave"]["running_when_sent"])),
        row("  answered in (s)", lambda r: _runs.fmt(r["leave"]["answered_s"], ".1f")),
        row("  samples moved (its move line)", lambda r: str(r["leave"]["samples_moved"])),
        row("  tokens regenerated (its move line)", lambda r: str(r["leave"].get("tokens_regenerated", "-"))),
        row("  samples unanswered (its move line)", lambda r: str(r["leave"].get("samples_unanswered", "-"))),
        row("ledger: issued / ended / in flight / failed", lambda r: r["leave"]["ledger"]),
        row("load average (1 min) at start / end", lambda r: "{:.1f} / {:.1f}".format(*r["load_average"])),
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- the run


def wait_for(what: str, done, proc: subprocess.Popen, timeout_s: float = WAIT_S, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while not (result := done()):
        if proc.poll() is not None:
            raise RuntimeError(f"the run exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:g}s")
        time.sleep(poll_s)
    return result


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return events_of(path.read_text()) if path.exists() else []


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / EVENTS_FILE
    return events_of(path.read_text()) if path.exists() else []


def step_count(run_dir: Path) -> int:
    return sum("batch/samples" in r for r in read_rows(run_dir))


def stats_of(http: httpx.Client, url: str) -> dict[str, Any] | None:
    """An embedded engine's `engine_stats` (/get_server_info), None while it does not answer."""
    try:
        return http.get(f"{url}/get_server_info").json()["engine_stats"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def watch_joiner(run_dir: Path, engine: str, url: str, proc: subprocess.Popen, poll_s: float) -> dict[str, float]:
    """Poll the joiner's /get_server_info until it has generated a token; when each counter first moved. (Not
    through `engines list`: the driver answers that between its own steps, which would hide what happens meanwhile.)"""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + WAIT_S
    with httpx.Client(timeout=httpx.Timeout(2.0)) as http:
        while "first_token" not in seen:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"engine {engine} generated no token (run exited: {proc.poll()}); seen {seen}")
            stats = stats_of(http, url)
            now = time.time()
            if stats is None:  # a lost port race restarts it on another port: the join line names the one it serves
                joined = next((e for e in read_events(run_dir) if e["event"] == "join" and e["engine"] == engine), None)
                url = joined["url"] if joined else url
            else:
                seen.setdefault("healthy", now)
                if stats.get("weight_updates", 0) >= 1:
                    seen.setdefault("weights", now)
                if stats.get("generated_tokens", 0) > 0:
                    seen.setdefault("first_token", now)
            time.sleep(poll_s)
    return seen


def wait_until_decoding(url: str, proc: subprocess.Popen, poll_s: float) -> int:
    """Until the engine at `url` has requests running (the remove is then sent; the driver applies it at its next
    watch, so some may have finished by then: the move line says how many moved)."""
    with httpx.Client(timeout=httpx.Timeout(2.0)) as http:
        return wait_for("requests on engine 0", lambda: (stats_of(http, url) or {}).get("num_running", 0), proc,
                        poll_s=poll_s)  # fmt: skip


def measure(name: str, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    run_dir = _runs.fresh_run_dir(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", _runs.TRAIN_MODULE, "train", f"run.dir={run_dir}", *RUN_OVERRIDES]
    command += [*CONFIGS[name], *args.overrides]
    load_start = os.getloadavg()[0]
    log = (run_dir / "output.log").open("w")
    proc = subprocess.Popen(
        command, cwd=_runs.REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
    )  # fmt: skip
    seen_pids: set[_runs.ProcessKey] = set()
    try:
        wait_for("control file", lambda: (run_dir / CONTROL_FILE).exists(), proc)
        first_url = send(run_dir, {"op": "list"})["engines"][0]["url"]
        wait_for(f"{args.steps_before + 1} steps", lambda: step_count(run_dir) >= args.steps_before + 1, proc)
        seen_pids |= _runs.descendants(proc.pid)
        t_add = time.time()
        added = send(run_dir, {"op": "add", "count": 1})
        print(f"[{name}] engines add 1: {added['message']}", flush=True)
        joiner = added["engines"][-1]
        seen = watch_joiner(run_dir, joiner["id"], joiner["url"], proc, args.poll_s)
        joined = lambda: next((e for e in read_events(run_dir) if e["event"] == "join"), None)  # noqa: E731
        join = wait_for("the join event", joined, proc)
        seen_pids |= _runs.descendants(proc.pid)
        after = step_count(run_dir)
        wait_for(
            f"{args.steps_after} steps after the join", lambda: step_count(run_dir) >= after + args.steps_after, proc
        )
        running = wait_until_decoding(first_url, proc, args.poll_s)
        t_remove = time.monotonic()
        removed = send(run_dir, {"op": "remove", "engine": "0"})
        answered_s = time.monotonic() - t_remove
        print(f"[{name}] engines remove 0 ({running} request(s) running on it): {removed['message']}", flush=True)
        then = step_count(run_dir)
        wait_for("two steps after the leave", lambda: step_count(run_dir) >= then + 2, proc)
        seen_pids |= _runs.descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        returncode = proc.wait(timeout=_runs.KILL_GRACE_S * 3)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _runs.sweep(seen_pids)
        log.close()

    rows, lines = read_rows(run_dir), read_events(run_dir)
    output = (run_dir / "output.log").read_text(errors="replace")
    loaded = JOIN_LINE.search(output)
    counts = history_counts(read_journal(run_dir / "ledger.jsonl"))  # raises on a sample issued or ended twice
    ended = sum(counts[k] for k in ("trained", "filtered", "dropped_stale", "failed"))
    moves = [e for e in lines if e["event"] == "move" and e["engine"] == "0"]
    return {
        "config": name,
        "command": command,
        "returncode": returncode,
        "run_dir": str(run_dir),
        "join": join_timeline(t_add, seen, join["time"]),
        "weight_load_s": float(loaded.group(3)) if loaded else None,
        "before": throughput(rows, after=_window_start(rows, t_add, args.steps_before), count=args.steps_before),
        # From the joiner's first token: until then it has no request (those issued before it joined wait on
        # engine 0), so the steps between the join and it are still one engine's.
        "after": throughput(rows, after=max(join["time"], seen["first_token"]), count=args.steps_after),
        "leave": {
            "running_when_sent": running,
            "answered_s": answered_s,
            "samples_moved": sum(e["samples_moved"] for e in moves),
            "tokens_regenerated": sum(e["tokens_regenerated"] for e in moves),
            "samples_unanswered": sum(e["samples_unanswered"] for e in moves),
            "ledger": f"{counts['issued']} / {ended} / {counts['in_flight']} / {counts['failed']}"
            + ("" if counts["issued"] == counts["in_flight"] + ended else " (NOT EXACT)"),
        },
        "events": lines,
        "load_average": (load_start, os.getloadavg()[0]),
    }


def _window_start(rows: list[dict[str, Any]], t_add: float, count: int) -> float:
    """The time after which the last `count` step rows before `t_add` lie (their predecessor's time)."""
    times = [r["time"] for r in rows if "batch/samples" in r and r["time"] <= t_add]
    return times[-count - 1] if len(times) > count else (times[0] - 1e-6 if times else 0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--steps-before", type=int, default=4, help="steps measured before the add (and waited)")
    parser.add_argument("--steps-after", type=int, default=6, help="steps measured after the joiner's first token")
    parser.add_argument("--poll-s", type=float, default=0.05, help="how often the engines' counters are read")
    parser.add_argument("--out", type=Path, default=None, help="default runs/bench/bench_elastic/<timestamp>/")
    parser.add_argument("overrides", nargs="*", help="key=value for every run (after --)")
    args = parser.parse_args(argv)
    if bad := [o for o in args.overrides if "=" not in o]:
        parser.error(f"overrides must be key=value, got {bad}")
    _runs.install_stop_handlers()
    out = (args.out or _runs.timestamped_dir(_runs.DEFAULT_RUNS_ROOT, "bench_elastic")).resolve()
    results = [measure(name, args, out / name) for name in args.configs]
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    _runs.write_json(out / "results.json", {"uptime": uptime, "runs": results})
    print(table(results))
    print(f"[bench] {uptime}; results in {out / 'results.json'}")
    return 0 if all(r["returncode"] == 130 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
