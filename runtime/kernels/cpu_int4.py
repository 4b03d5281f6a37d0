"""CPU kernels of INT4 weights (W4A16): y = x @ W.T with W's codes and scales decoded as the product
reads them, from the resident `int4` layout (int4.py, an `Int4Weight`), and the same product on
compressed-tensors' uncoded packed words (the baseline the layout is measured against).

For up to GEMV_ROWS rows of x each thread decodes a row's scales, then its codes 64 columns at a
time, multiplying each block with every row of x as it comes (W is never written). For more rows
of x the AVX-512 product works a tile of W at a time (rows by TILE_COLS columns), decoded once
into a small workspace and multiplied with each chunk of x's rows in registers, x cut to the same
tiles so that a chunk's tile stays in the L1:
- fp32 x (`_chunks_coded_avx512`): CHUNK_W rows of W decoded to fp32 (nibble - 8) * scale,
  `dense_chunk` keeping CHUNK rows' sums;
- BF16 x past GEMV_ROWS_BF16 rows where the CPU has AVX512_BF16 (`_chunks_bf16_coded_avx512`): 16
  rows of W decoded to nibble - 8 as BF16 pairs, interleaved so that one `vdpbf16ps` multiplies a
  broadcast pair of x with 16 rows of W, each 32 columns' sum then scaled by one FMA
  (`dense_rows_bf16`), in chunks of 4, 8 or 16 rows of x.
The portable product decodes BLOCK_ROWS rows of W at a time into an fp32 workspace for torch's
GEMM. Every weight comes out exact: (nibble - 8) * scale, a 4-bit integer times a BF16 scale, is
an fp32 value, and nibble - 8 a BF16 one.

Asymmetric codes (zero points) go through the same kernels, which count every weight as
(nibble - 8) * scale; then, for each row and group, (zero - 8) * scale (an exact fp32 value) times
the group's sum of x is subtracted (up to ZERO_FUSED_ROWS rows of x in one pass over the rows,
`_zero_terms`; above, those terms as a matrix and torch's GEMM), so y lies within the fp32 bound
of the two sums. The rows decoded for the portable GEMM and by `int4_rows_cpu` are corrected in
place instead (`_decoded_rows`): (nibble - 8) * scale - (zero - 8) * scale is (nibble - zero) *
scale exactly. A PlainInt4Weight (a weight the layout would not shrink, held as stored) takes the
uncoded kernels and the same terms.

The AVX-512 rows (cpu_int4_avx512.py) take the product where the CPU has them and W's shape fits
(`_fast`); the portable numba kernels here take the rest, and are the tests' oracle for them (the
plain reference of both is int4.decode_reference, dequantized and multiplied in float64).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange

from . import int4
from .cpu_int4_avx2 import FAST_PATH as AVX2_PATH
from .cpu_int4_avx2 import coded_rows_avx2
from .cpu_int4_avx512 import (
    BF16_PATH,
    CHUNK,
    CHUNKS_BF16,
    FAST_PATH,
    coded_dot,
    coded_pairs,
    coded_rows,
    dense_chunk,
    dense_rows_bf16,
    plain_dot,
    plain_pairs,
    plain_rows,
    row_scales,
    transpose_pairs,
)
from .weight import Int4Weight, PlainInt4Weight

GEMV_ROWS = 8  # rows of x up to which each row of W is multiplied with all of x as it is decoded;
# above, CHUNK rows of x at a time in registers (AVX-512) or decoded blocks and torch's GEMM (portable)
GEMV_ROWS_BF16 = 2  # ... for BF16 x where the CPU has AVX512_BF16 (the BF16 chunks are cheaper from 3 rows)
BLOCK_ROWS = 256  # rows of W decoded at a time for the GEMM
CHUNK_W = 32  # rows of W a thread takes through a column tile of the chunked product
TILE_COLS = 512  # columns of the chunked product's tiles
ZERO_FUSED_ROWS = 16  # rows of x up to which the zero points' terms are summed in one pass over the rows (then a GEMM)
TILE_BF16 = 512  # columns of the BF16 chunked product's tiles (16 rows of BF16 x and of W's pairs: 16 KiB each)
BLOCK = int4.BLOCK


def _values(w: Int4Weight) -> np.ndarray:
    """(32,) fp32, the two tables of the AVX-512 permute: nibble - 8 of w's short symbol s at s
    (0..6), of its long nibble i at _slot(i, payload_bits) (8..31)."""
    short, long = int4.lut_tables(w.lut, w.payload_bits)
    table = np.zeros(32, np.float32)
    table[: int4.SHORT] = short[: int4.SHORT].astype(np.float32) - 8
    for i in range(1 << w.payload_bits):
        table[_slot(i, w.payload_bits)] = np.float32(long[i]) - 8
    return table


@njit(cache=True, inline="always")
def _slot(index, pb):
    """Where the value of the long nibble `index` lies in the table: the escape symbol 7 with the
    index XORed in, past the short ones (the AVX-512 rows build it so, one masked XOR a plane)."""
    return (16 if pb == 4 else 8) + (7 ^ index)


@njit(cache=True, inline="always")
def _bf16(bits):
    return np.uint32((np.int64(bits) & 0xFFFF) << 16)


@njit(cache=True)
def _row_scales(r, G, smant, sexp, sbase, sesc, sesc_row, out):
    """Row r's G scales into out (fp32): every one from its window first (no branch, so the loop
    vectorizes), then the row's listed ones, if any, in order over the code-3 groups."""
    words = (G + 31) >> 5
    base = np.int64(sbase[r])
    raw = out.view(np.uint32)
    for g in range(G):
        m = np.int64(smant[r * G + g])
        code = (m >> 7) | (((np.int64(sexp[r * words + (g >> 5)]) >> (g & 31)) & 1) << 1)
        raw[g] = _bf16(((base + code) << 7) | (m & 0x7F))
    listed, end = np.int64(sesc_row[r]), np.int64(sesc_row[r + 1])
    g = 0
    while listed < end:
        m = np.int64(smant[r * G + g])
        if (m >> 7) & ((np.int64(sexp[r * words + (g >> 5)]) >> (g & 31)) & 1):
            raw[g] = _bf16(sesc[listed])
            listed += 1
        g += 1


