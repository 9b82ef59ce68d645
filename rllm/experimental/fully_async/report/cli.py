"""`python -m rllm.experimental.fully_async report RUN_DIR [RUN_DIR ...] [--out FILE] [--no-predict]`: one HTML page.

The one place the report touches files: it reads each `RUN_DIR/metrics.jsonl`, the run's saved `config.yaml` (its
mode, model and limits), `engine_events.jsonl` when the run's engine set changed, the last step of its trajectory
dump (`trainer.rollout_data_dir`, when the run wrote one) and, unless `--no-predict`, fits the simulator to the run
(`simulate --from`, simulate/from_run.py) for the summary block's "a synchronous run of the same config would take
X". The fit simulates the whole run 10-20 times (15 s of
CPU for the default 500-step run on a loaded development machine; tests/bench/bench_report_fit.py): it shows its
progress on stderr and is kept in `RUN_DIR/report_prediction.json`, reused while metrics.jsonl is unchanged.
`html.render_html` (pure) draws the page. Several run directories draw side by side, e.g. an async run against a
synchronous one (`async_training.max_staleness=0`). Exit codes: 0 written, 2 a run directory or its metrics could
not be read.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rllm.experimental.fully_async.observe.dumps import read_dump
from rllm.experimental.fully_async.observe.progress import status_printer
from rllm.experimental.fully_async.report.data import (
    EngineEvent,
    ReportDataError,
    RunRecords,
    RunReport,
    SyncPrediction,
    parse_engine_events,
    parse_metrics,
    run_info,
    run_report,
    sample_generations,
)
from rllm.experimental.fully_async.report.html import render_html
from rllm.experimental.fully_async.simulate.calibrate import CalibrationError
from rllm.experimental.fully_async.simulate.from_run import predict_from_run
from rllm.experimental.fully_async.simulate.scenarios import ScenarioError

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
ENGINE_EVENTS_FILE = "engine_events.jsonl"
CONFIG_FILE = "config.yaml"
REPORT_FILE = "report.html"
PREDICTION_FILE = "report_prediction.json"
EXIT_BAD_INPUT = 2
SAMPLES_SHOWN = 4


def load_run(run_dir: str | Path) -> RunRecords:
    """A run's records from RUN_DIR/metrics.jsonl (or from a metrics file given directly), labelled by the path."""
    path = Path(run_dir)
    metrics = path if path.is_file() else path / METRICS_FILE
    if not metrics.is_file():
        raise ReportDataError(f"{metrics}: not found (is {run_dir} a run directory? each run writes {METRICS_FILE})")
    with metrics.open(encoding="utf-8") as handle:
        records = parse_metrics(handle, str(metrics))
    if not records:
        raise ReportDataError(f"{metrics}: no records (the run stopped before its first step?)")
    return RunRecords.of(str(run_dir), records)


def load_engine_events(run_dir: Path) -> tuple[EngineEvent, ...]:
    """RUN_DIR/engine_events.jsonl's events; none when the run never changed its engine set (no file)."""
    path = run_dir / ENGINE_EVENTS_FILE
    if not path.is_file():
        return ()
    with path.open(encoding="utf-8") as handle:
        return tuple(parse_engine_events(handle, str(path)))


def _config(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return None

    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)  # type: ignore[return-value]


def _dump_dir(run_dir: Path, config: dict[str, Any]) -> Path | None:
    """The run's trajectory dump folder: as configured (relative to where the run was started, usually here), else
    relative to the run directory; None when dumps were off or the folder is gone."""
    configured = (config.get("trainer") or {}).get("rollout_data_dir")
    if not configured:
        return None
    for candidate in (Path(configured), run_dir / configured):
        if candidate.is_dir():
            return candidate
    return None


def _samples(run_dir: Path, config: dict[str, Any]) -> tuple[tuple, int | None]:

    folder = _dump_dir(run_dir, config)
    if folder is None:
        return (), None
    try:
        step, records = read_dump(folder)
    except (FileNotFoundError, json.JSONDecodeError) as exc:
        logger.warning("no sample generations from %s: %s", folder, exc)
        return (), None
    return tuple(sample_generations(records, SAMPLES_SHOWN)), step


