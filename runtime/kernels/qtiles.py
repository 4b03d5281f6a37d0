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
| `base` | uint8, R | the row's window (below) |
| `esc_row` | int32, R+1 | escapes of rows < r (the escape list is in row-major order) |
| `esc_col` | uint16 (int32 if K > 65536) | column of each escape |
| `esc_exp` | uint8 | its exponent byte |
| `mode` | uint8, 1 | 0: eight-exponent windows; 1: seven and a zero code (below) |

Codes: element j = 32g + 4q + i of row r (quad q in 0..7, lane i in 0..3) has a 3-bit code c.
Byte i of the group's words holds the codes of lane i: A: c(q0) | c(q1) << 3 | (c(q6) & 3) << 6;
B: c(q2) | c(q3) << 3 | (c(q6) >> 2) << 6 | (c(q7) & 1) << 7; C: c(q4) | c(q5) << 3 | (c(q7) >> 1)
<< 6. So `(A >> 3k) & 0x07070707` is the four codes of a quad with one shift and one mask, byte
per lane, ready for SWAR.

What a code means depends on the matrix's mode, which the encoder picks as the one that lists
fewer escapes (an escape: an element whose exponent e its code does not give, listed with its
column and exponent; kernels add its exact contribution apart, or overwrite it when decoding to
BF16):
- mode 0, eight exponents: c = e - base for base <= e <= base + 7 (0 <= base <= 248: no byte lane
  carries); below the window c = 0, above it c = 7, both listed. Every code names an
  exponent, so the decode is one add per four weights. The usual choice: trained weights have
  few exact zeros, and the eighth exponent covers more (MiniLM: 1.39 % listed, against 2.6 %).
- mode 1, seven exponents and zero: c = e - base + 1 for base <= e <= base + 6 (1 <= base <=
  249), else 0; code 0 decodes with exponent 0, exactly right for zeros and subnormals, which are
  not listed; every other escape is. For pruned matrices, whose zeros mode 0 would all list.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from unweight.codec import tiles
from unweight.codec.parallel import map_chunk_ranges

GROUP = 32  # columns per code group
MAX_BASE = (248, 249)  # by mode: the window's top exponent (base + 7, base + 6) is at most 255
ROLES = ("sm", "codes", "base", "esc_row", "esc_col", "esc_exp")  # the streams a kernel reads; `mode` picks its variant
_ROW_CHUNK = 1 << 22  # elements binned at a time when choosing each row's window (the reference)
_SPAN = 1 << 18  # elements of rows one encoding task takes


