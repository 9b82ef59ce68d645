"""The report's timeline of the engine set (issue 34): RUN_DIR/engine_events.jsonl's joins, leaves, losses,
restarts and moves as labelled lines on the throughput and engines figures, `engines/active` as a step line, a line
in the summary; a run without the file renders as before.

The fixture writes engine_events.jsonl to the runtime's contract: one JSON object per line with `time`, `step`,
`event` (join | leave | lost | restart | move), `engine`, `url`, `samples_moved`, `engines_active` (after the event)
and `source` (launched | registered).
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from rllm.experimental.fully_async.report import data as rd
from rllm.experimental.fully_async.report import figures as rf
from rllm.experimental.fully_async.report import html as rh
from rllm.experimental.fully_async.report.cli import load_report, main, write_report

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "report_run"

T0 = 1_000_000.0
ACTIVE = {1: 1, 2: 1, 3: 3, 4: 3, 5: 2, 6: 2, 7: 1, 8: 2}  # engines/active per step, as the events leave it


def _metrics(engines_active: bool = True) -> list[dict]:
    rows = []
    for step in range(1, 9):
        row = {
            "step": step,
            "trainer/step": step,
            "time": T0 + 2.0 * step,
            "timing/step_s": 2.0,
            "batch/tokens": 1000.0,
            "rollout/tokens_per_s": 1000.0 * ACTIVE[step],
            "trainer/idle_frac": 0.1,
            "sync/total_s": 0.1,
        }
        if engines_active:
            row["engines/active"] = ACTIVE[step]
        rows.append(row)
    return rows


def _event(
    step: int, event: str, engine: str, active: int, moved: int = 0, source: str = "launched", regenerated: int = 0
) -> dict:
    return {
        "time": T0 + 2.0 * step - 0.5,
        "step": step,
        "event": event,
        "engine": engine,
        "url": f"http://127.0.0.1:{30000 + int(engine[-1])}",
        "samples_moved": moved,
        "tokens_regenerated": regenerated,
        "engines_active": active,
        "source": source,
    }


EVENTS = [
    _event(3, "join", "engine-1", 2),
    _event(3, "join", "engine-2", 3),
    _event(5, "leave", "engine-1", 2, moved=3, regenerated=1),
    _event(6, "join", "ext-9", 3, source="registered"),
    _event(7, "lost", "engine-2", 2, moved=2),
    _event(7, "leave", "ext-9", 1, source="registered"),
    _event(8, "restart", "engine-2", 2),
]


def _run_dir(path: Path, events: list[dict] | None = EVENTS, engines_active: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in _metrics(engines_active)) + "\n")
    if events is not None:
        (path / "engine_events.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")
    return path


def _event_lines(fig) -> dict[float, str]:
    """Step -> label of the figure's dash-dotted vertical lines (the engine events)."""
    xs = [s.x0 for s in fig.layout.shapes if s.x0 == s.x1 and s.line.dash == "dashdot"]
    labels = {a.x: a.text for a in fig.layout.annotations if a.x in xs}
    return {x: labels[x] for x in xs}


def test_each_change_is_a_labelled_line_on_the_engines_and_throughput_figures(tmp_path: Path) -> None:
    report = load_report(_run_dir(tmp_path / "run"))
    assert len(report.engine_events) == len(EVENTS)
    figures = dict(rf.build_figures([report]))
    expected = {
        3: "+2 engines (launched)",
        5: "-1 engine, 3 samples moved, 1 token regenerated",
        6: "+1 engine (registered)",
        7: "-2 engines (1 lost), 2 samples moved",
        8: "1 engine restarted",
    }
    for title in ("Engines", "Throughput"):
        assert _event_lines(figures[title]) == expected, title
        (hover,) = [t for t in figures[title].data if t.name == "engine events"]
        assert list(hover.x) == list(expected)
        assert hover.hovertext[2] == "join ext-9 (http://127.0.0.1:30009, registered), 3 active"
        assert hover.hovertext[1] == (
            "leave engine-1 (http://127.0.0.1:30001, launched), 3 samples moved (1 token regenerated), 2 active"
        )
    engines = figures["Engines"]
    (active,) = [t for t in engines.data if t.name == "engines active"]
    assert active.line.shape == "hv"  # a count holds until the next change
    assert list(active.y) == [ACTIVE[s] for s in range(1, 9)]
    assert "5 change(s) marked" in engines.layout.title.text


def test_a_run_without_the_file_renders_as_before(tmp_path: Path) -> None:
    plain = load_report(_run_dir(tmp_path / "plain", events=None, engines_active=False))
    assert plain.engine_events == ()
    figures = rf.build_figures([plain])
    assert [title for title, _ in figures] == [
        "Reward and held-out accuracy",
        "Who waited",
        "Throughput",
        "Staleness",
        "Rollout pipeline",
        "Weight syncs",
        "Policy update",
        "Response length",
        "Ledger",
    ]
    throughput = dict(figures)["Throughput"]
    assert not _event_lines(throughput) and not [t for t in throughput.data if t.name == "engine events"]
    assert "engine changes" not in dict(rh.summary_rows(plain))


def test_engines_active_alone_draws_the_step_line_without_marks(tmp_path: Path) -> None:
    report = load_report(_run_dir(tmp_path / "run", events=None))
    engines = dict(rf.build_figures([report]))["Engines"]
    assert [t.name for t in engines.data] == ["engines active"]
    assert "no engine_events.jsonl" in engines.layout.title.text


