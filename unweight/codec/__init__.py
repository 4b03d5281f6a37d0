"""The codec core: CPU-only (numpy, numba, zstandard); never imports torch, triton or the runtime."""

from .entries import CODECS, transposed
from .tensor_codec import (
    CodecOptions,
    check_stream_crcs,
    decode_rows,
    decode_tensor,
    encode_tensor,
)

__all__ = [
    "CODECS",
    "CodecOptions",
    "check_stream_crcs",
    "transposed",
    "decode_rows",
    "decode_tensor",
    "encode_tensor",
]