def groups(cols: int) -> int:
    return -(-cols // GROUP)


def window(mode: int) -> tuple[int, int]:
    """(width, lowest base) of a mode's exponent window: (8, 0) or (7, 1)."""
    return (8, 0) if mode == 0 else (7, 1)


def _row_covers(values: np.ndarray, mode: int) -> tuple[np.ndarray, np.ndarray]:
    """(best base, elements not listed) of each row of the (R, K) uint16 matrix under `mode`."""
    rows, cols = values.shape
    width, lo = window(mode)
    base, kept = np.empty(rows, dtype=np.uint8), np.empty(rows, dtype=np.int64)
    step = max(1, _ROW_CHUNK // max(cols, 1))
    for r0 in range(0, rows, step):
        e = ((values[r0 : r0 + step] >> 7) & 0xFF).astype(np.int64)
        n = e.shape[0]
        hist = np.bincount((e + 256 * np.arange(n)[:, None]).ravel(), minlength=256 * n).reshape(n, 256)
        cs = np.concatenate([np.zeros((n, 1), np.int64), np.cumsum(hist, axis=1)], axis=1)
        top = MAX_BASE[mode]
        cover = cs[:, lo + width : top + width + 1] - cs[:, lo : top + 1]  # window starting at lo .. top
        best = np.argmax(cover, axis=1)  # the lowest of equals
        base[r0 : r0 + n] = lo + best
        kept[r0 : r0 + n] = cover[np.arange(n), best] + (hist[:, 0] if mode == 1 else 0)
    return base, kept


def choose_mode(values: np.ndarray) -> int:
    """The mode that lists fewer escapes (mode 0 on a tie)."""
    return int(_row_covers(values, 1)[1].sum() > _row_covers(values, 0)[1].sum())


def row_bases(values: np.ndarray, mode: int = 0) -> np.ndarray:
    """(R,) uint8: for each row of the (R, K) uint16 matrix, the base whose window covers the most
    elements under `mode`, the lowest of equals."""
    return _row_covers(values, mode)[0]


@njit(nogil=True, cache=True)
def _best_window(hist, mode):
    """(base, elements not listed) of one row's exponent histogram, as _row_covers gives them."""
    width, lo, top = (8, 0, 248) if mode == 0 else (7, 1, 249)
    best, cover = lo, -1
    run = hist[lo : lo + width].sum()
    for b in range(lo, top + 1):
        if b > lo:
            run += hist[b + width - 1] - hist[b - 1]
        if run > cover:
            best, cover = b, run
    return best, cover + (hist[0] if mode == 1 else 0)


@njit(nogil=True, cache=True)
def _windows(v, r0, r1, bases, kept):
    """Each row's best window in both modes (bases[r] = (mode 0, mode 1)), and the elements each
    would not list (kept[r], the same)."""
    hist = np.zeros(256, dtype=np.int64)
    for r in range(r0, r1):
        hist[:] = 0
        for j in range(v.shape[1]):
            hist[(v[r, j] >> 7) & 0xFF] += 1
        for mode in range(2):
            b, k = _best_window(hist, mode)
            bases[r, mode] = b
            kept[r, mode] = k


@njit(nogil=True, cache=True)
def _encode_rows(v, r0, r1, mode, row_base, sm, words, base, listed):
    """Rows r0..r1 of `encode`, loop by loop: each row's sign+mantissa bytes and codes in its
    window (row_base, from _windows), and the count of its listed escapes."""
    rows, cols = v.shape
    for r in range(r0, r1):
        best = np.int64(row_base[r])
        base[r] = best
        n = 0
        for j in range(cols):
            x = np.int64(v[r, j])
            e = (x >> 7) & 0xFF
            sm[r, j] = ((x >> 8) & 0x80) | (x & 0x7F)
            if mode == 0:
                c = e - best
                if c < 0:
                    c = 0
                    n += 1
                elif c > 7:
                    c = 7
                    n += 1
            else:
                c = e - best + 1
                if c < 1 or c > 7:
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
def _list_escapes(v, r0, r1, mode, base, esc_row, esc_col, esc_exp):
    """The listed escapes of rows r0..r1, at the offsets esc_row gives."""
    cols = v.shape[1]
    for r in range(r0, r1):
        k = esc_row[r]
        b = np.int64(base[r])
        for j in range(cols):
            e = (np.int64(v[r, j]) >> 7) & 0xFF
            if (e < b or e > b + 7) if mode == 0 else (e != 0 and (e < b or e > b + 6)):
                esc_col[k] = j
                esc_exp[k] = e
                k += 1


def encode(
    values: np.ndarray, rows: int, cols: int, threads: int | None = None, mode: int | None = None
) -> dict[str, np.ndarray]:
    """The qtiles streams of a rows x cols BF16 matrix given as uint16 (C order, any shape): numba
    kernels over row ranges on `threads` threads (default: all), in `mode` (default: the one that
    lists fewer escapes). `encode_reference` is the oracle."""
    v = np.ascontiguousarray(np.asarray(values, dtype=np.uint16).reshape(rows, cols))
    g = groups(cols)
    step = max(1, _SPAN // max(cols, 1))
    spans = [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]
    bases = np.empty((rows, 2), dtype=np.int64)
    kept = np.empty((rows, 2), dtype=np.int64)
    map_chunk_ranges(lambda a, b: [_windows(v, *spans[i], bases, kept) for i in range(a, b)], len(spans), threads)
    if mode is None:
        mode = int(kept[:, 1].sum() > kept[:, 0].sum())
    row_base = np.ascontiguousarray(bases[:, mode])
    sm = np.zeros((rows, g * GROUP), dtype=np.uint8)
    words = np.zeros((rows, g, 3, 4), dtype=np.uint8)
    base = np.empty(rows, dtype=np.uint8)
    listed = np.empty(rows, dtype=np.int64)
    map_chunk_ranges(
        lambda a, b: [_encode_rows(v, *spans[i], mode, row_base, sm, words, base, listed) for i in range(a, b)],
        len(spans),
        threads,
    )
    esc_row = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(listed, out=esc_row[1:])
    if esc_row[-1] >= 2**31:
        raise ValueError(f"{esc_row[-1]} escapes do not fit the int32 escape index")
    esc_col = np.empty(esc_row[-1], dtype=np.uint16 if cols <= 1 << 16 else np.int32)
    esc_exp = np.empty(esc_row[-1], dtype=np.uint8)
    map_chunk_ranges(
        lambda a, b: [_list_escapes(v, *spans[i], mode, base, esc_row, esc_col, esc_exp) for i in range(a, b)],
        len(spans),
        threads,
    )
    return {
        "sm": sm.ravel(),
        "codes": words.ravel(),
        "base": base,
        "esc_row": esc_row.astype(np.int32),
        "esc_col": esc_col,
        "esc_exp": esc_exp,
        "mode": np.array([mode], dtype=np.uint8),
    }


def encode_reference(values: np.ndarray, rows: int, cols: int, mode: int | None = None) -> dict[str, np.ndarray]:
    """The qtiles streams of a rows x cols BF16 matrix given as uint16, in plain numpy, written from
    the table above: the oracle for `encode`."""
    v = np.asarray(values, dtype=np.uint16).reshape(rows, cols)
    mode = choose_mode(v) if mode is None else mode
    g = groups(cols)
    width = g * GROUP
    e = ((v >> 7) & 0xFF).astype(np.int16)
    sm = np.zeros((rows, width), dtype=np.uint8)
    sm[:, :cols] = ((v >> 8) & 0x80) | (v & 0x7F)
    base = row_bases(v, mode)
    code = np.zeros((rows, width), dtype=np.uint8)
    if mode == 0:
        c = e - base[:, None].astype(np.int16)
        inside = (c >= 0) & (c <= 7)
        code[:, :cols] = np.clip(c, 0, 7)
        listed = ~inside
    else:
        c = e - base[:, None].astype(np.int16) + 1
        inside = (c >= 1) & (c <= 7)
        code[:, :cols] = np.where(inside, c, 0)
        listed = ~inside & (e != 0)
    q = code.reshape(rows, g, 8, 4)  # (row, group, quad, lane)
    words = np.empty((rows, g, 3, 4), dtype=np.uint8)  # (row, group, word A/B/C, byte = lane)
    words[:, :, 0] = q[:, :, 0] | q[:, :, 1] << 3 | (q[:, :, 6] & 3) << 6
    words[:, :, 1] = q[:, :, 2] | q[:, :, 3] << 3 | (q[:, :, 6] >> 2) << 6 | (q[:, :, 7] & 1) << 7
    words[:, :, 2] = q[:, :, 4] | q[:, :, 5] << 3 | (q[:, :, 7] >> 1) << 6
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
        "mode": np.array([mode], dtype=np.uint8),
    }


def from_tiles(
    streams: dict[str, np.ndarray], params: dict, rows: int, cols: int, threads: int | None = None
) -> dict[str, np.ndarray]:
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
    if int(np.asarray(q["mode"])[0]) == 0:
        e = (base + code).astype(np.uint16)
    else:
        e = np.where(code > 0, base - 1 + code, 0).astype(np.uint16)
    esc_row = np.asarray(q["esc_row"], dtype=np.int64)
    r_idx = np.repeat(np.arange(rows), np.diff(esc_row))
    e[r_idx, np.asarray(q["esc_col"], dtype=np.int64)] = q["esc_exp"]
    return ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)


def stand_ins_reference(q: dict[str, np.ndarray], rows: int, cols: int) -> np.ndarray:
    """The weights the fused kernels' main loops multiply, as uint16 (rows, cols): every element
    with the exponent its code gives, so the escapes' stand-ins (w0) in place of their weights (the
    kernels add x (w - w0) apart). Their fp32 error bound is stated in terms of these."""
    width = groups(cols) * GROUP
    sm = np.asarray(q["sm"], dtype=np.uint16).reshape(rows, width)[:, :cols]
    base, code = np.asarray(q["base"], dtype=np.uint16)[:, None], unpack_codes(q["codes"], rows, cols).astype(np.uint16)
    e = (base + code if int(np.asarray(q["mode"])[0]) == 0 else np.where(code > 0, base - 1 + code, 0)).astype(
        np.uint16
    )
    return ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)


def stored_bits(q: dict[str, np.ndarray]) -> int:
    """Bits the layout keeps resident."""
    return 8 * sum(np.asarray(a).nbytes for a in q.values())
