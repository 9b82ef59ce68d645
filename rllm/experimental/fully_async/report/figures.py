"""The report's figures, built with plotly (interactive: hover, zoom, legend toggles) from runs' report data. Pure.

Each figure answers one question about the run (is it learning, who waited, how stale, where samples ended, ...)
and is drawn in the conventions of plot.py. `build_figures` gives them in page order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from rllm.experimental.fully_async.core.versions import groups_ahead_budget
from rllm.experimental.fully_async.report.data import (
    RunRecords,
    RunReport,
    ledger_drops,
    smooth,
    staleness_histograms,
    step_times,
    trained_tokens_per_s,
    validation_points,
)
from rllm.experimental.fully_async.report.plot import (
    ACCURACY,
    DASHES,
    ENGINES,
    GENERATED,
    HEIGHT,
    PERCENT,
    REWARD,
    RUN_COLOURS,
    TRAINED,
    TRAINER,
    Getter,
    Line,
    add_limit,
    add_lines,
    column,
    layout,
    mark_engine_events,
    mark_syncs,
    mark_validations,
    note_missing,
)

ENTROPY_HINT = "verl logs it with<br>actor_rollout_ref.actor.calculate_entropy=true<br>or a nonzero entropy_coeff"


def learning_figure(reports: Sequence[RunReport]) -> go.Figure:
    """Reward per batch and held-out accuracy, against step (left) and wall time (right)."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("against trainer step", "against wall time"))
    reward = Line("reward (batch mean)", column("reward/mean"), REWARD)
    val = [Line("held-out accuracy", lambda run, x: _validation_series(run, x), ACCURACY, smoothed=False)]
    missing: list[str] = []
    for col, x in ((1, "step"), (2, "wall")):
        missing += add_lines(fig, reports, [reward], x, row=1, col=col, legend=col == 1)
        missing += add_lines(fig, reports, val, x, row=1, col=col, legend=col == 1)
        mark_validations(fig, reports, x, row=1, col=col)
    fig.update_xaxes(title_text="trainer step", row=1, col=1)
    fig.update_xaxes(title_text="wall time (s)", row=1, col=2)
    note_missing(fig, sorted(set(missing)), drew=len(missing) < 4)
    return layout(fig, "Is it learning? Reward and held-out accuracy (dotted: validations)", "", "reward / accuracy")


def _validation_series(run: RunRecords, x: str) -> tuple[list[float], list[float]]:
    points = validation_points(run)
    if x == "step":
        return [float(s) for s, _ in points], [a for _, a in points]
    times = step_times(run)
    kept = [(times.get(s, 0.0 if s == 0 else None), a) for s, a in points]
    return [t for t, _ in kept if t is not None], [a for t, a in kept if t is not None]


def series_figure(
    reports: Sequence[RunReport],
    title: str,
    lines: Sequence[Line],
    y_title: str,
    syncs: bool = False,
    percent: bool = False,
) -> go.Figure:
    """One panel of lines against the trainer step; with `syncs`, the weight syncs marked and the title saying how."""
    fig = go.Figure()
    missing = add_lines(fig, reports, lines)
    note_missing(fig, missing, drew=len(missing) < len(lines) * len(reports))
    mark_validations(fig, reports)
    drawn = mark_syncs(fig, reports) if syncs else ""
    if percent:
        fig.update_yaxes(tickformat=PERCENT)
    return layout(fig, f"{title} ({drawn})" if drawn else title, "trainer step", y_title)


def idle_figure(reports: Sequence[RunReport]) -> go.Figure:
    lines = [
        Line("trainer idle", column("trainer/idle_frac"), TRAINER),
        Line("engines idle", column("engines/idle_frac"), ENGINES),
    ]
    return series_figure(
        reports,
        "Who waited: share of each step's time idle",
        lines,
        "idle share",
        syncs=True,
        percent=True,
    )


def throughput_figure(reports: Sequence[RunReport]) -> go.Figure:
    """Generated and trained tokens/s, with the engine set's changes marked (the throughput before and after)."""
    lines = [
        Line("generated tokens/s", column("rollout/tokens_per_s"), GENERATED),
        Line("trained tokens/s", lambda run, x: trained_tokens_per_s(run, x), TRAINED),
    ]
    fig = series_figure(reports, "Throughput", lines, "tokens / s", syncs=True)
    mark_engine_events(fig, reports)
    return fig


