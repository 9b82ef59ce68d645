"""Benchmark: LoRA on the embedded engine (issue 33), every arm side by side in one invocation.

    .venv/bin/python tests/bench/bench_lora.py [--model default|smollm2] [--rank 8] [--adapters 4]
        [--requests 64] [--tokens 32] [--repeats 3] [--threads 1] [--skip-bytes]

1. Bytes a weight sync moves: one adapter (rank r on every linear layer, peft's adapter_model.safetensors) against
   the whole model (model.safetensors), for the default model (the addition task's 124k-parameter Qwen2) and
   SmolLM2-135M (when its wheel is installed), in float32 and (counted) bfloat16.
2. One mixed forward pass in this process, R rows spread over k adapters, prefill (16 tokens) and decode (1 token)
   shapes: the engine's hooks (one pass; each adapter's rows get their two matmuls), peft's own mixed batch
   (`PeftModel(..., adapter_names=[...])`), one pass per adapter's sub-batch, and the base model alone (the floor).
   This is the choice the engine made (hooks) against the two alternatives the issue named.
3. The engine over HTTP (one embedded engine, `--enable-lora`): R requests x T tokens (eos ignored) on the base
   model, all on one adapter, and spread over k adapters; then the latency of /load_lora_adapter on an idle engine
   and while the R requests generate, and the generation throughput while a new adapter version loads every
   50 ms against none (the sync has no pause, so it should cost generation little).
Best of `--repeats` per arm; the arms alternate so they share the machine's load. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from rllm.experimental.fully_async.engines import EmbeddedEngineCommand, EngineLauncher
from rllm.experimental.fully_async.engines.client import EngineClient
from rllm.experimental.fully_async.engines.embedded.lora import LoRALayers, build_adapter, read_adapter_folder
from rllm.experimental.fully_async.engines.lora import adapter_name
from rllm.experimental.fully_async.run_spec import EngineLoRASpec
from rllm.experimental.fully_async.tasks.addition import build_addition_model
from rllm.experimental.fully_async.tasks.smollm2 import SmolLM2NotInstalledError, prepare_smollm2_model

logger = logging.getLogger("bench_lora")


# ---------------------------------------------------------------- models and adapters
def default_model(folder: Path) -> Path:
    build_addition_model(seed=0).save_pretrained(folder)
    return folder


def write_adapter(base: Path, folder: Path, seed: int, rank: int) -> Path:
    """A peft adapter on every linear layer (verl's all-linear), lora_B random so it changes the model."""
    torch.manual_seed(seed)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    model.save_pretrained(folder)
    return folder


def safetensors_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def bytes_arm(root: Path, rank: int) -> None:
    print(f"\n1. bytes per sync: one rank-{rank} all-linear adapter vs the whole model (safetensors on disk)")
    models: list[tuple[str, Path]] = [("default (addition, 124k)", default_model(root / "default"))]
    try:
        models.append(("SmolLM2-135M", prepare_smollm2_model(root / "smollm2_cache")))
    except SmolLM2NotInstalledError as exc:
        print(f"   SmolLM2-135M skipped: {exc}")
    for label, base in models:
        adapter = write_adapter(base, root / f"adapter_{label[:7]}", seed=0, rank=rank)
        model_bytes, adapter_bytes = safetensors_bytes(base), safetensors_bytes(adapter)
        params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(base).parameters())
        adapter_params = sum(t.numel() for t in read_adapter_folder(str(adapter))[1].values())
        print(
            f"   {label:26s} model {model_bytes / 2**20:8.2f} MiB ({params:,} params)   adapter "
            f"{adapter_bytes / 2**20:7.3f} MiB ({adapter_params:,} params)   ratio {model_bytes / adapter_bytes:6.1f}x"
            f"   bf16: model {2 * params / 2**20:.2f} MiB, adapter {2 * adapter_params / 2**20:.3f} MiB"
        )


# ---------------------------------------------------------------- 2. one mixed forward pass, three ways
def timed(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def forward_arm(base: Path, adapters: list[Path], rows: int, repeats: int) -> None:
    print(f"\n2. one forward pass, {rows} rows over {len(adapters)} adapters (ms, best of {repeats} x 5 passes)")
    engine_model = AutoModelForCausalLM.from_pretrained(base).eval()
    layers = LoRALayers()
    layers.attach(engine_model)
    loaded = []
    for i, folder in enumerate(adapters):
        config, tensors = read_adapter_folder(str(folder))
        loaded.append(
            build_adapter(
                lora_id=str(i), name=str(i), path=None, pinned=False, config=config, tensors=tensors, model=engine_model
            )
        )
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapters[0], adapter_name="0")
    for i, folder in enumerate(adapters[1:], start=1):
        peft_model.load_adapter(folder, adapter_name=str(i))
    peft_model.eval()
    plain = AutoModelForCausalLM.from_pretrained(base).eval()
    row_adapter = [i % len(adapters) for i in range(rows)]
    vocab = plain.config.vocab_size
    for label, width in (("prefill x16", 16), ("decode x1", 1)):
        ids = torch.randint(2, vocab, (rows, width), generator=torch.Generator().manual_seed(0))

        def hooks(ids: torch.Tensor = ids) -> None:
            with torch.inference_mode(), layers.rows([loaded[a] for a in row_adapter]):
                for _ in range(5):
                    engine_model(input_ids=ids)

        def peft_mixed(ids: torch.Tensor = ids) -> None:
            with torch.inference_mode():
                for _ in range(5):
                    peft_model(input_ids=ids, adapter_names=[str(a) for a in row_adapter])

        def sub_batches(ids: torch.Tensor = ids) -> None:
            with torch.inference_mode():
                for _ in range(5):
                    for a, adapter in enumerate(loaded):
                        picked = [r for r in range(rows) if row_adapter[r] == a]
                        with layers.rows([adapter] * len(picked)):
                            engine_model(input_ids=ids[picked])

        def base_only(ids: torch.Tensor = ids) -> None:
            with torch.inference_mode():
                for _ in range(5):
                    plain(input_ids=ids)

        arms = {"engine hooks": hooks, "peft adapter_names": peft_mixed, "sub-batches": sub_batches}
        arms["base model"] = base_only
        times = {name: float("inf") for name in arms}
        for _ in range(repeats):  # alternate the arms: they share the machine's load
            for name, fn in arms.items():
                times[name] = min(times[name], timed(fn, 1) / 5 * 1000)
        cells = "   ".join(f"{name} {ms:7.2f}" for name, ms in times.items())
        print(f"   {label:12s} {cells}   (hooks / base {times['engine hooks'] / times['base model']:.2f}x)")


