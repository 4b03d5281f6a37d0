"""The AVX2 rans decoder against the portable numba one, on the same streams, valid and damaged."""

from __future__ import annotations

import numpy as np
import pytest

from unweight.codec import rans, rans_avx2
from unweight.codec.reference import decode_reference

pytestmark = pytest.mark.skipif(not rans_avx2.AVAILABLE, reason="the host CPU has no AVX2")


def bf16(n: int, seed: int) -> np.ndarray:
    """n BF16 bit patterns of N(0, 0.02) weights (as uint16)."""
    f = (np.random.default_rng(seed).standard_normal(n) * 0.02).astype(np.float32)
    return (f.view(np.uint32) >> 16).astype(np.uint16)


def decode_with(avx2: bool, streams, p, n, monkeypatch):
    """The decoded array, or the error message."""
    monkeypatch.setattr(rans_avx2, "AVAILABLE", avx2)
    try:
        return rans.decode(streams, p, n, threads=1)
    except ValueError as e:
        return str(e)


# 1 to 9 chunks (one group of four, then a second, then a lone chunk), with short last chunks
# of every kind: shorter than a round, a few rounds, nearly full.
@pytest.mark.parametrize("n", [1024, 4 * 1024, 5 * 1024 + 3, 7 * 1024 + 600, 9 * 1024 + 1017, 8 * 1024 + 8])
def test_chunk_groups_and_tails(n, monkeypatch):
    values = bf16(n, n)
    p = rans.RansParams.for_word(16, True, precision=14, chunk=1024)
    streams = rans.encode(values, p, 1)
    fast = decode_with(True, streams, p, n, monkeypatch)
    assert isinstance(fast, np.ndarray) and np.array_equal(fast, values)
    assert np.array_equal(decode_reference(p.to_json(), streams, n), values)


@pytest.mark.parametrize("precision", [10, 12, 15])
def test_precisions_and_all_patterns(precision, monkeypatch):
    values = np.random.default_rng(precision).permutation(np.tile(np.arange(65536, dtype=np.uint16), 2))
    p = rans.RansParams.for_word(16, True, precision=precision, chunk=8192)
    streams = rans.encode(values, p, 1)
    assert np.array_equal(decode_with(True, streams, p, len(values), monkeypatch), values)


def test_damaged_streams_give_the_same_outcome(monkeypatch):
    """Flipped bytes in the words, raw bits or states: the two decoders give the same array or
    the same error, for every damage tried (and neither reads out of bounds: no crash)."""
    n = 6 * 2048 + 77
    values = bf16(n, 5)
    p = rans.RansParams.for_word(16, True, precision=14, chunk=2048)
    streams = rans.encode(values, p, 1)
    rng = np.random.default_rng(11)
    errors = 0
    for trial in range(120):
        role = ("words", "raw", "index")[trial % 3]
        blob = streams[role].copy()
        lo = 8 * (p.nchunks(n) + 1) if role == "index" else 0  # damage states, not offsets
        for _ in range(1 + trial % 4):
            blob[rng.integers(lo, len(blob))] ^= np.uint8(1 << rng.integers(0, 8))
        damaged = dict(streams, **{role: blob})
        a = decode_with(True, damaged, p, n, monkeypatch)
        b = decode_with(False, damaged, p, n, monkeypatch)
        if isinstance(a, str) or isinstance(b, str):
            assert a == b
            errors += 1
        else:
            assert np.array_equal(a, b)
    assert errors > 20  # the damage was seen, not just decoded into other values


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [8, 9, 1023, 4 * 1024 + 5, 21 * 1024 + 333])
def test_vector_encoder_writes_the_portable_streams(n, threads, monkeypatch):
    """Word for word, on one thread and on two (ranges of chunks packed side by side: a vector
    store that ran over its range would clobber the next one's raw bytes)."""
    values = bf16(n, 3 * n)
    p = rans.RansParams.for_word(16, True, precision=14, chunk=1024)
    monkeypatch.setattr(rans_avx2, "AVAILABLE", True)
    fast = rans.encode(values, p, threads)
    monkeypatch.setattr(rans_avx2, "AVAILABLE", False)
    portable = rans.encode(values, p, threads)
    assert fast.keys() == portable.keys()
    for role in fast:
        assert np.array_equal(fast[role], portable[role]), role


def test_single_symbol_and_extreme_frequencies(monkeypatch):
    """f = 2^P (one symbol: never a word) and f = 1 (the division's shift-free case) together."""
    rng = np.random.default_rng(2)
    one = np.full(5000, 0x3F80, dtype=np.uint16)
    mixed = one.copy()
    mixed[rng.integers(0, 5000, 3)] = np.array([0x0001, 0x7F7F, 0xC2F0], dtype=np.uint16)
    for values in (one, mixed):
        p = rans.RansParams.for_word(16, True, precision=15, chunk=1024)
        monkeypatch.setattr(rans_avx2, "AVAILABLE", True)
        fast = rans.encode(values, p, 1)
        assert np.array_equal(decode_with(True, fast, p, len(values), monkeypatch), values)
        monkeypatch.setattr(rans_avx2, "AVAILABLE", False)
        assert all(np.array_equal(fast[k], v) for k, v in rans.encode(values, p, 1).items())


@pytest.mark.parametrize("case", ["weights", "all patterns", "one symbol"])
def test_lookup_gives_every_slot_its_entry(case):
    """The vector decoder's two-level table (a byte or two of symbol index per slot, then the
    symbol's entry) holds the same f, q - c and top bits as the slot table, slot for slot."""
    from unweight.codec import freq_table

    values = {
        "weights": bf16(50_000, 3),
        "all patterns": np.arange(65536, dtype=np.uint16),
        "one symbol": np.full(5000, 0x3F80, dtype=np.uint16),
    }[case]
    p = rans.RansParams.for_word(16, True, precision=14, chunk=8192)
    table = rans.encode(values, p, 1)["table"]
    lut, wide = freq_table.lookup_from_stream(table, p.sym_bits, p.precision, 16, 6, True)
    tab = freq_table.slots_from_stream(table, p.sym_bits, p.precision, 16, 6, True)
    assert wide == (case == "all patterns")  # 1024 symbols in use need two-byte indices
    index = lut[freq_table.LOOKUP_SYMBOLS :].view(np.uint16 if wide else np.uint8)
    assert [freq_table.slot_entry(lut, index, q) for q in range(len(tab))] == tab.tolist()
