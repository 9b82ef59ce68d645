"""The addition task: tokenizer, data format, reward, model, greedy evaluation and the asset cache (small sizes)."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from rllm.experimental.fully_async.tasks import addition
from rllm.experimental.fully_async.tasks.addition import (
    DATA_SOURCE,
    build_addition_model,
    build_addition_tokenizer,
    compute_score,
    evaluate_accuracy,
    make_problems,
    prepare_addition_assets,
    write_addition_parquets,
)

SMALL = {"num_train": 256, "num_val": 64, "warmup_steps": 3}


@pytest.fixture(scope="module")
def tokenizer():
    return build_addition_tokenizer()


@pytest.fixture(scope="module")
def small_assets(tmp_path_factory):
    return prepare_addition_assets(tmp_path_factory.mktemp("cache"), seed=0, **SMALL)


def test_tokenizer_round_trips_and_uses_the_chat_template(tokenizer):
    assert len(tokenizer) == 15
    ids = tokenizer.encode("12+34=046", add_special_tokens=False)
    assert len(ids) == 9
    assert tokenizer.decode(ids) == "12+34=046"
    messages = [{"role": "user", "content": "12+34="}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(prompt_ids) == ids[:6]
    assert tokenizer.decode([*ids[6:], tokenizer.eos_token_id, tokenizer.pad_token_id]) == "046<eos><pad>"
    assert tokenizer.decode([*ids[6:], tokenizer.eos_token_id], skip_special_tokens=True) == "046"
    assert tokenizer.decode(tokenizer.encode("1x", add_special_tokens=False)) == "1<unk>"


def test_tokenizer_survives_save_and_from_pretrained(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "99+01="}]
    assert loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False) == (
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    assert (loaded.pad_token_id, loaded.eos_token_id) == (0, 1)


@pytest.mark.parametrize(
    ("solution", "expected"),
    [("046", 1.0), ("046<eos>", 1.0), ("046<eos>123", 1.0), ("046<pad><pad>", 1.0), ("0467", 0.0), ("46", 0.0),
     ("", 0.0), ("047<eos>", 0.0)],
)  # fmt: skip
def test_reward_is_exact_match_after_eos_and_pad(solution, expected):
    assert compute_score(DATA_SOURCE, solution, "046") == expected
    assert compute_score(DATA_SOURCE, solution, "046", extra_info={"index": 3}) == expected


def test_splits_are_deterministic_disjoint_and_sized():
    train, val = make_problems(seed=0)
    assert (len(train), len(val)) == (7000, 1000)
    assert not set(train) & set(val)
    assert make_problems(seed=0) == (train, val)
    assert make_problems(seed=1)[0] != train
    with pytest.raises(ValueError, match="10,000"):
        make_problems(seed=0, num_train=9500, num_val=1000)


def test_parquet_is_in_verls_rl_format(tmp_path):
    train_path, val_path = write_addition_parquets(tmp_path, seed=3, num_train=50, num_val=10)
    train, val = pd.read_parquet(train_path), pd.read_parquet(val_path)
    assert {"prompt", "data_source", "reward_model", "extra_info"} <= set(train.columns)
    first = train.iloc[0]
    content = first["prompt"][0]["content"]
    assert first["prompt"][0]["role"] == "user"
    a, b = content.rstrip("=").split("+")
    assert first["reward_model"] == {"style": "rule", "ground_truth": f"{int(a) + int(b):03d}"}
    assert first["data_source"] == DATA_SOURCE
    assert first["extra_info"] == {"index": 0, "split": "train"}
    assert val.iloc[9]["extra_info"] == {"index": 9, "split": "test"}


def test_model_is_the_calibrated_tiny_qwen2():
    model = build_addition_model(seed=0)
    assert model.config.model_type == "qwen2"
    assert sum(p.numel() for p in model.parameters()) == 124_416
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied embeddings


def test_warmup_lowers_the_answer_loss(tokenizer):
    model = build_addition_model(seed=0)
    train, _ = make_problems(seed=0, num_train=512, num_val=0)
    result = addition.supervised_warmup(model, tokenizer, train, seed=0, steps=30, batch_size=64)
    assert result.final_loss < 2.4  # a uniform guess over 15 tokens is ln 15 = 2.71


def test_greedy_loop_matches_transformers_generate(tokenizer):
    model = build_addition_model(seed=5).eval()
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in ["12+34=", "99+99=", "00+07="]]
    ours = addition.greedy_complete(model, prompts, max_new_tokens=4)
    with torch.inference_mode():
        reference = model.generate(
            torch.tensor(prompts), do_sample=False, max_new_tokens=4, min_new_tokens=4, pad_token_id=0
        )[:, 6:].tolist()
    assert ours == reference


def test_assets_are_a_standard_hf_folder_and_evaluate_reproduces_the_warmup_score(small_assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert small_assets.tokenizer_dir == small_assets.model_dir
    assert (small_assets.model_dir / "model.safetensors").is_file()
    AutoModelForCausalLM.from_pretrained(small_assets.model_dir)
    assert AutoTokenizer.from_pretrained(small_assets.model_dir).eos_token_id == 1
    assert len(pd.read_parquet(small_assets.train_parquet)) == SMALL["num_train"]
    accuracy = evaluate_accuracy(small_assets.model_dir, small_assets.val_parquet)
    assert accuracy == pytest.approx(small_assets.warmup_val_accuracy)


def test_second_call_with_the_same_key_reuses_the_entry(small_assets):
    entry = small_assets.model_dir.parent
    stamp = (entry / "assets.json").stat().st_mtime_ns
    again = prepare_addition_assets(entry.parent, seed=0, **SMALL)
    assert again == small_assets
    assert (entry / "assets.json").stat().st_mtime_ns == stamp
    other = prepare_addition_assets(entry.parent, seed=1, **SMALL)
    assert other.model_dir.parent != entry
    assert sorted(p.name for p in entry.parent.iterdir() if p.name.startswith(".tmp")) == []


def test_a_failed_build_leaves_no_entry_behind(tmp_path, monkeypatch):
    def broken_warmup(*args, **kwargs):
        raise RuntimeError("out of memory halfway")

    monkeypatch.setattr(addition, "supervised_warmup", broken_warmup)
    with pytest.raises(RuntimeError, match="halfway"):
        prepare_addition_assets(tmp_path, seed=0, **SMALL)
    assert list(Path(tmp_path).iterdir()) == []


def test_cache_key_covers_every_setting(monkeypatch):
    base = addition._cache_key(0, 256, 64, 3)
    variants = {
        addition._cache_key(1, 256, 64, 3),
        addition._cache_key(0, 255, 64, 3),
        addition._cache_key(0, 256, 63, 3),
        addition._cache_key(0, 256, 64, 4),
    }
    monkeypatch.setattr(addition, "ASSETS_VERSION", addition.ASSETS_VERSION + 1)
    variants.add(addition._cache_key(0, 256, 64, 3))
    monkeypatch.setattr(addition, "MODEL_CONFIG", addition.MODEL_CONFIG | {"hidden_size": 32})
    variants.add(addition._cache_key(0, 256, 64, 3))
    assert len(variants) == 6
    assert base not in variants


def test_preparing_the_task_for_a_run_prints_no_progress_bar(tmp_path, capfd):
    """A cold cache saves the warmed-up model: transformers' "Writing model shards" bar must not reach the console."""
    from transformers.utils import logging as hf_logging

    from rllm.experimental.fully_async.runtime.run.prepare import prepare_task
    from rllm.experimental.fully_async.settings.loader import load_config

    cfg = load_config(None, [f"task.cache_dir={tmp_path}", "task.warmup_steps=3"])
    hf_logging.enable_progress_bar()
    prepare_task(cfg)
    out, err = capfd.readouterr()
    assert Path(cfg.actor_rollout_ref.model.path, "model.safetensors").exists()
    assert "task addition ready" in out
    assert "it/s" not in err and "Writing model shards" not in err, err
    assert hf_logging.is_progress_bar_enabled(), "the driver's own setting must be restored"


