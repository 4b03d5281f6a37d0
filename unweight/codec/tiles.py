"""The `tiles` codec (SPEC.md §3.4): the fixed-rate serving layout of 2-D BF16 weights.

Every element costs exactly 11 bits plus a sparse escape: its sign+mantissa byte (`sm`), and a
3-bit code that selects one of 7 consecutive exponents `base .. base+6` or, as 7, an escape whose
exponent byte lies in `esc`. A kernel finds any element's bytes by arithmetic alone; an escape's
position in `esc` is the block's entry in `esc_index` plus the escapes before it in its block.

Measured on all-MiniLM-L6-v2's 2-D weights in BF16: 3.0 % of elements escape with the best
per-tensor window; 11 + 0.24 + 0.03 bits per weight, a 29.26 % saving with 1024-column blocks
(docs/compression.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from unweight import memory

WINDOW = 7  # exponents a code can name; code 7 is the escape
ESCAPE = 7
BLOCK_RANGE = (8, 1 << 16)
DEFAULT_BLOCK = 1024


@dataclass(frozen=True, slots=True)
class TilesParams:
    """Validated on construction (the values may come from a hostile file)."""

    base: int  # exponent of code 0
    block: int  # columns per escape-index block (multiple of 8)

    def __post_init__(self) -> None:
        for key in ("base", "block"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{key} {v!r} is not an integer")
        if not 0 <= self.base <= 256 - WINDOW:
            raise ValueError(f"base {self.base} is outside 0..{256 - WINDOW}")
        lo, hi = BLOCK_RANGE
        if not (lo <= self.block <= hi and self.block % 8 == 0):
            raise ValueError(f"block {self.block} is not a multiple of 8 in {lo}..{hi}")

    @classmethod
    def from_json(cls, obj: dict) -> TilesParams:
        if set(obj) != {"base", "block"}:
            raise ValueError(f"tiles params must be exactly ['base', 'block'], got {sorted(obj)}")
        return cls(**obj)

    def to_json(self) -> dict:
        return {"base": self.base, "block": self.block}


def applies(dtype: str, shape: tuple[int, ...]) -> bool:
    """The serving layout is for the 2-D BF16 weights that matmuls read."""
    return dtype == "BF16" and len(shape) == 2 and shape[0] > 0 and shape[1] > 0


@njit(nogil=True, cache=True)
def exponent_histogram(values):
    """How many elements of a BF16 array (as uint16) have each exponent byte; no temporaries
    (np.bincount on the exponents would first make an int64 copy, 4 × the tensor)."""
    hist = np.zeros(256, dtype=np.int64)
    for w in values:
        hist[(w >> 7) & 0xFF] += 1
    return hist


def best_window(values: np.ndarray, hist: np.ndarray | None = None) -> tuple[int, int]:
    """(the base whose 7-exponent window covers the most elements, how many it leaves out);
    `hist`, the values' exponent_histogram, if the caller has it already."""
    hist = exponent_histogram(values) if hist is None else hist
    cover = np.convolve(hist, np.ones(WINDOW, dtype=np.int64), mode="valid")
    base = int(np.argmax(cover))
    return base, int(len(values) - cover[base])


def best_base(values: np.ndarray) -> int:
    """The base whose 7-exponent window covers the most elements."""
    return best_window(values)[0]


