"""Decode the serving layout (`tiles`, formats/SPEC.md §3.4) to BF16 with a Triton kernel.

One program rebuilds one escape block: `BLOCK` columns of one row. Codes come from three bit
planes, escapes from `esc` at the block's `esc_index` entry plus an exclusive prefix count of the
block's escapes. The launcher checks shapes, allocates the output and launches; the plain numpy
decoder `unweight.codec.tiles.decode_reference` is the oracle in the tests (on CPU through
TRITON_INTERPRET=1).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from unweight.codec import tiles


@triton.jit
def tiles_decode_kernel(
    # inputs: the four streams of one tensor, as uint8 / int32 tensors
    sm_ptr, codes_ptr, esc_ptr, esc_index_ptr,
    # output: int16 view of the BF16 matrix, row-major
    out_ptr,
    # shape and layout
    cols, blocks_per_row, base,
    BLOCK: tl.constexpr,  # columns per escape block (the `block` param), a power of two
):
    r = tl.program_id(0)
    b = tl.program_id(1)
    j = b * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,) column indices
    live = j < cols
    p = r.to(tl.int64) * cols + j  # element index, row-major
    sm = tl.load(sm_ptr + p, mask=live, other=0).to(tl.int32)
    g = (p >> 3) * 3
    i = (p & 7).to(tl.int32)
    c0 = (tl.load(codes_ptr + g, mask=live, other=0).to(tl.int32) >> i) & 1
    c1 = (tl.load(codes_ptr + g + 1, mask=live, other=0).to(tl.int32) >> i) & 1
    c2 = (tl.load(codes_ptr + g + 2, mask=live, other=0).to(tl.int32) >> i) & 1
    code = c0 | (c1 << 1) | (c2 << 2)
    escaped = (code == 7) & live
    first = tl.load(esc_index_ptr + r * blocks_per_row + b).to(tl.int64)
    before = tl.cumsum(escaped.to(tl.int32), axis=0) - escaped.to(tl.int32)  # exclusive count
    e_esc = tl.load(esc_ptr + first + before, mask=escaped, other=0).to(tl.int32)
    e = tl.where(escaped, e_esc, base + code)
    word = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
    tl.store(out_ptr + p, word.to(tl.int16), mask=live)


def tiles_decode(streams: dict[str, np.ndarray | torch.Tensor], params: dict, rows: int, cols: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """The (rows, cols) BF16 matrix of a `tiles` tensor, decoded by the Triton kernel on `device`.

    Checks the stream lengths that SPEC.md §3.4 derives from the shape before launching (the escape
    counts themselves are checked by the CPU decoder when the checkpoint is loaded).
    """
    p = tiles.TilesParams.from_json(params)
    if p.block & (p.block - 1):
        raise ValueError(f"the Triton decoder needs a power-of-two block, not {p.block}")
    want = tiles.stream_lengths(rows, cols, p)
    for role, n in want.items():
        if len(streams[role]) != n:
            raise ValueError(f"{role} stream has {len(streams[role])} bytes, the shape needs {n}")

    def as_tensor(a, dtype=torch.uint8) -> torch.Tensor:
        t = a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a))
        return t.view(dtype).to(device)

    sm, codes = as_tensor(streams["sm"]), as_tensor(streams["codes"])
    esc = as_tensor(streams["esc"]) if len(streams["esc"]) else torch.zeros(1, dtype=torch.uint8, device=device)
    esc_index = as_tensor(np.asarray(streams["esc_index"], dtype=np.uint8).view("<u4").astype(np.int32), torch.int32)
    out = torch.empty((rows, cols), dtype=torch.int16, device=device)
    nb = -(-cols // p.block)
    tiles_decode_kernel[(rows, nb)](sm, codes, esc, esc_index, out, cols, nb, p.base, BLOCK=p.block)
    return out.view(torch.bfloat16)
