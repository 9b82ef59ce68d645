"""Benchmark (issue 31): the per-step cost of `prox_log_probs=previous` against `recompute`.

    PYTHONPATH=. .venv/bin/python tests/bench/bench_previous_weights.py [--backend fsdp|torch] [--models tiny 30m]
        [--device cpu|cuda] [--batch 64] [--prompt-len 16] [--response-len 48] [--repeats 5] [--no-record]

Both corrections make one forward pass before each optimizer step. `recompute` runs it under the current weights;
`previous` runs it under the previous version's weights, which the backend keeps on the CPU
(backends/previous_weights.py): it copies the parameters to the CPU at every weight sync (K = 1: every step) and,
for the forward pass, copies the kept weights in and the current ones out and back. Per step (K = 1):

    recompute = forward + update
    previous  = forward under the previous weights (+ its copies) + update + the copy at the sync

Measured side by side in one process, medians of `--repeats` (after one warm-up round each):
- `--backend fsdp` (default): the trainer's own FSDPPolicyBackend (verl's patched actor) on a random Qwen2 model
  built from a config (`--models`: tiny = the default task's 124k parameters, 30m, 135m = SmolLM2-135M's shape),
  a batch of `--batch` rows of `--prompt-len` + `--response-len` tokens; needs the project's virtualenv;
- `--backend torch`: the same `PreviousWeights` on a plain torch transformer (no verl, no transformers), for a machine
  that has only torch (the lent GPU): forward = the model on the batch without gradients, update = forward,
  backward and an AdamW step.
Each (device, model) writes `tests/bench/results/previous-cost/<device>-<model>.json` (`_results.py`; `--no-record`:
print only); `tests/bench/results_tables.py` renders them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's rllm, whatever the cwd

from rllm.experimental.fully_async.backends.previous_weights import PreviousWeights

# Qwen2 shapes: (hidden, layers, heads, kv heads, intermediate, vocab)
SHAPES = {
    "tiny": (64, 2, 4, 2, 256, 15),  # the embedded default's model (tasks/addition.py)
    "30m": (512, 6, 8, 4, 1536, 8000),
    "135m": (576, 30, 9, 3, 1536, 49152),  # SmolLM2-135M's
    "1.5b": (1536, 28, 12, 2, 8960, 151936),  # Qwen2-1.5B's (torch backend: full attention, untied head)
}
RESULTS = Path(__file__).resolve().parent / "results" / "previous-cost"


def median_ms(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    fn()  # warm-up: allocator, first-touch pages, kernels
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        sync()
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def fsdp_case(shape: str, args: argparse.Namespace, folder: Path) -> dict[str, float | int]:
    """The trainer's backend: compute_log_prob under the current and the previous weights, weights_synced, one
    update."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from verl import DataProto

    from rllm.experimental.fully_async.backends.fsdp import FSDPPolicyBackend

    hidden, layers, heads, kv, inter, vocab = SHAPES[shape]
    config = Qwen2Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder / shape)
    cfg = {
        "ppo_micro_batch_size_per_gpu": args.batch,
        "ppo_mini_batch_size": args.batch,
        "use_remove_padding": False,
        "use_torch_compile": False,
        "fsdp_config": {"use_torch_compile": False},
        "optim": {"lr": 1e-5},
    }
    backend = FSDPPolicyBackend(folder / shape, cfg, keep_previous_weights=True)
    gen = torch.Generator().manual_seed(1)
    b, p, r = args.batch, args.prompt_len, args.response_len
    input_ids = torch.randint(2, vocab, (b, p + r), generator=gen)
    attention_mask = torch.ones(b, p + r, dtype=torch.long)
    data = DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": torch.arange(p + r).expand(b, -1).clone(),
            "responses": input_ids[:, p:].clone(),
            "response_mask": torch.ones(b, r),
            "advantages": torch.randn(b, 1, generator=gen).expand(-1, r).contiguous(),
        },
        meta_info={"temperature": 1.0},
    )
    data.batch["old_log_probs"] = backend.compute_log_prob(data)
    backend.weights_synced()  # a previous version exists: the forward under it swaps weights in and out
    params = sum(t.numel() for t in backend.model.parameters())

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    return {
        "parameters": params,
        "recompute_forward_ms": median_ms(lambda: backend.compute_log_prob(data), args.repeats, sync),
        "previous_forward_ms": median_ms(
            lambda: backend.compute_log_prob(data, weights="previous"), args.repeats, sync
        ),
        "publish_ms": median_ms(backend.weights_synced, args.repeats, sync),
        "update_ms": median_ms(lambda: backend.update_policy(data), args.repeats, sync),
        "held_mb": 2 * params * next(backend.model.parameters()).element_size() / 2**20,
    }


