"""The decode workspace: one growing buffer per thread that a layer decodes W into when it consumes
W before returning (ArchiveLinear's every forward, UnweightLinear's CPU `decode_matmul`), and the
blocked product of x with a BF16 W that converts W a cache-sized block of rows at a time.

Readers look `WORKSPACE` and `WORKSPACE_MAX_BYTES` up on this module at each call (so a test can
swap them).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

# Bytes of W (in x's dtype) converted at a time: about a Zen 3 core's L2. SmolLM2-135M decode steps in
# the archive layout, against 256 KiB: 128 KiB 1.00x, 512 KiB and 1 MiB 1.12x, 4 MiB 0.95x.
ROW_BLOCK_BYTES = 512 << 10


def linear_in_row_blocks(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w.to(x.dtype)) for a BF16 `w` on the CPU, converting w a block of rows at a time
    into one small buffer that stays in cache, instead of writing and reading back a whole copy
    of W in x's dtype (twice W's bytes)."""
    n, k = w.shape
    xs = x.reshape(-1, k)
    step = max(1, ROW_BLOCK_BYTES // (k * x.element_size()))
    yt = torch.empty(n, xs.shape[0], dtype=x.dtype)
    buf = torch.empty(min(step, n), k, dtype=x.dtype)
    xt = xs.t()
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        block = buf[: r1 - r0]
        block.copy_(w[r0:r1])
        torch.mm(block, xt, out=yt[r0:r1])
    return yt.t().reshape(*x.shape[:-1], n)


class Workspace(threading.local):
    """One growing, 8-byte aligned byte buffer per thread. ArchiveLinear.forward decodes W into it
    and consumes W before returning, so W's pages are faulted in once per thread instead of at
    every forward (an 8B-shaped 14336x4096 layer's CPU forward ran 1.17x faster, 1536x576 1.28x).
    Peak memory is what decoding into fresh memory reached; between forwards the buffer stays, the
    size of the largest weight decoded on that thread."""

    buf: np.ndarray | None = None

    def take(self, nbytes: int) -> np.ndarray:
        if self.buf is None or self.buf.nbytes < nbytes:
            self.buf = None  # drop the old one before allocating the larger
            self.buf = np.empty(-(-nbytes // 8), dtype=np.uint64).view(np.uint8)
        return self.buf[:nbytes]


WORKSPACE = Workspace()
# The largest W (in x's dtype) that UnweightLinear's CPU decode-then-matmul decodes into the
# workspace; a larger one (an 8B's MLP, a vocabulary) gets fresh memory, freed after its product,
# so the workspace never holds more than this. 256-row BF16 products of SmolLM2's shapes against
# fresh memory and a BF16 copy of an fp32 decode: 3-10% less time each.
WORKSPACE_MAX_BYTES = 32 << 20
