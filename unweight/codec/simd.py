"""Building blocks for x86 SIMD kernels written as LLVM IR inside numba intrinsics.

numba leaves gathers, lane permutes and shuffles out of the code it generates, so the hot loops
that need them (the AVX2 rANS coder here, the CPU GEMV of `unweight.runtime.kernels.cpu_gemv`) are
written as LLVM IR with llvmlite's builder and called from ordinary `@njit` functions. This module
holds what they share: host feature detection, IR types and constants, pointers and loads, and
x86 intrinsic declarations. Nothing here runs on its own; every kernel built from it keeps a
portable numba twin that the tests hold it to.
"""

from __future__ import annotations

import platform
from functools import lru_cache

import numpy as np
from llvmlite import ir
from numba import config
from numba.core import cgutils

I1, I8, I16, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F32 = ir.FloatType()
V8I1, V8I16, V8I32, V8I64 = (ir.VectorType(t, 8) for t in (I1, I16, I32, I64))
V8F32, V32I8, V4I64 = ir.VectorType(F32, 8), ir.VectorType(I8, 32), ir.VectorType(I64, 4)


@lru_cache(maxsize=1)
def host_features() -> frozenset[str]:
    """CPU features of the host numba compiles for; empty where the x86 kernels must not run
    (another architecture, a cross-compiling CPU_NAME, or the JIT disabled)."""
    if (
        platform.machine().lower() not in ("x86_64", "amd64")
        or config.CPU_NAME not in (None, "host")
        or config.DISABLE_JIT
    ):
        return frozenset()
    try:
        from llvmlite import binding

        features = binding.get_host_cpu_features()
    except Exception:  # noqa: BLE001 - llvmlite without the call, or a host it cannot read: no features
        return frozenset()
    return frozenset(name for name, on in features.items() if on)


def cache_bytes(level: int, kind: str) -> int | None:
    """The size of CPU 0's cache of `level` and `kind` (Data, Instruction, Unified) as Linux's sysfs
    gives it, or None where it cannot be read."""
    from pathlib import Path

    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "level").read_text().strip() == str(level) and (index / "type").read_text().strip() == kind:
                size = (index / "size").read_text().strip()
                shift = {"K": 10, "M": 20}.get(size[-1:], 0)
                return int(size[:-1] if shift else size) << shift
        except (OSError, ValueError):
            pass
    return None


@lru_cache(maxsize=1)
def l1d_bytes() -> int:
    """The size of CPU 0's L1 data cache, or 32 KiB where it cannot be read (the smallest of the x86
    cores the AVX-512 kernels run on)."""
    return cache_bytes(1, "Data") or 32 << 10


def has(*features: str) -> bool:
    return all(f in host_features() for f in features)


def const(v, ty=I64):
    return ir.Constant(ty, v)


def vconst(vals, ty=V8I32):
    return ir.Constant(ty, [ir.Constant(ty.element, v) for v in vals])


def splat(builder, scalar, ty):
    """`scalar` in every lane of vector type `ty`."""
    v = builder.insert_element(ir.Constant(ty, ir.Undefined), scalar, const(0, I32))
    return builder.shuffle_vector(
        v, ir.Constant(ty, ir.Undefined), ir.Constant(ir.VectorType(I32, ty.count), [0] * ty.count)
    )


def load(builder, base_ptr, byte_offset, ty, align=1):
    """A value of type `ty` read at base_ptr + byte_offset (base_ptr an i8*)."""
    return builder.load(builder.bitcast(builder.gep(base_ptr, [byte_offset]), ty.as_pointer()), align=align)


def store(builder, value, base_ptr, byte_offset, align=1):
    builder.store(value, builder.bitcast(builder.gep(base_ptr, [byte_offset]), value.type.as_pointer()), align=align)


def data_ptr(context, builder, aryty, ary):
    """The first byte of a numba array argument, as i8*."""
    return builder.bitcast(context.make_array(aryty)(context, builder, ary).data, I8.as_pointer())


def array_parts(context, builder, aryty, ary):
    """A numba array argument's first byte (i8*), its strides and its shape (lists of i64)."""
    arr = context.make_array(aryty)(context, builder, ary)
    dims = range(aryty.ndim)
    strides = [builder.extract_value(arr.strides, a) for a in dims]
    return builder.bitcast(arr.data, I8.as_pointer()), strides, [builder.extract_value(arr.shape, a) for a in dims]


def table(builder, name: str, data: np.ndarray):
    """A read-only global holding `data`'s bytes (one per module, by name), as i8*."""
    mod = builder.module
    g = mod.globals.get(name)
    if g is None:
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        g = cgutils.global_constant(mod, name, ir.Constant(ir.ArrayType(I8, len(raw)), bytearray(raw.tobytes())))
    return builder.bitcast(g, I8.as_pointer())


