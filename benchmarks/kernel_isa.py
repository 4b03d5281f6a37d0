"""What the GPU kernels compile to, on a machine without a GPU: the instruction budget, checked.

The triton wheel bundles ptxas (sm_80: CUDA 12.9; sm_90a: 13.4) and cuobjdump, so
`triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))` runs down to a cubin with no
driver. For every launch that the runtime's launchers make on Llama-3.1-8B shapes (and the
grouped GEMV, `qtiles_experts_linear`, on MoE expert shapes: Llama-4-Scout's and Kimi-K2's; and the
W4A16 GEMV, `int4_linear` and `int4_experts_linear`, on Kimi-K2's INT4 experts), this:

  1. records it: the launchers run on CPU tensors (the weight streams are expanded one-element
     views, so they take no memory) with each `@triton.jit` kernel swapped for a recorder;
  2. specialises it as Triton's JIT does (its own binder: integers equal to 1 become constexprs,
     integers and pointers divisible by 16 get `tt.divisibility`), then compiles each distinct
     variant for sm_90a and sm_80 in a process pool;
  3. reads registers, spills and stack (ptxas -v), shared memory, resident programs per SM, the
     SASS of the main loop (the first loop of the kernel: the walk over K) and of the escape pass
     (its last loop), and tensor-core instructions (HMMA/HGMMA);
  4. checks the budget (sm_90a: BUDGETS below), the grid limits, and every value a kernel
     computes in 32 bits at the largest launch (a 131072-token embedding gather included).

Per weight means thread-instructions per weight that the program streams: the loop's SASS
count times the program's threads over the weights of one iteration. The escape pass is
estimated at ESCAPE_RATE listed escapes per weight (MiniLM's 2-D weights list 1.39 % in mode 0).

Exit status 1 on a compile error, a spill, zero occupancy, a grid or int32 overflow, or a main
loop over its budget. Writes the table and, with --json, the same as JSON.

Run:  python benchmarks/kernel_isa.py [--quick] [--targets 90,80] [--shapes q/o,down] [--batches 1,2] [--json PATH]
      [--keep-asm DIR] [--max-per-weight 8]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

if __name__ == "__main__":  # before the kernels are defined: they must be JITFunctions, not interpreted
    os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402

TARGETS = {  # cc -> (name, SMs, shared memory per SM, per block, registers per SM, warps per SM)
    90: ("H200 (sm_90a)", 132, 228 * 1024, 227 * 1024, 65536, 64),
    80: ("A100 (sm_80)", 108, 164 * 1024, 163 * 1024, 65536, 64),
}
MODULES = {
    "qtiles_gemv_kernel": "unweight.runtime.kernels.qtiles_matmul",
    "qtiles_dot_kernel": "unweight.runtime.kernels.qtiles_matmul",
    "qtiles_decode_kernel": "unweight.runtime.kernels.qtiles_decode",
    "int4_gemv_kernel": "unweight.runtime.kernels.int4_matmul",
}
# Llama-3.1-8B (out_features, in_features); the runtime stacks q/k/v and gate/up (runtime/model/llama.py)
SHAPES = {
    "q/o 4096x4096": (4096, 4096),
    "k/v 1024x4096": (1024, 4096),
    "qkv 6144x4096": (6144, 4096),
    "gate/up 14336x4096": (14336, 4096),
    "gate_up 28672x4096": (28672, 4096),
    "down 4096x14336": (4096, 14336),
    "lm_head 128256x4096": (128256, 4096),
}
BATCHES = (1, 2, 4, 8, 12, 16, 32, 64, 256, 1024, 4096)
QUICK_SHAPES = ("q/o 4096x4096", "down 4096x14336")
# MoE experts stacked into one (E N, K) matrix, for qtiles_experts_linear: label -> (N, K, E, topk);
# w13 is gate and up stacked per expert (N = 2 intermediate), w2 the down projection
EXPERT_SHAPES = {
    "scout w13 16x16384x5120": (2 * 8192, 5120, 16, 1),  # Llama-4-Scout: top-1 of 16 experts
    "scout w2 16x5120x8192": (5120, 8192, 16, 1),
    "kimi w13 384x4096x7168": (2 * 2048, 7168, 384, 8),  # Kimi-K2: top-8 of 384
    "kimi w2 384x7168x2048": (7168, 2048, 384, 8),
}
# INT4 W4A16 (compressed-tensors, group 32): Kimi-K2's routed experts, stacked as above, for the grouped
# GEMV (int4_experts_linear), and one expert's gate/up matrix for the dense one (int4_linear)
INT4_EXPERT_SHAPES = {k: v for k, v in EXPERT_SHAPES.items() if k.startswith("kimi")}
INT4_SHAPES = {"kimi expert w13 4096x7168": (4096, 7168)}
INT4_GROUP = 32
INT4_LISTED_RATE = 0.0086  # scales the int4 layout lists, of Student-t(5) absmax codes (Kimi-shaped, group 32)
INT4_K_STEPS = 7168 / (128 * 32)  # steps over K of a Kimi gate/up row (7168 columns): the listed pass's share
QUICK_EXPERT_SHAPES = ("scout w13 16x16384x5120", "kimi w13 384x4096x7168")  # X_DIV 1 and 8
EXPERT_TOKENS = (1, 2)  # decode steps of 1 and 2 tokens: P = tokens * topk pairs
QUICK_BATCHES = (1, 2, 4, 8, 16, 32)
GATHER_TOKENS = (1, 64, 131072)  # embedding lookups; 131072: a whole Llama-3.1 context in one prefill
ESCAPE_RATE = 0.015
INT32_MAX = 2**31 - 1
# sm_90a main-loop budgets (instructions and global loads per weight; warps per SM), from the
# bandwidth budget of ../shared/tools/README.md: ~11 issue slots per weight at 4.3 TB/s
BUDGETS = {
    "gemv m=1": {"per_w": 10.0, "ldg_per_w": 0.5, "warps": 16},
    "gemv": {"per_w": 16.0},
    "dot m<=32": {"per_w": 16.0},
    "decode": {"per_w": 16.0},
    # INT4 at 0.537 bytes a weight (4-bit codes, Kimi-shaped scales coded to 0.59 of BF16): 7.78 issue
    # slots a byte at 4.3 TB/s (132 SMs x 1.98 GHz x 128 lanes / 4.3e12) give 4.2 a weight
    "int4 m=1": {"per_w": 4.2},
}


# ---------------------------------------------------------------------------------------------
# 1. recording the launches


class Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` records instead of launching."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            g = tuple(int(v) for v in grid)
            self.log.append((self.name, g + (1,) * (3 - len(g)), args, kwargs))

        return launch


def fake_streams(rows: int, cols: int, mode: int = 0):
    """A resident-layout weight (runtime.qtiles, as a QTilesWeight) whose streams have the right
    dtypes and lengths, taking no memory."""
    from unweight.runtime.kernels.weight import QTilesWeight

    g = -(-cols // 32)
    n_esc = int(rows * cols * ESCAPE_RATE)
    one = lambda dt: torch.zeros(1, dtype=dt)  # noqa: E731
    return QTilesWeight(
        sm=one(torch.uint8).expand(rows * g * 32),
        codes=one(torch.uint8).expand(rows * g * 12),
        base=one(torch.uint8).expand(rows),
        esc_row=one(torch.int32).expand(rows + 1),
        esc_col=one(torch.uint16 if cols <= 1 << 16 else torch.int32).expand(max(1, n_esc)),
        esc_exp=one(torch.uint8).expand(max(1, n_esc)),
        rows=rows,
        cols=cols,
        mode=mode,
    )


def fake_int4(rows: int, cols: int, scales: int, group: int = INT4_GROUP):
    """A symmetric PlainInt4Weight (scales 0) or Int4ScalesWeight (1) of the right dtypes and lengths,
    taking no memory."""
    from unweight.runtime.kernels.weight import Int4ScalesWeight, PlainInt4Weight

    g = cols // group
    one = lambda dt: torch.zeros(1, dtype=dt)  # noqa: E731
    packed, zero = one(torch.int32).expand(rows * cols // 8), one(torch.uint8).expand(0)
    if scales == 0:
        return PlainInt4Weight(packed, one(torch.int16).expand(rows * g), zero, rows, cols, group)
    return Int4ScalesWeight(
        packed,
        one(torch.uint8).expand(rows * g),
        one(torch.int32).expand(rows * -(-g // 32)),
        one(torch.uint8).expand(rows),
        one(torch.int16).expand(1),
        one(torch.int32).expand(1),
        one(torch.int32).expand(rows + 1),
        zero,
        rows,
        cols,
        group,
    )


def record_launches(
    shapes: dict[str, tuple[int, int]],
    batches: tuple[int, ...],
    gathers: tuple[int, ...],
    modes: tuple[int, ...] = (0, 1),
    experts: dict[str, tuple[int, int, int, int]] | None = None,
    int4_shapes: dict[str, tuple[int, int]] | None = None,
    int4_experts: dict[str, tuple[int, int, int, int]] | None = None,
) -> list[dict]:
    """Every launch the runtime's CUDA pipelines make on the shapes, in each qtiles mode: `fused`
    for the batches it takes (runtime.linear.UnweightLinear), `decode_matmul`'s decode, embedding
    gathers, and the grouped GEMV on the `experts` shapes (EXPERT_SHAPES' form) for EXPERT_TOKENS
    tokens (int64 ids with top-1, int32 ones, as vLLM's router gives them, with top-k); and the INT4
    GEMV, plain and coded scales, on `int4_shapes` (its batches) and `int4_experts`."""
    from unweight.runtime.kernels import int4_matmul as i4
    from unweight.runtime.kernels import qtiles_decode as qd
    from unweight.runtime.kernels import qtiles_matmul as qm

    log: list = []
    saved = {name: getattr(sys.modules[mod], name) for name, mod in MODULES.items()}
    for name, mod in MODULES.items():
        setattr(sys.modules[mod], name, Recorder(name, log))
    cases = []
    try:
        for mode in modes:
            tag = "" if mode == 0 else " mode=1"
            for label, (n, k) in shapes.items():
                w = fake_streams(n, k, mode)
                for m in batches:
                    if m <= qm.MAX_M:
                        qm.qtiles_linear(torch.empty(m, k, dtype=torch.bfloat16), w)
                        cases.append(f"fused {label} m={m}{tag}")
                qd.qtiles_decode(w)
                cases.append(f"decode {label}{tag}")
            emb = fake_streams(128256, 4096, mode)
            for t in gathers:
                qd.qtiles_decode(emb, torch.zeros(t, dtype=torch.int64))
                cases.append(f"embed-gather 128256x4096 ids={t}{tag}")
            for label, (n, k, e, topk) in (experts or {}).items():
                w = fake_streams(e * n, k, mode)
                for t in EXPERT_TOKENS:
                    ids = torch.zeros(t * topk, dtype=torch.int64 if topk == 1 else torch.int32)
                    qm.qtiles_experts_linear(torch.empty(t, k, dtype=torch.bfloat16), w, ids, n, topk)
                    cases.append(f"experts {label} pairs={t * topk}{tag}")
        for scales, tag in ((0, " int4"), (1, " int4 coded scales")):
            for label, (n, k) in (int4_shapes or {}).items():
                w = fake_int4(n, k, scales)
                for m in batches:
                    if m <= i4.GEMV_M:
                        i4.int4_linear(torch.empty(m, k, dtype=torch.bfloat16), w)
                        cases.append(f"int4 {label} m={m}{tag}")
            for label, (n, k, e, topk) in (int4_experts or {}).items():
                w = fake_int4(e * n, k, scales)
                for t in EXPERT_TOKENS:
                    ids = torch.zeros(t * topk, dtype=torch.int32)
                    i4.int4_experts_linear(torch.empty(t, k, dtype=torch.bfloat16), w, ids, n, topk)
                    cases.append(f"int4 experts {label} pairs={t * topk}{tag}")
    finally:
        for name, mod in MODULES.items():
            setattr(sys.modules[mod], name, saved[name])
    assert len(log) == len(cases), (len(log), len(cases))
    return [
        {"case": c, "kernel": name, "grid": grid, "args": args, "kwargs": kwargs}
        for c, (name, grid, args, kwargs) in zip(cases, log)
    ]


# ---------------------------------------------------------------------------------------------
# 2. specialising as the JIT does


def kernel_fn(name: str):
    import importlib

    return getattr(importlib.import_module(MODULES[name]), name)


def specialise(name: str, args, kwargs, cc: int):
    """(signature, constexprs, attrs, options, bound arguments) as JITFunction.run builds them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = kernel_fn(name)
    backend = make_backend(GPUTarget("cuda", cc, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or triton.knobs.runtime.debug
    kwargs["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
    if hasattr(triton.knobs.compilation, "fpsan_homomorphic_casts"):  # triton 3.9's run passes it; 3.6 has none
        kwargs["fpsan_homomorphic_casts"] = triton.knobs.compilation.fpsan_homomorphic_casts
    bound, spec, _ = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, None)
    return signature, constexprs, attrs, options.__dict__, dict(bound)


# ---------------------------------------------------------------------------------------------
# 3. compiling one variant (in a worker process) and reading the binary


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


PTXAS_REGS = re.compile(r"Used (\d+) registers")
PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
CLASSES = {
    "LDG": ("LDG", "LDGSTS"),
    "STG": ("STG",),
    "spill": ("LDL", "STL"),
    "shared": ("LDS", "STS", "LDSM", "STSM"),
    "shuffle": ("SHFL",),
    "atomic": ("ATOM", "RED"),
    "mma": ("HMMA", "HGMMA"),
    "fp32": ("FFMA", "FMUL", "FADD", "FSEL"),
    "barrier": ("BAR", "SYNCS"),
}


def loops(sass: str) -> tuple[list, list]:
    """(instructions as (address, opcode), loops as (start, end) sorted by start, outermost first)."""
    ins = []
    for line in sass.splitlines():
        m = SASS_LINE.search(line)
        if m:
            ins.append((int(m.group(1), 16), m.group(3), m.group(4)))
    spans = []
    for addr, op, rest in ins:
        t = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if t and int(t.group(1), 16) < addr:
            spans.append((int(t.group(1), 16), addr))
    outer = [s for s in spans if not any(o != s and o[0] <= s[0] and s[1] <= o[1] for o in spans)]
    return [(a, op) for a, op, _ in ins], sorted(outer)


def mix(ins, span) -> dict:
    body = [op for a, op in ins if span[0] <= a <= span[1]]
    counts = {k: sum(op.split(".")[0] in names for op in body) for k, names in CLASSES.items()}
    # byte loads: an escape entry loads two (its exponent and its sign+mantissa byte), so in an
    # escape loop they tell how many steps ptxas unrolled into one body
    return {"instrs": len(body), "byte_loads": sum(op.startswith("LDG.E.U8") for op in body), **counts}


def compile_variant(job: dict) -> dict:
    """Runs in a worker: compile, then inspect. Never raises; errors are returned."""
    try:
        return _compile_variant(job)
    except Exception as e:  # noqa: BLE001 - any failure is a finding to report
        return {"key": job["key"], "ok": False, "error": f"{type(e).__name__}: {e}"[:3000]}


def _compile_variant(job: dict) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    triton.knobs.nvidia.dump_ptxas_log = True  # make_cubin prints ptxas -v: captured below
    out = {"key": job["key"]}
    buf = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(buf):
            ck = triton.compile(
                ASTSource(kernel_fn(job["kernel"]), job["signature"], job["constexprs"], job["attrs"]),
                target=GPUTarget("cuda", job["cc"], 32),
                options=job["options"],
            )
    except Exception as e:  # noqa: BLE001 - a compile error is a finding
        return {**out, "ok": False, "error": f"{type(e).__name__}: {e}"[:3000]}
    out.update(ok=True, seconds=time.perf_counter() - t0, shared=ck.metadata.shared, num_warps=ck.metadata.num_warps)
    r, s = PTXAS_REGS.search(buf.getvalue()), PTXAS_SPILL.search(buf.getvalue())
    out["regs"] = int(r.group(1)) if r else None
    out["stack"], out["spill_st"], out["spill_ld"] = (int(s.group(i)) for i in (1, 2, 3)) if s else (None, None, None)
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(ck.asm["cubin"])
        res = subprocess.run(
            [_tool("cuobjdump"), "--dump-resource-usage", cubin], capture_output=True, text=True
        ).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+)", res)
        if m and out["regs"] is None:  # a cache hit skips ptxas: take the cubin's numbers
            out["regs"], out["stack"] = int(m.group(1)), int(m.group(2))
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
    ins, spans = loops(sass)
    out["loops"] = [mix(ins, sp) for sp in spans]
    out["ptx_wgmma"] = len(re.findall(r"\bwgmma\.mma_async", ck.asm["ptx"]))
    out["ptx_mma"] = len(re.findall(r"\bmma\.sync", ck.asm["ptx"]))
    if job.get("keep_asm"):
        os.makedirs(job["keep_asm"], exist_ok=True)
        stem = os.path.join(
            job["keep_asm"],
            re.sub(r"[^A-Za-z0-9=_.-]+", "_", job["label"]) + "-" + hashlib.sha1(job["key"].encode()).hexdigest()[:8],
        )
        for ext, text in (("ttgir", ck.asm["ttgir"]), ("ptx", ck.asm["ptx"]), ("sass", sass)):
            with open(f"{stem}.{ext}", "w") as f:
                f.write(text)
    return out


# ---------------------------------------------------------------------------------------------
# 4. per-weight figures, checks and the report


def occupancy(cc: int, regs: int, warps: int, shared: int) -> int:
    """Resident programs per SM, from registers (allocated per warp in units of 256), warps and
    shared memory (1 KiB reserved per block)."""
    _, _, smem_sm, _, regfile, max_warps = TARGETS[cc]
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    return min(32, regfile // (per_warp * warps), max_warps // warps, smem_sm // (shared + 1024) if shared else 32)


def per_weight(kernel: str, c: dict, threads: int, r: dict) -> dict:
    """Main-loop and escape-pass thread-instructions (and main-loop global loads) per weight."""
    main, esc = r["loops"][0], r["loops"][-1] if len(r["loops"]) > 1 else None
    if kernel == "int4_gemv_kernel":  # its loops: K, then (SCALES 1) one a row over its listed scales
        tile = c["BLOCK_N"] * c["GROUPS"] * c["GROUP"]
        out = {"per_w": main["instrs"] * threads / tile, "ldg_per_w": main["LDG"] * threads / tile, "mma": main["mma"]}
        if esc is not None:  # a program's listed scales, GROUPS a step: steps at INT4_LISTED_RATE
            weights = c["BLOCK_N"] * c["GROUPS"] * c["GROUP"] * INT4_K_STEPS
            steps = -(-round(INT4_LISTED_RATE * c["BLOCK_N"] * c["GROUPS"] * INT4_K_STEPS) // c["GROUPS"])
            out["esc_per_w"] = esc["instrs"] * threads * steps / weights
        return out
    tile = c["BLOCK_N"] * c["GROUPS"] * 32  # weights one iteration of the main loop streams
    out = {"per_w": main["instrs"] * threads / tile, "ldg_per_w": main["LDG"] * threads / tile, "mma": main["mma"]}
    if esc is not None:  # entries one step of the escape loop takes, and per thread
        entries = {
            "qtiles_gemv_kernel": c.get("ESC_BLOCK"),
            "qtiles_dot_kernel": c["BLOCK_N"],
            "qtiles_decode_kernel": c.get("ESC_BLOCK"),
        }[kernel]
        unrolled = max(1, round(esc["byte_loads"] / (2 * max(1, entries // threads))))
        out["esc_per_w"] = esc["instrs"] / unrolled * threads * ESCAPE_RATE / entries
    return out


def budget_key(kernel: str, c: dict) -> str | None:
    if kernel == "int4_gemv_kernel":
        return "int4 m=1"
    if kernel == "qtiles_gemv_kernel":  # the grouped GEMV (BLOCK_M 1) takes the batch-1 budget
        return "gemv m=1" if c.get("M") == 1 or c["BLOCK_M"] == 1 else "gemv"
    if kernel == "qtiles_dot_kernel":
        return "dot m<=32" if c["BLOCK_M"] <= 32 else None
    return "decode"


def int32_values(kernel: str, b: dict, grid: tuple) -> dict[str, int]:
    """The largest value of each quantity a kernel keeps in 32 bits (row and element offsets are
    64-bit in every kernel: they are not listed)."""
    m = b.get("M", 1)
    if kernel == "int4_gemv_kernel":
        return {
            "column GROUP G": b["GROUP"] * b["G"],
            "listed scale": b["sesc_ptr"].numel(),
            "row pid * BLOCK_N + i": grid[0] * b["BLOCK_N"],
        }
    vals = {"column 32 G": 32 * b["G"], "escape entry": b["esc_exp_ptr"].numel()}
    if kernel == "qtiles_decode_kernel":
        vals["output row pid * BLOCK_N + i"] = grid[0] * b["BLOCK_N"]
    else:
        vals["row pid * BLOCK_N + i"] = grid[-2 if kernel == "qtiles_dot_kernel" else 0] * b["BLOCK_N"]
        vals["x row pid_m * BLOCK_M + i"] = max(
            m, b["BLOCK_M"] * grid[0] if kernel == "qtiles_dot_kernel" else b["BLOCK_M"]
        )
    return vals


def check_launch(rec: dict) -> list[str]:
    g, probs = rec["grid"], []
    if g[0] > INT32_MAX or g[1] > 65535 or g[2] > 65535:
        probs.append(f"grid {g} exceeds CUDA's limits (x < 2^31, y and z <= 65535)")
    for what, v in int32_values(rec["kernel"], rec["bound"], g).items():
        if v > INT32_MAX:
            probs.append(f"{what} reaches {v}: overflows int32")
    return probs


def variant_label(kernel: str, c: dict) -> str:
    """'kind constexprs': the kind is the kernel's name, or `experts` for the grouped GEMV."""
    grouped = c.get("GROUPED") is True
    keys = ("BLOCK_M", "BLOCK_N", "GROUPS", "ESC_BLOCK", "GATHER", "EVEN_K", "MODE", "GROUP", "SCALES") + (
        ("X_DIV",) if grouped else ()
    )
    kind = kernel.removeprefix("qtiles_").removesuffix("_kernel")
    return (
        (("int4 experts" if kernel.startswith("int4") else "experts") if grouped else kind)
        + " "
        + " ".join(f"{k.replace('BLOCK_', 'B')}={c[k]}" for k in keys if k in c)
        + (" M=1" if c.get("M") == 1 else "")
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="90,80", help="compute capabilities, comma-separated (90, 80)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="two shapes, the fused batches, two gather sizes and two expert shapes (the tests' mode)",
    )
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None, help="write the rows as JSON here")
    ap.add_argument("--keep-asm", default=None, help="folder for the .ttgir, .ptx and .sass of every variant")
    ap.add_argument(
        "--cache-dir",
        default=None,
        help="Triton cache to reuse between runs (default: a fresh one, so ptxas -v always runs)",
    )
    ap.add_argument(
        "--max-per-weight",
        type=float,
        default=None,
        help="tighten every main-loop budget to this many instructions per weight (e.g. 8, the aim)",
    )
    ap.add_argument(
        "--shapes",
        default=None,
        help="comma-separated prefixes of the shape labels to take (default: all, or the quick ones)",
    )
    ap.add_argument(
        "--batches", default=None, help="comma-separated batch sizes (default: " + ",".join(map(str, BATCHES)) + ")"
    )
    args = ap.parse_args(argv)
    shapes = {k: SHAPES[k] for k in QUICK_SHAPES} if args.quick else SHAPES
    experts = {k: EXPERT_SHAPES[k] for k in QUICK_EXPERT_SHAPES} if args.quick else EXPERT_SHAPES
    if args.shapes:
        shapes = {k: v for k, v in SHAPES.items() if any(k.startswith(p) for p in args.shapes.split(","))}
        experts = {k: v for k, v in EXPERT_SHAPES.items() if any(k.startswith(p) for p in args.shapes.split(","))}
        if not shapes and not experts:
            ap.error(f"no shape label starts with any of {args.shapes!r}")
    batches = (
        tuple(int(b) for b in args.batches.split(",")) if args.batches else QUICK_BATCHES if args.quick else BATCHES
    )
    budgets = {
        k: {a: (min(v, args.max_per_weight) if a == "per_w" and args.max_per_weight else v) for a, v in b.items()}
        for k, b in BUDGETS.items()
    }
    t_start = time.perf_counter()
    tmp = tempfile.TemporaryDirectory()
    os.environ["TRITON_CACHE_DIR"] = args.cache_dir or tmp.name
    targets = [int(t) for t in args.targets.split(",")]
    if unknown := [t for t in targets if t not in TARGETS]:
        ap.error(f"unknown target {unknown[0]}: choose from {', '.join(map(str, TARGETS))}")
    print(f"triton {triton.__version__}, torch {torch.__version__}", flush=True)

    launches = record_launches(
        shapes,
        batches,
        GATHER_TOKENS[::2] if args.quick else GATHER_TOKENS,
        experts=experts,
        int4_shapes=INT4_SHAPES,
        int4_experts=INT4_EXPERT_SHAPES,
    )
    jobs, recs = {}, []
    for cc in targets:
        for launch in launches:
            sig, cexp, attrs, opts, bound = specialise(launch["kernel"], launch["args"], launch["kwargs"], cc)
            names = [p.name for p in kernel_fn(launch["kernel"]).params]
            rec = dict(launch, cc=cc, bound=bound, constexprs={names[k[0]]: v for k, v in cexp.items()})
            key = f"sm{cc}|{launch['kernel']}|" + json.dumps(
                [sig, sorted((str(k), v) for k, v in cexp.items()), sorted((str(k), v) for k, v in attrs.items())],
                default=str,
            )
            rec["key"] = key
            jobs.setdefault(
                key,
                {
                    "key": key,
                    "kernel": launch["kernel"],
                    "cc": cc,
                    "signature": sig,
                    "constexprs": cexp,
                    "attrs": attrs,
                    "options": opts,
                    "keep_asm": args.keep_asm,
                    "label": f"sm{cc} " + variant_label(launch["kernel"], rec["constexprs"]),
                },
            )
            recs.append(rec)
    print(
        f"{len(recs)} launches -> {len(jobs)} distinct variants; compiling with {args.jobs} processes ...", flush=True
    )
    with ProcessPoolExecutor(max_workers=args.jobs) as ex:
        results = {r["key"]: r for r in ex.map(compile_variant, jobs.values())}

    rows, failures = [], []
    for key, job in jobs.items():
        r, mine = results[key], [x for x in recs if x["key"] == key]
        c, cc = mine[0]["constexprs"], job["cc"]
        problems = sorted({p for x in mine for p in check_launch(x)})
        row = {"variant": job["label"], "cc": cc, "cases": [x["case"] for x in mine], **r}
        if r["ok"]:
            threads = 32 * r["num_warps"]
            row["programs_per_sm"] = occupancy(cc, r["regs"], r["num_warps"], r["shared"])
            row["warps_per_sm"] = row["programs_per_sm"] * r["num_warps"]
            row.update(per_weight(job["kernel"], c, threads, r))
            if (r["spill_st"] or 0) > 0 or (r["spill_st"] is None and (r["stack"] or 0) > 0):
                problems.append(
                    f"register spills: {r['spill_st']} B stores / {r['spill_ld']} B loads per thread (stack "
                    f"{r['stack']} B)"
                )
            if row["programs_per_sm"] == 0:
                problems.append("occupancy 0: cannot launch")
            budget = budgets.get(budget_key(job["kernel"], c)) if cc == 90 else None
            for what, limit in (budget or {}).items():
                got = row["warps_per_sm"] if what == "warps" else row[what]
                if (got < limit) if what == "warps" else (got > limit):
                    problems.append(f"{what} {got:.2f} misses the budget {limit}")
        else:
            problems.append("compile error: " + r["error"].splitlines()[0][:200])
        row["problems"] = problems
        if problems:
            failures.append((job["label"], problems))
        rows.append(row)

    rows.sort(key=lambda r: (r["cc"], r["variant"]))
    hdr = (
        f"{'variant':<52} {'regs':>4} {'spill':>5} {'smem':>6} {'warps/SM':>8} "
        f"{'SASS/w':>6} {'LDG/w':>5} {'esc/w':>5} {'mma':>3}  cases"
    )
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for r in rows:
        if r["ok"]:
            spill = r["spill_st"] if r["spill_st"] is not None else f"s{r['stack']}"
            esc = f"{r['esc_per_w']:>5.2f}" if "esc_per_w" in r else f"{'-':>5}"
            print(
                f"{r['variant']:<52} {r['regs']:>4} {spill:>5} {r['shared']:>6} {r['warps_per_sm']:>8} "
                f"{r['per_w']:>6.2f} {r['ldg_per_w']:>5.2f} {esc} {r['mma']:>3}  "
                + ", ".join(r["cases"][:3])
                + (f" (+{len(r['cases']) - 3})" if len(r["cases"]) > 3 else "")
            )
        else:
            print(f"{r['variant']:<52} compile error: {r['error'].splitlines()[0][:120]}")
    print(
        "\nSASS/w, LDG/w: main-loop thread-instructions and global loads per weight streamed; esc/w: the escape pass "
        "at "
        f"{ESCAPE_RATE:.1%} listed escapes (INT4: listed scales at {INT4_LISTED_RATE:.2%}); mma: tensor-core "
        "instructions per main-loop iteration; budgets (sm_90a): "
        + "; ".join(
            f"{k}: " + ", ".join(f"{a} {'>=' if a == 'warps' else '<='} {v}" for a, v in b.items())
            for k, b in budgets.items()
        )
    )
    if failures:
        print(f"\n{len(failures)} variant(s) with problems:")
        for label, probs in failures:
            print(f"  {label}: " + "; ".join(probs))
    else:
        print("\nall variants compile, none spills, every index fits, every main loop is within its budget")
    print(f"time {time.perf_counter() - t_start:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"triton": triton.__version__, "escape_rate": ESCAPE_RATE, "budgets": budgets, "rows": rows},
                f,
                indent=1,
                default=str,
            )
    tmp.cleanup()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