# --- the registry ---------------------------------------------------------------------------------------------


def test_an_unknown_task_name_lists_the_registered_ones_in_one_line():
    from rllm.experimental.fully_async.settings.loader import ConfigError, load_config
    from rllm.experimental.fully_async.tasks import get_task, task_names

    assert {"addition", "smollm2"} <= set(task_names())
    with pytest.raises(ConfigError) as info:
        load_config(None, ["task.name=subtraction"])
    message = str(info.value)
    assert "\n" not in message and "'subtraction'" in message
    assert all(name in message for name in task_names())
    with pytest.raises(KeyError, match="addition, calculator, number_line, smollm2"):
        get_task("subtraction")


def test_a_registered_task_points_the_config_at_its_assets_and_a_users_reward_wins(tmp_path, capsys):
    from rllm.experimental.fully_async.settings.loader import load_config, verl_base_config
    from rllm.experimental.fully_async.tasks import _REGISTRY, TaskAssets, apply_task, register_task

    seen = []

    def prepare(task_cfg):
        seen.append(int(task_cfg.seed))
        return TaskAssets(str(tmp_path / "t.parquet"), None, str(tmp_path / "model"), "my.rewards", "score", "ok")

    register_task("echo", prepare)
    try:
        cfg = load_config(None, ["task.name=echo", "task.seed=7"])  # validation asks the registry
        apply_task(cfg, verl_base_config())
        assert seen == [7]
        assert cfg.data.train_files == str(tmp_path / "t.parquet") and cfg.data.val_files is None
        assert cfg.actor_rollout_ref.model.path == str(tmp_path / "model")
        assert (cfg.reward.custom_reward_function.path, cfg.reward.custom_reward_function.name) == (
            "my.rewards",
            "score",
        )
        assert "task echo ready in" in capsys.readouterr().out
        cfg = load_config(None, ["task.name=echo", "reward.custom_reward_function.path=mine.py"])
        apply_task(cfg, verl_base_config())
        assert cfg.reward.custom_reward_function.path == "mine.py"
    finally:
        _REGISTRY.pop("echo")


