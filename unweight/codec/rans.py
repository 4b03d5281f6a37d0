"""The `rans` codec (SPEC.md §3.3): split each element into an entropy-coded symbol and raw bits.

For BF16 the symbol is the exponent plus the two high mantissa bits, whose joint entropy carries
nearly all the redundancy of trained weights (measured on all-MiniLM-L6-v2: 34.06 % saving at
precision 14 against an order-0 bound of 34.16 %; docs/compression.md); the sign and the five low
mantissa bits are stored as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import njit

from unweight import memory
from unweight.defaults import DEFAULT_CHUNK, DEFAULT_PRECISION, PRECISION_RANGE
from unweight.errors import CorruptDataError

from . import freq_table, rans_avx2
from .parallel import map_chunk_ranges
from .rans_kernels import LANES, OK, STATUS_TEXT, decode_chunks, encode_chunks, encoder_tables, histogram

SYM_BITS_MAX = 10
CHUNK_RANGE = (1024, 1 << 22)
ENCODE_SLAB_BYTES = 32 << 20  # encoder scratch per slab of chunks
UINT_OF_BITS = {8: np.uint8, 16: np.uint16, 32: np.uint32}


@dataclass(frozen=True, slots=True)
class RansParams:
    """Codec parameters, validated on construction (they may come from a hostile file)."""

    word_bits: int
    rotate: bool
    sym_bits: int
    precision: int = DEFAULT_PRECISION
    chunk: int = DEFAULT_CHUNK

    def __post_init__(self) -> None:
        for key in ("word_bits", "sym_bits", "precision", "chunk"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{key} {v!r} is not an integer")
        if self.word_bits not in UINT_OF_BITS:
            raise ValueError(f"word_bits {self.word_bits!r} is not 8, 16 or 32")
        if not isinstance(self.rotate, bool):
            raise ValueError(f"rotate {self.rotate!r} is not a boolean")
        if self.sym_bits != min(SYM_BITS_MAX, self.word_bits):
            raise ValueError(
                f"sym_bits {self.sym_bits!r} must be {min(SYM_BITS_MAX, self.word_bits)} for word_bits {self.word_bits}"
            )
        lo, hi = PRECISION_RANGE
        if not lo <= self.precision <= hi:
            raise ValueError(f"precision {self.precision!r} is outside {lo}..{hi}")
        lo, hi = CHUNK_RANGE
        if not (lo <= self.chunk <= hi and self.chunk % LANES == 0):
            raise ValueError(f"chunk {self.chunk!r} is not a multiple of {LANES} in {lo}..{hi}")

    @classmethod
    def for_word(
        cls, word_bits: int, rotate: bool, precision: int = DEFAULT_PRECISION, chunk: int = DEFAULT_CHUNK
    ) -> RansParams:
        return cls(word_bits, rotate, min(SYM_BITS_MAX, word_bits), precision, chunk)

    @classmethod
    def from_json(cls, obj: dict) -> RansParams:
        keys = {"word_bits", "rotate", "sym_bits", "precision", "chunk"}
        if set(obj) != keys:
            raise ValueError(f"rans params must be exactly {sorted(keys)}, got {sorted(obj)}")
        try:  # a checkpoint repeats a few parameter sets many times
            return _params_of(tuple((k, obj[k], type(obj[k])) for k in sorted(keys)))
        except TypeError:  # unhashable values: let the constructor say what is wrong
            return cls(**obj)

    def to_json(self) -> dict:
        return {
            "word_bits": self.word_bits,
            "rotate": self.rotate,
            "sym_bits": self.sym_bits,
            "precision": self.precision,
            "chunk": self.chunk,
        }

    @property
    def raw_bits(self) -> int:
        return self.word_bits - self.sym_bits

    def raw_len(self, n: int) -> int:
        return -(-n // 4) * self.raw_bits // 2  # 4R bits = R/2 bytes per group of four

    def nchunks(self, n: int) -> int:
        return -(-n // self.chunk)


MIN_SPLIT_CHUNK = 1 << 14  # a tensor is cut into more chunks only while each keeps this many elements


def chunk_for(n: int, limit: int = DEFAULT_CHUNK) -> int:
    """The chunk size for a tensor of n elements: at most `limit`, and a multiple of four chunks
    where each can keep MIN_SPLIT_CHUNK elements, so the vector decoder (which interleaves four
    chunks) never runs one alone. Each chunk costs 40 bytes of index: 0.1 % of a 16K chunk."""
    count = max(1, min(4 * -(-n // (4 * limit)), n // MIN_SPLIT_CHUNK))
    per_chunk = -(-n // count)  # ceil(n / count)
    chunk = -(-per_chunk // LANES) * LANES
    return max(CHUNK_RANGE[0], min(limit, chunk))


@lru_cache(maxsize=256)
def _params_of(items: tuple) -> RansParams:
    return RansParams(**{k: v for k, v, _ in items})


def symbol_counts(values: np.ndarray, p: RansParams, threads: int | None = None) -> np.ndarray:
    """How often each symbol occurs in `values` (1-D unsigned ints of p.word_bits bits)."""
    n = len(values)
    nchunks = p.nchunks(n)
    partial: list[np.ndarray] = []

    def work(c0: int, c1: int) -> None:
        counts = np.zeros(1 << p.sym_bits, dtype=np.int64)
        histogram(values, p.word_bits, p.raw_bits, p.rotate, c0 * p.chunk, min(c1 * p.chunk, n), counts)
        partial.append(counts)

    map_chunk_ranges(work, nchunks, threads)
    return np.sum(partial, axis=0) if partial else np.zeros(1 << p.sym_bits, dtype=np.int64)


def encode(
    values: np.ndarray, p: RansParams, threads: int | None = None, counts: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """Encode a non-empty 1-D array of unsigned ints; returns the streams by role."""
    n = len(values)
    if n == 0:
        raise ValueError("the rans codec needs at least one element")
    if counts is None:
        counts = symbol_counts(values, p, threads)
    f = freq_table.quantize(counts, p.precision)
    cum, magic, tab = encoder_tables(f, p.precision)
    nchunks = p.nchunks(n)
    nwords = np.zeros(nchunks, dtype=np.int64)
    states = np.zeros(nchunks * LANES, dtype=np.int64)
    raw = np.zeros(p.raw_len(n), dtype=np.uint8)
    simd = rans_avx2.AVAILABLE and p.word_bits == 16 and p.raw_bits == 6 and p.rotate and values.dtype == np.uint16
    # The chunks go in slabs of about ENCODE_SLAB_BYTES of scratch (one word per element at most),
    # each slab's words gathered before the next reuses it: the scratch does not grow with the
    # tensor. A slab is an independent sub-problem (chunks share nothing), cut at whole groups.
    per_slab = max(rans_avx2.MAX_GROUP, ENCODE_SLAB_BYTES // (2 * p.chunk) // rans_avx2.MAX_GROUP * rans_avx2.MAX_GROUP)
    scratch = np.empty(min(nchunks, per_slab) * p.chunk, dtype=np.uint16)
    pieces = []
    for s0 in range(0, nchunks, per_slab):
        s1 = min(nchunks, s0 + per_slab)
        e0, e1 = s0 * p.chunk, min(s1 * p.chunk, n)
        sub_values, sub_n = values[e0:e1], e1 - e0
        sub_raw = raw[p.raw_len(e0) : p.raw_len(e0) + p.raw_len(sub_n)]
        sub_nwords, sub_states = nwords[s0:s1], states[s0 * LANES : s1 * LANES]

        def work(c0: int, c1: int) -> None:
            if simd:
                rans_avx2.encode_chunks16(
                    sub_values,
                    sub_n,
                    p.chunk,
                    c0,
                    c1,
                    f,
                    cum,
                    magic,
                    tab,
                    p.precision,
                    scratch,
                    sub_nwords,
                    sub_states,
                    sub_raw,
                )
                return
            encode_chunks(
                sub_values,
                p.word_bits,
                p.raw_bits,
                p.rotate,
                sub_n,
                p.chunk,
                c0,
                c1,
                f,
                cum,
                magic,
                p.precision,
                scratch,
                sub_nwords,
                sub_states,
                sub_raw,
            )

        map_chunk_ranges(work, s1 - s0, threads, align=rans_avx2.MAX_GROUP)
        memory.release(sub_values)  # its pages, if a file mapping's: the source is not kept whole
        offsets = np.zeros(s1 - s0 + 1, dtype=np.int64)
        np.cumsum(sub_nwords, out=offsets[1:])
        words = np.empty(int(offsets[-1]), dtype="<u2")
        _gather_words(scratch, sub_nwords, p.chunk, offsets, words)
        pieces.append(words)
    scratch = None  # its memory goes before the index and the words are joined
    index = np.empty(8 * (nchunks + 1) + 4 * LANES * nchunks, dtype=np.uint8)
    offsets = index[: 8 * (nchunks + 1)].view("<u8")
    offsets[0] = 0
    np.cumsum(nwords, out=offsets[1:])
    index[8 * (nchunks + 1) :].view("<u4")[:] = states
    words = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
    del pieces
    table = np.frombuffer(freq_table.serialize(f), dtype=np.uint8)
    return {"table": table, "raw": raw, "words": words.view(np.uint8), "index": index}


@njit(nogil=True, cache=True)
def _gather_words(scratch, nwords, chunk, offsets, words):
    """Each chunk's words (at the end of its scratch slice) into the words stream, in order."""
    for c in range(len(nwords)):
        end = (c + 1) * chunk
        words[offsets[c] : offsets[c + 1]] = scratch[end - nwords[c] : end]


