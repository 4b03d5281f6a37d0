"""The decode step's work between the linears on the CPU, in numba: RMSNorm (with the residual add
before it), and rotary embeddings with the store of K and V into the paged cache.

At one row these move a few kilobytes, and as chains of torch operators they cost more than the
linears around them: a norm was eight operators (19 us a norm on an avx512_bf16 EPYC), a layer's
rope, cache store and attention call some sixty, and a step called about 5,500 (benchmarks/
step_profile.py). Here each is one call. The model (runtime/model/llama.py) takes them on the CPU
for fp32 and BF16 activations; its torch code stays the reference, and the tests hold these to it.

Rounding follows the torch code step by step: fp32 arithmetic, and in BF16 each operator's result
rounded to nearest even where torch rounds it (the residual sum; the normalised row before the
weight multiplies it; each rope product and their sum). So the residual add and rope give torch's
bits exactly. The norm's sum of squares is taken in float64 (torch's fp32 reduction sums in
another order): a value may differ from torch's in its last place, and in BF16 only where that
moves a rounding.

SiLU(gate) x up stays torch's: its three operators take 4.7 us at one row there, vectorised over
SLEEF's exp, against 5.8 us for a loop over libm's here, and at sixteen rows torch's threads win.

BF16 arrays come in as their bits (uint16); `_widen` and `_narrow` move a row between them and fp32.
The launchers hand the kernels their tensors' addresses, not arrays: a call then costs about a
microsecond, where making numpy views of five tensors cost five.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import carray, njit, types
from numba.extending import overload

from .cpu_avx2 import _f32_at, _i64_at, _u16_at

ROUND_BIAS = np.uint32(0x7FFF)
BF16_NAN = np.uint16(0xFFFF)  # what torch's vectorised conversion makes of every NaN (its scalar one: 0x7FC0)


def _widen(src, dst):
    """dst (fp32) = src, a row of fp32 or of BF16 bits."""
    raise NotImplementedError("compiled by numba only")


def _narrow(src, dst):
    """dst = src (fp32) in dst's dtype: fp32 as it is, BF16 rounded to nearest even as torch rounds
    a row (its vectorised conversion, which makes every NaN 0xFFFF)."""
    raise NotImplementedError("compiled by numba only")


def _copy(src, dst):
    """The fp32 body of both: a row copied as it is."""
    for i in range(src.shape[0]):
        dst[i] = src[i]


@overload(_widen, inline="always")
def _widen_impl(src, dst):
    if src.dtype == types.uint16:

        def widen(src, dst):
            bits = dst.view(np.uint32)
            for i in range(src.shape[0]):
                bits[i] = np.uint32(src[i]) << np.uint32(16)

        return widen

    return _copy


@overload(_narrow, inline="always")
def _narrow_impl(src, dst):
    if dst.dtype == types.uint16:

        def narrow(src, dst):
            bits = src.view(np.uint32)
            for i in range(src.shape[0]):
                u = bits[i]
                if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                    dst[i] = BF16_NAN
                else:
                    dst[i] = np.uint16((u + ROUND_BIAS + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))

        return narrow

    return _copy


@njit(nogil=True, cache=True)
def _rms_norm(x, d, w, eps, out):
    """Row by row: with d (rows, n), first x[r] = x[r] + d[r] in x's dtype (the residual add, in
    place); then out[r] = w * (h / sqrt(mean(h^2) + eps)), h = x[r], the quotient in x's dtype
    before w multiplies it (transformers' LlamaRMSNorm). x, d, out (rows, n); w (n,)."""
    rows, n = x.shape
    h = np.empty(n, dtype=np.float32)
    t = np.empty(n, dtype=np.float32)
    wf = np.empty(n, dtype=np.float32)
    _widen(w, wf)
    for r in range(rows):
        _widen(x[r], h)
        if d.shape[0]:
            _widen(d[r], t)
            for i in range(n):
                t[i] = h[i] + t[i]
            _narrow(t, x[r])
            _widen(x[r], h)
        s = 0.0
        for i in range(n):
            s += np.float64(h[i] * h[i])
        inv = np.float32(1.0) / np.sqrt(np.float32(np.float32(s) / np.float32(n)) + eps)
        for i in range(n):
            t[i] = h[i] * inv
        _narrow(t, out[r])
        _widen(out[r], t)
        for i in range(n):
            t[i] = wf[i] * t[i]
        _narrow(t, out[r])


@njit(nogil=True, cache=True)
def _rotate(x, c, s, a, b, o):
    """x (hd,) rotated in place: rotate_half's pairs (i, i + hd/2), x * c + rotated * s, each product
    and the sum in x's dtype; a, b, o fp32 scratch of hd."""
    hd = x.shape[0]
    half = hd // 2
    _widen(x, a)
    for i in range(half):
        b[i] = -a[i + half] * s[i]
        b[i + half] = a[i] * s[i + half]
    for i in range(hd):
        a[i] = a[i] * c[i]
    _narrow(a, x)
    _widen(x, a)
    _narrow(b, x)
    _widen(x, b)
    for i in range(hd):
        o[i] = a[i] + b[i]
    _narrow(o, x)


@njit(nogil=True, cache=True)
def _rope_store(qkv, cos, sin, nq, nkv, k_cache, v_cache, slots):
    """qkv (rows, nq + 2 nkv, hd), q's heads then k's then v's: q and k rotated in place by cos, sin
    (rows, hd), then row r's k and v heads stored at k_cache[slots[r]], v_cache[slots[r]] (each
    (cache slots, nkv, hd), qkv's dtype)."""
    rows, _, hd = qkv.shape
    c = np.empty(hd, dtype=np.float32)
    s = np.empty(hd, dtype=np.float32)
    a = np.empty(hd, dtype=np.float32)
    b = np.empty(hd, dtype=np.float32)
    o = np.empty(hd, dtype=np.float32)
    for r in range(rows):
        _widen(cos[r], c)
        _widen(sin[r], s)
        for h in range(nq + nkv):
            _rotate(qkv[r, h], c, s, a, b, o)
        slot = slots[r]
        if slot < 0 or slot >= k_cache.shape[0]:
            raise ValueError("a cache slot lies outside the cache")
        for h in range(nkv):
            for i in range(hd):
                k_cache[slot, h, i] = qkv[r, nq + h, i]
                v_cache[slot, h, i] = qkv[r, nq + nkv + h, i]


@njit(nogil=True, cache=True)
def _rms_norm_at(x_at, d_at, d_rows, w_at, eps, out_at, rows, n, bf16):
    if bf16:
        x, w, out = carray(_u16_at(x_at), (rows, n)), carray(_u16_at(w_at), (n,)), carray(_u16_at(out_at), (rows, n))
        _rms_norm(x, carray(_u16_at(d_at), (d_rows, n)), w, np.float32(eps), out)
    else:
        x, w, out = carray(_f32_at(x_at), (rows, n)), carray(_f32_at(w_at), (n,)), carray(_f32_at(out_at), (rows, n))
        _rms_norm(x, carray(_f32_at(d_at), (d_rows, n)), w, np.float32(eps), out)


@njit(nogil=True, cache=True)
def _rope_store_at(qkv_at, cos_at, sin_at, rows, nq, nkv, hd, k_at, v_at, cache_slots, slots_at, bf16):
    slots = carray(_i64_at(slots_at), (rows,))
    shape, cs, kv = (rows, nq + 2 * nkv, hd), (rows, hd), (cache_slots, nkv, hd)
    if bf16:
        qkv, cos, sin = carray(_u16_at(qkv_at), shape), carray(_u16_at(cos_at), cs), carray(_u16_at(sin_at), cs)
        _rope_store(qkv, cos, sin, nq, nkv, carray(_u16_at(k_at), kv), carray(_u16_at(v_at), kv), slots)
    else:
        qkv, cos, sin = carray(_f32_at(qkv_at), shape), carray(_f32_at(cos_at), cs), carray(_f32_at(sin_at), cs)
        _rope_store(qkv, cos, sin, nq, nkv, carray(_f32_at(k_at), kv), carray(_f32_at(v_at), kv), slots)


def takes(x: torch.Tensor) -> bool:
    """Whether these kernels take x: on the CPU, fp32 or BF16, contiguous."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.is_contiguous()


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm of x (rows, n) by weight (n,), as llama.py's RMSNorm computes it, in x's dtype (`takes`
    x). With `residual`, x += residual first, in place (the layer's residual add): then the norm is of
    the sum, and x holds it. weight in x's dtype."""
    if not takes(x) or weight.device != x.device:
        raise ValueError(f"RMSNorm natively of a {x.device} {x.dtype} x, contiguous {x.is_contiguous()}: not taken")
    if weight.dtype != x.dtype or weight.shape != x.shape[-1:] or x.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"RMSNorm of {x.dtype}{list(x.shape)} by {weight.dtype}{list(weight.shape)}")
    d_at, d_rows = 0, 0
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"residual {residual.dtype}{list(residual.shape)} is not x's {x.dtype}{list(x.shape)}")
        residual = residual.contiguous()
        d_at, d_rows = residual.data_ptr(), x.shape[0]
    out = torch.empty_like(x)
    rows, n = x.shape
    _rms_norm_at(x.data_ptr(), d_at, d_rows, weight.data_ptr(), eps, out.data_ptr(), rows, n, x.dtype is torch.bfloat16)
    return out