@njit(cache=True, inline="always")
def _row_scales_avx512(r, G, smant, sexp, sbase, sesc, sesc_row, out):
    """_row_scales by the AVX-512 row_scales, then the listed ones."""
    words = (G + 31) >> 5
    row_scales(smant, sexp, r * G, r * words, G, np.int64(sbase[r]), out)
    listed, end = np.int64(sesc_row[r]), np.int64(sesc_row[r + 1])
    g = 0
    raw = out.view(np.uint32)
    while listed < end:
        if (np.int64(smant[r * G + g]) >> 7) & ((np.int64(sexp[r * words + (g >> 5)]) >> (g & 31)) & 1):
            raw[g] = _bf16(sesc[listed])
            listed += 1
        g += 1


@njit(cache=True)
def _block(sym, at, esc, e, pb, values, v):
    """The 64 values (nibble - 8) of the block whose planes are sym[at : at + 3] into v, its first
    escape being e; returns the next block's. Column by column: symbol s from the planes; an
    escape's index from the pb bits at pb * (e + escapes before it)."""
    p0, p1, p2 = np.int64(sym[at]), np.int64(sym[at + 1]), np.int64(sym[at + 2])
    for j in range(BLOCK):
        s = ((p0 >> j) & 1) | (((p1 >> j) & 1) << 1) | (((p2 >> j) & 1) << 2)
        if s == 7:
            bit = pb * e
            window = (np.int64(esc[bit >> 5]) & 0xFFFFFFFF) | (np.int64(esc[(bit >> 5) + 1]) << 32)
            index = (window >> (bit & 31)) & ((1 << pb) - 1)
            e += 1
            v[j] = values[_slot(index, pb)]
        else:
            v[j] = values[s]
    return e


