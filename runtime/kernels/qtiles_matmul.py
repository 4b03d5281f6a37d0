"""Fused decode-and-multiply over the resident layout (qtiles.py): y = x @ W^T, W never
materialised, for the decode-time batches (M <= MAX_M rows of x). Two kernels, one launch each:

- `qtiles_gemv_kernel` (M <= GEMV_M), on CUDA cores: one program takes BLOCK_N rows of W and walks
  all of K, one group of 32 columns per thread per step, so each x value loaded serves BLOCK_N
  rows. A word of four weights decodes with about a dozen integer instructions (qtiles_common)
  and each weight costs one FFMA per row of x; partial sums stay in a (BLOCK_M, BLOCK_N, GROUPS)
  accumulator, reduced once after the loop. Its GROUPED variant (`qtiles_experts_linear`) is the
  MoE decode step: W holds E experts stacked, (E N, K), and program_id(1) is a (token, expert)
  pair, which multiplies its x row by the N rows of the expert whose id it reads on the device.
- `qtiles_dot_kernel` (GEMV_M < M <= MAX_M), on the tensor cores: (BLOCK_M, BLOCK_N) tiles of y,
  W decoded to BF16 a (BLOCK_N, 32 GROUPS) tile at a time for `tl.dot`, K split among programs
  when the tiles alone would leave SMs idle.

Both then add the listed escapes of their rows: each escaped weight was multiplied as its
exponent-0 stand-in w0 (|w0| < 2^-126), so it adds x * (w - w0), the difference rounded to fp32:
within 2^-24 of x * w, as the summation bound allows. The oracle in the tests is
`F.linear(x.float(), W.float())` with W from the numpy decoder.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import interpreter
from .pairs import MAX_PAIRS, check_pairs
from .qtiles_common import escape_delta, group_words, kernel_streams, pair_f32, quad_pairs, row_offsets
from .weight import QTilesWeight

GEMV_M = 2  # rows of x up to which the CUDA-core GEMV runs; beyond, the tensor-core kernel (at 3-4 rows
# the GEMV's FFMAs cost 14 instructions a weight, the 16-row tensor-core tile 11)
MAX_M = 32  # larger batches take decode + matmul (a 64-row tile costs 17-23 instructions a weight, and spills on sm_80)
MIN_PROGRAMS = 256  # about two per SM of an H200: fewer leave SMs without enough loads in flight
MAX_SPLITS = 8
_NO_GUARD = contextlib.nullcontext()
# Triton 3.9's interpreter multiplies bf16 tl.dot operands as their integer bit patterns, so under
# it the kernel feeds tl.dot fp32 operands; tests that patch the interpreter's dot set this True
# to run the bf16 operands that a GPU gets
INTERPRETER_BF16_DOT = False


@triton.jit
def qtiles_gemv_kernel(
    # activations x (M, K) bf16 with row stride; output y (M, N) with row stride
    x_ptr,
    y_ptr,
    M,
    stride_xm,
    stride_ym,
    # W (N, K) in the resident layout: sm (N, 32G) uint8, codes (N, G, 3) words, base (N,) uint8,
    # esc_row (N + 1,) int32, esc_col and esc_exp (one per listed escape)
    sm_ptr,
    codes_ptr,
    base_ptr,
    esc_row_ptr,
    esc_col_ptr,
    esc_exp_ptr,
    N,
    K,
    G,
    ids_ptr,  # GROUPED only (else None): expert ids (P,), int32 or int64
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    ESC_BLOCK: tl.constexpr,
    PRMT: tl.constexpr,  # byte permutes as inline PTX (a GPU); else their integer model (the interpreter)
    MODE: tl.constexpr,  # the matrix's mode (qtiles.py): 0, eight-exponent windows; 1, seven and a zero code
    # W is E stacked (N, K) experts, (E N, K), and program_id(1) is the pair p (BLOCK_M 1, M 1): it
    # multiplies x row p // X_DIV by expert ids[p], rows [ids[p] N, ids[p] N + N) of W, into y row p
    GROUPED: tl.constexpr,
    # pairs per row of x (top-k; 1 unless GROUPED): a constant, as a runtime divisor's integer
    # division took 8-22 more registers (sm_90a 88-102, against 80, down to 16 warps an SM)
    X_DIV: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) rows of the (expert's) W: y's columns
    n_live = rn < N
    rn64 = tl.where(n_live, rn, 0).to(tl.int64)
    if GROUPED:
        pair = tl.program_id(1)
        w_row0 = tl.load(ids_ptr + pair).to(tl.int64) * N  # the expert's first row of W (ids trusted)
        wn64 = w_row0 + rn64  # (BLOCK_N,) rows of W: a dead lane reads the expert's row 0
        x_ptr += (pair // X_DIV).to(tl.int64) * stride_xm
        y_ptr += pair.to(tl.int64) * stride_ym
    else:
        wn64 = rn64
    rm = tl.arange(0, BLOCK_M)  # (BLOCK_M,) rows of x
    m_live = rm < M
    x_row = x_ptr + rm.to(tl.int64)[:, None, None] * stride_xm  # (BLOCK_M, 1, 1)
    x_words = x_row.to(tl.pointer_type(tl.uint32))  # rows word-aligned and of even length (launcher)
    off = row_offsets(tl.load(base_ptr + wn64).to(tl.uint32), MODE)[None, :, None]  # (1, BLOCK_N, 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N, GROUPS), dtype=tl.float32)
    for g0 in range(0, G, GROUPS):
        gi = g0 + tl.arange(0, GROUPS)  # (GROUPS,) groups of this step
        live = n_live[None, :, None] & (gi < G)[None, None, :]  # (1, BLOCK_N, GROUPS)
        grp = wn64[None, :, None] * G + gi[None, None, :]  # group index in W
        words, a, b, c = group_words(sm_ptr, codes_ptr, grp, live)
        for q in tl.static_range(8):
            pairs = quad_pairs(a, b, c, tl.load(words + q, mask=live, other=0), off, q, PRMT, MODE)
            for p in tl.static_range(2):  # weights and x as bf16 pairs: lanes 2p, 2p + 1
                k = gi * 32 + 4 * q + 2 * p  # (GROUPS,) column of lane 2p
                xw = tl.load(
                    x_words + (k // 2)[None, None, :], mask=m_live[:, None, None] & (k < K)[None, None, :], other=0
                )
                acc += pair_f32(xw, 0) * pair_f32(pairs[p], 0)
                acc += pair_f32(xw, 1) * pair_f32(pairs[p], 1)
    out = tl.sum(acc, axis=2)  # (BLOCK_M, BLOCK_N)

    # escapes, one row at a time: ESC_BLOCK of the row's entries per step, one per thread, each
    # adding x * (w - w0); the row's sum crosses threads once
    row0 = pid * BLOCK_N
    for i in tl.static_range(BLOCK_N):
        if row0 + i < N:
            r = (row0 + i).to(tl.int64)
            if GROUPED:
                r += w_row0  # its row of W
            first = tl.load(esc_row_ptr + r)
            last = tl.load(esc_row_ptr + r + 1)
            row_base = tl.load(base_ptr + r).to(tl.uint32)
            fix = tl.zeros((BLOCK_M, ESC_BLOCK), dtype=tl.float32)
            for e0 in tl.range(first, last, ESC_BLOCK, loop_unroll_factor=1):  # about one step a row
                ei = e0 + tl.arange(0, ESC_BLOCK)  # (ESC_BLOCK,)
                e_live = ei < last
                col = tl.load(esc_col_ptr + ei, mask=e_live, other=0).to(tl.int64)
                exp = tl.load(esc_exp_ptr + ei, mask=e_live, other=0).to(tl.uint32)
                smb = tl.load(sm_ptr + r * (G * 32) + col, mask=e_live, other=0).to(tl.uint32)
                xe = tl.load(
                    x_row.reshape(BLOCK_M, 1) + col[None, :], mask=m_live[:, None] & e_live[None, :], other=0.0
                ).to(tl.float32)
                fix += xe * escape_delta(smb, exp, row_base, MODE)[None, :]  # (BLOCK_M, ESC_BLOCK)
            out += tl.where((tl.arange(0, BLOCK_N) == i)[None, :], tl.sum(fix, axis=1)[:, None], 0.0)
    y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn64[None, :]
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=m_live[:, None] & n_live[None, :])


@triton.jit
def _by_quad(t0, t1, t2, t3, t4, t5, t6, t7):
    """(..., 2, 2, 2) from eight per-quad tensors, flattening to quad 4a + 2b + c: each tl.join
    adds the innermost dimension, so quads 4 apart are joined first."""
    return tl.join(tl.join(tl.join(t0, t4), tl.join(t2, t6)), tl.join(tl.join(t1, t5), tl.join(t3, t7)))


@triton.jit
def qtiles_dot_kernel(
    # activations x (M, K) bf16 with row stride; output y (M, N) with row stride
    x_ptr,
    y_ptr,
    M,
    stride_xm,
    stride_ym,
    # W (N, K) in the resident layout, as for qtiles_gemv_kernel
    sm_ptr,
    codes_ptr,
    base_ptr,
    esc_row_ptr,
    esc_col_ptr,
    esc_exp_ptr,
    N,
    K,
    G,
    # split-K: program_id(2) of splits takes groups [pid_k * groups_per_split, ...) and every
    # splits-th escape of each row; partials (splits, M, N) fp32 in ws, tile counters (all 0
    # between calls). A runtime value, so that one variant serves every split count (Triton's
    # JIT still specialises splits == 1, the plain store)
    ws_ptr,
    count_ptr,
    groups_per_split,
    splits,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    PRMT: tl.constexpr,  # byte permutes as inline PTX (a GPU); else their integer model (the interpreter)
    MODE: tl.constexpr,  # the matrix's mode (qtiles.py): 0, eight-exponent windows; 1, seven and a zero code
    DOT_F32: tl.constexpr,  # feed tl.dot fp32 operands (the interpreter, whose bf16 dot is wrong) instead of bf16
):
    """y tile (BLOCK_M, BLOCK_N) on the tensor cores: each step decodes a (BLOCK_N, 32 GROUPS) W
    tile (its columns in the order the decode yields them; x is loaded in the same order). With
    splits > 1 the tile's last program to finish (a counter) adds the partials in split order, so
    the result does not depend on the schedule, and resets the counter: one launch, no memset."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_live = rm < M
    n_live = rn < N
    rm64 = tl.where(m_live, rm, 0).to(tl.int64)
    rn64 = tl.where(n_live, rn, 0).to(tl.int64)
    base = tl.load(base_ptr + rn64).to(tl.uint32)  # (BLOCK_N,)
    off = row_offsets(base, MODE)[:, None]  # (BLOCK_N, 1)
    x_rows = x_ptr + rm64[:, None] * stride_xm  # (BLOCK_M, 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    g_end = tl.minimum(G, (pid_k + 1) * groups_per_split)
    for g0 in range(pid_k * groups_per_split, g_end, GROUPS):
        gi = g0 + tl.arange(0, GROUPS)
        live = n_live[:, None] & (gi < g_end)[None, :]  # (BLOCK_N, GROUPS)
        grp = rn64[:, None] * G + gi[None, :]
        words, a, b, c = group_words(sm_ptr, codes_ptr, grp, live)
        a0, b0 = quad_pairs(a, b, c, tl.load(words + 0, mask=live, other=0), off, 0, PRMT, MODE)
        a1, b1 = quad_pairs(a, b, c, tl.load(words + 1, mask=live, other=0), off, 1, PRMT, MODE)
        a2, b2 = quad_pairs(a, b, c, tl.load(words + 2, mask=live, other=0), off, 2, PRMT, MODE)
        a3, b3 = quad_pairs(a, b, c, tl.load(words + 3, mask=live, other=0), off, 3, PRMT, MODE)
        a4, b4 = quad_pairs(a, b, c, tl.load(words + 4, mask=live, other=0), off, 4, PRMT, MODE)
        a5, b5 = quad_pairs(a, b, c, tl.load(words + 5, mask=live, other=0), off, 5, PRMT, MODE)
        a6, b6 = quad_pairs(a, b, c, tl.load(words + 6, mask=live, other=0), off, 6, PRMT, MODE)
        a7, b7 = quad_pairs(a, b, c, tl.load(words + 7, mask=live, other=0), off, 7, PRMT, MODE)
        # (BLOCK_N, GROUPS, quad 2x2x2, pair, half): flattens to column 32 g + 4 q + 2 pair + half
        pairs = tl.join(_by_quad(a0, a1, a2, a3, a4, a5, a6, a7), _by_quad(b0, b1, b2, b3, b4, b5, b6, b7))
        wt = tl.join((pairs & 0xFFFF).to(tl.uint16), (pairs >> 16).to(tl.uint16))
        wt = wt.reshape(BLOCK_N, GROUPS * 32).to(tl.bfloat16, bitcast=True)
        kt = g0 * 32 + tl.arange(0, GROUPS * 32)  # (32 GROUPS,) columns, in order
        xt = tl.load(x_rows + kt[None, :], mask=m_live[:, None] & (kt < tl.minimum(K, g_end * 32))[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)))
        else:
            acc += tl.dot(xt, tl.trans(wt))

    # escapes, row by row: step j adds the j-th listed escape of every row of the tile (rows with
    # fewer are masked), x * (w - w0) for each row of x: no row search, no one-hot
    first = tl.load(esc_row_ptr + rn64, mask=n_live, other=0)  # (BLOCK_N,)
    count = tl.load(esc_row_ptr + rn64 + 1, mask=n_live, other=0) - first
    fixes = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in tl.range(pid_k, tl.max(count), splits, loop_unroll_factor=1):
        e_live = j < count  # (BLOCK_N,)
        ei = first + j
        col = tl.load(esc_col_ptr + ei, mask=e_live, other=0).to(tl.int64)
        exp = tl.load(esc_exp_ptr + ei, mask=e_live, other=0).to(tl.uint32)
        smb = tl.load(sm_ptr + rn64 * (G * 32) + col, mask=e_live, other=0).to(tl.uint32)
        xe = tl.load(x_rows + col[None, :], mask=m_live[:, None] & e_live[None, :], other=0.0).to(
            tl.float32
        )  # (BLOCK_M, BLOCK_N)
        fixes += xe * escape_delta(smb, exp, base, MODE)[None, :]
    acc += fixes
    out_live = m_live[:, None] & n_live[None, :]
    y_ptrs = y_ptr + rm64[:, None] * stride_ym + rn64[None, :]
    if splits == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_live)
    else:
        part = rm64[:, None] * N + rn64[None, :]  # (BLOCK_M, BLOCK_N) offsets in one split's partials
        plane = M.to(tl.int64) * N
        tl.store(ws_ptr + pid_k * plane + part, acc, mask=out_live)
        tl.debug_barrier()  # every thread's partials, then one release-acquire on the tile's counter
        tile = pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == splits - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(splits):
                total += tl.load(ws_ptr + k * plane + part, mask=out_live, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_live)
            tl.store(count_ptr + tile, 0)  # ready for the next call


