"""The results tables of README.md and tests/bench/README.md are what tests/bench/results_tables.py writes from the
committed result files (tests/bench/results/), and the tables it writes say what the files say: each arm's Δ is paired
per seed against its own control and the best synchronous arm, the run order is the recorded one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _metrics
import _results
import _runs
import results_tables


def test_the_committed_tables_equal_the_regenerated_ones():
    for path in results_tables.DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        assert results_tables.regenerate(text) == text, (
            f"{path.name}: a results table differs from the result files; run tests/bench/results_tables.py"
        )


def _record(arm: str, seed: int, final: float, order: int, control: str | None = None, **summary) -> dict:
    return {
        "experiment": "demo",
        "arm": arm,
        "seed": seed,
        "order": order,
        "commit": "0123456789abcdef",
        "load_average": [1.0, 1.5],
        "params": {
            "task": "default",
            "regime": "rollout-bound",
            "steps": 100,
            "test_freq": 25,
            "threshold": 0.55,
            "control": control,
        },
        "ok": True,
        "summary": {
            "final_val_accuracy": final,
            "time_to_threshold_s": summary.pop("t", None),
            "train_wall_s": 100.0,
            "staleness_mean": 0.0,
            "staleness_max": 0.0,
            "pg_clipfrac_mean": summary.pop("clip", 0.0),
            "pg_clipfrac_early": 0.0,
            "idle_frac_total": 0.5,
            **summary,
        },
    }


def _demo(tmp_path: Path) -> Path:
    folder = tmp_path / "demo"
    arms = [
        # arm, control, finals per seed, time to threshold per seed
        ("sync", None, (0.50, 0.52), (None, 90.0)),
        ("sync-prev", None, (0.60, 0.64), (50.0, 40.0)),
        ("eta1-prev", "sync-prev", (0.63, 0.66), (30.0, 30.0)),
        ("eta8-prev", "sync-prev", (0.58, 0.60), (70.0, None)),
        ("eta1-adaptive-prev", "sync-prev", (0.61, 0.65), (45.0, 35.0)),
    ]
    for seed in (0, 1):
        for order, (arm, control, finals, times) in enumerate(arms[::-1] if seed else arms):
            record = _record(arm, seed, finals[seed], order, control, t=times[seed], clip=0.02 if control else 0.0)
            _results.write_record(_results.record_path(folder, arm, seed), record)
    return folder


def test_a_staleness_table_pairs_each_arm_with_its_control_and_the_best_sync(tmp_path):
    _demo(tmp_path)
    table = results_tables.render("staleness", "demo", tmp_path)
    rows = {
        line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in table.splitlines() if line.startswith("| ")
    }
    header = rows["arm"]
    assert "Δ vs best sync (sync-prev, pts)" in header
    delta_control, delta_best = header.index("Δ vs its control (pts)"), header.index("Δ vs best sync (sync-prev, pts)")
    # +3.0 and +2.0 points: under 3 points with 2 seeds, marked as noise
    assert rows["eta1-prev"][delta_control] == "+2.5 ± 0.7 (n=2 < 5: noise) (sync-prev)"
    assert rows["eta8-prev"][delta_best] == "-3.0 ± 1.4"  # -2.0 and -4.0 points
    assert rows["sync"][delta_best] == "-11.0 ± 1.4" and rows["sync-prev"][delta_best] == "-"
    time = header.index("time to 55% (s)")
    assert rows["eta8-prev"][time] == "70 (1/2)" and rows["sync"][time] == "90 (1/2)"
    assert "seed 0: sync, sync-prev, eta1-prev, eta8-prev, eta1-adaptive-prev" in table
    assert "seed 1: eta1-adaptive-prev, eta8-prev, eta1-prev, sync-prev, sync" in table
    # the fastest fixed η (both seeds at 30 s) and adaptive's distance: 10 s over 25 s intervals (100 s / 4)
    assert "fastest fixed η to 55%: eta1-prev (30 s, 2/2)" in table
    assert "eta1-adaptive-prev: 40 s (2/2), +0.4 validation intervals (25 s each)" in table


def test_regions_are_rewritten_between_their_markers_and_a_missing_folder_says_so(tmp_path):
    _demo(tmp_path)
    text = (
        "before\n<!-- results:staleness:demo -->\nSTALE TABLE\n<!-- /results:staleness:demo -->\nmiddle\n"
        "<!-- results:staleness:none -->\n<!-- /results:staleness:none -->\nafter\n"
    )
    new = results_tables.regenerate(text, tmp_path)
    assert new.startswith("before\n<!-- results:staleness:demo -->\n| arm |") and "STALE TABLE" not in new
    assert "middle\n<!-- results:staleness:none -->\n_No result files in `tests/bench/results/none/` yet" in new
    assert new.endswith("<!-- /results:staleness:none -->\nafter\n")
    assert results_tables.regenerate(new, tmp_path) == new


def test_an_unknown_kind_or_an_unclosed_region_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown results table kind 'plots'"):
        results_tables.regenerate("<!-- results:plots:demo -->\n<!-- /results:plots:demo -->\n", tmp_path)
    with pytest.raises(ValueError, match="no matching"):
        results_tables.regenerate("<!-- results:staleness:demo -->\n", tmp_path)


def _run_result(tmp_path: Path, final: float) -> _runs.RunResult:
    """A RunResult as `_runs.launch` returns it, over metrics.jsonl records of a 4-step run."""
    t0 = 1000.0
    rows: list[dict] = [{"step": 0, "time": t0 - 5, "val/accuracy": 0.434}]
    for step in range(1, 5):
        rows.append(
            {
                "time": t0 + 2.0 * step,
                "trainer/step": step,
                "timing/step_s": 1.0,
                "timing/wait_batch_s": 0.2,
                "batch/tokens": 100.0,
                "staleness/mean": 1.0,
                "staleness/max": 1.0,
                "actor/pg_clipfrac": 0.01,
            }
        )
    rows.append({"step": 4, "time": t0 + 12, "val/accuracy": final})
    return _runs.RunResult(
        label="x",
        run_dir=tmp_path,
        command=("python", "-m", "rllm.experimental.fully_async", "train"),
        returncode=0,
        timeout_s=100.0,
        wall_s=95.0,
        metrics=_metrics.summarize_metrics(rows),
        output_tail="",
        started_at=t0 - 40,
        load_average=(1.2, 1.4),
    )


@pytest.mark.parametrize("kind", ["staleness", "signals", "default-run", "async-vs-sync"])
def test_what_the_scripts_write_renders_in_each_table(kind, tmp_path):
    """The record writer the scripts use (`_results.run_record`) and each table's reader agree on the format."""
    folder = tmp_path / "made"
    params = {
        "staleness": {"task": "default", "regime": "trainer-bound", "steps": 4, "test_freq": 2, "threshold": 0.55},
        "signals": {},
        "default-run": {"candidate_overrides": [], "cache": "empty", "target_accuracy": 0.784, "target_wall_s": 120.0},
        "async-vs-sync": {"steps": 4, "repeats": 1},
    }[kind]
    for position, (arm, final) in enumerate([("sync", 0.5), ("async", 0.6)]):
        record = _results.run_record(
            _run_result(tmp_path, final),
            experiment="made",
            arm=arm,
            seed=0,
            order=position,
            overrides=["trainer.total_training_steps=4"],
            config=None,
            invocation="script.py",
            params=params | {"control": "sync" if arm == "async" else None},
            commit="0123456789abcdef+dirty",
            threshold=0.55,
        )
        _results.write_record(_results.record_path(folder, arm, 0), record)
    table = results_tables.render(kind, "made", tmp_path)
    if kind == "signals":  # cut = pg_clipfrac 0.01 (under max_cut 0.02), wait 0.2 of each step (above 0.1)
        assert "| async | n/a / n/a | n/a / n/a | 0.010 / n/a | 0.20 |" in table
        return
    assert "60.0%" in table and "| sync" in table
    if kind == "staleness":
        assert "+10.0 ± n/a (sync)" in table and "0123456789ab+dirty" in table and "0.010 / 0.010" in table
    if kind == "default-run":
        assert "43.4% → 60.0%" in table and "| 95 | 41 | 7 |" in table and "not met" in table
    if kind == "async-vs-sync":
        assert "sync / async training wall time (means over repeats): 1.00x" in table


