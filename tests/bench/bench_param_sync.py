"""Benchmark: ParamSync's paused window (disk transport) against the time to write and read the same bytes.

    .venv/bin/python tests/bench/bench_param_sync.py [--model-path DIR] [--engines 2] [--syncs 5] [--load]

Measured side by side in one run on the same model folder:
- write: `save_pretrained` of the in-memory model into a fresh folder (what the trainer's `save_hf` does);
- read:  `safetensors.torch.load_file` of that folder, every tensor touched (the bytes an engine must read);
- load:  `AutoModelForCausalLM.from_pretrained` of that folder, every parameter touched (an engine's update);
- sync:  `ParamSync.sync` to N embedded engines, reporting write_s (before the pause), pause_s (engines paused:
  first pause sent .. last continue acknowledged) and update_s (loading, inside the pause).
The ratio pause_s / (write + read) shows what the pause-after-write design saves over a naive stop-the-world
sync, and pause_s / load what HTTP and the swap add. `--load` keeps clients generating during the syncs, so the
pause includes aborting and re-admitting them. Files are fresh in the page cache for both sides. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rllm.experimental.fully_async.engines import EmbeddedEngineCommand, EngineLauncher
from rllm.experimental.fully_async.engines.client import EngineClient
from rllm.experimental.fully_async.runtime.param_sync import DiskTransport, ParamSync

logger = logging.getLogger("bench_param_sync")


def build_model(path: Path, seed: int) -> Path:
    """A random Qwen2 of ~30M parameters (~120 MB in float32), so file I/O is not negligible."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=16000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _touch(tensors) -> float:
    return float(sum(t.detach().float().sum() for t in tensors))


def baseline(model, root: Path, repeats: int) -> dict[str, float]:
    """Best-of-`repeats` write, read and from_pretrained times of the model's folder."""
    writes, reads, loads = [], [], []
    for i in range(repeats):
        folder = root / f"baseline-{i}"
        writes.append(timed(lambda f=folder: model.save_pretrained(f)))
        # Touch every tensor: safetensors maps files lazily, so an untouched load reads almost nothing.
        reads.append(timed(lambda f=folder: [_touch(load_file(p).values()) for p in sorted(f.glob("*.safetensors"))]))
        loads.append(timed(lambda f=folder: _touch(AutoModelForCausalLM.from_pretrained(f).parameters())))
        shutil.rmtree(folder)
    return {"write": min(writes), "read": min(reads), "load": min(loads)}


async def generate_until(urls: list[str], stop: threading.Event, counts: dict[str, int]) -> None:
    """Keep 16 generations in flight until `stop` is set; count resumes."""
    async with EngineClient(urls) as client:

        async def worker(i: int) -> None:
            while not stop.is_set():
                result = await client.generate([2 + i], {"max_new_tokens": 64, "ignore_eos": True})
                counts["requests"] += 1
                counts["resumes"] += result.num_resumes

        await asyncio.gather(*(worker(i) for i in range(16)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", help="HF causal-LM folder; default: a random ~30M-parameter Qwen2")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine and for this process")
    parser.add_argument("--load", action="store_true", help="keep clients generating during the syncs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp:
        root = Path(tmp)
        model_path = Path(args.model_path) if args.model_path else build_model(root / "model", args.seed)
        model = AutoModelForCausalLM.from_pretrained(model_path)
        base = baseline(model, root, repeats=3)
        cmd = EmbeddedEngineCommand(str(model_path), num_threads=args.threads)
        counts = {"requests": 0, "resumes": 0}
        with EngineLauncher(cmd, args.engines, log_dir=root / "logs") as launcher:
            stop = threading.Event()
            load_thread = None
            if args.load:
                load_thread = threading.Thread(
                    target=asyncio.run, args=(generate_until(launcher.urls, stop, counts),), daemon=True
                )
                load_thread.start()
            with ParamSync(launcher.urls, DiskTransport(root / "weights")) as sync:
                reports = [sync.sync(model.save_pretrained, new_version=v) for v in range(1, args.syncs + 1)]
            stop.set()
            if load_thread is not None:
                load_thread.join(timeout=120)

    def med(field: str) -> float:
        return statistics.median(getattr(r, field) for r in reports)

    io_s = base["write"] + base["read"]
    print(f"model: {model_path if args.model_path else 'random Qwen2 (~30M parameters)'}")
    print(f"  {reports[0].nbytes / 1e6:.0f} MB of weights, {args.engines} engine(s), {args.syncs} syncs")
    print(f"baseline : write {base['write']:.3f} s, read {base['read']:.3f} s, from_pretrained {base['load']:.3f} s")
    print(
        f"sync     : write {med('write_s'):.3f} s (engines generating), paused {med('pause_s'):.3f} s "
        f"(of which loading {med('update_s'):.3f} s), total {med('total_s'):.3f} s   [medians]"
    )
    print(
        "per sync (write, paused, load): "
        + ", ".join(f"({r.write_s:.3f}, {r.pause_s:.3f}, {r.update_s:.3f})" for r in reports)
    )
    print(f"ratio paused / (write + read)   : {med('pause_s') / io_s:.2f}")
    print(f"ratio paused / from_pretrained : {med('pause_s') / base['load']:.2f}")
    if args.load:
        print(f"under load: {counts['requests']} requests finished, {counts['resumes']} resumed after a sync abort")


if __name__ == "__main__":
    sys.exit(main())
