"""End to end: the CLI trains a few steps with 2 real engines, Ray actors and the patched verl actor.

One run (module-scoped) is checked for the properties the design promises: the ledger adds up, no trained group
was staler than max_staleness, the policy version advanced, interrupted generations were resumed and stitched
(samples mixing token versions were trained), the process exited 0 and left no engine or Ray process behind.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
from run_helpers import addition_run_command, leftover_processes

STEPS = 8
pytestmark = pytest.mark.slow  # one CLI run end to end, read by every test
MAX_STALENESS = 1


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, addition_cache):
    root = tmp_path_factory.mktemp("e2e")
    run_dir = root / "run"
    env = dict(os.environ, RLLM_LOG_LEVEL="WARNING")
    command = addition_run_command(
        run_dir,
        addition_cache,
        "task.val_size=32",
        f"trainer.total_training_steps={STEPS}",
        "trainer.test_freq=4",
        "data.train_batch_size=16",
        "async_training.required_samples=16",
        f"async_training.max_staleness={MAX_STALENESS}",
        "async_training.trigger_parameter_sync_step=1",
        "actor_rollout_ref.rollout.n=4",
        "engines.num_engines=2",
        # Partial rollouts need requests decoding when a weight sync pauses the engines, so generating a batch must
        # take longer than training on it; otherwise the executor fills its staleness budget and sits idle at every
        # sync. Long generations (48 tokens, never stopping at EOS) decoded one at a time per engine make a batch
        # take about 6x a training step here (1.2 s vs 0.2 s). With 4 at a time the margin was under 2x, and one CI
        # run whose trainer was slower saw no sync catch a request.
        "actor_rollout_ref.rollout.ignore_eos=true",
        "data.max_response_length=48",
        "engines.max_running_requests=1",
    )
    proc = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"the run did not finish in 600 s:\n{output[-3000:]}")
    rows = []
    metrics_file = run_dir / "metrics.jsonl"
    if metrics_file.exists():
        rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    return proc, output, rows, run_dir


def _step_rows(rows):
    return [r for r in rows if "trainer/step" in r]


def test_run_exits_zero_and_trains_every_step(short_run):
    proc, output, rows, _ = short_run
    assert proc.returncode == 0, output[-3000:]
    assert [int(r["trainer/step"]) for r in _step_rows(rows)] == list(range(1, STEPS + 1))
    assert "validation accuracy:" in output  # measured before and after, whatever the (mostly zero) rewards


def test_verl_metric_names_are_logged_beside_ours(short_run):
    """verl's names for the same batch, so a verl dashboard carries over: every response here runs to the limit
    (ignore_eos, 48 tokens), so verl's clip ratio against data.max_response_length is exactly 1."""
    _, _, rows, _ = short_run
    for row in _step_rows(rows):
        assert row["critic/score/mean"] == pytest.approx(row["reward/mean"])
        assert row["response_length/max"] == row["response_length/mean"] == 48
        assert row["response_length/clip_ratio"] == 1.0
        assert row["training/global_step"] == row["trainer/step"]
        assert row["timing_s/step"] == row["timing/step_s"] and row["perf/time_per_step"] == row["timing/step_s"]


def test_the_end_says_where_the_files_are_and_how_to_draw_them(short_run):
    _, output, rows, run_dir = short_run
    tail = output.strip().splitlines()[-9:]
    assert any(line.startswith("metrics:") and line.endswith(f"{run_dir}/metrics.jsonl") for line in tail), tail
    assert any(line.startswith("checkpoints:") and f"{run_dir}/checkpoints" in line for line in tail), tail
    assert any(line.startswith("trajectory dumps:") and "off" in line for line in tail), tail
    assert any(line.startswith("trained model:") and "/weights/v" in line for line in tail), tail
    assert any(f"python -m rllm.experimental.fully_async report {run_dir}" in line for line in tail), tail
    wall = re.search(r"run finished: \d+ steps, wall time (\d+):(\d\d)", output)
    assert wall, output[-2000:]
    from rllm.experimental.fully_async.observe.wall_time import training_wall_s

    assert int(wall.group(1)) * 60 + int(wall.group(2)) == round(training_wall_s(rows))  # one definition