def rope_store_cpu(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    nq: int,
    nkv: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Rotary embeddings of qkv's q and k heads, in place, then k and v stored into the cache's `slots`.
    qkv (rows, nq + 2 nkv, hd) (`takes` it); cos, sin (rows, hd) or (rows, 1, hd) in its dtype; the
    caches (cache slots, nkv, hd) in its dtype, contiguous; slots (rows,) int64, each a slot of the
    cache (the kernel checks them as it stores)."""
    if not takes(qkv) or k_cache.device != qkv.device or v_cache.device != qkv.device:
        raise ValueError(
            f"rope natively of a {qkv.device} {qkv.dtype} qkv, contiguous {qkv.is_contiguous()}: not taken"
        )
    rows, heads, hd = qkv.shape
    if heads != nq + 2 * nkv or hd % 2 or cos.dtype != qkv.dtype or sin.dtype != qkv.dtype:
        raise ValueError(f"qkv {qkv.dtype}{list(qkv.shape)} is not {nq} + 2 x {nkv} heads with cos, sin in its dtype")
    if cos.numel() != rows * hd or sin.numel() != rows * hd or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"cos, sin {list(cos.shape)}, {list(sin.shape)} are not {rows} contiguous rows of {hd}")
    if k_cache.dtype != qkv.dtype or k_cache.shape[1:] != (nkv, hd) or v_cache.shape != k_cache.shape:
        raise ValueError(f"a cache of {k_cache.dtype}{list(k_cache.shape)} does not take {nkv} heads of {hd}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the caches must be contiguous")
    if slots.dtype != torch.int64 or slots.shape != (rows,) or not slots.is_contiguous():
        raise ValueError(f"slots must be int64, one a row ({rows})")
    bf16 = qkv.dtype is torch.bfloat16
    args = (qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows, nq, nkv, hd)
    _rope_store_at(*args, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], slots.data_ptr(), bf16)