def predict(run_dir: Path, config: dict[str, Any], records: Sequence[dict[str, Any]], quiet: bool = False):
    """(SyncPrediction or None, note) for a run: from RUN_DIR/report_prediction.json while metrics.jsonl is the one
    it was made from, else fitted now (simulate/from_run.py) and saved there."""

    stat = (run_dir / METRICS_FILE).stat()
    key = {"metrics_bytes": stat.st_size, "metrics_mtime_ns": stat.st_mtime_ns}
    cache = run_dir / PREDICTION_FILE
    note = f"predicted from this run (`simulate --from {run_dir}`)"
    if cache.is_file():
        saved = json.loads(cache.read_text())
        if saved.get("key") == key:
            return SyncPrediction(**saved["prediction"]), note
    status = None if quiet else status_printer(sys.stderr)
    if status is not None:
        status(f"report: fitting the simulator to {run_dir} for the synchronous prediction (--no-predict skips it)")
    try:
        result = predict_from_run(config, records, cores=os.cpu_count(), progress=status)
    except (CalibrationError, ScenarioError, ValueError, KeyError) as exc:
        return None, f"no prediction: {exc}"
    finally:
        if status is not None:
            status.close()
    prediction = SyncPrediction(
        measured_s=result.fit.measured.wall_s,
        predicted_self_s=result.predicted_self_s,
        synchronous_s=None if result.own == "synchronous" else result.wall_s("synchronous"),
        other_mode=result.other,
        other_s=result.wall_s(result.other),
        baseline=result.baseline,
    )
    cache.write_text(json.dumps({"key": key, "prediction": prediction.__dict__}, indent=1))
    return prediction, note


def load_report(run_dir: str | Path, *, with_prediction: bool = True, quiet: bool = False) -> RunReport:
    """Everything the page shows of one run directory (or a bare metrics file: the figures only)."""
    run = load_run(run_dir)
    path = Path(run_dir)
    config = _config(path) if path.is_dir() else None
    events = load_engine_events(path) if path.is_dir() else ()
    if config is None:
        note = f"no {CONFIG_FILE} beside the metrics: mode and prediction unknown"
        return run_report(run, prediction_note=note, engine_events=events)
    samples, samples_step = _samples(path, config)
    prediction, note = None, "not predicted (--no-predict)"
    if with_prediction:
        prediction, note = predict(path, config, run.records, quiet=quiet)
    return run_report(
        run,
        info=run_info(config),
        samples=samples,
        samples_step=samples_step,
        prediction=prediction,
        prediction_note=note,
        engine_events=events,
    )


def default_output(run_dirs: Sequence[str | Path]) -> Path:
    """RUN_DIR/report.html for one run directory; ./report.html when comparing several."""
    if len(run_dirs) == 1 and Path(run_dirs[0]).is_dir():
        return Path(run_dirs[0]) / REPORT_FILE
    return Path(REPORT_FILE)


def write_report(
    run_dirs: Sequence[str | Path], out: str | Path | None = None, *, with_prediction: bool = True, quiet: bool = False
) -> Path:
    """Render the runs into one HTML page at `out` (default: `default_output`); returns its path."""

    reports = [load_report(d, with_prediction=with_prediction, quiet=quiet) for d in run_dirs]
    target = Path(out) if out is not None else default_output(run_dirs)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render_html(reports), encoding="utf-8")
    return target


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rllm.experimental.fully_async report",
        description="Draw one or more runs into a self-contained interactive HTML page: a summary per run (mode, "
        "model, wall time, held-out accuracy, idle, throughput, staleness, ledger, the synchronous prediction), "
        "reward and accuracy, who waited, throughput, staleness, queue, syncs, verl's actor metrics, response "
        "lengths, the ledger, and sample generations when the run dumped them.",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (each has metrics.jsonl)")
    parser.add_argument("--out", default=None, help="output file (default: RUN_DIR/report.html, or ./report.html)")
    parser.add_argument(
        "--no-predict", action="store_true", help="skip the synchronous-run prediction (a fit of the simulator)"
    )
    return parser


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        path = write_report(args.run_dirs, args.out, with_prediction=not args.no_predict)
    except (ReportDataError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(path)
    return 0
