"""How well the archive codec stores Kimi K2.5's INT4 experts: compressed-tensors `pack-quantized`
codes (symmetric, groups of 32, eight 4-bit codes to an I32) and their BF16 scales.

Kimi K2.5's routed experts are 7168 x 2048 (gate, up) and 2048 x 7168 (down). Their real codes are
not at hand (no Hub here), so the codes are made the way a quantizer makes them: weights of a
Gaussian or of a heavier-tailed Student t (5 degrees of freedom, closer to trained weights), each
group of 32 scaled by its largest |w| / 7 and rounded. For each, the table gives what the codes and
scales take against their own bytes:

- the order-0 bounds: of single 4-bit codes (a "nibble model") and of bytes (two codes a symbol);
- `rans` coding bytes (what `compress` tries first for integers), and zstd at levels 3 and 10;
- what `compress` picked (encode_tensor: the smallest candidate), and the BF16 scales' saving;
- encode and decode speed of `rans` and zstd-10 on the codes (one thread; medians over --reps,
  the two codecs alternated).

    python benchmarks/int4_bench.py [--experts 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import zstandard
from side_by_side import cpu_flags, write_record

from unweight.codec import CodecOptions, encode_tensor, rans

KIMI_EXPERT = ((2048, 7168), (2048, 7168), (7168, 2048))  # gate, up, down: (out, in)
GROUP = 32


def quantize(rng: np.random.Generator, rows: int, cols: int, dist: str) -> tuple[np.ndarray, np.ndarray]:
    """(packed codes as int32 (rows, cols / 8), BF16 scale bit patterns (rows, cols / 32))."""
    w = rng.standard_normal((rows, cols), dtype=np.float32) if dist == "gaussian" else rng.standard_t(5, (rows, cols))
    g = w.astype(np.float32).reshape(rows, cols // GROUP, GROUP)
    scale = np.abs(g).max(-1, keepdims=True) / 7
    scale_bf16 = (scale.view(np.uint32) >> 16).astype(np.uint16)  # truncated to BF16, as stored
    scale = (scale_bf16.astype(np.uint32) << 16).view(np.float32)
    codes = (np.clip(np.rint(g / scale), -8, 7).astype(np.int32) + 8).reshape(rows, cols).astype(np.uint32)
    packed = np.zeros((rows, cols // 8), dtype=np.uint32)
    for i in range(8):
        packed |= codes[:, i::8] << (4 * i)
    return packed.view(np.int32), scale_bf16.reshape(rows, cols // GROUP)


def entropy_bits(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum() * counts.sum())


def layer(experts: int, dist: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    codes, scales = [], []
    for _ in range(experts):
        for rows, cols in KIMI_EXPERT:
            c, s = quantize(rng, rows, cols, dist)
            codes.append(c.view(np.uint8).reshape(-1))
            scales.append(s.view(np.uint8).reshape(-1))
    return np.concatenate(codes), np.concatenate(scales)


def measure(codes: np.ndarray, scales: np.ndarray, reps: int) -> dict:
    opts = CodecOptions(threads=1, verify=False)
    n = len(codes)
    byte_counts = np.bincount(codes, minlength=256)
    nibble_counts = np.bincount(codes & 15, minlength=16) + np.bincount(codes >> 4, minlength=16)
    picked, streams = encode_tensor("codes", "I32", (n // 4,), codes, opts)
    sizes = {
        "nibble bound": entropy_bits(nibble_counts) / 8,
        "byte bound": entropy_bits(byte_counts) / 8,
        "zstd-3": len(zstandard.ZstdCompressor(level=3).compress(codes.tobytes())),
        "zstd-10": len(zstandard.ZstdCompressor(level=10).compress(codes.tobytes())),
        "compress": sum(len(s) for s in streams.values()),
    }
    p = rans.RansParams.for_word(8, False, opts.precision, rans.chunk_for(n, opts.chunk))  # as compress codes integers
    times: dict[str, list[float]] = {"rans encode": [], "rans decode": [], "zstd-10 encode": [], "zstd-10 decode": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        coded = rans.encode(codes, p, 1)
        times["rans encode"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        blob = zstandard.ZstdCompressor(level=10).compress(codes.tobytes())
        times["zstd-10 encode"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        back = rans.decode(coded, p, n, 1)
        times["rans decode"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        back2 = zstandard.ZstdDecompressor().decompress(blob)
        times["zstd-10 decode"].append(time.perf_counter() - t0)
        assert np.array_equal(back, codes) and back2 == codes.tobytes()  # bit-exact, on the bytes
    sizes["rans"] = sum(len(s) for s in coded.values())
    scale_entry, scale_streams = encode_tensor("scales", "BF16", (len(scales) // 2,), scales, opts)
    return {
        "code_bytes": n,
        "saving": {k: 1 - v / n for k, v in sizes.items()},
        "picked": picked.codec,
        "scales_saving": 1 - sum(len(s) for s in scale_streams.values()) / len(scales),
        "scales_codec": scale_entry.codec,
        "mb_per_s": {k: n / 1e6 / statistics.median(v) for k, v in times.items()},
        "mb_per_s_range": {k: [n / 1e6 / max(v), n / 1e6 / min(v)] for k, v in times.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=2, help="Kimi K2.5 experts of the layer (it has 384)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/int4_bench.json")
    args = ap.parse_args()
    results = {}
    for dist in ("gaussian", "student-t5"):
        codes, scales = layer(args.experts, dist)
        results[dist] = measure(codes, scales, args.reps)
    print(f"{args.experts} Kimi K2.5 experts (3 x 7168 x 2048), INT4 group {GROUP}; CPU: {cpu_flags()}")
    keys = ["nibble bound", "byte bound", "rans", "zstd-3", "zstd-10", "compress"]
    print(
        "| weights | "
        + " | ".join(keys)
        + " | compress picked | BF16 scales | rans enc/dec MB/s | zstd-10 enc/dec MB/s |"
    )
    print("|" + " --- |" * (len(keys) + 5))
    for dist, r in results.items():
        s, v = r["saving"], r["mb_per_s"]
        cells = [f"{100 * s[k]:.2f} %" if k in s else "-" for k in keys]
        print(
            f"| {dist} | "
            + " | ".join(cells)
            + f" | {r['picked']} | {100 * r['scales_saving']:.1f} % ({r['scales_codec']})"
            f" | {v['rans encode']:.0f} / {v['rans decode']:.0f}"
            f" | {v['zstd-10 encode']:.0f} / {v['zstd-10 decode']:.0f} |"
        )
    write_record(args.out, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
