"""Committed result files: one JSON per run, from which every results table in the READMEs is regenerated.

Layout: `tests/bench/results/<experiment>/<arm>-seed<k>.json` (`record_path`), one file per finished run, written
by the experiment scripts as each run ends (`write_record`), so an interrupted experiment keeps what it finished and
a re-run of the same command skips those runs (`finished`). Each file holds:

- what ran: `experiment`, `arm`, `seed`, `order` (its position among the seed's arms, which run in a shuffled
  order recorded here), `command` (the training command line), `invocation` (the script's own), `config` (the YAML),
  `overrides` (every key=value, in order), `commit` (git HEAD, "+dirty" when the tree had uncommitted changes),
  `date` (UTC), `load_average` (1-minute, at the run's start and end), `host` (cores);
- the experiment's own parameters it is read under (`params`: task, regime, steps, test_freq, threshold, ...);
- `returncode`, `ok`, `wall_s` (the whole command), `startup_s` (command start to the first step's start);
- `summary`: `_metrics.MetricsSummary` as a dict (final accuracy, validation curve, time to the experiment's
  threshold, pg_clipfrac, masked fractions, trainer idle and wait shares, staleness, η trajectory, statistics the
  adaptive rule reads, ...).

`tests/bench/results_tables.py` reads these files back (`read_records`) and writes the tables.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from _runs import REPO_ROOT, RunResult

RESULTS_ROOT = Path(__file__).resolve().parent / "results"


def record_path(experiment_dir: Path, arm: str, seed: int) -> Path:
    return experiment_dir / f"{arm}-seed{seed}.json"


def git_commit(repo: Path = REPO_ROOT) -> str:
    """HEAD's hash, with "+dirty" when tracked files differ from it ("unknown" outside a git checkout)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def run_record(
    result: RunResult,
    *,
    experiment: str,
    arm: str,
    seed: int,
    order: int,
    overrides: list[str],
    config: str | None,
    invocation: str,
    params: dict[str, Any],
    commit: str,
    threshold: float | None = None,
) -> dict[str, Any]:
    """The JSON record of one finished run (see the module docstring)."""
    summary = asdict(result.metrics)
    summary["generated_per_trained_token"] = result.metrics.generated_per_trained_token
    if threshold is not None:
        summary["time_to_threshold_s"] = result.metrics.time_to_accuracy(threshold)
    return {
        "experiment": experiment,
        "arm": arm,
        "seed": seed,
        "order": order,
        "command": list(result.command),
        "invocation": invocation,
        "config": config,
        "overrides": list(overrides),
        "commit": commit,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "load_average": list(result.load_average),
        "host": {"cpus": os.cpu_count()},
        "params": params,
        "returncode": result.returncode,
        "ok": result.ok,
        "wall_s": result.wall_s,
        "startup_s": result.startup_s,
        "summary": summary,
    }


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Write `record` as `path` (pretty JSON, keys in order), through a temporary file so a reader never sees half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)


def read_records(experiment_dir: Path) -> list[dict[str, Any]]:
    """Every run record of an experiment folder, sorted by (seed, order); [] when the folder does not exist."""
    if not experiment_dir.is_dir():
        return []
    records = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(experiment_dir.glob("*.json"))]
    return sorted(records, key=lambda r: (r["seed"], r["order"], r["arm"]))


def finished(experiment_dir: Path, arm: str, seed: int) -> bool:
    """Whether a successful run of (arm, seed) is recorded already (a re-run of the experiment skips it)."""
    path = record_path(experiment_dir, arm, seed)
    return path.is_file() and bool(json.loads(path.read_text(encoding="utf-8")).get("ok"))
