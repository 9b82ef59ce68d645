"""The report's plotting vocabulary on plotly: how a series, a missing metric, a moment and a limit are drawn.

Conventions every figure of the report follows (figures.py builds the figures with these):
- each series is drawn twice: its raw per-step values thin and faint, and smoothed (data.smooth) on top;
- one quantity, one colour: trainer blue, engines orange, generated tokens green, trained tokens purple, reward
  teal, held-out accuracy brown; with several runs, a figure of one quantity colours by run, a figure of several
  quantities dashes by run;
- shares are percent with as many decimals as they need (`PERCENT`: 0.25% reads 0.25%, not 0%);
- validation moments are dotted vertical lines; weight syncs a rug of ticks along the bottom while there are few
  (`SPARSE_SYNCS`), else said in the title when they come every K steps, else one mark per stretch of steps
  with its count (a tick per sync at K=1 over 500 steps is a solid bar); limits (the queue's capacity, the
  staleness budget, η) dashed red horizontal lines with their name; changes of the engine set (engine_events.jsonl)
  dash-dotted vertical lines labelled with what changed ("+1 engine (registered)", "-1 engine, 3 samples moved"),
  a triangle at their top carrying one hover line per event;
- a metric a run did not record is said on the plot ("not recorded by this run: ..."), never an error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import plotly.graph_objects as go

from rllm.experimental.fully_async.report.data import (
    RunRecords,
    RunReport,
    engine_marks,
    smooth,
    step_times,
    sync_steps,
    validation_points,
)

NOT_RECORDED = "not recorded by this run"
RUN_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")
TRAINER, ENGINES, GENERATED, TRAINED = "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"
REWARD, ACCURACY = "#17becf", "#8c564b"
PERCENT = ".2~%"  # d3 format: a percent with up to 2 decimals, trailing zeros trimmed
SPARSE_SYNCS = 40  # at most this many sync ticks in a rug: more merge into a bar at the report's width
DASHES = ("solid", "dash", "dot", "dashdot")
HEIGHT = 340

Getter = Callable[[RunRecords, str], tuple[list[float], list[float]]]


def column(key: str) -> Getter:
    return lambda run, x: run.series(key, x)


@dataclass(frozen=True)
class Line:
    """One quantity drawn for every run: its name, how to get it, and its colour (None: the run's colour)."""

    name: str
    get: Getter
    colour: str | None = None
    smoothed: bool = True


def layout(fig: go.Figure, title: str, x_title: str, y_title: str, height: int = HEIGHT) -> go.Figure:
    fig.update_layout(
        title={"text": title, "x": 0.01, "font": {"size": 15}},
        height=height,
        margin={"l": 60, "r": 20, "t": 50, "b": 45},
        template="plotly_white",
        legend={"orientation": "h", "y": -0.18, "font": {"size": 11}},
        hovermode="x unified",
    )
    if x_title:
        fig.layout.xaxis.title = x_title
    if y_title:
        fig.layout.yaxis.title = y_title
    return fig


def add_lines(
    fig: go.Figure,
    reports: Sequence[RunReport],
    lines: Sequence[Line],
    x: str = "step",
    row: int | None = None,
    col: int | None = None,
    legend: bool = True,
) -> list[str]:
    """Raw (faint) and smoothed traces of each line for each run; returns what was not recorded."""
    missing: list[str] = []
    where = {"row": row, "col": col} if row is not None else {}
    for i, report in enumerate(reports):
        for line in lines:
            xs, ys = line.get(report.run, x)
            name = line.name if len(reports) == 1 else f"{report.label}: {line.name}"
            if not xs:
                missing.append(name)
                continue
            colour = line.colour or RUN_COLOURS[i % len(RUN_COLOURS)]
            dash = DASHES[i % len(DASHES)] if line.colour else "solid"
            sparse = len(xs) <= 30
            if line.smoothed and not sparse:
                fig.add_trace(
                    go.Scatter(
                        x=xs,
                        y=ys,
                        mode="lines",
                        line={"color": colour, "width": 1},
                        opacity=0.25,
                        name=f"{name} (raw)",
                        legendgroup=name,
                        showlegend=False,
                        hovertemplate="%{y:.4g}",
                    ),
                    **where,
                )
                ys = smooth(ys)
            mode = "lines+markers" if sparse else "lines"
            fig.add_trace(
                go.Scatter(
                    x=xs,
                    y=ys,
                    mode=mode,
                    line={"color": colour, "width": 2.2, "dash": dash},
                    name=name,
                    legendgroup=name,
                    showlegend=legend,
                    hovertemplate="%{y:.4g}" + (" (smoothed)" if line.smoothed and not sparse else ""),
                ),
                **where,
            )
    return missing


def note_missing(fig: go.Figure, missing: Sequence[str], drew: bool, hint: str = "", axis: str = "") -> None:
    """The NOT_RECORDED note on the subplot of axes x{axis}/y{axis}: small in its corner when something was drawn,
    else centred on it with the subplot's empty axes hidden (placed by the axes' domains: plotly leaves a subplot
    without traces unanchored)."""
    if not missing:
        return
    # One run per line: a panel is a third of the page wide, and one line naming every run ran into its neighbour.
    text = f"{NOT_RECORDED}:<br>" + "<br>".join(missing) + (f"<br>({hint})" if hint else "")
    if drew:  # inside the panel's lower left, one line: above it sit the panel's title and the other runs' lines
        text = f"{NOT_RECORDED}: {', '.join(missing)}"
        fig.add_annotation(
            text=text,
            xref=f"x{axis} domain",
            yref=f"y{axis} domain",
            x=0.01,
            y=0.02,
            xanchor="left",
            yanchor="bottom",
            showarrow=False,
            font={"size": 9, "color": "#666"},
            bgcolor="rgba(255,255,255,0.8)",
        )
        return
    x_axis, y_axis = fig.layout[f"xaxis{axis}"], fig.layout[f"yaxis{axis}"]
    (x0, x1), (y0, y1) = x_axis.domain or (0, 1), y_axis.domain or (0, 1)
    fig.add_annotation(
        text=text,
        xref="paper",
        yref="paper",
        x=(x0 + x1) / 2,
        y=(y0 + y1) / 2,
        # centred on the point: plotly's "auto" anchors a paper-placed note's left edge there when x < 1/3 (the
        # left column), which ran the note into the next panel
        xanchor="center",
        yanchor="middle",
        showarrow=False,
        font={"size": 12, "color": "#666"},
    )
    x_axis.visible = y_axis.visible = False


def mark_validations(fig: go.Figure, reports: Sequence[RunReport], x: str = "step", **where) -> None:
    """Dotted vertical lines at the steps whose weights a validation measured (the first run's)."""
    run = reports[0].run
    times = step_times(run) if x == "wall" else {}
    for step, _ in validation_points(run):
        at = times.get(step, 0.0 if step == 0 else None) if x == "wall" else step
        if at is not None:
            fig.add_vline(x=at, line={"dash": "dot", "color": "#888", "width": 1}, opacity=0.6, **where)


def mark_syncs(fig: go.Figure, reports: Sequence[RunReport]) -> str:
    """The first run's weight syncs along the bottom (module docstring); returns how they are drawn, for the title."""
    steps = sync_steps(reports[0].run)
    if not steps:
        return ""
    every = _cadence(steps)
    if len(steps) <= SPARSE_SYNCS:
        _rug(fig, steps, [f"sync after step {s}" for s in steps], "weight sync", [1.0] * len(steps))
        return "ticks: weight syncs"
    if every is not None:  # said in the title only: a regular cadence drawn tick by tick tells nothing more
        said = "weight sync after every step" if every == 1 else f"a weight sync every {every} steps"
        return f"{said} ({len(steps)} syncs)"
    width = -(-(steps[-1] - steps[0] + 1) // SPARSE_SYNCS)  # steps per mark, so at most SPARSE_SYNCS marks
    bins: dict[int, list[int]] = {}
    for step in steps:
        bins.setdefault((step - steps[0]) // width, []).append(step)
    most = max(len(b) for b in bins.values())
    texts = [f"{len(b)} syncs in steps {b[0]}-{b[-1]}" for b in bins.values()]
    centres = [(b[0] + b[-1]) / 2 for b in bins.values()]
    _rug(fig, centres, texts, "weight syncs", [0.25 + 0.75 * len(b) / most for b in bins.values()])
    return f"one mark per {width} steps: weight syncs, darker for more"


def _cadence(steps: list[int]) -> int | None:
    """K when the syncs came every K steps from step K on, else None."""
    every = steps[0]
    regular = all(b - a == every for a, b in zip([0, *steps], steps, strict=False))
    return every if regular else None


def _rug(fig: go.Figure, xs: Sequence[float], texts: list[str], name: str, opacity: list[float]) -> None:
    fig.add_trace(
        go.Scatter(
            x=list(xs),
            y=[0.0] * len(xs),
            yaxis="y9",
            mode="markers",
            name=name,
            marker={"symbol": "line-ns-open", "size": 9, "color": "#555", "opacity": opacity},
            hovertext=texts,
            hovertemplate="%{hovertext}<extra></extra>",
        )
    )
    fig.update_layout(yaxis9={"overlaying": "y", "range": [0, 1], "visible": False, "fixedrange": True})


def mark_engine_events(fig: go.Figure, reports: Sequence[RunReport]) -> int:
    """Each run's engine events as labelled vertical lines at their steps (module docstring) on a one-panel figure
    against the trainer step; returns how many steps were marked."""
    marked = 0
    for i, report in enumerate(reports):
        marks = engine_marks(report.run, report.engine_events)
        if not marks:
            continue
        colour = ENGINES if len(reports) == 1 else RUN_COLOURS[i % len(RUN_COLOURS)]
        prefix = "" if len(reports) == 1 else f"{report.label}: "
        for mark in marks:
            fig.add_vline(
                x=mark.x,
                line={"dash": "dashdot", "color": colour, "width": 1.3},
                annotation_text=prefix + mark.label,
                annotation_position="top right",
                annotation_font={"color": colour, "size": 10},
                annotation_xshift=7,  # clear of the hover triangle on the line
            )
        fig.add_trace(
            go.Scatter(
                x=[mark.x for mark in marks],
                y=[1.0] * len(marks),
                yaxis="y8",
                mode="markers",
                name=f"{prefix}engine events",
                marker={"symbol": "triangle-down", "size": 9, "color": colour},
                hovertext=["<br>".join(mark.details) for mark in marks],
                hovertemplate="%{hovertext}<extra></extra>",
            )
        )
        marked += len(marks)
    if marked:
        fig.update_layout(yaxis8={"overlaying": "y", "range": [0, 1.05], "visible": False, "fixedrange": True})
    return marked


def add_limit(fig: go.Figure, value: float | None, label: str, **where) -> None:
    if value is not None:
        fig.add_hline(
            y=value,
            line={"dash": "dash", "color": "#c00", "width": 1.3},
            annotation_text=label,
            annotation_position="top left",
            annotation_font={"color": "#c00", "size": 11},
            annotation_bgcolor="rgba(255,255,255,0.8)",  # readable where a run's line crosses the label
            **where,
        )
