"""`unweight inspect` on a checkpoint with as many tensors as a real MoE model (40-90k).

Builds a compressed folder of N small BF16 tensors named like an MoE checkpoint (layers x experts
x gate/up/down, plus norms), in shards of SHARD_TENSORS tensors with their index (one container
holds at most about 60k tensors: its header would pass the readers' cap). Then times the CLI on
it, alternating the modes, each run a fresh process: the default table (one row per layer type),
--tensors (one row per tensor) and --json; and `unweight.inspect` alone (decoding and
statistics, no rendering). Target: every output under ~5 s for 100k tensors.

    python benchmarks/inspect_bench.py                 # 100k tensors, 3 rounds
    python benchmarks/inspect_bench.py --tensors 20000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPE = (16, 32)  # 512 weights, 1 KiB a tensor


SHARD_TENSORS = 10_000


def names(n: int) -> list[str]:
    """n tensor names: layers of two norms and 64 experts' three projections."""
    out, layer = [], 0
    while len(out) < n:
        out += [f"model.layers.{layer}.input_layernorm.weight", f"model.layers.{layer}.post_attention_layernorm.weight"]
        out += [
            f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight" for e in range(64) for p in ("gate", "up", "down")
        ]
        layer += 1
    return out[:n]


def build(folder: Path, n: int) -> None:
    """The compressed folder: shards of SHARD_TENSORS tensors and model.safetensors.index.json."""
    from unweight.codec import CodecOptions, encode_tensor
    from unweight.formats import ContainerWriter

    rng = np.random.default_rng(0)
    opts = CodecOptions(threads=1, verify=False)
    folder.mkdir()
    all_names = names(n)
    shards = -(-n // SHARD_TENSORS)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        with ContainerWriter(os.fspath(folder / file)) as writer:
            for name in all_names[k * SHARD_TENSORS : (k + 1) * SHARD_TENSORS]:
                w = rng.standard_normal(SHAPE, dtype=np.float32) * 0.02
                bf16 = (w.view(np.uint32) >> 16).astype(np.uint16)  # truncation is fine for a size benchmark
                entry, streams = encode_tensor(name, "BF16", SHAPE, bf16.view(np.uint8).reshape(-1), opts)
                writer.add(entry, streams)
                weight_map[name] = file
            writer.finish(source_header=None)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def run_cli(path: Path, *flags: str) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "unweight.cli.main", "inspect", str(path), *flags], capture_output=True, text=True
    )
    took = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"inspect {' '.join(flags)} failed: {r.stderr[-500:]}")
    return took


def library(path: Path) -> float:
    code = (
        f"import os, time, unweight; t = time.perf_counter(); "
        f"unweight.inspect({str(path)!r}, processes=len(os.sched_getaffinity(0))); "
        "print(time.perf_counter() - t)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(r.stdout.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/inspect_bench.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as td:
        path = Path(td) / "moe-uw"
        t0 = time.perf_counter()
        build(path, args.tensors)
        size = sum(f.stat().st_size for f in path.iterdir())
        took = time.perf_counter() - t0
        print(f"built {args.tensors:,} tensors ({size / 1e6:.1f} MB) in {took:.0f} s", file=sys.stderr)
        modes = {"table (by layer type)": (), "--tensors": ("--tensors",), "--json": ("--json",)}
        times: dict[str, list[float]] = {m: [] for m in [*modes, "unweight.inspect"]}
        for _ in range(args.rounds):  # alternated, so a slow spell of the machine hits every mode
            for mode, flags in modes.items():
                times[mode].append(run_cli(path, *flags))
            times["unweight.inspect"].append(library(path))
    print(f"\n`unweight inspect`, {args.tensors:,} tensors, {args.rounds} alternated rounds, {os.cpu_count()} CPUs\n")
    print("| output | median s | range s |")
    print("| --- | ---: | ---: |")
    for mode, ts in times.items():
        print(f"| {mode} | {statistics.median(ts):.2f} | {min(ts):.2f}–{max(ts):.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"tensors": args.tensors, "rounds": args.rounds, "cpus": os.cpu_count(), "seconds": times}, indent=1)
    )


if __name__ == "__main__":
    main()