class _BFloat(ir.Type):
    """LLVM's `bfloat` (llvmlite has no class for it; its IR is text, so the name is all it takes)."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


BF16 = _BFloat()
V16F32, V16I32, V32BF16 = ir.VectorType(F32, 16), ir.VectorType(I32, 16), ir.VectorType(BF16, 32)


def dpbf16ps(builder, acc, a, b):
    """vdpbf16ps on 512 bits (AVX512_BF16): dpbf16ps on <16 x float> `acc` and <16 x i32> a, b
    holding 32 BF16 values each."""
    fn = function(builder, "llvm.x86.avx512bf16.dpbf16ps.512", V16F32, [V16F32, V32BF16, V32BF16])
    return builder.call(fn, [acc, builder.bitcast(a, V32BF16), builder.bitcast(b, V32BF16)])


def _pointer_mangling(vec) -> str:
    """The pointer part of a masked memory intrinsic's name: `p0` where LLVM's pointers are opaque
    (LLVM 17 and later), `p0<vector>` where they are typed."""
    from llvmlite import binding

    return "p0" if binding.llvm_version_info[0] >= 17 else f"p0{_mangle(vec)}"


def _mangle(vec) -> str:
    return f"v{vec.count}{vec.element}"


def mask_of(builder, bits, lanes: int):
    """The low `lanes` bits of the integer `bits` as an <lanes x i1> (an AVX-512 mask register)."""
    return builder.bitcast(builder.trunc(bits, ir.IntType(lanes)), ir.VectorType(I1, lanes))


def masked_load(builder, ptr, mask, vec):
    """A `vec` read at i8* `ptr`, only the lanes of `mask` (<n x i1>) touched in memory (AVX-512
    masked vmovdqu: no byte past the mask is read, so no slack is needed); the others zero."""
    fn = function(
        builder,
        f"llvm.masked.load.{_mangle(vec)}.{_pointer_mangling(vec)}",
        vec,
        [vec.as_pointer(), I32, mask.type, vec],
    )
    zero = ir.Constant(vec, [ir.Constant(vec.element, 0)] * vec.count)
    return builder.call(fn, [builder.bitcast(ptr, vec.as_pointer()), const(1, I32), mask, zero])


def masked_store(builder, value, ptr, mask):
    """Store the lanes of `mask` of `value` at i8* `ptr`; memory under the other lanes is untouched."""
    vec = value.type
    fn = function(
        builder,
        f"llvm.masked.store.{_mangle(vec)}.{_pointer_mangling(vec)}",
        ir.VoidType(),
        [vec, vec.as_pointer(), I32, mask.type],
    )
    builder.call(fn, [value, builder.bitcast(ptr, vec.as_pointer()), const(1, I32), mask])


def expand_load(builder, ptr, mask, passthru):
    """vpexpandb: lane i of `mask`'s set lanes (in order) takes the next byte from i8* `ptr` (only
    as many bytes as the mask has set are read); the other lanes keep `passthru`."""
    vec = passthru.type
    fn = function(builder, f"llvm.masked.expandload.{_mangle(vec)}", vec, [I8.as_pointer(), mask.type, vec])
    return builder.call(fn, [ptr, mask, passthru])


def function(builder, name: str, ret, args):
    """Declare (once per module) and return an LLVM intrinsic or function."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def ctpop64(builder, v):
    return builder.call(function(builder, "llvm.ctpop.i64", I64, [I64]), [v])


def pshufb(builder, table_bytes, control):
    """vpshufb on <32 x i8>: within each 128-bit half, byte j takes table byte control[j] & 15, or
    0 if bit 7 of control[j] is set."""
    return builder.call(function(builder, "llvm.x86.avx2.pshuf.b", V32I8, [V32I8, V32I8]), [table_bytes, control])


def permd(builder, v, idx):
    """vpermd: lane i takes lane idx[i] of v (any lane of the 256 bits)."""
    return builder.call(function(builder, "llvm.x86.avx2.permd", V8I32, [V8I32, V8I32]), [v, idx])


def lookup64x8(builder, base_ptr, idx, via=None):
    """The 64-bit words at base_ptr + 8 * idx[i] (eight lanes), split into their low and high
    halves as two <8 x i32>: eight scalar loads (extract the index, load, insert). With `via` (a
    pointer to unsigned integers), the words at base_ptr + 8 * via[idx[i]]: two loads a lane.

    AVX2's vpgatherdq is microcoded on Zen 3 and slows down most when the core is shared: the rANS
    decoder ran 1.05-1.22x faster (median of paired runs) with these loads than with two gathers."""
    p64 = builder.bitcast(base_ptr, I64.as_pointer())
    halves = []
    for part in (0, 1):
        v = ir.Constant(V4I64, ir.Undefined)
        for i in range(4):
            j = builder.zext(builder.extract_element(idx, const(4 * part + i, I32)), I64)
            if via is not None:
                j = builder.zext(builder.load(builder.gep(via, [j]), align=1), I64)
            v = builder.insert_element(v, builder.load(builder.gep(p64, [j]), align=8), const(i, I32))
        halves.append(builder.bitcast(v, V8I32))
    lo = builder.shuffle_vector(halves[0], halves[1], ir.Constant(V8I32, [0, 2, 4, 6, 8, 10, 12, 14]))
    hi = builder.shuffle_vector(halves[0], halves[1], ir.Constant(V8I32, [1, 3, 5, 7, 9, 11, 13, 15]))
    return lo, hi


def lane_mask(builder, cond):
    """The 8 lanes of an <8 x i1> as the low bits of an i64 (vmovmskps)."""
    return builder.zext(builder.bitcast(cond, I8), I64)
