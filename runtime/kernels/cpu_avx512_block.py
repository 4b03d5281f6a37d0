"""The block GEMM of the AVX-512 kernels (cpu_avx512.py), for prompts of two or more passes of 16 rows
of BF16 x below GEMM_ROWS: eight rows of W decoded once into L1 (cpu_avx512_decode.py) and met by
every pass of x in the pairs layout (cpu_avx512_layout.py), two passes at a time."""

from __future__ import annotations

from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

from unweight.codec import simd

from .cpu_avx2 import aligned_zeros_u16
from .cpu_avx512_decode import _chunk_words_row
from .cpu_avx512_ir import _I32, _V16I32, _const, _store_columns


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


# rows of W a block decodes, passes of x one call of the block meets it with: 16 sums in registers,
# beside the loads of x and the broadcast weights (the shapes measured against it: docs/kernels.md,
# "CPU kernels", "The constants of the 64-weight chunks")
_BLOCK_T, _BLOCK_P = 8, 2
_BLOCK_MIN = 2  # passes of 16 rows from which x goes through `_chunk_block` (below GEMM_ROWS)
_block_tp, _block_t1 = _make_block(_BLOCK_T, _BLOCK_P), _make_block(_BLOCK_T, 1)


@njit(nogil=True, cache=True)
def _chunk_block(xt, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0):
    """y[:16 * passes, n - c0] = x @ W[n] for n in [n0, n1), x's passes of 16 rows in the pairs
    layout (`xt`): W's rows decoded _BLOCK_T at a time into a buffer in L1, once, each block then
    met by every pass, _BLOCK_P at a time. Where x has several passes this beats decoding W for
    each (`_chunk_sixteen`), whose decode overlaps its products but is repeated; at one pass it
    does not, so one pass stays with `_chunk_sixteen` (measured: docs/kernels.md, "CPU kernels")."""
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
