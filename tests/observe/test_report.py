"""The run report: parsing metrics.jsonl, the figures' data, the summary, missing metrics, the page, the CLI, a real
browser.

`tests/fixtures/report_run/` is a real run of the embedded default (60 steps, 2 cores shared with other jobs; recorded
again on 2026-12-08 at 11cfcd9, so its metrics are counted as runs count them now):
`python -m rllm.experimental.fully_async trainer.total_training_steps=60 trainer.test_freq=20
trainer.rollout_data_dir=RUN_DIR/dumps actor_rollout_ref.actor.calculate_entropy=true run.dir=RUN_DIR`, keeping its
metrics.jsonl, config.yaml (its run paths made relative) and the first 16 trajectories of the last step's dump.
"""

from __future__ import annotations

import html
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.image import imread

from rllm.experimental.fully_async.observe.summary import fold
from rllm.experimental.fully_async.report import data as rd
from rllm.experimental.fully_async.report import figures as rf
from rllm.experimental.fully_async.report import html as rh
from rllm.experimental.fully_async.report import plot as rp
from rllm.experimental.fully_async.report.cli import PREDICTION_FILE, load_report, load_run, main, write_report
from rllm.experimental.fully_async.report.plot import NOT_RECORDED

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "report_run"
T0 = 1_000_000.0


def _async_records() -> list[dict]:
    """Six steps of an async run: validation at 0 and 6, a staleness histogram, ledger with per-reason drops."""
    rows: list[dict] = [{"step": 0, "time": T0, "val/accuracy": 0.40}]
    for step in range(1, 7):
        rows.append(
            {
                "step": step,
                "trainer/step": step,
                "time": T0 + 2.0 * step,
                "timing/wait_batch_s": 0.05,
                "batch/samples": 64.0,
                "reward/mean": 0.1 * step,
                "batch/tokens": 1000.0,
                "timing/step_s": 0.5,
                "trainer/idle_frac": 0.1,
                "engines/idle_frac": 0.3,
                "rollout/tokens_per_s": 4000.0,
                "sync/pause_s": 0.1,
                "sync/total_s": 0.2,
                "queue/size": float(step),
                "staleness/mean": 0.5,
                "staleness/max": 1.0,
                "staleness/hist/0": 10.0,
                "staleness/hist/1": float(step),
                "ledger/issued": 100.0 * step,
                "ledger/trained": 80.0 * step,
                "ledger/filtered": 4.0,
                "ledger/filtered/zero_variance": 4.0,
                "ledger/failed": 2.0,
                "ledger/failed/reward_error": 2.0,
                "ledger/dropped_stale": 3.0,
                "ledger/in_flight": 10.0,
            }
        )
    rows.append({"step": 6, "time": T0 + 13.0, "val/accuracy": 0.55})
    return rows


def _sync_records() -> list[dict]:
    """An older, synchronous run: no histograms, no engine idle or generation throughput, no per-reason ledger."""
    rows: list[dict] = [{"step": 0, "time": T0, "val/accuracy": 0.41}]
    for step in range(1, 5):
        rows.append(
            {
                "step": step,
                "trainer/step": step,
                "time": T0 + 3.0 * step,
                "reward/mean": 0.05 * step,
                "batch/tokens": 900.0,
                "timing/step_s": 1.5,
                "trainer/idle_frac": 0.5,
                "staleness/mean": 0.0,
                "staleness/max": 0.0,
                "ledger/issued": 64.0 * step,
                "ledger/trained": 64.0 * step,
                "ledger/filtered": 0.0,
                "ledger/dropped_stale": 0.0,
                "ledger/failed": 0.0,
            }
        )
    return rows


def _write_run(path: Path, records: list[dict], tail: str = "") -> Path:
    path.mkdir(parents=True)
    text = "\n".join(json.dumps(r) for r in records) + "\n" + tail
    (path / "metrics.jsonl").write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def two_runs(tmp_path: Path) -> tuple[Path, Path]:
    return _write_run(tmp_path / "async_run", _async_records()), _write_run(tmp_path / "sync_run", _sync_records())


# --- parsing ---


