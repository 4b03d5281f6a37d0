"""The CPU fused GEMV (`tiles_gemv_cpu`) against torch's F.linear, on SmolLM2-135M's linear shapes.

For each (out_features N, in_features K) below and each batch M (--batches), in one process and
at one thread count (--threads, for torch and numba alike):

  torch bf16   F.linear(x_bf16, W_bf16)      the baseline (oneDNN/MKL)
  torch fp32   F.linear(x_fp32, W_fp32)      twice the weight bytes
  fused        tiles_gemv_cpu(x_fp32, W)     W in the serving layout (`tiles`), fp32 out
  groups       the same, W rebuilt 8 weights at a time (cpu_avx2) where fused takes 64-weight
               chunks (cpu_avx512: CPUs with AVX-512 VBMI, VBMI2 and GFNI)
  fused bf16   tiles_gemv_cpu(x_bf16, W)     the same through vdpbf16ps (only on AVX512_BF16 CPUs)
  groups bf16  the same on 8-weight groups, where fused bf16 takes 64-weight chunks

the median wall time of one call, the bytes of weight read per second (BF16 bytes for torch bf16
and llama.cpp, FP32 for torch fp32, the serving layout's coded bytes for the fused variants), and
each fused variant over torch bf16.

--llamacpp adds llama.cpp's own BF16 GEMV (`ggml_bf16`: ggml's `ggml_mul_mat` from the libggml
that llama-cpp-python ships, built with GGML_NATIVE by tests/envs.py, in a child process, see
ggml_gemv.py) on random BF16 weights of the same shapes, at the same threads and the same number
of weight copies, and each fused variant over it.

Weights (--model smollm2): the matrices of one layer (--layer) of the SmolLM2-135M-Instruct
fixture when it is cached (or --safetensors PATH), as the runtime fuses them: q,k,v stacked (960 x
576), o (576 x 576), gate,up stacked (3072 x 576), down (576 x 1536) and the tied embedding / LM
head (49152 x 576); else trained-like N(0, 0.02) BF16 values of the same shapes. --model llama-1b:
N(0, 0.02) values in Llama-3.2-1B's shapes (3072 x 2048, 2048 x 2048, 16384 x 2048, 2048 x 8192,
128256 x 2048), whose weights are far larger than any L3.

Correctness first: every shape and batch against F.linear(x, W.float()) within the fp32
summation bound (K * 2^-23 * |x| @ |W|^T), BF16 x too where the vdpbf16ps kernel runs; a failure
stops the script.
Timing: the variants interleave in rounds (the median is taken over every call of every round),
so load from other processes hits them alike; llama.cpp's take their rounds after those, with a
pause on each side of them (SETTLE_S) for the spinning OpenMP threads of the other process to sleep. --sdpa runs a small
scaled_dot_product_attention before every timed call, as a decode step interleaves torch ops
with its linears (this shows OpenMP thread pools getting in each other's way). --cold rotates
every variant over enough copies of its weight (--cold-mb in all) that each call reads it from
DRAM, as a decode step of a whole model does; by default the weight stays in cache between calls.

Writes JSON (--json; default benchmarks/results/cpu_gemv_bench.json).

Run:  python benchmarks/cpu_gemv_bench.py [--model smollm2|llama-1b] [--threads N] [--batches 1,4,16] [--rounds 15]
          [--sdpa] [--cold] [--llamacpp]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import struct
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from side_by_side import cpu_flags

from unweight.codec import tiles
from unweight.runtime.kernels import cpu_gemv
from unweight.runtime.kernels.cpu_gemv import BF16_DOT, CHUNK_DOT, CHUNKS, FAST_PATH, tiles_gemv_cpu
from unweight.runtime.kernels.weight import TilesWeight

# label -> (N, K, tensor names stacked in this order, {layer} filled in)
SHAPES = {
    "qkv": (
        960,
        576,
        [
            "model.layers.{layer}.self_attn.q_proj.weight",
            "model.layers.{layer}.self_attn.k_proj.weight",
            "model.layers.{layer}.self_attn.v_proj.weight",
        ],
    ),
    "o": (576, 576, ["model.layers.{layer}.self_attn.o_proj.weight"]),
    "gate_up": (3072, 576, ["model.layers.{layer}.mlp.gate_proj.weight", "model.layers.{layer}.mlp.up_proj.weight"]),
    "down": (576, 1536, ["model.layers.{layer}.mlp.down_proj.weight"]),
    "lm_head": (49152, 576, ["model.embed_tokens.weight"]),
}
# Between this process's variants and llama.cpp's (in a process of its own): the OpenMP threads
# of the one before spin a while after their last region before they sleep, and would take a core
# from the other (interleaved in each round, llama.cpp's GEMV lost half its speed, and ours 4 ms a
# call, a scheduler tick).
SETTLE_S = 0.2
# Llama-3.2-1B's linears as the runtime fuses them (hidden 2048, 32 query and 8 KV heads of 64, MLP 8192)
LLAMA_1B = {
    "qkv": (3072, 2048),
    "o": (2048, 2048),
    "gate_up": (16384, 2048),
    "down": (2048, 8192),
    "lm_head": (128256, 2048),
}


def read_bf16(path: Path, names: list[str]) -> np.ndarray | None:
    """The named BF16 matrices of a safetensors file stacked by rows, as uint16; None if any is missing."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        parts = []
        for name in names:
            entry = header.get(name)
            if entry is None or entry["dtype"] != "BF16" or len(entry["shape"]) != 2:
                return None
            b, e = entry["data_offsets"]
            f.seek(8 + n + b)
            parts.append(np.frombuffer(f.read(e - b), dtype=np.uint16).reshape(entry["shape"]))
    return np.ascontiguousarray(np.concatenate(parts))


