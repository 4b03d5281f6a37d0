"""Decode attention on the CPU: one new query per sequence, read straight from the paged KV cache.

A decode step of B sequences attends B single queries, each over its own cached keys and values.
Run as B calls of torch's attention, each after an `index_select` that gathers the sequence's
blocks, this costs a few hundred Python-level operations per layer and a copy of every cached
key (a BF16 cache: also a widening to fp32); at 16 sequences it was a third of the step.
`paged_decode_attention_cpu` does the whole batch of one layer in one numba call, as vLLM-CPU's
paged attention kernel does: one task per (sequence, KV head), which walks the sequence's block
table a block at a time, scores the query heads that share that KV head against each key (fp32,
BF16 keys widened as they are read, in place), takes the softmax in two passes and sums the values.

The reference is torch's `scaled_dot_product_attention` over the gathered keys (the model's
per-sequence path, and `graph_step.paged_attention`); tests hold this kernel to it.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.extending import intrinsic, overload

from .cpu_avx2 import _f32_at, _i64_at, _u16_at
from .cpu_gemv import _PARALLEL


def _f32(value):
    """A cache element as fp32: BF16 bits (uint16) shifted into an fp32's high half, fp32 as it is
    (numba picks the body by the cache's dtype). Read in place, in the loops over head_dim, they
    vectorise, and no block is first copied into fp32 scratch (which took longer)."""
    raise NotImplementedError("compiled by numba only")


@intrinsic
def _bits_as_f32(typingctx, bits):
    """The fp32 whose bits are `bits` (uint32)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@overload(_f32, inline="always")
def _f32_impl(value):
    if value == types.uint16:
        return lambda value: _bits_as_f32(np.uint32(value) << np.uint32(16))
    return lambda value: value


@njit(nogil=True, cache=True, parallel=True, fastmath=True)
def _paged_decode(q, k, v, tables, lengths, window, scale, out):
    """out[b, h] = softmax(q[b, h] . K_b^T * scale) V_b for q (B, H, hd) fp32, k and v (blocks,
    block_size, KVH, hd) fp32 or BF16 bits (uint16), tables (B, W) block ids, lengths (B,) the
    positions each sequence attends (the new one's included); window > 0 keeps the last `window`.
    One task per (sequence, KV head): each key and value row is read once, in place, for the query
    heads that share it."""
    nb, nh, hd = q.shape
    bs, kvh = k.shape[1], k.shape[2]
    group = nh // kvh
    for task in prange(nb * kvh):
        b = task // kvh
        g = task - b * kvh
        length = lengths[b]
        first = max(0, length - window) if window > 0 else 0
        n = length - first
        scores = np.empty((group, n), dtype=np.float32)
        best = np.full(group, -np.inf, dtype=np.float32)
        qg = q[b, g * group : (g + 1) * group]
        for blk in range(first // bs, (length + bs - 1) // bs):
            t0 = blk * bs
            lo, hi = max(first, t0) - t0, min(length, t0 + bs) - t0
            kb = k[tables[b, blk]]
            for t in range(lo, hi):
                krow = kb[t, g]
                for j in range(group):
                    qrow = qg[j]
                    s = np.float32(0.0)
                    for d in range(hd):
                        s += qrow[d] * _f32(krow[d])
                    s *= scale
                    scores[j, t0 + t - first] = s
                    if s > best[j]:
                        best[j] = s
        total = np.zeros(group, dtype=np.float32)
        for j in range(group):
            for i in range(n):
                e = np.float32(math.exp(scores[j, i] - best[j]))
                scores[j, i] = e
                total[j] += e
        acc = np.zeros((group, hd), dtype=np.float32)
        for blk in range(first // bs, (length + bs - 1) // bs):
            t0 = blk * bs
            lo, hi = max(first, t0) - t0, min(length, t0 + bs) - t0
            vb = v[tables[b, blk]]
            for t in range(lo, hi):
                vrow = vb[t, g]
                for j in range(group):
                    p = scores[j, t0 + t - first]
                    a = acc[j]
                    for d in range(hd):
                        a[d] += p * _f32(vrow[d])
        for j in range(group):
            inv = np.float32(1.0) / total[j]
            for d in range(hd):
                out[b, g * group + j, d] = acc[j, d] * inv


@njit(nogil=True, cache=True)
def _paged_decode_at(q_at, k_at, v_at, tables_at, lengths_at, shape, cache_shape, width, window, scale, out_at, bf16):
    """_paged_decode on the tensors' addresses (a call with arrays paid a microsecond or more for each
    array's numpy view): q and out (B, H, hd) fp32, the caches `cache_shape` in BF16 bits or fp32."""
    q, out = carray(_f32_at(q_at), shape), carray(_f32_at(out_at), shape)
    tables, lengths = carray(_i64_at(tables_at), (shape[0], width)), carray(_i64_at(lengths_at), (shape[0],))
    if bf16:
        k, v = carray(_u16_at(k_at), cache_shape), carray(_u16_at(v_at), cache_shape)
        _paged_decode(q, k, v, tables, lengths, window, scale, out)
    else:
        k, v = carray(_f32_at(k_at), cache_shape), carray(_f32_at(v_at), cache_shape)
        _paged_decode(q, k, v, tables, lengths, window, scale, out)


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    window: int | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Attention of one new query per sequence, q (B, H, hd), over one layer's paged cache k_cache,
    v_cache (blocks, block_size, KVH, hd) (fp32 or BF16, contiguous): sequence b attends positions
    0..lengths[b]-1 (the last `window` of them with a sliding window), read through its block ids
    tables[b] (int64). Computed in fp32; returns (B, H, hd) in q's dtype. check=False leaves out the
    checks of tables and lengths against the cache (four reductions a call): for a caller whose own
    plan made them (the model's Step, once a step for all its layers)."""
    b, nh, hd = q.shape
    if k_cache.dtype not in (torch.float32, torch.bfloat16) or v_cache.dtype is not k_cache.dtype:
        raise ValueError(f"the CPU decode attention reads an fp32 or BF16 cache, not {k_cache.dtype}/{v_cache.dtype}")
    if nh % k_cache.shape[2] or k_cache.shape[3] != hd:
        raise ValueError(f"{nh} query heads of {hd} do not share a cache of {tuple(k_cache.shape[2:])} (heads, dim)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape):
        raise ValueError("the caches must be contiguous and of one shape")
    if tables.dtype is not torch.int64 or lengths.dtype is not torch.int64 or lengths.shape != (b,):
        raise ValueError(f"block tables and lengths must be int64, one length per sequence ({b})")
    if b and check:  # the kernel reads by these without bounds checks
        if int(lengths.min()) < 1 or int(lengths.max()) > tables.shape[1] * k_cache.shape[1]:
            raise ValueError(f"lengths must lie in [1, {tables.shape[1] * k_cache.shape[1]}] (the block tables' room)")
        if int(tables.min()) < 0 or int(tables.max()) >= k_cache.shape[0]:
            raise ValueError(f"block ids must lie in [0, {k_cache.shape[0]})")
    out = torch.empty(b, nh, hd)
    if b:
        q32 = q.to(torch.float32).contiguous()
        tables, lengths = tables.contiguous(), lengths.contiguous()
        addresses = (q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lengths.data_ptr())
        with _PARALLEL:
            _paged_decode_at(
                *addresses,
                (b, nh, hd),
                tuple(k_cache.shape),
                tables.shape[1],
                window or 0,
                np.float32(1.0 / math.sqrt(hd)),
                out.data_ptr(),
                k_cache.dtype is torch.bfloat16,
            )
    return out.to(q.dtype)
