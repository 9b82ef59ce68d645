"""The simulator's engine schedule (issue 34's what-if of elastic rollout capacity): engines joining take work,
leaving ones hand their samples on with their tokens, the staleness bound holds in every stretch, bad schedules are
refused in one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from rllm.experimental.fully_async.__main__ import main
from rllm.experimental.fully_async.settings.loader import load_config
from rllm.experimental.fully_async.simulate.engine import Simulation, simulate
from rllm.experimental.fully_async.simulate.layout import Layout, baseline
from rllm.experimental.fully_async.simulate.model import (
    EngineModel,
    LengthModel,
    Pipeline,
    SimConfig,
    SyncModel,
    TrainerModel,
)
from rllm.experimental.fully_async.simulate.scenarios import (
    ScenarioError,
    build_config,
    parse_overrides,
    pipeline_from_project,
)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "report_run"  # a real 60-step run of 2 engines


def generation_bound(schedule: list, *, engines: int = 1, partial: bool = True, eta: int = 1) -> SimConfig:
    """Slow engines, a fast trainer: throughput is set by how many engines decode (and the staleness budget lets
    enough groups run to keep four engines busy)."""
    return SimConfig(
        pipeline=Pipeline(
            required_samples=8,
            samples_per_prompt=4,
            max_staleness=eta,
            partial_rollout=partial,
            num_engines=engines,
        ),
        engine=EngineModel(peak_tokens_per_s=400.0, single_tokens_per_s=50.0, max_running_requests=64),
        lengths=LengthModel(mean_tokens=80.0, sigma=0.7, max_tokens=400),
        trainer=TrainerModel(fixed_s=0.01, per_token_s=1e-6),
        sync=SyncModel(total_s=0.05, pause_s=0.02),
        steps=40,
        seed=5,
        engine_schedule=schedule,
    )


def test_without_a_schedule_the_run_is_one_segment_and_unchanged() -> None:
    cfg = generation_bound([])
    result = simulate(cfg)
    (segment,) = result.segments
    assert (segment.start_s, segment.end_s, segment.engines, segment.steps) == (0.0, result.wall_s, 1, cfg.steps)
    assert segment.tokens_trained == result.tokens_trained
    assert sum(segment.staleness.values()) == sum(result.staleness.values())
    assert result.engine_s == pytest.approx(result.wall_s)  # one engine throughout
    same = copy.deepcopy(cfg)
    same.engine_schedule = [[0, 1]]  # the count at 0 s is the run's own: the same simulation
    assert simulate(same).wall_s == result.wall_s


def test_engines_that_join_take_work_and_raise_throughput() -> None:
    base = simulate(generation_bound([]))
    at = base.wall_s / 3
    result = simulate(generation_bound([[at, 4]]))
    before, after = result.segments
    assert (before.engines, after.engines, after.change, after.start_s) == (1, 4, 3, at)
    assert after.generated_tokens_per_s > 2 * before.generated_tokens_per_s
    assert after.trained_tokens_per_s > 2 * before.trained_tokens_per_s
    assert result.wall_s < base.wall_s  # the same steps end sooner
    assert result.engine_s == pytest.approx(at + 4 * (result.wall_s - at))


def test_a_joining_engine_takes_no_work_before_its_join_time() -> None:
    cfg = generation_bound([[5.0, 2]])
    cfg.engine.join_s = 3.0
    sim = Simulation(cfg)
    result = sim.run()
    joined = sim.engines[-1]
    assert joined.joined_at == 5.0
    assert 0 < joined.busy_s <= result.wall_s - 8.0 + 1e-9
    never = generation_bound([[5.0, 2]])
    never.engine.join_s = 1e6  # still starting when the run ends: provisioned, never used
    sim = Simulation(never)
    result = sim.run()
    assert sim.engines[-1].busy_s == 0.0
    assert result.engine_s == pytest.approx(2 * result.wall_s - 5.0)


def _in_flight_tokens(sim: Simulation) -> float:
    """Tokens held by samples not finished: decoding, waiting on an engine after a move, or without an engine."""
    live = [e for e in sim.engines if e.active]
    running = sum(e.progress - r.start for e in live for r in e.running.values())
    return running + sum(r.done for e in live for _, r in e.waiting) + sum(r.done for r in sim.orphans)


@pytest.mark.parametrize("limit", [64, 6])  # 6 running per engine: moved samples also wait in an engine's queue
@pytest.mark.parametrize("partial", [True, False])
def test_removed_engines_samples_move_with_their_tokens(partial: bool, limit: int) -> None:
    """Engines join after the first groups started (work stays where it was sent, so a join takes new groups).
    Every token decoded is accounted for: in a finished sample, in a sample still in flight, or (partial
    rollout off: a moved sample restarts from its prompt) counted as regenerated. With token-level resume nothing
    is regenerated."""
    cfg = generation_bound([[60.0, 4], [120.0, 1], [150.0, 3], [180.0, 2]], partial=partial)
    cfg.engine.max_running_requests = limit
    sim = Simulation(cfg)
    result = sim.run()
    moved = [s.samples_moved for s in result.segments]
    assert moved[2] > 0 and sum(moved) == result.samples_moved
    if limit == 6:
        assert moved[2] > limit  # 3 engines' samples onto 1: some wait in its queue with their tokens
    decoded = sum(s.tokens_decoded for s in result.segments)
    accounted = result.tokens_generated + _in_flight_tokens(sim) + result.tokens_regenerated
    # The run's generated rate counts every token decoded, as a real run's rollout/tokens_per_s does (the tokens
    # of samples still in flight and of restarted pieces included), not only the finished samples' tokens.
    assert result.generated_tokens_per_s * result.wall_s == pytest.approx(decoded, rel=1e-9)
    assert result.generated_tokens_per_s * result.wall_s > result.tokens_generated
    if partial:
        assert result.tokens_regenerated == 0
        assert decoded == pytest.approx(accounted, rel=1e-9)
    else:
        assert result.tokens_regenerated > 0
        assert abs(decoded - accounted) <= 0.5 * result.samples_moved  # each restart's count is rounded
    assert result.steps == 40  # the run goes on after every change


@pytest.mark.parametrize("eta", [0, 1, 3])
@pytest.mark.parametrize("partial", [True, False])
def test_the_staleness_bound_holds_in_every_segment(eta: int, partial: bool) -> None:
    result = simulate(generation_bound([[40.0, 4], [80.0, 1], [120.0, 0], [130.0, 3]], partial=partial, eta=eta))
    assert len(result.segments) == 5
    for segment in result.segments:
        assert segment.max_staleness is None or segment.max_staleness <= eta
    assert sum(sum(s.staleness.values()) for s in result.segments) == sum(result.staleness.values())


def test_no_engine_pauses_generation_until_one_joins() -> None:
    result = simulate(generation_bound([[3.0, 0], [6.0, 2]]))
    empty = result.segments[1]
    assert (empty.engines, empty.tokens_decoded) == (0, 0.0)
    assert empty.samples_moved > 0  # the last engine's samples waited for the next one
    assert result.steps == 40


def test_no_engine_for_the_timeout_stops_the_run() -> None:
    cfg = generation_bound([[3.0, 0], [60.0, 2]])
    cfg.pipeline.no_engine_timeout_s = 5.0
    result = simulate(cfg)
    assert result.stopped == "no engine for 5s from 3s"
    assert result.wall_s == pytest.approx(8.0) and result.steps < 40
    assert len(result.segments) == 2  # the join at 60 s came too late


@pytest.mark.parametrize(
    "schedule, timeout, message",
    [
        ("[[0,1],[10,2],[10,3]]", None, "engine_schedule[2]: time 10s is not after the entry before it (10s)"),
        ("[[5,-1]]", None, "engine_schedule[0]: engine count -1 must be a whole number >= 0"),
        ("[[5,1.5]]", None, "engine_schedule[0]: engine count 1.5 must be a whole number >= 0"),
        ("[[-1,2]]", None, "engine_schedule[0]: time -1 must be a number of seconds >= 0"),
        ("[[5,2,1]]", None, "engine_schedule[0] = [5, 2, 1]: each entry is [time_s, engines]"),
        ("[5,2]", None, "engine_schedule[0] = 5: each entry is [time_s, engines]"),
        ("5", None, "simulate.engine_schedule = 5: expected a list"),
        ("[[0,4]]", None, "engine_schedule[0]: 4 engines at 0s, but the run starts with 1"),
        ("[[5,2]]", -1, "pipeline.no_engine_timeout_s must be >= 0"),
    ],
)
def test_a_bad_schedule_is_refused_in_one_line(
    schedule: str, timeout: float | None, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = [f"simulate.engine_schedule={schedule}", "engines.num_engines=1", "simulate.steps=2"]
    if timeout is not None:
        overrides.append(f"simulate.pipeline.no_engine_timeout_s={timeout}")
    assert main(["simulate", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_a_schedule_ending_at_0_without_a_timeout_is_refused() -> None:
    # Only a scenario without a project config can lack the timeout: a project's engines.no_engine_timeout_s is one.
    with pytest.raises(
        ScenarioError, match=r"engine_schedule ends at 0 engines \(9s\) and pipeline.no_engine_timeout_s"
    ):
        build_config(generation_bound([]), [{"engine_schedule": [[5, 2], [9, 0]]}])


def test_the_runs_no_engine_timeout_is_the_simulated_one() -> None:
    project = load_config(None, ["engines.no_engine_timeout_s=7"])
    assert pipeline_from_project(project)["pipeline"]["no_engine_timeout_s"] == 7.0
    default = load_config(None, [])
    assert pipeline_from_project(default)["pipeline"]["no_engine_timeout_s"] == float(
        default.engines.no_engine_timeout_s
    )


def test_a_schedule_ending_at_0_with_a_timeout_is_accepted() -> None:
    cfg = build_config(generation_bound([]), [{"engine_schedule": [[5, 0]], "pipeline": {"no_engine_timeout_s": 1}}])
    assert cfg.schedule() == [(5.0, 0)]


def test_a_schedule_with_a_gpu_sweep_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--gpus", "4", "simulate.engine_schedule=[[5,2]]"]) == 2
    assert "leave out simulate.engine_schedule" in capsys.readouterr().err


def test_a_misspelt_schedule_key_gets_the_nearest_one() -> None:
    with pytest.raises(ScenarioError, match=r"did you mean simulate\.engine_schedule\?"):
        parse_overrides(["simulate.engine_schedul=[[5,2]]"])


def test_cli_prints_each_segment_and_the_change_before_and_after(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = [
        "--json",
        str(tmp_path / "sim.json"),
        "--config",
        "config/gpu_fsdp_sglang.yaml",
        "engines.num_engines=1",
        "simulate.engine_schedule=[[0,1],[300,4],[99999,2]]",
        "simulate.steps=30",
        "simulate.trainer.per_token_s=1e-6",
    ]
    assert main(["simulate", *overrides]) == 0
    out = capsys.readouterr().out
    assert "engine schedule (configured): 1 engine(s) at 0s, 4 engine(s) at 300s" in out
    assert "the synchronous row keeps its GPUs" in out
    header = next(line for line in out.splitlines() if "from s" in line)
    assert "gen tok/s" in header and "stale max" in header
    change = next(line for line in out.splitlines() if line.startswith("  at 300s +3 engines:"))
    before, after = (
        float(x.replace(",", "")) for x in change.split("generated tokens/s ")[1].split(" (")[0].split(" -> ")
    )
    assert after > before
    assert "not reached (the run ended at" in out and "2 engine(s) at 99999s" in out
    saved = json.loads((tmp_path / "sim.json").read_text())["modes"]
    assert set(saved) == {"synchronous", "configured"}
    segments = saved["configured"]["segments"]
    assert [(s["start_s"], s["engines"], s["change"]) for s in segments] == [(0.0, 1, 0), (300.0, 4, 3)]
    assert segments[1]["generated_tokens_per_s"] == pytest.approx(after, abs=0.5)  # the printed figure, unrounded
    assert all(s["max_staleness"] <= 2 for s in segments)  # η of gpu_fsdp_sglang.yaml
    assert len(saved["synchronous"]["segments"]) == 1  # verl's colocated baseline keeps its GPUs


def test_from_a_run_the_schedule_is_a_what_if_after_the_fit(capsys: pytest.CaptureFixture[str]) -> None:
    """`--from RUN_DIR simulate.engine_schedule=...`: the fit is the run's own (the same predicted wall time for
    it as without the schedule), the schedule changes only the prediction (tests/fixtures/report_run: 2 engines)."""

    def predicted_for_it(out: str) -> str:
        return next(line for line in out.splitlines() if "measured run:" in line).split("predicted for it ")[1]

    assert main(["simulate", "--from", str(FIXTURE)]) == 0
    plain = capsys.readouterr().out
    assert main(["simulate", "--from", str(FIXTURE), "simulate.engine_schedule=[[0,2],[10,4]]"]) == 0
    out = capsys.readouterr().out
    assert predicted_for_it(out) == predicted_for_it(plain)
    assert "engine schedule (configured): 2 engine(s) at 0s, 4 engine(s) at 10s" in out
    assert any(line.startswith("  at 10s +2 engines:") for line in out.splitlines())
    assert main(["simulate", "--from", str(FIXTURE), "simulate.engine_schedule=[[0,1]]"]) == 2
    assert "the run starts with 2" in capsys.readouterr().err


def test_the_synchronous_baseline_follows_the_schedule_on_cpu_and_keeps_its_gpus_on_gpus() -> None:
    cfg = generation_bound([[5.0, 3]])
    assert baseline(cfg, None).engine_schedule == [[5.0, 3]]  # the same processes at η = 0
    cpu = Layout("cpu", engines=1, gpus_per_engine=1, trainer=1, cores=2.0)
    assert baseline(cfg, cpu).engine_schedule == [[5.0, 3]]
    gpu = Layout("gpu", engines=1, gpus_per_engine=1, trainer=1)
    assert baseline(cfg, gpu).engine_schedule == []  # verl's colocated trainer keeps its GPUs
    assert cfg.engine_schedule == [[5.0, 3]]  # the configured mode's own is untouched


def test_a_scenario_file_takes_a_schedule_and_fixed_split_rows_refuse_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = tmp_path / "s.yaml"
    body = (
        "description: elastic\nsimulate:\n  steps: 6\n  engine_schedule: [[0, 1], [2, 3]]\n"
        "  pipeline: {required_samples: 4, samples_per_prompt: 2, num_engines: 1}\n"
    )
    scenario.write_text(body)
    assert main(["simulate", "--config", str(scenario)]) == 0
    assert "engine schedule (configured): 1 engine(s) at 0s, 3 engine(s) at 2s" in capsys.readouterr().out
    assert main(["simulate", "--config", str(scenario), "--gpus", "4"]) == 2
    assert capsys.readouterr().err.strip() == (
        "simulate: simulate.engine_schedule: --gpus 4's rows are fixed GPU splits; leave out the schedule"
    )
    scenario.write_text(body + "published: {source: x, rows: []}\n")
    assert main(["simulate", "--config", str(scenario)]) == 2
    assert "a published block's rows are fixed GPU splits" in capsys.readouterr().err
