"""The chunk decoder of the AVX-512 kernels (cpu_avx512.py): 64 weights of the serving layout at a time.

A chunk of eight code groups (64 weights) becomes 64 BF16 values in two zmm registers with about a
dozen vector instructions, against 14 for each group of 8 in cpu_avx2's decoder:
  codes:   the chunk's 24 code bytes (a plain 64-byte load where the stream holds 64 bytes from
           there, else a masked one: nothing past the stream is read) are spread by one vpermb,
           the other bytes zeroed, so that each qword holds one group's three bit planes in its
           top bytes; one vgf2p8affineqb transposes each qword's 8x8 bit matrix, which leaves the code of weight
           i of that group in byte i (the planes are bits 0, 1 and 2 of the codes);
  escapes: vpcmpeqb against 7 gives the escape mask; vpshufb of a table gives base + code for
           the others, and vpexpandb, under that mask, reads the next escape bytes straight into
           the escaped lanes (as many bytes as there are escapes; popcnt of the mask moves on);
  merge:   with the chunk's 64 sign-and-mantissa bytes, two vpternlog-style selects build each
           weight's low byte (exponent bit 0 and mantissa) and high byte (sign and exponent bits
           1-7), and vpunpcklbw / vpunpckhbw interleave them into BF16 words: groups 0, 2, 4, 6 of
           the chunk in one register, 1, 3, 5, 7 in the other.
Rows written to memory take one vpermq of the exponent and of the sign-and-mantissa bytes first,
so that the two registers hold weights in row order. A row's last chunk may hold fewer than
eight groups: its loads and stores are masked, so no kernel here reads past a stream or needs the
portable decoder for the last rows of a tensor. Each chunk prefetches its streams some groups of
work ahead (PREFETCH, PREFETCH_LONG): the decoder outruns the hardware prefetcher.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from unweight.codec import simd

from .cpu_avx512_ir import _I8, _I32, _I64, _V8I64, _V32I16, _V64I8, _const, _low_bits, _splat, _vconst

# (groups of work ahead, locality) of each chunk's prefetches of its streams, locality 3 into L1 and 2
# into L2: the chunk decoder asks for bytes faster than the hardware prefetcher brings them. Measured
# distances: docs/kernels.md, "CPU kernels", "The constants of the 64-weight chunks".
PREFETCH = ((192, 3),)
# Where a chunk's work is long (passes of 8 or 16 rows of x, `_make_dot`; W decoded row after row for
# the GEMMs): into L2 512 groups on and from there into L1 64 on (see docs/kernels.md, as PREFETCH).
PREFETCH_LONG = ((512, 2), (64, 3))
ESC_AHEAD = 192  # bytes of esc each chunk prefetches ahead of its position


# vpermb control: qword g's bytes 5, 6, 7 take group g's code bytes 2, 1, 0 (the bit planes of code
# bits 2, 1, 0: vgf2p8affineqb's matrix row for result bit i is byte 7 - i); its bytes 0-4, which
# the vpermb's mask (`_PLANE_BYTES`) zeroes, take byte 63
_CODE_IDX = [3 * (j // 8) + 7 - j % 8 if j % 8 >= 5 else 63 for j in range(64)]
_PLANE_BYTES = _vconst([j % 8 >= 5 for j in range(64)], ir.VectorType(ir.IntType(1), 64))
_ZERO64 = ir.Constant(_V64I8, [ir.Constant(_I8, 0)] * 64)
_UNPACK = [  # vpunpcklbw / vpunpckhbw of (low bytes, high bytes) as shuffles of the 128 bytes of both
    [16 * (j // 16) + h * 8 + (j % 16) // 2 + (64 if j % 2 else 0) for j in range(64)] for h in (0, 1)
]
# vpunpcklbw takes the low qword of each 128-bit lane, vpunpckhbw the high one: groups 0, 2, 4, 6
# and 1, 3, 5, 7 of the chunk. For rows in order, one vpermq first puts group L in lane L's low
# qword and group L + 4 in its high one (the dot product lays x out to match instead).
_ROW_ORDER = [q // 2 + 4 * (q % 2) for q in range(8)]


class _ChunkEmitter:
    """IR for the chunks of one row: `chunk(g, groups)` gives the BF16 words of groups g..g + 7
    (groups g..g + groups - 1 when `groups`, an i64 below 8, is given; the rest are finite values
    that zero x multiplies) as two <64 x i8>: with `in_order`, weights 8g..8g + 31 and 8g + 32..8g
    + 63; else groups g, g + 2, g + 4, g + 6 and g + 1, g + 3, g + 5, g + 7 (two vpermq fewer)."""

    def __init__(
        self, context, builder, sig_args, sm, sm_off, codes, codes_off, esc, k0, base, in_order, ahead, span=None
    ):
        b = self.b = builder
        self.in_order = in_order
        # prefetches (`ahead`: PREFETCH or PREFETCH_LONG) follow the order the chunks are used in: a
        # row's G groups, then the next row's (`span` (G, skip): the next row's start lies `skip`
        # groups past this one's end, where a GEMV takes W's columns a segment at a time; rows lie
        # end to end without it)
        self.ahead = [
            (
                dist,
                level,
                None if span is None else (*span, b.udiv(_const(dist), span[0]), b.urem(_const(dist), span[0])),
            )
            for dist, level in ahead
        ]
        self.sm = b.gep(simd.data_ptr(context, b, sig_args[0], sm), [sm_off])
        self.codes = b.gep(simd.data_ptr(context, b, sig_args[2], codes), [codes_off])
        self.esc = simd.data_ptr(context, b, sig_args[4], esc)
        self.pos = cgutils.alloca_once_value(b, k0)
        # the last offset from this row's codes on at which 64 bytes of the stream remain
        n_codes = b.extract_value(context.make_array(sig_args[2])(context, b, codes).shape, 0)
        self.codes_room = b.sub(b.sub(n_codes, codes_off), _const(64))
        # vpshufb table in each 128-bit lane: byte c is base + c (the escape code 7's is overwritten)
        self.lut = b.add(_splat(b, b.trunc(base, _I8), _V64I8), _vconst([j % 16 for j in range(64)], _V64I8))
        self.idx = _vconst(_CODE_IDX, _V64I8)
        self.unit = _vconst([1 << (j % 8) for j in range(64)], _V64I8)  # x of the transpose: byte i = bit i
        self.seven = _vconst([7] * 64, _V64I8)
        self.permb = simd.function(b, "llvm.x86.avx512.permvar.qi.512", _V64I8, [_V64I8, _V64I8])
        self.affine = simd.function(b, "llvm.x86.vgf2p8affineqb.512", _V64I8, [_V64I8, _V64I8, _I8])
        self.pshufb = simd.function(b, "llvm.x86.avx512.pshuf.b.512", _V64I8, [_V64I8, _V64I8])
        self.prefetch = simd.function(b, "llvm.prefetch", ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32])

    def _row_order(self, v):
        b = self.b
        q = b.shuffle_vector(
            b.bitcast(v, _V8I64), ir.Constant(_V8I64, None), _vconst(_ROW_ORDER, ir.VectorType(_I32, 8))
        )
        return b.bitcast(q, _V64I8)

    def chunk(self, g, groups=None):
        b = self.b
        code_bits = _const(0xFFFFFF) if groups is None else _low_bits(b, b.mul(groups, _const(3)))
        off = b.mul(g, _const(3))
        at = b.gep(self.codes, [off])

        def masked_load():
            return simd.masked_load(b, at, simd.mask_of(b, code_bits, 64), _V64I8)

        if groups is None:
            # a plain 64-byte load wherever the stream holds 64 bytes from the chunk on (all but its
            # last chunks), the bytes past the chunk's 24 zeroed by the vpermb's mask: a masked load
            # costs about two cycles more beside vdpbf16ps (measured: docs/kernels.md, "CPU kernels")
            with b.if_else(b.icmp_signed("<=", off, self.codes_room), likely=True) as (plain, masked):
                with plain:
                    wide, wide_at = simd.load(b, at, _const(0), _V64I8), b.basic_block
                with masked:
                    narrow, narrow_at = masked_load(), b.basic_block
            planes = b.phi(_V64I8)
            planes.add_incoming(wide, wide_at)
            planes.add_incoming(narrow, narrow_at)
        else:
            planes = masked_load()
        spread = b.select(_PLANE_BYTES, b.call(self.permb, [planes, self.idx]), _ZERO64)
        code = b.call(self.affine, [self.unit, spread, ir.Constant(_I8, 0)])
        # the exponent byte: base + code, or for the escape code the next byte of esc (in row order)
        escaped = b.icmp_unsigned("==", code, self.seven)
        pos = b.load(self.pos)
        e = simd.expand_load(b, b.gep(self.esc, [pos]), escaped, b.call(self.pshufb, [self.lut, code]))
        b.store(b.add(pos, simd.ctpop64(b, b.bitcast(escaped, _I64))), self.pos)
        sm_at = b.gep(self.sm, [b.shl(g, _const(3))])
        # the streams' bytes `dist` groups of work on (prefetches do not fault past a stream's end);
        # the escapes ESC_AHEAD bytes on, into L1
        for dist, level, span in self.ahead:
            ahead = b.add(g, _const(dist))
            if span is not None:  # dist = rows * G + rest: rows or rows + 1 rows on, `skip` groups a row
                G, skip, rows, rest = span
                rows = b.add(rows, b.zext(b.icmp_unsigned(">=", b.add(g, rest), G), _I64))
                ahead = b.add(ahead, b.mul(rows, skip))
            for at in (b.gep(self.sm, [b.shl(ahead, _const(3))]), b.gep(self.codes, [b.mul(ahead, _const(3))])):
                b.call(self.prefetch, [at, ir.Constant(_I32, 0), ir.Constant(_I32, level), ir.Constant(_I32, 1)])
        at = b.gep(self.esc, [b.add(pos, _const(ESC_AHEAD))])
        b.call(self.prefetch, [at, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        if groups is None:
            s = simd.load(b, sm_at, _const(0), _V64I8)
        else:
            s = simd.masked_load(b, sm_at, simd.mask_of(b, _low_bits(b, b.shl(groups, _const(3))), 64), _V64I8)
        if self.in_order:
            e, s = self._row_order(e), self._row_order(s)
        e16 = b.bitcast(e, _V32I16)
        bit0 = b.bitcast(b.shl(e16, _vconst([7] * 32, _V32I16)), _V64I8)  # exponent bit 0 to bit 7 of its byte
        high7 = b.bitcast(b.lshr(e16, _vconst([1] * 32, _V32I16)), _V64I8)  # exponent bits 1-7 to bits 0-6
        top, low = _vconst([0x80] * 64, _V64I8), _vconst([0x7F] * 64, _V64I8)
        lo = b.or_(b.and_(bit0, top), b.and_(s, low))  # exponent bit 0, mantissa
        hi = b.or_(b.and_(s, top), b.and_(high7, low))  # sign, exponent bits 1-7
        return tuple(b.shuffle_vector(lo, hi, _vconst(idx, ir.VectorType(_I32, 64))) for idx in _UNPACK)


def _loop(rows, G, body, ahead=False):
    """body(g, [(first 32 words, last 32 words) of each emitter's row], groups) for g = 0, 8, 16, ...
    < G, the rows decoded side by side: groups is None for whole chunks, the i64 count of groups
    left for the rows' last, shorter one. With `ahead`, each whole chunk is decoded one turn before
    its body runs, so that the body's vdpbf16ps find their operands ready and the next chunk's
    decode overlaps them (rather than waiting behind them for the scheduler's room). Passes of 8
    rows of x (W's rows in pairs) gain from it; at one row and in `_make_dot`'s 16-row pass it gains
    nothing (`_make_dot_t` decodes a chunk ahead into memory instead). Measured: docs/kernels.md,
    "CPU kernels"."""
    b = rows[0].b
    full = b.lshr(G, _const(3))
    if not ahead:
        with cgutils.for_range(b, full) as loop:
            g = b.shl(loop.index, _const(3))
            body(g, [row.chunk(g) for row in rows], None)
    else:
        with b.if_then(b.icmp_unsigned("!=", full, _const(0))):
            held = [[cgutils.alloca_once_value(b, v) for v in row.chunk(_const(0))] for row in rows]

            def decoded():
                return [tuple(b.load(h) for h in hs) for hs in held]

            with cgutils.for_range(b, b.sub(full, _const(1))) as loop:
                g = b.shl(loop.index, _const(3))
                following = [row.chunk(b.add(g, _const(8))) for row in rows]
                body(g, decoded(), None)
                for hs, vs in zip(held, following):
                    for h, v in zip(hs, vs):
                        b.store(v, h)
            body(b.shl(b.sub(full, _const(1)), _const(3)), decoded(), None)
    rest = b.and_(G, _const(7))
    with b.if_then(b.icmp_unsigned("!=", rest, _const(0))):
        g = b.sub(G, rest)
        body(g, [row.chunk(g, rest) for row in rows], rest)


def _make_bits_row(in_order: bool, ahead: tuple):
    """Intrinsic: out[i, :8G] = the row's BF16 bit patterns (out uint16), in row order or, without
    `in_order`, each chunk's 64 in the decoder's order (`_CHUNK_ORDER`; a short last chunk stored
    whole, its words past the row finite values, so out needs 64 words a chunk), prefetching its
    streams `ahead` (PREFETCH or PREFETCH_LONG); returns the esc position after the row."""

    @intrinsic
    def bits_row(typingctx, sm, sm_off, codes, codes_off, esc, k0, G, base, out, i):
        sig = types.intp(sm, types.intp, codes, types.intp, esc, types.intp, types.intp, types.intp, out, types.intp)
        return sig, codegen

    def codegen(context, builder, signature, args):
        sm_a, sm_off, codes_a, codes_off, esc_a, k0, G, base, out_a, i = args
        b = builder
        row = _ChunkEmitter(
            context, b, signature.args, sm_a, sm_off, codes_a, codes_off, esc_a, k0, base, in_order, ahead
        )
        oarr = context.make_array(signature.args[8])(context, b, out_a)
        op = b.gep(b.bitcast(oarr.data, _I8.as_pointer()), [b.mul(b.extract_value(oarr.strides, 0), i)])

        def body(g, chunks, groups):
            ((first, last),) = chunks
            at = b.gep(op, [b.shl(g, _const(4))])
            if groups is None or not in_order:
                simd.store(b, first, at, _const(0))
                simd.store(b, last, at, _const(64))
                return
            ones = _low_bits(b, b.shl(groups, _const(3)))  # the row's last 8 * groups words
            simd.masked_store(b, b.bitcast(first, _V32I16), at, simd.mask_of(b, ones, 32))
            last_mask = simd.mask_of(b, b.lshr(ones, _const(32)), 32)
            simd.masked_store(b, b.bitcast(last, _V32I16), b.gep(at, [_const(64)]), last_mask)

        _loop([row], G, body)
        return b.load(row.pos)

    return bits_row


# Rows of ids (an embedding's lookup) are not where the next row's prefetches would land; W decoded
# row after row for the GEMMs (`_chunk_block`, `_chunk_gemm`) is: its prefetches reach as far as a
# long GEMV pass's (measured: docs/kernels.md, "CPU kernels", "The constants of the 64-weight chunks").
_chunk_bits_row, _chunk_words_row = _make_bits_row(True, PREFETCH), _make_bits_row(False, PREFETCH_LONG)
