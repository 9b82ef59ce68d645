"""simulate gives one answer per layout: the trainer's GPU count honoured, the layout named in the header, the same
wall time and speedup whether `--config` or `--gpus N` described it (against a named baseline), arguments checked
before anything is simulated, unknown keys answered with the nearest one, and a CPU timing line that adds up."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rllm.experimental.fully_async.__main__ import main
from rllm.experimental.fully_async.simulate import engine
from rllm.experimental.fully_async.simulate.layout import Layout, layout_from_project
from rllm.experimental.fully_async.simulate.scenarios import CPU_TIMING, ScenarioError

REPO = Path(__file__).resolve().parents[2]
GPU_CONFIG = str(REPO / "config/gpu_fsdp_sglang.yaml")
SHORT = ["simulate.steps=6", "trainer.total_training_steps=6"]


def simulate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["simulate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def row(out: str, name: str) -> float:
    """The wall seconds of a mode's row in the modes table."""
    return float(re.search(rf"^  {re.escape(name)}\s+([\d.]+)", out, re.M).group(1))


def speedup(out: str) -> float:
    return float(re.search(r"speedup \(synchronous / \S+ wall\): ([\d.]+)x", out).group(1))


def test_the_trainers_gpu_count_is_honoured_and_named(capsys):
    _, one, _ = simulate(capsys, "--config", GPU_CONFIG, "trainer.n_gpus_per_node=1", *SHORT)
    _, four, _ = simulate(capsys, "--config", GPU_CONFIG, "trainer.n_gpus_per_node=4", *SHORT)
    _, two_nodes, _ = simulate(capsys, "--config", GPU_CONFIG, "trainer.n_gpus_per_node=2", "trainer.nnodes=2", *SHORT)
    assert "layout: 4 engine(s) x tp 1 (4 rollout GPUs) + 1 trainer GPU(s)" in one
    assert "layout: 4 engine(s) x tp 1 (4 rollout GPUs) + 4 trainer GPU(s)" in four and "separate" in four
    assert row(four, "configured") < row(one, "configured")  # four trainer GPUs train faster
    assert row(two_nodes, "configured") == row(four, "configured")  # 2 x 2 is 4 trainer GPUs
    assert "colocated on all 8 GPUs" in four and "colocated on all 5 GPUs" in one


def test_one_layout_gives_one_wall_time_and_one_speedup_whichever_flag_describes_it(capsys):
    """4 engines + 4 trainer GPUs: from the config's own keys, and as the 4:4 row of `--gpus 8`."""
    _, config, _ = simulate(capsys, "--config", GPU_CONFIG, "trainer.n_gpus_per_node=4", "--gpus", "8", *SHORT)
    wall, ratio = row(config, "configured"), speedup(config)
    split = re.search(r"^\s+4:4\s+wall\s+([\d.]+)s.*speedup ([\d.]+)x(.*)$", config, re.M)
    assert (float(split.group(1)), float(split.group(2))) == (wall, ratio)
    assert "this config's layout" in split.group(3)
    colocated = float(re.search(r"colocated on all 8 GPUs: ([\d.]+)s", config).group(1))
    assert colocated == row(config, "synchronous")  # one baseline, named the same in both places
    assert "synchronous: eta=0, K=1, colocated on all 8 GPUs" in config
    # the same split from a config that describes another layout: the same numbers
    _, other, _ = simulate(capsys, "--config", GPU_CONFIG, "trainer.n_gpus_per_node=1", "--gpus", "8", *SHORT)
    again = re.search(r"^\s+4:4\s+wall\s+([\d.]+)s.*speedup ([\d.]+)x(.*)$", other, re.M)
    assert (float(again.group(1)), float(again.group(2))) == (wall, ratio) and "this config" not in again.group(3)