def torch_case(shape: str, args: argparse.Namespace) -> dict[str, float | int]:
    """PreviousWeights on a plain torch transformer of the shape's width and depth (no verl, no transformers)."""
    hidden, layers, heads, _, inter, vocab = SHAPES[shape]
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(vocab, hidden),
        nn.TransformerEncoder(
            nn.TransformerEncoderLayer(hidden, heads, inter, batch_first=True, norm_first=True),
            layers,
            enable_nested_tensor=False,
        ),
        nn.Linear(hidden, vocab, bias=False),
    ).to(device)
    kept = PreviousWeights(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    tokens = torch.randint(0, vocab, (args.batch, args.prompt_len + args.response_len), device=device)
    params = sum(t.numel() for t in model.parameters())

    def forward() -> None:
        with torch.no_grad():
            torch.log_softmax(model(tokens).float(), dim=-1)

    def forward_previous() -> None:
        with kept.in_place():
            forward()

    def update() -> None:
        optimizer.zero_grad()
        loss = torch.log_softmax(model(tokens).float(), dim=-1).mean()
        loss.backward()
        optimizer.step()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def device_copy() -> None:  # what a copy kept on the device instead would cost per sync
        with torch.no_grad():
            [p.detach().clone() for p in model.parameters()]

    kept.publish()
    return {
        "parameters": params,
        "recompute_forward_ms": median_ms(forward, args.repeats, sync),
        "previous_forward_ms": median_ms(forward_previous, args.repeats, sync),
        "publish_ms": median_ms(kept.publish, args.repeats, sync),
        "update_ms": median_ms(update, args.repeats, sync),
        "held_mb": 2 * params * 4 / 2**20,
        "device_copy_ms": median_ms(device_copy, args.repeats, sync),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["fsdp", "torch"], default="fsdp")
    parser.add_argument("--models", nargs="+", choices=list(SHAPES), default=["tiny", "30m"])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--response-len", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the result files go")
    parser.add_argument("--no-record", action="store_true", help="print only; write no result file")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git HEAD; a copy has no .git)")
    args = parser.parse_args(argv)
    if args.backend == "fsdp" and args.device == "cuda":
        os.environ.setdefault("LOCAL_RANK", "0")
    for shape in args.models:
        load_start = os.getloadavg()[0]
        with tempfile.TemporaryDirectory(prefix="bench_previous_") as tmp:
            figures = fsdp_case(shape, args, Path(tmp)) if args.backend == "fsdp" else torch_case(shape, args)
        recompute = figures["recompute_forward_ms"] + figures["update_ms"]
        previous = figures["previous_forward_ms"] + figures["update_ms"] + figures["publish_ms"]
        summary = {**figures, "previous_over_recompute_step": previous / recompute}
        device = args.device if args.device == "cpu" else torch.cuda.get_device_name(0)
        print(
            f"{device} {shape} ({figures['parameters'] / 1e6:.2f}M, {args.backend}): forward recompute "
            f"{figures['recompute_forward_ms']:.1f} ms, previous {figures['previous_forward_ms']:.1f} ms; copy at sync "
            f"{figures['publish_ms']:.1f} ms; update {figures['update_ms']:.1f} ms; per step previous / recompute "
            f"{summary['previous_over_recompute_step']:.2f}x"
            + (f"; a copy on the device {figures['device_copy_ms']:.1f} ms" if "device_copy_ms" in figures else ""),
            flush=True,
        )
        if args.no_record:
            continue
        import _results  # here: it needs the bench helpers, which a torch-only machine may lack

        record = {
            "experiment": "previous-cost",
            "arm": f"{args.device}-{shape}",
            "seed": 0,
            "order": 0,
            "command": ["tests/bench/bench_previous_weights.py", *(argv if argv is not None else sys.argv[1:])],
            "commit": args.commit or _results.git_commit(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "load_average": [load_start, os.getloadavg()[0]],
            "host": {"cpus": os.cpu_count()},
            "params": {
                "device": device,
                "model": f"{shape} ({args.backend})",
                "parameters": figures["parameters"],
                "batch": [args.batch, args.prompt_len + args.response_len],
                "repeats": args.repeats,
            },
            "ok": True,
            "summary": summary,
        }
        _results.write_record(args.results / f"{args.device}-{shape}-{args.backend}.json", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
