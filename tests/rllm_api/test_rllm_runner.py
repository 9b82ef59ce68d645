"""rLLM's runner pieces without a training run: the config an rLLM program composes (rLLM's config package shipped
here) mapped onto this project's, data by name, the datum a rollout function receives, the metadata metrics, the
rollout functions shipped by value, and AsyncAgentTrainer's signatures. The programs themselves train end to end in
tests/e2e/test_rllm_training_programs.py.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import subprocess
import sys

import numpy as np
import pytest
from hydra import compose, initialize_config_module
from omegaconf import DictConfig, OmegaConf, open_dict

from rllm.data import DatasetRegistry
from rllm.experimental.fully_async.api.rollout_functions import RolloutFunctions, with_rllm_functions
from rllm.experimental.fully_async.errors import ConfigError
from rllm.experimental.fully_async.run_spec import build_run_spec
from rllm.experimental.fully_async.settings.rllm_program import program_config, program_layer
from rllm.experimental.fully_async.workflows.rllm_metrics import (
    StaleCounts,
    batch_metadata_metrics,
    validation_metadata_metrics,
)

ROWS = [
    {
        "prompt": [{"role": "user", "content": f"{a:02d}+{b:02d}="}],
        "data_source": "toy/addition",
        "reward_model": {"style": "rule", "ground_truth": f"{a + b:03d}"},
        "extra_info": {"index": i},
        "difficulty": 1,
    }
    for i, (a, b) in enumerate([(1, 2), (10, 20), (33, 44)])
]


@pytest.fixture(autouse=True)
def rllm_home(tmp_path, monkeypatch):
    monkeypatch.setenv("RLLM_HOME", str(tmp_path / "home"))
    DatasetRegistry.register_dataset("toy", ROWS, "train")
    DatasetRegistry.register_dataset("toy", ROWS[:1], "test")
    return tmp_path / "home"


@functools.cache
def _package() -> DictConfig:
    """The config an rLLM program gets from `@hydra.main(config_path="pkg://rllm.experimental.fully_async.config",
    config_name="fully_async_ppo_trainer")`, composed by hydra once (its first composition costs seconds)."""
    with initialize_config_module("rllm.experimental.fully_async.config", version_base=None):
        return compose("fully_async_ppo_trainer")


def composed(*overrides: str) -> DictConfig:
    """The package's config with command-line overrides applied as hydra applies these simple ones: `key=value`
    sets an existing key (YAML-typed value), `+key=value` adds one."""
    cfg = copy.deepcopy(_package())
    for item in overrides:
        key, value = item.split("=", 1)
        parsed = OmegaConf.from_dotlist([f"v={value}"]).v
        if not key.startswith("+") and OmegaConf.select(cfg, key, default=KeyError) is KeyError:
            raise KeyError(f"hydra would refuse {item!r}: no such key (add it with +)")
        with open_dict(cfg):
            OmegaConf.update(cfg, key.lstrip("+"), parsed, force_add=True)
    return cfg


def mapped(*overrides: str, **kwargs):
    return program_config(composed("actor_rollout_ref.model.path=/models/tiny", *overrides), **kwargs)


# --- the config -------------------------------------------------------------------------------------------------


def test_the_shipped_package_composes_rllms_keys_and_defaults_on_verls_tree():
    with initialize_config_module("rllm.experimental.fully_async.config", version_base=None):
        cfg = compose("fully_async_ppo_trainer", overrides=["+async_training.dataset_name=toy", "rollout.test_freq=2"])
    assert cfg.async_training.dataset_name == "toy" and cfg.rollout.test_freq == 2
    at = cfg.async_training
    assert (at.staleness_threshold, at.trigger_parameter_sync_step, at.required_samples) == (0.1, 4, 128)
    assert (cfg.rollout.total_rollout_steps, cfg.data.train_split, cfg.data.val_split) == (100, "train", "test")
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6  # verl's ppo_trainer underneath
    assert cfg.rollout.n == cfg.actor_rollout_ref.rollout.n  # rLLM's executor reads the latter; here linked


def test_a_registered_name_becomes_the_data_files_and_rows_are_passed_as_stored(rllm_home):
    cfg = mapped("data.train_dataset_name=toy", "data.val_dataset_name=toy", "actor_rollout_ref.rollout.n=4")
    assert list(cfg.data.train_files) == [str(rllm_home / "datasets" / "toy" / "train.parquet")]
    assert list(cfg.data.val_files) == [str(rllm_home / "datasets" / "toy" / "test.parquet")]
    assert cfg.workflow.rllm_rows and cfg.workflow.name == "rllm_runner"
    spec = build_run_spec(cfg)
    assert spec.executor.data.rows and spec.executor.samples_per_prompt == 4
    assert spec.run.total_training_steps == 1  # rollout.total_rollout_steps 100 / required_samples 128, rounded up
    assert spec.trainer.device == "cpu" and spec.engines.backend == "embedded"  # verl defaults left: this project's


def test_without_a_val_dataset_name_there_is_no_validation_as_in_rllm():
    assert mapped("data.train_dataset_name=toy").data.val_files is None


def test_the_dapo_examples_dataset_name_key_and_argument(rllm_home):
    train = str(rllm_home / "datasets" / "toy" / "train.parquet")
    assert list(mapped("+async_training.dataset_name=toy").data.train_files) == [train]
    assert list(mapped(dataset_name="toy").data.train_files) == [train]
    assert list(mapped("+async_training.dataset_name=toy", dataset_name="toy").data.train_files) == [train]
    with pytest.raises(ConfigError, match=r"dataset_name='toy'\) and the config's dataset name \('other'\) differ"):
        mapped("+async_training.dataset_name=other", dataset_name="toy")


def test_a_parquet_path_is_a_dataset_name_too(tmp_path):
    import pandas as pd

    pd.DataFrame(ROWS).to_parquet(tmp_path / "mine.parquet")
    cfg = mapped(f"data.train_dataset_name={tmp_path / 'mine.parquet'}")
    assert list(cfg.data.train_files) == [str(tmp_path / "mine.parquet")] and cfg.workflow.rllm_rows


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["data.train_dataset_name=nope"], "'data.train_dataset_name=nope': no such dataset in the DatasetRegistry"),
        (["data.train_dataset_name=toy", "data.train_split=dev"], "has no split 'dev' (it has: train, test)"),
        (["data.train_dataset_name=toy", "data.train_files=/x.parquet"], "both name the train data; keep one"),
        (["data.val_split=dev", "data.train_dataset_name=toy"], "'data.val_split' is read only with data.val_dataset"),
        ([], "no training data: set data.train_dataset_name=NAME"),
        (["data.train_dataset_name=toy", "+workflow.path=x.py"], "'workflow.path': AsyncAgentTrainer's rollout_fn"),
        # keys rLLM's scripts set that this trainer cannot honour: one line naming the key and why
        (["data.train_dataset_name=toy", "trainer.default_local_dir=/ckpt"], "'trainer.default_local_dir' is verl's"),
        (["data.train_dataset_name=toy", "reward_model.reward_manager=dapo"], "'reward_model.reward_manager' is verl"),
        (["data.train_dataset_name=toy", "async_training.require_batches=4"], "required_samples=128 is set and wins"),
        (["data.train_dataset_name=toy", "async_training.checkpoint_engine.enable=true"], "checkpoint engine is not"),
        (["data.train_dataset_name=toy", "rollout.n_gpus_per_node=4"], "set engines.num_engines instead"),
        (["data.train_dataset_name=toy", "actor_rollout_ref.rollout.val_kwargs.top_p=0.7"], "pass their own sampling"),
    ],
)
def test_what_cannot_be_honoured_is_refused_in_one_line(overrides, named):
    with pytest.raises(ConfigError) as info:
        mapped(*overrides)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_rllms_prox_log_prob_with_verls_rollout_is_is_one_decoupled_correction():
    """rLLM's scripts set compute_prox_log_prob with rollout_correction.rollout_is=sequence, threshold 2."""
    cfg = mapped(
        "data.train_dataset_name=toy",
        "async_training.compute_prox_log_prob=True",
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_is_threshold=3.0",
    )
    correction = build_run_spec(cfg).trainer.correction
    assert (correction.mode, correction.prox_log_probs, correction.level, correction.cap) == (
        "decoupled",
        "recompute",
        "sequence",
        3.0,
    )


