r"""The resident GPU layout of a serving-layout weight (`qtiles`): what the CUDA kernels read.

The stored `tiles` codec (formats/SPEC.md §3.4) is decoded by counting escapes element by
element, which no kernel can afford inside a matmul. When an `UnweightLinear` moves to a GPU it
transcodes it into this layout, which a kernel decodes four weights per 32-bit word with no per-element
branch, gather or prefix count. Same bits per weight for the codes and sign+mantissa; the
escape list grows (see docs/kernels.md for the sizes). For an R x K BF16 matrix, G = ceil(K/32)
groups of 32 columns per row, element (r, j) = s | e (8 bits) | m (7 bits):

| stream | dtype, length | content |
| --- | --- | --- |
| `sm` | uint8, R*32G | byte 32G*r + j is s << 7 \| m; 0 for the padding columns j >= K |
| `codes` | uint8, R*G*12 | three little-endian uint32 words A, B, C per (r, g) (below) |
| `base` | uint8, R | the row's window: exponents base .. base+6 get codes 1 .. 7 (1 <= base <= 249) |
| `esc_row` | int32, R+1 | escapes of rows < r (the escape list is in row-major order) |
| `esc_col` | uint16 (int32 if K > 65536) | column of each escape |
| `esc_exp` | uint8 | its exponent byte |

Codes: element j = 32g + 4q + i of row r (quad q in 0..7, lane i in 0..3) has code
c = e - base + 1 if base <= e <= base + 6, else 0. Byte i of the group's words holds the codes of
lane i: A: c(q0) | c(q1) << 3 | (c(q6) & 3) << 6; B: c(q2) | c(q3) << 3 | (c(q6) >> 2) << 6 |
(c(q7) & 1) << 7; C: c(q4) | c(q5) << 3 | (c(q7) >> 1) << 6. So `(A >> 3k) & 0x07070707` is the
four codes of a quad with one shift and one mask, byte per lane, ready for SWAR.

A code-0 element decodes with exponent 0: exactly right for zeros and subnormals (e = 0), which
are not in the escape list; every other escape (e != 0) is listed with its column and exponent,
and kernels add its exact contribution apart (or overwrite it, when decoding to BF16).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from unweight.codec import tiles
from unweight.codec.parallel import map_chunk_ranges

GROUP = 32  # columns per code group
WINDOW = 7  # exponents a code names; code 0 is the escape
ROLES = ("sm", "codes", "base", "esc_row", "esc_col", "esc_exp")
_ROW_CHUNK = 1 << 22  # elements binned at a time when choosing each row's window (the reference)
_SPAN = 1 << 18  # elements of rows one encoding task takes


def groups(cols: int) -> int:
    return -(-cols // GROUP)


def row_bases(values: np.ndarray) -> np.ndarray:
    """(R,) uint8: for each row of the (R, K) uint16 matrix, the base whose window of 7 exponents
    covers the most elements (at least 1, so that base - 1 is never negative)."""
    rows, cols = values.shape
    out = np.empty(rows, dtype=np.uint8)
    step = max(1, _ROW_CHUNK // max(cols, 1))
    for r0 in range(0, rows, step):
        e = ((values[r0 : r0 + step] >> 7) & 0xFF).astype(np.int64)
        n = e.shape[0]
        hist = np.bincount((e + 256 * np.arange(n)[:, None]).ravel(), minlength=256 * n).reshape(n, 256)
        cs = np.concatenate([np.zeros((n, 1), np.int64), np.cumsum(hist, axis=1)], axis=1)
        cover = cs[:, WINDOW + 1 : 257] - cs[:, 1 : 257 - WINDOW]  # window starting at 1 .. 249
        out[r0 : r0 + n] = 1 + np.argmax(cover, axis=1)
    return out


@njit(nogil=True, cache=True)
def _encode_rows(v, r0, r1, sm, words, base, listed):
    """Rows r0..r1 of `encode`, loop by loop: each row's window, its sign+mantissa bytes and codes,
    and the count of its listed escapes."""
    rows, cols = v.shape
    hist = np.zeros(256, dtype=np.int64)
    for r in range(r0, r1):
        hist[:] = 0
        for j in range(cols):
            hist[(v[r, j] >> 7) & 0xFF] += 1
        best, cover = 1, -1
        run = hist[1:1 + WINDOW].sum()
        for b in range(1, 257 - WINDOW):
            if b > 1:
                run += hist[b + WINDOW - 1] - hist[b - 1]
            if run > cover:
                best, cover = b, run
        base[r] = best
        n = 0
        for j in range(cols):
            x = np.int64(v[r, j])
            e = (x >> 7) & 0xFF
            sm[r, j] = ((x >> 8) & 0x80) | (x & 0x7F)
            c = e - best + 1
            if c < 1 or c > WINDOW:
                c = 0
                if e != 0:
                    n += 1
            g, q, i = j >> 5, (j >> 2) & 7, j & 3
            if q < 6:
                words[r, g, q >> 1, i] |= c << (3 * (q & 1))
            elif q == 6:
                words[r, g, 0, i] |= (c & 3) << 6
                words[r, g, 1, i] |= (c >> 2) << 6
            else:
                words[r, g, 1, i] |= (c & 1) << 7
                words[r, g, 2, i] |= (c >> 1) << 6
        listed[r] = n


@njit(nogil=True, cache=True)
def _list_escapes(v, r0, r1, base, esc_row, esc_col, esc_exp):
    """The listed escapes of rows r0..r1, at the offsets esc_row gives."""
    cols = v.shape[1]
    for r in range(r0, r1):
        k = esc_row[r]
        b = np.int64(base[r])
        for j in range(cols):
            e = (np.int64(v[r, j]) >> 7) & 0xFF
            if e != 0 and (e < b or e > b + WINDOW - 1):
                esc_col[k] = j
                esc_exp[k] = e
                k += 1


def encode(values: np.ndarray, rows: int, cols: int, threads: int | None = None) -> dict[str, np.ndarray]:
    """The qtiles streams of a rows x cols BF16 matrix given as uint16 (C order, any shape): numba
    kernels over row ranges on `threads` threads (default: all). `encode_reference` is the oracle."""
    v = np.ascontiguousarray(np.asarray(values, dtype=np.uint16).reshape(rows, cols))
    g = groups(cols)
    sm = np.zeros((rows, g * GROUP), dtype=np.uint8)
    words = np.zeros((rows, g, 3, 4), dtype=np.uint8)
    base = np.empty(rows, dtype=np.uint8)
    listed = np.empty(rows, dtype=np.int64)
    step = max(1, _SPAN // max(cols, 1))
    spans = [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]
    map_chunk_ranges(lambda a, b: [_encode_rows(v, *spans[i], sm, words, base, listed) for i in range(a, b)], len(spans), threads)
    esc_row = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(listed, out=esc_row[1:])
    if esc_row[-1] >= 2**31:
        raise ValueError(f"{esc_row[-1]} escapes do not fit the int32 escape index")
    esc_col = np.empty(esc_row[-1], dtype=np.uint16 if cols <= 1 << 16 else np.int32)
    esc_exp = np.empty(esc_row[-1], dtype=np.uint8)
    map_chunk_ranges(lambda a, b: [_list_escapes(v, *spans[i], base, esc_row, esc_col, esc_exp) for i in range(a, b)], len(spans), threads)
    return {"sm": sm.ravel(), "codes": words.ravel(), "base": base, "esc_row": esc_row.astype(np.int32), "esc_col": esc_col, "esc_exp": esc_exp}


def encode_reference(values: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """The qtiles streams of a rows x cols BF16 matrix given as uint16, in plain numpy, written from
    the table above: the oracle for `encode`."""
    v = np.asarray(values, dtype=np.uint16).reshape(rows, cols)
    g = groups(cols)
    width = g * GROUP
    e = ((v >> 7) & 0xFF).astype(np.int16)
    sm = np.zeros((rows, width), dtype=np.uint8)
    sm[:, :cols] = ((v >> 8) & 0x80) | (v & 0x7F)
    base = row_bases(v)
    c = e - base[:, None].astype(np.int16) + 1
    inside = (c >= 1) & (c <= WINDOW)
    code = np.zeros((rows, width), dtype=np.uint8)
    code[:, :cols] = np.where(inside, c, 0)
    q = code.reshape(rows, g, 8, 4)  # (row, group, quad, lane)
    words = np.empty((rows, g, 3, 4), dtype=np.uint8)  # (row, group, word A/B/C, byte = lane)
    words[:, :, 0] = q[:, :, 0] | q[:, :, 1] << 3 | (q[:, :, 6] & 3) << 6
    words[:, :, 1] = q[:, :, 2] | q[:, :, 3] << 3 | (q[:, :, 6] >> 2) << 6 | (q[:, :, 7] & 1) << 7
    words[:, :, 2] = q[:, :, 4] | q[:, :, 5] << 3 | (q[:, :, 7] >> 1) << 6
    listed = ~inside & (e != 0)
    r_idx, c_idx = np.nonzero(listed)  # row-major order
    esc_row = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(r_idx, minlength=rows), out=esc_row[1:])
    if esc_row[-1] >= 2**31:
        raise ValueError(f"{esc_row[-1]} escapes do not fit the int32 escape index")
    return {
        "sm": sm.ravel(),
        "codes": words.ravel(),
        "base": base,
        "esc_row": esc_row.astype(np.int32),
        "esc_col": c_idx.astype(np.uint16 if cols <= 1 << 16 else np.int32),
        "esc_exp": e[r_idx, c_idx].astype(np.uint8),
    }


def from_tiles(streams: dict[str, np.ndarray], params: dict, rows: int, cols: int, threads: int | None = None) -> dict[str, np.ndarray]:
    """Transcode stored `tiles` streams (already checked) into the resident layout."""
    return encode(tiles.decode(streams, tiles.TilesParams.from_json(params), rows, cols), rows, cols, threads)


def unpack_codes(codes: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """(rows, cols) uint8 codes from the `codes` stream."""
    g = groups(cols)
    w = np.asarray(codes, dtype=np.uint8).reshape(rows, g, 3, 4)
    a, b, c = w[:, :, 0], w[:, :, 1], w[:, :, 2]
    q = np.empty((rows, g, 8, 4), dtype=np.uint8)
    q[:, :, 0], q[:, :, 1] = a & 7, (a >> 3) & 7
    q[:, :, 2], q[:, :, 3] = b & 7, (b >> 3) & 7
    q[:, :, 4], q[:, :, 5] = c & 7, (c >> 3) & 7
    q[:, :, 6] = (a >> 6) | ((b >> 6) & 1) << 2
    q[:, :, 7] = (b >> 7) | (c >> 6) << 1
    return q.reshape(rows, g * GROUP)[:, :cols]


def decode_reference(q: dict[str, np.ndarray], rows: int, cols: int) -> np.ndarray:
    """Plain numpy decoder, written from the table above; the oracle for the kernels. Returns the
    matrix as uint16 (rows, cols)."""
    width = groups(cols) * GROUP
    sm = np.asarray(q["sm"], dtype=np.uint16).reshape(rows, width)[:, :cols]
    code = unpack_codes(q["codes"], rows, cols).astype(np.uint16)
    base = np.asarray(q["base"], dtype=np.uint16)[:, None]
    e = np.where(code > 0, base - 1 + code, 0).astype(np.uint16)
    esc_row = np.asarray(q["esc_row"], dtype=np.int64)
    r_idx = np.repeat(np.arange(rows), np.diff(esc_row))
    e[r_idx, np.asarray(q["esc_col"], dtype=np.int64)] = q["esc_exp"]
    return ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)


def stored_bits(q: dict[str, np.ndarray]) -> int:
    """Bits the layout keeps resident."""
    return 8 * sum(np.asarray(a).nbytes for a in q.values())