def has_engine_changes(reports: Sequence[RunReport]) -> bool:
    """Whether any run changed its engine set (engine_events.jsonl) or logged `engines/active`."""
    return any(report.engine_events or report.run.has("engines/active") for report in reports)


def engines_figure(reports: Sequence[RunReport]) -> go.Figure:
    """The engines active at each step (a step line: the count holds until the next change) and every join, leave,
    loss, restart and move of the engine set, labelled."""
    fig = go.Figure()
    missing = []
    for i, report in enumerate(reports):
        xs, ys = report.run.series("engines/active")
        name = "engines active" if len(reports) == 1 else f"{report.label}: engines active"
        if not xs:
            missing.append(name)
            continue
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="lines",
                line={"color": ENGINES if len(reports) == 1 else RUN_COLOURS[i % len(RUN_COLOURS)], "width": 2.2},
                line_shape="hv",
                name=name,
                hovertemplate="%{y:.0f} engines",
            )
        )
    note_missing(fig, [f"engines/active ({name})" for name in missing], drew=len(missing) < len(reports))
    marked = mark_engine_events(fig, reports)
    counts = [y for t in fig.data if t.name and t.name.endswith("engines active") for y in t.y]
    counts += [e.engines_active for r in reports for e in r.engine_events if e.engines_active is not None]
    top = max(counts, default=1)
    # the primary axis only (update_yaxes would move the events' overlay axis too); room for the labels above
    fig.layout.yaxis.update(range=[0, top + 0.9], tick0=0, dtick=max(1, math.ceil(top / 8)))
    said = f"{marked} change(s) marked" if marked else "no engine_events.jsonl"
    return layout(fig, f"Engines: how many were active, and each change of the set ({said})", "trainer step", "engines")


def pipeline_figure(reports: Sequence[RunReport]) -> go.Figure:
    """Groups generating, waiting in the queue, and ahead of the trainer, with the limits that bound them: the
    staleness budget (core/versions.groups_ahead_budget: at most (η + 1)·B groups, B = K·required_samples, started and
    not yet taken by the trainer, right after a sync) and the queue's capacity."""
    lines = [
        Line(
            "generating (started - finished)", _difference("rollout/groups_started", "rollout/groups_queued"), ENGINES
        ),
        Line("waiting in the queue", column("queue/size"), GENERATED),
        Line(
            "ahead of the trainer (started - taken)", _difference("rollout/groups_started", "queue/total_got"), TRAINER
        ),
    ]
    fig = series_figure(reports, "Rollout pipeline (groups); dashed: its limits", lines, "groups", syncs=True)
    report = reports[0]
    info = report.info
    if info is not None and None not in (info.max_staleness, info.sync_every, info.required_samples):
        budget = groups_ahead_budget(info.max_staleness, info.required_samples, info.sync_every)
        add_limit(fig, budget, f"staleness budget (η+1)·B = {budget} groups")
    capacity = report.run.last("queue/max_size") or (info.queue_capacity if info else None)
    if capacity:
        add_limit(fig, capacity, f"queue capacity {capacity:.0f} groups")
    return fig


def _difference(minuend: str, subtrahend: str) -> Getter:
    def get(run: RunRecords, x: str) -> tuple[list[float], list[float]]:
        xs, a = run.series(minuend, x)
        other = dict(zip(*run.series(subtrahend, x), strict=True))
        kept = [(at, value - other[at]) for at, value in zip(xs, a, strict=True) if at in other]
        return [at for at, _ in kept], [v for _, v in kept]

    return get


def sync_figure(reports: Sequence[RunReport]) -> go.Figure:
    lines = [
        Line("engines paused", column("sync/pause_s"), ENGINES),
        Line("sync total", column("sync/total_s"), TRAINER),
    ]
    return series_figure(reports, "Weight syncs: seconds per sync", lines, "seconds")


