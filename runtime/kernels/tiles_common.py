"""Triton helpers shared by the serving-layout kernels (formats/SPEC.md §3.4)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_codes(codes_ptr, p, live):
    """The 3-bit codes of elements `p` (any shape, int64): bit p % 8 of the three plane bytes
    3 * (p // 8) + 0, 1, 2."""
    g = (p >> 3) * 3
    i = (p & 7).to(tl.int32)
    c0 = (tl.load(codes_ptr + g, mask=live, other=0).to(tl.int32) >> i) & 1
    c1 = (tl.load(codes_ptr + g + 1, mask=live, other=0).to(tl.int32) >> i) & 1
    c2 = (tl.load(codes_ptr + g + 2, mask=live, other=0).to(tl.int32) >> i) & 1
    return c0 | (c1 << 1) | (c2 << 2)


@triton.jit
def bf16_bits(sm, e):
    """BF16 bit pattern from the sign+mantissa byte and the exponent (both int32)."""
    return ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
