"""`python -m rllm.experimental.fully_async report RUN_DIR [RUN_DIR ...] [--out FILE]`: one self-contained HTML page.

The one place the report touches files: it reads each `RUN_DIR/metrics.jsonl`, hands the parsed records to
`report_html.render_html` (pure) and writes the page. Several run directories draw side by side, e.g. an async run
against a synchronous one (`async_training.max_staleness=0`). Exit codes: 0 written, 2 a run directory or its
metrics could not be read.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rllm.experimental.fully_async.observe.report_data import ReportDataError, RunRecords, parse_metrics

METRICS_FILE = "metrics.jsonl"
REPORT_FILE = "report.html"
EXIT_BAD_INPUT = 2


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


def default_output(run_dirs: Sequence[str | Path]) -> Path:
    """RUN_DIR/report.html for one run directory; ./report.html when comparing several."""
    if len(run_dirs) == 1 and Path(run_dirs[0]).is_dir():
        return Path(run_dirs[0]) / REPORT_FILE
    return Path(REPORT_FILE)


def write_report(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Render the runs into one HTML page at `out` (default: `default_output`); returns its path."""
    from rllm.experimental.fully_async.observe.report_html import render_html

    runs = [load_run(d) for d in run_dirs]
    target = Path(out) if out is not None else default_output(run_dirs)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render_html(runs), encoding="utf-8")
    return target


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rllm.experimental.fully_async report",
        description="Draw one or more runs' metrics.jsonl into a self-contained HTML page (reward, held-out "
        "accuracy, staleness, idle fractions, throughput, sync pauses, queue depth, ledger).",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (each has metrics.jsonl)")
    parser.add_argument("--out", default=None, help="output file (default: RUN_DIR/report.html, or ./report.html)")
    return parser


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: the report needs matplotlib: pip install matplotlib", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        path = write_report(args.run_dirs, args.out)
    except (ReportDataError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(path)
    return 0
