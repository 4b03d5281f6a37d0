"""Decode the serving layout (`tiles`, formats/SPEC.md §3.4) to BF16 with a Triton kernel.

One program rebuilds one escape block: `BLOCK` columns of one row. Codes come from three bit
planes, escapes from `esc` at the block's `esc_index` entry plus an exclusive prefix count of the
block's escapes. The launcher checks shapes, allocates the output and launches; the plain numpy
decoder `unweight.codec.tiles.decode_reference` is the oracle in the tests (on CPU through
TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unweight.codec import tiles

from .tiles_common import bf16_bits, load_codes


@triton.jit
def tiles_decode_kernel(
    # inputs: the four streams of one tensor, as uint8 / int32 tensors
    sm_ptr, codes_ptr, esc_ptr, esc_index_ptr,
    # output: int16 view of the BF16 matrix (or of the gathered rows), row-major
    out_ptr,
    # rows to gather (int64), read only when GATHER
    ids_ptr,
    # shape and layout
    cols, blocks_per_row, base,
    BLOCK: tl.constexpr,  # columns per escape block (the `block` param), a power of two
    GATHER: tl.constexpr,  # program row i decodes W row ids[i] (embedding lookups)
):
    i = tl.program_id(0)
    r = tl.load(ids_ptr + i) if GATHER else i
    b = tl.program_id(1)
    j = b * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,) column indices
    live = j < cols
    p = r.to(tl.int64) * cols + j  # element index, row-major
    sm = tl.load(sm_ptr + p, mask=live, other=0).to(tl.int32)
    code = load_codes(codes_ptr, p, live)
    escaped = (code == 7) & live
    first = tl.load(esc_index_ptr + r * blocks_per_row + b).to(tl.int64)
    before = tl.cumsum(escaped.to(tl.int32), axis=0) - escaped.to(tl.int32)  # exclusive count
    e_esc = tl.load(esc_ptr + first + before, mask=escaped, other=0).to(tl.int32)
    e = tl.where(escaped, e_esc, base + code)
    word = bf16_bits(sm, e)
    tl.store(out_ptr + i.to(tl.int64) * cols + j, word.to(tl.int16), mask=live)


def tiles_decode(weight: dict[str, torch.Tensor], params: dict, rows: int, cols: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The (rows, cols) BF16 matrix of a `tiles` tensor, decoded by the Triton kernel on the device
    that holds `weight`: uint8 tensors sm, codes, esc (at least one byte) and esc_index as int64
    entries, as UnweightLinear keeps them. With `ids` (integers in [0, rows), on the same device),
    only those rows, as a (len(ids), cols) matrix: an embedding lookup.

    Checks the lengths that SPEC.md §3.4 derives from the shape before launching; the escape counts
    themselves are checked when a checkpoint is loaded (unweight.codec.tiles.check).
    """
    p = tiles.TilesParams.from_json(params)
    if p.block & (p.block - 1):
        raise ValueError(f"the Triton decoder needs a power-of-two block, not {p.block}")
    want = tiles.stream_lengths(rows, cols, p)
    got = {"sm": weight["sm"].numel(), "codes": weight["codes"].numel(), "esc_index": 4 * weight["esc_index"].numel()}
    for role, n in want.items():
        if got[role] != n:
            raise ValueError(f"{role} stream has {got[role]} bytes, the shape needs {n}")
    gather = ids is not None
    if gather:
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
            raise ValueError(f"row ids must lie in [0, {rows})")
    n_out = ids.numel() if gather else rows
    out = torch.empty((n_out, cols), dtype=torch.int16, device=weight["sm"].device)
    nb = -(-cols // p.block)
    if n_out:
        tiles_decode_kernel[(n_out, nb)](
            weight["sm"], weight["codes"], weight["esc"], weight["esc_index"], out, ids if gather else out, cols, nb, p.base, BLOCK=p.block, GATHER=gather
        )
    return out.view(torch.bfloat16)