def synthetic(rows: int, cols: int, seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return (
        (torch.randn(rows, cols, generator=g) * 0.02)
        .to(torch.bfloat16)
        .view(torch.int16)
        .numpy()
        .view(np.uint16)
        .reshape(rows, cols)
    )


def weights(path: Path | None, layer: int, model: str = "smollm2") -> dict[str, tuple[np.ndarray, str]]:
    if model == "llama-1b":
        return {
            label: (synthetic(rows, cols, seed=i), "N(0, 0.02)")
            for i, (label, (rows, cols)) in enumerate(LLAMA_1B.items())
        }
    out = {}
    for i, (label, (rows, cols, names)) in enumerate(SHAPES.items()):
        v = read_bf16(path, [s.format(layer=layer) for s in names]) if path is not None and path.exists() else None
        if v is not None and v.shape == (rows, cols):
            out[label] = (v, "+".join(s.format(layer=layer).split(".")[-2] for s in names))
        else:
            out[label] = (synthetic(rows, cols, seed=i), "N(0, 0.02)")
    return out


def groups(fn):
    """fn() with the GEMV on cpu_avx2's 8-weight groups instead of cpu_avx512's chunks."""
    cpu_gemv.CHUNKS = cpu_gemv.CHUNK_DOT = False
    try:
        return fn()
    finally:
        cpu_gemv.CHUNKS, cpu_gemv.CHUNK_DOT = CHUNKS, CHUNK_DOT


def check(label: str, w, p, dense: torch.Tensor, batches) -> None:
    rows, cols = dense.shape
    for m in batches:
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
        for xv in (x, x.bfloat16()) if BF16_DOT else (x,):
            ref = F.linear(xv.double(), dense.double())
            bound = cols * 2.0**-23 * F.linear(xv.double().abs(), dense.double().abs()) + 1e-30
            got = tiles_gemv_cpu(xv, w)
            err = (got.double() - ref).abs()
            if got.shape != (m, rows) or not torch.all(err <= bound):
                sys.exit(
                    f"FAIL {label} M={m} x {xv.dtype}: max error {err.max().item():.3g}, "
                    f"{(err / bound).max().item():.2f}x the fp32 bound"
                )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads for torch and numba (default: numba's default, the CPU count)",
    )
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "llama-1b"), help="whose linear shapes")
    ap.add_argument("--batches", default="1,4,16", help="comma-separated batch sizes M")
    ap.add_argument("--rounds", type=int, default=15, help="rounds of interleaved timing per shape and batch")
    ap.add_argument("--min-round-ms", type=float, default=4.0, help="each variant runs at least this long per round")
    ap.add_argument("--layer", type=int, default=15)
    ap.add_argument(
        "--safetensors", type=Path, default=None, help="BF16 SmolLM2-135M weights (default: the cached fixture)"
    )
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES))
    ap.add_argument(
        "--sdpa", action="store_true", help="run a small scaled_dot_product_attention before every timed call"
    )
    ap.add_argument(
        "--cold", action="store_true", help="rotate over copies of each weight so that every call reads it from DRAM"
    )
    ap.add_argument(
        "--cold-mb",
        type=float,
        default=96.0,
        help="bytes of BF16 weight copies per shape with --cold (above the L3 size)",
    )
    ap.add_argument(
        "--llamacpp", action="store_true", help="also llama.cpp's BF16 GEMV (ggml, from llama-cpp-python built here)"
    )
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/cpu_gemv_bench.json"))
    args = ap.parse_args(argv)

    import numba

    if args.threads:
        numba.set_num_threads(args.threads)
        torch.set_num_threads(args.threads)
    else:
        torch.set_num_threads(numba.get_num_threads())
    threads = numba.get_num_threads()
    batches = tuple(int(b) for b in args.batches.split(","))
    path = args.safetensors
    if path is None:
        from unweight.defaults import cache_dir

        path = cache_dir() / "smollm2-bf16" / "model.safetensors"
    labels = [s for s in args.shapes.split(",") if s]
    mats = weights(path, args.layer, args.model)
    ggml = None
    if args.llamacpp:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test support: envs
        from ggml_gemv import Ggml

        from envs import llamacpp_site

        ggml = Ggml(llamacpp_site() / "llama_cpp" / "lib", threads)

    q, k, v = (torch.randn(1, 9, n, 64) for n in (1, 64, 64))
    between = (lambda: F.scaled_dot_product_attention(q, k, v)) if args.sdpa else (lambda: None)

    print(
        f"cpu: {cpu_flags()}; {threads} threads (torch {torch.get_num_threads()}, numba layer "
        f"{numba.config.THREADING_LAYER}); fused path: {'AVX2 kernels' if FAST_PATH else 'portable'}"
        f"{', vdpbf16ps for BF16 x' if BF16_DOT else ''}{', 64-weight chunks' if CHUNKS else ''}; "
        f"weights: {path if path.exists() and args.model == 'smollm2' else 'synthetic'} ({args.model})"
    )
    print("correctness:")
    prepared = {}
    for label in labels:
        vals, source = mats[label]
        rows, cols = vals.shape
        p, s = tiles.encode(vals.ravel(), rows, cols)
        w = TilesWeight.from_numpy(s, p, rows, cols)
        dense = torch.from_numpy(vals.view(np.int16).copy()).view(torch.bfloat16)
        check(label, w, p, dense, batches)
        esc = len(s["esc"]) / vals.size
        print(
            f"  ok  {label} {rows}x{cols} ({source}): {100 * esc:.1f}% escapes, within the fp32 bound at "
            f"M={','.join(map(str, batches))}"
        )
        copies = max(1, -(-int(args.cold_mb * 2**20) // (2 * vals.size))) if args.cold else 1
        ws = [w] + [TilesWeight.from_numpy(s, p, rows, cols) for _ in range(copies - 1)]
        dense_copies = [dense] + [dense.clone() for _ in range(copies - 1)]
        prepared[label] = (ws, p, dense_copies, [d.float() for d in dense_copies], esc, source)
        if ggml is not None:
            for m in batches:  # (its first product checked against numpy's)
                ggml.prepare(label, rows, cols, copies, m)

    results = []
    names = ["torch_bf16", "torch_fp32", "fused"] + (["groups"] if CHUNKS else [])
    names += (["fused_bf16"] if BF16_DOT else []) + (["groups_bf16"] if CHUNK_DOT else [])
    names += ["ggml_bf16"] if ggml is not None else []
    fused = [n for n in names if n.startswith(("fused", "groups"))]
    bases = ["torch_bf16"] + (["ggml_bf16"] if ggml is not None else [])
    over = [(n, b) for b in bases for n in fused]
    print(
        f"\n{'shape':>16} {'M':>3} | "
        + " ".join(f"{n:>11}" for n in names)
        + " us | "
        + " ".join(f"{n:>11}" for n in names)
        + " GB/s | "
        + " ".join(f"{n + '/' + b:>22}" for n, b in over)
    )
    for label in labels:
        ws, p, dense, dense32, esc, source = prepared[label]
        rows, cols = dense[0].shape
        copies = len(ws)
        turn = [0]

        def pick(seq):  # the next copy of a weight (the same one unless --cold)
            turn[0] += 1
            return seq[turn[0] % copies]

        for m in batches:
            x = torch.randn(m, cols)
            xb = x.to(torch.bfloat16)
            variants = {
                "torch_bf16": lambda: F.linear(xb, pick(dense)),
                "torch_fp32": lambda: F.linear(x, pick(dense32)),
                "fused": lambda: tiles_gemv_cpu(x, pick(ws)),
                "groups": lambda: groups(lambda: tiles_gemv_cpu(x, pick(ws))),
                "fused_bf16": lambda: tiles_gemv_cpu(xb, pick(ws)),
                "groups_bf16": lambda: groups(lambda: tiles_gemv_cpu(xb, pick(ws))),
            }
            variants = {n: variants[n] for n in names if n != "ggml_bf16"}
            reps = {}
            for name, fn in variants.items():  # warm up, and size a round
                fn()
                t0 = time.perf_counter()
                fn()
                reps[name] = max(3, int(args.min_round_ms * 1e-3 / max(time.perf_counter() - t0, 1e-7)))
            if ggml is not None:  # a graph is one product per weight copy: enough graphs for a round
                one = statistics.median(ggml.time(label, m, 3)) * copies
                reps["ggml_bf16"] = max(3, int(args.min_round_ms * 1e-3 / max(one, 1e-7)))
            times = {name: [] for name in names}
            time.sleep(SETTLE_S)
            for _ in range(args.rounds):
                for name, fn in variants.items():
                    for _ in range(reps[name]):
                        between()
                        t0 = time.perf_counter()
                        fn()  # (pick() is inside: an index and a list lookup, timed alike for all three)
                        times[name].append(time.perf_counter() - t0)
            if ggml is not None:  # its rounds after this process's, once their threads sleep
                time.sleep(SETTLE_S)
                for _ in range(args.rounds):
                    times["ggml_bf16"] += ggml.time(label, m, reps["ggml_bf16"])
            med = {name: statistics.median(t) for name, t in times.items()}
            ns = {name: 1e9 * t / (rows * cols) for name, t in med.items()}
            read = {n: ws[0].nbytes if n in fused else rows * cols * (4 if n == "torch_fp32" else 2) for n in names}
            gbs = {n: read[n] / med[n] / 1e9 for n in names}
            ratios = {f"{n}_over_{b}": med[n] / med[b] for n, b in over}
            print(
                f"{label + ' ' + str(rows) + 'x' + str(cols):>16} {m:>3} | "
                + " ".join(f"{1e6 * med[n]:>11.1f}" for n in names)
                + "    | "
                + " ".join(f"{gbs[n]:>11.1f}" for n in names)
                + "      | "
                + " ".join(f"{r:>22.2f}" for r in ratios.values()),
                flush=True,
            )
            results.append(
                {
                    "shape": label,
                    "out_features": rows,
                    "in_features": cols,
                    "batch": m,
                    "weights": source,
                    "escape_fraction": esc,
                    "median_us": {k: 1e6 * t for k, t in med.items()},
                    "ns_per_element": ns,
                    "weight_bytes_read": read,
                    "gb_per_s": gbs,
                    **ratios,
                    "calls_timed": {k: len(t) for k, t in times.items()},
                }
            )

    if ggml is not None:
        ggml.close()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    out = {
        "benchmark": "cpu_gemv_bench",
        "model": args.model,
        "llama_cpp": "ggml_mul_mat (BF16 weight, F32 activations) from llama-cpp-python's libggml"
        if ggml is not None
        else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_flags(),
        "threads": threads,
        "numba_threading_layer": numba.config.THREADING_LAYER,
        "fused_path": "avx2" if FAST_PATH else "portable",
        "chunks": CHUNKS,
        "bf16_chunks": CHUNK_DOT,
        "torch": torch.__version__,
        "numba": numba.__version__,
        "sdpa_between_calls": args.sdpa,
        "cold": args.cold,
        "results": results,
    }
    args.json.write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