def test_start_up_shows_its_phases_then_a_header_before_the_first_step(short_run):
    _, output, _, run_dir = short_run
    lines = output.splitlines()
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step    1/"))
    header = [i for i, line in enumerate(lines[:first_step]) if line.startswith("fully-async grpo: η=1, K=1, ")]
    assert header and f"{STEPS} steps of 16 groups x 4 samples; run dir {run_dir}" in lines[header[0]], lines[:30]
    phases = [re.sub(r"^\[\d+:\d\d\] ", "", line) for line in lines[:first_step] if re.match(r"\[\d+:\d\d\] ", line)]
    assert phases[0] == "preparing the data and model of task addition", phases
    for phase in ("starting 2 embedded engines", "starting Ray", "starting the rollout service", "initial validation"):
        assert any(p.startswith(phase) for p in phases), phases
    assert phases[-1] == "generating the first batch, then step 1"


def test_ledger_adds_up_at_every_step(short_run):
    _, _, rows, _ = short_run
    for row in rows:
        if "ledger/issued" not in row:
            continue
        ended = sum(row[f"ledger/{k}"] for k in ("trained", "filtered", "dropped_stale", "failed"))
        assert row["ledger/in_flight"] + ended == row["ledger/issued"]
    final = rows[-1]
    assert final["ledger/trained"] == STEPS * 16 * 4  # required_samples x n per step, nothing failed


def test_no_trained_group_exceeded_max_staleness_and_versions_advanced(short_run):
    _, _, rows, _ = short_run
    steps = _step_rows(rows)
    assert max(r["staleness/max"] for r in steps) <= MAX_STALENESS
    assert [int(r["trainer/version"]) for r in steps] == list(range(1, STEPS + 1))  # trigger 1: one sync per step


def test_partial_rollouts_were_resumed_and_stitched(short_run):
    _, _, rows, _ = short_run
    steps = _step_rows(rows)
    # If this fails, compare the trainer's update time with its wait for a batch: resumes need the wait to dominate.
    timings = [(r["timing/wait_batch_s"], r["timing/update_s"]) for r in steps]
    assert sum(r["partial/resumed_samples"] for r in steps) > 0, f"(wait_batch_s, update_s) per step: {timings}"
    # A stitched sample holds tokens of two versions: the engine's pieces before and after a weight update.
    assert sum(r["partial/mixed_version_samples"] for r in steps) > 0


def test_no_engine_or_ray_process_is_left(short_run, addition_cache):
    proc, _, _, _ = short_run
    assert not leftover_processes(proc.pid, str(addition_cache))


def test_simulate_from_the_run_shares_its_cores_and_predicts_both_modes(short_run, capsys):
    """`simulate --from` on this real CPU run: host sharing from the cores and CPU share the run logged, its own
    wall time predicted within 25%, and the synchronous mode's predicted too (simulate/calibrate.py)."""
    from rllm.experimental.fully_async.__main__ import main

    _, _, _, run_dir = short_run
    assert main(["simulate", "--from", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "cores recorded by the run" in out and "host sharing:" in out, out
    assert re.search(r"trainer CPU share: measured \d+%", out), out
    assert "cross-mode: this fully-async run predicts" in out, out
    error = re.search(r"predicted for it [\d.]+s \(([-+][\d.]+)%\)", out)
    # Here the run shares 2 cores with the other test worker, whose load comes and goes while the model fits it as one
    # constant background: quiet, it predicts within 2%; on a CI machine where the trainer got 12% of a core (13
    # background cores fitted) it was off by 15.8%. Issue 16's 15% target is held on a quiet machine by the benchmark
    # (tests/bench/README.md); this test bounds the error at 25%.
    assert error is not None and abs(float(error.group(1))) < 25, out