def staleness_figure(reports: Sequence[RunReport]) -> go.Figure:
    """Three panels, one unit each: the staleness distribution per step range (first run), the staleness mean and
    max per step in versions with η drawn, and the share of trained rows whose tokens come from several versions."""
    fig = make_subplots(
        rows=1,
        cols=3,
        column_widths=[0.34, 0.38, 0.28],
        horizontal_spacing=0.08,
        subplot_titles=("trained groups by staleness, per step range", "staleness per step", "mixed-version rows"),
    )
    buckets = staleness_histograms(reports[0].run)
    for j, bucket in enumerate(buckets):
        total = sum(bucket.counts.values()) or 1.0
        ks = sorted(bucket.counts)
        fig.add_trace(
            go.Bar(
                x=[str(k) for k in ks],
                y=[bucket.counts[k] / total for k in ks],
                name=bucket.label,
                marker={"color": TRAINER, "opacity": 0.3 + 0.7 * (j + 1) / len(buckets)},
                hovertemplate="%{y:.1%}",
            ),
            row=1,
            col=1,
        )
    if not buckets:
        note_missing(fig, ["staleness/hist/*"], drew=False)
    lines = [
        Line("staleness mean", column("staleness/mean"), TRAINER),
        Line("staleness max", column("staleness/max"), "#444", smoothed=False),
    ]
    missing = add_lines(fig, reports, lines, row=1, col=2)
    note_missing(fig, missing, drew=len(missing) < 2 * len(reports), axis="2")
    mixed = Line("share of rows with several versions", _mixed_share, GENERATED)
    missing = add_lines(fig, reports, [mixed], row=1, col=3)
    note_missing(fig, missing, drew=len(missing) < len(reports), axis="3")
    info = reports[0].info
    top = max((report.run.last("staleness/max") or 0.0 for report in reports), default=0.0)
    if info is not None and info.max_staleness is not None:
        add_limit(fig, info.max_staleness, f"η = {info.max_staleness} (max_staleness)", row=1, col=2)
        top = max(top, float(info.max_staleness))
    fig.update_xaxes(title_text="versions behind", row=1, col=1)
    fig.update_yaxes(title_text="share of groups", tickformat=PERCENT, row=1, col=1)
    fig.update_xaxes(title_text="trainer step", row=1, col=2)
    # staleness counts whole versions: integer ticks (a tick every few versions when η is large)
    # headroom above η: its label sits over the line, where the staleness max (at η most of a run) would cross it
    fig.update_yaxes(
        title_text="versions behind",
        tick0=0,
        dtick=max(1, math.ceil(top / 8)),
        range=[-0.05 * max(top, 1.0), 1.2 * max(top, 1.0)],
        row=1,
        col=2,
    )
    fig.update_xaxes(title_text="trainer step", row=1, col=3)
    fig.update_yaxes(title_text="share of trained rows", tickformat=PERCENT, rangemode="tozero", row=1, col=3)
    return layout(fig, "Staleness of trained samples", "", "", height=HEIGHT + 20)


def _mixed_share(run: RunRecords, x: str) -> tuple[list[float], list[float]]:
    xs, mixed = run.series("partial/mixed_version_samples", x)
    rows = dict(zip(*run.series("advantages/num_rows", x), strict=True)) or dict(
        zip(*run.series("batch/samples", x), strict=True)
    )
    kept = [(a, m / rows[a]) for a, m in zip(xs, mixed, strict=True) if rows.get(a)]
    return [a for a, _ in kept], [s for _, s in kept]


ACTOR_PANELS = (
    ("policy loss", "actor/pg_loss"),
    ("clip fraction", "actor/pg_clipfrac"),
    ("KL to the old policy", "actor/ppo_kl"),
    ("entropy", "actor/entropy"),
    ("grad norm", "actor/grad_norm"),
    ("learning rate", "actor/lr"),
)


def actor_figure(reports: Sequence[RunReport]) -> go.Figure:
    """verl's actor metrics, one small panel each (their verl names in the titles)."""
    fig = make_subplots(
        rows=2,
        cols=3,
        subplot_titles=[f"{t} ({k})" for t, k in ACTOR_PANELS],
        vertical_spacing=0.2,
        horizontal_spacing=0.07,
    )
    for index, (title, key) in enumerate(ACTOR_PANELS):
        row, col = index // 3 + 1, index % 3 + 1
        missing = add_lines(fig, reports, [Line(title, column(key))], row=row, col=col, legend=False)
        hint = ENTROPY_HINT if key == "actor/entropy" else ""
        note_missing(
            fig, missing, drew=len(missing) < len(reports), hint=hint, axis="" if index == 0 else str(index + 1)
        )
        mark_validations(fig, reports, row=row, col=col)
    return layout(fig, "Policy update (verl's actor metrics)", "trainer step", "", height=2 * HEIGHT)


