"""numba kernels of the `rans` codec (SPEC.md §3.3): histogram, encoder, decoder.

Each kernel works on a range of chunks and releases the GIL, so callers run chunk ranges on a
thread pool (no numba threading layer, so no nested-parallelism limits). Decoders never raise:
they report a per-chunk status, and never read outside a chunk's words or the raw stream.

Element layout: `w` is the element as an unsigned W-bit integer; with `rotate`, `w' = rotl(w, 1)`.
The symbol is `w' >> R`, the raw field `w' & (2^R - 1)`, with R = W - S.
"""

from __future__ import annotations

import numpy as np
from numba import njit

RANS_L = 1 << 16  # lower bound of the state interval [2^16, 2^32)
LANES = 8

OK = 0
ERR_UNDERFLOW = 1  # a chunk asked for more words than it has
ERR_LEFTOVER = 2  # words left over at the end of a chunk
ERR_FINAL_STATE = 3  # a lane did not return to RANS_L
ERR_BAD_STATE = 4  # an initial state outside [2^16, 2^32)

STATUS_TEXT = {
    ERR_UNDERFLOW: "chunk {c} runs out of rANS words",
    ERR_LEFTOVER: "chunk {c} has rANS words left over",
    ERR_FINAL_STATE: "chunk {c} does not end in the initial rANS state",
    ERR_BAD_STATE: "chunk {c} has an initial rANS state outside [2^16, 2^32)",
}


@njit(nogil=True, cache=True, inline="always")
def _rotl(w, W):
    return ((w << 1) | (w >> (W - 1))) & ((1 << W) - 1)


@njit(nogil=True, cache=True, inline="always")
def _rotr(w, W):
    return (w >> 1) | ((w & 1) << (W - 1))


@njit(nogil=True, cache=True)
def histogram(values, W, R, rotate, start, stop, counts):
    """Add the symbol counts of values[start:stop] to `counts` (int64, 2^S entries)."""
    for e in range(start, stop):
        w = np.int64(values[e])
        if rotate:
            w = _rotl(w, W)
        counts[w >> R] += 1


@njit(nogil=True, cache=True, inline="always")
def _enc(x, f, cum, rcp, P, scratch, wp):
    """Encode one symbol into state x; returns (x, wp). Branch-free renormalisation: the low word
    is always stored at wp-1 (inside this chunk's scratch) and kept only if x needed to shrink."""
    emit = np.int64(x >= (f << (32 - P)))
    scratch[wp - 1] = x & 0xFFFF
    wp -= emit
    x >>= emit << 4
    q = np.int64(x * rcp)  # x / f via a float64 reciprocal: exact after one correction
    r = x - q * f
    if r >= f:
        q += 1
        r -= f
    return (q << P) + r + cum, wp


