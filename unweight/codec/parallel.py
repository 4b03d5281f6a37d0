"""Running GIL-free kernels over ranges of chunks on a shared thread pool."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Callable


def default_threads() -> int:
    """Threads to use when the caller says 0 or None: the CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@lru_cache(maxsize=8)
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="unweight")


# Below this many chunks a tensor runs on the calling thread: handing a few 100-microsecond chunks
# to the pool costs more than it saves (MiniLM's 384x384 tensors decoded slower on 2 threads).
MIN_PARALLEL_CHUNKS = 8


def map_chunk_ranges(fn: Callable[[int, int], None], nchunks: int, threads: int | None, align: int = 1) -> None:
    """Call fn(c0, c1) over [0, nchunks) split into about 4 ranges per thread, each starting at a
    multiple of `align` (kernels that take chunks in groups then always find full groups), or,
    when there are too few groups for that to balance (12 chunks in groups of 4 on 2 threads),
    into one even range per thread; wait for all."""
    threads = threads or default_threads()
    if threads <= 1 or nchunks < MIN_PARALLEL_CHUNKS:
        if nchunks:
            fn(0, nchunks)
        return
    parts = min(nchunks // align, threads * 4)
    if parts < 2 * threads:  # too few whole groups to share out evenly: one range per thread
        parts, align = threads, 1
    bounds = [nchunks * i // parts // align * align for i in range(parts)] + [nchunks]
    ranges = iter([(a, b) for a, b in zip(bounds, bounds[1:]) if a < b])
    lock = threading.Lock()

    def work() -> None:  # take the next range until none is left
        while True:
            with lock:
                r = next(ranges, None)
            if r is None:
                return
            fn(*r)

    # The calling thread works too, beside threads - 1 pool threads: one wake-up fewer per call
    # (a 590K-element tensor decoded slower on 2 threads than on 1 when the caller only waited).
    futures = [_pool(threads - 1).submit(work) for _ in range(min(threads, parts) - 1)]
    try:
        work()
    finally:
        for f in futures:  # every range is done before returning, even when one failed
            f.exception()
    for f in futures:
        f.result()
