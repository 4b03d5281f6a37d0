"""The prompt GEMM of the AVX-512 kernels (cpu_avx512.py), for GEMM_ROWS rows of BF16 x or more: W
decoded a slab at a time (cpu_avx512_decode.py) into the pairs layout itself, 16 rows of W's pairs
a vector, and x, read where it lies, broadcast into vdpbf16ps against them (as oneDNN's BF16 GEMM
lays the product out)."""

from __future__ import annotations

from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

from unweight.codec import simd

from .cpu_avx2 import aligned_empty_u16, aligned_zeros_u16
from .cpu_avx512_decode import _chunk_words_row
from .cpu_avx512_ir import _I32, _V16I32, _bf16_words, _const, _low_bits, _transposed

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


# rows of x and vectors of 16 rows of W one call of the GEMM meets: 24 sums in registers, R + V loads
# per R * V vdpbf16ps
_GEMM_R, _GEMM_V = 8, 3
# W in the pairs layout `_chunk_gemm` decodes before it reads x: a slab that stays in L2 while x
# passes over it. The decode runs before the products, not beside them: its vector instructions take
# issue slots from vdpbf16ps rather than wait on memory, so interleaving it hides nothing.
W_SLAB_BYTES = 384 << 10
# rows of BF16 x from which `_chunk_gemm` takes them, rather than `_chunk_block`'s passes of 16: the
# GEMM's transpose of W into the pairs layout costs half as much again as the decode of W, where the
# block lays out only x, once a call, so the block is ahead on fewer rows. The choices of these three
# constants, measured: docs/kernels.md, "CPU kernels", "The constants of the 64-weight chunks".
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
