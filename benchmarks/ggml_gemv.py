"""llama.cpp's own BF16 matrix-vector product, timed as llama.cpp runs it: ggml's CPU backend (the
libggml that llama-cpp-python ships, built for this CPU), `ggml_mul_mat` of a BF16 weight (N x K)
by F32 activations (M x K), F32 out, the activations converted to BF16 inside as llama.cpp does
for every BF16 matmul of a decode step.

The libraries load in a child process of their own (they bring their own OpenMP runtime, beside
numba's and torch's): `Ggml(lib_dir, threads)` starts it; `prepare(label, n, k, copies, m)`
makes `copies` distinct random BF16 weights of one shape (their values do not change ggml's
work) and one graph of one `ggml_mul_mat` per copy; `time(label, m, graphs)` computes that
graph `graphs` times and returns the seconds of one product each time (the graph's time over
its nodes). A graph of nodes is how llama.cpp runs its step: one OpenMP region, a barrier
between nodes. With enough copies (above the L3 size) every product reads its weight from DRAM.

Used by cpu_gemv_bench.py (`--llamacpp`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import ctypes, json, sys, time
import numpy as np
from ctypes import c_bool, c_int, c_int64, c_size_t, c_void_p

lib, threads = sys.argv[1], int(sys.argv[2])
base = ctypes.CDLL(f"{lib}/libggml-base.so", mode=ctypes.RTLD_GLOBAL)
cpu = ctypes.CDLL(f"{lib}/libggml-cpu.so", mode=ctypes.RTLD_GLOBAL)
F32, BF16 = 0, 30  # enum ggml_type


class InitParams(ctypes.Structure):  # struct ggml_init_params
    _fields_ = [("mem_size", c_size_t), ("mem_buffer", c_void_p), ("no_alloc", c_bool)]


class CPlan(ctypes.Structure):  # struct ggml_cplan (ggml-cpu.h)
    _fields_ = [("work_size", c_size_t), ("work_data", c_void_p), ("n_threads", c_int), ("threadpool", c_void_p),
                ("abort_callback", c_void_p), ("abort_callback_data", c_void_p), ("use_ref", c_bool)]


def sig(f, res, *args):
    f.restype, f.argtypes = res, list(args)


sig(base.ggml_init, c_void_p, InitParams)
sig(base.ggml_free, None, c_void_p)
sig(base.ggml_new_tensor_2d, c_void_p, c_void_p, c_int, c_int64, c_int64)
sig(base.ggml_get_data, c_void_p, c_void_p)
sig(base.ggml_nbytes, c_size_t, c_void_p)
sig(base.ggml_mul_mat, c_void_p, c_void_p, c_void_p, c_void_p)
sig(base.ggml_new_graph_custom, c_void_p, c_void_p, c_size_t, c_bool)
sig(base.ggml_graph_overhead_custom, c_size_t, c_size_t, c_bool)
sig(base.ggml_tensor_overhead, c_size_t)
sig(base.ggml_build_forward_expand, None, c_void_p, c_void_p)
sig(cpu.ggml_graph_plan, CPlan, c_void_p, c_int, c_void_p)
sig(cpu.ggml_graph_compute, c_int, c_void_p, ctypes.POINTER(CPlan))

graphs = {}  # (label, m) -> (ctx, graph, plan, work, nodes)
rng = np.random.default_rng(0)
for line in sys.stdin:
    job = json.loads(line)
    if job["op"] == "prepare":
        n, k, copies, m = job["n"], job["k"], job["copies"], job["m"]
        size = copies * (n * k * 2 + n * m * 4) + k * m * 4 + (2 * copies + 1) * base.ggml_tensor_overhead()
        size += base.ggml_graph_overhead_custom(copies + 8, False) + (1 << 20)
        ctx = base.ggml_init(InitParams(size, None, False))
        if not ctx:
            raise SystemExit(f"ggml_init: no {size} bytes")
        x = base.ggml_new_tensor_2d(ctx, F32, k, m)
        np.ctypeslib.as_array(ctypes.cast(base.ggml_get_data(x), ctypes.POINTER(ctypes.c_float)), (m * k,))[:] = (
            rng.standard_normal(m * k, dtype=np.float32))
        g = base.ggml_new_graph_custom(ctx, copies + 8, False)
        for i in range(copies):
            w = base.ggml_new_tensor_2d(ctx, BF16, k, n)  # ne0 = K (a row), ne1 = N rows
            bits = ((rng.standard_normal(n * k, dtype=np.float32) * 0.02).view(np.uint32) >> 16).astype(np.uint16)
            data = ctypes.cast(base.ggml_get_data(w), ctypes.POINTER(ctypes.c_uint16))
            np.ctypeslib.as_array(data, (n * k,))[:] = bits
            y = base.ggml_mul_mat(ctx, w, x)  # (M, N) = x @ W^T
            base.ggml_build_forward_expand(g, y)
            if i == 0:
                first = (bits, y)
        plan = cpu.ggml_graph_plan(g, threads, None)
        work = np.zeros(max(plan.work_size, 1), dtype=np.uint8)
        plan.work_data = work.ctypes.data
        graphs[(job["label"], m)] = (ctx, g, plan, work, copies)
        # the first product against numpy's, x rounded to BF16 as ggml rounds it: within the fp32 sum's bound
        if cpu.ggml_graph_compute(g, ctypes.byref(plan)) != 0:
            raise SystemExit("ggml_graph_compute failed")
        xs = np.ctypeslib.as_array(ctypes.cast(base.ggml_get_data(x), ctypes.POINTER(ctypes.c_float)), (m, k))
        xb = ((xs.view(np.uint32) + 0x7FFF + ((xs.view(np.uint32) >> 16) & 1)) & 0xFFFF0000).view(np.float32)
        w0 = (first[0].astype(np.uint32) << 16).view(np.float32).reshape(n, k).astype(np.float64)
        ref = xb.astype(np.float64) @ w0.T
        got = np.ctypeslib.as_array(ctypes.cast(base.ggml_get_data(first[1]), ctypes.POINTER(ctypes.c_float)), (m, n))
        bound = k * 2.0**-23 * (np.abs(xb).astype(np.float64) @ np.abs(w0).T) + 1e-30
        err = np.abs(got - ref)
        print(json.dumps({"ok": bool(np.all(err <= bound)), "err": float((err / bound).max())}), flush=True)
    elif job["op"] == "time":
        ctx, g, plan, work, nodes = graphs[(job["label"], job["m"])]
        out = []
        for _ in range(job["graphs"]):
            t0 = time.perf_counter()
            if cpu.ggml_graph_compute(g, ctypes.byref(plan)) != 0:
                raise SystemExit("ggml_graph_compute failed")
            out.append((time.perf_counter() - t0) / nodes)
        print(json.dumps({"s": out}), flush=True)
    elif job["op"] == "free":
        for ctx, *_ in graphs.values():
            base.ggml_free(ctx)
        graphs.clear()
        print(json.dumps({"ok": True}), flush=True)
"""


class Ggml:
    """ggml's BF16 GEMV in a child process (see the module's docstring)."""

    def __init__(self, lib_dir: Path, threads: int):
        if not (lib_dir / "libggml-cpu.so").exists():
            raise SystemExit(f"{lib_dir}: no libggml-cpu.so (llama-cpp-python's lib folder)")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(lib_dir), str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def _ask(self, job: dict) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the ggml child stopped (exit {self.proc.wait()}) on {job['op']}")
        return json.loads(line)

    def prepare(self, label: str, n: int, k: int, copies: int, m: int) -> None:
        """Weights, activations and graph for (label, m); its first product checked against numpy."""
        r = self._ask({"op": "prepare", "label": label, "n": n, "k": k, "copies": copies, "m": m})
        if not r["ok"]:
            raise SystemExit(f"ggml's {label} product at M={m}: {r['err']:.2f}x the fp32 bound off numpy's")

    def time(self, label: str, m: int, graphs: int) -> list[float]:
        """Seconds per product, one figure per graph computed."""
        return self._ask({"op": "time", "label": label, "m": m, "graphs": graphs})["s"]

    def free(self) -> None:
        self._ask({"op": "free"})

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)

    def __enter__(self) -> Ggml:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
