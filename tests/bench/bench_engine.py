"""Benchmark: embedded engine (continuous batching) against `transformers.generate` with static batches.

    .venv/bin/python tests/bench/bench_engine.py [--model-path DIR] [--num-requests 128] [--threads 1]

Both sides serve the same model, the same prompts and the same long-tailed distribution of `max_new_tokens`
(log-normal: most requests are short, a few are long, as RL rollouts are), greedy, eos ignored so every request
yields exactly its budget. `generate` runs arrival-ordered static batches and keeps decoding a batch until its
longest member is done; the engine admits and retires requests between decode steps. Throughput counts useful
tokens only (the tokens each request asked for). The two runs alternate `--repeats` times in one process so they
see the same machine load; the best of each is reported. This is a measurement script, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rllm.experimental.fully_async.engines import EmbeddedEngineCommand, EngineLauncher
from rllm.experimental.fully_async.engines.client import EngineClient

logger = logging.getLogger("bench_engine")


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_new_tokens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.max_new_tokens)


def build_model(path: Path, seed: int) -> Path:
    """A random Qwen2 big enough for matmuls to matter (hidden 256, 4 layers, vocab 2048, ~5M parameters)."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def make_workload(n: int, vocab: int, seed: int, max_len: int) -> Workload:
    """Prompts of 8-48 tokens; max_new_tokens log-normal (median ~24), clipped to [4, max_len]."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(8, 48))] for _ in range(n)]
    budgets = [int(min(max_len, max(4, rng.lognormvariate(3.2, 0.9)))) for _ in range(n)]
    return Workload(prompts, budgets)


async def run_engine(url: str, work: Workload) -> tuple[float, int]:
    """All requests at once through the client; returns (seconds, forward passes used)."""
    async with EngineClient([url]) as client:
        before = (await client.get_server_info(url))["engine_stats"]["forward_passes"]
        start = time.perf_counter()
        results = await asyncio.gather(
            *(
                client.generate(p, {"temperature": 0, "max_new_tokens": n, "ignore_eos": True})
                for p, n in zip(work.prompts, work.max_new_tokens, strict=True)
            )
        )
        elapsed = time.perf_counter() - start
        after = (await client.get_server_info(url))["engine_stats"]["forward_passes"]
    got = sum(len(r.output_ids) for r in results)
    if got != work.useful_tokens:
        raise RuntimeError(f"engine produced {got} tokens, expected {work.useful_tokens}")
    return elapsed, after - before


def run_static_batches(model, work: Workload, batch_size: int) -> tuple[float, int]:
    """Arrival-ordered static batches through generate; returns (seconds, tokens computed incl. waste)."""
    computed = 0
    start = time.perf_counter()
    for i in range(0, len(work.prompts), batch_size):
        prompts = work.prompts[i : i + batch_size]
        budget = max(work.max_new_tokens[i : i + batch_size])
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=budget, min_new_tokens=budget, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
        computed += (out.shape[1] - width) * len(prompts)
    return time.perf_counter() - start, computed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", help="HF causal-LM folder; default: a random ~5M-parameter Qwen2")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32, help="static batch size for transformers.generate")
    parser.add_argument("--max-running-requests", type=int, default=128)
    parser.add_argument("--max-new-tokens-cap", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for each side (same for both)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        model_path = Path(args.model_path) if args.model_path else build_model(Path(tmp) / "model", args.seed)
        model = AutoModelForCausalLM.from_pretrained(model_path).eval()
        work = make_workload(args.num_requests, model.config.vocab_size, args.seed, args.max_new_tokens_cap)
        cmd = EmbeddedEngineCommand(
            str(model_path), max_running_requests=args.max_running_requests, num_threads=args.threads
        )
        engine_s, hf_s, passes, computed = [], [], 0, 0
        with EngineLauncher(cmd, 1, log_dir=Path(tmp) / "logs") as launcher:
            url = launcher.urls[0]
            warm = Workload(work.prompts[:4], [4] * 4)
            asyncio.run(run_engine(url, warm))
            run_static_batches(model, warm, 4)
            for _ in range(args.repeats):
                seconds, passes = asyncio.run(run_engine(url, work))
                engine_s.append(seconds)
                seconds, computed = run_static_batches(model, work, args.batch_size)
                hf_s.append(seconds)

    tokens = work.useful_tokens
    budgets = sorted(work.max_new_tokens)
    best_engine, best_hf = min(engine_s), min(hf_s)
    print(f"model: {model_path if args.model_path else 'random Qwen2 (hidden 256, 4 layers, vocab 2048)'}")
    print(f"  {model.num_parameters() / 1e6:.1f}M parameters, torch threads per side: {args.threads}")
    print(
        f"workload: {len(budgets)} requests, {tokens} useful tokens; max_new_tokens median "
        f"{statistics.median(budgets):.0f}, p90 {budgets[int(0.9 * len(budgets))]}, max {budgets[-1]}"
    )
    print(f"embedded engine     : {tokens / best_engine:8.0f} tok/s  ({best_engine:.2f} s, {passes} forward passes)")
    print(
        f"generate, batch {args.batch_size:<4}: {tokens / best_hf:8.0f} tok/s  ({best_hf:.2f} s, "
        f"{computed} tokens computed, {100 * (1 - tokens / computed):.0f}% of them wasted on finished rows)"
    )
    print(f"ratio engine / generate: {best_hf / best_engine:.2f}x   (runs: engine {engine_s}, generate {hf_s})")


if __name__ == "__main__":
    sys.exit(main())
