"""The run report as one self-contained HTML page: a summary block per run, interactive figures, sample generations.

Pure rendering: takes each run's report data (`data.RunReport`), returns the page as a string. plotly.js is
inlined once in the page's head (plotly's offline bundle, ~4.7 MB), so the page opens without a network; the
figures (figures.py) are plotly's `to_html` fragments. The summary block's numbers are
`observe/summary.py`'s, the ones the end-of-run summary printed.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence

from plotly.offline import get_plotlyjs

from rllm.experimental.fully_async.observe.progress import format_duration
from rllm.experimental.fully_async.report.data import RunReport, Sample, eta_changes, regenerated_text
from rllm.experimental.fully_async.report.figures import build_figures
from rllm.experimental.fully_async.report.plot import RUN_COLOURS

VERSION_COLOURS = ("#1a7f37", "#0969da", "#8250df", "#bf8700", "#cf222e", "#1b7c83")
PLOT_CONFIG = {"displaylogo": False, "responsive": True, "toImageButtonOptions": {"format": "png", "scale": 2}}

_STYLE = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:1.5em auto;max-width:1250px;color:#222}
h1{font-size:1.5em;margin-bottom:.2em}h2{font-size:1.15em;margin:1.4em 0 .3em;border-bottom:1px solid #ddd}
.runs{display:flex;flex-wrap:wrap;gap:1em}.run{border:1px solid #ccc;border-radius:6px;padding:.6em 1em;flex:1 1 520px}
.run h3{margin:.1em 0 .5em;font-size:1em;word-break:break-all}
table{border-collapse:collapse;width:100%}td{padding:2px 8px;font-size:.9em;vertical-align:top}
td:first-child{color:#555;white-space:nowrap;width:13em}.big{font-weight:600}
.sample{border-left:3px solid #ddd;margin:.6em 0;padding:.2em .8em;font-family:ui-monospace,Menlo,monospace;
font-size:.85em;white-space:pre-wrap}.prompt{color:#777}.legend span{margin-right:1em}
code{font-family:ui-monospace,Menlo,monospace;font-size:.92em;background:#f3f3f3;padding:0 .25em;border-radius:3px}
"""


def text_html(text: str) -> str:
    """Plain text as HTML: escaped, and what the text quotes in backticks (a command, a key) set as <code>."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _val(point: tuple[int, float] | None) -> str:
    return "-" if point is None else f"{point[1]:.1%}@{point[0]}"


def summary_rows(report: RunReport) -> list[tuple[str, str]]:
    """(label, value) lines of a run's summary block, in reading order."""
    t, info, p = report.totals, report.info, report.prediction
    rows: list[tuple[str, str]] = []
    if info is not None:
        rows += [
            ("mode", info.mode),
            ("correction", info.correction),
            ("model", info.model),
            ("learning rate", _fmt(info.lr, "{:g}")),
            (
                "batch",
                f"{info.required_samples} groups x {info.samples_per_prompt} samples, {info.estimator}, "
                f"{info.engines} engines",
            ),
        ]
    wall = t.wall_s
    rows.append(
        (
            "wall time",
            f"{format_duration(wall)} ({wall:.0f} s) for {t.steps} steps, first step's start to last step's end"
            if wall is not None
            else "-",
        )
    )
    if p is not None and p.synchronous_s is not None and wall:
        saving = 1 - wall / p.synchronous_s
        rows.append(
            (
                "synchronous run",
                f"a synchronous run of the same config (η=0, K=1, {p.baseline}) would take "
                f"{format_duration(p.synchronous_s)} ({p.synchronous_s:.0f} s): async saved {saving:.0%} "
                f"({p.synchronous_s / wall:.2f}x); "
                f"{report.prediction_note}, which predicts this run at {p.predicted_self_s:.0f} s",
            )
        )
    elif p is not None:
        rows.append(
            (
                "other mode",
                f"{p.other_mode} would take {format_duration(p.other_s)} ({p.other_s:.0f} s); {report.prediction_note}",
            )
        )
    else:
        rows.append(("synchronous run", report.prediction_note))
    rows += [
        ("held-out accuracy", f"{_val(t.first_val)} first → {_val(t.best_val)} best → {_val(t.last_val)} last"),
        ("idle (mean)", f"trainer {_fmt(t.trainer_idle, '{:.0%}')}, engines {_fmt(t.engines_idle, '{:.0%}')}"),
        (
            "tokens / s",
            f"generated {_fmt(t.generated_tokens_per_s, '{:,.0f}')}, trained {_fmt(t.trained_tokens_per_s, '{:,.0f}')}",
        ),
        (
            "staleness",
            f"mean {_fmt(t.staleness_mean, '{:.2f}')}, max {_fmt(t.staleness_max, '{:.0f}')} versions; "
            f"{_fmt(t.mixed_version_share, '{:.1%}')} of trained rows hold tokens of several versions",
        ),
    ]
    ledger = ", ".join(f"{k} {v:,.0f}" + (f" ({s:.2%})" if s is not None else "") for k, v, s in t.ledger_shares())
    rows.append(("ledger", f"issued {t.ledger['issued']:,.0f}: {ledger}" if "issued" in t.ledger else ledger or "-"))
    if report.engine_events:
        rows.append(("engine changes", _engine_changes(report)))
    return rows


