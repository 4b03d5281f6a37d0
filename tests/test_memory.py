"""unweight.codec.memory: decode outputs over 32 MiB without numpy's huge-page advice."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from unweight.codec import memory, rans

BIG = memory.OWN_MAP_BYTES + 2


def vm_flags(a: np.ndarray) -> list[str]:
    """The VmFlags of the mapping holding the middle of `a`, from /proc/self/smaps (numpy
    advises whole pages only, from the first page boundary after the array's start)."""
    addr = a.ctypes.data + a.nbytes // 2
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError("no mapping holds the array")


@pytest.mark.parametrize("n, dtype", [(BIG // 2, np.uint16), (BIG, np.uint8), (2 * BIG + 5, np.uint8)])
def test_big_outputs_are_private_writable_and_page_aligned(n, dtype):
    a = memory.empty(n, dtype)
    assert a.shape == (n,) and a.dtype == dtype and a.flags.writeable and a.flags.c_contiguous
    assert a.ctypes.data % 4096 == 0
    a[:] = 7
    a[-1] = 9
    assert int(a[0]) == 7 and int(a[-1]) == 9 and int(a.sum(dtype=np.uint64)) == 7 * (n - 1) + 9


def test_smaller_outputs_are_numpys():  # malloc recycles freed heap memory for them
    a = memory.empty(memory.OWN_MAP_BYTES // 2, np.uint16)
    assert a.base is None and a.size == memory.OWN_MAP_BYTES // 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_big_outputs_carry_no_hugepage_advice():
    plain = np.empty(BIG, dtype=np.uint8)
    plain[::4096] = 1  # fault the pages in so that the mapping is listed with its flags
    if "hg" not in vm_flags(plain):
        pytest.skip("this numpy does not advise huge pages here: nothing to avoid")
    ours = memory.empty(BIG, np.uint8)
    ours[::4096] = 1
    assert "hg" not in vm_flags(ours)


def test_decode_of_a_big_tensor_fills_fresh_private_memory():
    values = (np.random.default_rng(3).standard_normal(BIG // 2) * 0.02).astype(np.float32).view(np.uint32) >> 16
    values = values.astype(np.uint16)
    p = rans.RansParams.for_word(16, True, rans.DEFAULT_PRECISION, 1 << 16)
    out = rans.decode(rans.encode(values, p, 1), p, len(values), 1)
    assert np.array_equal(out, values)
    if sys.platform.startswith("linux"):
        assert "hg" not in vm_flags(out)


def test_a_refused_map_is_a_memory_error(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(memory.mmap, "mmap", refuse)
    with pytest.raises(MemoryError, match="cannot map"):
        memory.empty(BIG, np.uint8)
