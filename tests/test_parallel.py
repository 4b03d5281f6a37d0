"""map_chunk_ranges: every chunk exactly once, whole groups where it can, errors after all ranges.
map_in_order: results in order, small items ahead on the pool within a bound, big ones alone."""

from __future__ import annotations

import threading
import time

import pytest

from unweight.codec.parallel import MIN_PARALLEL_CHUNKS, map_chunk_ranges, map_in_order


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


class Recorder:
    """fn for map_in_order: records who ran each item, with how many threads, and how many small
    items were started and not yet consumed at once."""

    def __init__(self, big=(), bad=(), tiny=()):
        self.big, self.bad, self.tiny = set(big), set(bad), set(tiny)
        self.lock = threading.Lock()
        self.ran = {}
        self.started = self.consumed = self.most_ahead = 0
        self.running = 0

    def __call__(self, item, inner):
        with self.lock:
            self.ran[item] = (threading.current_thread().name, inner)
            if item not in self.big | self.tiny:
                self.started += 1
                self.most_ahead = max(self.most_ahead, self.started - self.consumed)
            self.running += 1
        time.sleep(0.002)
        with self.lock:
            self.running -= 1
        if item in self.bad:
            raise ValueError(f"item {item} is bad")
        return item * 10


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_map_in_order_keeps_order_and_runs_big_items_alone(threads):
    items = list(range(20))
    rec = Recorder(big={0, 7, 8, 19}, tiny={3, 12, 13})
    got = []
    for item, get in map_in_order(rec, items, threads, lambda i: i in rec.big, lambda i: i in rec.tiny):
        got.append((item, get()))
        time.sleep(0.006)  # a consumer slower than the workers: they must not run far ahead
        with rec.lock:
            rec.consumed += item not in rec.big | rec.tiny
    assert got == [(i, 10 * i) for i in items]
    me = threading.current_thread().name
    for i in items:
        who, inner = rec.ran[i]
        if threads == 1:
            assert (who, inner) == (me, 1)
        elif i in rec.big:  # in the consumer's own call, with every thread
            assert (who, inner) == (me, threads)
        elif i in rec.tiny:  # in the consumer's own call, with one thread
            assert (who, inner) == (me, 1)
        else:  # ahead of the consumer on the pool, one thread each
            assert who != me and inner == 1
    if threads > 1:
        assert rec.most_ahead <= threads + 2  # in flight, plus the one the consumer holds


def test_map_in_order_runs_small_items_at_the_same_time():
    both = threading.Barrier(2, timeout=10)  # breaks (and the test fails) unless two run at once

    def fn(item, inner):
        if item < 2:
            both.wait()
        return item

    assert [get() for _, get in map_in_order(fn, range(4), 2, lambda i: False)] == [0, 1, 2, 3]


def test_map_in_order_goes_on_ahead_past_an_item_the_consumer_runs():
    both = threading.Barrier(2, timeout=10)  # item 2 must start while item 0 still runs

    def fn(item, inner):
        if item in (0, 2):
            both.wait()
        return item

    assert [get() for _, get in map_in_order(fn, range(4), 2, lambda i: False, lambda i: i == 1)] == [0, 1, 2, 3]


def test_map_in_order_hands_each_error_to_its_item():
    rec = Recorder(bad={3, 4})
    results = {}
    for item, get in map_in_order(rec, range(8), 2, lambda i: False):
        try:
            results[item] = get()
        except ValueError as e:
            results[item] = str(e)
    assert results == {i: (f"item {i} is bad" if i in (3, 4) else 10 * i) for i in range(8)}


def test_map_in_order_stopped_early_leaves_nothing_running():
    rec = Recorder()
    it = map_in_order(rec, range(50), 3, lambda i: False)
    item, get = next(it)
    assert (item, get()) == (0, 0)
    it.close()
    assert rec.running == 0
    assert len(rec.ran) < 50  # what was not started yet never runs
    snapshot = dict(rec.ran)
    time.sleep(0.05)
    assert rec.ran == snapshot