def _aligned_view(blob: np.ndarray, dtype: str) -> np.ndarray:
    """A little-endian view of a byte stream as `dtype`, copied only when it is misaligned."""
    view = np.asarray(blob, dtype=np.uint8).view(dtype)
    return view if view.flags.aligned else view.copy()


@njit(nogil=True, cache=True)
def _offsets_ok(offsets, nwords):
    """The chunk word offsets start at 0, never decrease and end at the word count."""
    if offsets[0] != 0 or offsets[len(offsets) - 1] != nwords:
        return False
    for c in range(len(offsets) - 1):
        if offsets[c + 1] < offsets[c]:
            return False
    return True


def decode(
    streams: dict[str, np.ndarray],
    p: RansParams,
    n: int,
    threads: int | None = None,
    out: np.ndarray | None = None,
    chunks: np.ndarray | None = None,
) -> np.ndarray:
    """Decode n elements (1-D unsigned ints of p.word_bits bits) into `out` (a new array if None,
    else n aligned, writable elements of that type, which it returns); raises ValueError if corrupt.

    With `chunks` (sorted, distinct chunk indices), only those chunks are decoded: elements
    [c * p.chunk, (c + 1) * p.chunk) of each; the rest of `out` is left as it was. Each chunk is
    checked as in a whole decode (its words all used, its lanes back at the initial state)."""
    d = Decoder(streams, p, n)
    if out is None:
        out = np.empty(n, dtype=UINT_OF_BITS[p.word_bits])
    elif (
        out.dtype != UINT_OF_BITS[p.word_bits]
        or out.shape != (n,)
        or not (out.flags.writeable and out.flags.aligned and out.flags.c_contiguous)
    ):
        raise TypeError(
            f"out must be {n} aligned, writable, contiguous {np.dtype(UINT_OF_BITS[p.word_bits]).name} elements"
        )
    if chunks is None:
        d.run(0, d.nchunks, out, threads)
        return out
    chunks = np.asarray(chunks, dtype=np.int64)
    if len(chunks) and (chunks[0] < 0 or chunks[-1] >= d.nchunks or np.any(np.diff(chunks) <= 0)):
        raise ValueError(f"chunks must be sorted, distinct and in [0, {d.nchunks})")
    breaks = np.flatnonzero(np.diff(chunks) != 1) + 1  # runs of consecutive chunks
    for run in np.split(chunks, breaks) if len(chunks) else ():
        c0, c1 = int(run[0]), int(run[-1]) + 1
        d.run(c0, c1, out[c0 * p.chunk : min(c1 * p.chunk, n)], threads)
    return out


