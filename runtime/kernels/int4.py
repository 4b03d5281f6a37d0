r"""The resident layout of an INT4 weight (`int4`): compressed-tensors `pack-quantized` codes and
their BF16 group scales, coded so that a kernel decodes them row by row inside a GEMV or an
expert GEMM.

The source W (R, K) is R*K 4-bit codes ("nibbles", eight to a little-endian INT32 word, code j of
a word in bits 4j..4j+3) and R*G BF16 scales, G = K / group. Its nibbles are far from uniform
(absmax-scaled groups put most codes near the middle: 3.63 bits of entropy a code for Gaussian
weights, 3.39 for Student-t(5)), and its scales are positive numbers whose exponents a row keeps
within a few values. The layout keeps every address computable without parsing a bit stream:

Codes. The 7 nibbles the matrix uses most are "short": symbol s in 0..6 stands for `lut` nibble s.
Every other nibble is an escape: symbol 7, and an index into the `long` nibbles (`lut` nibbles
8.., in order) of `payload_bits` = ceil(log2(how many long nibbles the matrix uses)) bits, 0 when
it uses one; a matrix that uses more than 8 long nibbles (all 16) lists the nibble itself, in 4
bits. The symbols lie in blocks of 64 columns as three bit planes (64-bit word k of block b has
bit j = bit k of column 64b + j's symbol), so `p0 & p1 & p2` is a block's escape mask, and a
block's escape count is its popcount. The escapes' indices lie apart, `payload_bits` bits each,
packed LSB first in row-major order; a row's first escape is `esc_row[r]`, so a kernel walking a
row keeps one running count and finds a block's indices at a known bit. Symmetric codes
(absmax / 7) use 15 nibbles: 7 short, 8 long, 3-bit indices.

Scales. Each row keeps a base exponent; a scale whose sign is 0 and whose exponent lies in
base .. base + 2 is stored as its 7 mantissa bits and a 2-bit exponent code (e - base), anything
else (negative, zero or another exponent) as code 3, its 16 bits listed apart (`sesc`, row-major,
the row's first at `sesc_row[r]`). Code bit 0 is the top bit of the mantissa byte; bit 1 lies in
a plane of 32 groups a word.

| stream | dtype, length | content |
| --- | --- | --- |
| `sym` | int64, R*B*3 (B = ceil(K/64)) | three plane words per (row, block); padding columns are symbol 0 |
| `esc` | int32, ceil(E*payload_bits/32) + 16 | E escapes' indices: bit payload_bits*i + k is bit k of the i-th |
| `esc_row` | int32, R+1 | escapes of rows < r |
| `smant` | uint8, R*G | (exponent code & 1) << 7 \| mantissa |
| `sexp` | int32, R*ceil(G/32) | exponent code >> 1, bit g % 32 of word g // 32 of the row |
| `sbase` | uint8, R | the row's base exponent |
| `sesc` | int16, max(S, 1) | listed scales' bits (S listed) |
| `sesc_row` | int32, R+1 | listed scales of rows < r |
| `zero` | uint8, R*H or 0 (H = ceil(G/2)) | zero points: byte r*H + j holds group j (low nibble) and H + j (high) |

Zero points. Symmetric codes have none (`zero` empty): w = (nibble - 8) * scale. Asymmetric ones
(compressed-tensors' `weight_zero_point`, 4-bit and packed eight rows to an INT32 word along the
output dimension) keep theirs as plain nibbles, two a byte, as many bytes as the source's words
hold: w = (nibble - zero) * scale. Kernels take the symmetric product and subtract each group's
(zero - 8) * scale times the sum of x over the group.

`lut` (16 nibbles in a 64-bit integer, nibble i at bits 4i: short ones at 0..6, long ones from 8)
and `payload_bits` are the weight's parameters (weight.Int4Weight). Decoding is bit-exact: back to
the source's INT32 words, BF16 scale bits (`decode_reference`) and zero-point words (`zero_words`).
"""

from __future__ import annotations

import numpy as np