def test_parse_skips_blank_lines_and_a_cut_off_last_line(caplog):
    lines = ['{"step": 1, "time": 5}', "", '{"step": 2, "time": 6}', '{"step": 3, "ti']
    records = rd.parse_metrics(lines, "m.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert "m.jsonl:4" in caplog.text


def test_parse_refuses_a_bad_line_in_the_middle_naming_it():
    with pytest.raises(rd.ReportDataError, match=r"m.jsonl:2: not JSON"):
        rd.parse_metrics(['{"step": 1}', "{oops", '{"step": 3}'], "m.jsonl")
    with pytest.raises(rd.ReportDataError, match=r"m.jsonl:1: expected a JSON object"):
        rd.parse_metrics(["[1, 2]"], "m.jsonl")


def test_load_run_names_a_directory_without_metrics(tmp_path):
    with pytest.raises(rd.ReportDataError, match=r"not found .*is .*a run directory"):
        load_run(tmp_path)


# --- derived data ---


def test_series_against_step_and_wall_time_skip_records_without_the_key():
    run = rd.RunRecords.of("r", _async_records())
    assert run.series("val/accuracy") == ([0.0, 6.0], [0.40, 0.55])
    # wall time 0 is the first step's start (its time minus timing/step_s): the initial validation came before it
    assert run.series("val/accuracy", x="wall") == ([-1.5, 11.5], [0.40, 0.55])
    assert run.series("reward/mean", x="wall")[0] == [0.5, 2.5, 4.5, 6.5, 8.5, 10.5]
    assert run.series("not/there") == ([], [])
    assert not run.has("not/there")


def test_trained_tokens_per_second_is_batch_tokens_over_step_time():
    run = rd.RunRecords.of("r", _sync_records())
    xs, ys = rd.trained_tokens_per_s(run)
    assert xs == [1.0, 2.0, 3.0, 4.0]
    assert ys == pytest.approx([600.0] * 4)


def test_staleness_histograms_sum_counts_per_step_range():
    buckets = rd.staleness_histograms(rd.RunRecords.of("r", _async_records()), ranges=2)
    assert [(b.first_step, b.last_step) for b in buckets] == [(1, 3), (4, 6)]
    assert buckets[0].counts == {0: 30.0, 1: 6.0}
    assert buckets[1].counts == {0: 30.0, 1: 15.0}
    assert buckets[0].label == "steps 1-3"
    assert rd.staleness_histograms(rd.RunRecords.of("r", _sync_records())) == []


def test_ledger_totals_and_drops_by_reason_come_from_the_last_record():
    run = rd.RunRecords.of("r", _async_records())
    assert {k: v for k, v in fold(run.records).ledger.items() if "/" not in k} == {
        "issued": 600.0,
        "trained": 480.0,
        "filtered": 4.0,
        "dropped_stale": 3.0,
        "failed": 2.0,
        "in_flight": 10.0,
    }
    assert rd.ledger_drops(run) == {"filtered/zero_variance": 4.0, "failed/reward_error": 2.0, "dropped_stale": 3.0}
    assert rd.ledger_drops(rd.RunRecords.of("s", _sync_records())) == {}


def test_summary_wall_time_is_first_step_start_to_last_step_end_over_resumed_stretches():
    rows = [
        {"step": 0, "time": 100.0, "val/accuracy": 0.4},
        {"trainer/step": 1, "time": 110.0, "timing/step_s": 2.0, "timing/wait_batch_s": 1.0},
        {"trainer/step": 2, "time": 112.0, "timing/step_s": 2.0, "timing/wait_batch_s": 0.0},
        # a crash, then a resume from the checkpoint of step 1: the gap does not count
        {"trainer/step": 2, "time": 500.0, "timing/step_s": 3.0, "timing/wait_batch_s": 3.0},
        {"trainer/step": 3, "time": 502.0, "timing/step_s": 2.0, "timing/wait_batch_s": 0.0},
    ]
    totals = fold(rows)
    assert totals.wall_s == (112.0 - 108.0) + (502.0 - 497.0)
    assert totals.trainer_idle == pytest.approx(4.0 / 9.0)  # Σ wait / Σ step time, not a mean of fractions
    assert totals.steps == 3


def test_summary_validation_first_best_last_at_the_step_measured():
    rows = [
        {"step": 0, "val/accuracy": 0.40},
        {"step": 500, "val/step": 300, "val/accuracy": 0.70},  # validation of step 300, logged at step 500
        {"step": 500, "val/step": 400, "val/accuracy": 0.77},
        {"step": 500, "val/accuracy": 0.75},  # the final validation
    ]
    totals = fold(rows)
    assert (totals.first_val, totals.best_val, totals.last_val) == ((0, 0.40), (400, 0.77), (500, 0.75))


def test_summary_staleness_mixed_share_and_ledger_shares():
    totals = fold(_async_records())
    assert totals.staleness_mean == 0.5 and totals.staleness_max == 1.0
    shares = {k: (v, s) for k, v, s in totals.ledger_shares()}
    assert shares["dropped_stale"] == (3.0, 3.0 / 600.0) and "issued" not in shares
    rows = [{"trainer/step": 1, "batch/samples": 8.0, "advantages/num_rows": 16.0,
             "partial/mixed_version_samples": 4.0}]  # fmt: skip
    assert fold(rows).mixed_version_share == 0.25  # per training row (a turn), not per episode


def test_smoothing_is_a_debiased_moving_average_that_keeps_a_constant():
    assert rd.smooth([2.0] * 10, points=4) == pytest.approx([2.0] * 10)
    smoothed = rd.smooth([0.0] * 5 + [1.0] * 5, points=4)
    assert smoothed[4] == 0.0 and 0.0 < smoothed[5] < smoothed[9] < 1.0


# --- the real run (tests/fixtures/report_run) ---


@pytest.fixture(scope="module")
def real() -> rd.RunReport:
    return load_report(FIXTURE, with_prediction=False)


def test_real_run_mode_model_and_limits_come_from_its_config(real):
    info = real.info
    assert info.mode == "fully async: η=1, K=1, partial rollouts"
    assert info.lr == 3e-4 and "task addition" in info.model and info.estimator == "grpo"
    assert info.queue_capacity == 192 and (info.required_samples, info.samples_per_prompt) == (64, 8)


def test_real_run_summary_matches_what_the_run_printed_at_its_end(real):
    # The run's own end-of-run summary said: 60 steps, wall time 0:27, trainer idle 24%, engines 42%,
    # held-out 43.4% -> 45.7%, ledger trained 30,720 (98.4%).
    t = real.totals
    assert t.steps == 60 and round(t.wall_s) == 27
    assert (round(t.trainer_idle, 2), round(t.engines_idle, 2)) == (0.24, 0.42)
    assert [s for s, _ in t.validations] == [0, 20, 40, 60]
    assert t.first_val[1] == pytest.approx(0.434, abs=1e-3) and t.last_val[1] == pytest.approx(0.457, abs=1e-3)
    assert t.ledger["trained"] == 30720 and t.ledger["trained"] / t.ledger["issued"] == pytest.approx(0.984, abs=1e-3)


def test_real_run_logs_verl_metric_names_beside_its_own(real):
    last = [r for r in real.run.records if "trainer/step" in r][-1]
    assert last["critic/score/mean"] == pytest.approx(last["reward/mean"])
    assert last["response_length/max"] <= 6 and 0.0 <= last["response_length/clip_ratio"] <= 1.0
    assert last["training/global_step"] == last["trainer/step"] == 60
    assert last["timing_s/update_actor"] == last["timing/update_s"]
    assert "actor/entropy" in last


def test_sample_generations_come_from_the_last_dumped_step(real):
    assert real.samples_step == 60
    assert 1 <= len(real.samples) <= 4
    best, worst = real.samples[0], real.samples[-1]
    assert best.reward >= worst.reward
    assert all(s.versions and s.prompt.endswith("=") for s in real.samples)
    assert len({s.prompt for s in real.samples}) == len(real.samples)  # one per prompt


def test_every_figure_draws_the_real_run(real):
    for title, fig in rf.build_figures([real]):
        assert fig.data, title
        notes = [a.text for a in fig.layout.annotations if NOT_RECORDED in (a.text or "")]
        assert not notes, (title, notes)


def test_limits_and_moments_are_drawn(real):
    figures = dict(rf.build_figures([real]))
    pipeline = figures["Rollout pipeline"]
    limits = {round(s.y0) for s in pipeline.layout.shapes if s.y0 == s.y1 and s.type == "line"}
    assert {128, 192} <= limits  # the (η+1)·B staleness budget and the queue capacity
    staleness = figures["Staleness"]
    assert any("η = 1" in (a.text or "") for a in staleness.layout.annotations)
    idle = figures["Who waited"]
    validations = [s.x0 for s in idle.layout.shapes if s.x0 == s.x1]
    assert validations == [0, 20, 40, 60]
    # K=1: a sync after every step; 60 ticks would merge into a solid comb, so the title says the cadence instead
    assert not any((t.name or "").startswith("weight sync") for t in idle.data)
    assert idle.layout.title.text.endswith("(weight sync after every step (60 syncs))")
    colours = {t.name: t.line.color for t in idle.data if t.name in ("trainer idle", "engines idle")}
    assert colours["trainer idle"] != colours["engines idle"]
    raw = [t for t in idle.data if (t.name or "").endswith("(raw)")]
    assert raw and all(t.opacity < 0.5 for t in raw)  # raw values faint under the smoothed line


def _synced(name: str, steps: list[int]) -> rd.RunReport:
    """A run whose steps ended with a weight sync at `steps`."""
    last = max(steps)
    rows = [{"step": s, "trainer/step": s} | ({"sync/total_s": 0.1} if s in steps else {}) for s in range(1, last + 1)]
    return rd.run_report(rd.RunRecords.of(name, rows))


@pytest.mark.parametrize(
    ("steps", "ticks", "said"),
    [
        (list(range(4, 61, 4)), list(range(4, 61, 4)), None),  # K=4, 60 steps: 15 ticks, one per sync
        (list(range(4, 501, 4)), None, "a weight sync every 4 steps (125 syncs)"),  # K=4, 500 steps
        (list(range(1, 501)), None, "weight sync after every step (500 syncs)"),  # K=1, 500 steps
    ],
    ids=["K=4-sparse", "K=4-dense", "K=1-dense"],
)
def test_sync_marks_are_readable_at_every_cadence(steps, ticks, said):
    fig = rf.idle_figure([_synced("run", steps)])
    rug = [t for t in fig.data if t.name == "weight sync"]
    if ticks is not None:
        assert list(rug[0].x) == ticks and fig.layout.title.text.endswith("(ticks: weight syncs)")
    else:
        assert not rug and fig.layout.title.text.endswith(f"({said})")


def test_irregular_dense_syncs_are_aggregated_into_few_marks():
    import random

    steps = sorted(random.Random(0).sample(range(1, 1001), 300))
    fig = rf.idle_figure([_synced("run", steps)])
    (rug,) = [t for t in fig.data if t.name == "weight syncs"]
    assert len(rug.x) <= rp.SPARSE_SYNCS
    counts = [int(re.match(r"(\d+) syncs", text).group(1)) for text in rug.hovertext]
    assert sum(counts) == 300 and "one mark per" in fig.layout.title.text


def test_reward_and_held_out_accuracy_have_colours_of_their_own(real):
    fig = rf.learning_figure([real])
    colours = {t.name: t.line.color for t in fig.data if t.name in ("reward (batch mean)", "held-out accuracy")}
    assert len(colours) == 2 and colours["reward (batch mean)"] != colours["held-out accuracy"]
    other = {rp.TRAINER, rp.ENGINES, rp.GENERATED, rp.TRAINED}
    assert not set(colours.values()) & other  # one quantity, one colour, across the report


def test_staleness_is_drawn_in_versions_and_the_mixed_share_in_percent_on_its_own_axis(real):
    fig = rf.staleness_figure([real])
    axes = {a: fig.layout[a] for a in ("yaxis2", "yaxis3")}
    assert axes["yaxis2"].title.text == "versions behind" and "%" not in (axes["yaxis2"].tickformat or "")
    assert axes["yaxis2"].dtick == 1  # η = 1: whole versions
    # room above the η line for its label, which a run at η (most of its steps) would otherwise run through
    eta = next(a for a in fig.layout.annotations if (a.text or "").startswith("η = 1"))
    assert axes["yaxis2"].range[1] >= 1.15 and eta.bgcolor is not None
    assert axes["yaxis3"].tickformat == rp.PERCENT  # 0.25% reads 0.25%, not 0%
    mixed = next(t for t in fig.data if t.name == "share of rows with several versions")
    assert mixed.yaxis == "y3"
    stale = next(t for t in fig.data if t.name == "staleness mean")
    assert stale.yaxis == "y2"


def test_code_in_the_summary_is_set_as_code_not_backticks():
    report = rd.run_report(rd.RunRecords.of("run", _async_records()), prediction_note="fitted (`simulate --from run`)")
    block = rh.summary_block(report, 0)
    assert "<code>simulate --from run</code>" in block and "`" not in block


def test_a_metric_a_run_lacks_is_said_on_its_panel():
    sync = rd.run_report(rd.RunRecords.of("sync_run", _sync_records()))
    actor = rf.actor_figure([sync])
    notes = [a.text for a in actor.layout.annotations if NOT_RECORDED in (a.text or "")]
    assert len(notes) == 6 and any("calculate_entropy=true" in n for n in notes)
    # Two runs that both lack entropy: each named on a line of its own, so the note keeps inside its panel
    other = rd.run_report(rd.RunRecords.of("other_sync_run", _sync_records()))
    both = rf.actor_figure([sync, other])
    entropy = next(a for a in both.layout.annotations if "calculate_entropy=true" in (a.text or ""))
    assert entropy.text.split("<br>")[:3] == [f"{NOT_RECORDED}:", "sync_run: entropy", "other_sync_run: entropy"]
    # centred on its panel (entropy: the left column), not left-anchored there by plotly's "auto" (x < 1/3)
    panel = both.layout.xaxis4.domain
    assert (entropy.x, entropy.xanchor, entropy.yanchor) == ((panel[0] + panel[1]) / 2, "center", "middle")
    idle = rf.idle_figure([sync])
    assert any("engines idle" in (a.text or "") for a in idle.layout.annotations)


# --- the page ---


def test_page_is_self_contained_with_a_summary_block_per_run(tmp_path, real):
    other = rd.run_report(rd.RunRecords.of("sync_run", _sync_records()))
    page = rh.render_html([real, other])
    markup = re.sub(r"<script>.*?</script>", "", page, flags=re.S)  # plotly.js itself names URLs it never loads
    assert "<script src" not in page and not re.search(r'(src|href)="(https?:)?//', markup) and "<link" not in markup
    assert page.count('class="plotly-graph-div"') == len(rf.build_figures([real, other]))
    assert "Plotly.newPlot" in page and len(page) > 3_000_000  # plotly.js inlined
    assert page.count('class="run"') == 2
    assert "fully async: η=1, K=1, partial rollouts" in page
    assert "43.4%@0 first → 45.7%@60 best → 45.7%@60 last" in page
    assert "trained 30,720 (98.36%)" in page
    assert "No trajectory dump" not in page and "step 60 (best and worst rewards)" in page


def test_the_synchronous_prediction_is_read_from_its_cache_while_the_metrics_are_unchanged(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    stat = (run / "metrics.jsonl").stat()
    saved = {"measured_s": 26.5, "predicted_self_s": 26.6, "synchronous_s": 38.0, "other_mode": "synchronous",
             "other_s": 38.0}  # fmt: skip
    key = {"metrics_bytes": stat.st_size, "metrics_mtime_ns": stat.st_mtime_ns}
    (run / PREDICTION_FILE).write_text(json.dumps({"key": key, "prediction": saved}))
    report = load_report(run)
    assert report.prediction == rd.SyncPrediction(**saved)
    rows = dict(rh.summary_rows(report))
    assert rows["synchronous run"].startswith(
        "a synchronous run of the same config (η=0, K=1, the same engines and trainer on the same cores) would take "
        "0:38 (38 s)"
    )
    assert "async saved 30%" in rows["synchronous run"] and f"simulate --from {run}" in rows["synchronous run"]


@pytest.mark.slow
def test_the_synchronous_prediction_fits_the_real_run(tmp_path):
    """The fit itself (simulate/from_run.py) on the fixture: it reproduces the run's own wall time and predicts
    a slower synchronous run (the run's trainer waited 24% of the time)."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    report = load_report(run, quiet=True)
    p = report.prediction
    assert p is not None, report.prediction_note
    assert abs(p.predicted_self_s / p.measured_s - 1) < 0.15
    assert p.synchronous_s > p.measured_s
    assert (run / PREDICTION_FILE).is_file()


# --- CLI ---


def test_cli_writes_the_page_and_prints_its_path(two_runs, tmp_path, capsys):
    out = tmp_path / "cmp" / "report.html"
    assert main([str(two_runs[0]), str(two_runs[1]), "--out", str(out), "--no-predict"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_text().count('class="plotly-graph-div"') == 9


def test_cli_default_output_is_inside_a_single_run_dir(two_runs):
    assert write_report([two_runs[0]], with_prediction=False) == two_runs[0] / "report.html"


def test_cli_reports_a_bad_run_dir_in_one_line_exit_2(tmp_path):
    bad = _write_run(tmp_path / "bad", _sync_records(), tail='{"x": 1}\nnot json\n{"y": 2}\n')
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "rllm.experimental.fully_async", "report", str(bad)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: {bad}/metrics.jsonl:7: not JSON (Expecting value)"]
    assert not (tmp_path / "report.html").exists()


# --- a real browser ---

# After load: for every plotly figure, how many traces plotly drew (SVG groups with class "trace"), by its section.
_CHECK_SCRIPT = (
    '<script>window.addEventListener("load",()=>{setTimeout(()=>{document.body.setAttribute("data-drawn",'
    "JSON.stringify([...document.querySelectorAll('section')].map(s=>[s.dataset.figure,"
    "s.querySelectorAll('.main-svg .trace').length])));},500);});</script>"
)


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-headless-shell")


def _browser(*args: str) -> subprocess.CompletedProcess:
    # No name resolves: the page must draw from what it holds (plotly.js inlined).
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--host-resolver-rules=MAP * ~NOTFOUND", "--virtual-time-budget=20000", *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


@pytest.mark.slow  # a headless browser renders every figure (~12 s on a busy 2-core machine)
@pytest.mark.skipif(_chromium() is None, reason="no chromium on PATH (Debian: apt-get install -y chromium)")
def test_every_figure_renders_in_headless_chromium(tmp_path):
    """The written page (the real run beside a synchronous one) loaded in a real browser: plotly drew traces in
    every figure, and a screenshot of the whole page shows them. A section whose figure is never plotted, added to
    the same page, proves the check can fail. The screenshots are kept in the test's folder."""
    run = tmp_path / "real"
    shutil.copytree(FIXTURE, run)
    other = _write_run(tmp_path / "sync_run", _sync_records())
    page = write_report([run, other], tmp_path / "report.html", with_prediction=False).read_text()
    checked = tmp_path / "checked.html"
    broken = '<section data-figure="broken"><div class="plotly-graph-div"></div></section>'
    checked.write_text(page.replace("</body>", broken + _CHECK_SCRIPT + "</body>"))
    proc = _browser("--dump-dom", checked.as_uri())
    found = re.search(r'data-drawn="([^"]*)"', proc.stdout)
    assert found, f"chromium printed no checked DOM: {proc.stderr[-2000:]}"
    drawn = dict(json.loads(html.unescape(found.group(1))))
    assert drawn.pop("broken") == 0
    titles = [title for title, _ in rf.build_figures([load_report(run, with_prediction=False)])]
    assert set(drawn) == set(titles)
    assert all(count > 0 for count in drawn.values()), drawn
    shot = tmp_path / "report.png"
    proc = _browser("--window-size=1300,5600", f"--screenshot={shot}", (tmp_path / "report.html").as_uri())
    assert shot.is_file(), proc.stderr[-2000:]
    pixels = imread(io.BytesIO(shot.read_bytes()), format="png")
    assert pixels.shape[:2] == (5600, 1300)
    # Drawn, not blank: many distinct colours over the page and ink in every vertical fifth of it.
    assert len({tuple(p) for p in pixels[::7, ::7, :3].reshape(-1, 3).round(2).tolist()}) > 50
    for part in range(5):
        band = pixels[part * 1120 : (part + 1) * 1120, :, :3]
        assert (band < 0.5).any(), f"band {part} of the screenshot is blank"


# After load: what a reader sees of the properties issue 32 named, read from the drawn SVG and the page's text.
_PROPS_SCRIPT = (
    '<script>window.addEventListener("load",()=>{setTimeout(()=>{'
    'const sec=n=>document.querySelector(`section[data-figure="${n}"]`);'
    "const ticks=(n,c)=>[...sec(n).querySelectorAll(`.${c} text`)].map(t=>t.textContent);"
    "const title=n=>sec(n).querySelector('.gtitle').textContent;"
    "document.body.setAttribute('data-props',JSON.stringify({"
    "staleness_axis:ticks('Staleness','y2tick'),mixed_axis:ticks('Staleness','y3tick'),"
    "idle_title:title('Who waited'),idle_points:sec('Who waited').querySelectorAll('.scatterlayer .point').length,"
    "backtick:document.body.innerText.includes(String.fromCharCode(96)),"
    "code:[...document.querySelectorAll('.run code')].map(c=>c.textContent)}));},500);});</script>"
)


@pytest.mark.slow  # a headless browser renders the page (~10 s on a busy 2-core machine)
@pytest.mark.skipif(_chromium() is None, reason="no chromium on PATH (Debian: apt-get install -y chromium)")
def test_the_page_reads_right_in_headless_chromium(tmp_path):
    """The fixture's page as a browser draws it: the staleness axis in whole versions (no %), the mixed-version
    share on its own percent axis, the K=1 syncs said once (no comb of ticks), code set as code (no backtick
    anywhere in the page's text). The screenshot is kept in the test's folder (report.png)."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    stat = (run / "metrics.jsonl").stat()
    key = {"metrics_bytes": stat.st_size, "metrics_mtime_ns": stat.st_mtime_ns}
    saved = {"measured_s": 98.0, "predicted_self_s": 97.6, "synchronous_s": 142.6, "other_mode": "synchronous",
             "other_s": 142.6}  # fmt: skip
    (run / PREDICTION_FILE).write_text(json.dumps({"key": key, "prediction": saved}))
    page = write_report([run], tmp_path / "report.html").read_text()
    checked = tmp_path / "checked.html"
    checked.write_text(page.replace("</body>", _PROPS_SCRIPT + "</body>"))
    proc = _browser("--dump-dom", checked.as_uri())
    found = re.search(r'data-props="([^"]*)"', proc.stdout)
    assert found, f"chromium printed no checked DOM: {proc.stderr[-2000:]}"
    props = json.loads(html.unescape(found.group(1)))
    assert props["staleness_axis"] and not any("%" in t for t in props["staleness_axis"]), props
    assert set(props["staleness_axis"]) <= {"0", "1"}  # η = 1: whole versions
    assert props["mixed_axis"] and all(t.endswith("%") for t in props["mixed_axis"])
    assert len(set(props["mixed_axis"])) == len(props["mixed_axis"])  # no two ticks read the same (1%, 0%, 0%)
    assert props["idle_title"].endswith("(weight sync after every step (60 syncs))") and props["idle_points"] == 0
    assert not props["backtick"] and props["code"] == [f"simulate --from {run}"]
    shot = tmp_path / "report.png"
    _browser("--window-size=1300,5600", f"--screenshot={shot}", (tmp_path / "report.html").as_uri())
    assert shot.is_file()


def test_each_eta_change_of_adaptive_staleness_is_a_line_in_the_report():
    rows = _async_records()
    for r in rows[1:7]:
        r["staleness/eta"] = 4.0
    rows[3] |= {"staleness/eta": 5.0, "staleness/eta_change": 1.0, "adaptive/ess": 0.93, "adaptive/kl": 0.004}
    rows[5] |= {"staleness/eta": 4.0, "staleness/eta_change": -1.0, "adaptive/ess": 0.61, "adaptive/cut": 0.035}
    runs = [rd.RunRecords.of("adaptive_run", rows), rd.RunRecords.of("sync_run", _sync_records())]
    assert [c.line() for c in rd.eta_changes(runs[0])] == [
        "step 3: η 4 → 5 (ess 0.930, kl 0.0040)",
        "step 5: η 5 → 4 (ess 0.610, cut 3.5%)",
    ]
    reports = [rd.run_report(run) for run in runs]
    section = rh.eta_section(reports)
    assert section.startswith("<h2>Adaptive staleness</h2><h3>adaptive_run (final η 4)</h3>")
    assert "<li>step 5: η 5 → 4 (ess 0.610, cut 3.5%)</li>" in section and "sync_run (final" not in section
    assert rh.eta_section(reports[1:]) == ""
