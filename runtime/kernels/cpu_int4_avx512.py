"""AVX-512 rows of the CPU INT4 kernels (cpu_int4.py): a row of W decoded 64 columns at a time into
four <16 x float> and multiplied with the rows of x, or stored, as LLVM IR inside numba intrinsics
(simd.py).

A block of the `int4` layout (int4.py) decodes without a per-column branch or scan: each of its
three symbol planes is a mask register, so the symbols are three masked byte constants ORed; the
escapes' index bit k comes from index plane k by one `pdep` (the plane's next bits, from the
block's first escape, deposited over the escape mask p0 & p1 & p2); a two-table `vpermi2ps` turns
symbol s, or 8 + index, into the value nibble - 8. The uncoded baseline splits 32 bytes of packed
words into their low and high nibbles.

Each intrinsic takes a whole row (its blocks in a loop), for one `payload_bits` (made per value,
picked by `coded_row`): `dot` adds value * scale * x[m, c] to acc[m, c % 64] for every row m of x
(acc (M, 64) fp32), `rows` writes value * scale to out[c]. They need AVX-512 (F, BW), BMI2, 64 | K
and a power-of-two group of 32 or more (cpu_int4._fast). The portable kernels of cpu_int4.py are
their oracle in the tests.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

from unweight.codec import simd

_I1, _I8, _I32, _I64, _I128 = simd.I1, simd.I8, simd.I32, simd.I64, ir.IntType(128)
_V16F32, _V16I32 = simd.V16F32, simd.V16I32
_V64I8, _V64I1, _V32I8 = ir.VectorType(_I8, 64), ir.VectorType(_I1, 64), ir.VectorType(_I8, 32)
_V64I32 = ir.VectorType(_I32, 64)
_const, _vconst = simd.const, simd.vconst
FAST_PATH = simd.has("avx512f", "avx512bw", "bmi2")
MODES = ("dot", "rows")


def _bytes_where(b, bits, value):
    """<64 x i8>: `value` where bit j of the i64 `bits` is set, else 0."""
    return b.select(b.bitcast(bits, _V64I1), _vconst([value] * 64, _V64I8), _vconst([0] * 64, _V64I8))


def _quarters(b, t):
    """The <64 x i8> `t` as four <16 x i32> (zero-extended)."""
    return [
        b.zext(b.shuffle_vector(t, t, _vconst(list(range(16 * q, 16 * q + 16)), _V16I32)), _V16I32) for q in range(4)
    ]


def _coded_block(b, symp, escp, plane_bytes, at, e, tables, pb):
    """The block at sym[at] (first escape e): its four <16 x float> values (nibble - 8, unscaled) and
    the next block's first escape."""
    planes = [simd.load(b, symp, b.shl(b.add(at, _const(k)), _const(3)), _I64, align=8) for k in range(3)]
    mask = b.and_(b.and_(planes[0], planes[1]), planes[2])
    s = b.or_(b.or_(_bytes_where(b, planes[0], 1), _bytes_where(b, planes[1], 2)), _bytes_where(b, planes[2], 4))
    t = _vconst([0] * 64, _V64I8)
    pdep = simd.function(b, "llvm.x86.bmi.pdep.64", _I64, [_I64, _I64])
    byte, shift = b.ashr(e, _const(3)), b.zext(b.and_(e, _const(7)), _I128)
    for k in range(pb):
        pair = simd.load(b, escp, b.add(b.mul(plane_bytes, _const(k)), byte), _I128, align=1)
        window = b.trunc(b.lshr(pair, shift), _I64)
        t = b.or_(t, _bytes_where(b, b.call(pdep, [window, mask]), 1 << k))
    t = b.select(b.bitcast(mask, _V64I1), b.add(t, _vconst([8] * 64, _V64I8)), s)
    permi2 = simd.function(b, "llvm.x86.avx512.vpermi2var.ps.512", _V16F32, [_V16F32, _V16I32, _V16F32])
    values = [b.call(permi2, [tables[0], q, tables[1]]) for q in _quarters(b, t)]
    return values, b.add(e, simd.ctpop64(b, mask))


