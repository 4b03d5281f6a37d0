"""Serving-layout kernels against torch.matmul on BF16, for Llama-3.1-8B layer shapes.

On an NVIDIA GPU (the target: H200), in one run:
  1. correctness first: for every shape, the Triton decode kernel is bit-exact against the numpy
     decoder, and the fused kernel matches F.linear on the decoded weight within the fp32
     summation bound (K * 2^-24 * sum|x w|) at batch 1 and 64; any failure stops the script;
  2. timing (triton.testing.do_bench, medians): for each shape and batch, torch.matmul on dense
     BF16 (the baseline), `fused` (tiles kernel), and `decode_matmul` (Triton decode to a BF16
     workspace, then cuBLAS); the table gives each pipeline's speed-up over the baseline and the
     weight bytes per second it achieved against the device's measured copy bandwidth.

Writes JSON (--json). Meant to finish in under 5 minutes on an H200. With --device cpu it runs
the same checks and timings on small shapes through the numba CPU pipelines (no Triton).

Run:  python benchmarks/kernel_bench.py [--device cuda|cpu] [--batches 1,2,4,...] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from unweight.codec import tiles
from unweight.runtime.tile_tensors import tile_tensors

# Llama-3.1-8B linear layers, (out_features, in_features)
LLAMA8B_SHAPES = {"q_proj/o_proj": (4096, 4096), "k_proj/v_proj": (1024, 4096), "gate/up": (14336, 4096), "down": (4096, 14336)}
CPU_SHAPES = {"q-like": (1024, 1024), "up-like": (2816, 1024)}
GPU_BATCHES = (1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096)
CPU_BATCHES = (1, 4, 16, 64)


def make_weight(out_f: int, in_f: int, seed: int) -> np.ndarray:
    """Trained-like BF16 weights: N(0, 0.02), as uint16."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(out_f, in_f, generator=g) * 0.02).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).ravel()


def time_ms(fn, device: str) -> float:
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a device-to-device copy of 1 GiB (256 MiB on CPU): the napkin bound."""
    n = (1 << 30) if device == "cuda" else (1 << 28)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = time_ms(lambda: b.copy_(a), device)
    return 2 * n / (ms / 1e3)  # read + write


def pipelines(device: str, w_streams, p, out_f: int, in_f: int):
    """name -> fn(x) for the serving-layout pipelines on this device."""
    if device == "cuda":
        from unweight.runtime.kernels.tiles_decode import tiles_decode
        from unweight.runtime.kernels.tiles_matmul import tiles_linear

        return {
            "fused": lambda x: tiles_linear(x, w_streams, p.to_json(), out_f, in_f),
            "decode_matmul": lambda x: F.linear(x, tiles_decode(w_streams, p.to_json(), out_f, in_f)),
        }
    from unweight.runtime.cpu_gemv import tiles_gemv_cpu

    host = {k: v.numpy() for k, v in w_streams.items()}
    host["esc_index"] = host["esc_index"].astype("<u4").view(np.uint8)
    n_esc = int(w_streams["esc_index"][-1])
    host["esc"] = host["esc"][:n_esc]

    def decode_matmul(x):
        flat = tiles.decode(host, p, out_f, in_f)
        return F.linear(x, torch.from_numpy(flat.view(np.int16)).view(torch.bfloat16).reshape(out_f, in_f))

    return {"fused": lambda x: tiles_gemv_cpu(x, w_streams, p.base, p.block, out_f, in_f).to(torch.bfloat16), "decode_matmul": decode_matmul}


def check(device: str, name: str, v: np.ndarray, s, p, out_f: int, in_f: int, pipes, dense: torch.Tensor) -> None:
    if device == "cuda":
        from unweight.runtime.kernels.tiles_decode import tiles_decode

        got = tiles_decode(tile_tensors(s, device), p.to_json(), out_f, in_f)
        if not np.array_equal(got.view(torch.int16).cpu().numpy().view(np.uint16).ravel(), v):
            sys.exit(f"FAIL {name}: Triton decode is not bit-exact")
    for m in (1, 64):
        x = torch.randn(m, in_f, device=device).to(torch.bfloat16)
        ref = F.linear(x.float(), dense.float())
        bound = in_f * 2.0**-24 * F.linear(x.float().abs(), dense.float().abs()) + 2.0**-8 * ref.abs()  # + bf16 output rounding
        for pname, fn in pipes.items():
            err = (fn(x).float() - ref).abs()
            if not torch.all(err <= bound):
                sys.exit(f"FAIL {name} m={m} {pname}: max error {err.max().item():.3g}")
    print(f"  ok  {name}: decode bit-exact, pipelines within the fp32 bound", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/kernel_bench.json"))
    args = ap.parse_args(argv)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu, or on a GPU machine")
    shapes = LLAMA8B_SHAPES if device == "cuda" else CPU_SHAPES
    batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else (GPU_BATCHES if device == "cuda" else CPU_BATCHES)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    bw = copy_bandwidth(device)
    print(f"device {name}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)

    prepared = {}
    print("correctness:")
    for i, (label, (out_f, in_f)) in enumerate(shapes.items()):
        v = make_weight(out_f, in_f, seed=i)
        p, s = tiles.encode(v, out_f, in_f)
        dense = torch.from_numpy(v.view(np.int16)).view(torch.bfloat16).reshape(out_f, in_f).to(device)
        w = tile_tensors(s, device)
        pipes = pipelines(device, w, p, out_f, in_f)
        check(device, label, v, s, p, out_f, in_f, pipes, dense)
        stored = sum(len(a) for a in s.values())
        prepared[label] = (out_f, in_f, dense, pipes, stored)

    rows = []
    print(f"\n{'shape':<14} {'batch':>5} {'bf16 ms':>9} " + " ".join(f"{n + ' ×':>16} {'GB/s':>6}" for n in ("fused", "decode_matmul")))
    for label, (out_f, in_f, dense, pipes, stored) in prepared.items():
        for m in batches:
            x = torch.randn(m, in_f, device=device).to(torch.bfloat16)
            base_ms = time_ms(lambda: torch.matmul(x, dense.T), device)
            row = {"shape": label, "out": out_f, "in": in_f, "batch": m, "bf16_ms": base_ms, "bf16_weight_GBps": 2 * out_f * in_f / base_ms / 1e6}
            cells = []
            for pname, fn in pipes.items():
                ms = time_ms(lambda: fn(x), device)
                row[f"{pname}_ms"] = ms
                row[f"{pname}_speedup"] = base_ms / ms
                row[f"{pname}_weight_GBps"] = stored / ms / 1e6  # compressed bytes actually read
                cells.append(f"{base_ms / ms:>16.2f} {stored / ms / 1e6:>6.1f}")
            rows.append(row)
            print(f"{label:<14} {m:>5} {base_ms:>9.3f} " + " ".join(cells), flush=True)

    result = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "device": name,
              "copy_bandwidth_GBps": bw / 1e9, "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"\nresults written to {args.json}")


if __name__ == "__main__":
    main()
