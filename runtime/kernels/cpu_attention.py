"""Decode attention on the CPU: one new query per sequence, read straight from the paged KV cache.

A decode step of B sequences attends B single queries, each over its own cached keys and values.
Run as B calls of torch's attention, each after an `index_select` that gathers the sequence's
blocks, this costs a few hundred Python-level operations per layer and a copy of every cached
key (a BF16 cache: also a widening to fp32); at 16 sequences it was a third of the step.
`paged_decode_attention_cpu` does the whole batch of one layer in one numba call, as vLLM-CPU's
paged attention kernel does: one task per (sequence, KV head), which walks the sequence's block
table a block at a time, scores the query heads that share that KV head against each key (fp32,
BF16 keys widened as they are read, in place), takes the softmax in two passes and sums the values.
Where that makes fewer than two tasks a thread (one sequence of SmolLM2's three KV heads on two
threads left one thread idle a third of the call), each row's blocks are split into parts, each
part attended with its own maximum and sum, and the parts combined after (flash-decoding's split):
17.0 against 19.0 us a layer at 300 positions on a quiet host (SmolLM2's shapes, 2 threads, Zen 5);
on a busy one, within its noise (-7 % to +6 % in three runs).

The reference is torch's `scaled_dot_product_attention` over the gathered keys (the model's
per-sequence path, and `graph_step.paged_attention`); tests hold this kernel to it.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.extending import intrinsic, overload

from .cpu_avx2 import _f32_at, _i64_at, _u16_at
from .cpu_gemv import _PARALLEL

MAX_SPLITS = 4  # parts a (sequence, KV head)'s positions are split into at most
MIN_SPLIT_BLOCKS = 4  # cache blocks a part attends at least


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


@njit(nogil=True, cache=True)
def _splits(lengths, window, bs, kvh, threads) -> int:
    """Parts each (sequence, KV head)'s positions are split into, one task a part: enough tasks for
    two a thread (one task a KV head left a thread idle for a third of the call at one sequence and
    three KV heads on two threads), none shorter than MIN_SPLIT_BLOCKS blocks, at most MAX_SPLITS."""
    longest = 0
    for b in range(lengths.shape[0]):
        first = max(0, lengths[b] - window) if window > 0 else 0
        longest = max(longest, (lengths[b] + bs - 1) // bs - first // bs)
    tasks = lengths.shape[0] * kvh
    want = (2 * threads + tasks - 1) // tasks
    return max(1, min(want, MAX_SPLITS, longest // MIN_SPLIT_BLOCKS))


# fast math without its no-NaN and no-inf promises: sums may be reordered (the loops over head_dim
# vectorise), but a NaN or an infinity in the cache reaches the outputs as in torch's attention
FAST = {"reassoc", "contract", "arcp", "nsz", "afn"}


@njit(nogil=True, cache=True, parallel=True, fastmath=FAST)
def _paged_decode(q, k, v, tables, lengths, window, scale, out, parts):
    """out[b, h] = softmax(q[b, h] . K_b^T * scale) V_b for q (B, H, hd) fp32, k and v (blocks,
    block_size, KVH, hd) fp32 or BF16 bits (uint16), tables (B, W) block ids, lengths (B,) the
    positions each sequence attends (the new one's included); window > 0 keeps the last `window`.
    One task per (sequence, KV head, one of `parts` parts of its blocks): each key and value row is read once, in
    place, for the query heads that share it; each part keeps its own maximum, sum and weighted
    values, which a second pass combines (as flash-decoding splits a long row)."""
    nb, nh, hd = q.shape
    bs, kvh = k.shape[1], k.shape[2]
    group = nh // kvh
    # each part's maximum, sum and weighted values, for the combining pass (one part: none)
    split = parts > 1
    best = np.empty((nb * kvh * parts if split else 0, group), dtype=np.float32)
    total = np.empty_like(best)
    acc = np.empty((best.shape[0], group, hd), dtype=np.float32)
    for task in prange(nb * kvh * parts):
        b = task // (kvh * parts)
        g = (task // parts) % kvh
        length = lengths[b]
        first = max(0, length - window) if window > 0 else 0
        b0, b1 = first // bs, (length + bs - 1) // bs
        per = (b1 - b0 + parts - 1) // parts
        lo_blk = b0 + (task % parts) * per
        hi_blk = min(b1, lo_blk + per)
        t_lo, t_hi = max(first, lo_blk * bs), min(length, hi_blk * bs)
        n = max(0, t_hi - t_lo)
        m = np.full(group, -np.inf, dtype=np.float32)
        scores = np.empty((group, n), dtype=np.float32)
        qg = q[b, g * group : (g + 1) * group]
        for blk in range(lo_blk, hi_blk):
            t0 = blk * bs
            lo, hi = max(t_lo, t0) - t0, min(t_hi, t0 + bs) - t0
            kb = k[tables[b, blk]]
            for t in range(lo, hi):
                krow = kb[t, g]
                for j in range(group):
                    qrow = qg[j]
                    s = np.float32(0.0)
                    for d in range(hd):
                        s += qrow[d] * _f32(krow[d])
                    s *= scale
                    scores[j, t0 + t - t_lo] = s
                    if s > m[j]:
                        m[j] = s
        sums = np.zeros(group, dtype=np.float32)
        for j in range(group):
            for i in range(n):
                e = np.float32(math.exp(scores[j, i] - m[j]))
                scores[j, i] = e
                sums[j] += e
        a = np.zeros((group, hd), dtype=np.float32)
        for blk in range(lo_blk, hi_blk):
            t0 = blk * bs
            lo, hi = max(t_lo, t0) - t0, min(t_hi, t0 + bs) - t0
            vb = v[tables[b, blk]]
            for t in range(lo, hi):
                vrow = vb[t, g]
                for j in range(group):
                    p = scores[j, t0 + t - t_lo]
                    aj = a[j]
                    for d in range(hd):
                        aj[d] += p * _f32(vrow[d])
        if split:
            best[task], total[task], acc[task] = m, sums, a
        else:
            for j in range(group):
                inv = np.float32(1.0) / sums[j]
                for d in range(hd):
                    out[b, g * group + j, d] = a[j, d] * inv
    if split:
        _combine(best, total, acc, out, kvh)


@njit(nogil=True, cache=True, parallel=True)
def _combine(best, total, acc, out, kvh):
    """out from the parts of each (sequence, KV head): best, total (B * KVH * parts, group) each
    part's maximum score and sum of exponentials, acc (.., group, hd) its values so weighed, parts
    in order. Without fastmath: a NaN sum must spread to the heads' outputs, as in one part."""
    nb, group, hd = out.shape[0], acc.shape[1], acc.shape[2]
    parts = best.shape[0] // (nb * kvh)
    for bg in prange(nb * kvh):  # the parts of each (sequence, KV head), weighed by their maxima
        b, g = bg // kvh, bg % kvh
        for j in range(group):
            top = -np.inf
            for part in range(bg * parts, (bg + 1) * parts):
                top = max(top, best[part, j])
            o = out[b, g * group + j]
            o[:] = 0
            norm = np.float32(0.0)
            for part in range(bg * parts, (bg + 1) * parts):
                if total[part, j] != 0:  # a part past a short row's end holds nothing
                    w = np.float32(math.exp(best[part, j] - top))
                    norm += w * total[part, j]
                    for d in range(hd):
                        o[d] += w * acc[part, j, d]
            inv = np.float32(1.0) / norm
            for d in range(hd):
                o[d] *= inv


@njit(nogil=True, cache=True)
def _paged_decode_at(
    q_at, k_at, v_at, tables_at, lengths_at, shape, cache_shape, width, window, scale, out_at, bf16, threads, parts
):
    """_paged_decode on the tensors' addresses (a call with arrays paid a microsecond or more for each
    array's numpy view): q and out (B, H, hd) fp32, the caches `cache_shape` in BF16 bits or fp32;
    `parts` of each row (0: as `_splits` says for `threads` threads)."""
    q, out = carray(_f32_at(q_at), shape), carray(_f32_at(out_at), shape)
    tables, lengths = carray(_i64_at(tables_at), (shape[0], width)), carray(_i64_at(lengths_at), (shape[0],))
    if parts <= 0:
        parts = _splits(lengths, window, cache_shape[1], cache_shape[2], threads)
    if bf16:
        k, v = carray(_u16_at(k_at), cache_shape), carray(_u16_at(v_at), cache_shape)
        _paged_decode(q, k, v, tables, lengths, window, scale, out, parts)
    else:
        k, v = carray(_f32_at(k_at), cache_shape), carray(_f32_at(v_at), cache_shape)
        _paged_decode(q, k, v, tables, lengths, window, scale, out, parts)


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    window: int | None = None,
    check: bool = True,
    parts: int = 0,
) -> torch.Tensor:
    """Attention of one new query per sequence, q (B, H, hd), over one layer's paged cache k_cache,
    v_cache (blocks, block_size, KVH, hd) (fp32 or BF16, contiguous): sequence b attends positions
    0..lengths[b]-1 (the last `window` of them with a sliding window), read through its block ids
    tables[b] (int64). Computed in fp32; returns (B, H, hd) in q's dtype. check=False leaves out the
    checks of tables and lengths against the cache (four reductions a call): for a caller whose own
    plan made them (the model's Step, once a step for all its layers). `parts`: how many parts of
    each row's positions are attended apart (0: enough for two tasks a thread, `_splits`)."""
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
                numba.get_num_threads(),
                parts,
            )
    return out.to(q.dtype)
