"""The serving layout's CPU kernels on AVX-512 with VBMI, VBMI2 and GFNI: 64 weights at a time.

Where the CPU has them (`CHUNKS`: Intel Ice Lake and later, AMD Zen 4 and later), a chunk of eight
code groups (64 weights) becomes 64 BF16 values in two zmm registers with about a dozen vector
instructions, against 14 for each group of 8 in cpu_avx2's decoder, and meets x by vdpbf16ps
(BF16 x, AVX512_BF16: `CHUNK_DOT`) or by fp32 FMAs. This module holds the numba entries that
cpu_gemv.py calls (on the tensors' addresses) and what picks a kernel for the rows of x; the
kernels lie beside it, one concern a module:
  cpu_avx512_ir.py      the LLVM IR helpers they share (types, masks, a 16 x 16 transpose, stores);
  cpu_avx512_decode.py  the chunk decoder, its prefetches, and W's rows decoded to memory;
  cpu_avx512_layout.py  x's layouts: the chunk layout and the pairs layout of the 16-row passes;
  cpu_avx512_dot.py     the dot products of a pass with one to four rows of W;
  cpu_avx512_gemv.py    the GEMV passes (up to 16 rows of x) over W's columns in segments;
  cpu_avx512_block.py   the block GEMM: two or more passes of 16 rows, W's rows decoded once;
  cpu_avx512_gemm.py    the prompt GEMM from GEMM_ROWS rows of BF16 x on.
Where x has two or more passes of 16 rows (a prompt), eight rows of W are decoded once into L1 and
met by every pass (`_chunk_block`); from GEMM_ROWS rows on, W is decoded a slab at a time into the
pairs layout itself and x, read where it lies, broadcast into vdpbf16ps against 16 rows of W a
register (`_chunk_gemm`); fewer rows go through the passes (`_chunk_rows`).

numba keys its cache of each function on that function's own source file alone: after an edit to a
cpu_avx512_* module, clear numba's cache (its *.nbi and *.nbc files, in __pycache__ beside the
sources or under NUMBA_CACHE_DIR) so that the entries here compile again.

The portable kernels (cpu_reference.py) are the oracle, in the same tests as cpu_avx2's.
"""

from __future__ import annotations

from numba import carray, njit, prange

from unweight.codec import simd

from .cpu_avx2 import BF16_DOT, _f32_at, _i64_at, _streams_at, _u16_at, aligned_zeros_u16
from .cpu_avx512_block import _BLOCK_MIN, _chunk_block
from .cpu_avx512_decode import _chunk_bits_row
from .cpu_avx512_gemm import GEMM_ROWS, _chunk_gemm
from .cpu_avx512_gemv import _chunk_pairs, _chunk_pass, _chunk_sixteen, _padded_rows, _pass_rows
from .cpu_avx512_layout import _bf16_chunks, _f32_chunks, _fill_chunks, _no_pairs, _pairs

CHUNKS = simd.has("avx512bw", "avx512vbmi", "avx512vbmi2", "gfni")
CHUNK_DOT = CHUNKS and BF16_DOT  # ... and vdpbf16ps, for the GEMV of BF16 x


@njit(nogil=True, cache=True)
def _bf16_x(x):
    """x (M, K) BF16 bits as `_chunk_rows` reads them: (chunk layout, pairs layout). The passes of 16
    rows come first (`_pass_rows`) and read the pairs layout; the chunk layout spans every pass's
    rows but holds only those of the passes after them (none at all where they take every row)."""
    M, K = x.shape
    if M >= GEMM_ROWS:  # `_chunk_gemm` reads x as it lies
        return aligned_zeros_u16(0).reshape((0, 0, 64)), _pairs(x, 0)
    sixteens = 0
    while M > sixteens and _pass_rows(M - sixteens) == 16:
        sixteens += 16
    rest = M - sixteens
    if rest <= 0:
        return aligned_zeros_u16(0).reshape((0, 0, 64)), _pairs(x, sixteens)
    chunks = (K + 63) >> 6
    rows = sixteens + _padded_rows(rest)
    out = aligned_zeros_u16(chunks * rows * 64).reshape((chunks, rows, 64))
    _fill_chunks(x[sixteens:], out[:, sixteens:])
    return out, _pairs(x, sixteens)


