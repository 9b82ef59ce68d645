"""Host sharing in the simulator (engines and trainer on the same cores, as in a CPU run): the processor-sharing
model, the calibration that divides the measured contention out, and the cross-mode prediction it enables."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from test_simulate import small

from rllm.experimental.fully_async.__main__ import main
from rllm.experimental.fully_async.simulate.calibrate import calibrate
from rllm.experimental.fully_async.simulate.engine import simulate
from rllm.experimental.fully_async.simulate.layout import synchronous, with_gpus
from rllm.experimental.fully_async.simulate.model import HostModel, SimConfig
from rllm.experimental.fully_async.simulate.result import SimResult
from rllm.experimental.fully_async.simulate.scenarios import ScenarioError, build_config


def shared(eta: int = 1, background: float | None = None, steps: int = 16) -> SimConfig:
    cfg = small(eta=eta, steps=steps)
    cfg.host = HostModel(cores=2.0, background=background)
    return cfg


def test_speed_is_processor_sharing_of_the_busy_components() -> None:
    host = HostModel(cores=2.0)
    assert host.speed(trainer_busy=False, busy_engines=2) == 1.0  # two engines, two cores
    assert host.speed(trainer_busy=True, busy_engines=2) == pytest.approx(2 / 3)
    assert host.speed(trainer_busy=True, busy_engines=0) == 1.0
    assert HostModel(cores=2.0, background=1.0).speed(True, 2) == pytest.approx(0.5)
    assert HostModel(cores=2.0, engine_demand=2.0).speed(False, 2) == pytest.approx(0.5)
    assert HostModel(cores=None).speed(True, 8) == 1.0


def test_sharing_slows_only_what_overlaps() -> None:
    # Synchronous: the trainer trains alone and the two engines decode alone on two cores: nothing to share.
    sync = synchronous(shared())
    assert simulate(sync).wall_s == simulate(synchronous(small(steps=16))).wall_s
    # Fully async: the trainer trains while the engines decode, so both slow down, by at most 2/3 here.
    alone, both = simulate(small(steps=16)), simulate(shared())
    assert alone.trainer_busy_s == pytest.approx(alone.trainer_work_s)
    assert both.trainer_work_s < both.trainer_busy_s <= both.trainer_work_s * 1.5 + 1e-9
    assert both.wall_s > alone.wall_s
    one_core = shared()
    one_core.host.cores = 1.0
    assert simulate(one_core).wall_s > both.wall_s
    assert simulate(shared()) == both  # still deterministic
    assert with_gpus(shared(), 2, 2, separated=True).host.cores is None  # GPUs: hardware of their own


def write_run(tmp_path: Path, name: str, truth: SimConfig, result: SimResult) -> Path:
    """A run dir as the runtime writes it, from a simulation of `truth`: the known answer for a fit."""
    rows, previous = [], 0.0
    for step, end in enumerate(result.step_end_s, start=1):
        tokens, busy = result.step_tokens[step - 1], result.step_busy_s[step - 1]
        rows.append(
            {
                "step": step,
                "trainer/step": float(step),
                "time": 1000.0 + end,
                "timing/step_s": end - previous,
                "timing/wait_batch_s": result.step_wait_s[step - 1],
                "timing/update_s": busy,
                "timing/compute_cpu_s": truth.trainer.step_s(tokens),  # the CPU it got: its uncontended work
                "sync/total_s": truth.sync.total_s,
                "sync/pause_s": truth.sync.pause_s,
                "batch/tokens": float(tokens),
                "response_length/mean": truth.lengths.mean_tokens,  # before clipping, as the fit samples it
                "host/cpus": truth.host.cores,
            }
        )
        previous = end
    run = tmp_path / name
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = truth.pipeline
    (run / "config.yaml").write_text(
        f"async_training: {{required_samples: 8, max_staleness: {p.max_staleness}, trigger_parameter_sync_step: 1,"
        " partial_rollout: true, max_concurrent_rollouts: 96, queue_max_groups: 24}\n"
        "actor_rollout_ref: {rollout: {n: 4}}\n"
        "engines: {backend: embedded, num_engines: 2, max_running_requests: 16, torch_threads: 1}\n"
        f"data: {{max_response_length: 400}}\ntrainer: {{device: cpu, total_training_steps: {truth.steps}}}\n"
    )
    return run


def fit_base(eta: int, cores: float | None) -> SimConfig:
    """What the CLI builds from the run's config.yaml (plus the sigma the metrics do not carry)."""
    return build_config(
        SimConfig(),
        [
            {
                "pipeline": {
                    "required_samples": 8,
                    "samples_per_prompt": 4,
                    "num_engines": 2,
                    "max_concurrent_rollouts": 96,
                    "max_staleness": eta,
                },
                # the curve's shape (peak / single) is not fitted: the truth's
                "engine": {"max_running_requests": 16, "peak_tokens_per_s": 2000.0, "single_tokens_per_s": 100.0},
                "lengths": {"max_tokens": 400, "sigma": 0.8},
                "host": {"cores": cores},
                "seed": 3,  # the truth's: the same length draws, so a miss is the model's, not sampling noise
            }
        ],
    )


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def other_mode(cfg: SimConfig, eta: int) -> SimConfig:
    out = copy.deepcopy(cfg)
    out.pipeline.max_staleness = eta
    return out