@pytest.mark.parametrize(
    "override",
    ["data.train_files=/mine/t.parquet", "data.val_files=/mine/v.parquet", "actor_rollout_ref.model.path=/mine/m"],
)
def test_a_users_data_or_model_with_a_built_in_task_is_refused_in_one_line(override):
    """The default config names the addition task; a user's own files or model must not be trained on addition."""
    from rllm.experimental.fully_async.settings.loader import ConfigError, load_config

    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"'{re.escape(key)}' is set, but task\.name=addition makes its own") as info:
        load_config(None, [override])
    assert "set task.name=null" in str(info.value) and "\n" not in str(info.value)
    # with task.name=null the same value is the user's, untouched
    cfg = load_config(None, ["task.name=null", "data.train_files=/mine/t.parquet", override])
    assert OmegaConf.select(cfg, key) == override.split("=", 1)[1]


def test_skipping_validation_with_a_task_is_pointed_at_the_keys_that_do_it():
    from rllm.experimental.fully_async.settings.loader import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"trainer\.test_freq=0 trainer\.val_before_train=false"):
        load_config(None, ["data.val_files=null"])


def test_apply_task_refuses_rather_than_replaces_a_value_set_after_loading(tmp_path):
    """A config edited in code after load_config reaches apply_task: it must not be silently overwritten."""
    from rllm.experimental.fully_async.settings.loader import ConfigError, load_config, verl_base_config
    from rllm.experimental.fully_async.tasks import _REGISTRY, TaskAssets, apply_task, register_task

    prepared = []

    def prepare(task_cfg):
        prepared.append(True)
        return TaskAssets(str(tmp_path / "t.parquet"), None, str(tmp_path / "model"), "my.rewards")

    register_task("echo", prepare)
    try:
        cfg = load_config(None, ["task.name=echo"])
        cfg.actor_rollout_ref.model.path = "/mine/m"
        with pytest.raises(ConfigError, match=r"'actor_rollout_ref\.model\.path' is set, but task\.name=echo"):
            apply_task(cfg, verl_base_config())
        assert cfg.actor_rollout_ref.model.path == "/mine/m" and not prepared  # untouched, nothing prepared
    finally:
        _REGISTRY.pop("echo")


