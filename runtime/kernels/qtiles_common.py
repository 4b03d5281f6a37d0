"""SWAR decode of the resident layout (qtiles.py), shared by the qtiles kernels.

Everything works on uint32 words holding four weights, one byte lane each: a word of four
sign+mantissa bytes and the word of the four matching 3-bit codes. No per-element branch,
gather or prefix count (escapes are fixed apart). MODE is the matrix's (qtiles.py): 0, a
lane with code c gets exponent base + c; 1, base - 1 + c, and a code-0 lane exponent 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import interpreter  # noqa: F401  (its fix of the interpreter, before any kernel runs)


def kernel_streams(w) -> tuple:
    """The resident streams of a QTilesWeight (weight.py) in the order every kernel takes them: sm,
    codes, base, esc_row, esc_col, esc_exp (qtiles.py)."""
    return w.sm, w.codes, w.base, w.esc_row, w.esc_col, w.esc_exp


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
def row_offsets(base, MODE: tl.constexpr):
    """What quad_planes adds to the codes, from the rows' bases (uint32): mode 0 the base in every
    byte lane, mode 1 base - 1 (spread by the lanes' nonzero flags)."""
    if MODE == 0:
        return base * 0x01010101
    else:
        return base - 1


@triton.jit
def quad_planes(w, z, off, MODE: tl.constexpr):
    """(H, L): the high and low BF16 bytes of four weights, a byte lane each, from the word `w` of
    their sign+mantissa bytes, their codes `z` and the row's offsets (`row_offsets`). The exponent
    bytes take one add in mode 0, a flag and a multiply-add in mode 1; no lane carries (<= 255)."""
    if MODE == 0:
        e = z + off
    else:
        nz = ((z + 0x7F7F7F7F) & 0x80808080) >> 7  # 1 in the lanes whose code is not 0
        e = nz * off + z
    h = (w & 0x80808080) | ((e >> 1) & 0x7F7F7F7F)
    lo = (w & 0x7F7F7F7F) | ((e << 7) & 0x80808080)
    return h, lo


@triton.jit
def bf16_pair(h, lo, P: tl.constexpr, PRMT: tl.constexpr):
    """Lanes 2P and 2P+1 as a BF16 pair: (L[2P], H[2P], L[2P+1], H[2P+1]) from low byte up. With
    PRMT one `prmt.b32` (a byte permute); else its plain integer model (the interpreter)."""
    if PRMT:
        sel: tl.constexpr = 0x5140 if P == 0 else 0x7362
        return tl.inline_asm_elementwise(
            f"prmt.b32 $0, $1, $2, {sel};", "=r,r,r", [lo, h], dtype=tl.uint32, is_pure=True, pack=1
        )
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
def quad_pairs(a, b, c, w, off, Q: tl.constexpr, PRMT: tl.constexpr, MODE: tl.constexpr):
    """Quad Q of each (row, group) as two BF16 pairs, lanes 0-1 and lanes 2-3, from the group's
    code words, the quad's sign+mantissa word and the row's offsets."""
    h, lo = quad_planes(w, quad_codes(a, b, c, Q), off, MODE)
    return bf16_pair(h, lo, 0, PRMT), bf16_pair(h, lo, 1, PRMT)


@triton.jit
def escape_delta(smb, exp, base, MODE: tl.constexpr):
    """w - w0 in fp32 for listed escapes (uint32 sign+mantissa bytes, exponent bytes and their
    rows' bases): the true weight less the stand-in the main loops multiplied. In mode 0 the
    stand-in has the escape's code, 0 (exponent base) below the window and 7 (base + 7) above it;
    in mode 1 exponent 0 (|w0| < 2^-126). Exact while the two exponents differ by at most 16, else
    rounded once; inf and NaN weights stay inf and NaN."""
    sm = ((smb & 0x80) << 24) | ((smb & 0x7F) << 16)
    if MODE == 0:
        w0 = sm | (tl.where(exp < base, base, base + 7) << 23)
    else:
        w0 = sm  # exponent 0
    return (sm | (exp << 23)).to(tl.float32, bitcast=True) - w0.to(tl.float32, bitcast=True)
