"""Number line: a multi-step agent task a tiny Qwen2 learns on CPU in minutes (the environment is envs/number_line).

An episode starts at a position on 0..9 with a target; each model turn is one action "+k"/"-k" (k = 1..3) ended by
EOS, and the environment answers with the new state. Success is reaching the target within `MAX_TURNS` turns.
The conversation, token by token (character-level, 19-token vocabulary):

    N 3>7:  +3<eos> 6>7:  +1<eos>            (prompt "N", first observation, turn, observation, turn)

Why it suits GiGPO: all trajectories of a prompt group start in the same state, and with 100 states they meet the
same states again, so step-level groups are large. RL has room: the supervised warm-up imitates a noisy
demonstrator (right direction with probability `DEMO_DIRECTION_P`, step size uniform in 1..3, so it overshoots),
which reaches the target within 4 turns about 56% of the time; the best policy (min(3, distance) towards the
target) always does. Held-out success is measured by sampling at temperature 1 (the policy RL trains), not
greedily: greedy decoding of the imitated mixture would hide the randomness RL removes.

Data: all 90 (start, target) pairs with start != target, split into train and held-out pairs by a fixed seed,
written as verl-format parquet (prompt "N", `extra_info` {start, target}, ground truth the target).
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from rllm.experimental.fully_async.envs.number_line import NumberLineEnv
from rllm.experimental.fully_async.tasks import TaskAssets, entry_paths
from rllm.experimental.fully_async.tasks.addition import single_torch_thread
from rllm.experimental.fully_async.tasks.cache import cache_key, cached_entry, entry_path
from rllm.experimental.fully_async.tasks.imitation import imitation_warmup, pad_rows

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

DATA_SOURCE = "fully_async/number_line"
PAD_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<eos>", "<unk>"
VOCAB: dict[str, int] = {PAD_TOKEN: 0, EOS_TOKEN: 1, UNK_TOKEN: 2} | {c: 3 + i for i, c in enumerate("0123456789+->:N")}
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
PROMPT = "N"  # a task marker: the first observation comes from the environment's reset
SIZE, MAX_STEP, MAX_TURNS = 10, 3, 4
ACTION_TOKENS = 3  # sign, digit, EOS
DEMO_DIRECTION_P = 0.8
NUM_VAL_PAIRS = 20
ASSETS_VERSION = 1
WARMUP_STEPS = 300
WARMUP_BATCH_SIZE = 128
WARMUP_LR = 2e-3
MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    # An episode is 1 + 4 + 4 * (3 + 4) = 33 tokens; the engine's context length is this, so leave room for
    # sampled turns that run on without EOS (env.max_total_tokens must stay below it).
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "rope_theta": 10_000.0,
}


@dataclass(frozen=True)
class NumberLineAssets:
    model_dir: Path
    train_parquet: Path
    val_parquet: Path
    warmup_val_success: float
    warmup_seconds: float
    cache_key: str


def build_tokenizer(vocab: dict[str, int] = VOCAB, chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """Character-level tokenizer over `vocab` (default VOCAB) with a verbatim chat template (as the addition task's)."""

    backend = Tokenizer(models.WordLevel(vocab=dict(vocab), unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, unk_token=UNK_TOKEN
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def build_model(
    seed: int = 0, vocab: dict[str, int] = VOCAB, model_config: dict[str, Any] = MODEL_CONFIG
) -> PreTrainedModel:
    """A randomly initialised tiny Qwen2 over `vocab` (the tool task reuses it with its own vocabulary)."""

    config = Qwen2Config(
        vocab_size=len(vocab),
        eos_token_id=vocab[EOS_TOKEN],
        pad_token_id=vocab[PAD_TOKEN],
        bos_token_id=None,
        **model_config,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def make_pairs(seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Disjoint train / held-out (start, target) pairs."""
    pairs = [(s, t) for s in range(SIZE) for t in range(SIZE) if s != t]
    random.Random(seed).shuffle(pairs)
    return pairs[NUM_VAL_PAIRS:], pairs[:NUM_VAL_PAIRS]


def write_parquets(out_dir: Path, seed: int = 0, train_repeats: int = 20) -> tuple[Path, Path]:
    """train.parquet (each train pair `train_repeats` times, so an epoch is long enough) and val.parquet."""

    train, val = make_pairs(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, pairs in (("train", train * train_repeats), ("val", val)):
        rows = [
            {
                "prompt": [{"role": "user", "content": PROMPT}],
                "data_source": DATA_SOURCE,
                "ability": "agent",
                "reward_model": {"style": "env", "ground_truth": str(t)},
                "extra_info": {"start": s, "target": t, "index": i, "split": name},
            }
            for i, (s, t) in enumerate(pairs)
        ]
        path = out_dir / f"{name}.parquet"
        pd.DataFrame(rows).to_parquet(path, index=False)
        paths.append(path)
    return paths[0], paths[1]


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """verl-signature reward for a transcript: 1.0 if the last observation shows the target reached, else 0.0.

    The multi-turn workflow rewards from the environment directly; this is for validation code that scores text.
    """
    states = [chunk for chunk in solution_str.split(":") if ">" in chunk]
    if not states:
        return 0.0
    position, _, target = states[-1][-3:].partition(">")
    return 1.0 if position == target == str(ground_truth) else 0.0


def demo_episode(start: int, target: int, rng: random.Random) -> str:
    """One episode of the noisy demonstrator as text (first observation onward)."""
    env = NumberLineEnv(SIZE, MAX_STEP)
    text = env.reset(0, {"start": start, "target": target})
    for _ in range(MAX_TURNS):
        sign = 1 if target > env.position else -1
        if rng.random() > DEMO_DIRECTION_P:
            sign = -sign
        action = f"{'+' if sign > 0 else '-'}{rng.randint(1, MAX_STEP)}"
        observation, _, done, _ = env.step(action)
        text += action + EOS_TOKEN
        if done:
            break
        text += observation
    return text


def _encode_demos(tokenizer: PreTrainedTokenizerBase, pairs: list[tuple[int, int]], count: int, seed: int):
    """[count, L] ids and labels (loss on action tokens only, -100 on prompt, observations and padding)."""

    rng = random.Random(seed)
    ids_list, labels_list = [], []
    for _ in range(count):
        start, target = pairs[rng.randrange(len(pairs))]
        text = PROMPT + demo_episode(start, target, rng)
        ids = tokenizer.encode(text, add_special_tokens=False)
        # A token is an action token when it is a sign, the digit right after a sign, or EOS.
        labels = [-100] * len(ids)
        for i, tok in enumerate(ids):
            is_sign = tok in (VOCAB["+"], VOCAB["-"])
            after_sign = i > 0 and ids[i - 1] in (VOCAB["+"], VOCAB["-"])
            if is_sign or after_sign or tok == VOCAB[EOS_TOKEN]:
                labels[i] = tok
        ids_list.append(ids)
        labels_list.append(labels)
    return pad_rows(list(zip(ids_list, labels_list, strict=True)), VOCAB[PAD_TOKEN])


def supervised_warmup(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, seed: int, steps: int) -> float:
    """Imitate the demonstrator on train pairs for a fixed number of AdamW steps; returns the seconds taken."""

    train, _ = make_pairs(seed)
    ids, labels = _encode_demos(tokenizer, train, WARMUP_BATCH_SIZE * steps, seed)
    return imitation_warmup(
        model, ids, labels, pad_id=VOCAB[PAD_TOKEN], batch_size=WARMUP_BATCH_SIZE, lr=WARMUP_LR, steps=steps
    )


def sampled_success(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pairs: list[tuple[int, int]], samples: int, seed: int
) -> float:
    """Fraction of episodes (each pair `samples` times, temperature 1) that reach the target within MAX_TURNS."""

    torch.manual_seed(seed)
    episodes = [(s, t) for s, t in pairs for _ in range(samples)]
    envs = [NumberLineEnv(SIZE, MAX_STEP) for _ in episodes]
    contexts = [
        tokenizer.encode(PROMPT + env.reset(0, {"start": s, "target": t}), add_special_tokens=False)
        for env, (s, t) in zip(envs, episodes, strict=True)
    ]
    done = [False] * len(episodes)
    with torch.inference_mode(), single_torch_thread():
        for _ in range(MAX_TURNS):
            active = [i for i, d in enumerate(done) if not d]
            if not active:
                break
            width = max(len(contexts[i]) for i in active)
            ids = torch.full((len(active), width), VOCAB[PAD_TOKEN], dtype=torch.long)
            mask = torch.zeros((len(active), width), dtype=torch.long)
            for row, i in enumerate(active):  # left padding, as generation expects
                ids[row, width - len(contexts[i]) :] = torch.tensor(contexts[i])
                mask[row, width - len(contexts[i]) :] = 1
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=ACTION_TOKENS,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=VOCAB[PAD_TOKEN],
                eos_token_id=VOCAB[EOS_TOKEN],
            )[:, width:].tolist()
            for row, i in enumerate(active):
                action = out[row]
                if VOCAB[EOS_TOKEN] in action:
                    action = action[: action.index(VOCAB[EOS_TOKEN]) + 1]
                observation, _, finished, _ = envs[i].step(tokenizer.decode(action, skip_special_tokens=True))
                contexts[i] += action + tokenizer.encode(observation, add_special_tokens=False)
                done[i] = finished
    return sum(done) / len(done)


def evaluate_success(model_dir: str | Path, seed: int = 0, samples: int = 16) -> float:
    """Held-out sampled success of an HF model folder (tokenizer inside) on the held-out pairs of `seed`."""

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    return sampled_success(model, tokenizer, make_pairs(seed)[1], samples, seed)


def locate_task(task_cfg: Any) -> dict[str, str]:
    """The task registry's locator (tasks.task_asset_paths): where `prepare_task` puts the data and model."""
    cache = Path(os.path.expanduser(str(task_cfg.cache_dir)))
    return entry_paths(number_line_entry(cache, seed=int(task_cfg.seed), warmup_steps=int(task_cfg.warmup_steps)))


def prepare_task(task_cfg: Any) -> Any:
    """The task registry's entry (tasks/__init__.py): data, warmed-up model; rewards come from the environment."""

    cache = Path(os.path.expanduser(str(task_cfg.cache_dir)))
    assets = prepare_number_line_assets(cache, seed=int(task_cfg.seed), warmup_steps=int(task_cfg.warmup_steps))
    return TaskAssets(
        train_files=str(assets.train_parquet),
        val_files=str(assets.val_parquet),
        model_path=str(assets.model_dir),
        reward_module=None,
        summary=f"model {assets.model_dir}, warm-up held-out success {assets.warmup_val_success:.1%}",
    )


def _number_line_key(seed: int, warmup_steps: int) -> str:
    """The cache key of everything that changes what `prepare_number_line_assets` builds."""

    spec = {"v": ASSETS_VERSION, "seed": seed, "steps": warmup_steps, "model": MODEL_CONFIG, "vocab": VOCAB}
    spec |= {"batch": WARMUP_BATCH_SIZE, "lr": WARMUP_LR, "demo_p": DEMO_DIRECTION_P, "turns": MAX_TURNS}
    return cache_key(spec)


def number_line_entry(cache_dir: str | Path, seed: int = 0, warmup_steps: int = WARMUP_STEPS) -> Path:
    """The cache folder `prepare_number_line_assets` builds (or reuses) for these settings; nothing is built."""
    return entry_path(cache_dir, "number_line", _number_line_key(seed, warmup_steps))


def prepare_number_line_assets(cache_dir: str | Path, seed: int = 0, warmup_steps: int = WARMUP_STEPS):
    """Build (once, cached by a key of everything that changes it) the data and the warmed-up model."""
    key = _number_line_key(seed, warmup_steps)

    def build(folder: Path) -> dict[str, Any]:
        write_parquets(folder, seed)
        tokenizer, model = build_tokenizer(), build_model(seed)
        seconds = supervised_warmup(model, tokenizer, seed, warmup_steps)
        success = sampled_success(model, tokenizer, make_pairs(seed)[1], 16, seed)
        model.save_pretrained(folder / "model", safe_serialization=True)
        tokenizer.save_pretrained(folder / "model")
        return {"cache_key": key, "warmup_val_success": success, "warmup_seconds": seconds, "torch": torch.__version__}

    entry, meta = cached_entry(cache_dir, "number_line", key, build)
    assets = NumberLineAssets(
        model_dir=entry / "model",
        train_parquet=entry / "train.parquet",
        val_parquet=entry / "val.parquet",
        warmup_val_success=float(meta["warmup_val_success"]),
        warmup_seconds=float(meta["warmup_seconds"]),
        cache_key=key,
    )
    logger.info("number-line assets in %s: held-out sampled success %.1f%%", entry, 100 * assets.warmup_val_success)
    return assets