BLOCK = 64  # columns a block of symbol planes covers
SHORT = 7  # short symbols; symbol SHORT is the escape
ESCAPE = SHORT
WINDOW = 3  # exponents a row's scales code without listing (code 3 lists)
PAD_WORDS = 16  # words after the escape indices: a kernel reads 64 bytes from the byte of a block's first index
ROLES = ("sym", "esc", "esc_row", "smant", "sexp", "sbase", "sesc", "sesc_row", "zero")


def blocks(cols: int) -> int:
    return -(-cols // BLOCK)


def unpack_nibbles(packed: np.ndarray, cols: int) -> np.ndarray:
    """(R, cols) uint8 nibbles of compressed-tensors' packed INT32 words (R, ceil(cols / 8))."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    rows = words.shape[0]
    nib = np.empty((rows, words.shape[1], 8), dtype=np.uint8)
    for j in range(8):
        nib[:, :, j] = (words >> np.uint32(4 * j)) & np.uint32(15)
    return nib.reshape(rows, -1)[:, :cols]


def pack_nibbles(nib: np.ndarray) -> np.ndarray:
    """The inverse of unpack_nibbles: (R, ceil(cols / 8)) int32 words, padding nibbles 0."""
    rows, cols = nib.shape
    padded = np.zeros((rows, -(-cols // 8) * 8), dtype=np.uint32)
    padded[:, :cols] = nib
    padded = padded.reshape(rows, -1, 8)
    words = np.zeros(padded.shape[:2], dtype=np.uint32)
    for j in range(8):
        words |= padded[:, :, j] << np.uint32(4 * j)
    return words.view(np.int32)


def unpack_zero_points(packed: np.ndarray, rows: int) -> np.ndarray:
    """(rows, G) uint8 zero-point nibbles of compressed-tensors' `weight_zero_point`, (ceil(rows / 8),
    G) int32 words packed along the rows (row 8i + j of column g in bits 4j.. of word (i, g))."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    nib = np.empty((words.shape[0], 8, words.shape[1]), dtype=np.uint8)
    for j in range(8):
        nib[:, j] = (words >> np.uint32(4 * j)) & np.uint32(15)
    return nib.reshape(-1, words.shape[1])[:rows]


def pack_zero_points(nib: np.ndarray) -> np.ndarray:
    """The inverse of unpack_zero_points: (ceil(rows / 8), G) int32 words, padding nibbles 0."""
    return pack_nibbles(np.ascontiguousarray(nib.T)).T.copy()