def length_figure(reports: Sequence[RunReport]) -> go.Figure:
    """Response length mean and max (left axis) and the share cut at data.max_response_length (right axis)."""
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    lines = [Line("mean", column("response_length/mean"), TRAINER), Line("max", column("response_length/max"), ENGINES)]
    missing = add_lines(fig, reports, lines)
    for i, report in enumerate(reports):
        xs, ys = report.run.series("response_length/clip_ratio")
        if not xs:
            missing.append("response_length/clip_ratio")
            continue
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=smooth(ys),
                mode="lines",
                name="clipped at max_response_length" if i == 0 else f"{report.label}: clipped",
                line={"color": "#d62728", "width": 1.5, "dash": DASHES[i % len(DASHES)]},
                hovertemplate="%{y:.1%}",
            ),
            secondary_y=True,
        )
    note_missing(fig, missing, drew=len(missing) < 3 * len(reports))
    # tickmode auto: make_subplots syncs a secondary axis's ticks to the primary's grid, which gives 18%, 37%, ...
    fig.update_yaxes(
        title_text="clipped share", tickformat=PERCENT, rangemode="tozero", tickmode="auto", secondary_y=True
    )
    return layout(fig, "Response length (tokens)", "trainer step", "tokens")


def ledger_figure(reports: Sequence[RunReport]) -> go.Figure:
    """Every sample's end state and the untrained ones by reason, on a log axis so 12 failed show beside 256k
    trained; each label says its count and its share of the issued samples (a zero draws no bar)."""
    fig = go.Figure()
    drew = False
    for i, report in enumerate(reports):
        t = report.totals
        issued = t.ledger.get("issued")
        rows = list(t.ledger_shares())
        rows += [(f"{k}", v, v / issued if issued else None) for k, v in ledger_drops(report.run).items() if "/" in k]
        if not rows:
            continue
        drew = True
        prefix = "" if len(reports) == 1 else f"{report.label}: "
        labels = [f"{prefix}{k}  {v:,.0f}" + (f" ({s:.2%})" if s is not None else "") for k, v, s in rows]
        fig.add_trace(
            go.Bar(
                y=labels,
                x=[v if v > 0 else None for _, v, _ in rows],
                orientation="h",
                name=report.label,
                marker={"color": RUN_COLOURS[i % len(RUN_COLOURS)]},
                hovertemplate="%{y}<extra></extra>",
            )
        )
    if not drew:
        note_missing(fig, ["ledger/*"], drew=False)
    largest = max((r.totals.ledger.get("issued", 1.0) for r in reports), default=1.0)
    fig.update_xaxes(type="log", range=[0, math.log10(max(largest, 10.0)) + 0.05])  # from 1 sample up
    fig.update_yaxes(autorange="reversed", automargin=True)
    fig.update_layout(showlegend=len(reports) > 1)
    issued = ", ".join(f"{r.totals.ledger.get('issued', 0):,.0f}" for r in reports)
    return layout(fig, f"Ledger: where every issued sample ended (issued: {issued}; log scale)", "samples", "")


def build_figures(reports: Sequence[RunReport]) -> list[tuple[str, go.Figure]]:
    """(section title, figure) in page order; "Engines" only for runs whose engine set changed."""
    return [
        ("Reward and held-out accuracy", learning_figure(reports)),
        ("Who waited", idle_figure(reports)),
        ("Throughput", throughput_figure(reports)),
        *([("Engines", engines_figure(reports))] if has_engine_changes(reports) else []),
        ("Staleness", staleness_figure(reports)),
        ("Rollout pipeline", pipeline_figure(reports)),
        ("Weight syncs", sync_figure(reports)),
        ("Policy update", actor_figure(reports)),
        ("Response length", length_figure(reports)),
        ("Ledger", ledger_figure(reports)),
    ]
