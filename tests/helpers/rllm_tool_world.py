"""A tiny world for rLLM-style tool agents: a tokenizer whose chat template renders tools and tool messages the way
Qwen's does, a tiny Qwen2 warmed up to call a `multiply` tool in Qwen's `<tool_call>{json}</tool_call>` format, and
verl-format data. Built like the built-in tasks build theirs (tasks/calculator.py): from a config, offline.

The conversation (PIECES are single tokens; every other character is one token):

    <|im_start|>system\\n<tools>multiply</tools><|im_end|>             (the template renders `tools=`)
    <|im_start|>system\\ngo<|im_end|><|im_start|>user\\n7*8<|im_end|><|im_start|>assistant\\n
    <tool_call>{"name": "multiply", "arguments": {"a": 7, "b": 8}}</tool_call><|im_end|>        (trained)
    <|im_start|>user\\n<tool_response>56</tool_response><|im_end|><|im_start|>assistant\\n   (a tool message)
    \\boxed{56}<|im_end|>                                                                     (trained)

The demonstrator calls the tool with probability DEMO_TOOL_P and otherwise guesses a boxed number, so the
warmed-up policy calls the tool on some episodes (and is right when it copies the result) and guesses on others.
An assistant message with `tool_calls` is rendered back as the call it came from (arguments as written, or
`tojson` of a dict), so the next turn's prompt extends the previous one token for token.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

PAD, EOS, START = "<|endoftext|>", "<|im_end|>", "<|im_start|>"
# Added tokens, as Qwen's tokenizer has them: the chat markers special (dropped by skip_special_tokens), the tool
# markup not (kept in decoded text, where the tool parser reads it); JSON punctuation and a few words merged, as
# a BPE would merge them. Every other character is one byte-level token.
PIECES = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<tools>",
    "</tools>",
    "\\boxed{",
    ' {"',
    ', "',
    '{"',
    '":',
    ' "',
    '",',
    "}}",
    "multiply",
    "arguments",
    "assistant",
    "system",
    "name",
    "user",
]
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t.function.name }}{% endfor %}</tools>"
    "<|im_end|>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}{%- set f = c.function if c.function is defined else c %}"
    '<tool_call>{"name": "{{ f.name }}", "arguments": '
    "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}{% endif %}}</tool_call>"
    "{%- endfor %}<|im_end|>"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SYSTEM = "go"
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "multiply two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
DEMO_TOOL_P = 0.6
MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,  # an episode is ~100 tokens
    "tie_word_embeddings": True,
    "rope_theta": 10_000.0,
}


def build_tokenizer() -> Any:
    """The world's tokenizer: a Qwen2 tokenizer (byte-level, no merges) with PIECES added and the template above.

    Built as the class transformers 5 loads for a qwen2 model folder anyway (AutoTokenizer picks the tokenizer
    class by model type), so the tokenizer the run loads from the model folder tokenizes exactly like this one.
    """
    from tokenizers import AddedToken, pre_tokenizers
    from transformers import Qwen2Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {PAD: 0} | {c: i + 1 for i, c in enumerate(alphabet)}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, eos_token=PAD, pad_token=PAD)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in (START, EOS)], special_tokens=True)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in PIECES])
    tokenizer.eos_token = EOS
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def messages_for(a: int, b: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{a}*{b}"}]


def tool_call_text(a: int, b: int) -> str:
    return f'<tool_call>{{"name": "multiply", "arguments": {arguments(a, b)}}}</tool_call>'


def arguments(a: int, b: int) -> str:
    return f'{{"a": {a}, "b": {b}}}'  # as json.dumps writes them (what the parsed call renders back as)


def demonstration(tokenizer: Any, a: int, b: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """One demonstrated episode as (ids, labels): the model's turns trained, everything else -100."""

    def render(messages: list[dict[str, Any]]) -> str:
        return tokenizer.apply_chat_template(messages, tools=[TOOL_SCHEMA], add_generation_prompt=True, tokenize=False)

    messages = messages_for(a, b)
    segments = [(render(messages), False)]
    if rng.random() < DEMO_TOOL_P:
        call = {"function": {"name": "multiply", "arguments": arguments(a, b)}}
        after = [*messages, {"role": "assistant", "content": "", "tool_calls": [call]}]
        after.append({"role": "tool", "name": "multiply", "content": str(a * b)})
        first = tool_call_text(a, b) + EOS
        rendered = render(after)
        assert rendered.startswith(segments[0][0] + first), "the template must render the call back as written"
        observation = rendered[len(segments[0][0]) + len(first) :]
        segments += [(first, True), (observation, False), (f"\\boxed{{{a * b}}}{EOS}", True)]
    else:
        segments.append((f"\\boxed{{{rng.randint(1, 81)}}}{EOS}", True))
    ids, labels = [], []
    for text, trained in segments:
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        labels += piece if trained else [-100] * len(piece)
    return ids, labels


def make_pairs(seed: int, num_val: int = 16) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Disjoint train / held-out pairs of one-digit factors (copying one digit is what a tiny model learns fast)."""
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    random.Random(seed).shuffle(pairs)
    return pairs[num_val:], pairs[:num_val]


def write_parquets(folder: Path, seed: int = 0) -> tuple[Path, Path]:
    """verl-format rows; `question` and the pair ride in extra_info (rLLM agents read `question` as a keyword)."""
    import pandas as pd

    paths = []
    for split, pairs in zip(("train", "val"), make_pairs(seed), strict=True):
        rows = [
            {
                "prompt": messages_for(a, b),
                "data_source": "rllm_tool_world",
                "reward_model": {"style": "rule", "ground_truth": str(a * b)},
                "extra_info": {"question": f"{a}*{b}", "a": a, "b": b, "index": i, "split": split},
            }
            for i, (a, b) in enumerate(pairs)
        ]
        path = folder / f"{split}.parquet"
        pd.DataFrame(rows).to_parquet(path, index=False)
        paths.append(path)
    return paths[0], paths[1]


def prepare(folder: Path, seed: int = 0, warmup_steps: int = 300, lr: float = 3e-3) -> tuple[Path, Path, Path]:
    """Write the data and a warmed-up model with its tokenizer under `folder`: (model dir, train, val)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rllm.experimental.fully_async.tasks.imitation import imitation_warmup, pad_rows

    folder.mkdir(parents=True, exist_ok=True)
    train, val = write_parquets(folder, seed)
    tokenizer = build_tokenizer()
    pad_id, eos_id = tokenizer.convert_tokens_to_ids([PAD, EOS])
    config = Qwen2Config(vocab_size=len(tokenizer), eos_token_id=eos_id, pad_token_id=pad_id, **MODEL_CONFIG)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    rng = random.Random(seed)
    pairs, _ = make_pairs(seed)
    batch = 64
    rows = [demonstration(tokenizer, *pairs[rng.randrange(len(pairs))], rng) for _ in range(batch * warmup_steps)]
    ids, labels = pad_rows(rows, pad_id)
    imitation_warmup(model, ids, labels, pad_id=pad_id, batch_size=batch, lr=lr, steps=warmup_steps)
    model.save_pretrained(folder / "model", safe_serialization=True)
    tokenizer.save_pretrained(folder / "model")
    return folder / "model", train, val
