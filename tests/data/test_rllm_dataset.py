"""rLLM's DatasetRegistry (rllm.data.dataset): rows registered by name and split, stored where and how rLLM stores them.

The registry's layout is rLLM's (v2 registry.json, relative paths, a verl-format companion file), so a registry rLLM
wrote is read here: one test writes rLLM's layout by hand and loads it. RLLM_HOME points every test at its own folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rllm.data import Dataset, DatasetRegistry

ROWS = [
    {"question": "2+2?", "ground_truth": "4", "meta": {"level": 1, "tags": ["easy"]}},
    {"question": "3*3?", "ground_truth": "9", "meta": {"level": 2, "tags": ["easy", "times"]}},
]


@pytest.fixture(autouse=True)
def rllm_home(tmp_path, monkeypatch):
    monkeypatch.setenv("RLLM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_registered_rows_come_back_as_they_went_in(rllm_home):
    registered = DatasetRegistry.register_dataset("toy", ROWS, "train", source="hand", category="math")
    assert registered.get_data() == ROWS and (registered.name, registered.split) == ("toy", "train")
    loaded = DatasetRegistry.load_dataset("toy", "train")
    assert loaded.get_data() == ROWS  # nested structs and lists as Python dicts and lists
    assert loaded.get_data_path() == str(rllm_home / "datasets" / "toy" / "train.parquet")
    registry = json.loads((rllm_home / "datasets" / "registry.json").read_text())
    assert registry["version"] == 2
    assert registry["datasets"]["toy"] == {
        "metadata": {"source": "hand", "category": "math"},
        "splits": {
            "train": {"path": "toy/train.parquet", "num_examples": 2, "fields": ["question", "ground_truth", "meta"]}
        },
    }
    # verl's RL format beside it, each row in extra_info (rLLM's apply_verl_postprocessing)
    verl_rows = pq.read_table(loaded.get_verl_data_path()).to_pylist()
    assert verl_rows[1]["extra_info"] == ROWS[1] and verl_rows[1]["prompt"] == [
        {"role": "user", "content": "placeholder"}
    ]


def test_names_splits_and_removal():
    DatasetRegistry.register_dataset("toy", ROWS, "train")
    DatasetRegistry.register_dataset("toy", ROWS[:1], "test")
    assert DatasetRegistry.get_dataset_names() == ["toy"]
    assert DatasetRegistry.get_dataset_splits("toy") == ["train", "test"]
    assert DatasetRegistry.dataset_exists("toy") and DatasetRegistry.dataset_exists("toy", "test")
    assert not DatasetRegistry.dataset_exists("toy", "val") and not DatasetRegistry.dataset_exists("other")
    assert DatasetRegistry.load_dataset("toy", "val") is None and DatasetRegistry.load_dataset("other") is None
    path = Path(DatasetRegistry.load_dataset("toy", "test").get_data_path())
    assert DatasetRegistry.remove_dataset_split("toy", "test") and not DatasetRegistry.dataset_exists("toy", "test")
    assert not path.exists() and not path.with_name("test_verl.parquet").exists()
    assert DatasetRegistry.remove_dataset("toy") and DatasetRegistry.get_dataset_names() == []
    assert not DatasetRegistry.remove_dataset("toy")


def test_a_registry_rllm_wrote_is_read(rllm_home):
    """rLLM's own layout, written by hand: relative path in a v2 registry, the split's parquet beside it."""
    import pandas as pd

    folder = rllm_home / "datasets" / "browsecomp-plus"
    folder.mkdir(parents=True)
    pd.DataFrame(ROWS).to_parquet(folder / "test.parquet")
    registry = {
        "version": 2,
        "datasets": {"browsecomp-plus": {"metadata": {}, "splits": {"test": {"path": "browsecomp-plus/test.parquet"}}}},
    }
    (rllm_home / "datasets" / "registry.json").write_text(json.dumps(registry))
    assert DatasetRegistry.load_dataset("browsecomp-plus", "test").get_data() == ROWS


def test_rows_with_bytes_are_stored_as_arrow_as_rllm_does(rllm_home):
    rows = [{"image": b"\x89PNG...", "question": "what is it?"}]
    DatasetRegistry.register_dataset("pictures", rows, "train")
    assert (rllm_home / "datasets" / "pictures" / "train.arrow").is_file()
    assert DatasetRegistry.load_dataset("pictures", "train").get_data() == rows
    companion = pq.read_table(rllm_home / "datasets" / "pictures" / "train_verl.parquet").to_pylist()
    assert companion[0]["extra_info"]["image"] == {"bytes": b"\x89PNG...", "path": ""}


def test_dataset_helpers_follow_rllm():
    data = Dataset([{"i": i} for i in range(4)], name="n", split="s")
    assert [r["i"] for r in data.repeat(2)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [r["i"] for r in data.select([3, 1, 9])] == [3, 1]  # out of range skipped
    assert sorted(r["i"] for r in data.shuffle(seed=0)) == [0, 1, 2, 3]
    assert data.shuffle(seed=0).get_data() == data.shuffle(seed=0).get_data()
    assert data.get_data_path() is None  # not registered
    with pytest.raises(ValueError, match="Repeat count must be positive"):
        data.repeat(0)


def test_load_data_reads_the_file_formats_rllm_reads(tmp_path):
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS))
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    assert Dataset.load_data(str(tmp_path / "rows.jsonl")).get_data() == ROWS
    assert Dataset.load_data(str(tmp_path / "rows.json")).get_data() == ROWS
    with pytest.raises(FileNotFoundError):
        Dataset.load_data(str(tmp_path / "missing.parquet"))
    (tmp_path / "rows.txt").write_text("x")
    with pytest.raises(ValueError, match=r"Unsupported file format: \.txt"):
        Dataset.load_data(str(tmp_path / "rows.txt"))
