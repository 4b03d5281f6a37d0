"""The serving layout's CPU kernels on AVX-512 with VBMI, VBMI2 and GFNI: 64 weights at a time.

Where the CPU has them (`CHUNKS`: Intel Ice Lake and later, AMD Zen 4 and later), a chunk of eight
code groups (64 weights) becomes 64 BF16 values in two zmm registers with about a dozen vector
instructions, against 14 for each group of 8 in cpu_avx2's decoder:
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
The GEMV multiplies each register with the matching 32 BF16 values of each row of x (laid out in
that order once per call) by one vdpbf16ps (AVX512_BF16), summing in fp32 as cpu_avx2's BF16 kernel
does; x in fp32 (laid out the same way) meets each register widened into two <16 x float> (a BF16
value is the top half of its fp32) by FMAs, which needs no AVX512_BF16. A pass over up to 16 rows of
x takes W's columns in segments whose part of x stays in L1 (X_SEGMENT_BYTES) while every row of W
in the thread's range passes over it, each row carrying its sums and its place in the escapes from
one segment to the next; a pass of 8 or 4 rows takes W's rows two at a time, so that each load of
x serves both (passes of 2 and 1 take one, as their decode, not the loads of x, bounds them).
A pass of 16 rows of BF16 x turns the product around (`_make_dot_t`): x laid out by pairs of
columns, the 16 rows' pair in one register, and each decoded pair of weights broadcast from memory
into vdpbf16ps, so that a register of sums holds the 16 rows of x, four rows of W share each load
of x, and no sums are folded across lanes at the end. Where x has two or more passes of 16 rows
(a prompt), eight rows of W are decoded once into L1 and met by every pass (`_chunk_block`); from
GEMM_ROWS rows on, W is decoded a slab at a time into the pairs layout itself and x, read where it
lies, broadcast into vdpbf16ps against 16 rows of W a register (`_chunk_gemm`).
Rows written to memory take one vpermq of the exponent and of the sign-and-mantissa bytes first,
so that the two registers hold weights in row order. A row's last chunk may hold fewer than
eight groups: its loads and stores are masked, so no kernel here reads past a stream or needs the
portable decoder for the last rows of a tensor. Each chunk prefetches its streams some groups of
work ahead (PREFETCH, PREFETCH_LONG): the decoder outruns the hardware prefetcher.

The portable kernels (cpu_reference.py) are the oracle, in the same tests as cpu_avx2's.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic

from unweight.codec import simd

from .cpu_avx2 import BF16_DOT, _f32_at, _i64_at, _streams_at, _u16_at, aligned_empty_u16, aligned_zeros_u16

CHUNKS = simd.has("avx512bw", "avx512vbmi", "avx512vbmi2", "gfni")
CHUNK_DOT = CHUNKS and BF16_DOT  # ... and vdpbf16ps, for the GEMV of BF16 x
# (groups of work ahead, locality) of each chunk's prefetches of its streams. The chunk decoder asks
# for bytes faster than the hardware prefetcher brings them: SmolLM2's four shapes x 30 (212 MB of
# BF16, out of cache), Zen 4, into L1 192 groups on against no prefetch: 1.4-1.7x at one row of x,
# 1.5x at 16 (128 and 256 groups ahead: less).
PREFETCH = ((192, 3),)
# Where a chunk's work is long (passes of 8 or 16 rows of x, `_make_dot`), into L2 512 groups on and from there
# into L1 64 on: at 16 rows, out of cache, one core, 0.95x the time of PREFETCH (at one row, 1.08x).
PREFETCH_LONG = ((512, 2), (64, 3))
ESC_AHEAD = 192  # bytes of esc each chunk prefetches ahead of its position
PASS_ROWS = (16, 8, 4, 2, 1)  # rows of x one pass multiplies (accumulators in registers), largest first
# Bytes of x (BF16, P rows of a pass) a pass multiplies each row of W with before it moves on to the
# next columns: on Zen 4 (32 KiB L1D) sixteen rows of a 1536-wide x (48 KiB) came from L2 for every
# row of W, and that pass ran 1.7x slower per weight than over a 576-wide x, so 3/4 of L1D. On Zen
# 5 (48 KiB L1D; twice Zen 4's bandwidth from L2 to L1, by AMD's figures) the same x whole took
# 0.85x the time of two 24 KiB segments (SmolLM2's down projection at 16 rows, one core, 1.15x
# vLLM's oneDNN time against 1.36x; 16 KiB: 1.44x), so all of L1D there. FP32 x keeps 3/4 of L1D
# (X_SEGMENT_BYTES_F32): on Zen 5, 48 KiB segments of it made the down projection 1.24x slower at 8
# rows and 1.33x at 16 (cpu_gemv_bench --cold, one core, 3 alternated runs), 36 KiB ones ran as 24
# KiB ones did (0.98-1.00x).
_L1D = simd.l1d_bytes()
X_SEGMENT_BYTES = _L1D if _L1D >= 48 << 10 else _L1D * 3 // 4
X_SEGMENT_BYTES_F32 = _L1D * 3 // 4
ADD, MORE = 1, 2  # a dot's stage bits: add the row's sums so far (part); more columns follow (to part, not y)

_I8, _I16, _I32, _I64 = simd.I8, simd.I16, simd.I32, simd.I64
_V64I8, _V32I16, _V8I64 = ir.VectorType(_I8, 64), ir.VectorType(_I16, 32), ir.VectorType(_I64, 8)
_const, _vconst, _splat = simd.const, simd.vconst, simd.splat
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


def _low_bits(builder, n):
    """(1 << n) - 1 for an i64 n below 64."""
    return builder.sub(builder.shl(_const(1), n), _const(1))


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
            # costs about two cycles more beside vdpbf16ps (SmolLM2's linears out of cache, one core,
            # 6 alternated runs: 0.95-0.98x the time at one row of x, 0.95-0.99x at 16)
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
    decode overlaps them (rather than waiting behind them for the scheduler's room): passes of 8
    rows of x (W's rows in pairs) took 0.84-0.93x the time (SmolLM2's linears out of cache, one core,
    6 alternated runs); at one row and in `_make_dot`'s 16-row pass it gained nothing
    (`_make_dot_t` decodes a chunk ahead into memory instead)."""
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
# long GEMV pass's. SmolLM2's qkv, gate_up and down x 30 at 256 rows, one core, Zen 5: the decode
# alone 0.80x the time of PREFETCH's (5 rounds), the GEMM 0.99x (9 alternated rounds, o too).
_chunk_bits_row, _chunk_words_row = _make_bits_row(True, PREFETCH), _make_bits_row(False, PREFETCH_LONG)


_HALVES = [_vconst(list(range(16 * q, 16 * q + 16)), ir.VectorType(_I32, 16)) for q in (0, 1)]
_SIXTEEN = ir.Constant(ir.VectorType(_I32, 16), [ir.Constant(_I32, 16)] * 16)
_V16I1, _V16I32 = ir.VectorType(ir.IntType(1), 16), ir.VectorType(_I32, 16)
# lane j's partner at the fold's step of h lanes (h = 8, 4, 2, 1), from the first vector where bit h of
# j is clear and from the second where it is set; that bit of j picks which vector j keeps
_PARTNER = {h: _vconst([(j ^ h) + (16 if j & h else 0) for j in range(16)], _V16I32) for h in (8, 4, 2, 1)}
_KEEP_SECOND = {h: _vconst([bool(j & h) for j in range(16)], _V16I1) for h in (8, 4, 2, 1)}