class Decoder:
    """One tensor's streams, validated once (table, index, offsets, raw padding), then decoded
    chunk range by chunk range (`run`) into memory the caller holds: decode() runs it over the
    chunks asked for; checkpoint commands run it piece by piece, so that their memory does not
    follow the size a file declares. Raises ValueError (or CorruptDataError) if corrupt."""

    def __init__(self, streams: dict[str, np.ndarray], p: RansParams, n: int):
        if n == 0:
            raise ValueError("the rans codec needs at least one element")
        self.p, self.n = p, n
        self.vector = vector = rans_avx2.AVAILABLE and p.word_bits == 16 and p.raw_bits == 6 and p.rotate
        try:
            build = freq_table.lookup_from_stream if vector else freq_table.slots_from_stream
            self.tables = build(streams["table"], p.sym_bits, p.precision, p.word_bits, p.raw_bits, p.rotate)
        except freq_table.TableError as e:
            raise ValueError(f"table: {e}") from None
        self.nchunks = nchunks = p.nchunks(n)
        index, words, raw = streams["index"], streams["words"], streams["raw"]
        want = 8 * (nchunks + 1) + 4 * LANES * nchunks
        if len(index) != want:
            raise ValueError(f"index stream has {len(index)} bytes, {nchunks} chunks need {want}")
        if len(words) % 2:
            raise ValueError(f"words stream has an odd length ({len(words)} bytes)")
        if len(raw) != p.raw_len(n):
            raise ValueError(f"raw stream has {len(raw)} bytes, {n} elements need {p.raw_len(n)}")
        index = _aligned_view(index, "<u8")  # offsets, then states (uint32) from byte 8 (k + 1)
        self.offsets = offsets = index[: nchunks + 1]
        if not _offsets_ok(offsets, len(words) // 2):
            raise ValueError("chunk offsets do not rise from 0 to the word count")
        self.states = index[nchunks + 1 :].view("<u4")
        R = p.raw_bits
        if R and n % 4:  # the padding bits of the last raw group must be zero
            if np.unpackbits(raw[-(R // 2) :], bitorder="little")[(n % 4) * R :].any():
                raise ValueError("padding bits of the raw stream are not zero")
        self.words = _aligned_view(words, "<u2")
        self.raw = np.asarray(raw, dtype=np.uint8)
        self.raw_pairs = None if vector else freq_table.raw_pairs(p.rotate)

    def run(self, c0: int, c1: int, out: np.ndarray, threads: int | None = None) -> None:
        """Decode chunks [c0, c1) into `out`: their elements [c0 * chunk, min(c1 * chunk, n)), as
        aligned, writable, contiguous unsigned ints of word_bits. The range is decoded as a tensor
        of its own (chunks share nothing): the words, states and raw bits of those chunks."""
        p, chunk = self.p, self.p.chunk
        e0 = c0 * chunk
        n = min(c1 * chunk, self.n) - e0
        if (
            out.dtype != UINT_OF_BITS[p.word_bits]
            or out.shape != (n,)
            or not (out.flags.writeable and out.flags.aligned and out.flags.c_contiguous)
        ):
            raise TypeError(
                f"out must be {n} aligned, writable, contiguous {np.dtype(UINT_OF_BITS[p.word_bits]).name} elements"
            )
        offsets = self.offsets[c0 : c1 + 1]
        w0 = int(offsets[0])
        if w0:
            offsets = offsets - offsets[0]
        words = self.words[w0 : w0 + int(offsets[-1])]
        states = self.states[c0 * LANES : c1 * LANES]
        raw = self.raw[p.raw_len(e0) : p.raw_len(e0) + p.raw_len(n)]
        status = np.zeros(c1 - c0, dtype=np.int8)
        if self.vector:
            lut, wide = self.tables

            def work(a: int, b: int) -> None:
                rans_avx2.decode_chunks16(
                    words, offsets, states, lut, wide, p.precision, raw, n, chunk, a, b, out, status
                )
        else:
            tab, raw_pairs = self.tables, self.raw_pairs
            # the 16-bit fast path ORs raw bits into element pairs
            out32 = out[: n // 2 * 2].view(np.uint32) if p.word_bits == 16 else np.empty(0, dtype=np.uint32)

            def work(a: int, b: int) -> None:
                decode_chunks(
                    words,
                    offsets,
                    states,
                    tab,
                    raw_pairs,
                    p.precision,
                    raw,
                    p.word_bits,
                    p.raw_bits,
                    p.rotate,
                    n,
                    chunk,
                    a,
                    b,
                    out,
                    out32,
                    status,
                )

        map_chunk_ranges(work, c1 - c0, threads, align=rans_avx2.MAX_GROUP)
        if not np.count_nonzero(status):  # (a few microseconds less than status.any() on tiny tensors)
            return
        bad = np.flatnonzero(status != OK)
        if len(bad):
            c = int(bad[0])
            raise CorruptDataError(None, STATUS_TEXT[int(status[c])].format(c=c0 + c))
