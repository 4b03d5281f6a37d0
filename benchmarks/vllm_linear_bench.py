"""The vLLM plugin's CPU linears against vLLM's own, one layer call at a time, in vLLM's environment.

SmolLM2-135M-Instruct's four linear shapes (q,k,v stacked 960x576, o 576x576, gate,up stacked
3072x576, down 576x1536, read as cpu_gemv_bench.py reads them), each as its 30 layers' real BF16
weights, so that a round over them reads every weight from DRAM as a forward does; with --shapes
lm_head also the lm_head (the tied 49152x576 embedding, 57 MB: one layer). At each batch
of BF16 x (--batches), per shape, the time of one call of all 30 layers through:

  vllm           vLLM's CPU GEMM dispatch on the dense weight, packed once (what its unquantized
                 layers run; oneDNN on x86): the baseline
  fused          the plugin's layer, fused pipeline (the numba GEMV that decodes W as it multiplies)
  decode_linear  the plugin's layer, W decoded into a workspace, then F.linear
  dense_linear   F.linear on the dense weight: decode_linear without the decode

The worker runs in the vLLM environment (tests/envs.py's vllm_env) on --cores cores with as many
threads (vLLM's CPU worker on a 2-vCPU box gets one), the variants' order alternated from one
repeat to the next. Prints medians and ranges over --reps repeats with each over vllm's median,
the CPU flags with them, and each variant's medians summed over the four shapes (a decoder layer's
linears) over vLLM's; writes JSON (--out).

    python benchmarks/vllm_linear_bench.py [--batches 1,16,256] [--reps 5] [--cores 1]
                                           [--shapes qkv,o,gate_up,down,lm_head]
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

from side_by_side import cpu_flags, write_record

LINEARS = ("qkv", "o", "gate_up", "down")  # of cpu_gemv_bench.SHAPES: a decoder layer's linears
SHAPES_KNOWN = (*LINEARS, "lm_head")  # --shapes: the lm_head is one layer, left out of the layer's total
VARIANTS = ("vllm", "fused", "decode_linear", "dense_linear")


def worker(src: str, out: str, batches: list[int], reps: int, cores: int, shapes: list[str]) -> None:
    """In the vLLM environment: {batch: {shape: {variant: [ms per call of all layers, ...]}}} to `out`."""
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:cores]))
    import numba
    import numpy as np
    import torch
    import torch.nn.functional as F
    from cpu_gemv_bench import SHAPES, read_bf16

    from unweight.runtime.vllm.plugin import _linear_class, _vllm_cpu_gemm

    torch.set_num_threads(cores)
    numba.set_num_threads(min(cores, numba.config.NUMBA_NUM_THREADS))
    n_layers = json.loads((Path(src) / "config.json").read_text())["num_hidden_layers"]
    layers = {}
    for shape in shapes:
        layers[shape] = []
        for i in range(n_layers if shape in LINEARS else 1):
            values = read_bf16(Path(src) / "model.safetensors", [n.format(layer=i) for n in SHAPES[shape][2]])
            w = torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
            uw = _linear_class().from_values(values.reshape(-1), *w.shape, None, torch.device("cpu"))
            layers[shape].append((w, uw, _vllm_cpu_gemm(w)))
    calls = {
        "vllm": lambda x, w, uw, gemm: gemm(x),
        "fused": lambda x, w, uw, gemm: uw.run("fused", x),
        "decode_linear": lambda x, w, uw, gemm: uw.run("decode_linear", x),
        "dense_linear": lambda x, w, uw, gemm: F.linear(x, w),
    }
    g = torch.Generator().manual_seed(0)
    results: dict = {}
    for m in batches:
        for shape, group in layers.items():
            x = torch.randn(m, group[0][0].shape[1], generator=g).to(torch.bfloat16)
            times = results.setdefault(str(m), {}).setdefault(shape, {v: [] for v in VARIANTS})
            for rep in range(reps + 1):  # the first round warms up (the plugin's workspace, oneDNN's kernels)
                for v in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
                    t = time.perf_counter()
                    for w, uw, gemm in group:
                        calls[v](x, w, uw, gemm)
                    if rep:
                        times[v].append((time.perf_counter() - t) * 1e3)
        print(f"batch {m} done", file=sys.stderr)
    Path(out).write_text(json.dumps({"layers": n_layers, "results": results}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16,256", help="rows of x, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cores", type=int, default=1, help="cores (and threads) the worker runs on")
    ap.add_argument("--shapes", default=",".join(LINEARS), help=f"of {', '.join(SHAPES_KNOWN)}")
    ap.add_argument("--out", default="benchmarks/results/vllm_linear_bench.json")
    ap.add_argument("--worker", nargs=2, metavar=("SRC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = set(shapes) - set(SHAPES_KNOWN)
    if unknown:
        ap.error(f"unknown shape(s) {', '.join(sorted(unknown))}")
    if args.worker:
        return worker(*args.worker, batches, args.reps, args.cores, shapes)

    from unweight.defaults import cache_dir

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test support: envs, hosts, peak_rss
    from envs import vllm_env
    from unweight.testing import smollm2_bf16

    python, src = vllm_env(), smollm2_bf16(cache_dir() / "smollm2-bf16")
    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "linears.json"
        cmd = [str(python), __file__, "--worker", str(src), str(out), "--batches", args.batches]
        cmd += ["--reps", str(args.reps), "--cores", str(args.cores), "--shapes", args.shapes]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"the worker failed:\n{(done.stdout + done.stderr)[-3000:]}")
        record = json.loads(out.read_text())

    summary: dict = {}
    print(
        f"\nms for one call of each shape's {record['layers']} layers (the lm_head's one), BF16 x, median (range) over "
        f"{args.reps} repeats, and the median over vLLM's; {args.cores} core(s); CPU: {cpu_flags()}\n"
    )
    print("| rows of x | shape | " + " | ".join(VARIANTS) + " |")
    print("| ---: | --- |" + " ---: |" * len(VARIANTS))
    for m, shapes in record["results"].items():
        for shape, times in shapes.items():
            base = statistics.median(times["vllm"])
            cells = {}
            for v in VARIANTS:
                med = statistics.median(times[v])
                cells[v] = {"median_ms": med, "min_ms": min(times[v]), "max_ms": max(times[v]), "vs_vllm": med / base}
            summary.setdefault(m, {})[shape] = cells
            row = " | ".join(
                f"{c['median_ms']:.1f} ({c['min_ms']:.1f}–{c['max_ms']:.1f}) {c['vs_vllm']:.2f}×"
                for c in cells.values()
            )
            print(f"| {m} | {shape} | {row} |")
        # a decoder layer's linears together (not the lm_head): each variant's medians summed over vLLM's
        layer = [cells for shape, cells in summary[m].items() if shape in LINEARS]
        if not layer:
            continue
        totals = {v: sum(cells[v]["median_ms"] for cells in layer) for v in VARIANTS}
        summary[m]["total"] = {v: {"median_ms": t, "vs_vllm": t / totals["vllm"]} for v, t in totals.items()}
        print(f"| {m} | total | " + " | ".join(f"{t:.1f} {t / totals['vllm']:.2f}×" for t in totals.values()) + " |")
    write_record(args.out, {"args": vars(args), "summary": summary, "runs": record})


if __name__ == "__main__":
    main()
