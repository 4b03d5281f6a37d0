"""The x86 CPU kernels of the serving layout (`tiles`), written as LLVM IR through numba intrinsics.

On x86 with AVX2 and FMA (`FAST_PATH`), the kernels are LLVM IR written through numba intrinsics
(the comment above `_RowEmitter` walks through them): a group of 8 weights becomes 8 fp32 values
in one ymm register with 14 vector instructions and no branch on the data, then one FMA per row
of x. Measured on this 2-vCPU AMD EPYC (Zen 3) VM at M = 1 on SmolLM2-135M's shapes (960x576,
576x576, 3072x576, 576x1536, 49152x576), weights warm in cache, ns per weight element:
  one thread:  0.21-0.25, against 0.22-0.28 for torch's BF16 F.linear and 0.63-0.78 for the
               three-pass kernel below that this replaced;
  two threads: 0.12-0.21 (torch 0.13-0.17). A second thread gained 1.2x to 1.8x from run to run
               on this shared VM (torch 1.6x to 1.9x): the kernel keeps the vector unit busy.
(benchmarks/cpu_gemv_bench.py measures all three side by side, also at M = 4 and 16.) The Python
wrapper hands numba the tensors' addresses, since converting them to arrays would cost more than
a tenth of a small layer's GEMV.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

from unweight.codec import simd

from .cpu_reference import LOWBIT, SPREAD, _dot, _row_bits

# ---------------------------------------------------------------------------------------------
# The x86 path. numba's own loops leave this work scalar (or, as above, split into passes through
# memory), so the inner loop is written as LLVM IR in numba intrinsics: each group of 8 weights
# becomes 8 fp32 values in one ymm register, with 14 vector instructions,
#   codes:   the group's 3 code bytes broadcast to the 8 lanes; lane i keeps bits i, 8+i, 16+i
#            (AND) and a per-lane multiply moves them to bits 24..26, the others to bytes 0..2
#            below their bit 7; OR 0x08808080 turns that into a pshufb control whose byte 3 is
#            8 + code, so one pshufb of a 16-byte table gives the exponent byte base + code in
#            byte 3 (0 for the escape code 7) and zeroes bytes 0..2;
#   escapes: a pshufb with a control from a 256-entry table (indexed by the group's escape mask)
#            moves the next 8 `esc` bytes to byte 3 of the escaped lanes; OR;
#   merge:   >> 1 puts the exponent at bits 23..30; a pshufb copies each sm byte to bytes 2 and
#            3 of its lane and an AND keeps the sign (bit 31) and the mantissa (16..22); OR;
# and the integer unit, alongside, computes the escape masks (a & b & c of the code bytes, two
# groups per 8-byte load) and the position in `esc` (popcount): no branch depends on the data.
# The GEMV then issues one FMA per row of x (into two accumulators per row up to 4 rows, which
# hides the FMA latency).
# ---------------------------------------------------------------------------------------------

_I8, _I32, _I64, _F32 = simd.I8, simd.I32, simd.I64, simd.F32
_V8I32, _V8F32, _V32I8, _V4I64 = simd.V8I32, simd.V8F32, simd.V32I8, simd.V4I64
MAX_FUSED_ROWS = (
    8  # rows of x one pass of the fused kernel multiplies (accumulators stay in registers); more take several passes
)


def _esc_ctrl() -> np.ndarray:
    """[32h : 32h+32]: the pshufb control for escape mask h: byte 3 of lane i takes source byte
    r (the r-th escape of the group) when bit i of h is set; every other byte is zeroed."""
    table = np.full((256, 32), 0x80, dtype=np.uint8)
    for h in range(256):
        lanes = [i for i in range(8) if h >> i & 1]
        for r, i in enumerate(lanes):
            table[h, 4 * i + 3] = r
    return table.reshape(-1)


_ESC_CTRL = _esc_ctrl()
# pshufb control: byte j of the ymm (lane j // 4) takes sm byte j // 4 in bytes 2 and 3 of its lane, else 0
_SM_CTRL = ir.Constant(_V32I8, [ir.Constant(_I8, j // 4 if j % 4 >= 2 else 0x80) for j in range(32)])
_LANE_MASK = [0x010101 << i for i in range(8)]  # lane i keeps bit i of each code byte
_LANE_MUL = [(1 << (24 - i)) + (1 << (17 - i)) + (1 << (10 - i)) for i in range(8)]  # ... and moves them to 24, 25, 26


FAST_PATH = simd.has("avx2", "fma")  # the fused kernels need both on the CPU numba compiles for
BF16_DOT = simd.has("avx512bf16", "avx512vl")  # ... and vdpbf16ps (512 bits), for BF16 activations
# With AVX-512 (VL), 32 vector registers: a pass of WIDE_ROWS rows of x keeps its accumulators in
# registers, so a decode step of 16 sequences rebuilds each W row once instead of twice.
WIDE_ROWS = 16
WIDE = simd.has("avx512f", "avx512vl")
_const, _vconst, _splat, _load, _bytes = simd.const, simd.vconst, simd.splat, simd.load, simd.data_ptr


def _opaque(builder, value, constraint):
    """`value` through an empty inline asm, which LLVM cannot see through: reading the codes
    through an opaque copy of their pointer keeps the integer unit's loads apart from the vector
    broadcasts of the same bytes (merged, they would cost a move from a general register)."""
    return builder.asm(ir.FunctionType(value.type, [value.type]), "", f"={constraint},0", [value], side_effect=False)


class _RowEmitter:
    """IR for the groups of one row: `pair(g)` gives the lane bits (<8 x i32>) of groups g and
    g + 1, `single(g)` those of group g."""

    def __init__(self, context, builder, sig_args, sm, sm_off, codes, codes_off, esc, k0, base):
        b = self.b = builder
        self.sm = b.gep(_bytes(context, b, sig_args[0], sm), [sm_off])
        self.codes = b.gep(_bytes(context, b, sig_args[2], codes), [codes_off])
        self.codes_int = _opaque(b, self.codes, "r")  # the same bytes, read separately by the integer unit
        self.esc = _bytes(context, b, sig_args[4], esc)
        self.ctrl = simd.table(b, "unweight_tiles_esc_ctrl", _ESC_CTRL)
        self.ctpop = simd.function(b, "llvm.ctpop.i64", _I64, [_I64])
        self.pshufb = simd.function(b, "llvm.x86.avx2.pshuf.b", _V32I8, [_V32I8, _V32I8])
        # pshufb table of exponent bytes: entry 8 + c is base + c for codes 0..6, 0 for the escape
        lut = b.add(_splat(b, b.trunc(base, _I8), _V32I8), _vconst([j % 16 - 8 for j in range(32)], _V32I8))
        self.exp_lut = b.and_(lut, _vconst([0xFF if 0 <= j % 16 - 8 < 7 else 0 for j in range(32)], _V32I8))
        self.k = cgutils.alloca_once_value(b, k0)

    def _group(self, g, hx, k):
        """Lane bits of group g, whose escape mask times 32 is hx and whose escapes start at k."""
        b = self.b
        # codes -> exponent byte at bits 24..31 (0 for escapes): code c to bits 24..26, + 8 for the
        # table, and bit 7 set in the other bytes (the products' stray bits stay below it) to zero them
        t = _splat(b, _load(b, self.codes, b.mul(g, _const(3)), _I32), _V8I32)
        t = b.or_(b.mul(b.and_(t, _vconst(_LANE_MASK)), _vconst(_LANE_MUL)), _vconst([0x08808080] * 8))
        e = b.call(self.pshufb, [self.exp_lut, b.bitcast(t, _V32I8)])
        # escapes: the next esc bytes to byte 3 of the escaped lanes
        ex = b.bitcast(_splat(b, _load(b, self.esc, k, _I64), _V4I64), _V32I8)
        e = b.bitcast(b.or_(e, b.call(self.pshufb, [ex, _load(b, self.ctrl, hx, _V32I8)])), _V8I32)
        # merge with sign and mantissa: the sm byte to bytes 2 and 3 of its lane, keep sign and mantissa
        s = b.bitcast(_splat(b, _load(b, self.sm, b.shl(g, _const(3)), _I64), _V4I64), _V32I8)
        s = b.and_(b.bitcast(b.call(self.pshufb, [s, _SM_CTRL]), _V8I32), _vconst([0x807F0000] * 8))
        return b.or_(s, b.lshr(e, _vconst([1] * 8)))

    def pair(self, g):
        b = self.b
        # escape masks of both groups (integer unit): a & b & c of their code bytes, times 32
        v = _load(b, self.codes_int, b.mul(g, _const(3)), _I64)
        t = b.and_(b.and_(v, b.lshr(v, _const(8))), b.lshr(v, _const(16)))
        h0 = b.shl(b.and_(t, _const(0xFF)), _const(5))
        h1 = b.and_(b.lshr(t, _const(19)), _const(0xFF << 5))
        k0 = b.load(self.k)
        k1 = b.add(k0, b.call(self.ctpop, [h0]))
        b.store(b.add(k1, b.call(self.ctpop, [h1])), self.k)
        return self._group(g, h0, k0), self._group(b.add(g, _const(1)), h1, k1)

    def single(self, g):
        b = self.b
        v = b.zext(_load(b, self.codes_int, b.mul(g, _const(3)), _I32), _I64)
        t = b.and_(b.and_(v, b.lshr(v, _const(8))), b.lshr(v, _const(16)))
        h0 = b.shl(b.and_(t, _const(0xFF)), _const(5))
        k0 = b.load(self.k)
        b.store(b.add(k0, b.call(self.ctpop, [h0])), self.k)
        return self._group(g, h0, k0)

    def loop(self, G, body):
        """body(g, lane bits, parity) for every group g < G, two at a time."""
        b = self.b
        with cgutils.for_range(b, b.lshr(G, _const(1))) as loop:
            g = b.shl(loop.index, _const(1))
            w0, w1 = self.pair(g)
            body(g, w0, 0)
            body(b.add(g, _const(1)), w1, 1)
        with b.if_then(b.trunc(G, ir.IntType(1))):
            g = b.sub(G, _const(1))
            body(g, self.single(g), 0)

    def bf16_quad_loop(self, G, body):
        """body(g, bf16 quad) for g = 0, 4, 8, ... < G: the BF16 weights of groups g..g + 3 in one
        <16 x i32>, as vdpbf16ps on 512 bits pairs them: lane i < 8 holds weight i of group g in its
        low half and of group g + 1 in its high half, lane 8 + i those of groups g + 2 and g + 3
        (zero past the last group). A lane's fp32 bits are the BF16 value and 16 zero bits, so a
        pair is (w0 >> 16) | w1."""
        b = self.b
        half = _vconst([16] * 8)
        zero = ir.Constant(_V8I32, [ir.Constant(_I32, 0)] * 8)
        both = ir.Constant(ir.VectorType(_I32, 16), list(range(16)))

        def pair(g):
            w0, w1 = self.pair(g)
            return b.or_(b.lshr(w0, half), w1)

        def quad(g, lo, hi):
            body(g, b.shuffle_vector(lo, hi, both))

        with cgutils.for_range(b, b.lshr(G, _const(2))) as loop:
            g = b.shl(loop.index, _const(2))
            quad(g, pair(g), pair(b.add(g, _const(2))))
        rest = b.and_(G, _const(3))
        g = b.sub(G, rest)
        with b.if_then(b.icmp_unsigned("!=", rest, _const(0))):
            with b.if_else(b.icmp_unsigned("==", rest, _const(1))) as (one, more):
                with one:
                    quad(g, b.lshr(self.single(g), half), zero)
                with more:
                    lo = pair(g)
                    with b.if_else(b.icmp_unsigned("==", rest, _const(2))) as (two, three):
                        with two:
                            quad(g, lo, zero)
                        with three:
                            quad(g, lo, b.lshr(self.single(b.add(g, _const(2))), half))


def _hsum(builder, acc):
    b = builder
    undef = ir.Constant(_V8F32, ir.Undefined)
    half = lambda v, idx: b.shuffle_vector(v, undef, ir.Constant(ir.VectorType(_I32, len(idx)), idx))  # noqa: E731
    s4 = b.fadd(half(acc, [0, 1, 2, 3]), half(acc, [4, 5, 6, 7]), flags=("fast",))
    s2 = b.fadd(
        b.shuffle_vector(s4, s4, ir.Constant(ir.VectorType(_I32, 2), [0, 1])),
        b.shuffle_vector(s4, s4, ir.Constant(ir.VectorType(_I32, 2), [2, 3])),
        flags=("fast",),
    )
    return b.fadd(b.extract_element(s2, _const(0, _I32)), b.extract_element(s2, _const(1, _I32)), flags=("fast",))


def _make_dot(M: int):
    """Intrinsic: y[m, n] = x[m] . W[n] for the M rows of x, W[n] rebuilt group by group in
    registers; returns the esc position after the row. x is fp32 (one FMA per group and row), or
    BF16 bits (uint16) laid out as `_bf16_quads` lays them (one 512-bit vdpbf16ps per four groups
    and row, AVX512_BF16): the kernel follows x's dtype."""

    @intrinsic
    def dot(typingctx, sm, sm_off, codes, codes_off, esc, k0, x, G, base, y, n):
        sig = types.intp(sm, types.intp, codes, types.intp, esc, types.intp, x, types.intp, types.intp, y, types.intp)

        def codegen(context, builder, signature, args):
            sm_a, sm_off, codes_a, codes_off, esc_a, k0, x_a, G, base, y_a, n = args
            b = builder
            row = _RowEmitter(context, b, signature.args, sm_a, sm_off, codes_a, codes_off, esc_a, k0, base)
            fma = cgutils.get_or_insert_function(b.module, ir.FunctionType(_V8F32, [_V8F32] * 3), "llvm.fma.v8f32")
            bf16 = signature.args[6].dtype == types.uint16
            xarr = context.make_array(signature.args[6])(context, b, x_a)
            xp = b.bitcast(xarr.data, _I8.as_pointer())
            xstride = b.extract_value(xarr.strides, 0)
            # fp32 x is (M, K), a pointer per row; BF16 quads are (quads, M, 32), x[j, m] at j * stride
            # + 64 * m, one pointer for every row (16 row pointers do not fit in registers)
            xrows = [] if bf16 else [b.gep(xp, [b.mul(xstride, _const(m))]) for m in range(M)]
            lanes = 16 if bf16 else 8
            zero = ir.Constant(ir.VectorType(_F32, lanes), [ir.Constant(_F32, 0.0)] * lanes)
            # accumulators per row of x: even and odd groups, to hide the FMA latency (a BF16 quad
            # of groups rebuilds 32 weights between two vdpbf16ps of a row, which hides it)
            split = 2 if M <= 4 and not bf16 else 1
            accs = [[cgutils.alloca_once_value(b, zero) for _ in range(split)] for _ in range(M)]

            def body(g, w, parity):
                w = b.bitcast(w, _V8F32)
                for m in range(M):
                    xv = _load(b, xrows[m], b.shl(g, _const(5)), _V8F32, align=4)
                    acc = accs[m][parity % split]
                    b.store(b.call(fma, [w, xv, b.load(acc)]), acc)

            def body_bf16(g, w):
                xg = b.gep(xp, [b.mul(b.lshr(g, _const(2)), xstride)])
                for m in range(M):
                    xv = _load(b, xg, _const(64 * m), simd.V16I32, align=2)
                    acc = accs[m][0]
                    b.store(simd.dpbf16ps(b, b.load(acc), w, xv), acc)

            if bf16:
                row.bf16_quad_loop(G, body_bf16)
            else:
                row.loop(G, body)
            yarr = context.make_array(signature.args[9])(context, b, y_a)
            yp = b.bitcast(yarr.data, _I8.as_pointer())
            ystride = b.extract_value(yarr.strides, 0)
            halves = [ir.Constant(ir.VectorType(_I32, 8), list(range(h, h + 8))) for h in (0, 8)]
            for m in range(M):
                acc = b.load(accs[m][0])
                for extra in accs[m][1:]:
                    acc = b.fadd(acc, b.load(extra), flags=("fast",))
                if bf16:  # the two halves of the 512-bit accumulator
                    lo, hi = (b.shuffle_vector(acc, acc, h) for h in halves)
                    acc = b.fadd(lo, hi, flags=("fast",))
                dst = b.gep(yp, [b.add(b.mul(ystride, _const(m)), b.shl(n, _const(2)))])
                b.store(_hsum(b, acc), b.bitcast(dst, _F32.as_pointer()), align=4)
            return b.load(row.k)

        return sig, codegen

    return dot


