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


@njit(nogil=True, cache=True, fastmath=True)
def _gemv_rows(x, sm, codes, esc, esc_index, K, blocks_per_row, base, n0, n1, y):
    """y[:, n] = x @ W[n] for rows n0..n1-1 of W; x is (M, K) float32, y (M, N) float32."""
    bits = np.empty(K, dtype=np.uint32)
    wrow = bits.view(np.float32)
    M = x.shape[0]
    for n in range(n0, n1):
        k_esc = esc_index[n * blocks_per_row]
        for j in range(K):
            p = n * K + j
            g = (p >> 3) * 3
            i = p & 7
            c = ((codes[g] >> i) & 1) | (((codes[g + 1] >> i) & 1) << 1) | (((codes[g + 2] >> i) & 1) << 2)
            if c == 7:
                e = np.uint32(esc[k_esc])
                k_esc += 1
            else:
                e = np.uint32(base + c)
            s = np.uint32(sm[p])
            bits[j] = (((s & 0x80) << 8) | (e << 7) | (s & 0x7F)) << 16
        for m in range(M):
            acc = np.float32(0.0)
            for j in range(K):
                acc += x[m, j] * wrow[j]
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
        _gemv_rows(x2, *args, in_features, nb, base, t0 * ROWS_PER_TASK, min(t1 * ROWS_PER_TASK, out_features), y)

    map_chunk_ranges(work, tasks, threads)
    return torch.from_numpy(y).reshape(*lead, out_features)
