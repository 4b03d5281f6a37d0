"""The safetensors dtype names this project reads and writes, with their sizes.

Defined once here; the codec and runtime layers import from this table.
"""

from __future__ import annotations

# safetensors dtype name -> bytes per element, for the dtypes whose values the codec models
# (floats split into exponent and mantissa, 1-byte integers coded byte-wise)
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}

# The other dtypes of the safetensors format (those safetensors 0.8 accepts), in bits per element:
# stored as they are (zstd, else raw), bit-exact, with no model of their values. Sub-byte elements
# are packed as safetensors packs them; a tensor of them MUST fill a whole number of bytes.
STORED_DTYPE_BITS: dict[str, int] = {
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "C64": 64,
}

DTYPE_BITS: dict[str, int] = {**{k: 8 * v for k, v in DTYPE_SIZES.items()}, **STORED_DTYPE_BITS}

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