@intrinsic
def _bits_row(typingctx, sm, sm_off, codes, codes_off, esc, k0, G, base, out, i):
    """out[i, :8G] = the row's fp32 bit patterns (a uint32 out), or its BF16 bit patterns (a
    uint16 out: each lane's top half, exact, narrowed in registers, vpsrld and vpmovdw with
    AVX-512); returns the esc position after the row."""
    sig = types.intp(sm, types.intp, codes, types.intp, esc, types.intp, types.intp, types.intp, out, types.intp)
    bf16 = out.dtype == types.uint16
    lane = ir.VectorType(ir.IntType(16), 8) if bf16 else _V8I32

    def codegen(context, builder, signature, args):
        sm_a, sm_off, codes_a, codes_off, esc_a, k0, G, base, out_a, i = args
        b = builder
        row = _RowEmitter(context, b, signature.args, sm_a, sm_off, codes_a, codes_off, esc_a, k0, base)
        oarr = context.make_array(signature.args[8])(context, b, out_a)
        op = b.gep(b.bitcast(oarr.data, _I8.as_pointer()), [b.mul(b.extract_value(oarr.strides, 0), i)])

        def body(g, w, parity):
            if bf16:
                w = b.trunc(b.lshr(w, _vconst([16] * 8)), lane)
            dst = b.gep(op, [b.shl(g, _const(4 if bf16 else 5))])
            b.store(w, b.bitcast(dst, lane.as_pointer()), align=2 if bf16 else 4)

        row.loop(G, body)
        return b.load(row.k)

    return sig, codegen


