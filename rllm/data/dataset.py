"""rLLM's dataset registry (`rllm.data.dataset`): name a list of rows once, load it by name and split later.

rLLM's programs register their data with `DatasetRegistry.register_dataset(name, rows, split)` and its fully-async
executor loads `DatasetRegistry.load_dataset(name, split)` and hands each row, as stored, to the rollout function.
This is the same registry, on the same disk layout, so a dataset registered by rLLM is found here and the other
way round:

    $RLLM_HOME/datasets/registry.json          (RLLM_HOME defaults to ~/.rllm)
        {"version": 2, "datasets": {name: {"metadata": {...},
                                           "splits": {split: {"path": "<name>/<split>.parquet",
                                                              "num_examples": n, "fields": [...]}}}}}
    $RLLM_HOME/datasets/<name>/<split>.parquet        the rows
    $RLLM_HOME/datasets/<name>/<split>_verl.parquet   verl's RL format with each row in `extra_info`

Rows holding bytes (images) are stored as `<split>.arrow` (Arrow IPC), as rLLM does. Paths in the registry are
relative to the datasets folder. RLLM_HOME is read at every call (rLLM reads it when the module is imported), so a
test points the registry at a temporary folder with the environment variable alone.

Not carried over from rLLM: the migration of its pre-v2 registry (`rllm/registry/dataset_registry.json`), and
`load_dataset(as_tasks=True)` (rLLM's `rllm.types.Task`, which its fully-async module does not use).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

logger = logging.getLogger(__name__)

DEFAULT_RLLM_HOME = "~/.rllm"


def rllm_home() -> Path:
    """`$RLLM_HOME`, else ~/.rllm (rLLM's `rllm.paths.rllm_home`)."""
    return Path(os.path.expanduser(os.environ.get("RLLM_HOME", DEFAULT_RLLM_HOME)))


class Dataset:
    """Rows (dicts) with the `__len__` / `__getitem__` a torch DataLoader needs, and rLLM's helpers."""

    def __init__(self, data: list[dict[str, Any]], name: str | None = None, split: str | None = None) -> None:
        self.data = data
        self.name = name
        self.split = split

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        return self.data[idx]

    def get_data(self) -> list[dict[str, Any]]:
        return self.data

    def repeat(self, n: int) -> Dataset:
        """Each row n times, the copies adjacent."""
        if n <= 0:
            raise ValueError("Repeat count must be positive")
        return Dataset([row.copy() for row in self.data for _ in range(n)], self.name, self.split)

    def shuffle(self, seed: int | None = None) -> Dataset:
        order = list(range(len(self.data)))
        (random.Random(seed) if seed is not None else random).shuffle(order)
        return Dataset([self.data[i] for i in order], self.name, self.split)

    def select(self, indices: list[int] | range) -> Dataset:
        """The rows at `indices` (out-of-range indices are skipped, as in rLLM)."""
        return Dataset([self.data[i] for i in indices if 0 <= i < len(self.data)], self.name, self.split)

    def get_data_path(self) -> str | None:
        """The registered file of this dataset's split, or None when it is not registered."""
        if self.name is None or self.split is None:
            return None
        path = DatasetRegistry.split_path(self.name, self.split)
        return None if path is None else str(path)

    def get_verl_data_path(self) -> str | None:
        """The verl-format companion file, or None when absent."""
        path = self.get_data_path()
        if path is None:
            return None
        verl = DatasetRegistry._verl_path_for(path)
        return verl if os.path.exists(verl) else None

    @classmethod
    def load_data(cls, path: str) -> Dataset:
        """Rows from a .json, .jsonl, .csv, .parquet or .arrow file."""
        if not os.path.exists(path):
            raise FileNotFoundError(f"Dataset file not found at {path}")
        return cls(data=read_rows(path))


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a dataset file, as rLLM's loaders give them: nested lists and structs as Python lists and dicts
    (pyarrow's `to_pylist`, the same values rLLM's polars `to_dicts` gives). ValueError names an unknown format."""
    path = str(path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".json":
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    if suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    if suffix == ".csv":
        return pd.read_csv(path).to_dict("records")
    if suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    if suffix == ".arrow":
        with pa.OSFile(path, "rb") as f:
            return ipc.open_file(f).read_all().to_pylist()
    raise ValueError(f"Unsupported file format: {suffix} ({path}); use .parquet, .arrow, .json, .jsonl or .csv")


class DatasetRegistry:
    """Datasets by name and split, stored under `$RLLM_HOME/datasets` (module docstring)."""

    @classmethod
    def datasets_dir(cls) -> Path:
        return rllm_home() / "datasets"

    @classmethod
    def registry_file(cls) -> Path:
        return cls.datasets_dir() / "registry.json"

    # ---- the registry file ---------------------------------------------------------------------------------

    @classmethod
    def _load_registry(cls) -> dict[str, Any]:
        path = cls.registry_file()
        if not path.exists():
            return {"version": 2, "datasets": {}}
        try:
            registry = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            logger.warning("Invalid JSON in registry file %s. Creating a new registry.", path)
            return {"version": 2, "datasets": {}}
        if registry.get("version") != 2:
            raise ValueError(
                f"{path} is rLLM's pre-v2 dataset registry; load it once with rLLM (which migrates it) or register "
                "the datasets again"
            )
        return registry

    @classmethod
    def _save_registry(cls, registry: dict[str, Any]) -> None:
        cls.datasets_dir().mkdir(parents=True, exist_ok=True)
        # Write then rename: a reader (another process resolving a name) never sees half a file.
        tmp = cls.registry_file().with_suffix(".json.tmp")
        tmp.write_text(json.dumps(registry, indent=2), encoding="utf-8")
        tmp.replace(cls.registry_file())

    @classmethod
    def _resolve_path(cls, rel_path: str) -> str:
        return rel_path if os.path.isabs(rel_path) else str(cls.datasets_dir() / rel_path)

    @classmethod
    def _verl_path_for(cls, dataset_path: str) -> str:
        if dataset_path.endswith(".arrow"):
            return dataset_path[: -len(".arrow")] + "_verl.parquet"
        return dataset_path.replace(".parquet", "_verl.parquet")

    @classmethod
    def split_path(cls, name: str, split: str) -> Path | None:
        """The file holding `name`'s `split`, or None when it is not registered (not part of rLLM's API: the
        trainer resolves `data.train_dataset_name` with it)."""
        splits = cls._load_registry().get("datasets", {}).get(name, {}).get("splits", {})
        if split not in splits:
            return None
        return Path(cls._resolve_path(splits[split]["path"]))

    # ---- registering ---------------------------------------------------------------------------------------

    @classmethod
    def register_dataset(
        cls,
        name: str,
        data: list[dict[str, Any]] | Any,
        split: str = "default",
        source: str = "",
        description: str = "",
        category: str = "",
    ) -> Dataset:
        """Store `data` (a list of dicts, or anything with `to_pandas()`, such as a Hugging Face dataset) as
        `name`'s `split`, replacing an earlier registration of that split."""

        rows = data.to_pandas().to_dict("records") if callable(getattr(data, "to_pandas", None)) else data
        folder = cls.datasets_dir() / name
        folder.mkdir(parents=True, exist_ok=True)
        binary = _binary_columns(rows)
        if binary:
            rel_path = f"{name}/{split}.arrow"
            _write_arrow(rows, cls._resolve_path(rel_path))
            verl_rows = cls.apply_verl_postprocessing(_wrap_binary(rows, binary))
        else:
            rel_path = f"{name}/{split}.parquet"
            pd.DataFrame(rows).to_parquet(cls._resolve_path(rel_path))
            verl_rows = cls.apply_verl_postprocessing(rows)
        pd.DataFrame(verl_rows).to_parquet(cls._verl_path_for(cls._resolve_path(rel_path)))
        registry = cls._load_registry()
        entry = registry.setdefault("datasets", {}).setdefault(name, {"metadata": {}, "splits": {}})
        for key, value in (("source", source), ("description", description), ("category", category)):
            if value:
                entry["metadata"][key] = value
        fields = list(rows[0].keys()) if rows else []
        entry["splits"][split] = {"path": rel_path, "num_examples": len(rows), "fields": fields}
        cls._save_registry(registry)
        logger.info("Registered dataset '%s' split '%s' with %d examples.", name, split, len(rows))
        return Dataset(data=rows, name=name, split=split)

    @classmethod
    def apply_verl_postprocessing(cls, data: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """verl's RL format around each row (a placeholder prompt, the row in `extra_info`), as rLLM writes it."""
        return [
            {
                "prompt": [{"role": "user", "content": "placeholder"}],
                "reward_model": {"style": "rule", "ground_truth": None},
                "extra_info": entry,
            }
            for entry in data
        ]

    # ---- reading -------------------------------------------------------------------------------------------

    @classmethod
    def load_dataset(cls, name: str, split: str = "default", *, as_tasks: bool = False) -> Dataset | None:
        """`name`'s `split` as a Dataset of its rows, or None (with a warning) when it is not registered."""
        if as_tasks:
            raise NotImplementedError("load_dataset(as_tasks=True) wraps rows as rLLM's rllm.types.Task: not here")
        datasets = cls._load_registry().get("datasets", {})
        if name not in datasets:
            logger.warning("Dataset '%s' not found in registry.", name)
            return None
        if split not in datasets[name].get("splits", {}):
            logger.warning("Split '%s' not found in dataset '%s'.", split, name)
            return None
        path = cls.split_path(name, split)
        assert path is not None  # the split is registered
        if not path.exists():
            logger.warning("Dataset file not found: %s", path)
            return None
        return Dataset(data=read_rows(path), name=name, split=split)

    @classmethod
    def get_dataset_names(cls) -> list[str]:
        return list(cls._load_registry().get("datasets", {}))

    @classmethod
    def get_dataset_splits(cls, name: str) -> list[str]:
        return list(cls._load_registry().get("datasets", {}).get(name, {}).get("splits", {}))

    @classmethod
    def dataset_exists(cls, name: str, split: str | None = None) -> bool:
        datasets = cls._load_registry().get("datasets", {})
        if name not in datasets:
            return False
        return split is None or split in datasets[name].get("splits", {})

    @classmethod
    def get_dataset_info(cls, name: str) -> dict[str, Any] | None:
        """`{"metadata": {...}, "splits": {...}}` of `name`, or None."""
        return cls._load_registry().get("datasets", {}).get(name)

    # ---- removing ------------------------------------------------------------------------------------------

    @classmethod
    def remove_dataset_split(cls, name: str, split: str) -> bool:
        """Delete one split's files and registry entry (the dataset too when it was the last split)."""
        registry = cls._load_registry()
        datasets = registry.get("datasets", {})
        if split not in datasets.get(name, {}).get("splits", {}):
            logger.warning("Dataset '%s' split '%s' not found in registry.", name, split)
            return False
        cls._remove_files(datasets[name]["splits"].pop(split))
        if not datasets[name]["splits"]:
            del datasets[name]
            cls._remove_folder(name)
        cls._save_registry(registry)
        return True

    @classmethod
    def remove_dataset(cls, name: str) -> bool:
        """Delete every split's files and the dataset's registry entry."""
        registry = cls._load_registry()
        datasets = registry.get("datasets", {})
        if name not in datasets:
            logger.warning("Dataset '%s' not found in registry.", name)
            return False
        for info in datasets.pop(name).get("splits", {}).values():
            cls._remove_files(info)
        cls._remove_folder(name)
        cls._save_registry(registry)
        return True

    @classmethod
    def _remove_files(cls, split_info: dict[str, Any]) -> None:
        path = cls._resolve_path(split_info["path"])
        for file in (path, cls._verl_path_for(path)):
            if os.path.exists(file):
                os.remove(file)

    @classmethod
    def _remove_folder(cls, name: str) -> None:
        folder = cls.datasets_dir() / name
        if (folder / "images").is_dir():  # rLLM's older image layout
            shutil.rmtree(folder / "images")
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def _binary_columns(rows: list[dict[str, Any]]) -> list[str]:
    """Columns of the first row holding bytes or a list of bytes (rLLM's test for image data)."""
    if not rows:
        return []
    return [
        key
        for key, value in rows[0].items()
        if isinstance(value, bytes) or (isinstance(value, list) and value and isinstance(value[0], bytes))
    ]


def _write_arrow(rows: list[dict[str, Any]], path: str) -> None:

    table = pa.Table.from_pylist(rows) if rows else pa.table({})
    with pa.OSFile(path, "wb") as f, ipc.new_file(f, table.schema) as writer:
        writer.write_table(table)


def _wrap_binary(rows: list[dict[str, Any]], columns: list[str]) -> list[dict[str, Any]]:
    """Binary cells as verl's image dicts `{"bytes": ..., "path": ""}` for the verl-format companion."""

    def wrap(value: Any) -> Any:
        if isinstance(value, bytes):
            return {"bytes": value, "path": ""}
        if isinstance(value, list):
            return [{"bytes": v, "path": ""} if isinstance(v, bytes) else v for v in value]
        return value

    return [{**row, **{c: wrap(row.get(c)) for c in columns}} for row in rows]