@pytest.mark.parametrize("background", [None, 0.5])
def test_fit_on_a_contended_async_run_predicts_the_sync_run(tmp_path: Path, background: float | None) -> None:
    truth = shared(eta=1, background=background)
    run = write_run(tmp_path, "async", truth, simulate(truth))
    fit = calibrate(fit_base(1, 2.0), records(run))
    own = simulate(fit.cfg).wall_s + fit.startup_s
    assert own == pytest.approx(fit.measured.wall_s, rel=0.03)
    # the trainer's model is the uncontended one, and the other jobs' load is found from its CPU share
    assert fit.cfg.trainer.step_s(1000) == pytest.approx(truth.trainer.step_s(1000), rel=0.1)
    assert (fit.cfg.host.background or 0.0) == pytest.approx(background or 0.0, abs=0.15)
    sync_truth = simulate(synchronous(truth)).wall_s
    miss = abs((simulate(synchronous(fit.cfg)).wall_s + fit.startup_s) / sync_truth - 1)
    assert miss < 0.03
    # without the sharing term the same fit keeps the contended speeds and misses the other mode by far more
    blind = calibrate(fit_base(1, None), records(run))
    blind_miss = abs((simulate(synchronous(blind.cfg)).wall_s + blind.startup_s) / sync_truth - 1)
    assert blind_miss > max(0.1, 4 * miss)


def test_fit_on_a_sync_run_predicts_the_contended_async_run(tmp_path: Path) -> None:
    truth = shared(eta=0)
    run = write_run(tmp_path, "sync", truth, simulate(truth))
    fit = calibrate(fit_base(0, 2.0), records(run))
    assert simulate(fit.cfg).wall_s + fit.startup_s == pytest.approx(fit.measured.wall_s, rel=0.03)
    async_truth = simulate(other_mode(truth, 1)).wall_s
    assert simulate(other_mode(fit.cfg, 1)).wall_s + fit.startup_s == pytest.approx(async_truth, rel=0.05)


def test_cli_from_a_cpu_run_shares_its_recorded_cores_and_prints_the_other_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    truth = shared(eta=0)
    run = write_run(tmp_path, "sync", truth, simulate(truth))
    assert main(["simulate", "--from", str(run), "simulate.lengths.sigma=0.8", "simulate.async_staleness=1"]) == 0
    out = capsys.readouterr().out
    assert "CPU run: 2 cores recorded by the run" in out and "host sharing: 2 cores" in out
    assert "async eta=1" in out and "cross-mode: this synchronous run predicts" in out
    assert "trainer CPU share: measured 100%" in out


def test_host_keys_are_honoured_or_refused() -> None:
    for bad, name in [({"cores": 0}, "host.cores"), ({"engine_demand": 0}, "engine_demand"), ({"cors": 2}, "cors")]:
        with pytest.raises(ScenarioError, match=name):
            build_config(SimConfig(), [{"host": bad}])
    with pytest.raises(ScenarioError, match="async_staleness"):
        build_config(SimConfig(), [{"async_staleness": 0}])
    base = simulate(shared()).wall_s
    for key, value in [("cores", 1.0), ("trainer_demand", 2.0), ("engine_demand", 2.0), ("background", 1.0)]:
        cfg = build_config(shared(), [{"host": {key: value}}])
        assert simulate(cfg).wall_s > base, key
