"""The GEMV passes of the AVX-512 kernels (cpu_avx512.py): the rows of x in passes of up to 16, each
pass meeting a thread's range of W's rows through the dot products of cpu_avx512_dot.py.

A pass over up to 16 rows of x takes W's columns in segments whose part of x stays in L1
(X_SEGMENT_BYTES) while every row of W in the thread's range passes over it, each row carrying its
sums and its place in the escapes from one segment to the next; a pass of 8 or 4 rows takes W's
rows two at a time, so that each load of x serves both (passes of 2 and 1 take one, as their
decode, not the loads of x, bounds them); a pass of 16 rows of BF16 x takes them four at a time
(`_make_dot_t`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from unweight.codec import simd

from .cpu_avx512_dot import (
    _DOT_T,
    ADD,
    MORE,
    _dot1,
    _dot2,
    _dot4,
    _dot4x2,
    _dot8,
    _dot8x2,
    _dot16,
    _dot16t1,
    _dot16t2,
    _dot16t4,
)

# Bytes of x (BF16, P rows of a pass) a pass multiplies each row of W with before it moves on to the
# next columns, so that they stay in L1 while every row of W passes over them: all of L1D where it
# holds 48 KiB or more (Zen 5; its L2 feeds L1 at twice Zen 4's bandwidth, by AMD's figures), else
# 3/4 of it (24 KiB of Zen 4's 32). FP32 x keeps 3/4 of L1D on every CPU (X_SEGMENT_BYTES_F32). The
# measurements that set them: docs/kernels.md, "CPU kernels", "The constants of the 64-weight chunks".
_L1D = simd.l1d_bytes()
X_SEGMENT_BYTES = _L1D if _L1D >= 48 << 10 else _L1D * 3 // 4
X_SEGMENT_BYTES_F32 = _L1D * 3 // 4


@njit(nogil=True, cache=True, inline="always")
def _dot_rows(P, sm, sm_off, codes, codes_off, esc, k, xs, G, base, ys, live, n, part, i, stage, skip):
    """The dot intrinsic for a pass of P rows of x (numba cannot hold the intrinsics as values)."""
    if P == 16:
        return _dot16(sm, sm_off, codes, codes_off, esc, k, xs, G, base, ys, live, n, part, i, stage, skip)
    if P == 8:
        return _dot8(sm, sm_off, codes, codes_off, esc, k, xs, G, base, ys, live, n, part, i, stage, skip)
    if P == 4:
        return _dot4(sm, sm_off, codes, codes_off, esc, k, xs, G, base, ys, live, n, part, i, stage, skip)
    if P == 2:
        return _dot2(sm, sm_off, codes, codes_off, esc, k, xs, G, base, ys, live, n, part, i, stage, skip)
    return _dot1(sm, sm_off, codes, codes_off, esc, k, xs, G, base, ys, live, n, part, i, stage, skip)


@njit(nogil=True, cache=True, inline="always")
def _dot_pairs(P, sm, sm_off, codes, codes_off, esc, k, xs, G, base, ys, live, n, part, i, stage, skip):
    """The dot intrinsic for a pass of P (8 or 4) rows of x and two rows of W."""
    if P == 8:
        return _dot8x2(sm, sm_off, codes, codes_off, esc, k, xs, G, base, ys, live, n, part, i, stage, skip)
    return _dot4x2(sm, sm_off, codes, codes_off, esc, k, xs, G, base, ys, live, n, part, i, stage, skip)


@njit(nogil=True, cache=True, inline="always")
def _segments(G, P, itemsize):
    """(groups a segment takes, segments) for G groups of W's columns met by P rows of x: as many
    whole chunks as keep X_SEGMENT_BYTES of BF16 x (X_SEGMENT_BYTES_F32 of fp32 x) in L1, the
    segments as even as whole chunks allow."""
    budget = X_SEGMENT_BYTES if itemsize == 2 else X_SEGMENT_BYTES_F32
    most = max(8, budget // (8 * itemsize * P) >> 3 << 3)
    segs = -(-G // most)
    return ((-(-G // segs)) + 7) >> 3 << 3, segs


@njit(nogil=True, cache=True)
def _chunk_pass(x, m0, P, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0):
    """y[m0 : m0 + P, n - c0] = x[m0 : m0 + P] @ W[n] for n in [n0, n1): W's columns in segments
    whose P rows of x (X_SEGMENT_BYTES at most) stay in L1 while every row of W passes over them.
    Between segments each row keeps its sums in `part` and its place in esc in `pos`."""
    G = K >> 3
    step, segs = _segments(G, P, x.itemsize)
    kept = n1 - n0 if segs > 1 else 1
    part, pos = np.empty((kept, 16), np.float32), np.empty(kept, np.int64)
    xp, ys, live = x[:, m0 : m0 + P], y[m0 : m0 + P], min(P, y.shape[0] - m0)
    for g0 in range(0, G, step):
        Gs = min(step, G - g0)
        stage = (ADD if g0 else 0) | (MORE if g0 + Gs < G else 0)
        xs = xp[g0 >> 3 : (g0 + Gs + 7) >> 3]
        for n in range(n0, n1):
            i = n - n0 if segs > 1 else 0
            k = (pos[i] if g0 else esc_index[n * bpr],)
            sm_off, codes_off = n * K + 8 * g0, 3 * (G * n + g0)
            pos[i] = _dot_rows(
                P, sm, sm_off, codes, codes_off, esc, k, xs, Gs, base, ys, live, n - c0, part, i, stage, G - Gs
            )[0]


@njit(nogil=True, cache=True)
def _chunk_pairs(x, m0, P, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0):
    """_chunk_pass for P = 8 or 4 rows of x, W's rows two at a time (`_dot_pairs`: each load of x
    meets both, so a weight costs half the loads of x; measured against one row of W at a time:
    docs/kernels.md, "CPU kernels"), the last of an odd count alone. Each pair keeps its sums (lane
    P * w + m for row n + w) in `part[n - n0]` and its two places in esc in `pos`."""
    G = K >> 3
    step, segs = _segments(G, P, x.itemsize)
    kept = n1 - n0 if segs > 1 else 2
    part, pos = np.empty((kept, 16), np.float32), np.empty(kept, np.int64)
    xp, ys, live = x[:, m0 : m0 + P], y[m0 : m0 + P], min(P, y.shape[0] - m0)
    n2 = n1 - (n1 - n0) % 2
    for g0 in range(0, G, step):
        Gs = min(step, G - g0)
        stage = (ADD if g0 else 0) | (MORE if g0 + Gs < G else 0)
        xs = xp[g0 >> 3 : (g0 + Gs + 7) >> 3]
        for n in range(n0, n2, 2):
            i = n - n0 if segs > 1 else 0
            k = (pos[i], pos[i + 1]) if g0 else (esc_index[n * bpr], esc_index[(n + 1) * bpr])
            sm_off, codes_off = n * K + 8 * g0, 3 * (G * n + g0)
            pos[i], pos[i + 1] = _dot_pairs(
                P, sm, sm_off, codes, codes_off, esc, k, xs, Gs, base, ys, live, n - c0, part, i, stage, G - Gs
            )
    if n2 < n1:
        _chunk_pass(x, m0, P, sm, codes, esc, esc_index, K, bpr, base, y, n2, n1, c0)


@njit(nogil=True, cache=True)
def _chunk_sixteen(xt, m0, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0):
    """_chunk_pass for 16 rows of BF16 x in the pairs layout (`_pairs`), through `_make_dot_t`:
    W's rows _DOT_T at a time, the last few two and one at a time; each row keeps its sums (lane m
    for row m of x) in `part[n - n0]` and its place in esc in `pos` between segments."""
    G = K >> 3
    step, segs = _segments(G, 16, 2)
    kept = n1 - n0 if segs > 1 else _DOT_T
    part, pos = np.empty((kept, 16), np.float32), np.empty(kept, np.int64)
    xp, ys, live = xt[m0 >> 4], y[m0 : m0 + 16], min(16, y.shape[0] - m0)
    for g0 in range(0, G, step):
        Gs = min(step, G - g0)
        stage = (ADD if g0 else 0) | (MORE if g0 + Gs < G else 0)
        xs = xp[g0 >> 3 : (g0 + Gs + 7) >> 3]
        n = n0
        while n < n1:
            i = n - n0 if segs > 1 else 0
            sm_off, codes_off, col = n * K + 8 * g0, 3 * (G * n + g0), n - c0
            if n1 - n >= _DOT_T:
                k4 = (
                    (pos[i], pos[i + 1], pos[i + 2], pos[i + 3])
                    if g0
                    else (
                        esc_index[n * bpr],
                        esc_index[(n + 1) * bpr],
                        esc_index[(n + 2) * bpr],
                        esc_index[(n + 3) * bpr],
                    )
                )
                pos[i], pos[i + 1], pos[i + 2], pos[i + 3] = _dot16t4(
                    sm, sm_off, codes, codes_off, esc, k4, xs, Gs, base, ys, live, col, part, i, stage, G - Gs
                )
                n += _DOT_T
            elif n1 - n >= 2:
                k2 = (pos[i], pos[i + 1]) if g0 else (esc_index[n * bpr], esc_index[(n + 1) * bpr])
                pos[i], pos[i + 1] = _dot16t2(
                    sm, sm_off, codes, codes_off, esc, k2, xs, Gs, base, ys, live, col, part, i, stage, G - Gs
                )
                n += 2
            else:
                k1 = (pos[i] if g0 else esc_index[n * bpr],)
                pos[i] = _dot16t1(
                    sm, sm_off, codes, codes_off, esc, k1, xs, Gs, base, ys, live, col, part, i, stage, G - Gs
                )[0]
                n += 1


@njit(nogil=True, cache=True, inline="always")
def _pass_rows(r):
    """Rows of x the next pass multiplies, r rows of x left: 16 from 11 rows on, 8 from 5, else r
    rounded up to a power of two (passes of 8 and 4 take W's rows in pairs, `_chunk_pairs`). A pass
    past the rows left reads padding (zeros, or rows whose sums are not written): one pass costs
    less than several smaller ones (measured against passes of 16, 8, 4, 2 and 1 as the rows allow:
    docs/kernels.md, "CPU kernels")."""
    if r >= 11:
        return 16
    if r >= 5:
        return 8
    return 4 if r >= 3 else r


@njit(nogil=True, cache=True, inline="always")
def _padded_rows(M):
    """Rows of x's chunk layout for M rows: the passes' rows, the last one's padding included."""
    rows = 0
    while rows < M:
        rows += _pass_rows(M - rows)
    return rows
