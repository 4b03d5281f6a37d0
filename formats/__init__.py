"""Unweight's container format: a safetensors file with a manifest (see SPEC.md).

This layer knows bytes, headers and manifests; it knows nothing of codecs. It depends only on
the standard library and numpy.
"""

from .container import (
    FORMAT_NAME,
    FORMAT_VERSION,
    ContainerReader,
    ContainerWriter,
    TensorEntry,
)
from .dtypes import DTYPE_BITS, DTYPE_SIZES, STORED_DTYPE_BITS
from .errors import FormatError
from .safetensors_file import SafetensorsFile, TensorInfo, declared_header_bytes, write_safetensors

__all__ = [
    "DTYPE_BITS",
    "DTYPE_SIZES",
    "STORED_DTYPE_BITS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "ContainerReader",
    "ContainerWriter",
    "FormatError",
    "SafetensorsFile",
    "TensorEntry",
    "TensorInfo",
    "declared_header_bytes",
    "write_safetensors",
]
