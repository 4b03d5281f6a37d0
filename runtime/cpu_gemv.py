"""CPU path of the serving layout: a fused numba GEMV that reads `tiles` rows directly.

CPU decode is memory-bound too, so for small batches each W row is rebuilt once into a small fp32
buffer (in cache) and multiplied with every row of x, never materialising W. Rows are split over
the shared thread pool (the kernel releases the GIL).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from unweight.codec.parallel import map_chunk_ranges

ROWS_PER_TASK = 64


# SPREAD[a]: the 8 bits of a byte spread into the low bit of 8 bytes (bit i -> bit 8i), so three
# code planes combine into 8 codes, one per byte, with three lookups and two shifts.
SPREAD = np.array([sum(((a >> i) & 1) << (8 * i) for i in range(8)) for a in range(256)], dtype=np.uint64)
ONES = np.uint64(0x0101010101010101)


@njit(nogil=True, cache=True, fastmath=True)
def _gemv_rows(x, sm, codes, esc, esc_index, K, blocks_per_row, base, n0, n1, y, spread):
    """y[:, n] = x @ W[n] for rows n0..n1-1 of W; x is (M, K) float32, y (M, N) float32.

    Each row is rebuilt into an fp32 buffer eight elements at a time (SWAR on uint64: codes and
    exponents one per byte), escapes patched afterwards; rows whose start is not a multiple of 8
    elements (K % 8 != 0) take the element-wise path.
    """
    bits = np.empty(K + 8, dtype=np.uint32)
    wrow = bits.view(np.float32)
    M = x.shape[0]
    base8 = np.uint64(base) * ONES
    for n in range(n0, n1):
        k_esc = esc_index[n * blocks_per_row]
        row = n * K
        j = 0
        if row % 8 == 0:
            g0 = row >> 3
            for gi in range(K >> 3):
                g = g0 + gi
                a = codes[3 * g]
                b = codes[3 * g + 1]
                c = codes[3 * g + 2]
                hit = a & b & c  # escapes among the eight
                c8 = spread[a] | (spread[b] << np.uint64(1)) | (spread[c] << np.uint64(2))
                e8 = (c8 & ~(spread[hit] * np.uint64(7))) + base8  # escapes get `base` for now
                for i in range(8):
                    sv = np.uint32(sm[8 * g + i])
                    ev = np.uint32((e8 >> np.uint64(8 * i)) & np.uint64(0xFF))
                    bits[8 * gi + i] = (((sv & 0x80) << 8) | (ev << 7) | (sv & 0x7F)) << 16
                if hit:
                    for i in range(8):
                        if (hit >> i) & 1:
                            w = bits[8 * gi + i]
                            bits[8 * gi + i] = (w & np.uint32(0x807FFFFF)) | (np.uint32(esc[k_esc]) << 23)
                            k_esc += 1
            j = (K >> 3) << 3
        for jj in range(j, K):  # element-wise: unaligned rows and the tail
            p = row + jj
            g = p >> 3
            i = p & 7
            cc = ((codes[3 * g] >> i) & 1) | (((codes[3 * g + 1] >> i) & 1) << 1) | (((codes[3 * g + 2] >> i) & 1) << 2)
            if cc == 7:
                e = np.uint32(esc[k_esc])
                k_esc += 1
            else:
                e = np.uint32(base + cc)
            sv = np.uint32(sm[p])
            bits[jj] = (((sv & 0x80) << 8) | (e << 7) | (sv & 0x7F)) << 16
        for m in range(M):
            acc = np.float32(0.0)
            for jj in range(K):
                acc += x[m, jj] * wrow[jj]
            y[m, n] = acc


def tiles_gemv_cpu(x: torch.Tensor, weight: dict[str, torch.Tensor], base: int, block: int, out_features: int, in_features: int, threads: int | None = None) -> torch.Tensor:
    """y = x @ W^T in fp32 for x (..., in_features) on the CPU, W in the serving layout."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features).to(torch.float32).contiguous().numpy()
    y = np.empty((x2.shape[0], out_features), dtype=np.float32)
    args = (weight["sm"].numpy(), weight["codes"].numpy(), weight["esc"].numpy(), weight["esc_index"].numpy())
    nb = -(-in_features // block)
    tasks = -(-out_features // ROWS_PER_TASK)

    def work(t0: int, t1: int) -> None:
        _gemv_rows(x2, *args, in_features, nb, base, t0 * ROWS_PER_TASK, min(t1 * ROWS_PER_TASK, out_features), y, SPREAD)

    map_chunk_ranges(work, tasks, threads)
    return torch.from_numpy(y).reshape(*lead, out_features)
