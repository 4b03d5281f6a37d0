"""The W4A16 GEMV on CUDA: y = x @ W^T for symmetric compressed-tensors INT4 weights whose codes are
held as stored, `PlainInt4Weight` (BF16 scales) or `Int4ScalesWeight` (scales coded as the `int4`
layout codes them), and the grouped variant that is a MoE layer's decode step. One launch each, W
never materialised, one row of x.

`int4_gemv_kernel`, on CUDA cores: one program takes BLOCK_N rows of W and walks all of K, one group
of GROUP columns per thread per step (GROUPS groups a step), so each x value loaded serves BLOCK_N
rows. A group's words come in one vector load, x's eight columns of a word in another. Nibble j of
a word, masked in place by one `lop3` (j < 5; the other three after one shift of the word), is the
fp32 2^23 + n 16^j, and one FADD takes away 2^23 + 8 16^j: (n - 8) 16^j exactly; one FFMA
multiplies it by x. The five powers' sums stay apart, are scaled back at the end of the group and
then by its scale: about 3 instructions a weight, 3.8-4.2 with the loads (benchmarks/kernel_isa.py).
The walk's tensors put the groups' axis where the Triton at hand lays its threads (`on_groups`).

A coded scale is a mantissa byte and a bit of the exponent code: one byte permute of the row's
exponents (base, base + 1, base + 2, 0) turns the code into the exponent, so a scale the window
does not code (negative, zero, or outside the row's three exponents: "listed") counts as 0 there.
After the walk, the program's listed scales (one range of `sesc`, their groups in `scol`) each add
their scale times their group's sum, one a thread: rare (none in Gaussian codes' scales, 0.86 % in
Student-t(5) ones'), and a pass about one step long a program where there are any.

Why the codes stay as stored on a GPU: at 4.3 TB/s an H200 streams about 4.2 thread-instructions a
weight at these 0.54 bytes, where decoding the `int4` layout's symbols and escapes costs about 7.5
(docs/kernels.md). Asymmetric codes are refused: their zero points took 4.6-4.8. The oracle in the
tests is a float64 product of the plainly decoded weights.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .interpreter import interpreted
from .pairs import MAX_PAIRS, check_pairs
from .weight import Int4ScalesWeight, PlainInt4Weight

GEMV_M = 1  # rows of x the GEMV takes: a second costs one FFMA a weight more, 5.3-5.6 in all (over budget)
GROUPS = 128  # groups a step: one a thread of four warps
MIN_PROGRAMS = 256  # about two an SM of an H200
_NO_GUARD = contextlib.nullcontext()
X_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
# the walk's axes (on_groups): measured with benchmarks/kernel_isa.py under 3.6 (the GPU machine's) and 3.9
GROUPS_FIRST = tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7)


@triton.jit
def scale_bits(smant_ptr, sexp_ptr, exps, grp, gi, nl, SW, live, ASM: tl.constexpr):
    """fp32 bits of the coded scales of groups `grp` (n * G + g of the program's rows n = nl, from
    the pointers' row), gi = g; `exps` holds each row's exponents base, base + 1, base + 2 and 0 in
    its bytes, so code 3 (a listed scale) decodes to +0.0: one byte permute picks the exponent."""
    m = tl.load(smant_ptr + grp, mask=live, other=0).to(tl.uint32)
    word = tl.load(sexp_ptr + nl * SW + gi // 32, mask=live, other=0).to(tl.uint32)
    code = (m >> 7) | (((word >> (gi % 32).to(tl.uint32)) & 1) << 1)
    if ASM:
        e = tl.inline_asm_elementwise(
            "prmt.b32 $0, $1, 0, $2;", "=r,r,r", [exps, code | 0x4440], dtype=tl.uint32, is_pure=True, pack=1
        )
    else:
        e = (exps >> (8 * code)) & 0xFF
    return (e << 23) | ((m & 0x7F) << 16)


@triton.jit
def nibble_f32(src, MASK: tl.constexpr, magic, ASM: tl.constexpr):
    """The fp32 whose bits are (src & MASK) | magic (magic 0x4B000000): with ASM one `lop3.b32`, the
    magic a register (else ptxas keeps each mask in one, and runs out); else its integer model."""
    if ASM:
        bits = tl.inline_asm_elementwise(
            f"lop3.b32 $0, $1, {MASK}, $2, 0xEA;", "=r,r,r", [src, magic], dtype=tl.uint32, is_pure=True, pack=1
        )
    else:
        bits = (src & MASK) | magic
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def x_f32(bits, X_KIND: tl.constexpr):
    """x's values from their bits (uint16, or uint32 after a sum): X_KIND 0 BF16, 1 FP16, 2 FP32."""
    if X_KIND == 0:
        return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    elif X_KIND == 1:
        return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return bits.to(tl.float32, bitcast=True)


@triton.jit
def on_groups(v, GF: tl.constexpr):
    """A (GROUPS,) vector as (1, GROUPS, 1) with GF, else (1, 1, GROUPS): the groups' axis of every
    tensor of the walk, where the threads go. Which of the two axes it must be depends on Triton:
    its pass that lays out loads takes the vector load of a group's words over rows first where the
    rows' axis comes first in its order, then moves x through shared memory for every weight. Triton
    3.9 puts the groups last (GF False), 3.6 first (GROUPS_FIRST)."""
    if GF:
        return v[None, :, None]
    else:
        return v[None, None, :]


@triton.jit
def on_rows(v, GF: tl.constexpr):
    """A (BLOCK_N,) vector on the rows' axis, the other one of on_groups'."""
    if GF:
        return v[None, None, :]
    else:
        return v[None, :, None]


@triton.jit
def _step(
    x_row,
    packed_ptr,
    scale_ptr,
    sexp_ptr,
    acc,
    exps,
    g0,
    nl,
    n_live,
    m_live,
    G,
    GROUP: tl.constexpr,
    GROUPS: tl.constexpr,
    SCALES: tl.constexpr,
    X_KIND: tl.constexpr,
    ASM: tl.constexpr,
    GF: tl.constexpr,
):
    """acc plus the products of the GROUPS groups from g0 (a listed scale counts as 0 here)."""
    gi = g0 + tl.arange(0, GROUPS)  # (GROUPS,)
    live = on_groups(gi < G, GF) & on_rows(n_live, GF)
    grp = on_groups(gi, GF) + on_rows(nl, GF) * G  # int32 offsets from the program's first row
    if SCALES == 0:  # BF16 bits as stored
        bits = tl.load(scale_ptr + grp, mask=live, other=0).to(tl.uint16).to(tl.uint32) << 16
    else:
        sw = (G + 31) // 32
        bits = scale_bits(scale_ptr, sexp_ptr, exps, grp, on_groups(gi, GF), on_rows(nl, GF), sw, live, ASM)
    x_live = m_live[:, None, None] & on_groups(gi < G, GF)
    part = _group_sums(x_row, packed_ptr, grp, on_groups(gi, GF), live, x_live, GROUP, X_KIND, ASM)
    return acc + part * bits.to(tl.float32, bitcast=True)


@triton.jit
def _group_sums(x_row, packed_ptr, grp, g, live, x_live, GROUP: tl.constexpr, X_KIND: tl.constexpr, ASM: tl.constexpr):
    """sum over the GROUP columns c of group g of (nibble - 8) x[c], for groups grp (int32 offsets
    n * G + g from packed_ptr's row, on_groups and on_rows; `live` where they are) of every row of x
    (x_live, BLOCK_M on groups, where it is): the group's words in one vector load, x's 8 columns of
    a word in another."""
    W: tl.constexpr = GROUP // 8  # words a group
    lane_w = tl.arange(0, W)[None, None, None, :]
    words = tl.load(packed_ptr + grp[:, :, :, None] * W + lane_w, mask=live[:, :, :, None], other=0)
    # nibble j of a word, masked in place (j < 5, or j - 5 of the word shifted right by 20), is the
    # fp32 2^23 + n 16^j: (n - 8) 16^j after one FADD; sums of the five powers apart, scaled at the end
    magic = tl.full(live.shape, 0x4B000000, tl.uint32)  # one register, for lop3's third operand
    lane8 = tl.arange(0, 8)[None, None, None, :]
    for q in tl.static_range(W):
        word = tl.sum(tl.where(lane_w == q, words, 0), axis=3)  # a register pick
        xw = tl.load(  # (BLOCK_M, 1 or ..., ..., 8): x's bits for the word's 8 columns, one vector load
            x_row[:, :, :, None] + (g * GROUP + 8 * q)[:, :, :, None] + lane8,
            mask=x_live[:, :, :, None],
            other=0,
        )
        for j in tl.static_range(8):
            if j < 5:
                src = word
            else:
                src = word >> 20
            v = nibble_f32(src, 15 << (4 * (j % 5)), magic, ASM) - (2**23 + 8 * 16 ** (j % 5))
            xv = x_f32(tl.sum(tl.where(lane8 == j, xw, 0), axis=3), X_KIND)  # a register pick
            if q == 0 and j < 5:  # the first product of each sum (no zeros to add to)
                if j == 0:
                    p0 = xv * v
                elif j == 1:
                    p1 = xv * v
                elif j == 2:
                    p2 = xv * v
                elif j == 3:
                    p3 = xv * v
                else:
                    p4 = xv * v
            elif j % 5 == 0:
                p0 += xv * v
            elif j % 5 == 1:
                p1 += xv * v
            elif j % 5 == 2:
                p2 += xv * v
            elif j % 5 == 3:
                p3 += xv * v
            else:
                p4 += xv * v
    return p0 + p1 * 0.0625 + p2 * 0.00390625 + p3 * 0.000244140625 + p4 * 0.0000152587890625


@triton.jit
def int4_gemv_kernel(
    # activations x (M, K) bf16, fp16 or fp32 with row stride; output y (M, N) with row stride
    x_ptr,
    y_ptr,
    M,
    stride_xm,
    stride_ym,
    # W (N, K): packed (N, K / 8) int32 words as stored; SCALES 0: scale_ptr (N, G) BF16 bits;
    # SCALES 1: scale_ptr the mantissa bytes (N, G), sexp (N, ceil(G / 32)) words, sbase (N,), and
    # the listed scales' bits sesc and groups scol, the row's from sesc_row (N + 1,)
    packed_ptr,
    scale_ptr,
    sexp_ptr,
    sbase_ptr,
    sesc_ptr,
    scol_ptr,
    sesc_row_ptr,
    N,
    K,
    G,
    ids_ptr,  # GROUPED only (else None): expert ids (P,), int32 or int64
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    GROUP: tl.constexpr,  # columns a scale covers, a multiple of 8
    SCALES: tl.constexpr,  # 0: BF16 (PlainInt4Weight); 1: coded (Int4ScalesWeight)
    # W is E stacked (N, K) experts, (E N, K), and program_id(1) is the pair p (BLOCK_M 1, M 1): it
    # multiplies x row p // X_DIV by expert ids[p], rows [ids[p] N, ids[p] N + N) of W, into y row p
    GROUPED: tl.constexpr,
    X_DIV: tl.constexpr,  # pairs a row of x (top-k; 1 unless GROUPED), a constant as in qtiles_gemv_kernel
    X_KIND: tl.constexpr,  # x's dtype (x_f32): 0 bf16, 1 fp16, 2 fp32
    ASM: tl.constexpr,  # inline PTX (a GPU); else its integer model (the interpreter)
    GF: tl.constexpr,  # the walk's tensors groups before rows (on_groups): GROUPS_FIRST
):
    pid = tl.program_id(0)
    nl = tl.arange(0, BLOCK_N)  # (BLOCK_N,) the program's rows, from its first
    rn = pid * BLOCK_N + nl  # rows of the (expert's) W: y's columns
    n_live = rn < N
    rn64 = tl.where(n_live, rn, 0).to(tl.int64)
    row0 = pid.to(tl.int64) * BLOCK_N  # the program's first row of W
    if GROUPED:
        pair = tl.program_id(1)
        expert0 = tl.load(ids_ptr + pair).to(tl.int64) * N  # ids trusted, as in qtiles_gemv_kernel
        wn64 = expert0 + rn64
        row0 += expert0
        x_ptr += (pair // X_DIV).to(tl.int64) * stride_xm
        y_ptr += pair.to(tl.int64) * stride_ym
    else:
        wn64 = rn64
    # the streams from the program's first row: the walk over K takes 32-bit offsets
    packed_ptr = packed_ptr.to(tl.pointer_type(tl.uint32)) + row0 * (K // 8)
    scale_ptr += row0 * G
    sexp_ptr += row0 * ((G + 31) // 32)
    rm = tl.arange(0, BLOCK_M)
    m_live = rm < M
    if X_KIND == 2:
        x_bits = x_ptr.to(tl.pointer_type(tl.uint32))
    else:
        x_bits = x_ptr.to(tl.pointer_type(tl.uint16))
    x_row = x_bits + rm.to(tl.int64)[:, None, None] * stride_xm  # (BLOCK_M, 1, 1): x's bits
    if SCALES == 1:  # each row's exponents base, base + 1, base + 2 and 0 (code 3: listed), a byte each
        exps = on_rows(tl.load(sbase_ptr + wn64).to(tl.uint32) * 0x010101 + 0x020100, GF)
    else:
        exps = 0
    if GF:
        acc = tl.zeros((BLOCK_M, GROUPS, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, GROUPS), dtype=tl.float32)
    for g0 in range(0, G, GROUPS):
        acc = _step(
            x_row, packed_ptr, scale_ptr, sexp_ptr, acc, exps, g0, nl, n_live, m_live, G, GROUP, GROUPS, SCALES,
            X_KIND, ASM, GF,
        )  # fmt: skip
    if SCALES == 1:  # the listed scales of the program's rows (one range of sesc): each adds its scale
        # times its group's sum to its row's sums, GROUPS at a time (one a thread, as the groups of a step)
        first = tl.load(sesc_row_ptr + row0)
        ends = tl.load(sesc_row_ptr + row0 + 1 + nl, mask=n_live, other=0x7FFFFFFF)  # each row's end (dead: none)
        last = tl.max(tl.where(n_live, ends, 0), axis=0)
        for e0 in tl.range(first, last, GROUPS, loop_unroll_factor=1):  # about one step a program
            ei = e0 + tl.arange(0, GROUPS)
            e_in = ei < last
            row = tl.sum((ei[None, :] >= ends[:, None]).to(tl.int32), axis=0)  # (GROUPS,) local row
            e_live = on_groups(e_in, GF)
            g = tl.load(scol_ptr + ei, mask=e_in, other=0)
            bits = tl.load(sesc_ptr + ei, mask=e_in, other=0).to(tl.uint16).to(tl.uint32) << 16
            part = _group_sums(x_row, packed_ptr, on_groups(row * G + g, GF), on_groups(g, GF), e_live,
                               m_live[:, None, None] & e_live, GROUP, X_KIND, ASM)  # fmt: skip
            fix = tl.where(e_live, part * on_groups(bits.to(tl.float32, bitcast=True), GF), 0.0)
            acc += tl.where(on_groups(row, GF) == on_rows(nl, GF), fix, 0.0)  # summed with the rest below
    out = tl.sum(acc, axis=1 if GF else 2)  # (BLOCK_M, BLOCK_N)
    y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn64[None, :]
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=m_live[:, None] & n_live[None, :])


def _block_n(n: int) -> int:
    """Rows of W a program takes: 16 (x loaded once for 16 rows: 3.8-4.1 instructions a weight, where 8
    rows took 3.9-4.3), fewer where that leaves fewer than MIN_PROGRAMS programs."""
    block_n = 16
    while block_n > 2 and -(-n // block_n) < MIN_PROGRAMS:
        block_n //= 2
    return block_n


def kernel_args(w: PlainInt4Weight | Int4ScalesWeight) -> tuple:
    """The weight's streams in the kernel's order, and its SCALES."""
    if isinstance(w, Int4ScalesWeight):
        return (w.packed, w.smant, w.sexp, w.sbase, w.sesc, w.scol, w.sesc_row), 1
    if isinstance(w, PlainInt4Weight):
        return (w.packed, w.scales, w.packed, w.packed, w.packed, w.packed, w.packed), 0
    raise TypeError(f"the INT4 GEMV takes a PlainInt4Weight or an Int4ScalesWeight, not {type(w).__name__}")


def _check(x: torch.Tensor, w) -> None:
    kernel_args(w)
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bfloat16, float16 or float32, not {x.dtype}")
    if not w.symmetric:
        raise ValueError(
            "the INT4 GEMV takes symmetric codes: with zero points it would spend 4.6-4.8 instructions a weight, "
            "past the 4.2 an H200's bandwidth leaves (docs/kernels.md)"
        )
    if w.group % 8:
        raise ValueError(f"the INT4 GEMV takes groups of a multiple of 8 columns, not {w.group}")
    if w.device != x.device:
        raise ValueError(f"weight streams are on {w.device}, x on {x.device}")
    if x.shape[-1] != w.cols:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {w.cols}")


def _launch(x2, y, m, w, n, ids, x_div: int) -> None:
    """One launch over n rows of W (an expert's, with ids: a grid row of programs a pair)."""
    streams, scales = kernel_args(w)
    block_n = _block_n(n)
    grid = (-(-n // block_n),) if ids is None else (-(-n // block_n), ids.shape[0])
    with torch.cuda.device(x2.device) if x2.device.type == "cuda" else _NO_GUARD:
        int4_gemv_kernel[grid](
            x2,
            y,
            m,
            x2.stride(0),
            y.stride(0),
            *streams,
            n,
            w.cols,
            w.cols // w.group,
            ids,
            BLOCK_M=max(m, 1),
            BLOCK_N=block_n,
            GROUPS=GROUPS,
            GROUP=w.group,
            SCALES=scales,
            GROUPED=ids is not None,
            X_DIV=x_div,
            X_KIND=X_KINDS[x2.dtype],
            ASM=not interpreted(),
            GF=GROUPS_FIRST,
        )


def int4_linear(x: torch.Tensor, w: PlainInt4Weight | Int4ScalesWeight, out_dtype: torch.dtype | None = None):
    """y = x @ W^T for W (w.rows, w.cols): `x` (..., w.cols) with at most GEMV_M rows, on the device
    of w's streams; returns (..., w.rows) in `out_dtype` (default x's), accumulated in fp32. One
    launch; never synchronises."""
    _check(x, w)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m > GEMV_M:
        raise ValueError(f"the INT4 GEMV takes at most {GEMV_M} rows of x, not {m}")
    y = torch.empty((m, w.rows), dtype=out_dtype or x.dtype, device=x.device)
    if m:
        _launch(x2, y, m, w, w.rows, None, 1)
    return y.reshape(*lead, w.rows)


def int4_experts_linear(
    x: torch.Tensor,
    w: PlainInt4Weight | Int4ScalesWeight,
    ids: torch.Tensor,
    out_features: int,
    x_div: int = 1,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y (P, out_features): y[p] = x[p // x_div] @ W_e^T with e = ids[p], W_e rows [e out_features,
    (e + 1) out_features) of the stacked W in w, as qtiles_experts_linear (its contract on ids and
    chunks of MAX_PAIRS pairs): `x` (T, w.cols), `ids` P = T x_div int32 or int64 ids on x's device."""
    _check(x, w)
    if x.dim() != 2:
        raise ValueError(f"x must be (tokens, {w.cols}), not {tuple(x.shape)}")
    check_pairs(x, ids, x_div)
    if out_features < 1 or w.rows % out_features:
        raise ValueError(f"a {w.rows}-row weight does not stack experts of {out_features} rows")
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    ids = ids.contiguous()
    pairs = ids.shape[0]
    y = torch.empty((pairs, out_features), dtype=out_dtype or x.dtype, device=x.device)
    chunk = MAX_PAIRS // x_div * x_div
    for p0 in range(0, pairs, chunk):
        _launch(x2[p0 // x_div :], y[p0:], 1, w, out_features, ids[p0 : p0 + chunk], x_div)
    return y
