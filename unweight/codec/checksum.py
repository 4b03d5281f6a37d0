"""CRC-32 (the zlib polynomial, SPEC.md §2) of tensor bytes, from the fastest implementation here.

Every tensor's CRC is computed when it is written and checked whenever it is read, so its speed
counts: zlib's runs at about 2.2 GB/s on this project's 2-core EPYC VM, a fifth of the codec's
encode time; ISA-L's (the `isal` package, carry-less multiply folding) at about 8.8 GB/s, and
zlib-ng's at 6.9. All three give the same value; the first one importable is used.
"""

from __future__ import annotations

import zlib

try:
    from isal.isal_zlib import crc32 as _crc32

    IMPLEMENTATION = "isal"
except ImportError:  # pragma: no cover - platforms without an isal wheel
    try:
        from zlib_ng.zlib_ng import crc32 as _crc32

        IMPLEMENTATION = "zlib-ng"
    except ImportError:
        _crc32 = zlib.crc32
        IMPLEMENTATION = "zlib"


def crc32(data, value: int = 0) -> int:
    """The CRC-32 of a bytes-like object (or a C-contiguous numpy array), as zlib.crc32 gives;
    `value`, the CRC of the bytes before, continues a running one (pieces in order)."""
    return _crc32(memoryview(data), value)