def zero_stream(nib: np.ndarray) -> np.ndarray:
    """The `zero` stream of (rows, G) zero-point nibbles: byte j of a row holds group j (low nibble)
    and group ceil(G / 2) + j (high), so a kernel unpacks each half with contiguous loads."""
    rows, g = nib.shape
    half = -(-g // 2)
    padded = np.zeros((rows, 2 * half), dtype=np.uint8)
    padded[:, :g] = nib
    return (padded[:, :half] | (padded[:, half:] << 4)).reshape(-1)


def zero_nibbles(stream: np.ndarray, rows: int, groups: int) -> np.ndarray:
    """(rows, G) zero-point nibbles of a `zero` stream."""
    b = np.asarray(stream).view(np.uint8).reshape(rows, -1)
    return np.concatenate([b & 15, b >> 4], axis=1)[:, :groups]


def zero_source(zero, rows: int, groups: int) -> np.ndarray:
    """compressed-tensors' zero-point words as (rows, G) nibbles; ValueError naming what does not fit."""
    zero = np.asarray(zero)
    want = (-(-rows // 8), groups)
    if zero.ndim != 2 or zero.dtype not in (np.int32, np.uint32) or zero.shape != want:
        raise ValueError(f"int4 zero points must be {list(want)} int32 words, not {zero.dtype}{list(zero.shape)}")
    nib = unpack_zero_points(zero, -(-rows // 8) * 8)
    if nib[rows:].any():
        raise ValueError(f"int4 zero points: the words' padding past row {rows} is not zero")
    return nib[:rows]


def choose_lut(nib: np.ndarray) -> tuple[int, int]:
    """(lut, payload_bits) for a matrix's nibbles (lut_of_counts of their histogram)."""
    return lut_of_counts(np.bincount(nib.reshape(-1), minlength=16))


def lut_of_counts(counts: np.ndarray) -> tuple[int, int]:
    """(lut, payload_bits) for nibbles of these counts (16): the SHORT most used (ties to the lower
    nibble) short, the other used ones long, in nibble order."""
    order = sorted(range(16), key=lambda v: (-counts[v], v))
    short = order[:SHORT]
    long = sorted(v for v in order[SHORT:] if counts[v])
    lut = 0
    for i, v in enumerate(short):
        lut |= v << (4 * i)
    if len(long) > 8:
        return lut, 4  # the nibbles themselves, in 4 bits
    for i, v in enumerate(long):
        lut |= v << (4 * (8 + i))
    return lut, payload_bits(len(long)) if long else 0


def symbol_tables(lut: int, payload_bits: int, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(nibble -> symbol, nibble -> escape index) (16 each, uint8) of a lut chosen for `counts`."""
    short, _ = lut_tables(lut, payload_bits)
    to_sym = np.full(16, ESCAPE, dtype=np.uint8)
    to_sym[short[:SHORT]] = np.arange(SHORT, dtype=np.uint8)
    to_index = np.arange(16, dtype=np.uint8)  # (at 4 payload bits, the nibble itself)
    if payload_bits < 4:
        longs = np.setdiff1d(np.flatnonzero(counts), short[:SHORT])  # in nibble order, as lut_of_counts lists them
        to_index[longs] = np.arange(longs.size, dtype=np.uint8)
    return to_sym, to_index


def payload_bits(longs: int) -> int:
    """Bits of an escape's index among `longs` long nibbles (1 to 8)."""
    return (longs - 1).bit_length()


def lut_tables(lut: int, payload_bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(short nibbles (8,), long nibbles (16,)) of a lut: an escape of index i is long[i] (i itself
    at 4 payload bits); short[7] is unused (0)."""
    nibbles = np.array([(lut >> (4 * i)) & 15 for i in range(16)], dtype=np.uint8)
    short = nibbles[:8].copy()
    short[ESCAPE] = 0
    long = np.arange(16, dtype=np.uint8) if payload_bits == 4 else np.concatenate([nibbles[8:], np.zeros(8, np.uint8)])
    return short, long


def _planes(bits: np.ndarray) -> np.ndarray:
    """(..., n) 0/1 values as little-endian uint32 words (..., ceil(n / 32)), zero padded."""
    n = bits.shape[-1]
    padded = np.zeros(bits.shape[:-1] + (-(-n // 32) * 32,), dtype=np.uint8)
    padded[..., :n] = bits
    return np.packbits(padded, axis=-1, bitorder="little").view(np.uint32)


def _unplanes(words: np.ndarray, n: int) -> np.ndarray:
    """The first n bits along the last axis of uint32 words, as 0/1 uint8."""
    return np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=-1, bitorder="little")[..., :n]


def _row_bases(exps: np.ndarray, plain: np.ndarray) -> np.ndarray:
    """Each row's base exponent: the lowest of the WINDOW-wide windows that holds most of its plain
    scales (0 for a row with none)."""
    rows = exps.shape[0]
    hist = np.zeros((rows, 256 + WINDOW), dtype=np.int64)
    r, e = np.nonzero(plain)
    np.add.at(hist, (r, exps[r, e]), 1)
    csum = np.concatenate([np.zeros((rows, 1), np.int64), np.cumsum(hist, axis=1)], axis=1)
    held = csum[:, WINDOW : WINDOW + 256] - csum[:, :256]  # held[r, b]: plain scales in b .. b + WINDOW - 1
    return held.argmax(axis=1).astype(np.uint8)


def check_source(packed: np.ndarray, scales: np.ndarray, cols: int, group: int) -> None:
    """ValueError naming what of compressed-tensors' packed words and BF16 scale bits does not fit."""
    if packed.ndim != 2 or packed.dtype not in (np.int32, np.uint32):
        raise ValueError(f"int4 codes must be a 2-D int32 array, not {packed.dtype}{list(packed.shape)}")
    rows = packed.shape[0]
    if packed.shape[1] != -(-cols // 8):
        raise ValueError(f"int4 codes of {packed.shape[1]} words a row do not hold {cols} columns")
    if not isinstance(group, int) or group < 1 or cols % group:
        raise ValueError(f"int4 group size {group!r} does not divide {cols} columns")
    g = cols // group
    if scales.dtype not in (np.uint16, np.int16) or scales.shape != (rows, g):
        raise ValueError(f"int4 scales must be ({rows}, {g}) BF16 bits, not {scales.dtype}{list(scales.shape)}")


def encode_reference(packed: np.ndarray, scales: np.ndarray, cols: int, group: int, zero=None) -> dict:
    """The streams of W from compressed-tensors' `weight_packed` (R, ceil(cols / 8)) int32,
    `weight_scale` (R, cols / group) BF16 bits (uint16 or int16) and, for asymmetric codes,
    `weight_zero_point` (ceil(R / 8), cols / group) int32; and its parameters `lut` and
    `payload_bits`, the plain way (numpy, whole arrays): the oracle of int4_encode.encode, which
    codes on threads. ValueError names what does not fit."""
    packed, scales = np.asarray(packed), np.asarray(scales)
    check_source(packed, scales, cols, group)
    zeros = np.zeros(0, np.uint8) if zero is None else zero_stream(zero_source(zero, packed.shape[0], cols // group))
    rows = packed.shape[0]
    nib = unpack_nibbles(packed, cols)
    counts = np.bincount(nib.reshape(-1), minlength=16)
    lut, payload_bits = lut_of_counts(counts)
    to_sym, to_index = symbol_tables(lut, payload_bits, counts)
    sym = np.zeros((rows, blocks(cols) * BLOCK), dtype=np.uint8)
    sym[:, :cols] = to_sym[nib]
    planes = np.stack([_planes((sym.reshape(rows, -1, BLOCK) >> k) & 1).view(np.uint64) for k in range(3)], axis=-1)
    escaped = sym[:, :cols] == ESCAPE
    esc_row = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(escaped.sum(axis=1), out=esc_row[1:])
    index = to_index[nib[escaped]]  # row-major
    fields = ((index[:, None] >> np.arange(payload_bits, dtype=np.uint8)) & 1).reshape(-1)
    esc = np.zeros(-(-fields.size // 32) + PAD_WORDS, dtype=np.uint32)
    esc[: -(-fields.size // 32)] = _planes(fields)
    scale_streams = encode_scales_reference(scales)
    check_count("escapes", esc_row[-1])
    streams = {
        "sym": planes.reshape(-1).view(np.int64),
        "esc": esc.view(np.int32),
        "esc_row": esc_row.astype(np.int32),
        **scale_streams,
        "zero": zeros,
    }
    return {"streams": streams, "lut": lut, "payload_bits": payload_bits}


SCALE_ROLES = ("smant", "sexp", "sbase", "sesc", "sesc_row")


def encode_scales_reference(scales: np.ndarray) -> dict:
    """The scale streams (SCALE_ROLES) of (R, G) BF16 scale bits, the plain way."""
    bits = np.asarray(scales).view(np.uint16)
    rows = bits.shape[0]
    exps = ((bits >> 7) & 0xFF).astype(np.int64)
    positive = (bits >> 15) == 0
    sbase = _row_bases(exps, positive & (exps > 0))
    code = exps - sbase[:, None].astype(np.int64)
    plain = positive & (code >= 0) & (code < WINDOW)
    code = np.where(plain, code, WINDOW).astype(np.uint8)
    smant = ((code & 1) << 7) | np.where(plain, bits & 0x7F, 0).astype(np.uint8)
    sexp = _planes(code >> 1)
    listed = ~plain
    sesc_row = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(listed.sum(axis=1), out=sesc_row[1:])
    sesc = bits[listed]
    check_count("listed scales", sesc_row[-1])
    return {
        "smant": smant.reshape(-1),
        "sexp": sexp.reshape(-1).view(np.int32),
        "sbase": sbase,
        "sesc": (sesc if sesc.size else np.zeros(1, np.uint16)).view(np.int16),
        "sesc_row": sesc_row.astype(np.int32),
    }


def _scale_codes(streams: dict, rows: int, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """((R, G) mantissa bytes, (R, G) 2-bit exponent codes) of the scale streams."""
    smant = np.asarray(streams["smant"]).reshape(rows, groups)
    return smant, (smant >> 7) | (_unplanes(np.asarray(streams["sexp"]).view(np.uint32).reshape(rows, -1), groups) << 1)


def listed_groups(streams: dict, rows: int, groups: int) -> np.ndarray:
    """The group of each listed scale (code 3), in `sesc`'s order (row-major), int32: what a GPU
    kernel that counts listed scales as 0 and adds them apart needs to find them."""
    return np.nonzero(_scale_codes(streams, rows, groups)[1] == WINDOW)[1].astype(np.int32)


def decode_scales_reference(streams: dict, rows: int, groups: int) -> np.ndarray:
    """(R, G) uint16 BF16 scale bits back from the scale streams, the plain way."""
    smant, code = _scale_codes(streams, rows, groups)
    exps = np.asarray(streams["sbase"]).astype(np.uint16)[:, None] + code
    scales = (exps << 7) | (smant & 0x7F)
    listed = code == WINDOW
    scales[listed] = np.asarray(streams["sesc"]).view(np.uint16)[: int(listed.sum())]
    return scales.astype(np.uint16)


def check_count(what: str, n: int) -> None:
    if n >= 1 << 31:
        raise ValueError(f"int4: {n} {what} are more than an int32 index holds; split the matrix")


def decode_reference(streams: dict, rows: int, cols: int, group: int, lut: int, payload_bits: int):
    """(packed int32 (R, ceil(cols / 8)), scales uint16 (R, cols / group)): the source's bits back,
    decoded the plain way (whole planes at once)."""
    b, g = blocks(cols), cols // group
    planes = streams["sym"].view(np.uint64).reshape(rows, b, 3)
    sym = np.zeros((rows, b * BLOCK), dtype=np.uint8)
    for k in range(3):
        sym |= _unplanes(planes[:, :, k], b * BLOCK) << k
    sym = sym[:, :cols]
    short, long = lut_tables(lut, payload_bits)
    nib = short[np.minimum(sym, ESCAPE)]
    escaped = sym == ESCAPE
    n = int(escaped.sum())
    fields = _unplanes(streams["esc"].view(np.uint32), n * payload_bits).reshape(n, payload_bits)
    index = (fields << np.arange(payload_bits, dtype=np.uint8)).sum(axis=1, dtype=np.uint8)
    nib[escaped] = long[index]
    return pack_nibbles(nib), decode_scales_reference(streams, rows, g)


def zero_words(streams: dict, rows: int, cols: int, group: int) -> np.ndarray | None:
    """The source's zero-point words back (compressed-tensors' `weight_zero_point`), or None for
    symmetric codes."""
    z = np.asarray(streams["zero"])
    return pack_zero_points(zero_nibbles(z, rows, cols // group)) if z.size else None


def resident_bytes(streams: dict) -> int:
    """Bytes the streams hold, the padding words included."""
    return sum(np.asarray(s).nbytes for s in streams.values())


def stored_bytes(rows: int, cols: int, group: int, zero: bool = False) -> int:
    """Bytes of the source: its INT32 words and BF16 scales, and with `zero` its zero-point words."""
    g = cols // group
    return rows * -(-cols // 8) * 4 + rows * g * 2 + (-(-rows // 8) * g * 4 if zero else 0)
