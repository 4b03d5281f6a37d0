"""The W4A16 GEMV on an NVIDIA GPU (runtime/kernels/int4_matmul.py): INT4 codes as stored with BF16
scales (`PlainInt4Weight`) and with coded scales (`Int4ScalesWeight`), against torch.matmul on the
same weights dequantized to BF16, at one row of x (a decode step).

One run, in this order, writing int4_gpu_bench.json and the table to --out:
  1. correctness, before anything is timed: on every shape and both weights, the product lies
     within the fp32 summation bound of F.linear on the dequantized fp32 weights (plus the BF16
     output's rounding); the first failure stops the script with exit status 1;
  2. medians of triton.testing.do_bench: torch.matmul (BF16), the plain GEMV and the coded-scales
     GEMV, each one's speed-up and GB/s of its own bytes; the grouped GEMV of a MoE step on Kimi's
     top-8 (8 of the stacked experts, one token).
Weights: symmetric absmax codes (group 32) of Gaussian and of Student-t(5) values (whose scales the
layout lists more often: they take the kernel's listed pass), Kimi K2's expert shapes; the grouped
case stacks 8 copies of one expert's codes (their own bytes each: the same traffic, less set-up).

--dry-run runs it on the CPU at tiny shapes through Triton's interpreter (one call a timing: no
number worth reading): it checks the script. benchmarks/device_run.py runs it on the GPU.

Run:  python benchmarks/int4_gpu_bench.py --out DIR [--dry-run]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from unweight.runtime.kernels import int4  # noqa: E402
from unweight.runtime.kernels.int4_matmul import int4_experts_linear, int4_linear  # noqa: E402
from unweight.runtime.kernels.weight import Int4ScalesWeight, PlainInt4Weight  # noqa: E402

GROUP = 32
SHAPES = {"kimi w13 4096x7168": (4096, 7168), "kimi w2 7168x2048": (7168, 2048)}
DRY_SHAPES = {"w13 16x128": (16, 128), "w2 12x64": (12, 64)}
EXPERTS, TOPK = 8, 8  # the grouped case: one token's top-8, over 8 stacked experts


def codes(rows: int, cols: int, heavy: bool, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric absmax INT4 codes of Gaussian (or Student-t(5)) weights as compressed-tensors
    packs them: (packed int32 (rows, cols / 8), BF16 scale bits (rows, cols / GROUP))."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_t(5, (rows, cols)) if heavy else rng.standard_normal((rows, cols))).astype(np.float32)
    g = w.reshape(rows, cols // GROUP, GROUP)
    bits = ((np.abs(g).max(-1, keepdims=True) / 7).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    scale = (bits.astype(np.uint32) << 16).view(np.float32)
    nib = (np.clip(np.rint(g / scale), -8, 7) + 8).astype(np.uint8).reshape(rows, cols)
    return int4.pack_nibbles(nib), bits.reshape(rows, -1)


def dequantized(packed: np.ndarray, scales: np.ndarray, cols: int) -> torch.Tensor:
    s = np.repeat((scales.astype(np.uint32) << 16).view(np.float32), GROUP, axis=1)
    return torch.from_numpy((int4.unpack_nibbles(packed, cols).astype(np.float32) - 8) * s)


def plain(packed: np.ndarray, scales: np.ndarray, cols: int) -> PlainInt4Weight:
    return PlainInt4Weight(
        torch.from_numpy(packed.reshape(-1).copy()),
        torch.from_numpy(scales.view(np.int16).reshape(-1).copy()),
        torch.zeros(0, dtype=torch.uint8),
        packed.shape[0],
        cols,
        GROUP,
    )


def first_expert(w, n: int):
    """The first n rows of a stacked INT4 weight (expert 0), as a weight of its own."""
    packed, scales = w.decode()
    if isinstance(w, PlainInt4Weight):
        return plain(packed[:n], scales[:n], w.cols)
    return Int4ScalesWeight.encode(packed[:n], scales[:n], w.cols, w.group)


def check(label: str, one: dict, stacked: dict, x, dense, ids, n: int) -> None:
    """Each weight's product (expert 0, and the grouped step) within the fp32 summation bound of
    F.linear on the dequantized weights, plus the BF16 output's rounding (2^-7: the interpreter
    truncates)."""
    k = x.shape[1]
    for kind in one:
        y1 = int4_linear(x, one[kind]).float()
        y8 = int4_experts_linear(x, stacked[kind], ids, n, len(ids), torch.float32)
        for p, (y, e) in enumerate([(y1[0], 0)] + [(y8[q], int(ids[q])) for q in range(len(ids))]):
            w = dense[e * n : (e + 1) * n]
            ref = F.linear(x.float(), w)[0]
            bound = (k + 1) * 2.0**-24 * F.linear(x.float().abs(), w.abs())[0] + (2.0**-7 if p == 0 else 0) * ref.abs()
            if not torch.all((y - ref).abs() <= bound):
                fail(f"{label} {kind} {'expert 0' if p == 0 else f'grouped pair {p - 1}'}: over the fp32 bound")
    print(f"  ok  {label}: plain and coded scales within the fp32 bound, alone and grouped", flush=True)


def time_ms(fn, device: str) -> float:
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def fail(msg: str) -> None:
    print(f"FAIL {msg}", flush=True)
    sys.exit(1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for int4_gpu_bench.json")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU through Triton's interpreter")
    args = ap.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU machine, or with --dry-run")
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    experts, topk = (2, 2) if args.dry_run else (EXPERTS, TOPK)
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run: Triton interpreter)"
    print(f"device {name}", flush=True)
    rows = []
    hdr = (
        f"{'shape':<22} {'weights':<9} {'listed':>6} {'bf16 ms':>8} {'plain x':>7} {'coded x':>7} "
        f"{'plain GB/s':>10} {'coded GB/s':>10} {'top-8 bf16 ms':>13} {'plain x':>7} {'coded x':>7}"
    )
    print("\n" + hdr, flush=True)
    for i, (label, (n, k)) in enumerate(shapes.items()):
        for heavy in (False, True):
            packed, scales = (np.tile(a, (experts, 1)) for a in codes(n, k, heavy, seed=i))  # the same codes a expert
            dense = dequantized(packed, scales, k).to(device)  # (experts n, k) fp32
            stacked = {"plain": plain(packed, scales, k), "coded": Int4ScalesWeight.encode(packed, scales, k, GROUP)}
            one = {kind: first_expert(w, n).to(device) for kind, w in stacked.items()}
            stacked = {kind: w.to(device) for kind, w in stacked.items()}
            x = torch.randn(1, k, device=device).to(torch.bfloat16)
            ids = torch.arange(topk, device=device, dtype=torch.int32) % experts
            check(label, one, stacked, x, dense, ids, n)
            w16 = dense.to(torch.bfloat16)
            w16_e = w16.view(experts, n, k)[ids.long()]  # the top-k's weights, (topk, n, k)
            base = time_ms(lambda: torch.matmul(x, w16[:n].T), device)
            base8 = time_ms(lambda: torch.bmm(x.expand(topk, 1, k), w16_e.transpose(1, 2)), device)
            row = {
                "shape": label,
                "weights": "student-t" if heavy else "gaussian",
                "listed_scales": int(one["coded"].sesc_row[-1]),
                "bf16_ms": base,
                "bf16_top8_ms": base8,
            }
            for kind in stacked:
                ms = time_ms(lambda: int4_linear(x, one[kind]), device)
                row[f"{kind}_ms"], row[f"{kind}_speedup"] = ms, base / ms
                row[f"{kind}_GBps"] = one[kind].stored_bytes / ms / 1e6
                ms8 = time_ms(lambda: int4_experts_linear(x, stacked[kind], ids, n, topk), device)
                row[f"{kind}_top8_ms"], row[f"{kind}_top8_speedup"] = ms8, base8 / ms8
            rows.append(row)
            print(
                f"{label:<22} {row['weights']:<9} {row['listed_scales']:>6} {base:>8.4f} {row['plain_speedup']:>7.2f} "
                f"{row['coded_speedup']:>7.2f} {row['plain_GBps']:>10.0f} {row['coded_GBps']:>10.0f} {base8:>13.4f} "
                f"{row['plain_top8_speedup']:>7.2f} {row['coded_top8_speedup']:>7.2f}",
                flush=True,
            )
    result = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": name,
        "dry_run": args.dry_run,
        "rows": rows,
        "seconds": time.perf_counter() - t_start,
    }
    (args.out / "int4_gpu_bench.json").write_text(json.dumps(result, indent=2))
    print(f"\nresults written to {args.out / 'int4_gpu_bench.json'} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