@njit(cache=True)
def _row_weights(r, K, group, sym, esc, esc_row, pb, values, scales, out):
    """Row r's K weights, (nibble - 8) * scale, into out (fp32)."""
    B = (K + BLOCK - 1) // BLOCK
    e = np.int64(esc_row[r])
    v = np.empty(BLOCK, np.float32)
    for b in range(B):
        e = _block(sym, (r * B + b) * 3, esc, e, pb, values, v)
        c0 = b * BLOCK
        for j in range(min(BLOCK, K - c0)):
            out[c0 + j] = v[j] * scales[(c0 + j) // group]


@njit(cache=True)
def _plain_row(r, K, group, packed, scales16, out):
    """Row r of uncoded W: nibbles of its INT32 words times scales from their BF16 bits."""
    G, at = K // group, r * ((K + 7) >> 3)
    bits = np.empty(1, np.uint32)
    for g in range(G):
        bits[0] = _bf16(scales16[r * G + g])
        scale = bits.view(np.float32)[0]
        for c in range(g * group, (g + 1) * group):
            out[c] = np.float32(((np.int64(packed[at + (c >> 3)]) >> (4 * (c & 7))) & 15) - 8) * scale


@njit(cache=True, fastmath=True)
def _dot_rows(x, w, y, r):
    for m in range(x.shape[0]):
        acc = np.float32(0)
        for c in range(w.shape[0]):
            acc += x[m, c] * w[c]
        y[m, r] = acc


@njit(cache=True, parallel=True)
def _gemv_coded(x, r0, sym, esc, esc_row, smant, sexp, sbase, sesc, sesc_row, K, group, pb, values, y, parts):
    """y[:, i] = x @ W[r0 + i] for every column i of y."""
    R, G = y.shape[1], K // group
    for p in prange(parts):
        scales = np.empty(G, np.float32)
        w = np.empty(K, np.float32)
        for i in range(p * R // parts, (p + 1) * R // parts):
            _row_scales(r0 + i, G, smant, sexp, sbase, sesc, sesc_row, scales)
            _row_weights(r0 + i, K, group, sym, esc, esc_row, pb, values, scales, w)
            _dot_rows(x, w, y, i)


@njit(cache=True, parallel=True)
def _rows_coded(r0, sym, esc, esc_row, smant, sexp, sbase, sesc, sesc_row, K, group, pb, values, out):
    G = K // group
    for i in prange(out.shape[0]):
        scales = np.empty(G, np.float32)
        _row_scales(r0 + i, G, smant, sexp, sbase, sesc, sesc_row, scales)
        _row_weights(r0 + i, K, group, sym, esc, esc_row, pb, values, scales, out[i])


@njit(cache=True, inline="always")
def _zero_floats(zero, r, G, out):
    """out[g] = zero point of row r's group g - 8, as fp32 (out holds 2 * ceil(G / 2)): the first
    half of the row's groups from its bytes' low nibbles, the rest from the high ones."""
    half = (G + 1) >> 1
    row = zero[r * half : (r + 1) * half]
    for j in range(half):
        out[j] = np.float32(np.int32(row[j] & np.uint8(15))) - np.float32(8)
        out[half + j] = np.float32(np.int32(row[j] >> np.uint8(4))) - np.float32(8)


@njit(cache=True, inline="always")
def _subtract_terms(xg, scales, zf, y, i):
    """y[:, i] -= sum over g of scales[g] * zf[g] * xg[:, g]."""
    for m in range(xg.shape[0]):
        xm = xg[m]
        acc = np.float32(0)
        for g in range(scales.shape[0]):
            acc += scales[g] * zf[g] * xm[g]
        y[m, i] -= acc


# the zero points' sums over a row's groups may be reordered (vectorized): no flag that assumes no NaN or inf
REORDER = {"reassoc", "contract"}


@njit(cache=True, parallel=True, fastmath=REORDER)
def _zero_terms(xg, r0, smant, sexp, sbase, sesc, sesc_row, zero, y, parts):
    """y[:, i] -= sum over g of (zero - 8) * scale of row r0 + i's group g times xg[:, g] (x summed
    over group g): the symmetric product of asymmetric codes made theirs."""
    R, G = y.shape[1], xg.shape[1]
    for p in prange(parts):
        scales, zf = np.empty(G, np.float32), np.empty(G + 1, np.float32)
        for i in range(p * R // parts, (p + 1) * R // parts):
            _row_scales(r0 + i, G, smant, sexp, sbase, sesc, sesc_row, scales)
            _zero_floats(zero, r0 + i, G, zf)
            _subtract_terms(xg, scales, zf, y, i)


@njit(cache=True, parallel=True, fastmath=REORDER)
def _zero_terms_avx512(xg, r0, smant, sexp, sbase, sesc, sesc_row, zero, y, parts):
    """_zero_terms with the AVX-512 scale decode."""
    R, G = y.shape[1], xg.shape[1]
    for p in prange(parts):
        scales, zf = np.empty(G, np.float32), np.empty(G + 1, np.float32)
        for i in range(p * R // parts, (p + 1) * R // parts):
            _row_scales_avx512(r0 + i, G, smant, sexp, sbase, sesc, sesc_row, scales)
            _zero_floats(zero, r0 + i, G, zf)
            _subtract_terms(xg, scales, zf, y, i)


@njit(cache=True, parallel=True)
def _zero_weights(r0, smant, sexp, sbase, sesc, sesc_row, zero, out):
    """out[i, g] = (zero - 8) * scale of row r0 + i's group g (fp32, exact)."""
    G = out.shape[1]
    for i in prange(out.shape[0]):
        zf = np.empty(G + 1, np.float32)
        _row_scales(r0 + i, G, smant, sexp, sbase, sesc, sesc_row, out[i])
        _zero_floats(zero, r0 + i, G, zf)
        for g in range(G):
            out[i, g] *= zf[g]


@njit(cache=True, parallel=True)
def _zero_weights_avx512(r0, smant, sexp, sbase, sesc, sesc_row, zero, out):
    """_zero_weights with the AVX-512 scale decode."""
    G = out.shape[1]
    for i in prange(out.shape[0]):
        zf = np.empty(G + 1, np.float32)
        _row_scales_avx512(r0 + i, G, smant, sexp, sbase, sesc, sesc_row, out[i])
        _zero_floats(zero, r0 + i, G, zf)
        for g in range(G):
            out[i, g] *= zf[g]


@njit(cache=True, parallel=True)
def _gemv_coded_avx512(x, r0, sym, esc, esc_row, smant, sexp, sbase, sesc, sesc_row, K, group, pb, values, y, parts):
    """_gemv_coded by the AVX-512 rows."""
    M, R, G, B = x.shape[0], y.shape[1], K // group, K // BLOCK
    gshift = np.int64(np.log2(group))
    for p in prange(parts):
        scales = np.empty(G, np.float32)
        acc = np.empty((M, BLOCK), np.float32)
        for i in range(p * R // parts, (p + 1) * R // parts):
            r = r0 + i
            _row_scales_avx512(r, G, smant, sexp, sbase, sesc, sesc_row, scales)
            acc[:] = 0
            coded_dot(pb, sym, r * B * 3, B, esc, np.int64(esc_row[r]), values, gshift, scales, x, acc)
            for m in range(M):
                y[m, i] = acc[m].sum()


@njit(cache=True, inline="always")
def _tile_blocks(group):
    """Blocks of a column tile of the fp32 chunked product: TILE_COLS columns (a chunk of CHUNK rows of
    fp32 x: 16 KiB of the L1), or one group where groups are wider (a tile starts at a group)."""
    return max(TILE_COLS, group) // BLOCK


@njit(cache=True, inline="always")
def _multiply_tile(xt, w, n, nb, acc):
    """acc[i, m] += the 16-lane sums of w[i] * xt[m] over nb blocks, for the n decoded rows of w and
    every chunk of xt's rows (a chunk's tile stays in the L1 while the rows pass)."""
    for m0 in range(0, xt.shape[0], CHUNK):
        for i in range(n):
            dense_chunk(w[i], nb, xt[m0 : m0 + CHUNK], acc[i, m0 : m0 + CHUNK])


@njit(cache=True, inline="always")
def _sums(acc, n, M, y, a):
    for i in range(n):
        for m in range(M):
            y[m, a + i] = acc[i, m].sum()


@njit(cache=True, parallel=True)
def _chunks_coded_avx512(x, r0, sym, esc, esc_row, smant, sexp, sbase, sesc, sesc_row, K, group, pb, values, y, parts):
    """y[:, i] = x @ W[r0 + i] for x tiled by _tiled: CHUNK_W rows of W and a tile of columns at a
    time, decoded once into an fp32 workspace, then multiplied with each chunk of x's rows."""
    M, R, G, B = y.shape[0], y.shape[1], K // group, K // BLOCK
    gshift, tile = np.int64(np.log2(group)), _tile_blocks(group)
    for p in prange(parts):
        scales = np.empty((CHUNK_W, G), np.float32)
        e = np.empty(CHUNK_W, np.int64)
        w = np.empty((CHUNK_W, tile * BLOCK), np.float32)
        acc = np.empty((CHUNK_W, x.shape[1], 16), np.float32)
        lo, hi = p * R // parts, (p + 1) * R // parts
        for a in range(lo, hi, CHUNK_W):
            n = min(CHUNK_W, hi - a)
            acc[:] = 0
            for i in range(n):
                _row_scales_avx512(r0 + a + i, G, smant, sexp, sbase, sesc, sesc_row, scales[i])
                e[i] = esc_row[r0 + a + i]
            for b0 in range(0, B, tile):
                nb, g0 = min(tile, B - b0), (b0 * BLOCK) >> gshift
                for i in range(n):
                    at = ((r0 + a + i) * B + b0) * 3
                    e[i] = coded_rows(pb, sym, at, nb, esc, e[i], values, gshift, scales[i, g0:], w[i])
                _multiply_tile(x[b0 // tile], w, n, nb, acc)
            _sums(acc, n, M, y, a)


@njit(cache=True, parallel=True)
def _rows_coded_avx512(r0, sym, esc, esc_row, smant, sexp, sbase, sesc, sesc_row, K, group, pb, values, out):
    G, B = K // group, K // BLOCK
    gshift = np.int64(np.log2(group))
    for i in prange(out.shape[0]):
        scales = np.empty(G, np.float32)
        r = r0 + i
        _row_scales_avx512(r, G, smant, sexp, sbase, sesc, sesc_row, scales)
        coded_rows(pb, sym, r * B * 3, B, esc, np.int64(esc_row[r]), values, gshift, scales, out[i])


@njit(cache=True, parallel=True)
def _gemv_coded_avx2(x, r0, sym, esc, esc_row, smant, sexp, sbase, sesc, sesc_row, K, group, pb, values, y, parts):
    """_gemv_coded with each row decoded by the AVX2 rows."""
    R, G, B = y.shape[1], K // group, K // BLOCK
    gshift = np.int64(np.log2(group))
    for p in prange(parts):
        scales = np.empty(G, np.float32)
        w = np.empty(K, np.float32)
        for i in range(p * R // parts, (p + 1) * R // parts):
            r = r0 + i
            _row_scales(r, G, smant, sexp, sbase, sesc, sesc_row, scales)
            coded_rows_avx2(pb, sym, r * B * 3, B, esc, np.int64(esc_row[r]), values, gshift, scales, w)
            _dot_rows(x, w, y, i)


@njit(cache=True, parallel=True)
def _rows_coded_avx2(r0, sym, esc, esc_row, smant, sexp, sbase, sesc, sesc_row, K, group, pb, values, out):
    G, B = K // group, K // BLOCK
    gshift = np.int64(np.log2(group))
    for i in prange(out.shape[0]):
        scales = np.empty(G, np.float32)
        r = r0 + i
        _row_scales(r, G, smant, sexp, sbase, sesc, sesc_row, scales)
        coded_rows_avx2(pb, sym, r * B * 3, B, esc, np.int64(esc_row[r]), values, gshift, scales, out[i])


@njit(cache=True, inline="always")
def _plain_scales(r, G, scales16, out):
    raw = out.view(np.uint32)
    for g in range(G):
        raw[g] = _bf16(scales16[r * G + g])


@njit(cache=True, parallel=True)
def _gemv_plain(x, packed, scales16, K, group, y, parts):
    R = y.shape[1]
    for p in prange(parts):
        w = np.empty(K, np.float32)
        for r in range(p * R // parts, (p + 1) * R // parts):
            _plain_row(r, K, group, packed, scales16, w)
            _dot_rows(x, w, y, r)


@njit(cache=True, parallel=True)
def _rows_plain(r0, packed, scales16, K, group, out):
    for i in prange(out.shape[0]):
        _plain_row(r0 + i, K, group, packed, scales16, out[i])


@njit(cache=True, parallel=True, fastmath=REORDER)
def _zero_terms_plain(xg, r0, scales16, zero, y, parts):
    """_zero_terms for a PlainInt4Weight: its BF16 scales as they are."""
    R, G = y.shape[1], xg.shape[1]
    for p in prange(parts):
        scales, zf = np.empty(G, np.float32), np.empty(G + 1, np.float32)
        for i in range(p * R // parts, (p + 1) * R // parts):
            _plain_scales(r0 + i, G, scales16, scales)
            _zero_floats(zero, r0 + i, G, zf)
            _subtract_terms(xg, scales, zf, y, i)


@njit(cache=True, parallel=True)
def _gemv_plain_avx512(x, packed, scales16, K, group, y, parts):
    M, R, G = x.shape[0], y.shape[1], K // group
    gshift = np.int64(np.log2(group))
    for p in prange(parts):
        scales = np.empty(G, np.float32)
        acc = np.empty((M, BLOCK), np.float32)
        for r in range(p * R // parts, (p + 1) * R // parts):
            _plain_scales(r, G, scales16, scales)
            acc[:] = 0
            plain_dot(packed, r * (K >> 3), K // BLOCK, gshift, scales, x, acc)
            for m in range(M):
                y[m, r] = acc[m].sum()


@njit(cache=True, parallel=True)
def _chunks_plain_avx512(x, packed, scales16, K, group, y, parts):
    """_chunks_coded_avx512 on the uncoded words."""
    M, R, G, B = y.shape[0], y.shape[1], K // group, K // BLOCK
    gshift, tile = np.int64(np.log2(group)), _tile_blocks(group)
    for p in prange(parts):
        scales = np.empty((CHUNK_W, G), np.float32)
        w = np.empty((CHUNK_W, tile * BLOCK), np.float32)
        acc = np.empty((CHUNK_W, x.shape[1], 16), np.float32)
        lo, hi = p * R // parts, (p + 1) * R // parts
        for a in range(lo, hi, CHUNK_W):
            n = min(CHUNK_W, hi - a)
            acc[:] = 0
            for i in range(n):
                _plain_scales(a + i, G, scales16, scales[i])
            for b0 in range(0, B, tile):
                nb, g0 = min(tile, B - b0), (b0 * BLOCK) >> gshift
                for i in range(n):
                    plain_rows(packed, (a + i) * (K >> 3) + b0 * 8, nb, gshift, scales[i, g0:], w[i])
                _multiply_tile(x[b0 // tile], w, n, nb, acc)
            _sums(acc, n, M, y, a)


@njit(cache=True, inline="always")
def _sub_scales(scales, gshift, K, out):
    """out[j] = the scale of columns 32 j .. 32 j + 31 (their group's: groups are 32 or more)."""
    for j in range(K >> 5):
        out[j] = scales[(j << 5) >> gshift]


@njit(cache=True, parallel=True)
def _chunks_bf16_coded_avx512(
    x, chunk, r0, sym, esc, esc_row, smant, sexp, sbase, sesc, sesc_row, K, group, pb, values, y, parts
):
    """y[:, i] = x @ W[r0 + i] for BF16 x tiled by _tiled_pairs (chunks of `chunk` rows): 16 rows of
    W and one of x's column tiles at a time decoded once to their integer values (nibble - 8, exact
    in BF16) as BF16 pairs, interleaved by transpose_pairs, then multiplied with each chunk of x's
    rows by dense_rows_bf16, which applies each 32 columns' scale to their sum."""
    M, R, G, B = y.shape[0], y.shape[1], K // group, K // BLOCK
    cols = 2 * x.shape[2]  # the tiles' columns (_tiled_pairs)
    gshift, tile, per_tile = np.int64(np.log2(group)), cols // BLOCK, cols >> 5
    for p in prange(parts):
        scales = np.empty(G, np.float32)
        st = np.zeros((x.shape[0] * per_tile, 16), np.float32)
        e = np.empty(16, np.int64)
        wp = np.zeros((16, cols // 2), np.uint32)
        wt = np.empty((per_tile, 16, 16), np.uint32)
        acc = np.empty((x.shape[1], 16), np.float32)
        lo, hi = p * R // parts, (p + 1) * R // parts
        for a in range(lo, hi, 16):
            n = min(16, hi - a)
            acc[:] = 0
            for i in range(n):
                _row_scales_avx512(r0 + a + i, G, smant, sexp, sbase, sesc, sesc_row, scales)
                _sub_scales(scales, gshift, K, st[:, i])
                e[i] = esc_row[r0 + a + i]
            for b0 in range(0, B, tile):
                nb = min(tile, B - b0)
                for i in range(n):
                    e[i] = coded_pairs(pb, sym, ((r0 + a + i) * B + b0) * 3, nb, esc, e[i], values, wp[i])
                _multiply_tile_bf16(x[b0 // tile], chunk, wp, wt, 2 * nb, st[2 * b0 :], acc)
            _lanes(acc, n, M, y, a)


@njit(cache=True, inline="always")
def _multiply_tile_bf16(xt, chunk, wp, wt, subs, st, acc):
    """acc[m, r] += the tile's products for the 16 decoded rows r of wp and every row m of xt."""
    transpose_pairs(wp, subs, wt)
    for m0 in range(0, xt.shape[0], chunk):
        dense_rows_bf16(chunk, wt, subs, xt[m0 : m0 + chunk], st, acc[m0 : m0 + chunk])


@njit(cache=True, inline="always")
def _lanes(acc, n, M, y, a):
    for i in range(n):
        for m in range(M):
            y[m, a + i] = acc[m, i]


@njit(cache=True, parallel=True)
def _chunks_bf16_plain_avx512(x, chunk, packed, scales16, K, group, y, parts):
    """_chunks_bf16_coded_avx512 on the uncoded words."""
    M, R, G, B = y.shape[0], y.shape[1], K // group, K // BLOCK
    cols = 2 * x.shape[2]  # the tiles' columns (_tiled_pairs)
    gshift, tile, per_tile = np.int64(np.log2(group)), cols // BLOCK, cols >> 5
    for p in prange(parts):
        scales = np.empty(G, np.float32)
        st = np.zeros((x.shape[0] * per_tile, 16), np.float32)
        wp = np.zeros((16, cols // 2), np.uint32)
        wt = np.empty((per_tile, 16, 16), np.uint32)
        acc = np.empty((x.shape[1], 16), np.float32)
        lo, hi = p * R // parts, (p + 1) * R // parts
        for a in range(lo, hi, 16):
            n = min(16, hi - a)
            acc[:] = 0
            for i in range(n):
                _plain_scales(a + i, G, scales16, scales)
                _sub_scales(scales, gshift, K, st[:, i])
            for b0 in range(0, B, tile):
                nb = min(tile, B - b0)
                for i in range(n):
                    plain_pairs(packed, (a + i) * (K >> 3) + b0 * 8, nb, wp[i])
                _multiply_tile_bf16(x[b0 // tile], chunk, wp, wt, 2 * nb, st[2 * b0 :], acc)
            _lanes(acc, n, M, y, a)


def _tiled_pairs(x: torch.Tensor, chunk: int) -> np.ndarray:
    """BF16 x (M, K) as the BF16 chunked product reads it: (tiles, M', columns / 2) BF16 pairs
    (uint32, column 2p in the low half), each tile's rows contiguous, M' a multiple of `chunk`
    (zero rows and columns past x's). Tiles of TILE_BF16 columns for chunks of 16 rows; for fewer
    rows one tile of all the columns, so W's rows are decoded whole, one stream from memory each."""
    m, k = x.shape
    cols = TILE_BF16 if chunk == CHUNKS_BF16[-1] else -(-k // TILE_BF16) * TILE_BF16
    tiles, rows = -(-k // cols), -(-m // chunk) * chunk
    out = np.zeros((rows, tiles * cols), np.uint16)
    out[:m, :k] = x.detach().contiguous().view(torch.int16).numpy().view(np.uint16)
    return np.ascontiguousarray(out.view(np.uint32).reshape(rows, tiles, cols // 2).transpose(1, 0, 2))


def _chunk_bf16(rows: int) -> int:
    """The rows of x dense_rows_bf16 takes at a time: the fewest of CHUNKS_BF16 that hold `rows`."""
    return next((c for c in CHUNKS_BF16 if rows <= c), CHUNKS_BF16[-1])


def _tiled(xs: np.ndarray, group: int) -> np.ndarray:
    """xs as the chunked product reads it: (tiles, M', tile columns), each column tile's rows
    contiguous (a chunk's tile then fills the L1's sets evenly: rows of x 28 KiB apart would fall
    in the same sets and evict each other), M' a multiple of CHUNK (zero rows past xs's)."""
    cols = _tile_blocks(group) * BLOCK
    tiles, rows = -(-xs.shape[1] // cols), -(-xs.shape[0] // CHUNK) * CHUNK
    out = np.zeros((rows, tiles * cols), np.float32)
    out[: xs.shape[0], : xs.shape[1]] = xs
    return np.ascontiguousarray(out.reshape(rows, tiles, cols).transpose(1, 0, 2))


def _parts(rows: int) -> int:
    return min(rows, 8 * numba.get_num_threads()) or 1


def _path(fast: bool | str | None, cols: int, group: int) -> str:
    """Which kernels take the product: "avx512" where the CPU has the AVX-512 rows' instructions, W's
    rows are whole blocks and its group a power of two of 32 or more; else "avx2" where it has AVX2
    and FMA, whole blocks and a power-of-two group of 8 or more; else "portable". `fast` False: the
    portable kernels; True: the AVX-512 rows, "avx2": the AVX2 ones, or ValueError."""
    pow2 = group & (group - 1) == 0
    avx512 = FAST_PATH and cols % BLOCK == 0 and group >= 32 and pow2
    avx2 = AVX2_PATH and cols % BLOCK == 0 and group >= 8 and pow2
    if fast is True and not avx512:
        raise ValueError(
            f"the AVX-512 INT4 rows need AVX-512, {BLOCK} | cols ({cols}) and a power-of-two group of 32 or "
            f"more ({group})"
        )
    if fast == "avx2" and not avx2:
        raise ValueError(
            f"the AVX2 INT4 rows need AVX2, {BLOCK} | cols ({cols}) and a power-of-two group of 8 or more ({group})"
        )
    if fast is None:
        return "avx512" if avx512 else "avx2" if avx2 else "portable"
    return "avx512" if fast is True else "avx2" if fast == "avx2" else "portable"


_ROWS = {"avx512": _rows_coded_avx512, "avx2": _rows_coded_avx2, "portable": _rows_coded}
_GEMV = {"avx512": _gemv_coded_avx512, "avx2": _gemv_coded_avx2, "portable": _gemv_coded}


def _args(w: Int4Weight) -> tuple:
    if w.device.type != "cpu":
        raise ValueError(f"the CPU INT4 kernels read a weight on the CPU, not on {w.device}")
    s = {role: t.numpy() for role, t in w.streams().items()}
    return (
        s["sym"],
        s["esc"],
        s["esc_row"],
        s["smant"],
        s["sexp"],
        s["sbase"],
        s["sesc"],
        s["sesc_row"],
        w.cols,
        w.group,
        w.payload_bits,
        _values(w),
    )


def _bf16_x(x: torch.Tensor) -> bool:
    """Whether the chunked product multiplies x as BF16 pairs (`vdpbf16ps`): BF16 x, where the CPU
    has AVX512_BF16; fp32 x keeps its fp32 products."""
    return x.dtype == torch.bfloat16 and BF16_PATH


def _check_x(x: torch.Tensor, cols: int) -> np.ndarray:
    if x.dim() != 2 or x.shape[1] != cols or x.device.type != "cpu":
        raise ValueError(f"x must be a (M, {cols}) CPU tensor, not {tuple(x.shape)} on {x.device}")
    return x.detach().to(torch.float32).contiguous().numpy()


def _gemm(xs: np.ndarray, rows: int, decode) -> np.ndarray:
    """x @ W.T, BLOCK_ROWS rows of W at a time decoded by decode(r0, out) and multiplied by torch."""
    xt = torch.from_numpy(xs)
    y = torch.empty((xs.shape[0], rows), dtype=torch.float32)
    block = np.empty((min(BLOCK_ROWS, rows), xs.shape[1]), np.float32)
    for r0 in range(0, rows, BLOCK_ROWS):
        r1 = min(r0 + BLOCK_ROWS, rows)
        decode(r0, block[: r1 - r0])
        torch.mm(xt, torch.from_numpy(block[: r1 - r0]).T, out=y[:, r0:r1])
    return y.numpy()


def _zero_args(w: Int4Weight) -> tuple:
    """The streams the zero-point kernels read: the scales' and the zero points'."""
    return tuple(getattr(w, role).numpy() for role in ("smant", "sexp", "sbase", "sesc", "sesc_row", "zero"))


def _zero_matrix(w: Int4Weight | PlainInt4Weight, path: str, r0: int, r1: int) -> np.ndarray:
    """(r1 - r0, G) fp32: (zero - 8) * scale of rows r0 .. r1's groups (exact)."""
    if isinstance(w, PlainInt4Weight):
        s = (w.scales.numpy().reshape(w.rows, -1)[r0:r1].view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        z = int4.zero_nibbles(w.zero.numpy().reshape(w.rows, -1)[r0:r1], r1 - r0, s.shape[1]).astype(np.float32)
        return s * (z - 8)
    out = np.empty((r1 - r0, w.cols // w.group), np.float32)
    (_zero_weights_avx512 if path == "avx512" else _zero_weights)(r0, *_zero_args(w), out)
    return out


def _subtract_zero_points(w: Int4Weight | PlainInt4Weight, path: str, xs: np.ndarray, y: np.ndarray, r0: int) -> None:
    """y (M, rows r0..) of the symmetric product made the asymmetric one: less, for each row and
    group, (zero - 8) * scale times x summed over the group; in one pass over the rows up to
    ZERO_FUSED_ROWS rows of x, else as a matrix of those terms and torch's GEMM."""
    r1 = r0 + y.shape[1]
    xg = xs.reshape(xs.shape[0], -1, w.group).sum(axis=2, dtype=np.float32)  # x summed over each group
    if xs.shape[0] > ZERO_FUSED_ROWS:
        torch.from_numpy(y).sub_(torch.from_numpy(xg) @ torch.from_numpy(_zero_matrix(w, path, r0, r1)).T)
    elif isinstance(w, PlainInt4Weight):
        _zero_terms_plain(xg, r0, w.scales.numpy(), w.zero.numpy(), y, _parts(r1 - r0))
    else:
        (_zero_terms_avx512 if path == "avx512" else _zero_terms)(xg, r0, *_zero_args(w), y, _parts(r1 - r0))


def _decoded_rows(w: Int4Weight | PlainInt4Weight, path: str, r0: int, out: np.ndarray) -> None:
    """Rows r0 .. r0 + len(out) of W dequantized into out (fp32): decoded as (nibble - 8) * scale,
    then each group's (zero - 8) * scale taken away, which leaves (nibble - zero) * scale exactly."""
    if isinstance(w, PlainInt4Weight):
        _rows_plain(r0, w.packed.numpy(), w.scales.numpy(), w.cols, w.group, out)
    else:
        _ROWS[path](r0, *_args(w), out)
    if not w.symmetric:
        out.reshape(out.shape[0], -1, w.group)[...] -= _zero_matrix(w, path, r0, r0 + out.shape[0])[:, :, None]


def int4_rows_cpu(w: Int4Weight | PlainInt4Weight, r0: int, r1: int, fast: bool | None = None) -> torch.Tensor:
    """Rows r0 .. r1 of W dequantized, (r1 - r0, cols) fp32."""
    if not 0 <= r0 <= r1 <= w.rows:
        raise ValueError(f"rows {r0}..{r1} are not within the weight's {w.rows}")
    out = np.empty((r1 - r0, w.cols), np.float32)
    _decoded_rows(w, _path(fast, w.cols, w.group), r0, out)
    return torch.from_numpy(out)


def int4_linear_cpu(
    x: torch.Tensor, w: Int4Weight | PlainInt4Weight, fast: bool | None = None, rows: tuple[int, int] | None = None
) -> torch.Tensor:
    """x @ W.T in fp32, (M, rows), for fp32 or BF16 x (M, cols) on the CPU: fused up to GEMV_ROWS
    rows of x, else BLOCK_ROWS rows of W decoded at a time and multiplied by torch. With `rows`
    (r0, r1), only W's rows r0 .. r1 (an expert of a stacked experts weight): (M, r1 - r0). A
    PlainInt4Weight takes the uncoded kernels (plain_int4_linear_cpu)."""
    r0, r1 = (0, w.rows) if rows is None else rows
    if not 0 <= r0 <= r1 <= w.rows:
        raise ValueError(f"rows {r0}..{r1} are not within the weight's {w.rows}")
    if isinstance(w, PlainInt4Weight):
        return _plain_linear(x, w, fast, r0, r1)
    xs, args, path = _check_x(x, w.cols), _args(w), _path(fast, w.cols, w.group)
    y = np.empty((xs.shape[0], r1 - r0), np.float32)
    if xs.shape[0] > GEMV_ROWS_BF16 and path == "avx512" and _bf16_x(x):
        chunk = _chunk_bf16(xs.shape[0])
        _chunks_bf16_coded_avx512(_tiled_pairs(x, chunk), chunk, r0, *args, y, _parts(r1 - r0))
    elif xs.shape[0] > GEMV_ROWS and path == "avx512":
        _chunks_coded_avx512(_tiled(xs, w.group), r0, *args, y, _parts(r1 - r0))
    elif xs.shape[0] > GEMV_ROWS:  # rows decoded whole (their zero points in them) for torch's GEMM
        return torch.from_numpy(_gemm(xs, r1 - r0, lambda i0, out: _decoded_rows(w, path, r0 + i0, out)))
    else:
        _GEMV[path](xs, r0, *args, y, _parts(r1 - r0))
    if not w.symmetric:
        _subtract_zero_points(w, path, xs, y, r0)
    return torch.from_numpy(y)


def _plain_linear(x: torch.Tensor, w: PlainInt4Weight, fast, r0: int, r1: int) -> torch.Tensor:
    """int4_linear_cpu of a PlainInt4Weight's rows r0 .. r1: the uncoded product, then its zero points' terms."""
    packed = w.packed.view(w.rows, -1)[r0:r1]
    scales = w.scales.view(w.rows, -1)[r0:r1].view(torch.bfloat16)
    xs = _check_x(x, w.cols)  # x in fp32 once, for the product and the zero points' terms
    y = _plain_product(x, xs, packed, scales, w.group, fast)
    if not w.symmetric:
        _subtract_zero_points(w, _path(fast, w.cols, w.group), xs, y.numpy(), r0)
    return y


def plain_int4_linear_cpu(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int, fast: bool | None = None
) -> torch.Tensor:
    """The same product from uncoded compressed-tensors tensors: `weight_packed` (rows, cols / 8)
    int32 and `weight_scale` (rows, cols / group) BF16; the baseline of the coded layout."""
    return _plain_product(x, _check_x(x, packed.shape[1] * 8), packed, scales, group, fast)


def _plain_product(x, xs, packed, scales, group, fast) -> torch.Tensor:
    """plain_int4_linear_cpu with x also as fp32 numpy (`xs`, _check_x's)."""
    rows, cols = packed.shape[0], packed.shape[1] * 8
    on = _path(fast, cols, group) == "avx512"  # AVX2 hosts: the portable kernels
    p, s = packed.contiguous().numpy().reshape(-1), scales.contiguous().view(torch.int16).numpy().reshape(-1)
    y = np.empty((xs.shape[0], rows), np.float32)
    if xs.shape[0] > GEMV_ROWS_BF16 and on and _bf16_x(x):
        chunk = _chunk_bf16(xs.shape[0])
        _chunks_bf16_plain_avx512(_tiled_pairs(x, chunk), chunk, p, s, cols, group, y, _parts(rows))
        return torch.from_numpy(y)
    if xs.shape[0] > GEMV_ROWS and on:
        _chunks_plain_avx512(_tiled(xs, group), p, s, cols, group, y, _parts(rows))
        return torch.from_numpy(y)
    if xs.shape[0] > GEMV_ROWS:
        return torch.from_numpy(_gemm(xs, rows, lambda r0, out: _rows_plain(r0, p, s, cols, group, out)))
    (_gemv_plain_avx512 if on else _gemv_plain)(xs, p, s, cols, group, y, _parts(rows))
    return torch.from_numpy(y)
