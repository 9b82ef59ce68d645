"""Calculator: a tool task a tiny Qwen2 learns on CPU in minutes (env: envs/product.py, tool: tools/calculator.py).

The problem is a product of two 2-digit numbers. The model cannot multiply; it can call the calculator in the
compact tool format and copy its answer. The conversation, token by token (character-level vocabulary):

    Q 23*47=  c[23*47]<eos>  >1081:  1081<eos>        (prompt, problem, tool call, tool result, answer)

The tool result is a tool message, which the chat template renders as ">result:"; both the problem and the
result are appended with loss mask 0. The supervised warm-up imitates a demonstrator that calls the tool only
with probability `DEMO_TOOL_P` and otherwise guesses a number, so it starts near that success rate; RL learns to
call the tool every time (the best policy always succeeds).

Data: random (a, b) pairs, 10..99, split into disjoint train and held-out sets by a fixed seed, written as
verl-format parquet (prompt "Q", `extra_info` {a, b}, ground truth the product).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from rllm.experimental.fully_async.tasks import TaskAssets, entry_paths
from rllm.experimental.fully_async.tasks.cache import cache_key, cached_entry, entry_path
from rllm.experimental.fully_async.tasks.imitation import imitation_warmup, pad_rows
from rllm.experimental.fully_async.tasks.number_line import build_model as tiny_qwen2
from rllm.experimental.fully_async.tasks.number_line import build_tokenizer as character_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

DATA_SOURCE = "fully_async/calculator"
PAD_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<eos>", "<unk>"
CHARACTERS = "0123456789*=c[]>:Q"
VOCAB: dict[str, int] = {PAD_TOKEN: 0, EOS_TOKEN: 1, UNK_TOKEN: 2} | {c: 3 + i for i, c in enumerate(CHARACTERS)}
# A tool message renders as ">result:", everything else verbatim (so the result is delimited for the model).
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}>{{ m['content'] }}:{% else %}{{ m['content'] }}{% endif %}"
    "{% endfor %}"
)
PROMPT = "Q"
DEMO_TOOL_P = 0.4
NUM_TRAIN, NUM_VAL = 3000, 100
ASSETS_VERSION = 1
WARMUP_BATCH_SIZE = 128
WARMUP_LR = 2e-3
MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,  # an episode is at most ~30 tokens
    "tie_word_embeddings": True,
    "rope_theta": 10_000.0,
}


@dataclass(frozen=True)
class CalculatorAssets:
    model_dir: Path
    train_parquet: Path
    val_parquet: Path
    warmup_seconds: float
    cache_key: str


def build_tokenizer() -> PreTrainedTokenizerFast:

    return character_tokenizer(VOCAB, CHAT_TEMPLATE)


def build_model(seed: int = 0) -> PreTrainedModel:

    return tiny_qwen2(seed, VOCAB, MODEL_CONFIG)


def make_pairs(seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    return pairs[NUM_VAL : NUM_VAL + NUM_TRAIN], pairs[:NUM_VAL]


def write_parquets(out_dir: Path, seed: int = 0) -> tuple[Path, Path]:

    train, val = make_pairs(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, pairs in (("train", train), ("val", val)):
        rows = [
            {
                "prompt": [{"role": "user", "content": PROMPT}],
                "data_source": DATA_SOURCE,
                "ability": "tool",
                "reward_model": {"style": "env", "ground_truth": str(a * b)},
                "extra_info": {"a": a, "b": b, "index": i, "split": name},
            }
            for i, (a, b) in enumerate(pairs)
        ]
        path = out_dir / f"{name}.parquet"
        pd.DataFrame(rows).to_parquet(path, index=False)
        paths.append(path)
    return paths[0], paths[1]


def demo_segments(a: int, b: int, rng: random.Random) -> list[tuple[str, bool]]:
    """One demonstration as (text, trained) segments: the tool route, or a guessed answer."""
    problem = [(PROMPT + f"{a}*{b}=", False)]
    if rng.random() < DEMO_TOOL_P:
        return [*problem, (f"c[{a}*{b}]" + EOS_TOKEN, True), (f">{a * b}:", False), (f"{a * b}" + EOS_TOKEN, True)]
    return [*problem, (f"{rng.randint(100, 9801)}" + EOS_TOKEN, True)]


def _encode_demos(tokenizer: Any, pairs: list[tuple[int, int]], count: int, seed: int):

    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        ids, labels = [], []
        for text, trained in demo_segments(*pairs[rng.randrange(len(pairs))], rng):
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids += piece
            labels += piece if trained else [-100] * len(piece)
        rows.append((ids, labels))
    return pad_rows(rows, VOCAB[PAD_TOKEN])


def supervised_warmup(model: PreTrainedModel, tokenizer: Any, seed: int, steps: int) -> float:
    """Imitate the demonstrator on train pairs for a fixed number of AdamW steps; returns the seconds taken."""

    train, _ = make_pairs(seed)
    ids, labels = _encode_demos(tokenizer, train, WARMUP_BATCH_SIZE * steps, seed)
    return imitation_warmup(
        model, ids, labels, pad_id=VOCAB[PAD_TOKEN], batch_size=WARMUP_BATCH_SIZE, lr=WARMUP_LR, steps=steps
    )


def _calculator_key(seed: int, warmup_steps: int) -> str:
    """The cache key of everything that changes what `prepare_calculator_assets` builds."""

    spec = {"v": ASSETS_VERSION, "seed": seed, "steps": warmup_steps, "model": MODEL_CONFIG, "vocab": VOCAB}
    spec |= {"batch": WARMUP_BATCH_SIZE, "lr": WARMUP_LR, "tool_p": DEMO_TOOL_P, "template": CHAT_TEMPLATE}
    return cache_key(spec)


def calculator_entry(cache_dir: str | Path, seed: int = 0, warmup_steps: int = 600) -> Path:
    """The cache folder `prepare_calculator_assets` builds (or reuses) for these settings; nothing is built."""
    return entry_path(cache_dir, "calculator", _calculator_key(seed, warmup_steps))


def prepare_calculator_assets(cache_dir: str | Path, seed: int = 0, warmup_steps: int = 600) -> CalculatorAssets:
    """Build (once, cached by a key of everything that changes it) the data and the warmed-up model."""
    key = _calculator_key(seed, warmup_steps)

    def build(folder: Path) -> dict[str, Any]:
        write_parquets(folder, seed)
        tokenizer, model = build_tokenizer(), build_model(seed)
        seconds = supervised_warmup(model, tokenizer, seed, warmup_steps)
        model.save_pretrained(folder / "model", safe_serialization=True)
        tokenizer.save_pretrained(folder / "model")
        return {"cache_key": key, "warmup_seconds": seconds}

    entry, meta = cached_entry(cache_dir, "calculator", key, build)
    return CalculatorAssets(
        entry / "model", entry / "train.parquet", entry / "val.parquet", float(meta["warmup_seconds"]), key
    )


def locate_task(task_cfg: Any) -> dict[str, str]:
    """The task registry's locator (tasks.task_asset_paths): where `prepare_task` puts the data and model."""
    cache = Path(os.path.expanduser(str(task_cfg.cache_dir)))
    return entry_paths(calculator_entry(cache, seed=int(task_cfg.seed), warmup_steps=int(task_cfg.warmup_steps)))


def prepare_task(task_cfg: Any) -> Any:
    """The task registry's entry (tasks/__init__.py): data, warmed-up model; rewards come from the environment."""

    cache = Path(os.path.expanduser(str(task_cfg.cache_dir)))
    assets = prepare_calculator_assets(cache, seed=int(task_cfg.seed), warmup_steps=int(task_cfg.warmup_steps))
    return TaskAssets(
        train_files=str(assets.train_parquet),
        val_files=str(assets.val_parquet),
        model_path=str(assets.model_dir),
        reward_module=None,
        summary=f"model {assets.model_dir}, warm-up {assets.warmup_seconds:.0f}s",
    )
