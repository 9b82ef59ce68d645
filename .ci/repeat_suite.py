"""Run the README's test command N times in a row and list every test that failed, with each run's time and load.

    .venv/bin/python .ci/repeat_suite.py 5                 # the whole suite, five times
    .venv/bin/python .ci/repeat_suite.py 3 -m "not slow"   # the inner loop, three times

Each run is the README's command (`python -m pytest -q -n 2 --dist worksteal tests`, plus any extra pytest
arguments given here) with a JUnit XML report, so failures are read from pytest's own record. While a run goes, the
1-minute load average is sampled every 5 s: the table gives its mean and maximum beside the wall time, so a slow or
failing run can be told apart from a loaded machine. Exit code: 0 when every run passed, 1 otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMAND = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "worksteal", "-p", "no:cacheprovider", "tests"]


def _load_sampler(samples: list[float], stop: threading.Event, period_s: float = 5.0) -> None:
    while not stop.wait(period_s):
        samples.append(os.getloadavg()[0])


def failures_in(junit: Path) -> list[str]:
    """`file::test` of every failed or errored test case in a JUnit XML report."""
    found = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            found.append(f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}")
    return found


def counts_in(junit: Path) -> dict[str, int]:
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None
    return {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}


def run_once(index: int, extra: list[str], out_dir: Path) -> dict:
    junit = out_dir / f"run{index}.xml"
    samples: list[float] = [os.getloadavg()[0]]
    stop = threading.Event()
    sampler = threading.Thread(target=_load_sampler, args=(samples, stop), daemon=True)
    sampler.start()
    started = time.monotonic()
    proc = subprocess.run([*COMMAND, f"--junitxml={junit}", *extra], cwd=REPO, capture_output=True, text=True)
    wall_s = time.monotonic() - started
    stop.set()
    sampler.join()
    (out_dir / f"run{index}.log").write_text(proc.stdout + proc.stderr)
    failed = failures_in(junit) if junit.exists() else ["(no report: pytest did not finish; see the log)"]
    counts = counts_in(junit) if junit.exists() else {}
    return {
        "run": index,
        "exit": proc.returncode,
        "wall_s": wall_s,
        "load_mean": sum(samples) / len(samples),
        "load_max": max(samples),
        "failed": failed,
        "counts": counts,
    }


def main(argv: list[str]) -> int:
    if not argv or not argv[0].isdigit():
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    n, extra = int(argv[0]), argv[1:]
    out_dir = Path(tempfile.mkdtemp(prefix="repeat_suite_"))
    print(f"logs and JUnit reports: {out_dir}", flush=True)
    results = []
    for index in range(1, n + 1):
        result = run_once(index, extra, out_dir)
        results.append(result)
        c = result["counts"]
        print(
            f"run {index}/{n}: exit {result['exit']}, {result['wall_s'] / 60:.1f} min, load mean "
            f"{result['load_mean']:.1f} max {result['load_max']:.1f}, {c.get('tests', '?')} tests, "
            f"{c.get('failures', '?')} failed, {c.get('errors', '?')} errors, {c.get('skipped', '?')} skipped",
            flush=True,
        )
        for name in result["failed"]:
            print(f"    FAILED {name}", flush=True)
    bad = [r for r in results if r["exit"] != 0]
    print(f"{n - len(bad)} of {n} runs green")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