def _bit_reversed(j):
    """j's four bits in reverse order: the lane in which _fold's steps leave the sums of vector j."""
    return int(f"{j:04b}"[::-1], 2)


def _fold(builder, sums):
    """The M <16 x float> sums (M a power of two up to 16) added up lane by lane: lane m of the result
    is the total of sums[m]. Each step of h lanes (8, 4, 2, 1) takes two vectors into one: a lane
    keeps its own value from the vector that bit h of its index picks (a blend) and adds its partner
    h lanes away from the same vector (one two-source shuffle), so each vector's 16 lanes add up by
    the same tree wherever it lies. The steps leave the sum of vector j in lane bit-reverse(j): with
    16 sums they go in that order; fewer are taken twice at the last steps, and one permute puts
    their lanes in order. 15 shuffles, 15 blends and 15 adds for 16 rows, against 30 shuffles and
    15 adds when both halves of each step are shuffles."""
    b = builder
    n = len(sums)
    vecs = [sums[_bit_reversed(j)] for j in range(16)] if n == 16 else list(sums)
    owner = [[i] * 16 for i in range(n)]  # owner[i][j]: which of the sums lane j of vecs[i] adds up
    for h in (8, 4, 2, 1):
        if len(vecs) == 1:
            vecs, owner = vecs * 2, owner * 2
        vecs = [
            b.fadd(b.select(_KEEP_SECOND[h], v, u), b.shuffle_vector(u, v, _PARTNER[h]))
            for u, v in zip(vecs[::2], vecs[1::2])
        ]
        owner = [[ov[j] if j & h else ou[j] for j in range(16)] for ou, ov in zip(owner[::2], owner[1::2])]
    ((total,), (lanes,)) = vecs, owner
    if n == 16:
        return total
    order = [lanes.index(m % n) for m in range(16)]  # lane m <- a lane holding sums[m]
    return b.shuffle_vector(total, ir.Constant(simd.V16F32, None), _vconst(order, _V16I32))


def _bf16_words(builder, v):
    """A <n x float>'s BF16 bit patterns (<n x i16>), rounded to nearest even as torch's
    .to(torch.bfloat16) rounds (vcvtneps2bf16)."""
    n = v.type.count
    return builder.bitcast(builder.fptrunc(v, ir.VectorType(simd.BF16, n)), ir.VectorType(_I16, n))


def _store_rows(builder, sums, yp, ystride, n, M, W, live, bf16_out):
    """y[m, n + w] = lane w * M + m of the <16 x float> sums for m < live (y at i8* yp, rows
    ystride bytes apart), fp32 or BF16 (rounded to nearest even, as torch's .to(torch.bfloat16)
    rounds: vcvtneps2bf16)."""
    b = builder
    if bf16_out:
        sums = _bf16_words(b, sums)
    lane = _I16 if bf16_out else simd.F32
    for w in range(W):
        col = b.shl(b.add(n, _const(w)), _const(1 if bf16_out else 2))
        for m in range(M):
            dst = b.gep(yp, [b.add(b.mul(ystride, _const(m)), col)])
            value = b.extract_element(sums, _const(w * M + m, _I32))
            with b.if_then(b.icmp_unsigned("<", _const(m), live)):
                b.store(value, b.bitcast(dst, lane.as_pointer()), align=2)


def _store_columns(builder, sums, yp, ystride, n, live, cols, bf16_out):
    """y[m, n + t] = lane m of the <16 x float> sums[t] for m < live and t < cols (y at i8* yp, rows
    ystride bytes apart, fp32 or BF16 as `_store_rows`): the sums turned to rows of y by one 16 x 16
    transpose, each row stored by one masked store (lane by lane, 16 stores a column, a GEMM of
    256 rows took 1.04x the time)."""
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


