"""SWAR decode of the resident layout (runtime/qtiles.py), shared by the qtiles kernels.

Everything works on uint32 words holding four weights, one byte lane each: a word of four
sign+mantissa bytes and the word of the four matching 3-bit codes. No per-element branch,
gather or prefix count; code-0 lanes decode with exponent 0 (escapes are fixed apart).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def group_words(sm_ptr, codes_ptr, grp, live):
    """(sm words, A, B, C) of groups `grp` (int64 group indices r * G + g, any shape): the eight
    sign+mantissa words as a pointer to the first (add the quad), and the three code words."""
    sm_words = sm_ptr.to(tl.pointer_type(tl.uint32)) + 8 * grp
    code_words = codes_ptr.to(tl.pointer_type(tl.uint32)) + 3 * grp
    a = tl.load(code_words, mask=live, other=0)
    b = tl.load(code_words + 1, mask=live, other=0)
    c = tl.load(code_words + 2, mask=live, other=0)
    return sm_words, a, b, c


@triton.jit
def quad_codes(a, b, c, Q: tl.constexpr):
    """Codes of quad Q (0..7) of a group, one per byte lane, from the group's words A, B, C."""
    M: tl.constexpr = 0x07070707
    if Q == 0:
        z = a & M
    elif Q == 1:
        z = (a >> 3) & M
    elif Q == 2:
        z = b & M
    elif Q == 3:
        z = (b >> 3) & M
    elif Q == 4:
        z = c & M
    elif Q == 5:
        z = (c >> 3) & M
    else:
        d = ((a >> 6) & 0x03030303) | ((b >> 4) & 0x0C0C0C0C) | ((c >> 2) & 0x30303030)
        if Q == 6:
            z = d & M
        else:
            z = (d >> 3) & M
    return z


@triton.jit
def quad_planes(w, z, base_m1):
    """(H, L): the high and low BF16 bytes of four weights, a byte lane each, from the word `w` of
    their sign+mantissa bytes, their codes `z` and the row's base - 1 (`base_m1`, int32). A lane
    with code c >= 1 gets exponent base - 1 + c, a code-0 lane exponent 0."""
    nz = ((z + 0x7F7F7F7F) & 0x80808080) >> 7  # 1 in the lanes whose code is not 0
    e = nz * base_m1 + z  # exponent bytes; no lane carries into the next (<= 255)
    h = (w & 0x80808080) | ((e >> 1) & 0x7F7F7F7F)
    lo = (w & 0x7F7F7F7F) | ((e << 7) & 0x80808080)
    return h, lo


@triton.jit
def bf16_pair(h, lo, P: tl.constexpr, PRMT: tl.constexpr):
    """Lanes 2P and 2P+1 as a BF16 pair: (L[2P], H[2P], L[2P+1], H[2P+1]) from low byte up. With
    PRMT one `prmt.b32` (a byte permute); else its plain integer model (the interpreter)."""
    if PRMT:
        sel: tl.constexpr = 0x5140 if P == 0 else 0x7362
        return tl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {sel};", "=r,r,r", [lo, h], dtype=tl.uint32, is_pure=True, pack=1)
    else:
        lo2 = lo >> (16 * P)
        h2 = h >> (16 * P)
        return (lo2 & 0xFF) | ((h2 & 0xFF) << 8) | ((lo2 & 0xFF00) << 8) | ((h2 & 0xFF00) << 16)


@triton.jit
def pair_f32(pair, J: tl.constexpr):
    """fp32 value of BF16 number J (0: low half, 1: high half) of a pair."""
    if J == 0:
        bits = pair << 16
    else:
        bits = pair & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def quad_pairs(a, b, c, w, base_m1, Q: tl.constexpr, PRMT: tl.constexpr):
    """Quad Q of each (row, group) as two BF16 pairs, lanes 0-1 and lanes 2-3, from the group's
    code words, the quad's sign+mantissa word and the row's base - 1."""
    h, lo = quad_planes(w, quad_codes(a, b, c, Q), base_m1)
    return bf16_pair(h, lo, 0, PRMT), bf16_pair(h, lo, 1, PRMT)


@triton.jit
def escape_delta(smb, exp):
    """w - w0 in fp32 for listed escapes (int32 sign+mantissa bytes and exponent bytes): the true
    weight less the exponent-0 stand-in the main loops multiplied (|w0| < 2^-126), rounded once,
    so within 2^-24 of w; inf and NaN weights stay inf and NaN."""
    w0 = ((smb & 0x80) << 24) | ((smb & 0x7F) << 16)
    return (w0 | (exp << 23)).to(tl.float32, bitcast=True) - w0.to(tl.float32, bitcast=True)
