"""map_chunk_ranges: every chunk exactly once, whole groups where it can, errors after all ranges."""

from __future__ import annotations

import threading
import time

import pytest

from unweight.codec.parallel import MIN_PARALLEL_CHUNKS, map_chunk_ranges


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("nchunks", [0, 1, 7, 8, 12, 13, 64, 181])
@pytest.mark.parametrize("align", [1, 4])
def test_ranges_cover_every_chunk_once(threads, nchunks, align):
    seen, lock = [], threading.Lock()

    def fn(c0, c1):
        assert 0 <= c0 < c1 <= nchunks
        with lock:
            seen.append((c0, c1))

    map_chunk_ranges(fn, nchunks, threads, align)
    covered = sorted(c for a, b in seen for c in range(a, b))
    assert covered == list(range(nchunks))
    if threads == 1 or nchunks < MIN_PARALLEL_CHUNKS:
        assert len(seen) == (1 if nchunks else 0)
    else:
        assert len(seen) >= threads  # the work is shared out
        whole_groups = nchunks // align >= 2 * threads
        if whole_groups:
            assert all(a % align == 0 for a, _ in seen)


def test_the_caller_works_and_waits_for_every_range_before_raising():
    done, callers = [], set()

    def fn(c0, c1):
        callers.add(threading.current_thread().name)
        if c0 == 0:
            raise RuntimeError("chunk 0 is bad")
        time.sleep(0.02)
        done.append(c0)

    with pytest.raises(RuntimeError, match="chunk 0"):
        map_chunk_ranges(fn, 16, 2, 1)
    assert threading.current_thread().name in callers
    assert len(done) >= 1 and all(c > 0 for c in done)
    snapshot = list(done)
    time.sleep(0.1)
    assert done == snapshot  # nothing still running after the call returned