def test_the_previous_cost_table_reads_the_benchmarks_files(tmp_path):
    record = {
        "experiment": "previous-cost",
        "arm": "cpu-tiny",
        "seed": 0,
        "order": 0,
        "commit": "0123456789abcdef",
        "date": "2026-11-28T00:00:00Z",
        "load_average": [1.0, 1.1],
        "params": {"device": "cpu", "model": "tiny (fsdp)", "parameters": 124416, "batch": [64, 64], "repeats": 5},
        "ok": True,
        "summary": {
            "recompute_forward_ms": 10.0,
            "previous_forward_ms": 12.0,
            "publish_ms": 1.0,
            "update_ms": 30.0,
            "held_mb": 1.0,
            "previous_over_recompute_step": 43.0 / 40.0,
        },
    }
    _results.write_record(tmp_path / "previous-cost" / "cpu-tiny-fsdp.json", record)
    table = results_tables.render("previous-cost", "previous-cost", tmp_path)
    assert "| cpu | tiny (fsdp) | 0.1M | 10.0 | 12.0 | 1.0 | 1.07x |" in table


def test_the_lora_table_pairs_each_seeds_gain_and_reports_the_trainable_share(tmp_path):
    """experiment_lora.py's records (`_results.run_record` plus its `lora` counts): the gain is end − start per run,
    and lora − full is paired per seed (seed 0: +4 − +16 = −12 points; seed 1: +20 − +10 = +10)."""
    folder = tmp_path / "lora-made"
    finals = {("full", 0): 0.594, ("lora", 0): 0.474, ("full", 1): 0.534, ("lora", 1): 0.634}
    shares = {
        "full": {"trainable_params": 124416, "total_params": 124416, "trainable_share": 1.0, "sync_bytes_fp32": 4096},
        "lora": {"trainable_params": 22528, "total_params": 146944, "trainable_share": 22528 / 146944},
    }
    shares["lora"] |= {"sync_bytes_fp32": 2048, "last_sync_file_bytes": 3072}
    for seed in (0, 1):
        for position, arm in enumerate(("full", "lora") if seed == 0 else ("lora", "full")):
            record = _results.run_record(
                _run_result(tmp_path, finals[arm, seed]),
                experiment="lora-made",
                arm=arm,
                seed=seed,
                order=position,
                overrides=[],
                config=None,
                invocation="experiment_lora.py",
                params={"task": "default", "steps": 4, "test_freq": 2},
                commit="0123456789abcdef",
            )
            record["lora"] = shares[arm]
            _results.write_record(_results.record_path(folder, arm, seed), record)
    table = results_tables.render("lora", "lora-made", tmp_path)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert "43.4% → 59.4%" in rows["full"] and "43.4% → 53.4%" in rows["full"]
    assert "+13.0 ± 4.2" in rows["full"] and "+12.0 ± 11.3" in rows["lora"]
    assert "22,528 of 146,944 (15.3%)" in rows["lora"] and "(100.0%)" in rows["full"]
    assert (
        "- lora − full, gain in points, paired per seed: seed 0 -12.0, seed 1 +10.0; mean -1.0 ± 15.6 (n=2)." in table
    )
    assert "seed 0: full then lora; seed 1: lora then full" in table
    assert "full 4 KiB (fp32 tensors); lora 2 KiB (fp32 tensors, 3 KiB on disk)" in table
