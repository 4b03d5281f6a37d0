"""The safetensors dtype names this project reads and writes, with their sizes.

Defined once here; the codec and runtime layers import from this table.
"""

from __future__ import annotations

# safetensors dtype name -> bytes per element
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

FLOAT_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64"})

# Largest tensor (in bytes) a reader accepts: far above any real checkpoint, far below what
# would overflow 64-bit offset arithmetic.
MAX_TENSOR_BYTES = 1 << 48


def tensor_nbytes(dtype: str, shape: list[int] | tuple[int, ...]) -> int:
    """Exact byte size of a tensor; raises ValueError on an unknown dtype or absurd size."""
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise ValueError(f"unknown dtype {dtype!r}")
    n = DTYPE_SIZES[dtype]
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d <= MAX_TENSOR_BYTES:
            raise ValueError(f"bad dimension {d!r} in shape {list(shape)}")
        n *= d
        if n > MAX_TENSOR_BYTES:
            raise ValueError(f"shape {list(shape)} of {dtype} exceeds {MAX_TENSOR_BYTES} bytes")
    return n