# ---------------------------------------------------------------- 3. the engine over HTTP
async def throughput(client: EngineClient, lora_paths: list[str | None], tokens: int) -> float:
    """Generated tokens per second for one request per entry of `lora_paths` (eos ignored)."""
    params = {"temperature": 1.0, "max_new_tokens": tokens, "ignore_eos": True}
    start = time.perf_counter()
    results = await asyncio.gather(
        *(client.generate([2 + i % 9], params, lora_path=p) for i, p in enumerate(lora_paths))
    )
    elapsed = time.perf_counter() - start
    return sum(len(r.output_ids) for r in results) / elapsed


async def engine_arm(base: Path, adapters: list[Path], args: argparse.Namespace, root: Path) -> None:
    k = len(adapters)
    spec = EngineLoRASpec(args.rank, ("all",), k + 2, k + 2, "lru", "csgmv")
    cmd = EmbeddedEngineCommand(str(base), max_running_requests=args.requests, num_threads=args.threads, lora=spec)
    with EngineLauncher(cmd, 1, log_dir=root / "logs") as launcher:
        url = launcher.urls[0]
        async with EngineClient([url], request_timeout_s=600) as client:
            for i, folder in enumerate(adapters):
                await client.load_lora_adapter(url, adapter_name(i), str(folder))
            n = args.requests
            arms = {
                "base model": [None] * n,
                "one adapter": [adapter_name(0)] * n,
                f"{k} adapters mixed": [adapter_name(i % k) for i in range(n)],
            }
            rates = {name: 0.0 for name in arms}
            for _ in range(args.repeats):
                for name, paths in arms.items():
                    rates[name] = max(rates[name], await throughput(client, paths, args.tokens))
            print(f"\n3. engine over HTTP: {n} requests x {args.tokens} tokens (tokens/s, best of {args.repeats})")
            print("   " + "   ".join(f"{name} {rate:9.0f}" for name, rate in rates.items()))
            await load_latency(client, url, adapters[0], arms[f"{k} adapters mixed"], args, version=k)


async def load_latency(
    client: EngineClient, url: str, folder: Path, mixed: list[str | None], args: argparse.Namespace, version: int
) -> None:
    """/load_lora_adapter on an idle engine, then while requests generate; throughput with a load every 50 ms."""

    async def load_and_unload() -> float:
        nonlocal version
        version += 1
        start = time.perf_counter()
        await client.load_lora_adapter(url, adapter_name(version), str(folder))
        took = time.perf_counter() - start
        await client.unload_lora_adapter(url, adapter_name(version))  # idle adapter: returns at once
        return took

    idle = [await load_and_unload() for _ in range(10)]
    busy: list[float] = []
    quiet_rate = loading_rate = 0.0
    for _ in range(args.repeats):
        quiet_rate = max(quiet_rate, await throughput(client, mixed, args.tokens))
        generation = asyncio.ensure_future(throughput(client, mixed, args.tokens))
        while not generation.done():
            busy.append(await load_and_unload())
            await asyncio.sleep(0.05)
        loading_rate = max(loading_rate, await generation)
    print(
        f"   /load_lora_adapter: idle median {statistics.median(idle) * 1000:.1f} ms; while generating median "
        f"{statistics.median(busy) * 1000:.1f} ms, max {max(busy) * 1000:.1f} ms ({len(busy)} loads)"
    )
    print(
        f"   generation with a load+unload every 50 ms: {loading_rate:.0f} tokens/s against {quiet_rate:.0f} "
        f"without ({loading_rate / quiet_rate:.2f}x)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["default", "smollm2"], default="default", help="model of arms 2 and 3")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=4, help="k: adapters mixed in a batch")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, here and in the engine")
    parser.add_argument("--skip-bytes", action="store_true", help="skip arm 1 (it converts SmolLM2 once, ~30 s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    try:
        if not args.skip_bytes:
            bytes_arm(root, args.rank)
        base = default_model(root / "base") if args.model == "default" else prepare_smollm2_model(root / "smollm2")
        adapters = [write_adapter(base, root / f"a{i}", seed=i, rank=args.rank) for i in range(args.adapters)]
        forward_arm(base, adapters, args.requests, args.repeats)
        asyncio.run(engine_arm(base, adapters, args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
