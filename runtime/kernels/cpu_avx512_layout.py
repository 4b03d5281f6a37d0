"""The layouts of x the AVX-512 kernels read (cpu_avx512.py), built once per call: the chunk layout
(for each 64 columns, the rows side by side, each row's 64 in the order the chunk decoder leaves W)
in BF16 bits or fp32, and the pairs layout of the 16-row passes (for each pair of columns, the 16
rows' pairs in one 64-byte vector). One masked load and one shuffle a row and chunk build them."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import types
from numba.extending import intrinsic

from unweight.codec import simd

from .cpu_avx2 import aligned_empty_u16, aligned_zeros_u16
from .cpu_avx512_ir import _I8, _I32, _V16I1, _V16I32, _const, _low_bits, _transposed, _vconst

# a row's 64 columns of a chunk in the order the dot product decodes W: groups 0, 2, 4, 6, then 1, 3, 5, 7
_CHUNK_ORDER = [8 * (2 * (p % 32 // 8) + p // 32) + p % 8 for p in range(64)]


@intrinsic
def _chunk_row(typingctx, x, m, c, out):
    """out[c, m] = columns 64c .. 64c + 63 of row m of x (M, K), BF16 bits or fp32, in the order of
    `_CHUNK_ORDER` (zeros past K): one masked load and one shuffle of the 64 values."""
    sig = types.void(x, types.intp, types.intp, out)

    def codegen(context, builder, signature, args):
        x_a, m, c, out_a = args
        b = builder
        elem = ir.IntType(signature.args[0].dtype.bitwidth)  # the values moved as bits
        vec = ir.VectorType(elem, 64)
        xarr = context.make_array(signature.args[0])(context, b, x_a)
        oarr = context.make_array(signature.args[3])(context, b, out_a)
        K = b.extract_value(xarr.shape, 1)
        width = _const(elem.width // 8)
        at = b.gep(
            b.bitcast(xarr.data, _I8.as_pointer()),
            [b.add(b.mul(m, b.extract_value(xarr.strides, 0)), b.mul(b.shl(c, _const(6)), width))],
        )
        left = b.sub(K, b.shl(c, _const(6)))
        bits = b.select(b.icmp_signed(">=", left, _const(64)), _const(-1), _low_bits(b, left))
        row = simd.masked_load(b, at, simd.mask_of(b, bits, 64), vec)
        ordered = b.shuffle_vector(row, ir.Constant(vec, None), _vconst(_CHUNK_ORDER, ir.VectorType(_I32, 64)))
        strides = [b.extract_value(oarr.strides, a) for a in (0, 1)]
        dst = b.gep(b.bitcast(oarr.data, _I8.as_pointer()), [b.add(b.mul(c, strides[0]), b.mul(m, strides[1]))])
        b.store(ordered, b.bitcast(dst, vec.as_pointer()), align=2)
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True, cache=True, inline="always")
def _fill_chunks(x, out):
    """out (K / 64 rounded up, rows, 64), zeros, takes x (M, K), M <= rows, as the chunk kernels read
    it: for each 64 columns, the rows side by side, so one pointer serves every row of a pass, each
    row's 64 in the order the dot product decodes W (`_CHUNK_ORDER`)."""
    M, K = x.shape
    for m in range(M):
        for c in range(out.shape[0]):
            _chunk_row(x, m, c, out)
    return out


@njit(nogil=True, cache=True)
def _bf16_chunks(x, rows):
    """x (M, K) BF16 bits in the chunk layout (`_fill_chunks`), `rows` rows (zeros past M and K)."""
    chunks = (x.shape[1] + 63) >> 6
    return _fill_chunks(x, aligned_zeros_u16(chunks * rows * 64).reshape((chunks, rows, 64)))


@njit(nogil=True, cache=True)
def _f32_chunks(x, rows):
    """x (M, K) fp32 in the chunk layout (`_fill_chunks`), `rows` rows (zeros past M and K)."""
    chunks = (x.shape[1] + 63) >> 6
    return _fill_chunks(x, aligned_zeros_u16(chunks * rows * 128).view(np.float32).reshape((chunks, rows, 64)))