def test_rows_by_name_need_an_rllm_rollout_function():
    """The same keys in a YAML run by the CLI with its single-turn workflow: refused, naming what reads them."""
    from rllm.experimental.fully_async.settings.loader import load_config
    from rllm.experimental.fully_async.settings.rllm_program import SHIPPED_CONFIG

    with pytest.raises(ConfigError, match="read only by an rLLM rollout function"):
        load_config(SHIPPED_CONFIG, ["data.train_dataset_name=toy", "actor_rollout_ref.model.path=/m"])
    cfg = load_config(SHIPPED_CONFIG, ["data.train_dataset_name=toy", "workflow.path=fn.py", "workflow.name=fn"])
    assert cfg.workflow.rllm_rows  # an rLLM function named by path reads them


def test_keys_the_program_adds_for_itself_are_left_to_it(caplog):
    cfg = mapped("data.train_dataset_name=toy", "+reward_model.reward_kwargs.overlong_buffer_cfg.len=2")
    assert "reward_kwargs" not in cfg.reward_model
    assert "reward_model.reward_kwargs.overlong_buffer_cfg.len" in caplog.text


def test_a_key_named_on_the_command_line_counts_even_at_its_default():
    """Under @hydra.main the runner reads the command line (HydraConfig): `trainer.device=cuda` is verl's default
    yet chosen; left unnamed it would be this project's default (cpu)."""
    cfg = composed("trainer.device=cuda")
    assert "trainer.device" not in program_layer(cfg)[0]
    assert program_layer(cfg, {"trainer.device"})[0]["trainer.device"] == "cuda"