def test_cpu_trainer_ranks_share_the_cores(capsys):
    _, one, _ = simulate(capsys, *SHORT)
    _, two, _ = simulate(capsys, "trainer.n_gpus_per_node=2", *SHORT)
    assert "layout: 2 embedded engine(s) + 1 trainer rank(s)" in one
    assert "layout: 2 embedded engine(s) + 2 trainer rank(s)" in two and "trainer (demand 2)" in two
    assert row(two, "configured") != row(one, "configured")
    assert "synchronous: eta=0, K=1, the same engines and trainer on the same cores" in one


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpus", "0"], "--gpus 0: at least 2 GPUs are needed"),
        (["--gpus", "-3"], "--gpus -3: at least 2 GPUs are needed"),
        (
            ["--config", GPU_CONFIG, "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "--gpus", "2"],
            "--gpus 2: at least 3 GPUs are needed, one engine of tp 2",
        ),
        (
            ["simulate.engine.peak_tokens_per_sec=5000"],
            "unknown key simulate.engine.peak_tokens_per_sec; did you mean simulate.engine.peak_tokens_per_s?",
        ),
        (["simulate.trainr.per_token_s=1"], "unknown key simulate.trainr; did you mean simulate.trainer?"),
        (["simulate.pipeline.num_engines=8"], "simulate.pipeline.num_engines: with a project config the layout"),
        (["--config", GPU_CONFIG, "trainer.device=cpu"], "engines.backend=sglang with trainer.device=cpu is not"),
    ],
)
def test_arguments_are_refused_in_one_line_before_anything_is_simulated(capsys, monkeypatch, argv, message):
    def never(self):
        raise AssertionError("simulated before the arguments were checked")

    monkeypatch.setattr(engine.Simulation, "run", never)
    code, out, err = simulate(capsys, *argv)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert message in line, line


def test_a_scenario_files_unknown_key_names_the_nearest(tmp_path, capsys):
    scenario = tmp_path / "s.yaml"
    scenario.write_text("description: x\nsimulate:\n  steps: 3\n  lengths: {mean_token: 5}\n")
    code, _, err = simulate(capsys, "--config", str(scenario))
    assert code == 2 and "did you mean simulate.lengths.mean_tokens?" in err


def test_the_cpu_timing_line_adds_up(capsys):
    """The default (CPU) config: CPU engine speeds, and a mean response length below the clip of 6 tokens."""
    _, out, _ = simulate(capsys, *SHORT)
    line = next(x for x in out.splitlines() if x.startswith("  timing models:"))
    assert "CPU process each" in line and "20,000" not in line
    mean = float(re.search(r"responses ([\d.]+) tokens mean", line).group(1))
    clipped = float(re.search(r"clipped at 6: ([\d.]+) mean after the clip", line).group(1))
    assert mean <= 6 and clipped <= 6
    assert "fitted to tests/fixtures/report_run" in out.splitlines()[0]


def test_the_cpu_timing_models_are_the_fit_of_the_committed_run(capsys):
    """CPU_TIMING says it is `simulate --from tests/fixtures/report_run`'s fit: a fixture recorded again without
    refitting them fails here."""
    code, out, _ = simulate(capsys, "--from", str(REPO / "tests" / "fixtures" / "report_run"))
    assert code == 0
    fit = re.search(
        r"fitted engine peak (\d+) tokens/s, trainer ([\d.]+)s \+ ([\d.]+)ms/token, sync ([\d.]+)s \(pause ([\d.]+)s\)",
        out,
    )
    assert fit, out
    peak, fixed_s, per_token_ms, sync_s, pause_s = (float(g) for g in fit.groups())
    assert CPU_TIMING["engine"]["peak_tokens_per_s"] == pytest.approx(peak, rel=0.01)
    assert CPU_TIMING["trainer"]["fixed_s"] == pytest.approx(fixed_s, abs=1e-3)
    assert CPU_TIMING["trainer"]["per_token_s"] == pytest.approx(per_token_ms / 1000, rel=0.01)
    assert CPU_TIMING["sync"]["total_s"] == pytest.approx(sync_s, abs=1e-3)
    assert CPU_TIMING["sync"]["pause_s"] == pytest.approx(pause_s, abs=1e-3)


