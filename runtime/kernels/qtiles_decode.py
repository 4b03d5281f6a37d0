"""Decode the resident layout (qtiles.py) to BF16 with a Triton kernel: the first half of
the `decode_matmul` pipeline (prefill, large batches) and the embedding lookup (rows by id).

One program takes BLOCK_N rows (or ids) and walks their groups GROUPS at a time, four weights per
32-bit word (qtiles_common), storing BF16 pairs. Then, after a barrier, it overwrites the listed
escapes of its rows with their true exponents. The plain numpy decoder
`runtime.qtiles.decode_reference` is the oracle in the tests (on CPU through TRITON_INTERPRET=1).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .interpreter import interpreted
from .qtiles_common import group_words, kernel_streams, quad_pairs, row_offsets
from .weight import QTilesWeight

_NO_GUARD = contextlib.nullcontext()


@triton.jit
def qtiles_decode_kernel(
    # W (N, K) in the resident layout: sm (N, 32G) uint8, codes (N, G, 3) words, base (N,) uint8,
    # esc_row (N + 1,) int32, esc_col and esc_exp (one per listed escape)
    sm_ptr,
    codes_ptr,
    base_ptr,
    esc_row_ptr,
    esc_col_ptr,
    esc_exp_ptr,
    N,
    K,
    G,
    # output: int16 view of the BF16 rows (n_out, K), row-major; rows to take (int64) when GATHER
    out_ptr,
    ids_ptr,
    n_out,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    ESC_BLOCK: tl.constexpr,
    GATHER: tl.constexpr,  # output row i is W row ids[i] (embedding lookups); else all rows
    PRMT: tl.constexpr,  # byte permutes as inline PTX (a GPU); else their integer model (the interpreter)
    MODE: tl.constexpr,  # the matrix's mode (qtiles.py): 0, eight-exponent windows; 1, seven and a zero code
    EVEN_K: tl.constexpr,  # K % 32 == 0: whole groups, stored as 32-bit BF16 pairs
):
    pid = tl.program_id(0)
    ri = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) output rows
    i_live = ri < n_out
    ri64 = tl.where(i_live, ri, 0).to(tl.int64)
    rn64 = tl.load(ids_ptr + ri64, mask=i_live, other=0) if GATHER else ri64  # W rows
    out_pairs = out_ptr.to(tl.pointer_type(tl.uint32))
    off = row_offsets(tl.load(base_ptr + rn64).to(tl.uint32), MODE)[:, None]  # (BLOCK_N, 1)
    for g0 in range(0, G, GROUPS):
        gi = g0 + tl.arange(0, GROUPS)
        live = i_live[:, None] & (gi < G)[None, :]  # (BLOCK_N, GROUPS)
        grp = rn64[:, None] * G + gi[None, :]
        words, a, b, c = group_words(sm_ptr, codes_ptr, grp, live)
        for q in tl.static_range(8):
            pairs = quad_pairs(a, b, c, tl.load(words + q, mask=live, other=0), off, q, PRMT, MODE)
            for p in tl.static_range(2):
                pair = pairs[p]
                k = gi[None, :] * 32 + 4 * q + 2 * p  # (1, GROUPS) column of the pair's first weight
                if EVEN_K:
                    tl.store(out_pairs + ri64[:, None] * (K // 2) + k // 2, pair, mask=live)
                else:
                    at = out_ptr + ri64[:, None] * K + k
                    tl.store(at, (pair & 0xFFFF).to(tl.uint16).to(tl.int16, bitcast=True), mask=live & (k < K))
                    tl.store(at + 1, (pair >> 16).to(tl.uint16).to(tl.int16, bitcast=True), mask=live & (k + 1 < K))
    tl.debug_barrier()  # the escapes below overwrite what other threads of this program stored
    # each output row's listed escapes: entries esc_row[r] .. esc_row[r + 1] of its W row r
    for i in tl.static_range(BLOCK_N):
        r = (
            tl.load(ids_ptr + pid * BLOCK_N + i, mask=pid * BLOCK_N + i < n_out, other=0)
            if GATHER
            else (pid * BLOCK_N + i).to(tl.int64)
        )
        if pid * BLOCK_N + i < n_out:
            first = tl.load(esc_row_ptr + r)
            last = tl.load(esc_row_ptr + r + 1)
            for e0 in tl.range(first, last, ESC_BLOCK, loop_unroll_factor=1):  # about one step a row
                ei = e0 + tl.arange(0, ESC_BLOCK)
                e_live = ei < last
                col = tl.load(esc_col_ptr + ei, mask=e_live, other=0).to(tl.int64)
                exp = tl.load(esc_exp_ptr + ei, mask=e_live, other=0).to(tl.int32)
                smb = tl.load(sm_ptr + r * (G * 32) + col, mask=e_live, other=0).to(tl.int32)
                bits = ((smb & 0x80) << 8) | (exp << 7) | (smb & 0x7F)
                tl.store(out_ptr + (pid * BLOCK_N + i).to(tl.int64) * K + col, bits.to(tl.int16), mask=e_live)


def qtiles_decode(w: QTilesWeight, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The (w.rows, w.cols) BF16 matrix W, decoded on its streams' device; with `ids` (int64, on
    that device, each in [0, rows): the caller checks), only those rows, as a (len(ids), cols)
    matrix. Never synchronises."""
    rows, cols, mode, sm = w.rows, w.cols, w.mode, w.sm
    gather = ids is not None
    if gather:
        ids = ids.reshape(-1)
        if ids.dtype != torch.int64:
            ids = ids.to(torch.int64)
    n_out = ids.numel() if gather else rows
    out = torch.empty((n_out, cols), dtype=torch.int16, device=sm.device)
    if n_out:
        block_n = 4
        with torch.cuda.device(sm.device) if sm.device.type == "cuda" else _NO_GUARD:
            qtiles_decode_kernel[(-(-n_out // block_n),)](
                *kernel_streams(w),
                rows,
                cols,
                -(-cols // 32),
                out,
                ids if gather else out,
                n_out,
                BLOCK_N=block_n,
                GROUPS=32,
                ESC_BLOCK=128,
                GATHER=gather,
                PRMT=not interpreted(),
                MODE=mode,
                EVEN_K=cols % 32 == 0,
            )
    return out.view(torch.bfloat16)
