"""The numba encoder of the resident `int4` layout (int4.py), row ranges on threads: what a layer
runs when it codes INT4 weights at load (`encode`). It writes the streams `int4.encode_reference`
writes, bit for bit (the tests hold it to that), from compressed-tensors' packed words and BF16 scale bits.

Codes: a histogram of the nibbles (the lut), each row's escape count (its first escape by a prefix
sum), then each range of rows writes its symbol planes and its escapes' index bits. A range owns
the index words from its first whole one; the bits it has in the word it shares with the range
before go to a word of its own (`heads`), ORed in after. Scales: each row's base exponent and
count of listed scales, then its mantissa bytes, exponent bits and listed scales.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from . import int4

ESCAPE, WINDOW, BLOCK = int4.ESCAPE, int4.WINDOW, int4.BLOCK


def _parts(rows: int) -> int:
    return max(1, min(rows, 4 * numba.get_num_threads()))


@njit(cache=True, inline="always")
def _nibble(words, r, c):
    return (np.int64(words[r, c >> 3]) >> (4 * (c & 7))) & 15


@njit(cache=True, parallel=True)
def _histogram(words, cols, parts):
    rows = words.shape[0]
    partial = np.zeros((parts, 16), np.int64)
    for p in prange(parts):
        for r in range(p * rows // parts, (p + 1) * rows // parts):
            for c in range(cols):
                partial[p, _nibble(words, r, c)] += 1
    return partial.sum(axis=0)


@njit(cache=True, parallel=True)
def _row_escapes(words, cols, to_sym, out):
    for r in prange(words.shape[0]):
        n = 0
        for c in range(cols):
            n += to_sym[_nibble(words, r, c)] == ESCAPE
        out[r] = n


@njit(cache=True, parallel=True)
def _code_rows(words, cols, to_sym, to_index, pb, esc_row, planes, esc, heads, parts):
    rows, nblocks = words.shape[0], planes.shape[1]
    for p in prange(parts):
        r0, r1 = p * rows // parts, (p + 1) * rows // parts
        bit = pb * esc_row[r0]
        owned = (bit + 31) >> 5  # the first index word this range owns
        head = np.int64(0)
        for r in range(r0, r1):
            for b in range(nblocks):
                p0 = p1 = p2 = np.int64(0)
                for j in range(min(BLOCK, cols - b * BLOCK)):
                    n = _nibble(words, r, b * BLOCK + j)
                    s = np.int64(to_sym[n])
                    one = np.int64(1) << j
                    p0 |= one * (s & 1)
                    p1 |= one * ((s >> 1) & 1)
                    p2 |= one * ((s >> 2) & 1)
                    if s == ESCAPE:
                        index = np.int64(to_index[n])
                        for k in range(pb):
                            if (index >> k) & 1:
                                w = bit >> 5
                                if w < owned:
                                    head |= np.int64(1) << (bit & 31)
                                else:
                                    esc[w] |= np.uint32(1) << np.uint32(bit & 31)
                            bit += 1
                planes[r, b, 0], planes[r, b, 1], planes[r, b, 2] = p0, p1, p2
        heads[p] = head


@njit(cache=True, parallel=True)
def _scale_bases(bits, sbase, listed):
    """Each row's base exponent (the lowest of the WINDOW-wide windows holding most of its positive
    normal scales) and how many of its scales the window does not code."""
    for r in prange(bits.shape[0]):
        hist = np.zeros(256 + WINDOW, np.int64)
        for g in range(bits.shape[1]):
            v = np.int64(bits[r, g]) & 0xFFFF
            e = (v >> 7) & 0xFF
            if v >> 15 == 0 and e > 0:
                hist[e] += 1
        best, most = 0, np.int64(-1)
        for b in range(256):
            held = hist[b] + hist[b + 1] + hist[b + 2]
            if held > most:
                best, most = b, held
        sbase[r] = best
        n = 0
        for g in range(bits.shape[1]):
            v = np.int64(bits[r, g]) & 0xFFFF
            code = ((v >> 7) & 0xFF) - best
            n += not (v >> 15 == 0 and 0 <= code < WINDOW)
        listed[r] = n


@njit(cache=True, parallel=True)
def _code_scales(bits, sbase, sesc_row, smant, sexp, sesc):
    G = bits.shape[1]
    words = sexp.shape[1]
    for r in prange(bits.shape[0]):
        at = np.int64(sesc_row[r])
        for w in range(words):
            sexp[r, w] = 0
        for g in range(G):
            v = np.int64(bits[r, g]) & 0xFFFF
            code = ((v >> 7) & 0xFF) - np.int64(sbase[r])
            if v >> 15 == 0 and 0 <= code < WINDOW:
                smant[r, g] = ((code & 1) << 7) | (v & 0x7F)
            else:
                code = WINDOW
                smant[r, g] = 0x80
                sesc[at] = v
                at += 1
            sexp[r, g >> 5] |= np.uint32((code >> 1) << (g & 31))


def encode(packed: np.ndarray, scales: np.ndarray, cols: int, group: int, zero=None) -> dict:
    """int4.encode_reference's streams and parameters, coded on threads. ValueError names what of
    the packed words, scales and zero points does not fit."""
    packed, scales = np.asarray(packed), np.asarray(scales)
    int4.check_source(packed, scales, cols, group)
    zeros = (
        np.zeros(0, np.uint8)
        if zero is None
        else int4.zero_stream(int4.zero_source(zero, packed.shape[0], cols // group))
    )
    words = np.ascontiguousarray(packed).view(np.uint32)
    rows = words.shape[0]
    parts = _parts(rows)
    counts = _histogram(words, cols, parts)
    lut, payload_bits = int4.lut_of_counts(counts)
    to_sym, to_index = int4.symbol_tables(lut, payload_bits, counts)
    escapes = np.empty(rows, np.int64)
    _row_escapes(words, cols, to_sym, escapes)
    esc_row = np.zeros(rows + 1, np.int64)
    np.cumsum(escapes, out=esc_row[1:])
    int4.check_count("escapes", esc_row[-1])
    planes = np.empty((rows, int4.blocks(cols), 3), np.int64)
    esc = np.zeros(-(-int(esc_row[-1]) * payload_bits // 32) + int4.PAD_WORDS, np.uint32)
    heads = np.zeros(parts, np.int64)
    _code_rows(words, cols, to_sym, to_index, payload_bits, esc_row, planes, esc, heads, parts)
    for p in range(parts):  # each range's bits in the word it shares with the range before
        esc[(payload_bits * esc_row[p * rows // parts]) >> 5] |= np.uint32(heads[p] & 0xFFFFFFFF)
    streams = {
        "sym": planes.reshape(-1),
        "esc": esc.view(np.int32),
        "esc_row": esc_row.astype(np.int32),
        **encode_scales(scales),
        "zero": zeros,
    }
    return {"streams": streams, "lut": lut, "payload_bits": payload_bits}


def code_bytes(packed: np.ndarray, cols: int) -> int:
    """Bytes of the codes' streams (sym, esc, esc_row) `encode` would write, from the nibbles'
    histogram alone: what int4_weight weighs before it codes anything."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    rows = words.shape[0]
    counts = _histogram(words, cols, _parts(rows))
    lut, payload_bits = int4.lut_of_counts(counts)
    to_sym, _ = int4.symbol_tables(lut, payload_bits, counts)
    escapes = int(counts[to_sym == ESCAPE].sum())
    esc_words = -(-escapes * payload_bits // 32) + int4.PAD_WORDS
    return rows * int4.blocks(cols) * 3 * 8 + esc_words * 4 + (rows + 1) * 4


def encode_scales(scales: np.ndarray) -> dict:
    """int4.encode_scales_reference's streams of (R, G) BF16 scale bits, coded on threads."""
    bits = np.ascontiguousarray(scales).view(np.uint16)
    rows, g = bits.shape
    sbase, listed = np.empty(rows, np.uint8), np.empty(rows, np.int64)
    _scale_bases(bits, sbase, listed)
    sesc_row = np.zeros(rows + 1, np.int64)
    np.cumsum(listed, out=sesc_row[1:])
    int4.check_count("listed scales", sesc_row[-1])
    smant, sexp = np.empty((rows, g), np.uint8), np.empty((rows, -(-g // 32)), np.uint32)
    sesc = np.zeros(max(1, int(sesc_row[-1])), np.uint16)
    _code_scales(bits, sbase, sesc_row, smant, sexp, sesc)
    return {
        "smant": smant.reshape(-1),
        "sexp": sexp.reshape(-1).view(np.int32),
        "sbase": sbase,
        "sesc": sesc.view(np.int16),
        "sesc_row": sesc_row.astype(np.int32),
    }