def test_the_program_can_set_this_projects_keys_with_plus():
    cfg = mapped("data.train_dataset_name=toy", "+engines.num_engines=1", "+run.dir=/tmp/somewhere")
    assert cfg.engines.num_engines == 1 and cfg.run.dir == "/tmp/somewhere"


# --- the datum ---------------------------------------------------------------------------------------------------


def _datum(row):
    from rllm.experimental.fully_async.data.prompts import PromptDatum
    from rllm.experimental.fully_async.data.rows import _record

    return PromptDatum(prompt_uid="e0/0", epoch=0, record=_record(0, row))


def test_a_rollout_function_gets_the_registered_row_itself():
    from rllm.experimental.fully_async.data.rows import RowDataset
    from rllm.experimental.fully_async.workflows.rllm_compat import datum_kwargs

    rows = RowDataset([DatasetRegistry.load_dataset("toy", "train").get_data_path()])
    assert [r.index for r in rows] == [0, 1, 2]
    assert datum_kwargs(_datum(rows[2].row)) == ROWS[2]  # every column, nothing added


def test_the_batched_form_is_verls_collated_batch_of_one():
    from rllm.experimental.fully_async.workflows.rllm_compat import datum_kwargs

    kwargs = datum_kwargs(_datum(ROWS[1]), batched=True)
    assert all(isinstance(v, np.ndarray) and v.shape == (1,) for v in kwargs.values())
    assert kwargs["raw_prompt"][0] == ROWS[1]["prompt"]  # rLLM's DAPO example at 65147d41 indexes [0]
    assert kwargs["reward_model"][0]["ground_truth"] == "030" and kwargs["index"][0] == 1
    assert kwargs["tools_kwargs"][0] == {} and kwargs["difficulty"][0] == 1


def test_a_missing_file_is_one_line():
    from rllm.experimental.fully_async.data.rows import RowDataset
    from rllm.experimental.fully_async.errors import DataError

    with pytest.raises(DataError, match=r"nope\.parquet: file not found"):
        RowDataset(["nope.parquet"])


# --- the metrics ---------------------------------------------------------------------------------------------------


def test_metadata_metrics_have_rllms_names_and_reductions():
    metadatas = [
        {"processing_time": 1.0, "param_version_start": 0, "param_version_end": 0, "is_correct": True, "s": "x"},
        {"processing_time": 3.0, "param_version_start": 0, "param_version_end": 2, "is_correct": False},
        {"tool_calls_time": 4, "custom/turns": 3, "param_version_start": 1, "param_version_end": 2},
    ]
    m = batch_metadata_metrics(metadatas)
    assert m["fully_async/processing_time/avg"] == pytest.approx(4 / 3)  # the missing one counts 0.0, as in rLLM
    assert (m["fully_async/processing_time/max"], m["fully_async/processing_time/min"]) == (3.0, 0.0)
    assert m["fully_async/processing_time/tp50"] == 1.0
    assert (m["fully_async/partial/total_partial_num"], m["fully_async/partial/max_partial_span"]) == (2.0, 2.0)
    assert m["fully_async/partial/partial_ratio"] == pytest.approx(2 / 3)
    assert m["timing_s/agent_loop/tool_calls/mean"] == 4.0  # only trajectories with tool calls
    assert (m["custom/is_correct/avg"], m["custom/is_correct/max"], m["custom/is_correct/min"]) == (0.5, 1.0, 0.0)
    assert m["custom/turns/avg"] == 3.0  # already prefixed: kept
    assert not any("/s/" in key for key in m)  # a string cannot be averaged: left out (rLLM would fail the batch)