def test_reading_the_registry_imports_no_task_module():
    import subprocess
    import sys

    code = (
        "import sys; from rllm.experimental.fully_async.tasks import task_names; task_names(); "
        "print('torch' in sys.modules, 'rllm.experimental.fully_async.tasks.addition' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_a_task_cache_entry_is_built_once_and_a_lost_race_keeps_the_winners_entry(tmp_path):
    """tasks/cache.py, which every built-in task uses: the second call only reads the marker; a build whose entry
    another process renamed into place first is discarded, and nothing temporary is left behind."""
    from rllm.experimental.fully_async.tasks.cache import cache_key, cached_entry

    key = cache_key({"seed": 0})
    builds: list[Path] = []

    def build(folder: Path) -> dict:
        builds.append(folder)
        (folder / "data.txt").write_text("ours")
        return {"who": "ours"}

    entry, meta = cached_entry(tmp_path, "t", key, build)
    assert meta == {"who": "ours"} and (entry / "data.txt").read_text() == "ours"
    assert cached_entry(tmp_path, "t", key, build) == (entry, meta) and len(builds) == 1

    other = cache_key({"seed": 1})

    def loses_the_race(folder: Path) -> dict:
        winner = tmp_path / f"t-{other}"
        winner.mkdir()
        (winner / "assets.json").write_text('{"who": "theirs"}')
        return {"who": "ours"}

    entry, meta = cached_entry(tmp_path, "t", other, loses_the_race)
    assert meta == {"who": "theirs"}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"t-{key}", f"t-{other}"])


def test_task_asset_paths_are_where_apply_task_points_the_config(addition_cache, number_line_cache):
    from rllm.experimental.fully_async.settings.loader import load_config, verl_base_config
    from rllm.experimental.fully_async.tasks import TASK_ASSET_KEYS, apply_task, task_asset_paths

    quick = ["task.warmup_steps=60"]
    agent = ["task.name=number_line", "workflow.name=multi_turn", "env.name=number_line"]
    for cache, task in ((addition_cache, []), (number_line_cache, agent)):
        cfg = load_config(None, [f"task.cache_dir={cache}", *quick, *task])
        located = task_asset_paths(cfg)
        apply_task(cfg, verl_base_config())  # the cache holds this entry: it is read, not built
        assert located == {key: OmegaConf.select(cfg, key) for key in TASK_ASSET_KEYS}
        assert all(Path(path).exists() for path in located.values())


@pytest.mark.parametrize("name", ["addition", "number_line", "calculator", "smollm2"])
def test_task_asset_paths_build_nothing(name, tmp_path):
    from rllm.experimental.fully_async.tasks import task_asset_paths

    cfg = OmegaConf.create({"task": {"name": name, "cache_dir": str(tmp_path), "seed": 0, "warmup_steps": 5}})
    located = task_asset_paths(cfg)
    if located is None:  # smollm2 without its package: the run says so in one line; `config` shows no path
        assert name == "smollm2"
        return
    assert set(located) == {"data.train_files", "data.val_files", "actor_rollout_ref.model.path"}
    assert all(path.startswith(str(tmp_path)) for path in located.values())
    assert list(tmp_path.iterdir()) == []