_dot1, _dot2, _dot3, _dot4, _dot5, _dot6, _dot7, _dot8 = (_make_dot(m) for m in range(1, MAX_FUSED_ROWS + 1))
_dot_wide = _make_dot(WIDE_ROWS)


@njit(nogil=True, cache=True, inline="always")
def _in_place(codes, esc, esc_index, G, bpr, n):
    """Whether row n leaves the slack the fused kernels read past its codes (2 bytes) and past
    its escape positions (8 bytes); the last rows of a tensor may not."""
    return 3 * G * (n + 1) + 2 <= codes.shape[0] and esc_index[(n + 1) * bpr] + 8 <= esc.shape[0]


@njit(nogil=True, cache=True)
def _portable_row_dot(x, sm, codes, esc, esc_index, K, bpr, base, y, n, col):
    e64 = np.empty(K // 8 + 1, dtype=np.uint64)
    hits = np.empty(K // 8 + 1, dtype=np.int64)
    bits = np.empty(K, dtype=np.uint32)
    _row_bits(sm, codes, esc, esc_index, K, bpr, base, n, SPREAD, LOWBIT, e64, hits, bits)
    w = bits.view(np.float32)
    for m in range(x.shape[0]):
        y[m, col] = _dot(x[m], w)


def _row_slice(x, m0, m1):
    """Rows m0..m1 of x as the fused kernels take it: x[m0:m1] of (M, K) fp32, x[:, m0:m1] of BF16 quads."""


@overload(_row_slice, inline="always")
def _row_slice_impl(x, m0, m1):
    if x.ndim == 3:
        return lambda x, m0, m1: x[:, m0:m1]
    return lambda x, m0, m1: x[m0:m1]


@njit(nogil=True, cache=True)
def _fused_rows(x, xt, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, c0):
    """y[:, n - c0] = x @ W[n] for n in [n0, n1) (K % 8 == 0): rows of x in passes of WIDE_ROWS
    (AVX-512), then of up to MAX_FUSED_ROWS, one inlined loop per pass size (a call per row would
    cost more than a row). x is (M, K) fp32, or BF16 quads (quads of groups, M, 32) from
    _bf16_quads; xt is x as (M, K) fp32, which the last rows of W, rebuilt by the portable code,
    multiply."""
    G = K >> 3
    n_fast = n1
    while n_fast > n0 and not _in_place(codes, esc, esc_index, G, bpr, n_fast - 1):
        n_fast -= 1
    M = xt.shape[0]
    m_wide = M - M % WIDE_ROWS if WIDE else 0  # rows taken WIDE_ROWS at a time (AVX-512), the rest 8 at a time
    for m0 in range(0, m_wide, WIDE_ROWS):
        xs = _row_slice(x, m0, m0 + WIDE_ROWS)
        ys = y[m0 : m0 + WIDE_ROWS]
        for n in range(n0, n_fast):
            _dot_wide(sm, n * K, codes, 3 * G * n, esc, esc_index[n * bpr], xs, G, base, ys, n - c0)
    for m0 in range(m_wide, M, MAX_FUSED_ROWS):
        m1 = min(M, m0 + MAX_FUSED_ROWS)
        xs = _row_slice(x, m0, m1)
        ys = y[m0:m1]
        mm = m1 - m0
        if mm == 1:
            for n in range(n0, n_fast):
                _dot1(sm, n * K, codes, 3 * G * n, esc, esc_index[n * bpr], xs, G, base, ys, n - c0)
        elif mm == 2:
            for n in range(n0, n_fast):
                _dot2(sm, n * K, codes, 3 * G * n, esc, esc_index[n * bpr], xs, G, base, ys, n - c0)
        elif mm == 3:
            for n in range(n0, n_fast):
                _dot3(sm, n * K, codes, 3 * G * n, esc, esc_index[n * bpr], xs, G, base, ys, n - c0)
        elif mm == 4:
            for n in range(n0, n_fast):
                _dot4(sm, n * K, codes, 3 * G * n, esc, esc_index[n * bpr], xs, G, base, ys, n - c0)
        elif mm == 5:
            for n in range(n0, n_fast):
                _dot5(sm, n * K, codes, 3 * G * n, esc, esc_index[n * bpr], xs, G, base, ys, n - c0)
        elif mm == 6:
            for n in range(n0, n_fast):
                _dot6(sm, n * K, codes, 3 * G * n, esc, esc_index[n * bpr], xs, G, base, ys, n - c0)
        elif mm == 7:
            for n in range(n0, n_fast):
                _dot7(sm, n * K, codes, 3 * G * n, esc, esc_index[n * bpr], xs, G, base, ys, n - c0)
        else:
            for n in range(n0, n_fast):
                _dot8(sm, n * K, codes, 3 * G * n, esc, esc_index[n * bpr], xs, G, base, ys, n - c0)
    for n in range(n_fast, n1):  # the last rows of the tensor, without slack to read past
        _portable_row_dot(xt, sm, codes, esc, esc_index, K, bpr, base, y, n, n - c0)


@njit(nogil=True, cache=True)
def _fused_bits(sm, codes, esc, esc_index, K, bpr, base, ids, out, i0, i1):
    """out[i] = row ids[i] of W for i in [i0, i1) (K % 8 == 0): fp32 bit patterns into a uint32
    out, BF16 ones into a uint16 out."""
    G = K >> 3
    for i in range(i0, i1):
        n = ids[i]
        if _in_place(codes, esc, esc_index, G, bpr, n):
            _bits_row(sm, n * K, codes, 3 * G * n, esc, esc_index[n * bpr], G, base, out, i)
        else:  # the last rows of the tensor, without slack to read past: the portable decoder
            _portable_row(sm, codes, esc, esc_index, K, bpr, base, n, out[i])


def _portable_row(sm, codes, esc, esc_index, K, bpr, base, n, out):
    """out[:] = row n of W by the portable decoder: fp32 bit patterns into a uint32 out, BF16 ones
    (the top half of each) into a uint16 out."""


@overload(_portable_row, inline="always")
def _portable_row_impl(sm, codes, esc, esc_index, K, bpr, base, n, out):
    if out.dtype == types.uint16:

        def narrowed(sm, codes, esc, esc_index, K, bpr, base, n, out):
            e64, hits = np.empty((K >> 3) + 1, dtype=np.uint64), np.empty((K >> 3) + 1, dtype=np.int64)
            bits = np.empty(K, dtype=np.uint32)
            _row_bits(sm, codes, esc, esc_index, K, bpr, base, n, SPREAD, LOWBIT, e64, hits, bits)
            for k in range(K):
                out[k] = np.uint16(bits[k] >> np.uint32(16))

        return narrowed

    def direct(sm, codes, esc, esc_index, K, bpr, base, n, out):
        e64, hits = np.empty((K >> 3) + 1, dtype=np.uint64), np.empty((K >> 3) + 1, dtype=np.int64)
        _row_bits(sm, codes, esc, esc_index, K, bpr, base, n, SPREAD, LOWBIT, e64, hits, out)

    return direct


def _make_pointer(nbtype):
    @intrinsic
    def pointer(typingctx, address):
        """The integer `address` as a pointer to `nbtype` (for numba.carray)."""
        sig = types.CPointer(nbtype)(types.intp)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return sig, codegen

    return pointer


_u8_at, _i64_at, _f32_at, _u32_at, _u16_at = (
    _make_pointer(t) for t in (types.uint8, types.int64, types.float32, types.uint32, types.uint16)
)


@njit(nogil=True, cache=True, inline="always")
def _streams_at(sm_at, n_sm, codes_at, n_codes, esc_at, n_esc, index_at, n_index):
    """The tiles streams (sm, codes, esc, esc_index) as arrays over their addresses."""
    return (
        carray(_u8_at(sm_at), (n_sm,)),
        carray(_u8_at(codes_at), (n_codes,)),
        carray(_u8_at(esc_at), (n_esc,)),
        carray(_i64_at(index_at), (n_index,)),
    )


@njit(nogil=True, cache=True, inline="always")
def _aligned_u16(buf, n):
    """The n uint16s of buf (n + 32 long) that start on a 64-byte boundary (numba's arrays may start
    32 bytes off one, and a zmm load across two cache lines costs two)."""
    start = (-(buf.ctypes.data >> 1)) & 31
    return buf[start : start + n]


@njit(nogil=True, cache=True)
def aligned_zeros_u16(n):
    """n zero uint16s starting on a 64-byte boundary."""
    return _aligned_u16(np.zeros(n + 32, np.uint16), n)


@njit(nogil=True, cache=True)
def aligned_empty_u16(n):
    """aligned_zeros_u16 left unwritten, for a layout its caller writes whole (x's pairs layout: at
    4096 x 1536 0.85-0.88x the time of zeroing it first)."""
    return _aligned_u16(np.empty(n + 32, np.uint16), n)


@njit(nogil=True, cache=True)
def _bf16_quads(x):
    """x (M, K) BF16 bits as the vdpbf16ps kernel reads them, (K / 32 rounded up, M, 32): for each
    four groups g..g + 3, the M rows side by side, each interleaving value i of group g with value
    i of group g + 1, then of g + 2 with g + 3 (zeros past K), as the kernel pairs the weights; and
    x in fp32 (M, K)."""
    M, K = x.shape
    quads = aligned_zeros_u16(((K + 31) >> 5) * M * 32).reshape(((K + 31) >> 5, M, 32))
    bits = np.empty((M, K), np.uint32)
    for m in range(M):
        for k in range(K):
            v = x[m, k]
            quads[k >> 5, m, (k & 16) + 2 * (k & 7) + (k >> 3 & 1)] = v
            bits[m, k] = np.uint32(v) << 16
    return quads, bits.view(np.float32)


@njit(nogil=True, cache=True, parallel=True)
def _gemv_fused_at(
    x_at, M, sm_at, codes_at, n_codes, esc_at, n_esc, index_at, n_index, N, K, bpr, base, r0, R, y_at, parts
):
    """y (M, R) = x @ W[r0 : r0 + R]^T for x (M, K) fp32 (K % 8 == 0) and W (N, K), its rows split
    into one range per thread. Takes the tensors' addresses: a call costs microseconds less than one
    that converts six tensors to arrays, and a small layer's GEMV takes only tens of microseconds."""
    x = carray(_f32_at(x_at), (M, K))
    sm, codes, esc, esc_index = _streams_at(sm_at, N * K, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    y = carray(_f32_at(y_at), (M, R))
    for t in prange(parts):
        n0, n1 = r0 + R * t // parts, r0 + R * (t + 1) // parts
        _fused_rows(x, x, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, r0)


@njit(nogil=True, cache=True, parallel=True)
def _gemv_fused_bf16_at(
    x_at, M, sm_at, codes_at, n_codes, esc_at, n_esc, index_at, n_index, N, K, bpr, base, r0, R, y_at, parts
):
    """_gemv_fused_at for x (M, K) in BF16, through vdpbf16ps (AVX512_BF16)."""
    xb, xt = _bf16_quads(carray(_u16_at(x_at), (M, K)))
    sm, codes, esc, esc_index = _streams_at(sm_at, N * K, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    y = carray(_f32_at(y_at), (M, R))
    for t in prange(parts):
        n0, n1 = r0 + R * t // parts, r0 + R * (t + 1) // parts
        _fused_rows(xb, xt, sm, codes, esc, esc_index, K, bpr, base, y, n0, n1, r0)


@njit(nogil=True, cache=True)
def _gemv_fused_one(
    x_at, M, sm_at, codes_at, n_codes, esc_at, n_esc, index_at, n_index, N, K, bpr, base, r0, R, y_at, parts
):
    """_gemv_fused_at as one range on the calling thread (`parts` unused): a call of one part enters
    no parallel region, which costs about a microsecond even with one thread."""
    x = carray(_f32_at(x_at), (M, K))
    sm, codes, esc, esc_index = _streams_at(sm_at, N * K, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    _fused_rows(x, x, sm, codes, esc, esc_index, K, bpr, base, carray(_f32_at(y_at), (M, R)), r0, r0 + R, r0)


@njit(nogil=True, cache=True)
def _gemv_fused_bf16_one(
    x_at, M, sm_at, codes_at, n_codes, esc_at, n_esc, index_at, n_index, N, K, bpr, base, r0, R, y_at, parts
):
    """_gemv_fused_bf16_at as one range on the calling thread (see _gemv_fused_one)."""
    xb, xt = _bf16_quads(carray(_u16_at(x_at), (M, K)))
    sm, codes, esc, esc_index = _streams_at(sm_at, N * K, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    _fused_rows(xb, xt, sm, codes, esc, esc_index, K, bpr, base, carray(_f32_at(y_at), (M, R)), r0, r0 + R, r0)


@njit(nogil=True, cache=True, parallel=True)
def _gemv_grouped_at(
    x_at, P, sm_at, codes_at, n_codes, esc_at, n_esc, index_at, n_index, N, K, bpr, base, starts, rows0, R, y_at, parts
):
    """y (P, R): rows [starts[g], starts[g + 1]) of x (P, K) times W[rows0[g] : rows0[g] + R]^T for
    each group g (the pairs routed to one expert, K % 8 == 0); one task per (group, part of R)."""
    x = carray(_f32_at(x_at), (P, K))
    sm, codes, esc, esc_index = _streams_at(sm_at, N * K, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    y = carray(_f32_at(y_at), (P, R))
    for task in prange(rows0.shape[0] * parts):
        g, t = task // parts, task % parts
        s, e, r0 = starts[g], starts[g + 1], rows0[g]
        n0, n1 = r0 + R * t // parts, r0 + R * (t + 1) // parts
        _fused_rows(x[s:e], x[s:e], sm, codes, esc, esc_index, K, bpr, base, y[s:e], n0, n1, r0)


@njit(nogil=True, cache=True, parallel=True)
def _rows_fused_at(
    sm_at, n_sm, codes_at, n_codes, esc_at, n_esc, index_at, n_index, K, bpr, base, ids_at, R, out_at, parts
):
    """out[i] = row ids[i] of W as fp32 bit patterns (K % 8 == 0), on the tensors' addresses."""
    sm, codes, esc, esc_index = _streams_at(sm_at, n_sm, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    ids = carray(_i64_at(ids_at), (R,))
    out = carray(_u32_at(out_at), (R, K))
    for t in prange(parts):
        _fused_bits(sm, codes, esc, esc_index, K, bpr, base, ids, out, R * t // parts, R * (t + 1) // parts)


@njit(nogil=True, cache=True, parallel=True)
def _rows_fused_bf16_at(
    sm_at, n_sm, codes_at, n_codes, esc_at, n_esc, index_at, n_index, K, bpr, base, ids_at, R, out_at, parts
):
    """_rows_fused_at writing BF16 bits (the top half of each fp32 pattern, exact), narrowed in
    registers: no fp32 copy of W is written."""
    sm, codes, esc, esc_index = _streams_at(sm_at, n_sm, codes_at, n_codes, esc_at, n_esc, index_at, n_index)
    ids = carray(_i64_at(ids_at), (R,))
    out = carray(_u16_at(out_at), (R, K))
    for t in prange(parts):
        _fused_bits(sm, codes, esc, esc_index, K, bpr, base, ids, out, R * t // parts, R * (t + 1) // parts)
