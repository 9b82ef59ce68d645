"""The embedded engine's weight updates (`engines/embedded/weights.py`): in-place loads into a recycled spare model."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rllm.experimental.fully_async.engines.embedded.model_runner import load_model
from rllm.experimental.fully_async.engines.embedded.weights import WeightLoader, read_safetensors_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def assert_holds_weights_of(model: torch.nn.Module, folder: Path) -> None:
    """Every tensor of `model` equals (after the cast to its dtype) the one `from_pretrained(folder)` builds."""
    expected = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    actual = model.state_dict()
    assert set(actual) == set(expected)
    for name, tensor in actual.items():
        assert torch.equal(tensor, expected[name].to(tensor.dtype)), name


def serving_then_spare(folder: Path, dtype: str = "float32") -> tuple[WeightLoader, torch.nn.Module]:
    """A loader whose spare is a model loaded from `folder`, as after the engine's first swap."""
    loader = WeightLoader(dtype)
    model, info = load_model(folder, dtype)
    loader.recycle(model, info)
    return loader, model


def test_an_update_of_the_same_model_overwrites_the_spare_in_place(models):
    (path_a, _), (path_b, _) = models["a"], models["b"]
    loader, spare = serving_then_spare(path_a)
    model, info = loader.load(str(path_b))
    assert model is spare, "the update should reuse the retired model, not build one"
    assert loader.counts == {"weight_loads_in_place": 1, "weight_loads_full": 0}
    assert info.model_path == str(path_b)
    assert_holds_weights_of(model, path_b)
    # The tiny Qwen2 ties lm_head to the embeddings and its save keeps one name: the tie survives the copy.
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_the_first_update_and_another_model_build_a_new_one(models, tmp_path):
    (path_a, _), (path_b, _) = models["a"], models["b"]
    loader = WeightLoader()
    first, info = loader.load(str(path_a))
    assert loader.counts == {"weight_loads_in_place": 0, "weight_loads_full": 1}
    other = tmp_path / "other"
    shutil.copytree(path_b, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3  # same tensors, another computation: must not be copied into the spare
    (other / "config.json").write_text(json.dumps(config))
    loader.recycle(first, info)
    model, _ = loader.load(str(other))
    assert model is not first
    assert model.config.rms_norm_eps == 1e-3
    assert loader.counts == {"weight_loads_in_place": 0, "weight_loads_full": 2}


def test_a_save_from_another_transformers_version_still_loads_in_place(models, tmp_path):
    (path_a, _), (path_b, _) = models["a"], models["b"]
    resaved = tmp_path / "resaved"
    shutil.copytree(path_b, resaved)
    config = json.loads((resaved / "config.json").read_text())
    config.update(transformers_version="0.0.1", _name_or_path="/elsewhere", dtype="bfloat16")
    (resaved / "config.json").write_text(json.dumps(config))
    loader, spare = serving_then_spare(path_a)
    assert loader.load(str(resaved))[0] is spare
    assert_holds_weights_of(spare, path_b)


def test_a_sharded_folder_and_a_lower_precision_engine(models, tmp_path):
    (path_a, _), (path_b, _) = models["a"], models["b"]
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(path_b).save_pretrained(sharded, max_shard_size="20KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    loader, spare = serving_then_spare(path_a, dtype="bfloat16")
    model, _ = loader.load(str(sharded))
    assert model is spare and next(model.parameters()).dtype == torch.bfloat16
    assert_holds_weights_of(model, path_b)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("drop", "parameter 'model.norm.weight' is missing"),
        ("reshape", "tensor 'model.norm.weight' has shape (32,), the served model's has (64,)"),
        ("rename", "tensor 'model.norm.weight_typo' is not in the served model"),
    ],
)
def test_a_folder_that_does_not_fit_fails_naming_the_tensor_and_drops_the_spare(models, tmp_path, damage, message):
    (path_a, _), (path_b, _) = models["a"], models["b"]
    broken = tmp_path / "broken"
    shutil.copytree(path_b, broken)
    tensors = load_file(broken / "model.safetensors")
    norm = tensors.pop("model.norm.weight")
    if damage == "reshape":
        tensors["model.norm.weight"] = norm[:32].clone()
    elif damage == "rename":
        tensors["model.norm.weight_typo"] = norm
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    loader, spare = serving_then_spare(path_a)
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        loader.load(str(broken))
    assert str(broken) in str(error.value)
    # The spare may be half-written now: the next update must build a model, not trust it.
    model, _ = loader.load(str(path_b))
    assert model is not spare
    assert loader.counts == {"weight_loads_in_place": 0, "weight_loads_full": 1}


def test_reading_a_folder_keeps_no_python_objects_alive(models):
    """The leak this module exists for: safetensors' mmap backend kept 2 objects per tensor opened, forever."""
    path_b, _ = models["b"]
    tensors_per_load = len(read_safetensors_folder(path_b))
    loader, _ = serving_then_spare(models["a"][0])
    for _ in range(20):  # warm caches (allocator pools, interned names) before counting
        model, info = loader.load(str(path_b))
        loader.recycle(model, info)
    before = sys.getallocatedblocks()
    loads = 300
    for _ in range(loads):
        model, info = loader.load(str(path_b))
        loader.recycle(model, info)
    grown = sys.getallocatedblocks() - before
    # The leaking reader grows by 2 x tensors_per_load blocks a load (here 300 x 2 x 27 ~ 16k); allow a tenth.
    assert grown < loads * 2 * tensors_per_load / 10, f"{grown} blocks more after {loads} loads"
    assert loader.counts["weight_loads_in_place"] == loads + 20