def _plain_block(b, packedp, word):
    """The four <16 x float> values (nibble - 8) of the 64 columns at packed[word]."""
    raw = simd.load(b, packedp, b.shl(word, _const(2)), _V32I8, align=4)
    low = b.and_(raw, _vconst([15] * 32, _V32I8))
    high = b.lshr(raw, _vconst([4] * 32, _V32I8))
    t = b.shuffle_vector(low, high, _vconst([j // 2 + 32 * (j % 2) for j in range(64)], _V64I32))
    eight = _vconst([8] * 16, _V16I32)
    return [b.sitofp(b.sub(q, eight), _V16F32) for q in _quarters(b, t)]


def _scaled(b, values, scalesp, c0, gshift):
    """values * the scales of columns c0 .. c0 + 31 and c0 + 32 .. c0 + 63 (groups of 1 << gshift)."""
    out = []
    for h in range(2):
        g = b.lshr(b.add(c0, _const(32 * h)), gshift)
        sv = simd.splat(b, simd.load(b, scalesp, b.shl(g, _const(2)), simd.F32, align=4), _V16F32)
        out += [b.fmul(values[2 * h + i], sv) for i in range(2)]
    return out


def _emit(b, context, sig, args, mode, values, c0, out_at):
    """Mode `dot`: acc[m, 0:64] += values * x[m, c0:c0 + 64] for every row m of x (args[out_at],
    args[out_at + 1]); `rows`: out[c0:c0 + 64] = values (args[out_at])."""
    if mode == "rows":
        op = simd.data_ptr(context, b, sig.args[out_at], args[out_at])
        for q in range(4):
            simd.store(b, values[q], op, b.add(b.shl(c0, _const(2)), _const(64 * q)), align=4)
        return
    xp, (xstride, _), (rows, _) = simd.array_parts(context, b, sig.args[out_at], args[out_at])
    ap, (astride, _), _ = simd.array_parts(context, b, sig.args[out_at + 1], args[out_at + 1])
    fma = simd.function(b, "llvm.fma.v16f32", _V16F32, [_V16F32] * 3)
    with cgutils.for_range(b, rows) as loop:
        m = loop.index
        xrow = b.gep(xp, [b.add(b.mul(m, xstride), b.shl(c0, _const(2)))])
        arow = b.gep(ap, [b.mul(m, astride)])
        for q in range(4):
            av = simd.load(b, arow, _const(64 * q), _V16F32, align=4)
            xv = simd.load(b, xrow, _const(64 * q), _V16F32, align=4)
            simd.store(b, b.call(fma, [values[q], xv, av]), arow, _const(64 * q), align=4)


def _make_coded(pb: int, mode: str):
    """Intrinsic (sym, at0, blocks, esc, plane_words, e, values, gshift, scales, x, acc) for `dot`,
    (..., scales, out) for `rows`: the row whose first block's planes are at sym[at0] and whose
    first escape is e, for weights of `pb` payload bits."""

    def codegen(context, builder, signature, args):
        b = builder
        symp, escp, tabp, scalesp = (simd.data_ptr(context, b, signature.args[i], args[i]) for i in (0, 3, 6, 8))
        tables = [simd.load(b, tabp, _const(64 * h), _V16F32, align=4) for h in range(2)]
        e = cgutils.alloca_once_value(b, args[5])
        plane_bytes = b.shl(args[4], _const(2))
        with cgutils.for_range(b, args[2]) as loop:
            blk = loop.index
            at = b.add(args[1], b.mul(blk, _const(3)))
            values, e_next = _coded_block(b, symp, escp, plane_bytes, at, b.load(e), tables, pb)
            b.store(e_next, e)
            c0 = b.shl(blk, _const(6))
            _emit(b, context, signature, args, mode, _scaled(b, values, scalesp, c0, args[7]), c0, 9)
        return context.get_dummy_value()

    def head(sym, esc, values, scales):
        return (sym, types.int64, types.int64, esc, types.int64, types.int64, values, types.int64, scales)

    if mode == "dot":

        @intrinsic
        def row(typingctx, sym, at0, blocks, esc, plane_words, e, values, gshift, scales, x, acc):
            return types.void(*head(sym, esc, values, scales), x, acc), codegen

    else:

        @intrinsic
        def row(typingctx, sym, at0, blocks, esc, plane_words, e, values, gshift, scales, out):
            return types.void(*head(sym, esc, values, scales), out), codegen

    return row


def _make_plain(mode: str):
    """Intrinsic (packed, word0, blocks, gshift, scales, x, acc) for `dot`, (..., scales, out) for
    `rows`: the uncoded row whose words start at packed[word0]."""

    def codegen(context, builder, signature, args):
        b = builder
        packedp, scalesp = (simd.data_ptr(context, b, signature.args[i], args[i]) for i in (0, 4))
        with cgutils.for_range(b, args[2]) as loop:
            c0 = b.shl(loop.index, _const(6))
            values = _plain_block(b, packedp, b.add(args[1], b.shl(loop.index, _const(3))))
            _emit(b, context, signature, args, mode, _scaled(b, values, scalesp, c0, args[3]), c0, 5)
        return context.get_dummy_value()

    if mode == "dot":

        @intrinsic
        def row(typingctx, packed, word0, blocks, gshift, scales, x, acc):
            return types.void(packed, types.int64, types.int64, types.int64, scales, x, acc), codegen

    else:

        @intrinsic
        def row(typingctx, packed, word0, blocks, gshift, scales, out):
            return types.void(packed, types.int64, types.int64, types.int64, scales, out), codegen

    return row


_dot0, _dot1, _dot2, _dot3, _dot4 = (_make_coded(pb, "dot") for pb in range(5))
_rows0, _rows1, _rows2, _rows3, _rows4 = (_make_coded(pb, "rows") for pb in range(5))
plain_dot, plain_rows = _make_plain("dot"), _make_plain("rows")


@njit(cache=True, inline="always")
def coded_dot(pb, sym, at0, blocks, esc, words, e, values, gshift, scales, x, acc):
    """acc[m, c % 64] += W[r, c] * x[m, c] over the row (the intrinsic of its payload bits)."""
    if pb == 3:
        _dot3(sym, at0, blocks, esc, words, e, values, gshift, scales, x, acc)
    elif pb == 4:
        _dot4(sym, at0, blocks, esc, words, e, values, gshift, scales, x, acc)
    elif pb == 2:
        _dot2(sym, at0, blocks, esc, words, e, values, gshift, scales, x, acc)
    elif pb == 1:
        _dot1(sym, at0, blocks, esc, words, e, values, gshift, scales, x, acc)
    else:
        _dot0(sym, at0, blocks, esc, words, e, values, gshift, scales, x, acc)


@njit(cache=True, inline="always")
def coded_rows(pb, sym, at0, blocks, esc, words, e, values, gshift, scales, out):
    """out[c] = W[r, c] over the row."""
    if pb == 3:
        _rows3(sym, at0, blocks, esc, words, e, values, gshift, scales, out)
    elif pb == 4:
        _rows4(sym, at0, blocks, esc, words, e, values, gshift, scales, out)
    elif pb == 2:
        _rows2(sym, at0, blocks, esc, words, e, values, gshift, scales, out)
    elif pb == 1:
        _rows1(sym, at0, blocks, esc, words, e, values, gshift, scales, out)
    else:
        _rows0(sym, at0, blocks, esc, words, e, values, gshift, scales, out)
