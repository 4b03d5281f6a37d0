"""The portable CPU kernels of the serving layout (`tiles`): plain numba loops, the oracle the
tests hold the AVX2 kernels (cpu_avx2.py) to, and the path on CPUs without AVX2 and FMA.

Elsewhere, and for rows whose start is not a multiple of 8 elements (in_features % 8 != 0), the
portable kernels (also the oracle the tests hold the fast ones to) rebuild a row into an fp32
buffer (in L1) in three passes that LLVM vectorises or keeps branch-free (1536x576 on one thread:
0.54 ns per element, against 0.99 for one fused scalar loop):
1. the three code planes of each 8-element group become 8 exponent bytes with three table lookups
   (SWAR on uint64); groups holding an escape are listed without a branch;
2. sign+mantissa and exponent bytes are merged into fp32 bit patterns, element-wise;
3. escapes are patched from the listed groups, lowest set bit first (unaligned rows: element-wise).
The fused kernels hand them the last rows of a tensor too, where reading past a group (which
they do) could leave the buffers.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

# SPREAD[a]: the 8 bits of a byte spread into the low bit of 8 bytes (bit i -> bit 8i), so three
# code planes combine into 8 codes, one per byte, with three lookups and two shifts.
SPREAD = np.array([sum(((a >> i) & 1) << (8 * i) for i in range(8)) for a in range(256)], dtype=np.uint64)
ONES = np.uint64(0x0101010101010101)
LOWBIT = np.array([0] + [(a & -a).bit_length() - 1 for a in range(1, 256)], dtype=np.int64)


@njit(nogil=True, cache=True, fastmath=True)
def _expand(codes3, e64, spread, base8, hits):
    """Pass 1: e64[g] = the 8 exponents of group g (escapes read as base, their code cleared so
    base + 7 cannot carry into the next byte when base is 249); returns how many groups hold an
    escape, listed in hits as g * 256 + escape mask."""
    nh = 0
    for g in range(e64.shape[0]):
        a = codes3[3 * g]
        b = codes3[3 * g + 1]
        c = codes3[3 * g + 2]
        h = np.int64(a & b & c)
        e64[g] = (
            (spread[a] | (spread[b] << np.uint64(1)) | (spread[c] << np.uint64(2))) - spread[h] * np.uint64(7)
        ) + base8
        hits[nh] = g * 256 + h
        nh += (h + 255) >> 8  # 1 if the group holds an escape: no branch to mispredict
    return nh


@njit(nogil=True, cache=True, fastmath=True)
def _merge(smr, ebytes, bits):
    """Pass 2: fp32 bit patterns from sign+mantissa and exponent bytes (vectorised)."""
    for j in range(bits.shape[0]):
        s = np.uint32(smr[j])
        bits[j] = (
            ((s & np.uint32(0x80)) << np.uint32(24))
            | (np.uint32(ebytes[j]) << np.uint32(23))
            | ((s & np.uint32(0x7F)) << np.uint32(16))
        )


@njit(nogil=True, cache=True)
def _row_bits(sm, codes, esc, esc_index, K, bpr, base, n, spread, lowbit, e64, hits, bits):
    """bits[:K] = row n of W as fp32 bit patterns. e64 holds K // 8 words, hits K // 8 + 1."""
    row = n * K
    k_esc = esc_index[n * bpr]
    if K % 8 == 0:
        G = K >> 3
        g0 = row >> 3
        nh = _expand(codes[3 * g0 : 3 * (g0 + G)], e64[:G], spread, np.uint64(base) * ONES, hits)
        _merge(sm[row : row + K], e64[:G].view(np.uint8), bits)
        for t in range(nh):  # pass 3: escapes, in order
            g = hits[t] >> 8
            h = hits[t] & 255
            while h:
                p = 8 * g + lowbit[h]
                h &= h - 1
                bits[p] = (bits[p] & np.uint32(0x807FFFFF)) | (np.uint32(esc[k_esc]) << np.uint32(23))
                k_esc += 1
        return
    for j in range(K):  # element-wise: rows not aligned to code groups
        p = row + j
        g = p >> 3
        i = p & 7
        cc = ((codes[3 * g] >> i) & 1) | (((codes[3 * g + 1] >> i) & 1) << 1) | (((codes[3 * g + 2] >> i) & 1) << 2)
        if cc == 7:
            e = np.uint32(esc[k_esc])
            k_esc += 1
        else:
            e = np.uint32(base + cc)
        s = np.uint32(sm[p])
        bits[j] = (
            ((s & np.uint32(0x80)) << np.uint32(24)) | (e << np.uint32(23)) | ((s & np.uint32(0x7F)) << np.uint32(16))
        )


@njit(nogil=True, cache=True, fastmath=True)
def _dot(xr, w):
    acc = np.float32(0.0)
    for j in range(w.shape[0]):
        acc += xr[j] * w[j]
    return acc


@njit(nogil=True, cache=True, parallel=True)
def _gemv_portable(x, sm, codes, esc, esc_index, K, bpr, base, y, r0, spread, lowbit, parts):
    """y[:, n - r0] = x @ W[n] for the rows n in [r0, r0 + R); x (M, K) float32, y (M, R) float32."""
    R = y.shape[1]
    for t in prange(parts):
        e64 = np.empty(K // 8 + 1, dtype=np.uint64)
        hits = np.empty(K // 8 + 1, dtype=np.int64)
        bits = np.empty(K, dtype=np.uint32)
        w = bits.view(np.float32)
        for i in range(R * t // parts, R * (t + 1) // parts):
            _row_bits(sm, codes, esc, esc_index, K, bpr, base, r0 + i, spread, lowbit, e64, hits, bits)
            for m in range(x.shape[0]):
                y[m, i] = _dot(x[m], w)


@njit(nogil=True, cache=True, parallel=True)
def _rows_portable(sm, codes, esc, esc_index, K, bpr, base, ids, out, spread, lowbit, parts):
    """out[i] = row ids[i] of W as fp32 bit patterns (uint32)."""
    R = ids.shape[0]
    for t in prange(parts):
        e64 = np.empty(K // 8 + 1, dtype=np.uint64)
        hits = np.empty(K // 8 + 1, dtype=np.int64)
        for i in range(R * t // parts, R * (t + 1) // parts):
            _row_bits(sm, codes, esc, esc_index, K, bpr, base, ids[i], spread, lowbit, e64, hits, out[i])