def _blocks_per_row(cols: int, block: int) -> int:
    return -(-cols // block)


def stream_lengths(rows: int, cols: int, p: TilesParams) -> dict[str, int]:
    """Byte lengths that §3.4 derives from the shape (esc is checked against esc_index instead)."""
    n = rows * cols
    return {"sm": n, "codes": -(-n // 8) * 3, "esc_index": 4 * (rows * _blocks_per_row(cols, p.block) + 1)}


def esc_index_entries(blob: np.ndarray) -> np.ndarray:
    """The esc_index stream's little-endian uint32 entries as int64 (any alignment)."""
    return np.frombuffer(np.asarray(blob, dtype=np.uint8).tobytes(), dtype="<u4").astype(np.int64)


def _check_lengths(streams: dict[str, np.ndarray], p: TilesParams, rows: int, cols: int) -> None:
    for role, want in stream_lengths(rows, cols, p).items():
        if len(streams[role]) != want:
            raise ValueError(f"{role} stream has {len(streams[role])} bytes, the shape needs {want}")


@njit(nogil=True, cache=True)
def _encode(values, r0, r1, cols, base, block, sm, codes, esc, esc_index, k, src0=0):
    """Fill the streams for rows [r0, r1), `k` escapes being written before them; returns the
    escape count after them (the caller writes the final esc_index entry). `values` holds the
    matrix from element `src0` on."""
    nb = -(-cols // block)
    for r in range(r0, r1):
        for j in range(cols):
            if j % block == 0:
                esc_index[r * nb + j // block] = k
            p = r * cols + j
            w = np.int64(values[p - src0])
            sm[p] = ((w >> 8) & 0x80) | (w & 0x7F)
            c = ((w >> 7) & 0xFF) - base
            if c < 0 or c >= ESCAPE:
                esc[k] = (w >> 7) & 0xFF
                k += 1
                c = ESCAPE
            g = p >> 3
            i = p & 7
            codes[3 * g] |= (c & 1) << i
            codes[3 * g + 1] |= ((c >> 1) & 1) << i
            codes[3 * g + 2] |= ((c >> 2) & 1) << i
    return k


ENCODE_SLAB_BYTES = 32 << 20  # source rows encoded between two release() calls


def encode(
    values: np.ndarray, rows: int, cols: int, block: int = DEFAULT_BLOCK
) -> tuple[TilesParams, dict[str, np.ndarray]]:
    """Encode a rows × cols BF16 matrix given as uint16 (C order)."""
    base, escapes = best_window(values)
    p = TilesParams(base, block)
    lengths = stream_lengths(rows, cols, p)
    sm = np.empty(lengths["sm"], dtype=np.uint8)
    codes = np.zeros(lengths["codes"], dtype=np.uint8)
    esc = np.empty(escapes, dtype=np.uint8)  # the histogram counted them: no tensor-sized guess
    esc_index = np.empty(lengths["esc_index"] // 4, dtype="<u4")
    # In row slabs, each slab's source pages given back after it (a no-op unless `values` is a
    # view of a file mapping): the source does not sit in memory whole beside the streams.
    per = max(1, ENCODE_SLAB_BYTES // (2 * cols))
    k = 0
    for r0 in range(0, rows, per):
        r1 = min(rows, r0 + per)
        k = _encode(values, r0, r1, cols, p.base, p.block, sm, codes, esc, esc_index, k)
        memory.release(values[r0 * cols : r1 * cols])
    esc_index[rows * _blocks_per_row(cols, p.block)] = k
    assert k == escapes
    return p, {"sm": sm, "codes": codes, "esc": esc, "esc_index": esc_index.view(np.uint8)}


class RowsEncoder:
    """A rows × cols tile set encoded a range of rows at a time, in any order (`put`), the window
    chosen from the first range: a layer's stacked experts encoded expert by expert as their
    tensors come in, so that no more than one expert is ever held decoded. `finish` gives what
    `encode` gives for the whole matrix with the same base."""

    def __init__(self, rows: int, cols: int, block: int = DEFAULT_BLOCK):
        self.rows, self.cols, self.block = rows, cols, block
        self.p: TilesParams | None = None
        lengths = stream_lengths(rows, cols, TilesParams(0, block))
        self.sm = np.empty(lengths["sm"], dtype=np.uint8)
        self.codes = np.zeros(lengths["codes"], dtype=np.uint8)
        self.esc_index = np.empty(lengths["esc_index"] // 4, dtype="<u4")
        self.escapes: dict[int, np.ndarray] = {}  # first row of a range -> its escapes
        self.sizes: dict[int, int] = {}  # first row of a range -> its rows

    def put(self, r0: int, values: np.ndarray) -> None:
        """Rows [r0, r0 + len(values) / cols) from their uint16 values (C order)."""
        n = len(values) // self.cols
        if n * self.cols != len(values) or not 0 <= r0 <= r0 + n <= self.rows:
            raise ValueError(
                f"{len(values)} values at row {r0} are not whole rows of a {self.rows} x {self.cols} matrix"
            )
        if any(r0 < a + m and a < r0 + n for a, m in self.sizes.items()):
            raise ValueError(f"rows [{r0}, {r0 + n}) were encoded already")
        hist = exponent_histogram(values)
        if self.p is None:
            self.p = TilesParams(best_window(values, hist)[0], self.block)
        esc = np.empty(int(len(values) - hist[self.p.base : self.p.base + WINDOW].sum()), dtype=np.uint8)
        k = _encode(
            values, r0, r0 + n, self.cols, self.p.base, self.block, self.sm, self.codes, esc, self.esc_index, 0,
            r0 * self.cols,
        )  # fmt: skip
        assert k == len(esc)
        self.escapes[r0], self.sizes[r0] = esc, n

    def finish(self) -> tuple[TilesParams, dict[str, np.ndarray]]:
        """The tile set, once every row is in: the ranges' escapes in row order, and each range's
        esc_index entries moved by the escapes of the ranges before it."""
        ranges = sorted(self.sizes.items())
        if sum(n for _, n in ranges) != self.rows:
            raise ValueError(f"{sum(n for _, n in ranges)} of {self.rows} rows were encoded")
        nb, k = _blocks_per_row(self.cols, self.block), 0
        for r0, n in ranges:
            self.esc_index[r0 * nb : (r0 + n) * nb] += k
            k += len(self.escapes[r0])
        self.esc_index[self.rows * nb] = k
        esc = np.concatenate([self.escapes.pop(r0) for r0, _ in ranges])
        return self.p, {"sm": self.sm, "codes": self.codes, "esc": esc, "esc_index": self.esc_index.view(np.uint8)}


@njit(nogil=True, cache=True)
def _decode(sm, codes, esc, esc_index, r0, r1, rows, cols, base, block, out):
    """Rebuild rows [r0, r1) into `out` ((r1 - r0) * cols elements); returns 0, or 1 if the
    escapes disagree with esc_index (corrupt). Ranges that tile [0, rows) check what one whole
    decode checks: every block's entry, and the escape count at the end."""
    nb = -(-cols // block)
    k = esc_index[r0 * nb]
    if k > len(esc) or (r0 == 0 and k != 0):
        return 1
    o = r0 * cols
    for r in range(r0, r1):
        for j in range(cols):
            if j % block == 0 and esc_index[r * nb + j // block] != k:
                return 1
            p = r * cols + j
            g = p >> 3
            i = p & 7
            c = ((codes[3 * g] >> i) & 1) | (((codes[3 * g + 1] >> i) & 1) << 1) | (((codes[3 * g + 2] >> i) & 1) << 2)
            if c == ESCAPE:
                if k >= len(esc):
                    return 1
                e = np.int64(esc[k])
                k += 1
            else:
                e = base + c
            s = np.int64(sm[p])
            out[p - o] = ((s & 0x80) << 8) | (e << 7) | (s & 0x7F)
    if esc_index[r1 * nb] != k or (r1 == rows and k != len(esc)):
        return 1
    return 0


class Decoder:
    """A tile set with its lengths and padding checked, decoded row range by row range (`run`),
    so that a caller can hold a piece of the matrix instead of all of it."""

    def __init__(self, streams: dict[str, np.ndarray], p: TilesParams, rows: int, cols: int):
        _check_lengths(streams, p, rows, cols)
        self.p, self.rows, self.cols = p, rows, cols
        self.esc_index = esc_index_entries(streams["esc_index"])
        self.codes = np.asarray(streams["codes"], dtype=np.uint8)
        n = rows * cols
        if n % 8 and np.unpackbits(self.codes[-3:], bitorder="little").reshape(3, 8)[:, n % 8 :].any():
            raise ValueError("padding bits of the codes stream are not zero")
        self.sm = np.asarray(streams["sm"], dtype=np.uint8)
        self.esc = np.asarray(streams["esc"], dtype=np.uint8)

    def run(self, r0: int, r1: int, out: np.ndarray) -> None:
        """Rows [r0, r1) into `out`, (r1 - r0) * cols uint16; ValueError if inconsistent."""
        if _decode(
            self.sm, self.codes, self.esc, self.esc_index, r0, r1, self.rows, self.cols, self.p.base, self.p.block, out
        ):
            raise ValueError("escapes disagree with esc_index")


def decode(streams: dict[str, np.ndarray], p: TilesParams, rows: int, cols: int) -> np.ndarray:
    """The matrix as uint16 (C order, flattened); raises ValueError on inconsistent streams."""
    d = Decoder(streams, p, rows, cols)
    out = np.empty(rows * cols, dtype=np.uint16)
    d.run(0, rows, out)
    return out


@njit(nogil=True, cache=True)
def _check_escapes(codes, esc_index, rows, cols, block):
    """Index of the first esc_index entry that disagrees with the codes, or -1."""
    nb = -(-cols // block)
    k = 0
    for r in range(rows):
        for j in range(cols):
            if j % block == 0 and esc_index[r * nb + j // block] != k:
                return r * nb + j // block
            p = r * cols + j
            g = p >> 3
            i = p & 7
            k += (codes[3 * g] >> i) & (codes[3 * g + 1] >> i) & (codes[3 * g + 2] >> i) & 1
    return -1 if esc_index[rows * nb] == k else rows * nb


def check(streams: dict[str, np.ndarray], p: TilesParams, rows: int, cols: int) -> None:
    """Validate a tile set without decoding it: lengths, and every esc_index entry against the
    codes (what a kernel trusts when it looks escapes up). Raises ValueError naming the entry."""
    _check_lengths(streams, p, rows, cols)
    esc_index = esc_index_entries(streams["esc_index"])
    bad = _check_escapes(np.asarray(streams["codes"], dtype=np.uint8), esc_index, rows, cols, p.block)
    if bad >= 0:
        raise ValueError(f"esc_index entry {bad} does not match the escape codes")
    if esc_index[-1] != len(streams["esc"]):
        raise ValueError(f"esc_index counts {esc_index[-1]} escapes, esc holds {len(streams['esc'])}")


def decode_reference(streams: dict[str, np.ndarray], p: TilesParams, rows: int, cols: int) -> np.ndarray:
    """Plain numpy decoder, written from SPEC.md §3.4; the oracle for the fast paths."""
    n = rows * cols
    sm = np.asarray(streams["sm"], dtype=np.uint16)
    planes = np.unpackbits(np.asarray(streams["codes"], dtype=np.uint8), bitorder="little").reshape(-1, 3, 8)
    code = (planes[:, 0] | (planes[:, 1] << 1) | (planes[:, 2] << 2)).reshape(-1)[:n].astype(np.uint16)
    exp = p.base + code
    escaped = code == ESCAPE
    exp[escaped] = np.asarray(streams["esc"], dtype=np.uint16)  # escapes in row-major order
    return ((sm & 0x80) << 8) | (exp << 7) | (sm & 0x7F)
