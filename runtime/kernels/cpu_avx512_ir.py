"""LLVM IR helpers the AVX-512 chunk kernels share (cpu_avx512.py and its cpu_avx512_* modules): the
vector types, masks of low bits, a 16 x 16 transpose of <16 x i32> registers, BF16 rounding, and
sums stored into y by columns."""

from __future__ import annotations

from llvmlite import ir

from unweight.codec import simd

_I8, _I16, _I32, _I64 = simd.I8, simd.I16, simd.I32, simd.I64
_V64I8, _V32I16, _V8I64 = ir.VectorType(_I8, 64), ir.VectorType(_I16, 32), ir.VectorType(_I64, 8)


_V16I1, _V16I32 = ir.VectorType(ir.IntType(1), 16), ir.VectorType(_I32, 16)


_const, _vconst, _splat = simd.const, simd.vconst, simd.splat


def _low_bits(builder, n):
    """(1 << n) - 1 for an i64 n below 64."""
    return builder.sub(builder.shl(_const(1), n), _const(1))


def _transposed(builder, rows):
    """The 16 <16 x i32> `rows` transposed (lane j of result i is lane i of rows[j]): at each bit of
    the index, from the highest, the off-diagonal blocks of that size trade places (two two-source
    shuffles per pair of vectors, 64 for the whole)."""
    b = builder
    for bit in (8, 4, 2, 1):
        low = _vconst([j if not j & bit else 16 + (j ^ bit) for j in range(16)], _V16I32)
        high = _vconst([j ^ bit if not j & bit else 16 + j for j in range(16)], _V16I32)
        out = list(rows)
        for i in range(16):
            if not i & bit:
                out[i] = b.shuffle_vector(rows[i], rows[i | bit], low)
                out[i | bit] = b.shuffle_vector(rows[i], rows[i | bit], high)
        rows = out
    return rows


def _bf16_words(builder, v):
    """A <n x float>'s BF16 bit patterns (<n x i16>), rounded to nearest even as torch's
    .to(torch.bfloat16) rounds (vcvtneps2bf16)."""
    n = v.type.count
    return builder.bitcast(builder.fptrunc(v, ir.VectorType(simd.BF16, n)), ir.VectorType(_I16, n))


def _store_columns(builder, sums, yp, ystride, n, live, cols, bf16_out):
    """y[m, n + t] = lane m of the <16 x float> sums[t] for m < live and t < cols (y at i8* yp, rows
    ystride bytes apart, fp32 or BF16 as `_store_rows`): the sums turned to rows of y by one 16 x 16
    transpose, each row stored by one masked store, fewer stores than lane by lane (16 a column;
    measured: docs/kernels.md, "CPU kernels")."""
    b = builder
    T = len(sums)
    rows = _transposed(
        b, [b.bitcast(v, _V16I32) for v in sums] + [ir.Constant(_V16I32, [_const(0, _I32)] * 16)] * (16 - T)
    )
    first_t = _vconst(list(range(T)), ir.VectorType(_I32, T))
    mask = simd.mask_of(b, _low_bits(b, cols), T)
    at_n = b.gep(yp, [b.mul(n, _const(2 if bf16_out else 4))])
    for m in range(16):
        with b.if_then(b.icmp_signed("<", _const(m), live)):
            row = b.shuffle_vector(rows[m], ir.Constant(_V16I32, None), first_t)
            if bf16_out:
                row = _bf16_words(b, b.bitcast(row, ir.VectorType(simd.F32, T)))
            simd.masked_store(b, row, b.gep(at_n, [b.mul(ystride, _const(m))]), mask)