def test_layouts_read_from_configs():
    gpu = {"engines": {"backend": "sglang", "num_engines": 2}, "trainer": {"device": "cuda", "n_gpus_per_node": 3,
           "nnodes": 2}, "actor_rollout_ref": {"rollout": {"tensor_model_parallel_size": 2}}}  # fmt: skip
    assert layout_from_project(gpu, None) == Layout("gpu", 2, 2, 6)
    cpu = {"engines": {"backend": "embedded", "num_engines": 3, "torch_threads": 0}, "trainer": {"device": "cpu"}}
    assert layout_from_project(cpu, 4.0) == Layout("cpu", 3, 1, 1, 0, 4.0)
    with pytest.raises(ScenarioError, match=r"n_gpus_per_node x trainer\.nnodes = 0 x 1"):
        layout_from_project({**gpu, "trainer": {"device": "cuda", "n_gpus_per_node": 0, "nnodes": 1}}, None)


def test_a_gpu_runs_fit_keeps_its_trainer_gpus_and_predicts_against_the_colocated_baseline(tmp_path):
    """`--from` a GPU run (2 engines, 2 trainer GPUs): its trainer times are at its own 2 GPUs, and its synchronous
    prediction is the layout's baseline, colocated on all 4 GPUs, the same simulation `--gpus 4` makes."""
    from test_simulate import small
    from test_simulate_host import records, write_run

    from rllm.experimental.fully_async.simulate.engine import simulate as run_one
    from rllm.experimental.fully_async.simulate.from_run import predict_from_run
    from rllm.experimental.fully_async.simulate.layout import baseline, sweep_splits, with_gpus

    truth = with_gpus(small(eta=1, steps=16), 2, 2, separated=True)
    truth.trainer.reference_gpus = 2  # its step times as measured on its 2 trainer GPUs
    run = write_run(tmp_path, "gpu", truth, run_one(truth))
    (run / "config.yaml").write_text(
        "async_training: {required_samples: 8, max_staleness: 1, trigger_parameter_sync_step: 1,"
        " partial_rollout: true, max_concurrent_rollouts: 96, queue_max_groups: 24}\n"
        "actor_rollout_ref: {rollout: {n: 4, tensor_model_parallel_size: 1}}\n"
        "engines: {backend: sglang, num_engines: 2, max_running_requests: 16}\n"
        "data: {max_response_length: 400}\n"
        "trainer: {device: cuda, n_gpus_per_node: 2, nnodes: 1, total_training_steps: 16}\n"
    )
    # the curve's shape and the length spread are not fitted: the truth's; its seed, so the draws are the same
    shape = {"engine": {"peak_tokens_per_s": 2000.0, "single_tokens_per_s": 100.0}, "lengths": {"sigma": 0.8}}
    shape["seed"] = 3
    result = predict_from_run(OmegaConf.load(run / "config.yaml"), records(run), cores=None, sim_layer=shape)
    assert result.layout == Layout("gpu", 2, 1, 2) and result.baseline.startswith("colocated on all 4 GPUs")
    assert (result.fit.cfg.trainer.reference_gpus, result.fit.cfg.trainer_gpus) == (2, 2)
    assert result.fit.cfg.trainer.step_s(1000, 2, True) == pytest.approx(truth.trainer.step_s(1000, 2, True), rel=0.1)
    assert result.predicted_self_s == pytest.approx(result.fit.measured.wall_s, rel=0.03)
    colocated, _ = sweep_splits(result.cfg, 4)
    assert result.results["synchronous"].wall_s == colocated.wall_s
    assert colocated.wall_s == run_one(baseline(result.cfg, result.layout)).wall_s