def test_events_without_the_metric_say_it_is_not_recorded(tmp_path: Path) -> None:
    report = load_report(_run_dir(tmp_path / "run", engines_active=False))
    engines = dict(rf.build_figures([report]))["Engines"]
    notes = [a.text or "" for a in engines.layout.annotations]
    assert any("not recorded by this run" in n and "engines/active" in n for n in notes), notes
    assert len(_event_lines(engines)) == 5


def test_the_summary_counts_the_changes_and_the_page_carries_them(tmp_path: Path) -> None:
    report = load_report(_run_dir(tmp_path / "run"))
    line = dict(rh.summary_rows(report))["engine changes"]
    assert line == (
        "3 joined (2 launched, 1 registered), 2 left, 1 lost, 1 restarted; 5 samples moved (1 token regenerated); "
        "2 active after the last (engine_events.jsonl)"
    )
    page = rh.render_html([report])
    assert "-1 engine, 3 samples moved, 1 token regenerated" in page and 'data-figure="Engines"' in page


def test_an_event_without_a_step_is_placed_at_the_next_step_logged() -> None:
    run = rd.RunRecords.of("run", _metrics())
    lines = [json.dumps({"time": T0 + 7.2, "event": "join", "engine": "e", "source": "registered"})]
    (event,) = rd.parse_engine_events(lines, "engine_events.jsonl")
    (mark,) = rd.engine_marks(run, [event])
    # step 1 started at T0 (its record at T0 + 2, after 2 s): 7.2 s in is after step 3's record (6 s), at step 4's
    assert (mark.x, mark.label) == (4.0, "+1 engine (registered)")


def test_a_bad_event_line_is_refused_naming_it_and_a_cut_off_last_line_is_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = [json.dumps(e) for e in EVENTS[:2]]
    assert len(rd.parse_engine_events([*good, '{"time": 1, "ev'], "f")) == 2  # a run killed while writing
    with pytest.raises(rd.ReportDataError, match=r"f:2: not JSON"):
        rd.parse_engine_events([good[0], "oops", good[1]], "f")
    with pytest.raises(rd.ReportDataError, match="event 1 lacks `event` or `engine`"):
        rd.parse_engine_events([json.dumps({"step": 1, "engine": "e"})], "f")
    with pytest.raises(rd.ReportDataError, match="neither `step` nor `time`"):
        rd.parse_engine_events([json.dumps({"event": "join", "engine": "e"})], "f")
    run = _run_dir(tmp_path / "run", events=[])
    (run / "engine_events.jsonl").write_text(f"{good[0]}\n[1, 2]\n{good[1]}\n")
    assert main([str(run), "--no-predict"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "engine_events.jsonl:2: expected a JSON object" in err


def test_several_runs_name_the_run_in_each_label(tmp_path: Path) -> None:
    first = load_report(_run_dir(tmp_path / "a"))
    second = load_report(_run_dir(tmp_path / "b", events=EVENTS[:1]))
    engines = dict(rf.build_figures([first, second]))["Engines"]
    labels = set(_event_lines(engines).values()) | {a.text for a in engines.layout.annotations}
    assert f"{tmp_path / 'b'}: +1 engine (launched)" in labels
    assert {t.name for t in engines.data} >= {f"{tmp_path / 'a'}: engine events", f"{tmp_path / 'b'}: engine events"}


_ENGINES_SCRIPT = (
    '<script>window.addEventListener("load",()=>{setTimeout(()=>{'
    'const sec=n=>document.querySelector(`section[data-figure="${n}"]`);'
    "const notes=n=>[...sec(n).querySelectorAll('.annotation-text')].map(t=>t.textContent);"
    "document.body.setAttribute('data-engines',JSON.stringify({"
    "traces:sec('Engines').querySelectorAll('.main-svg .trace').length,"
    "engines:notes('Engines'),throughput:notes('Throughput')}));},500);});</script>"
)


@pytest.mark.slow  # a headless browser renders the page (~10 s on a busy 2-core machine)
@pytest.mark.skipif(
    shutil.which("chromium") is None, reason="no chromium on PATH (Debian: apt-get install -y chromium)"
)
def test_the_engine_changes_read_in_headless_chromium(tmp_path: Path) -> None:
    """The committed real run with engine events added (tests/fixtures/report_run): a browser draws the Engines
    figure's step line and markers and prints every label on both timelines."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    (run / "engine_events.jsonl").write_text("\n".join(json.dumps(e) for e in EVENTS) + "\n")
    page = write_report([run], tmp_path / "report.html", with_prediction=False).read_text()
    checked = tmp_path / "checked.html"
    checked.write_text(page.replace("</body>", _ENGINES_SCRIPT + "</body>"))
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--host-resolver-rules=MAP * ~NOTFOUND",
           "--virtual-time-budget=20000", "--dump-dom", checked.as_uri()]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    found = re.search(r'data-engines="([^"]*)"', proc.stdout)
    assert found, f"chromium printed no checked DOM: {proc.stderr[-2000:]}"
    drawn = json.loads(html.unescape(found.group(1)))
    assert drawn["traces"] >= 2  # the engines/active step line the run recorded, and the markers
    labels = {
        "+2 engines (launched)",
        "-1 engine, 3 samples moved, 1 token regenerated",
        "+1 engine (registered)",
        "1 engine restarted",
    }
    assert labels <= set(drawn["engines"]) and labels <= set(drawn["throughput"])
    assert not any("not recorded by this run" in text for text in drawn["engines"]), drawn
