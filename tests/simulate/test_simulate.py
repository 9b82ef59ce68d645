"""The simulator: same decisions as the runtime's policy, deterministic, sync vs async behaviour, calibration, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rllm.experimental.fully_async.__main__ import main
from rllm.experimental.fully_async.core.staleness import StalenessManager, is_too_stale
from rllm.experimental.fully_async.simulate.calibrate import calibrate
from rllm.experimental.fully_async.simulate.engine import simulate
from rllm.experimental.fully_async.simulate.layout import synchronous
from rllm.experimental.fully_async.simulate.model import (
    EngineModel,
    LengthModel,
    Pipeline,
    SimConfig,
    SyncModel,
    TrainerModel,
)
from rllm.experimental.fully_async.simulate.published import predict_published
from rllm.experimental.fully_async.simulate.scenarios import ScenarioError, build_config, read_scenario

REPO = Path(__file__).resolve().parents[2]


def small(eta: int = 1, k: int = 1, partial: bool = True, steps: int = 12, reject: float = 0.0) -> SimConfig:
    return SimConfig(
        pipeline=Pipeline(
            required_samples=8,
            samples_per_prompt=4,
            max_staleness=eta,
            trigger_parameter_sync_step=k,
            partial_rollout=partial,
            max_concurrent_rollouts=96,
            num_engines=2,
            reject_fraction=reject,
        ),
        engine=EngineModel(peak_tokens_per_s=2000.0, single_tokens_per_s=100.0, max_running_requests=16),
        lengths=LengthModel(mean_tokens=60.0, sigma=0.8, max_tokens=400),
        trainer=TrainerModel(fixed_s=0.05, per_token_s=2e-4),
        sync=SyncModel(total_s=0.1, pause_s=0.05),
        steps=steps,
        seed=3,
    )


# ---- same decisions as the runtime's policy ----------------------------------------------------------------


@pytest.mark.parametrize("eta,k,reject", [(0, 1, 0.0), (1, 1, 0.2), (2, 2, 0.0), (1, 3, 0.3)])
def test_replayed_trace_gets_the_same_decisions_from_the_policy(eta: int, k: int, reject: float) -> None:
    """Replay the simulator's event sequence through a fresh StalenessManager, is_too_stale and the sync cadence:
    every capacity granted, every group dropped as stale and every sync must come out the same."""
    result = simulate(small(eta, k, reject=reject, partial=False), trace=True)
    manager = StalenessManager(groups_per_version=8 * k, max_staleness=eta)
    steps = syncs = drops = 0
    for event in result.trace:
        kind = event[0]
        if kind == "capacity":
            _, version, granted = event
            assert manager.capacity(version) == granted
        elif kind == "start":
            manager.on_start()
        elif kind == "finish":
            manager.on_finish(accepted=event[1])
        elif kind == "split":
            _, version, min_versions, n_stale = event
            assert sum(is_too_stale(v, version, eta) for v in min_versions) == n_stale
            if n_stale:
                manager.on_discarded(n_stale)
                drops += n_stale
        elif kind == "consumed":
            manager.on_consumed(event[1])
            steps += 1
        elif kind == "sync":
            _, step, new_version = event
            assert step == steps and step % k == 0 and new_version == syncs + 1
            syncs += 1
    assert steps == result.steps == 12 and syncs == result.syncs == 12 // k
    assert drops == result.dropped_stale_groups
    assert manager.counts().consumed == 12 * 8


def test_rejections_and_stale_drops_free_budget_so_the_run_finishes() -> None:
    result = simulate(small(eta=0, k=1, reject=0.4, steps=10))
    assert result.steps == 10
    # η = 0 with partial rollouts: groups a sync catches carry an older first token and are dropped
    assert all(s == 0 for s in result.staleness)


def test_staleness_never_exceeds_the_bound_and_async_drops_what_slipped() -> None:
    for eta in (0, 1, 2):
        result = simulate(small(eta=eta, steps=16))
        assert max(result.staleness) <= eta
        assert sum(result.staleness.values()) == 16 * 8


# ---- determinism --------------------------------------------------------------------------------------------


def test_same_seed_same_result_other_seed_differs() -> None:
    a, b = simulate(small(), trace=True), simulate(small(), trace=True)
    assert a == b
    other = small()
    other.seed = 4
    assert simulate(other).wall_s != a.wall_s


# ---- modes ---------------------------------------------------------------------------------------------------


def test_synchronous_mode_trainer_waits_while_engines_generate_and_engines_idle_while_it_trains() -> None:
    cfg = small(steps=10)
    sync, fast = simulate(synchronous(cfg)), simulate(cfg)
    assert sync.staleness == {0: 80}
    # every step waits for a whole batch: at least the time for the longest of its samples to decode
    assert min(sync.step_wait_s) > 0.05
    assert sync.trainer_idle_frac > 0.3
    # engines decode only while the trainer waits: their busy time fits inside the trainer's waits
    assert sync.engine_busy_s <= sync.num_engines * sync.trainer_wait_s + 1e-9
    assert fast.engine_busy_s > fast.num_engines * fast.trainer_wait_s  # async overlaps them
    assert fast.wall_s < sync.wall_s and fast.trainer_idle_frac < sync.trainer_idle_frac
    assert fast.mean_staleness > 0


def test_partial_rollout_marks_mixed_versions_and_drain_mode_does_not() -> None:
    cfg = small(eta=1, k=1, steps=10)
    cfg.lengths.mean_tokens = 300.0
    assert simulate(cfg).mixed_version_samples > 0
    cfg.pipeline.partial_rollout = False
    assert simulate(cfg).mixed_version_samples == 0


# ---- scenarios, calibration, CLI -----------------------------------------------------------------------------


def test_verl_scenario_runs_and_predictions_are_finite() -> None:
    import yaml

    raw = yaml.safe_load((REPO / "config/simulate/verl_dapo_qwen25_math_7b.yaml").read_text())
    sim, published = read_scenario(raw)
    assert len(published["rows"]) == 3
    # shrunk so the test is fast: one row, fewer samples; the full scenario runs from the CLI
    cfg = build_config(SimConfig(), [sim, {"steps": 12, "pipeline": {"required_samples": 16}}])
    block = {**published, "sync_prompts_per_step": 64, "rows": published["rows"][:1]}
    (row,) = predict_published(cfg, block)
    assert 0.1 < row.predicted < 100 and row.published == 2.66
    assert row.async_result.steps == 12


def test_unknown_scenario_key_is_refused() -> None:
    with pytest.raises(ScenarioError, match="engin"):
        build_config(SimConfig(), [{"engin": {"x": 1}}])
    with pytest.raises(ScenarioError, match="colour"):
        read_scenario({"simulate": {}, "colour": 1})


def _fixture_run(tmp_path: Path) -> Path:
    """A run dir written by the simulator itself, so the fit has a known truth to recover."""
    truth = small(eta=1, steps=15)
    result = simulate(truth)
    rows, t = [], 0.0
    for step, (end, wait) in enumerate(zip(result.step_end_s, result.step_wait_s, strict=True), start=1):
        step_s = end - t
        rows.append(
            {
                "step": step,
                "trainer/step": float(step),
                "time": 1000.0 + end,
                "timing/step_s": step_s,
                "timing/wait_batch_s": wait,
                "sync/total_s": 0.1,
                "sync/pause_s": 0.05,
                "batch/tokens": (step_s - wait - 0.1 - 0.05) / 2e-4,
                "response_length/mean": 60.0,
            }
        )
        t = end
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.yaml").write_text(
        "async_training: {required_samples: 8, max_staleness: 1, trigger_parameter_sync_step: 1,"
        " partial_rollout: true, max_concurrent_rollouts: 96, queue_max_groups: 24}\n"
        "actor_rollout_ref: {rollout: {n: 4}}\nengines: {num_engines: 2, max_running_requests: 16}\n"
        "data: {max_response_length: 400}\ntrainer: {total_training_steps: 15}\n"
    )
    return run


def test_from_run_fits_and_predicts_its_wall_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _fixture_run(tmp_path)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    base = build_config(
        SimConfig(),
        [
            {
                "pipeline": {
                    "required_samples": 8,
                    "samples_per_prompt": 4,
                    "num_engines": 2,
                    "max_concurrent_rollouts": 96,
                },
                "engine": {"max_running_requests": 16},
                "lengths": {"max_tokens": 400, "sigma": 0.8},
            }
        ],
    )
    fit = calibrate(base, records)
    predicted = simulate(fit.cfg).wall_s + fit.startup_s
    assert abs(predicted / fit.measured.wall_s - 1) < 0.15
    assert main(["simulate", "--from", str(run), "simulate.lengths.sigma=0.8"]) == 0
    out = capsys.readouterr().out
    assert "measured run: wall" in out and "synchronous" in out


def test_cli_bad_key_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "simulate.engine.bogus=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bogus" in err
    assert main(["simulate", "simulate.steps=0"]) == 2
    assert "steps" in capsys.readouterr().err


def test_cli_default_config_prints_both_modes_and_the_best_split(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--gpus", "4", "simulate.steps=6", "trainer.total_training_steps=6"]) == 0
    out = capsys.readouterr().out
    assert "synchronous" in out and "configured" in out and "best split:" in out
    assert "host sharing:" in out  # the default config is a CPU run: engines and trainer share this machine's cores


def test_cli_runs_a_scenario_file_and_refuses_project_keys_for_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(
        "description: tiny\nsimulate:\n  steps: 5\n  pipeline: {required_samples: 4, samples_per_prompt: 2}\n"
    )
    assert main(["simulate", "--config", str(scenario)]) == 0
    assert "tiny" in capsys.readouterr().out
    assert main(["simulate", "--config", str(scenario), "trainer.total_training_steps=3"]) == 2
    assert "simulate.*" in capsys.readouterr().err


def test_from_run_shows_its_progress_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The fit runs one simulation per step of its peak search; a line says so before the first and the rest are
    throttled off a terminal (observe/progress.py StatusPrinter), so a long fit is not silent and a log not
    flooded."""
    run = _fixture_run(tmp_path)
    assert main(["simulate", "--from", str(run), "simulate.lengths.sigma=0.8"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("[0:00] fitting the timing models to") and "(15 steps)" in err[0]
    assert len(err) < 16  # throttled: fewer lines than simulations


def test_status_printer_rewrites_one_line_on_a_terminal_and_throttles_elsewhere() -> None:
    import io

    from rllm.experimental.fully_async.observe.progress import StatusPrinter

    now = [0.0]
    log = io.StringIO()
    status = StatusPrinter(log, every_s=5.0, clock=lambda: now[0])
    for second in range(12):
        now[0] = float(second)
        status(f"simulation {second}")
    assert log.getvalue().splitlines() == ["[0:00] simulation 0", "[0:05] simulation 5", "[0:10] simulation 10"]

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    status = StatusPrinter(screen, clock=lambda: 0.0)
    status("first, longer line")
    status("second")
    status.close()
    shown = screen.getvalue()
    assert shown.startswith("\r[0:00] first, longer line\r[0:00] second  ")  # the second line covers the first
    assert shown.endswith("\r") and "\n" not in shown  # closed: the line blanked, the cursor at its start


def test_a_gpu_config_simulates_here_with_its_timing_models_stated(capsys: pytest.CaptureFixture[str]) -> None:
    """No GPU and no trainer.device=cpu: the config is loaded as for another machine, and the default timing
    models it is simulated with are printed (their numbers, so the reader knows what was assumed)."""
    argv = ["simulate", "--config", str(REPO / "config/gpu_fsdp_sglang.yaml"), "simulate.steps=4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "timing models: engine 20,000 tokens/s saturated" in out and "trainer 0s + 0.1ms/token" in out
    assert "host sharing" not in out  # GPUs: engines and trainer do not share cores


def test_timing_models_come_from_a_scenario_file_with_the_configs_pipeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    timing = tmp_path / "timing.yaml"
    timing.write_text(
        "simulate:\n  engine: {peak_tokens_per_s: 1234.0, single_tokens_per_s: 12.0}\n"
        "  pipeline: {required_samples: 999}\n"  # ignored: the config's pipeline is kept
    )
    config = str(REPO / "config/gpu_fsdp_sglang.yaml")
    assert main(["simulate", "--config", config, "--timing", str(timing), "simulate.steps=3"]) == 0
    out = capsys.readouterr().out
    assert "timing models: engine 1,234 tokens/s saturated (12 for one request" in out
    assert "3 steps of 128 groups" in out


def test_published_variants_predict_each_row_again_from_the_same_fit() -> None:
    """The README's two columns from one scenario: the colocated components as written, and with the stated
    factor; the variant changes only the async side, so it can only be faster here (a faster trainer, more
    staleness allowed)."""
    import yaml

    raw = yaml.safe_load((REPO / "config/simulate/verl_dapo_qwen25_math_7b.yaml").read_text())
    sim, published = read_scenario(raw)
    assert [v["name"] for v in published["variants"]] == ["separated_speedup=2.0 max_staleness=1"]
    cfg = build_config(SimConfig(), [sim, {"steps": 12, "pipeline": {"required_samples": 16}}])
    block = {**published, "sync_prompts_per_step": 64, "rows": published["rows"][:1]}
    (row,) = predict_published(cfg, block)
    ((name, with_factor),) = row.variants
    assert name == "separated_speedup=2.0 max_staleness=1" and with_factor > row.predicted
    with pytest.raises(ScenarioError, match="variants"):
        predict_published(cfg, {**block, "variants": [{"name": "x", "colour": 1}]})
