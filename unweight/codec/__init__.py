"""The codec core: CPU-only (numpy, numba, zstandard); never imports torch, triton or the runtime."""

from .tensor_codec import (
    CODECS,
    CodecOptions,
    check_stream_crcs,
    decode_rows,
    decode_tensor,
    encode_tensor,
    transposed,
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
