"""What loading one Kimi-shaped MoE layer's experts costs a tensor-parallel rank: peak memory and
seconds, gathering the rank's experts dense then encoding them (the plugin's loader before) against
encoding each expert as it comes in (`tiles.RowsEncoder`, the loader now).

Kimi K2.5's MoE layers hold 384 routed experts of hidden size 7168 and intermediate size 2048; at
TP=8 a rank holds 256 of each expert's intermediate rows: 384 x 3 x 7168 x 256 BF16 weights, 4.2 GB
dense. Random weights (std 0.02, BF16), made expert by expert on both sides alike; each side runs in
a fresh process (its peak RSS is its own), alternated over --rounds. The baseline is BF16 dense:
what the rank would hold uncompressed.

    python benchmarks/expert_load_bench.py [--experts 384] [--hidden 7168] [--intermediate 256] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np
from side_by_side import cpu_flags, table, write_record

SIDES = ("dense then encode", "expert by expert")


def run_side(side: str, experts: int, hidden: int, inter: int) -> dict:
    """One side in this process: returns its seconds, peak RSS and resident bytes."""

    from unweight.codec.tiles import RowsEncoder
    from unweight.runtime.layers.experts import UnweightExperts

    rng = np.random.default_rng(0)

    def expert_values(rows: int, cols: int) -> np.ndarray:  # BF16 bit patterns of N(0, 0.02)
        w = rng.standard_normal(rows * cols, dtype=np.float32) * np.float32(0.02)
        return (w.view(np.uint32) >> 16).astype(np.uint16)

    t0 = time.perf_counter()
    if side == SIDES[0]:
        w13 = np.empty(experts * 2 * inter * hidden, dtype=np.uint16)
        w2 = np.empty(experts * hidden * inter, dtype=np.uint16)
        for e in range(experts):
            w13[e * 2 * inter * hidden : (e + 1) * 2 * inter * hidden] = expert_values(2 * inter, hidden)
            w2[e * hidden * inter : (e + 1) * hidden * inter] = expert_values(hidden, inter)
        layer = UnweightExperts.from_values(w13, w2, experts, hidden, inter)
        del w13, w2
    else:
        e13, e2 = RowsEncoder(experts * 2 * inter, hidden), RowsEncoder(experts * hidden, inter)
        for e in range(experts):
            e13.put(e * 2 * inter, expert_values(2 * inter, hidden))
            e2.put(e * hidden, expert_values(hidden, inter))
        layer = UnweightExperts.from_tiles(e13.finish(), e2.finish(), experts, hidden, inter)
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "resident_bytes": layer.stored_bytes,
        "bf16_bytes": 2 * experts * 3 * hidden * inter,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--intermediate", type=int, default=256, help="per rank: 2048 / TP")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, in a child process
    ap.add_argument("--out", default="benchmarks/results/expert_load_bench.json")
    args = ap.parse_args()
    shape = (args.experts, args.hidden, args.intermediate)
    if args.side:
        print(json.dumps(run_side(args.side, *shape)))
        return
    results: dict[str, list[dict]] = {s: [] for s in SIDES}
    for _ in range(args.rounds):
        for side in SIDES:
            cmd = [sys.executable, __file__, "--side", side, "--experts", str(args.experts)]
            cmd += ["--hidden", str(args.hidden), "--intermediate", str(args.intermediate)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{side} failed:\n{done.stderr[-3000:]}")
            results[side].append(json.loads(done.stdout.splitlines()[-1]))
    bf16_mb = results[SIDES[0]][0]["bf16_bytes"] / 2**20
    print(f"one rank's experts: {args.experts} x 3 x {args.hidden} x {args.intermediate}, {bf16_mb:,.0f} MiB in BF16")
    print(f"CPU: {cpu_flags()}")
    rows = [("load (s)", "seconds"), ("peak RSS", "peak_rss_bytes"), ("resident", "resident_bytes")]
    summary = table(results[SIDES[0]], results[SIDES[1]], rows, SIDES)
    write_record(args.out, {"shape": shape, "results": results, "summary": summary})


if __name__ == "__main__":
    main()
