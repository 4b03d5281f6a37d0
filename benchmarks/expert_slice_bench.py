"""What a tensor-parallel rank's share of Llama-4-Scout's fused gate_up experts costs to decode:
the tensor coded as stored (a rank's gate and up rows are columns of every stored row, so it
decodes every expert whole) against coded transposed (format 2.1: its rows decode from their own
chunks), both read as vLLM's Llama 4 loader reads them (LazyWeight: transpose, chunk gate from up,
then each expert's block of the rank's rows of both, in one call as the plugin's loader asks).

Scout's MoE layer: 16 experts, hidden 5120, intermediate 8192, so gate_up is (16, 5120, 16384), 2.7 GB
in BF16. Random weights (std 0.02); each side decodes the same experts at --tp ranks in turn,
sides alternated over --reps, one thread; the baseline is the stored order.

    python benchmarks/expert_slice_bench.py [--experts 4] [--tp 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from side_by_side import cpu_flags, write_record

import unweight
from unweight.reader import CompressedCheckpoint
from unweight.runtime.vllm.lazy import LazyWeight

HIDDEN, INTER = 5120, 8192
NAMES = {"stored order": "gate_up", "transposed": "model.layers.0.feed_forward.experts.gate_up_proj"}


def rank_share(folder: Path, name: str, experts: int, tp: int, rank: int) -> tuple[float, int]:
    """(seconds, bytes kept) for rank `rank`'s gate and up rows of every expert."""
    with CompressedCheckpoint(folder, threads=1) as ckpt:
        gate, _ = LazyWeight(ckpt, name).transpose(-1, -2).chunk(2, dim=-2)
        both = gate.unchunked()  # the plugin's loader takes gate and up in one call (_gate_half)
        r0, r1 = rank * INTER // tp, (rank + 1) * INTER // tp
        t0 = time.perf_counter()
        kept = 0
        for e in range(experts):
            kept += both.expert(e, [(r0, r1), (INTER + r0, INTER + r1)], 0, HIDDEN).numel() * 2
        return time.perf_counter() - t0, kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=4, help="Scout has 16 a layer")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/expert_slice_bench.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        w = torch.from_numpy(
            ((rng.standard_normal((args.experts, HIDDEN, 2 * INTER), dtype=np.float32) * 0.02).view(np.uint32) >> 16)
            .astype(np.uint16)
            .view(np.int16)
        ).view(torch.bfloat16)
        folders = {}
        for side, name in NAMES.items():
            src = Path(tmp) / side.replace(" ", "-") / "src"
            src.mkdir(parents=True)
            save_file({name: w}, str(src / "model.safetensors"))
            folders[side] = Path(tmp) / side.replace(" ", "-") / "uw"
            unweight.compress(src, folders[side])
        del w
        runs: dict[str, list[float]] = {side: [] for side in NAMES}
        kept = {}
        for _ in range(args.reps):
            for side, name in NAMES.items():
                seconds = 0.0
                for rank in range(args.tp):
                    s, kept[side] = rank_share(folders[side], name, args.experts, args.tp, rank)
                    seconds += s
                runs[side].append(seconds / args.tp)  # a rank's time
    base, ours = statistics.median(runs["stored order"]), statistics.median(runs["transposed"])
    gb = args.experts * HIDDEN * 2 * INTER * 2 / 1e9
    print(f"gate_up of {args.experts} Scout experts ({gb:.2f} GB BF16), TP={args.tp}, one thread; CPU: {cpu_flags()}")
    print("| coded | a rank's decode (s), median (range) | kept per rank | ratio |")
    print("| --- | --- | --- | --- |")
    for side in NAMES:
        r = runs[side]
        print(
            f"| {side} | {statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f}) | {kept[side] / 1e6:,.0f} MB"
            f" | {statistics.median(r) / base:.2f}x |"
        )
    print(f"transposed: {base / ours:.2f}x faster a rank")
    write_record(args.out, {"args": vars(args), "seconds_per_rank": runs})


if __name__ == "__main__":
    main()
