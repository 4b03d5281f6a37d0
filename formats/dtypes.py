"""The safetensors dtypes this project reads and writes: their sizes, torch's name for each, and
whether the codec models their values. Defined once here (`DTYPES`); the tables below are views
of it, and the codec, the reader and the runtime import them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DType:
    bits: int  # per element
    torch: str | None  # torch's dtype of one element (its name: this layer imports no torch), if it has one
    modeled: bool  # the codec models its values (floats split into exponent and mantissa, 1-byte
    # integers coded byte-wise); the others are stored as they are (zstd, else raw), bit-exact


# Every dtype of the safetensors format (those safetensors 0.8 accepts). Sub-byte elements are
# packed as safetensors packs them; a tensor of them MUST fill a whole number of bytes.
DTYPES: dict[str, DType] = {
    "BOOL": DType(8, "bool", True),
    "U8": DType(8, "uint8", True),
    "I8": DType(8, "int8", True),
    "F8_E4M3": DType(8, "float8_e4m3fn", True),
    "F8_E5M2": DType(8, "float8_e5m2", True),
    "U16": DType(16, "uint16", True),
    "I16": DType(16, "int16", True),
    "F16": DType(16, "float16", True),
    "BF16": DType(16, "bfloat16", True),
    "U32": DType(32, "uint32", True),
    "I32": DType(32, "int32", True),
    "F32": DType(32, "float32", True),
    "U64": DType(64, "uint64", True),
    "I64": DType(64, "int64", True),
    "F64": DType(64, "float64", True),
    "F4": DType(4, None, False),
    "F6_E2M3": DType(6, None, False),
    "F6_E3M2": DType(6, None, False),
    "F8_E8M0": DType(8, "float8_e8m0fnu", False),
    "F8_E4M3FNUZ": DType(8, "float8_e4m3fnuz", False),
    "F8_E5M2FNUZ": DType(8, "float8_e5m2fnuz", False),
    "C64": DType(64, "complex64", False),
}

DTYPE_SIZES: dict[str, int] = {k: d.bits // 8 for k, d in DTYPES.items() if d.modeled}  # bytes per element
STORED_DTYPE_BITS: dict[str, int] = {k: d.bits for k, d in DTYPES.items() if not d.modeled}
DTYPE_BITS: dict[str, int] = {k: d.bits for k, d in DTYPES.items()}
TORCH_DTYPES: dict[str, str] = {k: d.torch for k, d in DTYPES.items() if d.torch is not None}

FLOAT_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64"})

# Largest tensor (in bytes) a reader accepts: far above any real checkpoint, far below what
# would overflow 64-bit offset arithmetic.
MAX_TENSOR_BYTES = 1 << 48


def tensor_nbytes(dtype: str, shape: list[int] | tuple[int, ...]) -> int:
    """Exact byte size of a tensor; raises ValueError on an unknown dtype, an absurd size, or
    sub-byte elements that do not fill whole bytes."""
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise ValueError(f"unknown dtype {dtype!r}")
    bits = DTYPE_BITS[dtype]
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d <= MAX_TENSOR_BYTES:
            raise ValueError(f"bad dimension {d!r} in shape {list(shape)}")
        bits *= d
        if bits > 8 * MAX_TENSOR_BYTES:
            raise ValueError(f"shape {list(shape)} of {dtype} exceeds {MAX_TENSOR_BYTES} bytes")
    if bits % 8:
        raise ValueError(f"shape {list(shape)} of {dtype} is {bits} bits, not a whole number of bytes")
    return bits // 8
