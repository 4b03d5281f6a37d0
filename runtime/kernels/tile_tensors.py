"""The serving layout's streams as the runtime holds them: torch tensors on one device.

On the CPU the streams of each layer lie together, each on a 64-byte boundary, in memory the kernel
is asked to back with 2 MiB pages (`StreamArena`): the CPU kernels read every stream once per step,
and a cold pass over the weights in 4 KiB pages took 1.11x the time at one row of x and 1.07x at
16 (SmolLM2's 120 layers, one Zen 4 core).
"""

from __future__ import annotations

import mmap
import threading
import weakref

import numpy as np
import torch

from unweight.codec import tiles

ALIGN = 64  # bytes: each stream starts on a cache line
HUGE = 2 << 20  # bytes of an x86 huge page


def _huge_mapping(nbytes: int) -> np.ndarray:
    """nbytes of zeroed private memory starting on a 2 MiB boundary, its whole 2 MiB extents advised
    MADV_HUGEPAGE (transparent huge pages where the kernel allows them: `enabled` madvise or always);
    plain numpy memory where the platform has no such mapping."""
    if not hasattr(mmap, "MAP_PRIVATE") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.zeros(nbytes, dtype=np.uint8)
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(m, dtype=np.uint8)  # holds the mapping open while any view of it lives
    start = -whole.ctypes.data % HUGE
    if nbytes >= HUGE:
        m.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE * HUGE)
    return whole[start : start + nbytes]


class StreamArena:
    """Hands out 64-byte-aligned blocks of CPU memory for the streams of a layer, from chunks of
    CHUNK bytes in huge-page mappings; a block over a quarter of a chunk gets a mapping of its own.
    A chunk stays mapped while any block of it is referenced (a model's layers live together), and
    no longer: the arena holds its current chunk by a weak reference, so a dropped model's memory
    goes back to the system even while its chunk is the one the arena fills."""

    CHUNK = 64 << 20

    def __init__(self):
        self._lock = threading.Lock()
        self._owner: weakref.ref | None = None  # the array owning the current chunk's memory
        self._offset = self._used = 0  # of the chunk in its owner; bytes of the chunk handed out

    def take(self, nbytes: int) -> np.ndarray:
        nbytes = -(-nbytes // ALIGN) * ALIGN
        if nbytes > self.CHUNK // 4:
            return _huge_mapping(nbytes)
        with self._lock:
            owner = self._owner() if self._owner is not None else None
            if owner is None or self._used + nbytes > self.CHUNK:
                chunk = _huge_mapping(self.CHUNK)
                # every block's base is the array owning the memory (numpy collapses chains of
                # views to it), so that array, not the chunk view, lives exactly as long as a block
                owner = chunk if chunk.base is None else chunk.base
                self._owner, self._used = weakref.ref(owner), 0
                self._offset = chunk.ctypes.data - owner.ctypes.data
            at = self._offset + self._used
            self._used += nbytes
            return owner[at : at + nbytes]


ARENA = StreamArena()


def tile_tensors(streams: dict[str, np.ndarray], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """uint8 sm, codes and esc (at least one byte, so kernels always get a valid pointer) and
    esc_index widened to int64 entries (kernels add it to 64-bit element offsets). On the CPU they
    are copied into one block of ARENA, each on a 64-byte boundary; elsewhere writable streams are
    taken over, not copied: the caller must not change them afterwards."""
    esc = np.asarray(streams["esc"], dtype=np.uint8)
    out = {
        "sm": np.asarray(streams["sm"], dtype=np.uint8),
        "codes": np.asarray(streams["codes"], dtype=np.uint8),
        "esc": esc if len(esc) else np.zeros(1, dtype=np.uint8),
        "esc_index": tiles.esc_index_entries(streams["esc_index"]),
    }
    if torch.device(device).type == "cpu":
        sizes = {k: -(-v.nbytes // ALIGN) * ALIGN for k, v in out.items()}
        block, at, placed = ARENA.take(sum(sizes.values())), 0, {}
        for k, v in out.items():
            dst = block[at : at + v.nbytes].view(v.dtype)
            dst[:] = v
            placed[k] = torch.from_numpy(dst)
            at += sizes[k]
        return placed
    # arrays the caller owns become the tensors' storage; read-only ones (a file mapping's) are copied
    return {k: torch.from_numpy(v if v.flags.writeable else np.array(v)).to(device) for k, v in out.items()}