def _engine_changes(report: RunReport) -> str:
    """The engine set's changes in one line: counts by kind (joins by source), samples moved, engines at the end."""
    events = report.engine_events
    sources: dict[str, int] = {}
    for e in events:
        if e.event == "join":
            sources[e.source or "?"] = sources.get(e.source or "?", 0) + 1
    joined = sum(sources.values())
    parts = [f"{joined} joined ({', '.join(f'{n} {s}' for s, n in sources.items())})"] if joined else []
    past = {"leave": "left", "lost": "lost", "restart": "restarted", "move": "moves"}
    for kind in (*past, *sorted({e.event for e in events} - {"join", *past})):
        if n := sum(e.event == kind for e in events):
            parts.append(f"{n} {past.get(kind, kind)}")
    said = ", ".join(parts)
    moved = sum(e.samples_moved for e in events)
    regenerated = sum(e.tokens_regenerated for e in events)
    active = [e.engines_active for e in events if e.engines_active is not None]
    end = f"; {active[-1]} active after the last" if active else ""
    return f"{said}; {moved} samples moved ({regenerated_text(regenerated)}){end} (engine_events.jsonl)"


def summary_block(report: RunReport, index: int) -> str:
    rows = "".join(
        f'<tr><td>{html.escape(k)}</td><td class="{"big" if k in ("wall time", "synchronous run") else ""}">'
        f"{text_html(v)}</td></tr>"
        for k, v in summary_rows(report)
    )
    colour = RUN_COLOURS[index % len(RUN_COLOURS)]
    return (
        f'<div class="run" style="border-top:4px solid {colour}"><h3>{html.escape(report.label)}</h3>'
        f"<table>{rows}</table></div>"
    )


def sample_block(sample: Sample) -> str:
    pieces = []
    for text, version in sample.pieces:
        if version is None:
            pieces.append(f'<span class="prompt">{html.escape(text)}</span>')
        else:
            colour = VERSION_COLOURS[version % len(VERSION_COLOURS)]
            pieces.append(f'<span style="color:{colour}" title="version {version}">{html.escape(text)}</span>')
    versions = ", ".join(f"v{v}" for v in sample.versions) or "-"
    return (
        f'<div class="sample"><b>reward {sample.reward:g}</b> · versions {versions}\n'
        f'<span class="prompt">{html.escape(sample.prompt)}</span>{"".join(pieces)}</div>'
    )


def samples_section(reports: Sequence[RunReport]) -> str:
    parts = []
    for report in reports:
        if not report.samples:
            continue
        versions = sorted({v for s in report.samples for v in s.versions})
        legend = "".join(
            f'<span style="color:{VERSION_COLOURS[v % len(VERSION_COLOURS)]}">■ version {v}</span>' for v in versions
        )
        parts.append(
            f"<h3>{html.escape(report.label)}: step {report.samples_step} (best and worst rewards)</h3>"
            f'<div class="legend"><span class="prompt">grey: prompt, not generated</span>{legend}</div>'
            + "".join(sample_block(s) for s in report.samples)
        )
    if not parts:
        return (
            "<h2>Sample generations</h2><p>No trajectory dump: run with trainer.rollout_data_dir=DIR to see the "
            "last step's generations here.</p>"
        )
    return "<h2>Sample generations from the last step</h2>" + "".join(parts)


def eta_section(reports: Sequence[RunReport]) -> str:
    """Adaptive staleness: one line per η change per run (empty when no run adapted η)."""
    adapted = [report for report in reports if report.run.has("staleness/eta")]
    if not adapted:
        return ""
    items = []
    for report in adapted:
        changes = [f"<li>{text_html(c.line())}</li>" for c in eta_changes(report.run)]
        lines = "".join(changes) or "<li>η never changed</li>"
        final = report.run.last("staleness/eta")
        items.append(f"<h3>{html.escape(report.label)} (final η {_fmt(final, '{:.0f}')})</h3><ul>{lines}</ul>")
    return f"<h2>Adaptive staleness</h2>{''.join(items)}"


def render_html(reports: Sequence[RunReport], title: str = "fully-async PPO run report") -> str:
    """The whole page. Runs draw side by side in every figure."""

    sections = []
    for index, (name, fig) in enumerate(build_figures(reports)):
        div = fig.to_html(full_html=False, include_plotlyjs=False, config=PLOT_CONFIG, div_id=f"figure-{index}")
        sections.append(f'<section data-figure="{html.escape(name)}"><h2>{html.escape(name)}</h2>{div}</section>')
    blocks = "".join(summary_block(r, i) for i, r in enumerate(reports))
    return (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_STYLE}</style><script>{get_plotlyjs()}</script></head><body>"
        f'<h1>{html.escape(title)}</h1><h2>Summary</h2><div class="runs">{blocks}</div>{eta_section(reports)}'
        f"{''.join(sections)}{samples_section(reports)}</body></html>\n"
    )