def _side_by_side(context, builder, sig_args, args, W, prefetch):
    """The emitters of a dot's W rows of W, n .. n + W - 1 (args as `_make_dot`'s dot takes them),
    in the decoder's order: each emitter's next row lies W rows on (a segment of G groups, `skip`
    groups to the next row), and `prefetch`'s distances are groups of work, which the W rows share."""
    b = builder
    sm_a, sm_off, codes_a, codes_off, esc_a, k, _, G, base = args[:9]
    skip = args[15]
    stride = b.add(G, skip)  # groups from one row of W to the next
    span = (G, b.add(skip, b.mul(_const(W - 1), stride)))
    ahead = tuple((dist // W, level) for dist, level in prefetch)
    return [
        _ChunkEmitter(
            context,
            b,
            sig_args,
            sm_a,
            b.add(sm_off, b.mul(_const(8 * w), stride)),
            codes_a,
            b.add(codes_off, b.mul(_const(3 * w), stride)),
            esc_a,
            b.extract_value(k, w),
            base,
            False,
            ahead,
            span,
        )
        for w in range(W)
    ]


def _make_dot(M: int, W: int = 1):
    """Intrinsic: y[m, n + w] = x[m] . W[n + w] for the M rows of x (BF16 chunks as `_bf16_chunks` lays
    them out, or fp32 ones from `_f32_chunks`; G groups of them: all of a row's columns or one
    segment) and the W rows n, n + 1, ... of W (M * W <= 16), rebuilt side by side a chunk at a
    time, so that each load of x meets every one of them; into an fp32 y, or a uint16 one as
    BF16 bits, its first `live` rows (the rest of the M are padding). `k` holds each row's first
    position in esc (a W-tuple); returns the positions after them. `stage` (ADD, MORE): the sums
    of earlier segments are added from `part[i]` (16 fp32, lane w * M + m for row m of x and row
    n + w), and where more segments follow the sums go to `part[i]` instead of y; `skip` groups
    lie between a segment's end and the next row's start."""

    @intrinsic
    def dot(typingctx, sm, sm_off, codes, codes_off, esc, k, x, G, base, y, live, n, part, i, stage, skip):
        positions = types.UniTuple(types.intp, W)
        args = (sm, types.intp, codes, types.intp, esc, positions, x, types.intp, types.intp, y, types.intp, types.intp)
        sig = positions(*args, part, types.intp, types.intp, types.intp)

        bf16_out = y.dtype == types.uint16
        fp32 = x.dtype == types.float32  # x in fp32 (`_f32_chunks`): FMAs, else BF16 bits and vdpbf16ps

        def codegen(context, builder, signature, args):
            sm_a, sm_off, codes_a, codes_off, esc_a, k, x_a, G, base, y_a, live, n, part_a, i, stage, skip = args
            b = builder
            prefetch = PREFETCH_LONG if M >= 8 else PREFETCH
            rows = _side_by_side(context, b, signature.args, args, W, prefetch)
            xarr = context.make_array(signature.args[6])(context, b, x_a)
            xp = b.bitcast(xarr.data, _I8.as_pointer())
            xstride = b.extract_value(xarr.strides, 0)
            zero = ir.Constant(simd.V16F32, [ir.Constant(simd.F32, 0.0)] * 16)
            fma = simd.function(b, "llvm.fma.v16f32", simd.V16F32, [simd.V16F32] * 3)
            # two accumulators per sum while the rows of x are few: the chain of vdpbf16ps a sum would
            # otherwise wait on is longer than a chunk's decode. By M alone, so that a row of W sums
            # alike in a pair and alone (the odd one of a range): every row range gives the bits
            # of the whole.
            split = 2 if M <= 4 else 1
            accs = [[[cgutils.alloca_once_value(b, zero) for _ in range(split)] for _ in range(M)] for _ in range(W)]

            def body(g, chunks, groups):
                xc = b.gep(xp, [b.mul(b.lshr(g, _const(3)), xstride)])
                if fp32:  # the 64 words as four <16 x float> (a BF16 word is an fp32's top half), FMAs
                    quarters = [
                        [
                            b.bitcast(
                                b.shl(b.zext(b.shuffle_vector(v, v, _HALVES[q]), simd.V16I32), _SIXTEEN), simd.V16F32
                            )
                            for v in (b.bitcast(half, _V32I16) for half in chunk)
                            for q in (0, 1)
                        ]
                        for chunk in chunks
                    ]
                    for m in range(M):
                        for j in range(4):
                            xv = simd.load(b, xc, _const(256 * m + 64 * j), simd.V16F32, align=4)
                            for w in range(W):
                                acc = accs[w][m][j % split]
                                b.store(b.call(fma, [quarters[w][j], xv, b.load(acc)]), acc)
                    return
                for m in range(M):
                    for h in range(2):
                        xv = simd.load(b, xc, _const(128 * m + 64 * h), simd.V16I32, align=2)
                        for w in range(W):
                            acc = accs[w][m][h % split]
                            b.store(simd.dpbf16ps(b, b.load(acc), b.bitcast(chunks[w][h], simd.V16I32), xv), acc)

            _loop(rows, G, body, ahead=M == 8)
            yarr = context.make_array(signature.args[9])(context, b, y_a)
            yp = b.bitcast(yarr.data, _I8.as_pointer())
            ystride = b.extract_value(yarr.strides, 0)
            sums = []
            for w in range(W):
                for m in range(M):
                    acc = b.load(accs[w][m][0])
                    sums.append(b.fadd(acc, b.load(accs[w][m][1]), flags=("fast",)) if split == 2 else acc)
            total = cgutils.alloca_once_value(b, _fold(b, sums))
            partp = b.bitcast(simd.data_ptr(context, b, signature.args[12], part_a), simd.V16F32.as_pointer())
            partp = b.gep(partp, [i])
            with b.if_then(b.icmp_unsigned("!=", b.and_(stage, _const(ADD)), _const(0))):
                b.store(b.fadd(b.load(total), b.load(partp, align=4), flags=("fast",)), total)
            with b.if_else(b.icmp_unsigned("!=", b.and_(stage, _const(MORE)), _const(0))) as (more, last):
                with more:
                    b.store(b.load(total), partp, align=4)
                with last:
                    _store_rows(b, b.load(total), yp, ystride, n, M, W, live, bf16_out)
            return context.make_tuple(b, signature.return_type, [b.load(row.pos) for row in rows])

        return sig, codegen

    return dot


_dot16, _dot8, _dot4, _dot2, _dot1 = (_make_dot(m) for m in PASS_ROWS)
_dot8x2, _dot4x2 = _make_dot(8, 2), _make_dot(4, 2)


def _make_dot_t(W: int):
    """Intrinsic: the 16-row pass of BF16 x in the pairs layout (`_pairs`: for each pair of
    columns, the 16 rows' pairs in one 64-byte vector) with the W rows n, n + 1, ... of W, whose
    chunks are decoded side by side and stored: each of a chunk's 32 pairs of W, broadcast from
    there (vdpbf16ps's 4-byte broadcast operand), meets that pair's vector of x, loaded once for the
    W rows. A sum holds the 16 rows of x in its lanes, so nothing is folded at the end, and a chunk
    reads 2 KiB of x per W rows rather than per row. The 16-row pass of `_make_dot` ran at 60-62
    GMAC/s with W in cache (one Zen 4 core; vdpbf16ps alone issues 117): beside its 32 vdpbf16ps a
    chunk, the decoder's zmm instructions, its 32 loads of x and the fold each took issue slots
    from them. Here each row's decode is spread over four rows' products and the broadcasts ride
    in vdpbf16ps's own memory operand: 68-70 GMAC/s in cache, and SmolLM2's 120 linears out of
    cache at 16 rows took 0.84-0.88x the time (one core, alternated runs; eight rows of W side by
    side: 60-64 GMAC/s in cache). Each chunk's next one is decoded and stored into the other of
    two buffers before the chunk's products, so that no decoded register is held across them, and
    _DOT_T_SUMS sums per row of W (pair d in sum d mod _DOT_T_SUMS) keep that many chains of
    vdpbf16ps a row in flight; a row sums alike whatever W it goes with. The arguments and `part`
    (16 fp32 per row of W: part[i + w], lane m) are `_make_dot`'s."""

    @intrinsic
    def dot(typingctx, sm, sm_off, codes, codes_off, esc, k, x, G, base, y, live, n, part, i, stage, skip):
        positions = types.UniTuple(types.intp, W)
        args = (sm, types.intp, codes, types.intp, esc, positions, x, types.intp, types.intp, y, types.intp, types.intp)
        sig = positions(*args, part, types.intp, types.intp, types.intp)
        bf16_out = y.dtype == types.uint16

        def codegen(context, builder, signature, args):
            sm_a, sm_off, codes_a, codes_off, esc_a, k, x_a, G, base, y_a, live, n, part_a, i, stage, skip = args
            b = builder
            rows = _side_by_side(context, b, signature.args, args, W, PREFETCH)
            xp = simd.data_ptr(context, b, signature.args[6], x_a)  # (chunks, 32, 16, 2), C order
            zero = ir.Constant(simd.V16F32, [ir.Constant(simd.F32, 0.0)] * 16)
            accs = [[cgutils.alloca_once_value(b, zero) for _ in range(_DOT_T_SUMS)] for _ in range(W)]
            scratch = cgutils.alloca_once(b, _V64I8, size=4 * W)  # two buffers of the W rows' decoded chunks

            def store(chunks, buf):
                at = b.mul(buf, _const(2 * W))
                for w, chunk in enumerate(chunks):
                    for h in range(2):
                        b.store(chunk[h], b.gep(scratch, [b.add(at, _const(2 * w + h))]), align=64)

            def products(g, buf):
                # the words are read back through a pointer LLVM cannot trace to the stores, or it
                # would take them from the registers by two shuffles each (a broadcast load folds
                # into vdpbf16ps and costs a load slot)
                at = b.ptrtoint(b.gep(scratch, [b.mul(buf, _const(2 * W))]), _I64)
                words = b.inttoptr(b.asm(ir.FunctionType(_I64, [_I64]), "", "=r,0", [at], False), _I32.as_pointer())
                xc = b.gep(xp, [b.shl(g, _const(8))])  # 2 KiB a chunk
                for d in range(32):  # pair d: word d of the first register's 16, then the second's
                    xv = simd.load(b, xc, _const(64 * d), _V16I32, align=64)
                    for w in range(W):
                        pair = simd.splat(b, b.load(b.gep(words, [_const(32 * w + d)]), align=4), _V16I32)
                        acc = accs[w][d % _DOT_T_SUMS]
                        b.store(simd.dpbf16ps(b, b.load(acc), xv, pair), acc)

            # chunk c + 1 is decoded into one buffer before chunk c's products read the other
            full = b.lshr(G, _const(3))
            with b.if_then(b.icmp_unsigned("!=", full, _const(0))):
                store([row.chunk(_const(0)) for row in rows], _const(0))
                with cgutils.for_range(b, b.sub(full, _const(1))) as loop:
                    c = loop.index
                    g = b.shl(c, _const(3))
                    store([row.chunk(b.add(g, _const(8))) for row in rows], b.and_(b.add(c, _const(1)), _const(1)))
                    products(g, b.and_(c, _const(1)))
                last = b.sub(full, _const(1))
                products(b.shl(last, _const(3)), b.and_(last, _const(1)))
            rest = b.and_(G, _const(7))
            with b.if_then(b.icmp_unsigned("!=", rest, _const(0))):  # a last, shorter chunk
                g, buf = b.sub(G, rest), b.and_(full, _const(1))
                store([row.chunk(g, rest) for row in rows], buf)
                products(g, buf)
            yarr = context.make_array(signature.args[9])(context, b, y_a)
            yp = b.bitcast(yarr.data, _I8.as_pointer())
            ystride = b.extract_value(yarr.strides, 0)
            partp = b.bitcast(simd.data_ptr(context, b, signature.args[12], part_a), simd.V16F32.as_pointer())
            totals = []
            for w in range(W):
                sums = [b.load(acc) for acc in accs[w]]
                while len(sums) > 1:  # (a tree: pairs of sums, then pairs of those)
                    sums = [b.fadd(sums[j], sums[j + 1]) for j in range(0, len(sums), 2)]
                total = cgutils.alloca_once_value(b, sums[0])
                at = b.gep(partp, [b.add(i, _const(w))])
                with b.if_then(b.icmp_unsigned("!=", b.and_(stage, _const(ADD)), _const(0))):
                    b.store(b.fadd(b.load(total), b.load(at, align=4)), total)
                totals.append((total, at))
            with b.if_else(b.icmp_unsigned("!=", b.and_(stage, _const(MORE)), _const(0))) as (more, last):
                with more:
                    for total, at in totals:
                        b.store(b.load(total), at, align=4)
                with last:
                    sums = [b.load(total) for total, _ in totals]
                    _store_columns(b, sums, yp, ystride, n, live, _const(W), bf16_out)
            return context.make_tuple(b, signature.return_type, [b.load(row.pos) for row in rows])

        return sig, codegen

    return dot


_DOT_T = 4  # rows of W a 16-row pass of BF16 x decodes side by side (`_make_dot_t`)
# sums a row of W keeps in the 16-row pass. SmolLM2's shapes x 30 (the lm_head once) at 16 rows, one
# core, Zen 5, 9 rounds alternated in one process, against two sums with the next chunk held in
# registers (`_loop`'s `ahead`): four with it held 1.08x the time (no registers left for them), two
# double-buffered 0.97x, four 0.94x (two runs: qkv and o 0.92x, gate_up 0.93-0.95x, down 0.97x,
# lm_head 0.94-0.95x), six 0.96x.
_DOT_T_SUMS = 4
_dot16t4, _dot16t2, _dot16t1 = (_make_dot_t(w) for w in (_DOT_T, 2, 1))


def _make_block(T: int, P: int):
    """Intrinsic: P passes of 16 rows of BF16 x (the pairs layout, passes p0 .. p0 + P - 1 of
    `xt`) times T rows of W decoded beforehand (`w` (T, chunks * 64), each chunk in the decoder's
    order, `_chunk_words_row`), over all of K: for each pair d of a chunk, P loads of x and each of
    the T pairs of weights broadcast into vdpbf16ps's memory operand, P * T sums in registers.
    Writes y[16p + m, n + t] for the rows m of each pass below `live` and t < cols."""

    @intrinsic
    def block(typingctx, w, xt, p0, y, live, n, cols):
        sig = types.void(w, xt, types.intp, y, types.intp, types.intp, types.intp)
        bf16_out = y.dtype == types.uint16

        def codegen(context, builder, signature, args):
            w_a, xt_a, p0, y_a, live, n, cols = args
            b = builder
            wp, (wstride, _), _ = simd.array_parts(context, b, signature.args[0], w_a)
            xp, (pstride, *_), (_, chunks, *_) = simd.array_parts(context, b, signature.args[1], xt_a)
            zero = ir.Constant(simd.V16F32, [ir.Constant(simd.F32, 0.0)] * 16)
            accs = [[cgutils.alloca_once_value(b, zero) for _ in range(P)] for _ in range(T)]
            with cgutils.for_range(b, chunks) as loop:
                c = loop.index
                xc = [b.gep(xp, [b.add(b.mul(b.add(p0, _const(p)), pstride), b.shl(c, _const(11)))]) for p in range(P)]
                wc = [
                    b.bitcast(b.gep(wp, [b.add(b.mul(wstride, _const(t)), b.shl(c, _const(7)))]), _I32.as_pointer())
                    for t in range(T)
                ]
                for d in range(32):
                    xv = [simd.load(b, xc[p], _const(64 * d), _V16I32, align=64) for p in range(P)]
                    for t in range(T):
                        pair = simd.splat(b, b.load(b.gep(wc[t], [_const(d)]), align=4), _V16I32)
                        for p in range(P):
                            b.store(simd.dpbf16ps(b, b.load(accs[t][p]), xv[p], pair), accs[t][p])
            yp, (ystride, _), _ = simd.array_parts(context, b, signature.args[3], y_a)
            for p in range(P):
                first = b.mul(b.add(p0, _const(p)), _const(16))
                sums = [b.load(accs[t][p]) for t in range(T)]
                _store_columns(
                    b, sums, b.gep(yp, [b.mul(first, ystride)]), ystride, n, b.sub(live, first), cols, bf16_out
                )

        return sig, codegen

    return block


# rows of W a block decodes, passes of x one call of the block meets it with: 16 sums. At 256 rows
# of x (SmolLM2's qkv and down, 30 layers each out of cache, one core, 2 alternated runs) 8 x 2,
# 8 x 3, 6 x 4 and 4 x 4 took the same time within 3 %, 16 x 1 1.02-1.12x, 12 x 2 and 4 x 6 (with
# y stored lane by lane) 1.06-1.22x
_BLOCK_T, _BLOCK_P = 8, 2
_BLOCK_MIN = 2  # passes of 16 rows from which x goes through `_chunk_block` (below GEMM_ROWS)
_block_tp, _block_t1 = _make_block(_BLOCK_T, _BLOCK_P), _make_block(_BLOCK_T, 1)


@njit(nogil=True, cache=True)
def _chunk_block(xt, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0):
    """y[:16 * passes, n - c0] = x @ W[n] for n in [n0, n1), x's passes of 16 rows in the pairs
    layout (`xt`): W's rows decoded _BLOCK_T at a time into a buffer in L1, once, each block then
    met by every pass, _BLOCK_P at a time. Where x has several passes this beats decoding W for
    each (`_chunk_sixteen`), whose decode overlaps its products but is repeated: SmolLM2's linears
    at 32 rows of x, out of cache, one core, 2 alternated runs: 0.91-1.0x the time per shape; at
    one pass 1.12-1.22x, so one pass stays with `_chunk_sixteen`."""
    G = K >> 3
    passes, chunks = xt.shape[0], xt.shape[1]
    w = aligned_zeros_u16(_BLOCK_T * chunks * 64).reshape((_BLOCK_T, chunks * 64))
    live = y.shape[0]
    for n in range(n0, n1, _BLOCK_T):
        cols = min(_BLOCK_T, n1 - n)
        for t in range(cols):
            r = n + t
            _chunk_words_row(sm, r * K, codes, 3 * G * r, esc, esc_index[r * bpr], G, base, w, t)
        p = 0
        while p < passes:
            if passes - p >= _BLOCK_P:
                _block_tp(w, xt, p, y, live, n - c0, cols)
                p += _BLOCK_P
            else:
                _block_t1(w, xt, p, y, live, n - c0, cols)
                p += 1


# the column pair of a chunk (of 32, in x's order) that the decoder's pair d (words 2d, 2d + 1 of a
# row's chunk in `_chunk_words_row`: groups 0, 2, 4, 6, then 1, 3, 5, 7) multiplies
_NATURAL_PAIR = [4 * (2 * (d % 16 // 4) + d // 16) + d % 4 for d in range(32)]


@intrinsic
def _w_pairs(typingctx, w, t0, v, wt):
    """wt[c, d, v] = the pairs d of chunk c of W's decoded rows t0 .. t0 + 15 (`w` (rows, chunks *
    64) as `_chunk_words_row` leaves them) side by side, one 64-byte vector of 16 rows' pairs (`wt`
    (chunks, 32, vectors, 32)): two loads a row and a chunk, a 16 x 16 transpose of each half."""
    sig = types.void(w, types.intp, types.intp, wt)

    def codegen(context, builder, signature, args):
        w_a, t0, v, wt_a = args
        b = builder
        wp, (wstride, _), _ = simd.array_parts(context, b, signature.args[0], w_a)
        tp, (cstride, dstride, *_), (chunks, *_) = simd.array_parts(context, b, signature.args[3], wt_a)
        with cgutils.for_range(b, chunks) as loop:
            c = loop.index
            halves = ([], [])
            for t in range(16):
                at = b.gep(wp, [b.add(b.mul(b.add(t0, _const(t)), wstride), b.shl(c, _const(7)))])
                for h in range(2):
                    halves[h].append(simd.load(b, at, _const(64 * h), _V16I32, align=64))
            at_c = b.gep(tp, [b.add(b.mul(c, cstride), b.shl(v, _const(6)))])
            for h in range(2):
                for j, vec in enumerate(_transposed(b, halves[h])):
                    simd.store(b, vec, at_c, b.mul(dstride, _const(16 * h + j)), align=64)
        return context.get_dummy_value()

    return sig, codegen


def _make_gemm(R: int, V: int):
    """Intrinsic: rows m0 .. m0 + R - 1 of BF16 x (M, K), as it lies, times 16V rows of W in the
    layout of `_w_pairs` (wt (chunks, 32, V, 32)), over all of K: for each of a chunk's pairs d,
    V loads of W (16 rows' pairs each) and each of the R rows' pair broadcast (vdpbf16ps),
    R * V sums in registers whose lanes are rows of W (R + V loads per R * V vdpbf16ps: 11 per 24
    at 8 x 3, against 10 per 16 in `_make_block`), and each row of y written by V stores. x needs
    no layout of its own: a chunk's pair d is read where it lies in x's row (`_NATURAL_PAIR`), and
    the last chunk's pairs past K are skipped. Rows past M read row M - 1 and store nothing.
    Writes y[m0 + i, n + j] for j < cols."""

    @intrinsic
    def gemm(typingctx, wt, x, m0, y, n, cols):
        sig = types.void(wt, x, types.intp, y, types.intp, types.intp)
        bf16_out = y.dtype == types.uint16

        def codegen(context, builder, signature, args):
            wt_a, x_a, m0, y_a, n, cols = args
            b = builder
            tp = simd.data_ptr(context, b, signature.args[0], wt_a)
            xp, (xstride, _), (M, K) = simd.array_parts(context, b, signature.args[1], x_a)
            live = b.sub(M, m0)
            last = b.sub(M, _const(1))
            at_x = []
            for i in range(R):
                row = b.add(m0, _const(i))
                row = b.select(b.icmp_signed("<", row, M), row, last)
                at_x.append(b.gep(xp, [b.mul(row, xstride)]))
            zero = ir.Constant(simd.V16F32, [ir.Constant(simd.F32, 0.0)] * 16)
            accs = [[cgutils.alloca_once_value(b, zero) for _ in range(V)] for _ in range(R)]

            def chunk(c, left=None):
                tc = b.gep(tp, [b.mul(c, _const(2048 * V))])
                xc = [b.gep(at, [b.shl(c, _const(7))]) for at in at_x]
                for d in range(32):
                    j = _NATURAL_PAIR[d]

                    def pair():
                        ws = [simd.load(b, tc, _const(64 * (V * d + v)), _V16I32, align=64) for v in range(V)]
                        for i in range(R):
                            xv = simd.splat(b, simd.load(b, xc[i], _const(4 * j), _I32, align=4), _V16I32)
                            for v in range(V):
                                b.store(simd.dpbf16ps(b, b.load(accs[i][v]), ws[v], xv), accs[i][v])

                    if left is None:
                        pair()
                    else:
                        with b.if_then(b.icmp_signed("<", _const(j), left)):
                            pair()

            full = b.lshr(K, _const(6))
            with cgutils.for_range(b, full) as loop:
                chunk(loop.index)
            left = b.lshr(b.and_(K, _const(63)), _const(1))  # pairs in the last, shorter chunk
            with b.if_then(b.icmp_signed(">", left, _const(0))):
                chunk(full, left)
            yp, (ystride, _), _ = simd.array_parts(context, b, signature.args[3], y_a)
            width = 2 if bf16_out else 4
            for v in range(V):
                room = b.sub(cols, _const(16 * v))
                room = b.select(b.icmp_signed(">", room, _const(16)), _const(16), room)
                with b.if_then(b.icmp_signed(">", room, _const(0))):
                    mask = simd.mask_of(b, _low_bits(b, room), 16)
                    at_v = b.gep(yp, [b.mul(b.add(n, _const(16 * v)), _const(width))])
                    for i in range(R):
                        with b.if_then(b.icmp_signed("<", _const(i), live)):
                            sums = b.load(accs[i][v])
                            if bf16_out:
                                sums = _bf16_words(b, sums)
                            dst = b.gep(at_v, [b.mul(b.add(m0, _const(i)), ystride)])
                            simd.masked_store(b, sums, dst, mask)
            return context.get_dummy_value()

        return sig, codegen

    return gemm


# rows of x and vectors of 16 rows of W one call of the GEMM meets: 24 sums. SmolLM2's linears (30
# layers each out of cache, one core, against vLLM's packed oneDNN, Zen 5, 2 alternated runs of 3):
# 8 x 3 at 64, 256 and 4096 rows 1.13-1.14x, 1.05-1.06x, 1.05x; 6 x 4 1.17x, 1.07x, 1.02-1.03x
# (each block of W met by all of x before the next); with slabs 8 x 3 took 1.14x, 1.06x, 1.01x
_GEMM_R, _GEMM_V = 8, 3
W_SLAB_BYTES = 384 << 10  # W in the pairs layout `_chunk_gemm` decodes before it reads x (in L2)
# The decode (a tenth of the products' time at 256 rows, its transpose into the pairs layout
# included) does not hide behind the products: decoding the next block of W a row at a time between
# GEMM calls, each block met by all of x (two blocks' buffers), took 1.03x the time of decoding it
# before its calls; the same between slabs of half this size, 1.01x; prefetching the next slab's
# streams during the products, 1.00x (SmolLM2's qkv, gate_up and down x 30 at 256 rows, one core, Zen 5).
# rows of BF16 x from which `_chunk_gemm` takes them, rather than `_chunk_block`'s passes of 16
# (SmolLM2's linears, 30 layers each out of cache, one core, Zen 5, over vLLM's packed oneDNN, 2
# alternated runs of 3): block against GEMM at 64 rows 1.06-1.07x against 1.15x, at 128 1.05x
# against 1.08-1.09x, at 192 1.04-1.05x against 1.08-1.11x, at 256 1.06-1.07x both, at 384
# 1.07-1.08x against 1.02-1.03x; at 4096 the GEMM 1.01x, the block 1.16-1.19x. (With W in L2 the
# GEMM's products alone run as fast as the block's; its transpose of W into the pairs layout costs
# half as much again as the decode of W, where the block lays out only x, once a call.)
GEMM_ROWS = 256
_gemm = _make_gemm(_GEMM_R, _GEMM_V)


@njit(nogil=True, cache=True)
def _chunk_gemm(x, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0):
    """y[:, n - c0] = x @ W[n] for n in [n0, n1), x (M, K) BF16 bits as it lies: W decoded a slab
    of blocks of 16 * _GEMM_V rows at a time (W_SLAB_BYTES of the pairs layout, `_w_pairs`), then
    each _GEMM_R rows of x met by every block of the slab (`_make_gemm`) while they lie in L1:
    x is read from L3 once a slab rather than once a block."""
    G = K >> 3
    chunks = (K + 63) >> 6
    wide = 16 * _GEMM_V
    blocks = max(1, W_SLAB_BYTES // (chunks * 2048 * _GEMM_V))
    w = aligned_zeros_u16(wide * chunks * 64).reshape((wide, chunks * 64))
    wt = aligned_empty_u16(blocks * chunks * 32 * _GEMM_V * 32).reshape((blocks, chunks, 32, _GEMM_V, 32))
    M = x.shape[0]
    for ns in range(n0, n1, wide * blocks):
        used = min(blocks, -(-(n1 - ns) // wide))
        for s in range(used):
            n = ns + wide * s
            for t in range(min(wide, n1 - n)):
                r = n + t
                _chunk_words_row(sm, r * K, codes, 3 * G * r, esc, esc_index[r * bpr], G, base, w, t)
            for v in range(_GEMM_V):
                _w_pairs(w, 16 * v, v, wt[s])
        for m0 in range(0, M, _GEMM_R):
            for s in range(used):
                n = ns + wide * s
                _gemm(wt[s], x, m0, y, n - c0, min(wide, n1 - n))


@njit(nogil=True, cache=True, inline="always")
def _dot_pairs(P, sm, sm_off, codes, codes_off, esc, k, xs, G, base, ys, live, n, part, i, stage, skip):
    """The dot intrinsic for a pass of P (8 or 4) rows of x and two rows of W."""
    if P == 8:
        return _dot8x2(sm, sm_off, codes, codes_off, esc, k, xs, G, base, ys, live, n, part, i, stage, skip)
    return _dot4x2(sm, sm_off, codes, codes_off, esc, k, xs, G, base, ys, live, n, part, i, stage, skip)


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


@njit(nogil=True, cache=True)
def _bf16_x(x):
    """x (M, K) BF16 bits as `_chunk_rows` reads them: (chunk layout, pairs layout). The passes of 16
    rows come first (`_pass_rows`) and read the pairs layout; the chunk layout spans every pass's
    rows but holds only those of the passes after them (none at all where they take every row)."""
    M, K = x.shape
    if M >= GEMM_ROWS:  # `_chunk_gemm` reads x as it lies
        return aligned_zeros_u16(0).reshape((0, 0, 64)), _pairs(x, 0)
    sixteens = 0
    while M > sixteens and _pass_rows(M - sixteens) == 16:
        sixteens += 16
    rest = M - sixteens
    if rest <= 0:
        return aligned_zeros_u16(0).reshape((0, 0, 64)), _pairs(x, sixteens)
    chunks = (K + 63) >> 6
    rows = sixteens + _padded_rows(rest)
    out = aligned_zeros_u16(chunks * rows * 64).reshape((chunks, rows, 64))
    _fill_chunks(x[sixteens:], out[:, sixteens:])
    return out, _pairs(x, sixteens)


@njit(nogil=True, cache=True)
def _f32_chunks(x, rows):
    """x (M, K) fp32 in the chunk layout (`_fill_chunks`), `rows` rows (zeros past M and K)."""
    chunks = (x.shape[1] + 63) >> 6
    return _fill_chunks(x, aligned_zeros_u16(chunks * rows * 128).view(np.float32).reshape((chunks, rows, 64)))


@njit(nogil=True, cache=True, inline="always")
def _pass_rows(r):
    """Rows of x the next pass multiplies, r rows of x left: 16 from 11 rows on, 8 from 5, else r
    rounded up to a power of two (passes of 8 and 4 take W's rows in pairs, `_chunk_pairs`). A pass
    past the rows left reads padding (zeros, or rows whose sums are not written): one pass costs
    less than several smaller ones. SmolLM2's shapes out of cache, one core, against passes of 16,
    8, 4, 2 and 1 as the rows allow: 0.60-0.64x the time at 3 rows, 0.47-0.54x at 7, 0.58-0.65x at
    15; at 9 rows, 8 + 1 take 0.84-0.95x the time of one pass of 16."""
    if r >= 11:
        return 16
    if r >= 5:
        return 8
    return 4 if r >= 3 else r


@njit(nogil=True, cache=True, inline="always")
def _padded_rows(M):
    """Rows of x's chunk layout for M rows: the passes' rows, the last one's padding included."""
    rows = 0
    while rows < M:
        rows += _pass_rows(M - rows)
    return rows


@njit(nogil=True, cache=True, inline="always")
def _dot_rows(P, sm, sm_off, codes, codes_off, esc, k, xs, G, base, ys, live, n, part, i, stage, skip):
    """The dot intrinsic for a pass of P rows of x (numba cannot hold the intrinsics as values)."""
    if P == 16:
        return _dot16(sm, sm_off, codes, codes_off, esc, k, xs, G, base, ys, live, n, part, i, stage, skip)
    if P == 8:
        return _dot8(sm, sm_off, codes, codes_off, esc, k, xs, G, base, ys, live, n, part, i, stage, skip)
    if P == 4:
        return _dot4(sm, sm_off, codes, codes_off, esc, k, xs, G, base, ys, live, n, part, i, stage, skip)
    if P == 2:
        return _dot2(sm, sm_off, codes, codes_off, esc, k, xs, G, base, ys, live, n, part, i, stage, skip)
    return _dot1(sm, sm_off, codes, codes_off, esc, k, xs, G, base, ys, live, n, part, i, stage, skip)


@njit(nogil=True, cache=True, inline="always")
def _segments(G, P, itemsize):
    """(groups a segment takes, segments) for G groups of W's columns met by P rows of x: as many
    whole chunks as keep X_SEGMENT_BYTES of BF16 x (X_SEGMENT_BYTES_F32 of fp32 x) in L1, the
    segments as even as whole chunks allow."""
    budget = X_SEGMENT_BYTES if itemsize == 2 else X_SEGMENT_BYTES_F32
    most = max(8, budget // (8 * itemsize * P) >> 3 << 3)
    segs = -(-G // most)
    return ((-(-G // segs)) + 7) >> 3 << 3, segs


@njit(nogil=True, cache=True)
def _chunk_pass(x, m0, P, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0):
    """y[m0 : m0 + P, n - c0] = x[m0 : m0 + P] @ W[n] for n in [n0, n1): W's columns in segments
    whose P rows of x (X_SEGMENT_BYTES at most) stay in L1 while every row of W passes over them.
    Between segments each row keeps its sums in `part` and its place in esc in `pos`."""
    G = K >> 3
    step, segs = _segments(G, P, x.itemsize)
    kept = n1 - n0 if segs > 1 else 1
    part, pos = np.empty((kept, 16), np.float32), np.empty(kept, np.int64)
    xp, ys, live = x[:, m0 : m0 + P], y[m0 : m0 + P], min(P, y.shape[0] - m0)
    for g0 in range(0, G, step):
        Gs = min(step, G - g0)
        stage = (ADD if g0 else 0) | (MORE if g0 + Gs < G else 0)
        xs = xp[g0 >> 3 : (g0 + Gs + 7) >> 3]
        for n in range(n0, n1):
            i = n - n0 if segs > 1 else 0
            k = (pos[i] if g0 else esc_index[n * bpr],)
            sm_off, codes_off = n * K + 8 * g0, 3 * (G * n + g0)
            pos[i] = _dot_rows(
                P, sm, sm_off, codes, codes_off, esc, k, xs, Gs, base, ys, live, n - c0, part, i, stage, G - Gs
            )[0]


@njit(nogil=True, cache=True)
def _chunk_pairs(x, m0, P, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0):
    """_chunk_pass for P = 8 or 4 rows of x, W's rows two at a time (`_dot_pairs`: each load of x
    meets both, so a weight costs half the loads of x; SmolLM2's shapes out of cache, one core,
    against one row of W at a time: 0.83-0.92x the time at 8 rows, 0.84-0.94x at 3 and 4), the last
    of an odd count alone. Each pair keeps its sums (lane P * w + m for row n + w) in
    `part[n - n0]` and its two places in esc in `pos`."""
    G = K >> 3
    step, segs = _segments(G, P, x.itemsize)
    kept = n1 - n0 if segs > 1 else 2
    part, pos = np.empty((kept, 16), np.float32), np.empty(kept, np.int64)
    xp, ys, live = x[:, m0 : m0 + P], y[m0 : m0 + P], min(P, y.shape[0] - m0)
    n2 = n1 - (n1 - n0) % 2
    for g0 in range(0, G, step):
        Gs = min(step, G - g0)
        stage = (ADD if g0 else 0) | (MORE if g0 + Gs < G else 0)
        xs = xp[g0 >> 3 : (g0 + Gs + 7) >> 3]
        for n in range(n0, n2, 2):
            i = n - n0 if segs > 1 else 0
            k = (pos[i], pos[i + 1]) if g0 else (esc_index[n * bpr], esc_index[(n + 1) * bpr])
            sm_off, codes_off = n * K + 8 * g0, 3 * (G * n + g0)
            pos[i], pos[i + 1] = _dot_pairs(
                P, sm, sm_off, codes, codes_off, esc, k, xs, Gs, base, ys, live, n - c0, part, i, stage, G - Gs
            )
    if n2 < n1:
        _chunk_pass(x, m0, P, sm, codes, esc, esc_index, K, bpr, base, y, n2, n1, c0)


@njit(nogil=True, cache=True)
def _chunk_sixteen(xt, m0, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0):
    """_chunk_pass for 16 rows of BF16 x in the pairs layout (`_pairs`), through `_make_dot_t`:
    W's rows _DOT_T at a time, the last few two and one at a time; each row keeps its sums (lane m
    for row m of x) in `part[n - n0]` and its place in esc in `pos` between segments."""
    G = K >> 3
    step, segs = _segments(G, 16, 2)
    kept = n1 - n0 if segs > 1 else _DOT_T
    part, pos = np.empty((kept, 16), np.float32), np.empty(kept, np.int64)
    xp, ys, live = xt[m0 >> 4], y[m0 : m0 + 16], min(16, y.shape[0] - m0)
    for g0 in range(0, G, step):
        Gs = min(step, G - g0)
        stage = (ADD if g0 else 0) | (MORE if g0 + Gs < G else 0)
        xs = xp[g0 >> 3 : (g0 + Gs + 7) >> 3]
        n = n0
        while n < n1:
            i = n - n0 if segs > 1 else 0
            sm_off, codes_off, col = n * K + 8 * g0, 3 * (G * n + g0), n - c0
            if n1 - n >= _DOT_T:
                k4 = (
                    (pos[i], pos[i + 1], pos[i + 2], pos[i + 3])
                    if g0
                    else (
                        esc_index[n * bpr],
                        esc_index[(n + 1) * bpr],
                        esc_index[(n + 2) * bpr],
                        esc_index[(n + 3) * bpr],
                    )
                )
                pos[i], pos[i + 1], pos[i + 2], pos[i + 3] = _dot16t4(
                    sm, sm_off, codes, codes_off, esc, k4, xs, Gs, base, ys, live, col, part, i, stage, G - Gs
                )
                n += _DOT_T
            elif n1 - n >= 2:
                k2 = (pos[i], pos[i + 1]) if g0 else (esc_index[n * bpr], esc_index[(n + 1) * bpr])
                pos[i], pos[i + 1] = _dot16t2(
                    sm, sm_off, codes, codes_off, esc, k2, xs, Gs, base, ys, live, col, part, i, stage, G - Gs
                )
                n += 2
            else:
                k1 = (pos[i] if g0 else esc_index[n * bpr],)
                pos[i] = _dot16t1(
                    sm, sm_off, codes, codes_off, esc, k1, xs, Gs, base, ys, live, col, part, i, stage, G - Gs
                )[0]
                n += 1


@njit(nogil=True, cache=True)
def _chunk_rows(x, xt, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0):
    """y[:, n - c0] = x @ W[n] for n in [n0, n1) (K % 8 == 0) and the M rows of y, x in the chunk
    layout (chunks, rows, 64): the rows of x in passes of `_pass_rows` (of 8 and 4 rows, W's rows
    in pairs), whose rows past M x's layout holds (zeros, or other rows whose sums are not
    written). Passes of 16 take x from `xt` instead where it holds rows (BF16 x in the pairs
    layout, `_bf16_x`; all of them at once in `_chunk_block` where there are two or more); x then
    needs only the rows of the other passes. BF16 x of GEMM_ROWS rows or more goes to
    `_chunk_gemm` instead (`_bf16_rows`)."""
    M = y.shape[0]
    m0 = 0
    if xt.shape[0] >= _BLOCK_MIN:
        _chunk_block(xt, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0)
        m0 = 16 * xt.shape[0]
    while m0 < M:
        P = _pass_rows(M - m0)
        if P == 16 and xt.shape[0]:
            _chunk_sixteen(xt, m0, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0)
        elif P == 8 or P == 4:
            _chunk_pairs(x, m0, P, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0)
        else:
            _chunk_pass(x, m0, P, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0)
        m0 += P


@njit(nogil=True, cache=True, inline="always")
def _bf16_rows(xr, x, xt, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0):
    """y[:, n - c0] = x @ W[n] for n in [n0, n1), BF16 x (M, K) as it lies (`xr`) and as `_bf16_x`
    lays it out (`x`, `xt`): a prompt of GEMM_ROWS rows or more through `_chunk_gemm`, fewer
    through the passes of `_chunk_rows`."""
    if xr.shape[0] >= GEMM_ROWS:
        _chunk_gemm(xr, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0)
    else:
        _chunk_rows(x, xt, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0)


@njit(nogil=True, cache=True, parallel=True)
def _gemv_chunk_bf16_at(
    x_at, M, sm_at, codes_at, n_codes, esc_at, n_esc, index_at, n_index, N, K, bpr, base, r0, R, y_at, parts
):
    """y (M, R) = x @ W[r0 : r0 + R]^T for x (M, K) BF16 (K % 8 == 0) and W (N, K), through
    vdpbf16ps, its rows split into one range per thread; takes the tensors' addresses."""
    xr = carray(_u16_at(x_at), (M, K))
    x, xt = _bf16_x(xr)
    sm, codes, esc, esc_index = _streams_at(sm_at, N * K, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    y = carray(_f32_at(y_at), (M, R))
    for t in prange(parts):
        n0, n1 = r0 + R * t // parts, r0 + R * (t + 1) // parts
        _bf16_rows(xr, x, xt, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, r0)


@njit(nogil=True, cache=True, parallel=True)
def _gemv_chunk_bf16_to_bf16_at(
    x_at, M, sm_at, codes_at, n_codes, esc_at, n_esc, index_at, n_index, N, K, bpr, base, r0, R, y_at, parts
):
    """_gemv_chunk_bf16_at with y in BF16 (each fp32 sum rounded to nearest even): no pass over y
    to convert it after the call."""
    xr = carray(_u16_at(x_at), (M, K))
    x, xt = _bf16_x(xr)
    sm, codes, esc, esc_index = _streams_at(sm_at, N * K, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    y = carray(_u16_at(y_at), (M, R))
    for t in prange(parts):
        n0, n1 = r0 + R * t // parts, r0 + R * (t + 1) // parts
        _bf16_rows(xr, x, xt, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, r0)


@njit(nogil=True, cache=True)
def _gemv_chunk_bf16_one(
    x_at, M, sm_at, codes_at, n_codes, esc_at, n_esc, index_at, n_index, N, K, bpr, base, r0, R, y_at, parts
):
    """_gemv_chunk_bf16_at as one range on the calling thread (`parts` unused): a call of one part
    enters no parallel region, which costs about a microsecond even with one thread."""
    xr = carray(_u16_at(x_at), (M, K))
    x, xt = _bf16_x(xr)
    sm, codes, esc, esc_index = _streams_at(sm_at, N * K, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    _bf16_rows(xr, x, xt, sm, codes, esc, esc_index, K, bpr, base, carray(_f32_at(y_at), (M, R)), r0, r0 + R, r0)


@njit(nogil=True, cache=True)
def _gemv_chunk_bf16_to_bf16_one(
    x_at, M, sm_at, codes_at, n_codes, esc_at, n_esc, index_at, n_index, N, K, bpr, base, r0, R, y_at, parts
):
    """_gemv_chunk_bf16_to_bf16_at as one range on the calling thread (see _gemv_chunk_bf16_one)."""
    xr = carray(_u16_at(x_at), (M, K))
    x, xt = _bf16_x(xr)
    sm, codes, esc, esc_index = _streams_at(sm_at, N * K, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    _bf16_rows(xr, x, xt, sm, codes, esc, esc_index, K, bpr, base, carray(_u16_at(y_at), (M, R)), r0, r0 + R, r0)


@njit(nogil=True, cache=True, parallel=True)
def _gemv_chunk_f32_at(
    x_at, M, sm_at, codes_at, n_codes, esc_at, n_esc, index_at, n_index, N, K, bpr, base, r0, R, y_at, parts
):
    """_gemv_chunk_bf16_at for x (M, K) in fp32, by fp32 FMAs (AVX-512 without AVX512_BF16, or
    compute in fp32)."""
    x, xt = _f32_chunks(carray(_f32_at(x_at), (M, K)), _padded_rows(M)), _no_pairs()
    sm, codes, esc, esc_index = _streams_at(sm_at, N * K, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    y = carray(_f32_at(y_at), (M, R))
    for t in prange(parts):
        n0, n1 = r0 + R * t // parts, r0 + R * (t + 1) // parts
        _chunk_rows(x, xt, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, r0)


@njit(nogil=True, cache=True)
def _gemv_chunk_f32_one(
    x_at, M, sm_at, codes_at, n_codes, esc_at, n_esc, index_at, n_index, N, K, bpr, base, r0, R, y_at, parts
):
    """_gemv_chunk_f32_at as one range on the calling thread (see _gemv_chunk_bf16_one)."""
    x, xt = _f32_chunks(carray(_f32_at(x_at), (M, K)), _padded_rows(M)), _no_pairs()
    sm, codes, esc, esc_index = _streams_at(sm_at, N * K, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    _chunk_rows(x, xt, sm, codes, esc, esc_index, K, bpr, base, carray(_f32_at(y_at), (M, R)), r0, r0 + R, r0)


@njit(nogil=True, cache=True, inline="always")
def _grouped_task(x, sm, codes, esc, esc_index, K, bpr, base, starts, rows0, R, y, parts, task):
    """Task (g, t) of the experts of a MoE layer: y[s:e] = x[s:e] @ W[n0 : n1]^T for group g's rows
    [s, e) = [starts[g], starts[g + 1]) and part t of its W rows [rows0[g], rows0[g] + R), x in the
    chunk layout (holding 15 rows past the last group's). The caller's prange runs the tasks."""
    g, t = task // parts, task % parts
    s, e, r0 = starts[g], starts[g + 1], rows0[g]
    n0, n1 = r0 + R * t // parts, r0 + R * (t + 1) // parts
    _chunk_rows(x[:, s:e], _no_pairs(), sm, codes, esc, esc_index, K, bpr, base, y[s:e], n0, n1, r0)


@njit(nogil=True, cache=True, parallel=True)
def _gemv_grouped_chunk_f32_at(
    x_at, P, sm_at, codes_at, n_codes, esc_at, n_esc, index_at, n_index, N, K, bpr, base, starts, rows0, R, y_at, parts
):
    """cpu_avx2's _gemv_grouped_at (the experts of a MoE layer: rows [starts[g], starts[g + 1]) of x
    (P, K) fp32 times W[rows0[g] : rows0[g] + R]^T) on 64-weight chunks, by fp32 FMAs."""
    x = _f32_chunks(carray(_f32_at(x_at), (P, K)), P + 15)  # a group's last pass may read 15 rows past it
    sm, codes, esc, esc_index = _streams_at(sm_at, N * K, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    y = carray(_f32_at(y_at), (P, R))
    for task in prange(rows0.shape[0] * parts):
        _grouped_task(x, sm, codes, esc, esc_index, K, bpr, base, starts, rows0, R, y, parts, task)


@njit(nogil=True, cache=True, parallel=True)
def _gemv_grouped_chunk_bf16_at(
    x_at, P, sm_at, codes_at, n_codes, esc_at, n_esc, index_at, n_index, N, K, bpr, base, starts, rows0, R, y_at, parts
):
    """_gemv_grouped_chunk_f32_at for x (P, K) BF16, through vdpbf16ps (fp32 y)."""
    x = _bf16_chunks(carray(_u16_at(x_at), (P, K)), P + 15)
    sm, codes, esc, esc_index = _streams_at(sm_at, N * K, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    y = carray(_f32_at(y_at), (P, R))
    for task in prange(rows0.shape[0] * parts):
        _grouped_task(x, sm, codes, esc, esc_index, K, bpr, base, starts, rows0, R, y, parts, task)


@njit(nogil=True, cache=True, parallel=True)
def _rows_chunk_bf16_at(
    sm_at, n_sm, codes_at, n_codes, esc_at, n_esc, index_at, n_index, K, bpr, base, ids_at, R, out_at, parts
):
    """out[i] = row ids[i] of W as BF16 bit patterns (K % 8 == 0), on the tensors' addresses."""
    sm, codes, esc, esc_index = _streams_at(sm_at, n_sm, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    ids = carray(_i64_at(ids_at), (R,))
    out = carray(_u16_at(out_at), (R, K))
    G = K >> 3
    for t in prange(parts):
        for i in range(R * t // parts, R * (t + 1) // parts):
            n = ids[i]
            _chunk_bits_row(sm, n * K, codes, 3 * G * n, esc, esc_index[n * bpr], G, base, out, i)
