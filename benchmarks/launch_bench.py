"""Host time per fused linear-layer call, measured on this CPU with no GPU.

A small-batch decode step on an H200 spends ~5.5 us of GPU time in a 4096x4096 layer, so the
host must not spend more than that launching it (or the step must be a CUDA graph, which
replays without the host). This measures, per `qtiles_linear` call on Llama-3.1-8B shapes:

  launcher   our Python: checks, output allocation, block and split choice (the kernel swapped for a no-op)
  triton     Triton's per-launch Python in JITFunction.run before the driver call: binding and
             specialising the arguments (its `binder`) and the kernel-cache key
  total      the two together: the host cost of a launch short of the CUDA driver call itself
             (a few microseconds more on a GPU machine)

Runs are alternated (launcher, triton, launcher, ...), repeated, and reported as medians with
their range. Budget: total <= 20 us per layer. Writes JSON with --json.

Run:  python benchmarks/launch_bench.py [--calls 2000] [--repeats 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"  # the kernels must be JITFunctions, as on a GPU

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_isa import Recorder, fake_streams  # noqa: E402

SHAPES = {"q/o 4096x4096": (4096, 4096), "down 4096x14336": (4096, 14336), "lm_head 128256x4096": (128256, 4096)}
BATCHES = (1, 4, 16)
BUDGET_US = 20.0


def triton_binding(fn, launch: tuple):
    """A callable doing what JITFunction.run does per launch before the driver call, for the
    recorded launch (grid, args, kwargs): bind and specialise the arguments, build the cache key."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import compute_cache_key, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    _, grid, args, kwargs = launch
    cache: dict = {}

    def run():
        bound, specialization, options = binder(*args, **kwargs)
        key = compute_cache_key(cache, specialization, options)
        return key, grid

    return run


def per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls per timed run")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs of each kind, alternated")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from unweight.runtime.kernels import qtiles_matmul as qm

    rows, worst = [], 0.0
    print(f"{'shape':<22} {'batch':>5} {'launcher us':>16} {'triton us':>16} {'total us':>9}")
    for label, (n, k) in SHAPES.items():
        w = fake_streams(n, k)
        for m in BATCHES:
            x = torch.empty(m, k, dtype=torch.bfloat16)
            log: list = []
            saved = qm.qtiles_gemv_kernel, qm.qtiles_dot_kernel
            qm.qtiles_gemv_kernel, qm.qtiles_dot_kernel = (
                Recorder("qtiles_gemv_kernel", log),
                Recorder("qtiles_dot_kernel", log),
            )
            try:
                # one call records the launch that the triton part binds (the mode from the host, as
                # UnweightLinear's value holds it)
                qm.qtiles_linear(x, w)
                launch = log[-1]
                bind = triton_binding(dict(zip(("qtiles_gemv_kernel", "qtiles_dot_kernel"), saved))[launch[0]], launch)
                noop = {"qtiles_gemv_kernel": lambda *a, **kw: None, "qtiles_dot_kernel": lambda *a, **kw: None}

                class Noop:
                    def __getitem__(self, grid):
                        return noop[launch[0]]

                qm.qtiles_gemv_kernel = qm.qtiles_dot_kernel = Noop()
                ours, theirs = [], []
                for _ in range(args.repeats):
                    ours.append(per_call_us(lambda: qm.qtiles_linear(x, w), args.calls))
                    theirs.append(per_call_us(bind, args.calls))
            finally:
                qm.qtiles_gemv_kernel, qm.qtiles_dot_kernel = saved
            row = {
                "shape": label,
                "batch": m,
                "kernel": launch[0],
                "launcher_us": statistics.median(ours),
                "launcher_range": [min(ours), max(ours)],
                "triton_us": statistics.median(theirs),
                "triton_range": [min(theirs), max(theirs)],
            }
            row["total_us"] = row["launcher_us"] + row["triton_us"]
            worst = max(worst, row["total_us"])
            rows.append(row)
            print(
                f"{label:<22} {m:>5} {row['launcher_us']:>6.1f} ({min(ours):.1f}-{max(ours):.1f}) "
                f"{row['triton_us']:>6.1f} ({min(theirs):.1f}-{max(theirs):.1f}) {row['total_us']:>9.1f}",
                flush=True,
            )
    print(f"\nworst total {worst:.1f} us per layer (budget {BUDGET_US:.0f} us)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"budget_us": BUDGET_US, "rows": rows}, f, indent=1)
    return 0 if worst <= BUDGET_US else 1


if __name__ == "__main__":
    sys.exit(main())
