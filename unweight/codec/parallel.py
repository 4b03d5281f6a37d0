"""Thread pools for the codec: chunk ranges of one tensor (map_chunk_ranges), and whole tensors
several at once, results in order (map_in_order)."""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, partial
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def default_threads() -> int:
    """Threads to use when the caller says 0 or None: the CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@lru_cache(maxsize=8)
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="unweight")


@lru_cache(maxsize=8)
def _tensor_pool(threads: int) -> ThreadPoolExecutor:  # apart from _pool: its tasks never wait on it
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="unweight-tensor")


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


def map_in_order(
    fn: Callable[[T, int], R],
    items: Iterable[T],
    threads: int | None,
    alone: Callable[[T], bool],
    inline: Callable[[T], bool] = lambda item: False,
) -> Iterator[tuple[T, Callable[[], R]]]:
    """Yield (item, get) for each item in order, where get() returns fn(item, inner_threads) or
    raises what it raised.

    - Items for which alone(item) holds (big tensors, which split well into chunk ranges) run one
      at a time, inside get(), with all `threads`.
    - Items for which inline(item) holds (tiny tensors, mostly Python work that would only contend
      for the GIL on a pool) run inside get() with one thread, while the pool goes on ahead.
    - The others (small tensors, whose chunks are too few to share out) run on a pool, one thread
      each, ahead of the consumer: at most threads + 1 in flight besides the one it holds.

    Closing the iterator early waits for the ones in flight."""
    threads = threads or default_threads()
    items = list(items)
    if threads <= 1:
        for item in items:
            yield item, partial(fn, item, 1)
        return
    pool = _tensor_pool(threads)
    ahead: deque = deque()  # (item, its future, or None for one the consumer runs)
    in_flight = i = 0
    try:
        while i < len(items) or ahead:
            while i < len(items) and in_flight <= threads and not alone(items[i]):
                future = None if inline(items[i]) else pool.submit(fn, items[i], 1)
                in_flight += future is not None
                ahead.append((items[i], future))
                i += 1
            if ahead:
                item, future = ahead.popleft()
                if future is None:
                    yield item, partial(fn, item, 1)
                else:
                    in_flight -= 1
                    yield item, future.result
            else:
                yield items[i], partial(fn, items[i], threads)
                i += 1
    finally:
        for _, future in ahead:  # the consumer stopped early: nothing keeps running behind it
            if future is not None and not future.cancel():
                future.exception()  # waits for it to finish
