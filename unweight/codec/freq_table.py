"""rANS frequency tables: quantising counts, the `table` stream (SPEC.md §3.3), decode slot tables."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import njit

MAX_VARINT_BYTES = 5


class TableError(ValueError):
    """The `table` stream does not describe a valid frequency table."""


def quantize(counts: np.ndarray, precision: int) -> np.ndarray:
    """Scale symbol counts to integer frequencies summing to 2**precision.

    Every symbol that occurs gets at least 1. Rounding is fixed greedily, one unit at a time, where
    it costs the fewest coded bits (count · log2 of the frequency ratio): deterministic, and within
    a hair of the ideal cross-entropy for the precisions used here.
    """
    counts = np.asarray(counts, dtype=np.int64)
    present = int(np.count_nonzero(counts))
    if present == 0:
        raise ValueError("cannot build a frequency table for no symbols")
    if present > 1 << precision:
        raise ValueError(f"{present} symbols do not fit precision {precision}")
    freq = _quantize(counts, 1 << precision)
    assert int(freq.sum()) == 1 << precision
    return freq


@njit(nogil=True, cache=True)
def _quantize(counts, target):
    present = np.flatnonzero(counts)
    total = counts.sum()
    freq = np.zeros(len(counts), dtype=np.int64)
    for s in present:
        freq[s] = max(1, counts[s] * target // total)
    diff = target - freq.sum()
    gain = np.empty(len(present), dtype=np.float64)
    while diff > 0:  # hand out units where they save the most bits, at most one per symbol a pass
        for i in range(len(present)):
            s = present[i]
            gain[i] = -(counts[s] * np.log2((freq[s] + 1) / freq[s]))
        order = np.argsort(gain, kind="mergesort")  # stable: ties go to the lower symbol
        take = min(diff, len(present))
        for i in range(take):
            freq[present[order[i]]] += 1
        diff -= take
    while diff < 0:  # take units back where they cost the least (rare: only after the max(1, .) bumps)
        best, best_cost = -1, np.inf
        for s in present:
            if freq[s] > 1:
                cost = counts[s] * np.log2(freq[s] / (freq[s] - 1))
                if cost < best_cost:
                    best, best_cost = s, cost
        freq[best] -= 1
        diff += 1
    return freq


@njit(nogil=True, cache=True)
def _write_varints(vals, out):
    """LEB128-encode vals into out (large enough: 5 bytes each); returns the byte count."""
    k = 0
    for v in vals:
        while v >= 0x80:
            out[k] = (v & 0x7F) | 0x80
            v >>= 7
            k += 1
        out[k] = v
        k += 1
    return k


def serialize(freq: np.ndarray) -> bytes:
    """The `table` stream: varints lo, count, then the frequencies of symbols lo .. lo+count-1."""
    nz = np.flatnonzero(freq)
    lo, hi = int(nz[0]), int(nz[-1]) + 1
    vals = np.concatenate(([lo, hi - lo], np.asarray(freq[lo:hi], dtype=np.int64)))
    out = np.empty(MAX_VARINT_BYTES * len(vals), dtype=np.uint8)
    return out[: _write_varints(vals, out)].tobytes()


@njit(nogil=True, cache=True)
def _read_varints(data, out):
    """Parse LEB128 varints from data into out; returns the count, or -1 (truncated), -2 (too
    long), -3 (more than out can hold)."""
    pos = 0
    k = 0
    while pos < len(data):
        v = np.int64(0)
        shift = 0
        done = False
        for _ in range(MAX_VARINT_BYTES):
            if pos >= len(data):
                return -1
            b = np.int64(data[pos])
            pos += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                done = True
                break
        if not done:
            return -2
        if k >= len(out):
            return -3
        out[k] = v
        k += 1
    return k


def parse(blob: bytes | np.ndarray, sym_bits: int, precision: int) -> np.ndarray:
    """Read and check a `table` stream; returns frequencies for all 2**sym_bits symbols."""
    nsym = 1 << sym_bits
    vals = np.empty(nsym + 2, dtype=np.int64)
    k = _read_varints(np.frombuffer(blob, dtype=np.uint8), vals)
    if k == -1:
        raise TableError("table stream ends inside a varint")
    if k == -2:
        raise TableError(f"varint longer than {MAX_VARINT_BYTES} bytes")
    if k == -3:
        raise TableError(f"table holds more than {nsym} frequencies")
    if k < 2:
        raise TableError("table stream is too short")
    lo, count = int(vals[0]), int(vals[1])
    if lo + count > nsym:
        raise TableError(f"symbols {lo}..{lo + count - 1} exceed the {nsym}-symbol alphabet")
    if k != 2 + count:
        raise TableError(f"table declares {count} frequencies but holds {k - 2}")
    freq = np.zeros(nsym, dtype=np.int64)
    freq[lo : lo + count] = vals[2:k]
    total = int(freq.sum())
    if total != 1 << precision:
        raise TableError(f"frequencies sum to {total}, not 2^{precision}")
    return freq


@njit(nogil=True, cache=True)
def _fill_slots(freq, W, R, rotate, tab, lut, index8, index16):
    """The slot table when `tab` is not empty, and lookup_from_stream()'s lookup when `lut` is not
    empty, with one-byte indices (index8) if at most 256 symbols are in use, else two-byte ones
    (index16). Returns whether they are two-byte."""
    wide = np.count_nonzero(freq) > 256
    q = k = 0
    for sym in range(len(freq)):
        f = freq[sym]
        if f == 0:
            continue
        top = sym << R
        if rotate:  # rotate right by one in W bits
            top = (top >> 1) | ((top & 1) << (W - 1))
        if len(tab):
            for i in range(f):
                tab[q + i] = np.uint64(f | (i << 16) | (top << 32))
        if len(lut):
            lut[k] = np.uint64(f | (q << 16) | (top << 32))
            if wide:
                index16[q : q + f] = k
            else:
                index8[q : q + f] = k
        q += f
        k += 1
    return wide


@lru_cache(maxsize=2)
def raw_pairs(rotate: bool) -> np.ndarray:
    """Output bits of every pair of 6-bit raw fields, as a uint32 of two little-endian elements."""
    r = np.arange(64, dtype=np.uint32)
    if rotate:
        r = (r >> 1) | ((r & 1) << 15)
    pairs = r[np.arange(4096) & 63] | (r[np.arange(4096) >> 6] << 16)
    pairs.flags.writeable = False
    return pairs


@njit(nogil=True, cache=True)
def _slots_from_stream(data, sym_bits, P, W, R, rotate, tab, lut, index8, index16):
    """parse() and the tables in one call: fills them and returns 0 (one-byte indices) or 1 (two)
    if the stream is a valid table, else -1 (parse() then says what is wrong)."""
    nsym = 1 << sym_bits
    vals = np.empty(nsym + 2, dtype=np.int64)
    k = _read_varints(data, vals)
    if k < 2 or vals[0] + vals[1] > nsym or k != 2 + vals[1]:
        return -1
    freq = np.zeros(nsym, dtype=np.int64)
    total = 0
    for i in range(vals[1]):
        freq[vals[0] + i] = vals[2 + i]
        total += vals[2 + i]
        if total > (1 << P):
            return -1
    if total != 1 << P:
        return -1
    return 1 if _fill_slots(freq, W, R, rotate, tab, lut, index8, index16) else 0


def _tables(blob, sym_bits, precision, word_bits, raw_bits, rotate, lookup: bool):
    """(slot table, lookup, wide): the slot table alone, or (lookup) the lookup alone."""
    tab = np.empty(0 if lookup else 1 << precision, dtype=np.uint64)
    # room for two-byte indices; _fill_slots writes one-byte ones into the same place when they fit
    lut = np.empty(LOOKUP_SYMBOLS + (1 << precision) // 4 if lookup else 0, dtype=np.uint64)
    index = lut[LOOKUP_SYMBOLS:]
    wide = _slots_from_stream(
        np.frombuffer(blob, dtype=np.uint8),
        sym_bits,
        precision,
        word_bits,
        raw_bits,
        rotate,
        tab,
        lut,
        index.view(np.uint8),
        index.view(np.uint16),
    )
    if wide < 0:
        parse(blob, sym_bits, precision)  # raises the precise error
        raise TableError("invalid table")  # pragma: no cover - parse() found nothing wrong
    return tab, lut, bool(wide)


def slots_from_stream(
    blob: np.ndarray, sym_bits: int, precision: int, word_bits: int, raw_bits: int, rotate: bool
) -> np.ndarray:
    """The portable decoder's slot table of a `table` stream; raises TableError as parse() does.

    For each slot q of symbol s: f(s) | (q - c(s)) << 16 | top << 32 (uint64), where top is the
    element's bits from its symbol alone, `s << R` rotated right by one if `rotate`. One 8-byte
    load a slot gives the decoder everything; the raw field, rotated the same way, is OR-ed in.
    (The vector decoder reads lookup_from_stream()'s smaller form instead, tails included.)"""
    return _tables(blob, sym_bits, precision, word_bits, raw_bits, rotate, False)[0]


LOOKUP_SYMBOLS = 1024  # entries of the lookup's symbol table: the 10-bit alphabet of 16-bit words


def lookup_from_stream(
    blob: np.ndarray, sym_bits: int, precision: int, word_bits: int, raw_bits: int, rotate: bool
) -> tuple[np.ndarray, bool]:
    """(lookup, wide): the AVX2 decoder's two-level form of slots_from_stream()'s table, one uint64
    array: for each symbol in use, in slot order, f | c << 16 | top << 32 (LOOKUP_SYMBOLS entries),
    then each slot's index into those entries, one byte each when at most 256 symbols are in use
    (16 KiB at P = 14, against the slot table's 128 KiB), else two (`wide`). Trained weights use
    100-160 symbols; the smaller table stays in L1 (docs/compression.md). slot_entry() gives any
    slot's slot-table entry from it. Raises TableError as parse() does."""
    if sym_bits > 10:
        raise ValueError(f"the lookup holds at most {LOOKUP_SYMBOLS} symbols, not 2^{sym_bits}")
    _, lut, wide = _tables(blob, sym_bits, precision, word_bits, raw_bits, rotate, True)
    return lut, wide


@njit(nogil=True, cache=True, inline="always")
def slot_entry(entries, index, q):
    """slots_from_stream()'s entry for slot q, from lookup_from_stream()'s symbol entries and
    slot indices (index: its uint8 or uint16 view from LOOKUP_SYMBOLS on)."""
    s = entries[index[q]]
    c = (s >> np.uint64(16)) & np.uint64(0xFFFF)
    return (s & np.uint64(0xFFFF)) | ((np.uint64(q) - c) << np.uint64(16)) | ((s >> np.uint64(32)) << np.uint64(32))