@njit(nogil=True, cache=True)
def _chunk_rows(x, xt, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0):
    """y[:, n - c0] = x @ W[n] for n in [n0, n1) (K % 8 == 0) and the M rows of y, x in the chunk
    layout (chunks, rows, 64): the rows of x in passes of `_pass_rows` (of 8 and 4 rows, W's rows
    in pairs), whose rows past M x's layout holds (zeros, or other rows whose sums are not
    written). Passes of 16 take x from `xt` instead where it holds rows (BF16 x in the pairs
    layout, `_bf16_x`; all of them at once in `_chunk_block` where there are two or more); x then
    needs only the rows of the other passes. BF16 x of GEMM_ROWS rows or more goes to
    `_chunk_gemm` instead (`_bf16_rows`)."""
    M = y.shape[0]
    m0 = 0
    if xt.shape[0] >= _BLOCK_MIN:
        _chunk_block(xt, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0)
        m0 = 16 * xt.shape[0]
    while m0 < M:
        P = _pass_rows(M - m0)
        if P == 16 and xt.shape[0]:
            _chunk_sixteen(xt, m0, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0)
        elif P == 8 or P == 4:
            _chunk_pairs(x, m0, P, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0)
        else:
            _chunk_pass(x, m0, P, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0)
        m0 += P


@njit(nogil=True, cache=True, inline="always")
def _bf16_rows(xr, x, xt, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0):
    """y[:, n - c0] = x @ W[n] for n in [n0, n1), BF16 x (M, K) as it lies (`xr`) and as `_bf16_x`
    lays it out (`x`, `xt`): a prompt of GEMM_ROWS rows or more through `_chunk_gemm`, fewer
    through the passes of `_chunk_rows`."""
    if xr.shape[0] >= GEMM_ROWS:
        _chunk_gemm(xr, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0)
    else:
        _chunk_rows(x, xt, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0)


