"""Decode attention on the CPU: one new query per sequence, read straight from the paged KV cache.

A decode step of B sequences attends B single queries, each over its own cached keys and values.
Run as B calls of torch's attention, each after an `index_select` that gathers the sequence's
blocks, this costs a few hundred Python-level operations per layer and a copy of every cached
key (a BF16 cache: also a widening to fp32); at 16 sequences it was a third of the step.
`paged_decode_attention_cpu` does the whole batch of one layer in one numba call, as vLLM-CPU's
paged attention kernel does: one task per (sequence, KV head), which walks the sequence's block
table, scores the query heads that share that KV head against each cached key (fp32, BF16 keys
widened as they are read), takes the softmax in two passes and sums the values.

The reference is torch's `scaled_dot_product_attention` over the gathered keys (the model's
per-sequence path, and `graph_step.paged_attention`); tests hold this kernel to it.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

from .cpu_gemv import _PARALLEL


def _row(cache, block, slot, head, scratch):
    """Row (block, slot, head) of a cache as fp32: a view of an fp32 cache, or BF16 bits widened
    into `scratch` (numba picks the body by the cache's dtype)."""
    raise NotImplementedError("compiled by numba only")


@overload(_row, inline="always")
def _row_impl(cache, block, slot, head, scratch):
    if cache.dtype == types.uint16:

        def widen(cache, block, slot, head, scratch):
            bits = scratch.view(np.uint32)
            src = cache[block, slot, head]
            for d in range(src.shape[0]):
                bits[d] = np.uint32(src[d]) << np.uint32(16)
            return scratch

        return widen

    def view(cache, block, slot, head, scratch):
        return cache[block, slot, head]

    return view


@njit(nogil=True, cache=True, parallel=True, fastmath=True)
def _paged_decode(q, k, v, tables, lengths, window, scale, out):
    """out[b, h] = softmax(q[b, h] . K_b^T * scale) V_b for q (B, H, hd) fp32, k and v (blocks,
    block_size, KVH, hd) fp32 or BF16 bits (uint16), tables (B, W) block ids, lengths (B,) the
    positions each sequence attends (the new one's included); window > 0 keeps the last `window`."""
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
        kbuf = np.empty(hd, dtype=np.float32)
        vbuf = np.empty(hd, dtype=np.float32)
        best = np.full(group, -np.inf, dtype=np.float32)
        for t in range(first, length):
            krow = _row(k, tables[b, t // bs], t % bs, g, kbuf)
            for j in range(group):
                qrow = q[b, g * group + j]
                s = np.float32(0.0)
                for d in range(hd):
                    s += qrow[d] * krow[d]
                s *= scale
                scores[j, t - first] = s
                if s > best[j]:
                    best[j] = s
        total = np.zeros(group, dtype=np.float32)
        for j in range(group):
            for i in range(n):
                e = np.float32(math.exp(scores[j, i] - best[j]))
                scores[j, i] = e
                total[j] += e
        acc = np.zeros((group, hd), dtype=np.float32)
        for t in range(first, length):
            vrow = _row(v, tables[b, t // bs], t % bs, g, vbuf)
            for j in range(group):
                p = scores[j, t - first]
                for d in range(hd):
                    acc[j, d] += p * vrow[d]
        for j in range(group):
            inv = np.float32(1.0) / total[j]
            for d in range(hd):
                out[b, g * group + j, d] = acc[j, d] * inv


def _numba_view(cache: torch.Tensor) -> np.ndarray:
    return cache.view(torch.uint16).numpy() if cache.dtype is torch.bfloat16 else cache.numpy()


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of one new query per sequence, q (B, H, hd), over one layer's paged cache k_cache,
    v_cache (blocks, block_size, KVH, hd) (fp32 or BF16, contiguous): sequence b attends positions
    0..lengths[b]-1 (the last `window` of them with a sliding window), read through its block ids
    tables[b] (int64). Computed in fp32; returns (B, H, hd) in q's dtype."""
    b, nh, hd = q.shape
    if k_cache.dtype not in (torch.float32, torch.bfloat16) or v_cache.dtype is not k_cache.dtype:
        raise ValueError(f"the CPU decode attention reads an fp32 or BF16 cache, not {k_cache.dtype}/{v_cache.dtype}")
    if nh % k_cache.shape[2] or k_cache.shape[3] != hd:
        raise ValueError(f"{nh} query heads of {hd} do not share a cache of {tuple(k_cache.shape[2:])} (heads, dim)")
    out = np.empty((b, nh, hd), dtype=np.float32)
    if b:  # the kernel reads by these without bounds checks
        if tables.dtype is not torch.int64 or lengths.dtype is not torch.int64 or lengths.shape != (b,):
            raise ValueError(f"block tables and lengths must be int64, one length per sequence ({b})")
        if int(lengths.min()) < 1 or int(lengths.max()) > tables.shape[1] * k_cache.shape[1]:
            raise ValueError(f"lengths must lie in [1, {tables.shape[1] * k_cache.shape[1]}] (the block tables' room)")
        if int(tables.min()) < 0 or int(tables.max()) >= k_cache.shape[0]:
            raise ValueError(f"block ids must lie in [0, {k_cache.shape[0]})")
        with _PARALLEL:
            _paged_decode(
                q.to(torch.float32).contiguous().numpy(),
                _numba_view(k_cache),
                _numba_view(v_cache),
                tables.numpy(),
                lengths.numpy(),
                window or 0,
                np.float32(1.0 / math.sqrt(hd)),
                out,
            )
    return torch.from_numpy(out).to(q.dtype)
