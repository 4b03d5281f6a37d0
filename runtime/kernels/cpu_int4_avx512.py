"""AVX-512 rows of the CPU INT4 kernels (cpu_int4.py): a row of W decoded 64 columns at a time into
four <16 x float> and multiplied with the rows of x, or stored, as LLVM IR inside numba intrinsics
(simd.py).

A block of the `int4` layout (int4.py) decodes without a per-column branch or scan: each of its
three symbol planes is a mask register, so the symbols are three masked ORs of a byte constant;
the block's escape indices are cut out of their packed bits at once (a constant byte permute puts
each run of eight in a qword, `vpmultishiftqb` shifts each to its byte), `vpexpandb` spreads them
over the escape mask p0 & p1 & p2 and a XOR puts each into its escape's symbol 7; a masked OR of
8 (16 at 4 index bits) puts the escapes past the short symbols, and a two-table `vpermi2ps` turns
each byte into the value nibble - 8 (cpu_int4._slot). The uncoded baseline splits 32 bytes of
packed words into their low and high nibbles and looks each up in a 16-value table (`vpermps`). A
byte reaches its lane's index by one `vpermb` a quarter (`_spread`: the permutes read the low bits
only), where zero-extending it took seven instructions a block.

Each intrinsic takes a whole row (its blocks in a loop), for one `payload_bits` (made per value,
picked by `coded_dot` and `coded_rows`): `dot` adds value * scale * x[m, c] to acc[m, c % 64] for
every row m of x (acc (M, 64) fp32), `rows` writes value * scale to out[c] (and returns the first
escape after the blocks, so a row can be decoded a tile at a time); `row_scales` decodes a row's
scales 16 at a time. `dense_chunk` multiplies a decoded row with CHUNK rows of x in registers;
for BF16 x, `coded_pairs` and `plain_pairs` decode a row to nibble - 8 as BF16 pairs (a word
permute of the slots), `transpose_pairs` interleaves 16 such rows (a 16 x 16 transpose of 32-bit
lanes in registers) and `dense_rows_bf16` multiplies them with 4, 8 or 16 rows of x
(AVX512_BF16). They need AVX-512 (F, BW, VBMI, VBMI2), 64 | K and a power-of-two group of 32 or
more (cpu_int4._path). The portable kernels of cpu_int4.py are their oracle in the tests.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

from unweight.codec import simd

_I1, _I8, _I32, _I64 = simd.I1, simd.I8, simd.I32, simd.I64
_V16F32, _V16I32 = simd.V16F32, simd.V16I32
_V64I8, _V64I1, _V32I8 = ir.VectorType(_I8, 64), ir.VectorType(_I1, 64), ir.VectorType(_I8, 32)
_V64I32, _V32I32 = ir.VectorType(_I32, 64), ir.VectorType(_I32, 32)
_V16I16, _V32I16 = ir.VectorType(ir.IntType(16), 16), ir.VectorType(ir.IntType(16), 32)
_const, _vconst = simd.const, simd.vconst
FAST_PATH = simd.has("avx512f", "avx512bw", "avx512vbmi", "avx512vbmi2")
MODES = ("dot", "rows")
BF16_PATH = FAST_PATH and simd.has("avx512bf16")  # ... and vdpbf16ps, for BF16 x
CHUNK = 8  # rows of x dense_chunk holds in registers
HELD_ROWS = 8  # rows of x `dot` holds in registers (4 registers a row up to 4 rows, else 1)
CHUNKS_BF16 = (4, 8, 16)  # rows of BF16 x dense_rows_bf16 holds in registers, by the rows of x


def _with_bits(b, t, bits, value, op):
    """<64 x i8> `t` with byte j replaced by op(t[j], value) where bit j of the i64 `bits` is set
    (a masked OR or XOR)."""
    return b.select(b.bitcast(bits, _V64I1), op(t, _vconst([value] * 64, _V64I8)), t)


def _spread(b, t):
    """The <64 x i8> `t` as four <16 x i32> whose low bytes are its bytes (the other three bytes of
    a lane are any): one `vpermb` each, for the permutes that read an index's low bits only."""
    permb = simd.function(b, "llvm.x86.avx512.permvar.qi.512", _V64I8, [_V64I8, _V64I8])
    out = []
    for q in range(4):
        idx = _vconst([16 * q + lane // 4 if lane % 4 == 0 else 0 for lane in range(64)], _V64I8)
        out.append(b.bitcast(b.call(permb, [t, idx]), _V16I32))
    return out


def _coded_block(b, symp, escp, at, e, tables, pb):
    """The block at sym[at] (first escape e): its four <16 x float> values (nibble - 8, unscaled) and
    the next block's first escape."""
    t, e_next = _coded_slots(b, symp, escp, at, e, pb)
    permi2 = simd.function(b, "llvm.x86.avx512.vpermi2var.ps.512", _V16F32, [_V16F32, _V16I32, _V16F32])
    return [b.call(permi2, [tables[0], q, tables[1]]) for q in _spread(b, t)], e_next


def _coded_slots(b, symp, escp, at, e, pb):
    """The block at sym[at] (first escape e): the <64 x i8> table slots of its columns
    (cpu_int4._slot) and the next block's first escape."""
    planes = [simd.load(b, symp, b.shl(b.add(at, _const(k)), _const(3)), _I64, align=8) for k in range(3)]
    mask = b.and_(b.and_(planes[0], planes[1]), planes[2])
    t = _vconst([0] * 64, _V64I8)
    for k in range(3):
        t = _with_bits(b, t, planes[k], 1 << k, b.or_)
    if pb:  # the block's indices, pb bits each from bit pb * e: qword q of `fields` holds the 8 from index 8q
        bit = b.mul(e, _const(pb))
        raw = simd.load(b, escp, b.ashr(bit, _const(3)), _V64I8, align=1)
        src = b.shuffle_vector(raw, raw, _vconst([pb * q + i for q in range(8) for i in range(8)], _V64I32))
        shift = b.trunc(b.and_(bit, _const(7)), _I8)
        ctrl = b.add(_vconst([pb * i for _ in range(8) for i in range(8)], _V64I8), simd.splat(b, shift, _V64I8))
        multishift = simd.function(b, "llvm.x86.avx512.pmultishift.qb.512", _V64I8, [_V64I8, _V64I8])
        fields = b.and_(b.call(multishift, [ctrl, src]), _vconst([(1 << pb) - 1] * 64, _V64I8))
        expand = simd.function(b, "llvm.x86.avx512.mask.expand.v64i8", _V64I8, [_V64I8, _V64I8, _V64I1])
        t = b.xor(t, b.call(expand, [fields, _vconst([0] * 64, _V64I8), b.bitcast(mask, _V64I1)]))
    t = _with_bits(b, t, mask, 16 if pb == 4 else 8, b.or_)  # escapes past the short symbols (cpu_int4._slot)
    return t, b.add(e, simd.ctpop64(b, mask))


def _word_table(b, tables):
    """<32 x i16>: the BF16 bits of the 32 fp32 table values (small integers: exact)."""
    halves = [b.trunc(b.lshr(b.bitcast(t, _V16I32), _vconst([16] * 16, _V16I32)), _V16I16) for t in tables]
    return b.shuffle_vector(halves[0], halves[1], _vconst(list(range(32)), _V32I32))


def _bf16_halves(b, t, words):
    """The BF16 values words[t[c]] of a block's 64 slots, as two <16 x i32> of BF16 pairs (columns
    0..31 and 32..63, column 2k in the low half of lane k)."""
    permw = simd.function(b, "llvm.x86.avx512.permvar.hi.512", _V32I16, [_V32I16, _V32I16])
    out = []
    for h in range(2):
        idx = b.zext(b.shuffle_vector(t, t, _vconst(list(range(32 * h, 32 * h + 32)), _V32I32)), _V32I16)
        out.append(b.bitcast(b.call(permw, [words, idx]), _V16I32))
    return out


def _plain_nibbles(b, packedp, word):
    """The <64 x i8> nibbles of the 64 columns at packed[word]."""
    raw = simd.load(b, packedp, b.shl(word, _const(2)), _V32I8, align=4)
    low = b.and_(raw, _vconst([15] * 32, _V32I8))
    high = b.lshr(raw, _vconst([4] * 32, _V32I8))
    return b.shuffle_vector(low, high, _vconst([j // 2 + 32 * (j % 2) for j in range(64)], _V64I32))


def _plain_block(b, packedp, word):
    """The four <16 x float> values (nibble - 8) of the 64 columns at packed[word]."""
    t = _plain_nibbles(b, packedp, word)
    permps = simd.function(b, "llvm.x86.avx512.permvar.sf.512", _V16F32, [_V16F32, _V16I32])
    values = ir.Constant(_V16F32, [ir.Constant(simd.F32, float(n - 8)) for n in range(16)])
    return [b.call(permps, [values, q]) for q in _spread(b, t)]


def _scaled(b, values, scalesp, c0, gshift):
    """values * the scales of columns c0 .. c0 + 31 and c0 + 32 .. c0 + 63 (groups of 1 << gshift)."""
    out = []
    for h in range(2):
        g = b.lshr(b.add(c0, _const(32 * h)), gshift)
        sv = simd.splat(b, simd.load(b, scalesp, b.shl(g, _const(2)), simd.F32, align=4), _V16F32)
        out += [b.fmul(values[2 * h + i], sv) for i in range(2)]
    return out


def _row_loop(b, context, sig, args, mode, blocks, block, out_at):
    """For each of the row's blocks, block(index) -> (its four scaled <16 x float> values, its first
    column c0), then mode `rows`: out[c0:c0 + 64] = values (out: args[out_at]); mode `dot`:
    acc[m, 0:64] += values * x[m, c0:c0 + 64] for every row m of x (x, acc: args[out_at],
    args[out_at + 1]), the sums of up to HELD_ROWS rows of x kept in registers over the row (one
    decoded block serves them all), more rows through acc in memory."""
    if mode == "rows":
        op = simd.data_ptr(context, b, sig.args[out_at], args[out_at])
        with cgutils.for_range(b, blocks) as loop:
            values, c0 = block(loop.index)
            for q in range(4):
                simd.store(b, values[q], op, b.add(b.shl(c0, _const(2)), _const(64 * q)), align=4)
        return
    xp, (xstride, _), (rows, _) = simd.array_parts(context, b, sig.args[out_at], args[out_at])
    ap, (astride, _), _ = simd.array_parts(context, b, sig.args[out_at + 1], args[out_at + 1])
    fma = simd.function(b, "llvm.fma.v16f32", _V16F32, [_V16F32] * 3)

    def held(count):
        """`count` rows of x, their sums in registers over the row: four a row up to 4 rows, else
        one (the row's four products chained into it; acc[m, 16:64] then stays as it was)."""
        arows = [b.gep(ap, [b.mul(_const(m), astride)]) for m in range(count)]
        regs = 4 if count <= 4 else 1
        sums = [
            [
                cgutils.alloca_once_value(b, simd.load(b, arows[m], _const(64 * q), _V16F32, align=4))
                for q in range(regs)
            ]
            for m in range(count)
        ]
        with cgutils.for_range(b, blocks) as loop:
            values, c0 = block(loop.index)
            for m in range(count):
                xrow = b.gep(xp, [b.add(b.mul(_const(m), xstride), b.shl(c0, _const(2)))])
                for q in range(4):
                    xv = simd.load(b, xrow, _const(64 * q), _V16F32, align=4)
                    b.store(b.call(fma, [values[q], xv, b.load(sums[m][q % regs])]), sums[m][q % regs])
        for m in range(count):
            for q in range(regs):
                simd.store(b, b.load(sums[m][q]), arows[m], _const(64 * q), align=4)

    def through_memory():
        with cgutils.for_range(b, blocks) as loop:
            values, c0 = block(loop.index)
            with cgutils.for_range(b, rows) as inner:
                m = inner.index
                xrow = b.gep(xp, [b.add(b.mul(m, xstride), b.shl(c0, _const(2)))])
                arow = b.gep(ap, [b.mul(m, astride)])
                for q in range(4):
                    av = simd.load(b, arow, _const(64 * q), _V16F32, align=4)
                    xv = simd.load(b, xrow, _const(64 * q), _V16F32, align=4)
                    simd.store(b, b.call(fma, [values[q], xv, av]), arow, _const(64 * q), align=4)

    def pick(count):
        if count > HELD_ROWS:
            through_memory()
            return
        with b.if_else(b.icmp_signed("==", rows, _const(count))) as (this, other):
            with this:
                held(count)
            with other:
                pick(count + 1)

    pick(1)


@intrinsic
def dense_chunk(typingctx, w, blocks, x, acc):
    """acc[m, 0:16] += the 16-lane sums of w[c] * x[m, c], c < 64 * blocks, for CHUNK rows m of x
    (w a row of W decoded to fp32): each block of w is loaded once for the CHUNK rows, each row's
    sums held in a register over the blocks."""
    sig = types.void(w, types.int64, x, acc)

    def codegen(context, builder, signature, args):
        b = builder
        wp = simd.data_ptr(context, b, signature.args[0], args[0])
        xp, (xstride, _), _ = simd.array_parts(context, b, signature.args[2], args[2])
        ap, (astride, _), _ = simd.array_parts(context, b, signature.args[3], args[3])
        fma = simd.function(b, "llvm.fma.v16f32", _V16F32, [_V16F32] * 3)
        rows = [b.gep(ap, [b.mul(_const(m), astride)]) for m in range(CHUNK)]
        sums = [cgutils.alloca_once_value(b, simd.load(b, row, _const(0), _V16F32, align=4)) for row in rows]
        with cgutils.for_range(b, args[1]) as loop:
            at = b.shl(loop.index, _const(8))
            values = [simd.load(b, wp, b.add(at, _const(64 * q)), _V16F32, align=4) for q in range(4)]
            for m in range(CHUNK):
                xrow = b.gep(xp, [b.add(b.mul(_const(m), xstride), at)])
                acc = b.load(sums[m])
                for q in range(4):
                    acc = b.call(fma, [values[q], simd.load(b, xrow, _const(64 * q), _V16F32, align=4), acc])
                b.store(acc, sums[m])
        for m in range(CHUNK):
            simd.store(b, b.load(sums[m]), rows[m], _const(0), align=4)
        return context.get_dummy_value()

    return sig, codegen


def _make_coded(pb: int, mode: str):
    """Intrinsic (sym, at0, blocks, esc, e, values, gshift, scales, x, acc) for `dot`,
    (..., scales, out) for `rows` (which returns the first escape after the blocks): the row whose
    first block's planes are at sym[at0] and whose first escape is e, for weights of `pb` payload
    bits."""

    def codegen(context, builder, signature, args):
        b = builder
        symp, escp, tabp, scalesp = (simd.data_ptr(context, b, signature.args[i], args[i]) for i in (0, 3, 5, 7))
        tables = [simd.load(b, tabp, _const(64 * h), _V16F32, align=4) for h in range(2)]
        e = cgutils.alloca_once_value(b, args[4])

        def block(blk):
            values, e_next = _coded_block(b, symp, escp, b.add(args[1], b.mul(blk, _const(3))), b.load(e), tables, pb)
            b.store(e_next, e)
            c0 = b.shl(blk, _const(6))
            return _scaled(b, values, scalesp, c0, args[6]), c0

        _row_loop(b, context, signature, args, mode, args[2], block, 8)
        return b.load(e) if mode == "rows" else context.get_dummy_value()

    def head(sym, esc, values, scales):
        return (sym, types.int64, types.int64, esc, types.int64, values, types.int64, scales)

    if mode == "dot":

        @intrinsic
        def row(typingctx, sym, at0, blocks, esc, e, values, gshift, scales, x, acc):
            return types.void(*head(sym, esc, values, scales), x, acc), codegen

    else:

        @intrinsic
        def row(typingctx, sym, at0, blocks, esc, e, values, gshift, scales, out):
            return types.int64(*head(sym, esc, values, scales), out), codegen

    return row


def _make_plain(mode: str):
    """Intrinsic (packed, word0, blocks, gshift, scales, x, acc) for `dot`, (..., scales, out) for
    `rows`: the uncoded row whose words start at packed[word0]."""

    def codegen(context, builder, signature, args):
        b = builder
        packedp, scalesp = (simd.data_ptr(context, b, signature.args[i], args[i]) for i in (0, 4))

        def block(blk):
            c0 = b.shl(blk, _const(6))
            values = _plain_block(b, packedp, b.add(args[1], b.shl(blk, _const(3))))
            return _scaled(b, values, scalesp, c0, args[3]), c0

        _row_loop(b, context, signature, args, mode, args[2], block, 5)
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


@intrinsic
def row_scales(typingctx, smant, sexp, at, word0, G, base, out):
    """out[g] = the window scale of group g of the row whose mantissa bytes start at smant[at] and
    exponent-bit words at sexp[word0] (base exponent `base`), 16 groups a step (a listed scale's
    group gets a wrong value here: the caller puts the listed ones in)."""
    sig = types.void(smant, sexp, types.int64, types.int64, types.int64, types.int64, out)

    def codegen(context, builder, signature, args):
        b = builder
        mp, ep, op = (simd.data_ptr(context, b, signature.args[i], args[i]) for i in (0, 1, 6))
        at, word0, G, base = args[2:6]
        v16i8, v16i1 = ir.VectorType(_I8, 16), ir.VectorType(_I1, 16)
        base_v = simd.splat(b, b.trunc(base, _I32), _V16I32)
        with cgutils.for_range(b, b.ashr(b.add(G, _const(15)), _const(4))) as loop:
            g0 = b.shl(loop.index, _const(4))
            lanes = b.sub(G, g0)
            lanes = b.select(b.icmp_signed(">", lanes, _const(16)), _const(16), lanes)
            mask = simd.mask_of(b, b.sub(b.shl(_const(1), lanes), _const(1)), 16)
            m = b.zext(simd.masked_load(b, b.gep(mp, [b.add(at, g0)]), mask, v16i8), _V16I32)
            word = simd.load(b, ep, b.shl(b.add(word0, b.ashr(g0, _const(5))), _const(2)), _I32, align=4)
            high = b.trunc(b.lshr(word, b.trunc(b.and_(g0, _const(31)), _I32)), ir.IntType(16))
            two = b.select(b.bitcast(high, v16i1), _vconst([2] * 16, _V16I32), _vconst([0] * 16, _V16I32))
            code = b.or_(b.lshr(m, _vconst([7] * 16, _V16I32)), two)
            bits = b.or_(
                b.shl(b.add(base_v, code), _vconst([23] * 16, _V16I32)),
                b.shl(b.and_(m, _vconst([0x7F] * 16, _V16I32)), _vconst([16] * 16, _V16I32)),
            )
            simd.masked_store(b, b.bitcast(bits, _V16F32), b.gep(op, [b.shl(g0, _const(2))]), mask)
        return context.get_dummy_value()

    return sig, codegen


def _make_coded_pairs(pb: int):
    """Intrinsic (sym, at0, blocks, esc, e, values, out) -> the first escape after the blocks: the
    row's weights nibble - 8, unscaled, as BF16 pairs (out uint32: column c in half c % 2 of word
    c // 2), for weights of `pb` payload bits (values: cpu_int4._values' table)."""

    def codegen(context, builder, signature, args):
        b = builder
        symp, escp, tabp, outp = (simd.data_ptr(context, b, signature.args[i], args[i]) for i in (0, 3, 5, 6))
        words = _word_table(b, [simd.load(b, tabp, _const(64 * h), _V16F32, align=4) for h in range(2)])
        e = cgutils.alloca_once_value(b, args[4])
        with cgutils.for_range(b, args[2]) as loop:
            t, e_next = _coded_slots(b, symp, escp, b.add(args[1], b.mul(loop.index, _const(3))), b.load(e), pb)
            b.store(e_next, e)
            for h, half in enumerate(_bf16_halves(b, t, words)):
                simd.store(b, half, outp, b.add(b.shl(loop.index, _const(7)), _const(64 * h)), align=4)
        return b.load(e)

    @intrinsic
    def pairs(typingctx, sym, at0, blocks, esc, e, values, out):
        return types.int64(sym, types.int64, types.int64, esc, types.int64, values, out), codegen

    return pairs


@intrinsic
def plain_pairs(typingctx, packed, word0, blocks, out):
    """The uncoded row at packed[word0]: nibble - 8 as BF16 pairs, as the coded pairs intrinsics."""
    sig = types.void(packed, types.int64, types.int64, out)
    table = [((np.float32(n - 8).view(np.uint32) >> 16) & 0xFFFF) for n in range(16)] + [0] * 16

    def codegen(context, builder, signature, args):
        b = builder
        packedp, outp = (simd.data_ptr(context, b, signature.args[i], args[i]) for i in (0, 3))
        words = _vconst([int(v) - (1 << 16) if v >= 1 << 15 else int(v) for v in table], _V32I16)
        with cgutils.for_range(b, args[2]) as loop:
            t = _plain_nibbles(b, packedp, b.add(args[1], b.shl(loop.index, _const(3))))
            for h, half in enumerate(_bf16_halves(b, t, words)):
                simd.store(b, half, outp, b.add(b.shl(loop.index, _const(7)), _const(64 * h)), align=4)
        return context.get_dummy_value()

    return sig, codegen


_dot0, _dot1, _dot2, _dot3, _dot4 = (_make_coded(pb, "dot") for pb in range(5))
_pairs0, _pairs1, _pairs2, _pairs3, _pairs4 = (_make_coded_pairs(pb) for pb in range(5))
_rows0, _rows1, _rows2, _rows3, _rows4 = (_make_coded(pb, "rows") for pb in range(5))
plain_dot, plain_rows = _make_plain("dot"), _make_plain("rows")


@njit(cache=True, inline="always")
def coded_dot(pb, sym, at0, blocks, esc, e, values, gshift, scales, x, acc):
    """acc[m, c % 64] += W[r, c] * x[m, c] over the row (the intrinsic of its payload bits)."""
    if pb == 3:
        _dot3(sym, at0, blocks, esc, e, values, gshift, scales, x, acc)
    elif pb == 4:
        _dot4(sym, at0, blocks, esc, e, values, gshift, scales, x, acc)
    elif pb == 2:
        _dot2(sym, at0, blocks, esc, e, values, gshift, scales, x, acc)
    elif pb == 1:
        _dot1(sym, at0, blocks, esc, e, values, gshift, scales, x, acc)
    else:
        _dot0(sym, at0, blocks, esc, e, values, gshift, scales, x, acc)


@njit(cache=True, inline="always")
def coded_rows(pb, sym, at0, blocks, esc, e, values, gshift, scales, out):
    """out[c] = W[r, c] over the blocks; returns the first escape after them."""
    if pb == 3:
        return _rows3(sym, at0, blocks, esc, e, values, gshift, scales, out)
    if pb == 4:
        return _rows4(sym, at0, blocks, esc, e, values, gshift, scales, out)
    if pb == 2:
        return _rows2(sym, at0, blocks, esc, e, values, gshift, scales, out)
    if pb == 1:
        return _rows1(sym, at0, blocks, esc, e, values, gshift, scales, out)
    return _rows0(sym, at0, blocks, esc, e, values, gshift, scales, out)


def _transpose16(b, rows):
    """The 16 x 16 matrix of 32-bit lanes `rows` (16 <16 x i32>) transposed: four rounds of
    two-register shuffles, each swapping the off-diagonal h x h blocks of every 2h x 2h block."""
    rows = list(rows)
    for h in (8, 4, 2, 1):
        low = _vconst([lane if lane & h == 0 else 16 + lane - h for lane in range(16)], _V16I32)
        high = _vconst([lane + h if lane & h == 0 else 16 + lane for lane in range(16)], _V16I32)
        for i in range(16):
            if i & h == 0:
                a, c = rows[i], rows[i + h]
                rows[i], rows[i + h] = b.shuffle_vector(a, c, low), b.shuffle_vector(a, c, high)
    return rows


@intrinsic
def transpose_pairs(typingctx, w, subs, out):
    """out[j, k, r] = w[r, 16 j + k] for the 16 rows r of w (BF16 pairs, uint32 (16, >= 16 subs))
    and its first `subs` sub-groups j of 32 columns: lane r of the 16-lane vector (j, k) is row r's
    pair k of sub-group j, the order dense_rows_bf16 multiplies in."""
    sig = types.void(w, types.int64, out)

    def codegen(context, builder, signature, args):
        b = builder
        wp, (wstride, _), _ = simd.array_parts(context, b, signature.args[0], args[0])
        op = simd.data_ptr(context, b, signature.args[2], args[2])
        with cgutils.for_range(b, args[1]) as loop:
            at = b.shl(loop.index, _const(6))  # 16 pairs a sub-group
            rows = [simd.load(b, wp, b.add(b.mul(_const(r), wstride), at), _V16I32, align=4) for r in range(16)]
            base = b.shl(loop.index, _const(10))  # 16 x 16 pairs a sub-group
            for k, vec in enumerate(_transpose16(b, rows)):
                simd.store(b, vec, op, b.add(base, _const(64 * k)), align=4)
        return context.get_dummy_value()

    return sig, codegen


def _make_dense_rows_bf16(chunk: int):
    """Intrinsic (wt, subs, xt, scales, acc): acc[m, r] += sum over sub-groups j < subs of
    scales[j, r] * (row r's 32 products w * x of sub-group j), for 16 rows r of W (wt in
    transpose_pairs' order) and `chunk` rows m of BF16 x (BF16 pairs, uint32): each x pair is
    broadcast to a `vdpbf16ps` with 16 rows' pairs, so a register holds one x row's sums for 16 rows
    of W, scaled by one FMA a sub-group. Each product of an integer weight and a BF16 x is exact;
    the sums are fp32 (the instruction flushes subnormal inputs and results to zero)."""

    def codegen(context, builder, signature, args):
        b = builder
        wp, sp = (simd.data_ptr(context, b, signature.args[i], args[i]) for i in (0, 3))
        xp, (xstride, _), _ = simd.array_parts(context, b, signature.args[2], args[2])
        ap, (astride, _), _ = simd.array_parts(context, b, signature.args[4], args[4])
        fma = simd.function(b, "llvm.fma.v16f32", _V16F32, [_V16F32] * 3)
        zero = ir.Constant(_V16F32, [ir.Constant(simd.F32, 0.0)] * 16)
        sums = [cgutils.alloca_once(b, _V16F32) for _ in range(chunk)]
        xrows = [b.gep(xp, [b.mul(_const(m), xstride)]) for m in range(chunk)]
        with cgutils.for_range(b, args[1]) as loop:
            for s in sums:
                b.store(zero, s)
            at, xat = b.shl(loop.index, _const(10)), b.shl(loop.index, _const(6))
            for k in range(16):
                wv = simd.load(b, wp, b.add(at, _const(64 * k)), _V16I32, align=4)
                for m in range(chunk):
                    pair = simd.load(b, xrows[m], b.add(xat, _const(4 * k)), _I32, align=4)
                    b.store(simd.dpbf16ps(b, b.load(sums[m]), wv, simd.splat(b, pair, _V16I32)), sums[m])
            scale = simd.load(b, sp, xat, _V16F32, align=4)  # (subs, 16) fp32
            for m in range(chunk):
                row = b.gep(ap, [b.mul(_const(m), astride)])
                total = simd.load(b, row, _const(0), _V16F32, align=4)
                simd.store(b, b.call(fma, [b.load(sums[m]), scale, total]), row, _const(0), align=4)
        return context.get_dummy_value()

    @intrinsic
    def dense_rows_bf16(typingctx, wt, subs, xt, scales, acc):
        return types.void(wt, types.int64, xt, scales, acc), codegen

    return dense_rows_bf16


_dense4, _dense8, _dense16 = (_make_dense_rows_bf16(c) for c in (4, 8, 16))


@njit(cache=True, inline="always")
def dense_rows_bf16(chunk, wt, subs, xt, scales, acc):
    """The dense rows intrinsic for `chunk` (4, 8 or 16) rows of x."""
    if chunk == 16:
        _dense16(wt, subs, xt, scales, acc)
    elif chunk == 8:
        _dense8(wt, subs, xt, scales, acc)
    else:
        _dense4(wt, subs, xt, scales, acc)


@njit(cache=True, inline="always")
def coded_pairs(pb, sym, at0, blocks, esc, e, values, out):
    """The row's weights nibble - 8 as BF16 pairs over the blocks; returns the first escape after
    them."""
    if pb == 3:
        return _pairs3(sym, at0, blocks, esc, e, values, out)
    if pb == 4:
        return _pairs4(sym, at0, blocks, esc, e, values, out)
    if pb == 2:
        return _pairs2(sym, at0, blocks, esc, e, values, out)
    if pb == 1:
        return _pairs1(sym, at0, blocks, esc, e, values, out)
    return _pairs0(sym, at0, blocks, esc, e, values, out)