@njit(nogil=True, cache=True, parallel=True)
def _gemv_chunk_bf16_at(
    x_at, M, sm_at, codes_at, n_codes, esc_at, n_esc, index_at, n_index, N, K, bpr, base, r0, R, y_at, parts
):
    """y (M, R) = x @ W[r0 : r0 + R]^T for x (M, K) BF16 (K % 8 == 0) and W (N, K), through
    vdpbf16ps, its rows split into one range per thread; takes the tensors' addresses."""
    xr = carray(_u16_at(x_at), (M, K))
    x, xt = _bf16_x(xr)
    sm, codes, esc, esc_index = _streams_at(sm_at, N * K, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    y = carray(_f32_at(y_at), (M, R))
    for t in prange(parts):
        n0, n1 = r0 + R * t // parts, r0 + R * (t + 1) // parts
        _bf16_rows(xr, x, xt, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, r0)


@njit(nogil=True, cache=True, parallel=True)
def _gemv_chunk_bf16_to_bf16_at(
    x_at, M, sm_at, codes_at, n_codes, esc_at, n_esc, index_at, n_index, N, K, bpr, base, r0, R, y_at, parts
):
    """_gemv_chunk_bf16_at with y in BF16 (each fp32 sum rounded to nearest even): no pass over y
    to convert it after the call."""
    xr = carray(_u16_at(x_at), (M, K))
    x, xt = _bf16_x(xr)
    sm, codes, esc, esc_index = _streams_at(sm_at, N * K, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    y = carray(_u16_at(y_at), (M, R))
    for t in prange(parts):
        n0, n1 = r0 + R * t // parts, r0 + R * (t + 1) // parts
        _bf16_rows(xr, x, xt, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, r0)


@njit(nogil=True, cache=True)
def _gemv_chunk_bf16_one(
    x_at, M, sm_at, codes_at, n_codes, esc_at, n_esc, index_at, n_index, N, K, bpr, base, r0, R, y_at, parts
):
    """_gemv_chunk_bf16_at as one range on the calling thread (`parts` unused): a call of one part
    enters no parallel region, which costs about a microsecond even with one thread."""
    xr = carray(_u16_at(x_at), (M, K))
    x, xt = _bf16_x(xr)
    sm, codes, esc, esc_index = _streams_at(sm_at, N * K, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    _bf16_rows(xr, x, xt, sm, codes, esc, esc_index, K, bpr, base, carray(_f32_at(y_at), (M, R)), r0, r0 + R, r0)


@njit(nogil=True, cache=True)
def _gemv_chunk_bf16_to_bf16_one(
    x_at, M, sm_at, codes_at, n_codes, esc_at, n_esc, index_at, n_index, N, K, bpr, base, r0, R, y_at, parts
):
    """_gemv_chunk_bf16_to_bf16_at as one range on the calling thread (see _gemv_chunk_bf16_one)."""
    xr = carray(_u16_at(x_at), (M, K))
    x, xt = _bf16_x(xr)
    sm, codes, esc, esc_index = _streams_at(sm_at, N * K, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    _bf16_rows(xr, x, xt, sm, codes, esc, esc_index, K, bpr, base, carray(_u16_at(y_at), (M, R)), r0, r0 + R, r0)


@njit(nogil=True, cache=True, parallel=True)
def _gemv_chunk_f32_at(
    x_at, M, sm_at, codes_at, n_codes, esc_at, n_esc, index_at, n_index, N, K, bpr, base, r0, R, y_at, parts
):
    """_gemv_chunk_bf16_at for x (M, K) in fp32, by fp32 FMAs (AVX-512 without AVX512_BF16, or
    compute in fp32)."""
    x, xt = _f32_chunks(carray(_f32_at(x_at), (M, K)), _padded_rows(M)), _no_pairs()
    sm, codes, esc, esc_index = _streams_at(sm_at, N * K, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    y = carray(_f32_at(y_at), (M, R))
    for t in prange(parts):
        n0, n1 = r0 + R * t // parts, r0 + R * (t + 1) // parts
        _chunk_rows(x, xt, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, r0)


@njit(nogil=True, cache=True)
def _gemv_chunk_f32_one(
    x_at, M, sm_at, codes_at, n_codes, esc_at, n_esc, index_at, n_index, N, K, bpr, base, r0, R, y_at, parts
):
    """_gemv_chunk_f32_at as one range on the calling thread (see _gemv_chunk_bf16_one)."""
    x, xt = _f32_chunks(carray(_f32_at(x_at), (M, K)), _padded_rows(M)), _no_pairs()
    sm, codes, esc, esc_index = _streams_at(sm_at, N * K, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    _chunk_rows(x, xt, sm, codes, esc, esc_index, K, bpr, base, carray(_f32_at(y_at), (M, R)), r0, r0 + R, r0)


@njit(nogil=True, cache=True, inline="always")
def _grouped_task(x, sm, codes, esc, esc_index, K, bpr, base, starts, rows0, R, y, parts, task):
    """Task (g, t) of the experts of a MoE layer: y[s:e] = x[s:e] @ W[n0 : n1]^T for group g's rows
    [s, e) = [starts[g], starts[g + 1]) and part t of its W rows [rows0[g], rows0[g] + R), x in the
    chunk layout (holding 15 rows past the last group's). The caller's prange runs the tasks."""
    g, t = task // parts, task % parts
    s, e, r0 = starts[g], starts[g + 1], rows0[g]
    n0, n1 = r0 + R * t // parts, r0 + R * (t + 1) // parts
    _chunk_rows(x[:, s:e], _no_pairs(), sm, codes, esc, esc_index, K, bpr, base, y[s:e], n0, n1, r0)


@njit(nogil=True, cache=True, parallel=True)
def _gemv_grouped_chunk_f32_at(
    x_at, P, sm_at, codes_at, n_codes, esc_at, n_esc, index_at, n_index, N, K, bpr, base, starts, rows0, R, y_at, parts
):
    """cpu_avx2's _gemv_grouped_at (the experts of a MoE layer: rows [starts[g], starts[g + 1]) of x
    (P, K) fp32 times W[rows0[g] : rows0[g] + R]^T) on 64-weight chunks, by fp32 FMAs."""
    x = _f32_chunks(carray(_f32_at(x_at), (P, K)), P + 15)  # a group's last pass may read 15 rows past it
    sm, codes, esc, esc_index = _streams_at(sm_at, N * K, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    y = carray(_f32_at(y_at), (P, R))
    for task in prange(rows0.shape[0] * parts):
        _grouped_task(x, sm, codes, esc, esc_index, K, bpr, base, starts, rows0, R, y, parts, task)


@njit(nogil=True, cache=True, parallel=True)
def _gemv_grouped_chunk_bf16_at(
    x_at, P, sm_at, codes_at, n_codes, esc_at, n_esc, index_at, n_index, N, K, bpr, base, starts, rows0, R, y_at, parts
):
    """_gemv_grouped_chunk_f32_at for x (P, K) BF16, through vdpbf16ps (fp32 y)."""
    x = _bf16_chunks(carray(_u16_at(x_at), (P, K)), P + 15)
    sm, codes, esc, esc_index = _streams_at(sm_at, N * K, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    y = carray(_f32_at(y_at), (P, R))
    for task in prange(rows0.shape[0] * parts):
        _grouped_task(x, sm, codes, esc, esc_index, K, bpr, base, starts, rows0, R, y, parts, task)


@njit(nogil=True, cache=True, parallel=True)
def _rows_chunk_bf16_at(
    sm_at, n_sm, codes_at, n_codes, esc_at, n_esc, index_at, n_index, K, bpr, base, ids_at, R, out_at, parts
):
    """out[i] = row ids[i] of W as BF16 bit patterns (K % 8 == 0), on the tensors' addresses."""
    sm, codes, esc, esc_index = _streams_at(sm_at, n_sm, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    ids = carray(_i64_at(ids_at), (R,))
    out = carray(_u16_at(out_at), (R, K))
    G = K >> 3
    for t in prange(parts):
        for i in range(R * t // parts, R * (t + 1) // parts):
            n = ids[i]
            _chunk_bits_row(sm, n * K, codes, 3 * G * n, esc, esc_index[n * bpr], G, base, out, i)
