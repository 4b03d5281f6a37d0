"""Memory budgets: how much a command may hold at once, and giving mapped file pages back.

Commands that only read a tensor (verify, inspect, decompress) decode it in pieces of at most
PIECE_BYTES, so their memory does not grow with the size a file declares. What must hold a whole
tensor (get_tensor, compress) first asks `require()`, which refuses, naming the file and tensor,
what the budget cannot hold: a small hostile file can declare a tensor of terabytes.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import resource

import numpy as np

from .errors import MemoryLimitError

PIECE_BYTES = 32 << 20  # decoded bytes per piece: big enough that per-piece costs vanish
MIN_PIECE_BYTES = 1 << 20
_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _vm_size() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def available() -> int:
    """Bytes this process can still allocate: the machine's available memory, less under an
    address-space or data rlimit (what `ulimit -v` and container limits set)."""
    avail = _meminfo("MemAvailable")
    if avail is None:
        try:
            avail = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):  # not POSIX: no cap
            avail = 1 << 62
    for limit in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
        soft, _ = resource.getrlimit(limit)
        if soft != resource.RLIM_INFINITY:
            avail = min(avail, max(0, soft - _vm_size()))
    return avail


def check_budget(max_memory: int | None) -> int | None:
    """Validate a max_memory value (None: no explicit budget)."""
    if max_memory is not None and (
        not isinstance(max_memory, int) or isinstance(max_memory, bool) or max_memory < MIN_PIECE_BYTES
    ):
        raise ValueError(f"max_memory {max_memory!r} must be an integer of at least {MIN_PIECE_BYTES} bytes")
    return max_memory


def require(nbytes: int, max_memory: int | None, what: str, path: str | None = None, tensor: str | None = None) -> None:
    """Raise MemoryLimitError unless `nbytes` fit in the budget (max_memory, or what is available;
    without a budget, sizes up to a piece are not worth reading /proc/meminfo for, tensor by tensor)."""
    if max_memory is None and nbytes <= PIECE_BYTES:
        return
    budget = max_memory if max_memory is not None else available()
    if nbytes > budget:
        source = "the --max-memory budget" if max_memory is not None else "the memory this machine has available"
        raise MemoryLimitError(path, f"{what} needs {nbytes:,} bytes, over {source} ({budget:,} bytes)", tensor)


def piece_bytes(max_memory: int | None) -> int:
    """The piece size of the streaming decoders under a budget (a few pieces are alive at once)."""
    if max_memory is None:
        return PIECE_BYTES
    return max(MIN_PIECE_BYTES, min(PIECE_BYTES, max_memory // 8))


def _mapped_file(view: np.ndarray) -> bool:
    base = view
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):  # np.frombuffer(mapping) holds a memoryview of it
        base = base.obj
    return isinstance(base, mmap.mmap)


def release(view: np.ndarray) -> None:
    """Unmap the whole pages under `view`, a view of a read-only file mapping (SafetensorsFile):
    they leave this process's resident set and are read again from the page cache if touched.
    Anything else is left alone (dropping anonymous pages would lose their contents)."""
    if os.name != "posix" or view.nbytes < _PAGE or not _mapped_file(view):  # under a page: no whole page to give
        return
    start = view.ctypes.data
    lo = -(-start // _PAGE) * _PAGE
    hi = (start + view.nbytes) // _PAGE * _PAGE
    if hi > lo:
        _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return _LIBC
