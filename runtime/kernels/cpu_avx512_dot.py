"""The dot products of the AVX-512 GEMV passes (cpu_avx512_gemv.py): numba intrinsics that meet the
rows of x of one pass with one or a few rows of W, decoded a chunk at a time (cpu_avx512_decode.py).

`_make_dot` multiplies each decoded register with the matching 32 BF16 values of each row of x
(laid out in that order once per call, cpu_avx512_layout.py) by one vdpbf16ps (AVX512_BF16),
summing in fp32 as cpu_avx2's BF16 kernel does; x in fp32 (laid out the same way) meets each
register widened into two <16 x float> (a BF16 value is the top half of its fp32) by FMAs, which
needs no AVX512_BF16. The rows' 16-lane sums fold together into one register at the end (`_fold`).
A pass of 16 rows of BF16 x turns the product around (`_make_dot_t`): x laid out by pairs of
columns, the 16 rows' pair in one register, and each decoded pair of weights broadcast from memory
into vdpbf16ps, so that a register of sums holds the 16 rows of x, four rows of W share each load
of x, and no sums are folded across lanes at the end.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from unweight.codec import simd

from .cpu_avx512_decode import PREFETCH, PREFETCH_LONG, _ChunkEmitter, _loop
from .cpu_avx512_ir import (
    _I8,
    _I16,
    _I32,
    _I64,
    _V16I1,
    _V16I32,
    _V32I16,
    _V64I8,
    _bf16_words,
    _const,
    _store_columns,
    _vconst,
)

PASS_ROWS = (16, 8, 4, 2, 1)  # rows of x one pass multiplies (accumulators in registers), largest first


ADD, MORE = 1, 2  # a dot's stage bits: add the row's sums so far (part); more columns follow (to part, not y)


_HALVES = [_vconst(list(range(16 * q, 16 * q + 16)), ir.VectorType(_I32, 16)) for q in (0, 1)]
_SIXTEEN = ir.Constant(ir.VectorType(_I32, 16), [ir.Constant(_I32, 16)] * 16)


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
    reads 2 KiB of x per W rows rather than per row. In the 16-row pass of `_make_dot`, beside its
    32 vdpbf16ps a chunk, the decoder's zmm instructions, its 32 loads of x and the fold each take
    issue slots from them. Here each row's decode is spread over four rows' products and the
    broadcasts ride in vdpbf16ps's own memory operand (the two passes' rates, measured:
    docs/kernels.md, "CPU kernels"). Each chunk's next one is decoded and stored into the other of
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
# sums a row of W keeps in the 16-row pass (pair d in sum d mod _DOT_T_SUMS), a power of two: that
# many chains of vdpbf16ps a row in flight, with the next chunk decoded into memory rather than held
# in registers (the choice among 2, 4 and 6: docs/kernels.md, "CPU kernels", "The constants of the
# 64-weight chunks")
_DOT_T_SUMS = 4
_dot16t4, _dot16t2, _dot16t1 = (_make_dot_t(w) for w in (_DOT_T, 2, 1))
