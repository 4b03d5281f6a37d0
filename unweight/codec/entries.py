"""What a manifest entry says of its codec, checked before any byte is decoded: which streams each
codec has (`ROLES`), a rans entry's parameters against its dtype (`rans_params`), whether its
matrices are coded transposed (`transposed`, `untranspose`), and `check_entry`. Both directions of
the codec build on this module: `tensor_codec` (whole tensors, encode and decode) and `pieces`
(decode a piece at a time).
"""

from __future__ import annotations

import numpy as np

from unweight.formats import TensorEntry
from unweight.formats.dtypes import DTYPE_SIZES, FLOAT_DTYPES

from . import rans, tiles

CODECS = ("raw", "zstd", "rans", "tiles")
ROLES = {
    "raw": ("data",),
    "zstd": ("data",),
    "rans": ("table", "raw", "words", "index"),
    "tiles": ("sm", "codes", "esc", "esc_index"),
}


def _rans_word(dtype: str) -> tuple[int, bool] | None:
    """(word bits, rotate) if the rans codec applies to this dtype, else None (F64 and the dtypes
    of STORED_DTYPE_BITS, F4 ... C64, go to zstd or raw). Integers are coded byte by byte (SPEC.md
    §3.3, format 2.1): a packed I32 of eight INT4 codes is four symbols of two codes each, a model
    at least as good as one of single 4-bit codes (two codes' joint entropy is at most the sum of
    theirs)."""
    size = DTYPE_SIZES.get(dtype)
    if size is None or dtype == "F64":
        return None
    if dtype in FLOAT_DTYPES:
        return 8 * size, True
    return 8, False  # BOOL, U8, I8 ... U64, I64


# elements of one matrix of a `transpose` entry (SPEC.md §3.3): such a tensor is decoded a matrix at a time
MAX_TRANSPOSED_MATRIX = 1 << 28


def rans_params(entry: TensorEntry) -> tuple[rans.RansParams, int]:
    """A rans entry's parameters, checked against its dtype, and how many words it codes (its
    elements, or its bytes where it is coded byte by byte). Raises ValueError."""
    params = dict(entry.params)
    transpose = params.pop("transpose", False)
    p = rans.RansParams.from_json(params)
    if _rans_word(entry.dtype) != (p.word_bits, p.rotate):
        raise ValueError(f"rans params word_bits={p.word_bits} rotate={p.rotate} do not fit dtype {entry.dtype}")
    if transpose is not False:
        if transpose is not True:
            raise ValueError(f"rans param transpose {transpose!r} is not a boolean")
        if not _transposable(entry.dtype, tuple(entry.shape)):
            raise ValueError(
                f"rans param transpose is for 3-D float tensors of at most {MAX_TRANSPOSED_MATRIX} elements a "
                f"matrix, not {entry.dtype}{list(entry.shape)}"
            )
    return p, entry.nbytes * 8 // p.word_bits


def transposed(entry: TensorEntry) -> bool:
    """Whether a rans entry codes its elements in the order of its matrices transposed
    (`transpose`: a fused experts tensor (E, H, 2I) coded as (E, 2I, H), so that a tensor-parallel
    rank's rows of gate and up are contiguous and decode alone). Square matrices too: the shape
    does not tell."""
    return entry.codec == "rans" and entry.params.get("transpose") is True


def untranspose(coded: np.ndarray, entry: TensorEntry, matrices: int) -> np.ndarray:
    """`matrices` whole matrices of a transposed entry, given as decoded (in coded order), as the
    tensor's original bytes (a new uint8 array)."""
    height, width = entry.shape[-2:]  # each coded matrix is (width, height)
    words = coded.view(rans.UINT_OF_BITS[8 * DTYPE_SIZES[entry.dtype]]).reshape(matrices, width, height)
    return np.ascontiguousarray(words.swapaxes(-1, -2)).view(np.uint8).reshape(-1)


def _transposable(dtype: str, shape: tuple[int, ...]) -> bool:
    """Whether a tensor may be coded transposed (SPEC.md §3.3): 3-D, floats coded element by
    element, matrices of at most MAX_TRANSPOSED_MATRIX elements."""
    return (
        len(shape) == 3
        and dtype in FLOAT_DTYPES
        and _rans_word(dtype) is not None
        and 0 < shape[-1] * shape[-2] <= MAX_TRANSPOSED_MATRIX
    )


def check_entry(entry: TensorEntry, streams: dict[str, np.ndarray]) -> None:
    """Codec-level validation of a manifest entry against its streams (SPEC.md §4 rule 5)."""
    if entry.codec not in ROLES:
        raise ValueError(f"unknown codec {entry.codec!r} (this version knows {', '.join(CODECS)}); upgrade unweight")
    if set(streams) != set(ROLES[entry.codec]):
        raise ValueError(f"codec {entry.codec} needs streams {sorted(ROLES[entry.codec])}, found {sorted(streams)}")
    if entry.codec == "raw" and len(streams["data"]) != entry.nbytes:
        raise ValueError(f"raw data has {len(streams['data'])} bytes, the tensor has {entry.nbytes}")
    if entry.codec in ("raw", "zstd") and entry.params:
        raise ValueError(f"codec {entry.codec} takes no params")
    if entry.codec == "tiles" and not tiles.applies(entry.dtype, entry.shape):
        raise ValueError(f"codec tiles is for non-empty 2-D BF16 tensors, not {entry.dtype}{list(entry.shape)}")
