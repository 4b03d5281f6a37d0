"""Memory for decoded tensors.

numpy advises the kernel to back every array of 4 MiB or more with transparent huge pages
(madvise MADV_HUGEPAGE). Where THP `defrag` is `madvise` (the default of most distributions),
a page fault in such memory may stop to compact memory until a free 2 MiB page exists, and
after other big arrays were freed in 4 KiB pieces it often must. Decoding writes every byte of
its output once, so those stalls land in the decode: on the VM of docs/compression.md, fresh
outputs of the 8B-shaped set (117 MB a tensor) cost 475 ms of system time with the advice and
240 ms without it, for about 300 ms of decoding (medians of 10 runs).

Below glibc's largest mmap threshold (32 MiB on 64-bit hosts) malloc serves arrays from its heap
and hands freed memory to the next array without new faults, which a map of our own would give
up (MiniLM's decode, 45 MB in 103 tensors, took 1.4x longer with every output mapped afresh). Above
it malloc maps fresh memory for every array anyway; there `empty()` maps it itself, private and
anonymous, without the advice: where THP is `always` the kernel still uses huge pages it has free,
and never stalls for them.
"""

from __future__ import annotations

import mmap

import numpy as np

OWN_MAP_BYTES = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit hosts
_PRIVATE = getattr(mmap, "MAP_PRIVATE", None)
_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", None)


def empty(n: int, dtype) -> np.ndarray:
    """np.empty(n, dtype), writable, without numpy's huge-page advice when over OWN_MAP_BYTES
    (page aligned then; the array owns its map through `.base`, released with the array).

    Smaller arrays, and all of them where mmap has no private anonymous maps (Windows), come from
    np.empty itself. A map the system refuses raises MemoryError, as np.empty would."""
    dtype = np.dtype(dtype)
    nbytes = n * dtype.itemsize
    if nbytes <= OWN_MAP_BYTES or _PRIVATE is None or _ANONYMOUS is None:
        return np.empty(n, dtype=dtype)
    try:
        buf = mmap.mmap(-1, nbytes, flags=_PRIVATE | _ANONYMOUS)
    except OSError as e:  # ENOMEM: the same failure np.empty reports as MemoryError
        raise MemoryError(f"cannot map {nbytes} bytes: {e.strerror}") from None
    return np.frombuffer(buf, dtype=dtype)