# the decoder's registers of a chunk (groups 0, 2, 4, 6 and 1, 3, 5, 7) from its columns' two halves
# (groups 0-3 and 4-7) as one two-source shuffle each: group g's pairs are 4g .. 4g + 3 of both
_EVEN_ODD = [_vconst([4 * (2 * q + h) + j for q in range(4) for j in range(4)], _V16I32) for h in (0, 1)]


@intrinsic
def _pairs_chunk(typingctx, x, m0, c, out):
    """out[c, d, m] (out one pass's (chunks, 32, 16, 2) of the pairs layout) = rows m0 .. m0 + 15 of
    x (M, K) BF16 bits, their pairs of chunk c in the decoder's order: two loads and two shuffles a
    row, a 16 x 16 transpose of each half (zeros past M and K)."""
    sig = types.void(x, types.intp, types.intp, out)

    def codegen(context, builder, signature, args):
        x_a, m0, c, out_a = args
        b = builder
        xarr = context.make_array(signature.args[0])(context, b, x_a)
        M, K = (b.extract_value(xarr.shape, a) for a in (0, 1))
        xstride = b.extract_value(xarr.strides, 0)
        xp = b.bitcast(xarr.data, _I8.as_pointer())
        op = simd.data_ptr(context, b, signature.args[3], out_a)
        # the chunk's pairs that lie within K: (K - 64c) / 2 of 32, as two masks of 16
        left = b.sub(b.lshr(K, _const(1)), b.shl(c, _const(5)))
        bits = b.select(b.icmp_signed(">=", left, _const(32)), _const(-1), _low_bits(b, left))
        masks = [simd.mask_of(b, b.lshr(bits, _const(16 * h)), 16) for h in (0, 1)]
        halves = ([], [])
        for m in range(16):
            row = b.add(m0, _const(m))
            at = b.gep(xp, [b.add(b.mul(row, xstride), b.shl(c, _const(7)))])
            live = b.icmp_signed("<", row, M)
            got = []
            for h in range(2):
                mask = b.and_(masks[h], b.select(live, _vconst([True] * 16, _V16I1), _vconst([False] * 16, _V16I1)))
                got.append(simd.masked_load(b, b.gep(at, [_const(64 * h)]), mask, _V16I32))
            for h in range(2):  # groups h, h + 2, h + 4, h + 6 of the row's 0-3 and 4-7 (4 pairs a group)
                halves[h].append(b.shuffle_vector(*got, _EVEN_ODD[h]))
        for h in range(2):
            for j, v in enumerate(_transposed(b, halves[h])):
                at = b.gep(op, [b.add(b.shl(c, _const(11)), _const(64 * (16 * h + j)))])
                b.store(v, b.bitcast(at, _V16I32.as_pointer()), align=64)
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True, cache=True, inline="always")
def _pairs(x, rows):
    """x (M, K) BF16 bits for the 16-row passes of `_make_dot_t` over its first `rows` rows (a
    multiple of 16): (rows / 16, K / 64 rounded up, 32, 16, 2), zeros past M and K, in which
    [p, c, d, m] holds row 16p + m's pair d of chunk c in the order the chunk decoder leaves W (the
    words 2d, 2d + 1 of `_fill_chunks`' 64), so that one 64-byte load gives a pass's 16 pairs d."""
    M, K = x.shape
    chunks = (K + 63) >> 6
    out = aligned_empty_u16(rows * chunks * 64).reshape((rows >> 4, chunks, 32, 16, 2))  # written whole
    for p in range(rows >> 4):
        for c in range(chunks):
            _pairs_chunk(x, 16 * p, c, out[p])
    return out


@njit(nogil=True, cache=True, inline="always")
def _no_pairs():
    """The pairs layout of no rows: `_chunk_rows` takes every pass from the chunk layout."""
    return aligned_zeros_u16(0).reshape((0, 0, 32, 16, 2))