def test_stale_counts_accumulate_over_steps_as_rllms_trainer_does():
    counts = StaleCounts()
    assert (
        counts.update([{"param_version": 0}, {"param_version": 1}], trainer_version=1)[
            "fully_async/count/stale_samples_processed"
        ]
        == 1
    )
    step2 = counts.update([{"param_version": 0, "param_version_end": 2}], trainer_version=2)
    assert step2["fully_async/count/stale_samples_processed"] == 2
    assert step2["fully_async/count/stale_trajectory_processed"] == 2  # end versions: 0 (default) and 2
    assert step2["fully_async/count/current_param_version"] == 2


def test_validation_metrics_are_rllms():
    m = validation_metadata_metrics([1.0, 0.0], [{"is_correct": True, "turns": 2}, {"is_correct": False}])
    assert m == {"val/avg_reward": 0.5, "val/num_samples": 2.0, "val/is_correct": 0.5, "val/turns": 2.0}


# --- the functions, shipped by value -------------------------------------------------------------------------------

PROGRAM = """
import asyncio, sys, cloudpickle

def make(offset):
    async def rollout_fn(client, tokenizer, **datum):
        return datum["x"] + offset
    return rollout_fn

sys.stdout.buffer.write(cloudpickle.dumps(make(40)))
"""


def test_a_closure_travels_by_value_to_a_process_that_cannot_import_its_module(tmp_path):
    """The program's functions live in its __main__, which the rollout service's process cannot import: what arrives
    is the code and the captured values (what rLLM's DAPO example relies on)."""
    from rllm.experimental.fully_async.workflows import runner_workflow

    (tmp_path / "program.py").write_text(PROGRAM)
    payload = subprocess.run([sys.executable, "program.py"], cwd=tmp_path, capture_output=True, check=True).stdout
    executor = with_rllm_functions(
        build_run_spec(mapped("data.train_dataset_name=toy")), RolloutFunctions(payload)
    ).executor
    workflow = runner_workflow(executor)
    assert asyncio.run(workflow.rollout_fn(None, None, x=2)) == 42
    assert runner_workflow(executor, held_out=True).rollout_fn.__name__ == "rollout_fn"  # no val fn: the same one


def test_the_runner_config_without_its_functions_is_one_line():
    from rllm.experimental.fully_async.workflows import runner_workflow

    with pytest.raises(ConfigError, match=r"runs the rollout_fn given to runner\.AsyncAgentTrainer"):
        runner_workflow(build_run_spec(mapped("data.train_dataset_name=toy")).executor)


# --- AsyncAgentTrainer's signatures -----------------------------------------------------------------------------


def test_async_agent_trainer_checks_what_rllm_checks():
    from omegaconf import OmegaConf

    from rllm.experimental.fully_async.runner import AsyncAgentTrainer

    async def rollout_fn(client, tokenizer, **datum):
        return None

    def not_async(client, tokenizer, **datum):
        return None

    with pytest.raises(TypeError, match="rollout_fn must be an async function"):
        AsyncAgentTrainer(config=composed(), rollout_fn=not_async)
    with pytest.raises(TypeError, match="val_rollout_fn must be an async function"):
        AsyncAgentTrainer(config=composed(), rollout_fn=rollout_fn, val_rollout_fn=not_async)
    with pytest.raises(ValueError, match="takes only None"):
        AsyncAgentTrainer(config=composed(), train_dataset=[1], val_dataset=None, rollout_fn=rollout_fn)
    with pytest.raises(RuntimeError, match="must set async_training config"):
        AsyncAgentTrainer(config=OmegaConf.create({}), rollout_fn=rollout_fn).train()
    assert AsyncAgentTrainer(
        config=composed(), train_dataset=None, val_dataset=None, rollout_fn=rollout_fn
    ).batched_datum
    assert not AsyncAgentTrainer(composed(), rollout_fn, dataset_name="toy").batched_datum


def test_a_bad_config_stops_the_program_with_one_line_and_status_2(capsys):
    from rllm.experimental.fully_async.runner import AsyncAgentTrainer

    async def rollout_fn(client, tokenizer, **datum):
        return None

    with pytest.raises(SystemExit) as info:
        AsyncAgentTrainer(config=composed("data.train_dataset_name=nope"), rollout_fn=rollout_fn).train()
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: 'data.train_dataset_name=nope'") and "\n" not in err


def test_colorful_print_styles_what_rllms_scripts_print(capsys):
    from rllm.utils import colorful_print

    colorful_print({"role": "user", "content": "hi"}, fg="cyan")
    colorful_print("done", fg="green", bold=True, end="")
    out = capsys.readouterr().out
    assert out == "\x1b[36m{'role': 'user', 'content': 'hi'}\x1b[0m\n\x1b[32m\x1b[1mdone\x1b[0m"
