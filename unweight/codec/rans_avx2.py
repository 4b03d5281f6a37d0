"""AVX2 kernels of the `rans` codec for 16-bit floats (BF16, F16): the same streams as
`rans_kernels`, eight lanes in one ymm register.

A chunk's eight rANS lanes (SPEC.md §3.3) map onto the eight 32-bit lanes of a ymm register, and a
round (one element per lane) becomes a handful of vector instructions:

  decode  q = x & (2^P - 1); per lane, a byte load fetches the index of slot q's symbol and a
          second load that symbol's f | c << 16 and its bits of the element (a two-level table,
          freq_table.lookup_from_stream: 16 KiB at P = 14, where one 8-byte entry per slot took
          128 KiB and missed L1; 1.03-1.32x faster, median 1.18x, kernel against kernel);
          x = f · (x >> P) + (q − c); the lanes with x < 2^16 (a mask of 8 bits) take the next
          words in lane order: eight words are loaded at the read position, widened, and moved to
          those lanes by a vpermd whose control comes from a 256-entry table indexed by the mask;
          the position advances by popcount(mask). The raw fields of the eight elements (6 bytes)
          are spread to their lanes by one pshufb and a per-lane shift, merged, and the eight
          16-bit elements stored at once.

One round is a chain of dependent steps (table loads, multiply, compare, permute), so a single chunk
would leave the core idle most of the time; the kernels take up to four chunks at once and
interleave their rounds, which the out-of-order core overlaps. Chunks are independent (their own
words, states and elements), so this changes nothing in the streams.

The kernels never read outside a chunk's words or past the raw stream: the caller runs them only
for rounds that cannot (at most 8 words a round, 8 raw bytes at the round's group), and finishes
every chunk with rans_kernels.checked_tail, which decodes the rest one element at a time and checks
the chunk's end. On hosts without AVX2 (`AVAILABLE` false) rans.decode uses rans_kernels alone,
which is also what the tests hold this path to.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

from . import freq_table, simd
from .rans_kernels import ERR_BAD_STATE, LANES, RANS_L, _pack_raw6, checked_tail, encode_prologue, load_states
from .simd import I32, I64, V4I64, V8I16, V8I32, V8I64, V32I8

AVAILABLE = simd.has("avx2")
MAX_GROUP = 4  # chunks decoded together


def _expand_table() -> np.ndarray:
    """[mask, lane]: for each lane whose bit is set in mask, the index of the word it takes among
    the eight loaded (the set lanes below it); 0 elsewhere (those lanes keep their state)."""
    t = np.zeros((256, 8), dtype=np.int32)
    for m in range(256):
        k = 0
        for lane in range(8):
            if m >> lane & 1:
                t[m, lane] = k
                k += 1
    return t


_EXPAND = _expand_table()
# Raw fields of the round's eight elements, bits [6i, 6i + 6) of 6 bytes: lane i takes bytes o_i and
# o_i + 1 (o_i = 6i div 8) into its low 16 bits, then shifts right by 6i mod 8.
_RAW_BYTE = [6 * i // 8 for i in range(8)]
_RAW_CTRL = [v for i in range(8) for v in (_RAW_BYTE[i], _RAW_BYTE[i] + 1, 0x80, 0x80)]
_RAW_SHIFT = [6 * i % 8 for i in range(8)]


def _compact_table() -> np.ndarray:
    """[mask, k]: the encoder's vpermd control for an emit mask: the set lanes, in lane order,
    move to the last popcount(mask) of the eight positions (the words end at the write pointer)."""
    t = np.zeros((256, 8), dtype=np.int32)
    for m in range(256):
        lanes = [lane for lane in range(8) if m >> lane & 1]
        for j, lane in enumerate(lanes):
            t[m, 8 - len(lanes) + j] = lane
    return t


_COMPACT = _compact_table()


def _load_lanes(b, xsp, ptrs, G):
    """Allocas (registers, after LLVM's mem2reg) for G chunks: their eight lane states, read from
    int64[8G] at xsp, and one int64 each from the arrays at `ptrs` (positions, pointers)."""
    xv = [cgutils.alloca_once_value(b, b.trunc(simd.load(b, xsp, simd.const(64 * g), V8I64), V8I32)) for g in range(G)]
    return xv, [[cgutils.alloca_once_value(b, simd.load(b, p, simd.const(8 * g), I64)) for g in range(G)] for p in ptrs]


def _store_lanes(b, xsp, ptrs, xv, scalars):
    """Write _load_lanes()'s values back to the arrays they came from."""
    for g, x in enumerate(xv):
        simd.store(b, b.zext(b.load(x), V8I64), xsp, simd.const(64 * g))
    for p, values in zip(ptrs, scalars):
        for g, v in enumerate(values):
            simd.store(b, b.load(v), p, simd.const(8 * g))


def _symbol_entries(b, lut, q, wide: bool):
    """freq_table.lookup_from_stream()'s entries for the slots q (eight lanes): each lane loads its
    slot's symbol index (one byte, or two if `wide`) and then that symbol's f | c << 16 | top << 32;
    returned split as simd.lookup64x8 does: (f | c << 16, top)."""
    entries = b.bitcast(lut, I64.as_pointer())
    index = b.gep(entries, [simd.const(freq_table.LOOKUP_SYMBOLS)])
    return simd.lookup64x8(b, entries, q, via=b.bitcast(index, ir.IntType(16 if wide else 8).as_pointer()))


def _make_decoder(G: int):
    """Intrinsic: `rounds` rounds of G chunks at once. xs (8G int64 states), pos (G word positions)
    and e (G element positions, multiples of 8) are read at the start and written back at the end.
    `lut` is freq_table.lookup_from_stream()'s lookup, with two-byte indices if `wide` (not 0): the
    loop is emitted for each index width, and `wide` picks one before it starts."""

    @intrinsic
    def decode_rounds(typingctx, words, pos, xs, rounds, raw, out, e, lut, wide, P):
        sig = types.void(words, pos, xs, types.intp, raw, out, e, lut, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            b = builder
            rounds, wide, P = args[3], args[8], args[9]
            wp, posp, xsp, rawp, outp, ep, lutp = (
                simd.data_ptr(context, b, signature.args[i], args[i]) for i in (0, 1, 2, 4, 5, 6, 7)
            )
            expand = simd.table(b, "unweight_rans_expand", _EXPAND)
            p32 = b.trunc(P, I32)
            qmask = simd.splat(b, b.sub(b.shl(simd.const(1, I32), p32), simd.const(1, I32)), V8I32)
            pshift = simd.splat(b, p32, V8I32)
            c16, c15, c1, c63 = (simd.vconst([v] * 8) for v in (16, 15, 1, 63))
            low16 = simd.vconst([0xFFFF] * 8)
            rans_l = simd.vconst([RANS_L] * 8)
            raw_ctrl = simd.vconst(_RAW_CTRL, V32I8)
            raw_shift = simd.vconst(_RAW_SHIFT)
            xv, (pv, ev) = _load_lanes(b, xsp, (posp, ep), G)

            def rounds_loop(two_byte: bool) -> None:
                with cgutils.for_range(b, rounds):
                    for g in range(G):
                        x = b.load(xv[g])
                        q = b.and_(x, qmask)
                        fc, sym = _symbol_entries(b, lutp, q, two_byte)
                        x = b.add(b.mul(b.and_(fc, low16), b.lshr(x, pshift)), b.sub(q, b.lshr(fc, c16)))
                        need = b.icmp_unsigned("<", x, rans_l)
                        m = simd.lane_mask(b, need)
                        p = b.load(pv[g])
                        w = b.zext(simd.load(b, wp, b.shl(p, simd.const(1)), V8I16), V8I32)
                        w = simd.permd(b, w, simd.load(b, expand, b.shl(m, simd.const(5)), V8I32))
                        b.store(b.select(need, b.or_(b.shl(x, c16), w), x), xv[g])
                        b.store(b.add(p, simd.ctpop64(b, m)), pv[g])
                        e = b.load(ev[g])
                        rb = simd.splat(
                            b, simd.load(b, rawp, b.mul(b.lshr(e, simd.const(2)), simd.const(3)), I64), V4I64
                        )
                        r = b.bitcast(simd.pshufb(b, b.bitcast(rb, V32I8), raw_ctrl), V8I32)
                        r = b.and_(b.lshr(r, raw_shift), c63)
                        # rotate right by one: the raw field's low bit (the sign) to bit 15, the rest down
                        v = b.or_(sym, b.or_(b.shl(b.and_(r, c1), c15), b.lshr(r, c1)))
                        simd.store(b, b.trunc(v, V8I16), outp, b.shl(e, simd.const(1)))
                        b.store(b.add(e, simd.const(8)), ev[g])

            with b.if_else(b.icmp_signed("!=", wide, simd.const(0))) as (two_byte, one_byte):
                with two_byte:
                    rounds_loop(True)
                with one_byte:
                    rounds_loop(False)
            _store_lanes(b, xsp, (posp, ep), xv, (pv, ev))
            return context.get_dummy_value()

        return sig, codegen

    return decode_rounds


_dec1, _dec2, _dec3, _dec4 = (_make_decoder(g) for g in range(1, MAX_GROUP + 1))


def _mulhi32(b, x, m):
    """The high 32 bits of x[i] * m[i] (unsigned), eight lanes: two vpmuludq (even, odd lanes)."""
    lo32 = ir.Constant(V4I64, [ir.Constant(I64, 0xFFFFFFFF)] * 4)
    c32 = ir.Constant(V4I64, [ir.Constant(I64, 32)] * 4)
    xq, mq = b.bitcast(x, V4I64), b.bitcast(m, V4I64)
    even = b.lshr(b.mul(b.and_(xq, lo32), b.and_(mq, lo32)), c32)
    odd = b.mul(b.lshr(xq, c32), b.lshr(mq, c32))
    return b.shuffle_vector(
        b.bitcast(even, V8I32), b.bitcast(odd, V8I32), ir.Constant(V8I32, [0, 9, 2, 11, 4, 13, 6, 15])
    )


def _make_encoder():
    """Intrinsic: `rounds` rounds of one chunk, from its round at element g[0] down (g decreases by
    8 a round). xs (8 int64 states) and wp[0] (the write pointer into scratch, moving down) are
    read at the start and written back at the end."""

    @intrinsic
    def encode_rounds(typingctx, values, g, xs, rounds, scratch, wp, tab, P, raw):
        sig = types.void(values, g, xs, types.intp, scratch, wp, tab, types.intp, raw)

        def codegen(context, builder, signature, args):
            b = builder
            rounds, P = args[3], args[7]
            vp, gp, xsp, sp, wpp, tabp, rawp = (
                simd.data_ptr(context, b, signature.args[i], args[i]) for i in (0, 1, 2, 4, 5, 6, 8)
            )
            compact = simd.table(b, "unweight_rans_compact", _COMPACT)
            p32 = b.trunc(P, I32)
            one_p = simd.splat(b, b.shl(simd.const(1, I32), p32), V8I32)
            hi_shift = simd.splat(b, b.sub(simd.const(32, I32), p32), V8I32)
            c1, c5, c16, c23, c127 = (simd.vconst([v] * 8) for v in (1, 5, 16, 23, 127))
            zero = simd.vconst([0] * 8)
            sym_mask, low16 = simd.vconst([0x3FF] * 8), simd.vconst([0xFFFF] * 8)
            (xv,), ((gv,), (wv,)) = _load_lanes(b, xsp, (gp, wpp), 1)
            with cgutils.for_range(b, rounds):
                g = b.load(gv)
                v = b.zext(simd.load(b, vp, b.shl(g, simd.const(1)), V8I16), V8I32)
                s = b.and_(b.lshr(v, c5), sym_mask)  # bits 14..5: the symbol of the rotated word
                _store_raw6(b, v, rawp, g)
                m, cc = simd.lookup64x8(b, tabp, s)
                cum, cmpl = b.and_(cc, low16), b.lshr(cc, c16)
                f = b.sub(one_p, cmpl)
                # shifts of the division: l = ceil(log2 f); sh1 = min(l, 1), sh2 = max(l - 1, 0)
                fm1 = b.sub(f, c1)  # < 2^15: the signed conversion and compares below are exact
                sh2 = b.sub(b.lshr(b.bitcast(b.sitofp(fm1, simd.V8F32), V8I32), c23), c127)
                sh2 = b.select(b.icmp_signed("<", sh2, zero), zero, sh2)
                sh1 = b.select(b.icmp_signed("<", fm1, c1), fm1, c1)
                x = b.load(xv)
                emit = b.icmp_signed(">=", b.lshr(x, hi_shift), f)  # x >= f << (32 - P); both sides < 2^16
                mask = simd.lane_mask(b, emit)
                out = simd.permd(b, x, simd.load(b, compact, b.shl(mask, simd.const(5)), V8I32))
                w = b.load(wv)
                simd.store(b, b.trunc(out, V8I16), sp, b.shl(b.sub(w, simd.const(8)), simd.const(1)))
                b.store(b.sub(w, simd.ctpop64(b, mask)), wv)
                x = b.select(emit, b.lshr(x, c16), x)
                t1 = _mulhi32(b, x, m)
                q = b.lshr(b.add(t1, b.lshr(b.sub(x, t1), sh1)), sh2)
                b.store(b.add(b.add(x, cum), b.mul(q, cmpl)), xv)  # q·2^P + (x − q·f) + c
                b.store(b.sub(g, simd.const(8)), gv)
            _store_lanes(b, xsp, (gp, wpp), [xv], ([gv], [wv]))
            return context.get_dummy_value()

        return sig, codegen

    return encode_rounds


_encode_rounds = _make_encoder()


def _store_raw6(b, w, rawp, e):
    """The raw fields of the eight words w (zero-extended <8 x i32>) of elements e..e+7 (e a
    multiple of 8): rotl(w, 1) & 63 of lane i to bits 6i of 6 bytes at raw + 3e/4, stored as 4 + 2
    bytes (no byte of another round is touched, so rounds may go in any order)."""
    c1, c15, c63 = (simd.vconst([v] * 8) for v in (1, 15, 63))
    undef = ir.Constant(V8I32, ir.Undefined)
    r = b.and_(b.or_(b.shl(w, c1), b.lshr(w, c15)), c63)
    t = b.shl(r, simd.vconst([0, 6, 12, 18] * 2))
    t = b.or_(t, b.shuffle_vector(t, undef, ir.Constant(V8I32, [1, 0, 3, 2, 5, 4, 7, 6])))
    t = b.or_(t, b.shuffle_vector(t, undef, ir.Constant(V8I32, [2, 3, 0, 1, 6, 7, 4, 5])))
    lo = b.extract_element(t, simd.const(0, I32))  # elements 0-3: 24 bits
    hi = b.extract_element(t, simd.const(4, I32))  # elements 4-7: 24 bits
    at = b.mul(b.lshr(e, simd.const(3)), simd.const(6))
    simd.store(b, b.or_(lo, b.shl(hi, simd.const(24, I32))), rawp, at)
    simd.store(b, b.trunc(b.lshr(hi, simd.const(8, I32)), ir.IntType(16)), rawp, b.add(at, simd.const(4)))


@njit(nogil=True, cache=True)
def encode_chunks16(values, n, chunk, c0, c1, freq, cum, magic, tab, P, scratch, nwords, states, raw):
    """rans_kernels.encode_chunks for 16-bit words with rotate and R = 6, the full rounds in the
    vector encoder; the same streams, word for word. `tab` is rans_kernels.encoder_tables()'s
    vector entries. (The encoder is bound by its instruction count, not by latency: interleaving
    chunks as the decoder does only added register spills, 10 % slower at four.)"""
    xs = np.empty(LANES, dtype=np.int64)
    g = np.empty(1, dtype=np.int64)
    wp = np.empty(1, dtype=np.int64)
    for c in range(c0, c1):
        start = c * chunk
        stop = min(start + chunk, n)
        full = start + ((stop - start) >> 3 << 3)
        _pack_raw6(values, True, full, stop, raw)  # the partial round; the vector rounds store their own
        full, wp[0] = encode_prologue(
            values, 16, 6, True, start, stop, (c + 1) * chunk, freq, cum, magic, P, scratch, xs, raw, False
        )
        g[0] = full - LANES
        _encode_rounds(values, g, xs, (full - start) >> 3, scratch, wp, tab, P, raw)
        nwords[c] = (c + 1) * chunk - wp[0]
        states[LANES * c : LANES * c + LANES] = xs


@njit(nogil=True, cache=True, inline="always")
def _safe_rounds(e, stop, pos, end, nraw):
    """Rounds the vector kernel may run from element e: each needs 8 elements, at most 8 words of
    the chunk, and the 8 raw bytes at its group inside the stream."""
    room = nraw - 8 - 3 * (e >> 2)
    if room < 0:
        return 0
    return min((stop - e) >> 3, (end - pos) >> 3, room // 6 + 1)


@njit(nogil=True, cache=True)
def decode_chunks16(words, offsets, states, lut, wide, P, raw, n, chunk, c0, c1, out, status):
    """Decode chunks c0..c1-1 of a 16-bit `rans` tensor with rotate and R = 6 (BF16, F16) into
    `out` (uint16); status[c] gets OK or an error code, as rans_kernels.decode_chunks does.
    `lut, wide` are freq_table.lookup_from_stream()'s; the tails read it too."""
    G = MAX_GROUP
    two = 1 if wide else 0
    xs = np.empty(LANES * G, dtype=np.int64)
    pos = np.empty(G, dtype=np.int64)
    e = np.empty(G, dtype=np.int64)
    ok = np.empty(G, dtype=np.bool_)
    act = np.empty(G, dtype=np.int64)
    cx = np.empty(LANES * G, dtype=np.int64)
    cpos = np.empty(G, dtype=np.int64)
    ce = np.empty(G, dtype=np.int64)
    nraw = len(raw)
    index8 = lut[freq_table.LOOKUP_SYMBOLS :].view(np.uint8)
    index16 = lut[freq_table.LOOKUP_SYMBOLS :].view(np.uint16)
    for g0 in range(c0, c1, G):
        k = min(G, c1 - g0)
        for j in range(k):
            c = g0 + j
            pos[j] = offsets[c]
            e[j] = c * chunk
            ok[j] = load_states(states, c, xs[LANES * j : LANES * j + LANES])
            if not ok[j]:
                status[c] = ERR_BAD_STATE
        while True:  # rounds of every chunk that has some left, until none has
            a = 0
            rounds = np.int64(1) << 62
            for j in range(k):
                if ok[j]:
                    c = g0 + j
                    r = _safe_rounds(e[j], min((c + 1) * chunk, n), pos[j], np.int64(offsets[c + 1]), nraw)
                    if r > 0:
                        act[a] = j
                        a += 1
                        rounds = min(rounds, r)
            if a == 0:
                break
            for i in range(a):
                j = act[i]
                cx[LANES * i : LANES * i + LANES] = xs[LANES * j : LANES * j + LANES]
                cpos[i] = pos[j]
                ce[i] = e[j]
            if a == 1:
                _dec1(words, cpos, cx, rounds, raw, out, ce, lut, two, P)
            elif a == 2:
                _dec2(words, cpos, cx, rounds, raw, out, ce, lut, two, P)
            elif a == 3:
                _dec3(words, cpos, cx, rounds, raw, out, ce, lut, two, P)
            else:
                _dec4(words, cpos, cx, rounds, raw, out, ce, lut, two, P)
            for i in range(a):
                j = act[i]
                xs[LANES * j : LANES * j + LANES] = cx[LANES * i : LANES * i + LANES]
                pos[j] = cpos[i]
                e[j] = ce[i]
        for j in range(k):
            if ok[j]:
                c = g0 + j
                args = (words, pos[j], np.int64(offsets[c + 1]), xs[LANES * j : LANES * j + LANES])
                rest = (P, raw, 16, 6, True, c * chunk, e[j], min((c + 1) * chunk, n), out)
                if wide:
                    status[c] = checked_tail(*args, lut, index16, *rest)
                else:
                    status[c] = checked_tail(*args, lut, index8, *rest)