def _blocks(m: int, n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, GROUPS) of the GEMV for m <= GEMV_M rows of x. Each thread takes one
    group of 32 columns and BLOCK_N rows, so that x is loaded once for BLOCK_N rows (8: 80
    registers at batch 1, 24 resident warps). benchmarks/kernel_isa.py measured the instructions per weight
    of each choice (docs/kernels.md)."""
    block_n = 8
    while block_n > 2 and -(-n // block_n) < MIN_PROGRAMS:  # k/v (1024 rows): more, smaller programs
        block_n //= 2
    return m, block_n, 128


def _dot_blocks(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, GROUPS) of the tensor-core kernel for GEMV_M < m <= MAX_M."""
    return (16, 128, 2) if m <= 16 else (32, 64, 4)


_WORKSPACES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, floats: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's split-K partials (fp32) and tile counters (int32, zero: each call leaves them
    so), grown when a call needs more. One per device: calls on one stream run one at a time."""
    ws, counts = _WORKSPACES.get(device, (None, None))
    if ws is None or ws.numel() < max(floats, 1) or counts.numel() < max(counters, 1):
        ws = torch.empty(max(floats, 1, 0 if ws is None else ws.numel()), dtype=torch.float32, device=device)
        counts = torch.zeros(
            max(counters, 1, 0 if counts is None else counts.numel()), dtype=torch.int32, device=device
        )
        _WORKSPACES[device] = ws, counts
    return ws, counts


def qtiles_linear(
    x: torch.Tensor, w: QTilesWeight, out_dtype: torch.dtype | None = None, split_k: int | None = None
) -> torch.Tensor:
    """y = x @ W^T for W (out_features, in_features) = (w.rows, w.cols) in the resident layout, W
    never materialised.

    `x` is (..., in_features) BF16 with at most MAX_M rows, on the device of w's streams; returns
    (..., out_features) in `out_dtype` (default x's), accumulated in fp32. Launches one kernel on
    x's device and never synchronises.
    Above GEMV_M rows, `split_k` (default: enough splits for MIN_PROGRAMS programs) splits K among
    programs."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bfloat16, not {x.dtype}")
    out_features, in_features = w.rows, w.cols
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {in_features}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] <= GEMV_M and (in_features % 2 or x2.stride(0) % 2 or x2.data_ptr() % 4):
        # the GEMV reads x as 32-bit pairs: rows of even length (an odd one gets a zero column),
        # even stride, 4-byte aligned
        x2 = F.pad(x2, (0, in_features % 2))
    m = x2.shape[0]
    if m > MAX_M:
        raise ValueError(f"the fused kernels take at most {MAX_M} rows of x, not {m}")
    if w.device != x.device:
        raise ValueError(f"weight streams are on {w.device}, x on {x.device}")
    y = torch.empty((m, out_features), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, out_features)
    mode = w.mode
    g = -(-in_features // 32)
    args = (
        x2,
        y,
        m,
        x2.stride(0),
        y.stride(0),
        *kernel_streams(w),
        out_features,
        in_features,
        g,
    )
    interpreted = interpreter.interpreted()
    with torch.cuda.device(x.device) if x.device.type == "cuda" else _NO_GUARD:
        if m <= GEMV_M:
            block_m, block_n, groups = _blocks(m, out_features)
            qtiles_gemv_kernel[(-(-out_features // block_n),)](
                *args,
                None,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                GROUPS=groups,
                ESC_BLOCK=128,
                PRMT=not interpreted,
                MODE=mode,
                GROUPED=False,
                X_DIV=1,
            )
        else:
            block_m, block_n, groups = _dot_blocks(m)
            tiles_m, tiles_n = -(-m // block_m), -(-out_features // block_n)
            splits = (
                split_k
                if split_k is not None
                else max(1, min(MAX_SPLITS, -(-MIN_PROGRAMS // (tiles_m * tiles_n)), g // groups))
            )
            per_split = -(-g // (splits * groups)) * groups
            splits = -(-g // per_split)
            ws, counts = _workspace(
                x.device, splits * m * out_features if splits > 1 else 0, tiles_m * tiles_n if splits > 1 else 0
            )
            qtiles_dot_kernel[(tiles_m, tiles_n, splits)](
                *args,
                ws,
                counts,
                per_split,
                splits,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                GROUPS=groups,
                PRMT=not interpreted,
                MODE=mode,
                DOT_F32=interpreted and not INTERPRETER_BF16_DOT,
            )
    return y.reshape(*lead, out_features)


def qtiles_experts_linear(
    x: torch.Tensor,
    w: QTilesWeight,
    ids: torch.Tensor,
    out_features: int,
    x_div: int = 1,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y (P, out_features): y[p] = x[p // x_div] @ W_e^T with e = ids[p], W_e = rows [e*out_features,
    (e+1)*out_features) of the stacked W in w.

    `w` holds E experts' (out_features, in_features) weights stacked into one (E out_features,
    in_features = w.cols) matrix in the resident layout (runtime.qtiles: rows are independent, so
    expert e is a plain range of rows). `x` is (T, in_features) BF16 on the streams' device and `ids` a 1-D
    int32 or int64 tensor of P = T x_div expert ids there (e.g. a (T, topk) routing reshaped,
    x_div = topk). Returns y (P, out_features) in `out_dtype` (default x's), accumulated in fp32.

    One launch of the GEMV (its batch-1 variant, GROUPED), grid (cdiv(out_features, BLOCK_N), P):
    CUDA takes at most MAX_PAIRS on dimension 1, so more pairs take a launch per MAX_PAIRS // x_div
    rows of x (whole rows, P in all). Program (i, p) reads ids[p] on the device, so the call
    never synchronises and can be captured in a CUDA graph with ids changing between replays.
    x_div is compiled in (one variant per top-k: a runtime divisor cost registers, see the kernel). The
    ids are trusted: the caller guarantees 0 <= ids < E = w.rows / out_features (checking them
    here would wait for the device); an id outside it reads past the streams (garbage, or a fault)."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bfloat16, not {x.dtype}")
    in_features = w.cols
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be (tokens, {in_features}) to match the weight's features, not {tuple(x.shape)}")
    check_pairs(x, ids, x_div)
    if w.device != x.device or ids.device != x.device:
        raise ValueError(f"weight streams are on {w.device}, ids on {ids.device}, x on {x.device}")
    rows, g = w.rows, -(-in_features // 32)
    if out_features < 1 or rows % out_features:
        raise ValueError(
            f"the streams hold a {rows}-row matrix of {w.sm.numel() // max(rows, 1)} stored columns, not experts of "
            f"({out_features}, {in_features}) stacked"
        )
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    if in_features % 2 or x2.stride(0) % 2 or x2.data_ptr() % 4:
        x2 = F.pad(x2, (0, in_features % 2))  # 32-bit pair loads, as in qtiles_linear
    ids = ids.contiguous()
    pairs = ids.shape[0]
    y = torch.empty((pairs, out_features), dtype=out_dtype or x.dtype, device=x.device)
    if pairs == 0:
        return y
    mode = w.mode
    _, block_n, groups = _blocks(1, out_features)
    chunk = MAX_PAIRS // x_div * x_div  # whole rows of x per launch: chunk c0 starts at x row c0 // x_div
    interpreted = interpreter.interpreted()
    with torch.cuda.device(x.device) if x.device.type == "cuda" else _NO_GUARD:
        for p0 in range(0, pairs, chunk):
            n_pairs = min(chunk, pairs - p0)
            qtiles_gemv_kernel[(-(-out_features // block_n), n_pairs)](
                x2[p0 // x_div :],
                y[p0:],
                1,
                x2.stride(0),
                y.stride(0),
                *kernel_streams(w),
                out_features,
                in_features,
                g,
                ids[p0:],
                BLOCK_M=1,
                BLOCK_N=block_n,
                GROUPS=groups,
                ESC_BLOCK=128,
                PRMT=not interpreted,
                MODE=mode,
                GROUPED=True,
                X_DIV=x_div,
            )
    return y
