"""Fused decompress-and-multiply: y = x @ W^T with W read from the serving layout (`tiles`).

The kernel never writes BF16 weights to memory: each program walks K for a tile of W's rows,
rebuilds the (BLOCK_N, BLOCK_K) weight tile in registers from the sign+mantissa bytes, the 3-bit
code planes and the escapes, and accumulates in fp32. Escapes are found with a running per-row
pointer into `esc` (from esc_index's first entry of the row) plus an exclusive prefix count within
the tile, so the loop has no branches. Two shapes of the same kernel:

- GEMV path (M < 16, decode-time batches): broadcast multiply and row sums on CUDA cores;
- GEMM path (M >= 16): `tl.dot` on the tensor cores.

The oracle in the tests is `F.linear(x.float(), W.float())` with W from the numpy decoder.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from unweight.codec import tiles

from .tiles_common import bf16_bits, load_codes


@triton.jit
def tiles_matmul_kernel(
    # activations (M, K) bf16 with row stride, output (M, N) with row stride
    x_ptr, y_ptr, M, stride_xm, stride_ym,
    # weight W (N, K) in the serving layout: uint8 sm and codes, uint8 esc, int64 esc_index
    sm_ptr, codes_ptr, esc_ptr, esc_index_ptr, N, K, blocks_per_row, base,
    # split-K: program_id(2) takes columns [pid_k * k_per_split, ...), a multiple of the escape
    # block, and atomically adds its partial sums into an fp32 y
    k_per_split, esc_block,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,  # tensor-core tl.dot (BLOCK_M >= 16) or broadcast-and-sum (GEMV)
    DOT_F32: tl.constexpr,  # feed tl.dot fp32 operands (the interpreter) instead of bf16
    SPLIT_K: tl.constexpr,  # > 1: partial sums go to y with atomic adds
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) rows of x and y
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) rows of W, columns of y
    m_live = rm < M
    n_live = rn < N
    k_start = tl.program_id(2) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # escapes of each W row seen so far: starts at the escapes before (row, k_start)
    run = tl.load(esc_index_ptr + rn.to(tl.int64) * blocks_per_row + k_start // esc_block, mask=n_live, other=0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
        k_live = rk < k_end
        live = n_live[:, None] & k_live[None, :]  # (BLOCK_N, BLOCK_K)
        p = rn.to(tl.int64)[:, None] * K + rk[None, :]  # element index in W, row-major
        sm = tl.load(sm_ptr + p, mask=live, other=0).to(tl.int32)
        code = load_codes(codes_ptr, p, live)
        esc_i = ((code == 7) & live).to(tl.int32)
        before = tl.cumsum(esc_i, axis=1) - esc_i  # escapes before each element in its tile row
        e_esc = tl.load(esc_ptr + run[:, None] + before, mask=esc_i != 0, other=0).to(tl.int32)
        run += tl.sum(esc_i, axis=1)
        e = tl.where(esc_i != 0, e_esc, base + code)
        bits = bf16_bits(sm, e)
        w = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)  # (BLOCK_N, BLOCK_K) rebuilt weights
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_live[:, None] & k_live[None, :], other=0.0)
        if USE_DOT:
            if DOT_F32:  # Triton's CPU interpreter multiplies bf16 tl.dot operands wrongly (3.9)
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
            else:
                acc += tl.dot(x, tl.trans(w))
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(y_ptrs, acc, mask=m_live[:, None] & n_live[None, :])
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_live[:, None] & n_live[None, :])


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _block_m(m: int) -> int:
    return min(64, max(1, triton.next_power_of_2(m)))


def _split_k(m_programs: int, n_programs: int, blocks_per_row: int, device: torch.device) -> int:
    """Split K when the (M, N) grid alone would leave SMs idle: aim at two programs per SM."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-2 * sms // (m_programs * n_programs))
    return max(1, min(want, blocks_per_row))


def tiles_linear(x: torch.Tensor, weight: dict[str, torch.Tensor], params: dict, out_features: int, in_features: int, out_dtype: torch.dtype | None = None, split_k: int | None = None) -> torch.Tensor:
    """y = x @ W^T for W (out_features, in_features) in the serving layout, W never materialised.

    `x` is (..., in_features) BF16 on the weight's device; `weight` holds the tiles streams as
    runtime.tile_tensors() makes them. Returns (..., out_features) in `out_dtype` (default x's
    dtype), accumulated in fp32. `split_k` (default: chosen from the grid and the SM count) splits
    K at escape-block boundaries.
    """
    p = tiles.TilesParams.from_json(params)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bfloat16, not {x.dtype}")
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {in_features}")
    for role in ("sm", "codes", "esc", "esc_index"):
        if weight[role].device != x.device:
            raise ValueError(f"weight stream {role} is on {weight[role].device}, x on {x.device}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out_dtype = out_dtype or x.dtype
    if m == 0:
        return torch.empty((*lead, out_features), dtype=out_dtype, device=x.device)
    use_dot = m >= 16
    block_m = 64 if use_dot else _block_m(m)
    # GEMV: the broadcast product holds BLOCK_M x BLOCK_N x BLOCK_K fp32 values; keep it near 8K
    block_n = 64 if use_dot else max(16, 64 // max(1, block_m // 2))
    block_k = 64 if use_dot else 128
    nb = -(-in_features // p.block)
    m_programs, n_programs = triton.cdiv(m, block_m), triton.cdiv(out_features, block_n)
    splits = split_k or _split_k(m_programs, n_programs, nb, x.device)
    if not 1 <= splits <= nb:
        raise ValueError(f"split_k {splits} is outside 1..{nb} (escape blocks per row)")
    k_per_split = -(-nb // splits) * p.block
    splits = -(-in_features // k_per_split)
    y = torch.zeros if splits > 1 else torch.empty
    y = y((m, out_features), dtype=torch.float32 if splits > 1 else out_dtype, device=x.device)
    tiles_matmul_kernel[(m_programs, n_programs, splits)](
        x2, y, m, x2.stride(0), y.stride(0),
        weight["sm"], weight["codes"], weight["esc"], weight["esc_index"], out_features, in_features, nb, p.base,
        k_per_split, p.block,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot, DOT_F32=_interpreted(), SPLIT_K=splits,
    )
    return y.to(out_dtype).reshape(*lead, out_features)