@njit(nogil=True, cache=True)
def encode_chunks(values, W, R, rotate, n, chunk, c0, c1, freq, cum, rcp, P, scratch, nwords, states, raw):
    """Encode chunks c0..c1-1 of `values` (unsigned W-bit integers, 1-D).

    Chunk c's words go to the end of scratch[c*chunk:(c+1)*chunk] (they are written backwards, so
    the slice scratch[(c+1)*chunk - nwords[c] : (c+1)*chunk] is already in decode order); its four
    final states to states[4c:4c+4]; the raw fields are OR-ed into `raw` (zeroed by the caller).
    `rcp` is 1.0 / freq per symbol.
    """
    rmask = (1 << R) - 1
    xs = np.empty(LANES, dtype=np.int64)
    for c in range(c0, c1):
        start = c * chunk
        stop = min(start + chunk, n)
        wp = (c + 1) * chunk  # write pointer, moving down
        for lane in range(LANES):
            xs[lane] = RANS_L
        full = start + ((stop - start) // LANES) * LANES  # elements [full, stop): a partial round
        for e in range(stop - 1, full - 1, -1):  # the partial group, generic path
            w = np.int64(values[e])
            if rotate:
                w = _rotl(w, W)
            s = w >> R
            if R > 0:  # raw field, LSB-first at bit e*R
                v = w & rmask
                bit = e * R
                while v:
                    idx = bit >> 3
                    sh = bit & 7
                    raw[idx] |= np.uint8((v << sh) & 0xFF)
                    v >>= 8 - sh
                    bit += 8 - sh
            lane = (e - start) % LANES
            xs[lane], wp = _enc(xs[lane], freq[s], cum[s], rcp[s], P, scratch, wp)
        for g in range(full - 4, start - 4, -4):  # full groups of four, last first, lanes 3..0
            lb = (g - start) % LANES  # lane of element g: 0 or 4
            x0, x1, x2, x3 = xs[lb], xs[lb + 1], xs[lb + 2], xs[lb + 3]
            w0 = np.int64(values[g])
            w1 = np.int64(values[g + 1])
            w2 = np.int64(values[g + 2])
            w3 = np.int64(values[g + 3])
            if rotate:
                w0 = _rotl(w0, W)
                w1 = _rotl(w1, W)
                w2 = _rotl(w2, W)
                w3 = _rotl(w3, W)
            s0 = w0 >> R
            s1 = w1 >> R
            s2 = w2 >> R
            s3 = w3 >> R
            if R == 6:
                grp = (w0 & 63) | ((w1 & 63) << 6) | ((w2 & 63) << 12) | ((w3 & 63) << 18)
                b = (g >> 2) * 3
                raw[b] = grp & 0xFF
                raw[b + 1] = (grp >> 8) & 0xFF
                raw[b + 2] = grp >> 16
            elif R > 0:
                for j in range(4):
                    v = np.int64(values[g + j])
                    if rotate:
                        v = _rotl(v, W)
                    v &= rmask
                    bit = (g + j) * R
                    while v:
                        idx = bit >> 3
                        sh = bit & 7
                        raw[idx] |= np.uint8((v << sh) & 0xFF)
                        v >>= 8 - sh
                        bit += 8 - sh
            x3, wp = _enc(x3, freq[s3], cum[s3], rcp[s3], P, scratch, wp)
            x2, wp = _enc(x2, freq[s2], cum[s2], rcp[s2], P, scratch, wp)
            x1, wp = _enc(x1, freq[s1], cum[s1], rcp[s1], P, scratch, wp)
            x0, wp = _enc(x0, freq[s0], cum[s0], rcp[s0], P, scratch, wp)
            xs[lb], xs[lb + 1], xs[lb + 2], xs[lb + 3] = x0, x1, x2, x3
        nwords[c] = (c + 1) * chunk - wp
        for lane in range(LANES):
            states[LANES * c + lane] = xs[lane]


@njit(nogil=True, cache=True, inline="always")
def _raw_get(raw, e, R):
    """The R-bit raw field of element e (LSB-first at bit e*R); reads only the bytes it needs."""
    bit = e * R
    idx = bit >> 3
    sh = bit & 7
    nbytes = (sh + R + 7) >> 3
    v = np.int64(0)
    for i in range(nbytes):
        v |= np.int64(raw[idx + i]) << (8 * i)
    return (v >> sh) & ((1 << R) - 1)


@njit(nogil=True, cache=True)
def decode_chunks(words, offsets, states, slots, dec_f, dec_b, dec_top, raw_map, P, raw, W, R, rotate, n, chunk, c0, c1, out, status):
    """Decode chunks c0..c1-1 into `out` (unsigned W-bit integers); status[c] gets OK or an error.

    `words` is the words stream as uint16; `slots` is freq_table.decode_slots() (checked path);
    dec_f/dec_b/dec_top are its columns as uint16 and raw_map the output bits of each 6-bit raw
    field (the BF16/F16 fast path: out = dec_top[q] | raw_map[raw]). The fast path decodes eight
    elements (one per lane) per step, branch-free, while at least eight words remain, so each lane
    may read words[pos] unconditionally; uint64 indices spare numba its negative-index checks.
    Tails and nearly exhausted chunks take the checked path.
    """
    mask = (1 << P) - 1
    um = np.uint64(mask)
    xs = np.empty(LANES, dtype=np.int64)
    for c in range(c0, c1):
        start = c * chunk
        stop = min(start + chunk, n)
        pos = np.int64(offsets[c])
        end = np.int64(offsets[c + 1])
        err = OK
        for lane in range(LANES):
            xs[lane] = np.int64(states[LANES * c + lane])
            if xs[lane] < RANS_L or xs[lane] >= (np.int64(1) << 32):
                err = ERR_BAD_STATE
        if err != OK:
            status[c] = err
            continue
        e = start
        if R == 6 and W == 16:
            x0, x1, x2, x3, x4, x5, x6, x7 = xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7]
            while e + 8 <= stop and pos + 8 <= end:
                q0 = np.uint64(x0) & um
                q1 = np.uint64(x1) & um
                q2 = np.uint64(x2) & um
                q3 = np.uint64(x3) & um
                q4 = np.uint64(x4) & um
                q5 = np.uint64(x5) & um
                q6 = np.uint64(x6) & um
                q7 = np.uint64(x7) & um
                x0 = np.int64(dec_f[q0]) * (x0 >> P) + np.int64(dec_b[q0])
                x1 = np.int64(dec_f[q1]) * (x1 >> P) + np.int64(dec_b[q1])
                x2 = np.int64(dec_f[q2]) * (x2 >> P) + np.int64(dec_b[q2])
                x3 = np.int64(dec_f[q3]) * (x3 >> P) + np.int64(dec_b[q3])
                x4 = np.int64(dec_f[q4]) * (x4 >> P) + np.int64(dec_b[q4])
                x5 = np.int64(dec_f[q5]) * (x5 >> P) + np.int64(dec_b[q5])
                x6 = np.int64(dec_f[q6]) * (x6 >> P) + np.int64(dec_b[q6])
                x7 = np.int64(dec_f[q7]) * (x7 >> P) + np.int64(dec_b[q7])
                n0 = np.int64(x0 < RANS_L)
                x0 = (x0 << (n0 << 4)) | (np.int64(words[np.uint64(pos)]) & -n0)
                pos += n0
                n1 = np.int64(x1 < RANS_L)
                x1 = (x1 << (n1 << 4)) | (np.int64(words[np.uint64(pos)]) & -n1)
                pos += n1
                n2 = np.int64(x2 < RANS_L)
                x2 = (x2 << (n2 << 4)) | (np.int64(words[np.uint64(pos)]) & -n2)
                pos += n2
                n3 = np.int64(x3 < RANS_L)
                x3 = (x3 << (n3 << 4)) | (np.int64(words[np.uint64(pos)]) & -n3)
                pos += n3
                n4 = np.int64(x4 < RANS_L)
                x4 = (x4 << (n4 << 4)) | (np.int64(words[np.uint64(pos)]) & -n4)
                pos += n4
                n5 = np.int64(x5 < RANS_L)
                x5 = (x5 << (n5 << 4)) | (np.int64(words[np.uint64(pos)]) & -n5)
                pos += n5
                n6 = np.int64(x6 < RANS_L)
                x6 = (x6 << (n6 << 4)) | (np.int64(words[np.uint64(pos)]) & -n6)
                pos += n6
                n7 = np.int64(x7 < RANS_L)
                x7 = (x7 << (n7 << 4)) | (np.int64(words[np.uint64(pos)]) & -n7)
                pos += n7
                g = np.uint64((e >> 2) * 3)  # two 3-byte raw groups
                ga = np.int64(raw[g]) | (np.int64(raw[g + np.uint64(1)]) << 8) | (np.int64(raw[g + np.uint64(2)]) << 16)
                gb = np.int64(raw[g + np.uint64(3)]) | (np.int64(raw[g + np.uint64(4)]) << 8) | (np.int64(raw[g + np.uint64(5)]) << 16)
                ue = np.uint64(e)
                out[ue] = dec_top[q0] | raw_map[np.uint64(ga & 63)]
                out[ue + np.uint64(1)] = dec_top[q1] | raw_map[np.uint64((ga >> 6) & 63)]
                out[ue + np.uint64(2)] = dec_top[q2] | raw_map[np.uint64((ga >> 12) & 63)]
                out[ue + np.uint64(3)] = dec_top[q3] | raw_map[np.uint64(ga >> 18)]
                out[ue + np.uint64(4)] = dec_top[q4] | raw_map[np.uint64(gb & 63)]
                out[ue + np.uint64(5)] = dec_top[q5] | raw_map[np.uint64((gb >> 6) & 63)]
                out[ue + np.uint64(6)] = dec_top[q6] | raw_map[np.uint64((gb >> 12) & 63)]
                out[ue + np.uint64(7)] = dec_top[q7] | raw_map[np.uint64(gb >> 18)]
                e += 8
            xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7] = x0, x1, x2, x3, x4, x5, x6, x7
        while e < stop:  # checked path: any W and R, tails, nearly exhausted chunks
            lane = (e - start) % LANES
            x = xs[lane]
            p = slots[x & mask]
            x = (p >> 32) * (x >> P) + ((p >> 16) & 0xFFFF)
            if x < RANS_L:
                if pos >= end:
                    err = ERR_UNDERFLOW
                    break
                x = (x << 16) | np.int64(words[pos])
                pos += 1
            xs[lane] = x
            w = (p & 0xFFFF) << R
            if R > 0:
                w |= _raw_get(raw, e, R)
            if rotate:
                w = _rotr(w, W)
            out[e] = w
            e += 1
        if err == OK and pos != end:
            err = ERR_LEFTOVER
        if err == OK:
            for lane in range(LANES):
                if xs[lane] != RANS_L:
                    err = ERR_FINAL_STATE
        status[c] = err
