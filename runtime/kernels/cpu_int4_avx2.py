"""AVX2 rows of the CPU INT4 kernels (cpu_int4.py), for hosts without AVX-512 VBMI2: a row of W in
the `int4` layout (int4.py) decoded 8 columns at a time into one <8 x float> of (nibble - 8) * scale,
as LLVM IR inside a numba intrinsic (simd.py), with no branch on the data.

For each 8 columns of a block, in vector registers:
  symbols: the three plane bytes packed in one word and broadcast to the 8 lanes; lane i keeps
           bits i, 8 + i, 16 + i (AND) and a per-lane multiply moves them to bits 24..26 (the
           product's other bits land below 24, without carries), so >> 24 is the lane's symbol;
  escapes: the next 8 indices (payload_bits each, from the running escape count's bit) broadcast
           and shifted so lane r holds index r; a `vpermd` with a control from a 256-entry table
           (indexed by the 8 columns' escape mask) moves index r to the lane of the r-th escape;
           XOR into the escapes' symbol 7, then OR 8 (16 at 4 index bits): the table slot
           cpu_int4._slot names;
  values:  two `vpermps` of the 32-entry value table and a blend by bit 3 of the slot (four and
           two more blends at 4 index bits), times the group's scale.
The integer unit meanwhile keeps the escape count (popcount of each byte of p0 & p1 & p2).

`coded_rows_avx2` takes one `payload_bits` per intrinsic, as the AVX-512 rows do. Needs AVX2 and
FMA, 64 | K and a power-of-two group of 8 or more (cpu_int4._path). The portable kernels of
cpu_int4.py are its oracle in the tests.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

from unweight.codec import simd

_I1, _I32, _I64 = simd.I1, simd.I32, simd.I64
_V8I32, _V8F32 = simd.V8I32, simd.V8F32
_const, _vconst = simd.const, simd.vconst
FAST_PATH = simd.has("avx2", "fma")
_LANE_MASK = [0x010101 << i for i in range(8)]  # lane i keeps bit i of each plane byte
_LANE_MUL = [(1 << (24 - i)) + (1 << (17 - i)) + (1 << (10 - i)) for i in range(8)]  # ... moved to bits 24..26


def _rank_table() -> np.ndarray:
    """(256, 8) int32: for escape mask h, lane i takes index r, the number of escapes below lane i
    (the vpermd control that moves index r to the r-th escape's lane; other lanes read index 0)."""
    table = np.zeros((256, 8), np.int32)
    for h in range(256):
        for i in range(8):
            table[h, i] = bin(h & ((1 << i) - 1)).count("1") if h >> i & 1 else 0
    return table


_RANK = _rank_table()


def _slots(b, planes, mask, k, escp, e, rankp, pb):
    """The table slots of columns 8k .. 8k + 7 of a block (<8 x i32>) and the escape count after
    them."""
    byte = [b.and_(b.lshr(p, _const(8 * k)), _const(0xFF)) for p in planes]
    word = b.trunc(b.or_(byte[0], b.or_(b.shl(byte[1], _const(8)), b.shl(byte[2], _const(16)))), _I32)
    v = b.and_(simd.splat(b, word, _V8I32), _vconst(_LANE_MASK, _V8I32))
    sym = b.lshr(b.mul(v, _vconst(_LANE_MUL, _V8I32)), _vconst([24] * 8, _V8I32))
    escaped = b.sext(b.icmp_unsigned("==", sym, _vconst([7] * 8, _V8I32)), _V8I32)
    mk = b.and_(b.lshr(mask, _const(8 * k)), _const(0xFF))
    if pb:
        bit = b.mul(e, _const(pb))
        window = b.lshr(simd.load(b, escp, b.ashr(bit, _const(3)), _I64, align=1), b.and_(bit, _const(7)))
        fields = b.lshr(simd.splat(b, b.trunc(window, _I32), _V8I32), _vconst([pb * r for r in range(8)], _V8I32))
        fields = b.and_(fields, _vconst([(1 << pb) - 1] * 8, _V8I32))
        ctrl = simd.load(b, rankp, b.shl(mk, _const(5)), _V8I32, align=4)
        permd = simd.function(b, "llvm.x86.avx2.permd", _V8I32, [_V8I32, _V8I32])
        sym = b.xor(sym, b.and_(b.call(permd, [fields, ctrl]), escaped))
    sym = b.or_(sym, b.and_(escaped, _vconst([16 if pb == 4 else 8] * 8, _V8I32)))
    return sym, b.add(e, simd.ctpop64(b, mk))


def _values(b, slots, tables, pb):
    """<8 x float>: tables[slot // 8][slot % 8] for each lane."""
    permps = simd.function(b, "llvm.x86.avx2.permps", _V8F32, [_V8F32, _V8I32])

    def bit(n):
        return b.icmp_unsigned("!=", b.and_(slots, _vconst([n] * 8, _V8I32)), _vconst([0] * 8, _V8I32))

    low = b.select(bit(8), b.call(permps, [tables[1], slots]), b.call(permps, [tables[0], slots]))
    if pb < 4:
        return low
    high = b.select(bit(8), b.call(permps, [tables[3], slots]), b.call(permps, [tables[2], slots]))
    return b.select(bit(16), high, low)


def _make_rows(pb: int):
    """Intrinsic (sym, at0, blocks, esc, e, values, gshift, scales, out) -> the first escape after
    the blocks: out[c] = W[r, c] for the row whose first block's planes are at sym[at0] and whose
    first escape is e, for weights of `pb` payload bits."""

    def codegen(context, builder, signature, args):
        b = builder
        symp, escp, tabp, scalesp, outp = (
            simd.data_ptr(context, b, signature.args[i], args[i]) for i in (0, 3, 5, 7, 8)
        )
        rankp = simd.table(b, "unweight_int4_rank", _RANK)
        tables = [simd.load(b, tabp, _const(32 * t), _V8F32, align=4) for t in range(4)]
        e = cgutils.alloca_once_value(b, args[4])
        with cgutils.for_range(b, args[2]) as loop:
            at = b.add(args[1], b.mul(loop.index, _const(3)))
            planes = [simd.load(b, symp, b.shl(b.add(at, _const(k)), _const(3)), _I64, align=8) for k in range(3)]
            mask = b.and_(b.and_(planes[0], planes[1]), planes[2])
            c0 = b.shl(loop.index, _const(6))
            for k in range(8):
                slots, e_next = _slots(b, planes, mask, k, escp, b.load(e), rankp, pb)
                b.store(e_next, e)
                col = b.add(c0, _const(8 * k))
                g = b.lshr(col, args[6])
                scale = simd.splat(b, simd.load(b, scalesp, b.shl(g, _const(2)), simd.F32, align=4), _V8F32)
                simd.store(b, b.fmul(_values(b, slots, tables, pb), scale), outp, b.shl(col, _const(2)), align=4)
        return b.load(e)

    @intrinsic
    def rows(typingctx, sym, at0, blocks, esc, e, values, gshift, scales, out):
        sig = types.int64(sym, types.int64, types.int64, esc, types.int64, values, types.int64, scales, out)
        return sig, codegen

    return rows


_rows0, _rows1, _rows2, _rows3, _rows4 = (_make_rows(pb) for pb in range(5))


@njit(cache=True, inline="always")
def coded_rows_avx2(pb, sym, at0, blocks, esc, e, values, gshift, scales, out):
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
