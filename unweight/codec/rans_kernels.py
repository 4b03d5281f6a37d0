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

from .freq_table import slot_entry

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
def _histogram16(values, shift, start, stop, counts):
    """histogram() for 16-bit words, whose symbol is (w >> shift) & 0x3FF: four words a uint64
    load into four uint32 sub-histograms (16 KiB, in L1), flushed every 2^30 loads so they
    cannot overflow. 2.5-3x the general loop's speed."""
    sh = np.uint64(shift)
    m = np.uint64(0x3FF)
    sub = np.zeros(4 * 1024, dtype=np.uint32)
    e = start
    while e < stop and e & 3:  # to a multiple of four
        counts[(np.int64(values[e]) >> shift) & 0x3FF] += 1
        e += 1
    q1 = stop >> 2
    while e < 4 * q1:
        block = min(q1 - (e >> 2), 1 << 30)
        v64 = values[e : e + 4 * block].view(np.uint64)
        for i in range(block):
            w = v64[i] >> sh
            sub[w & m] += np.uint32(1)
            sub[np.uint64(1024) + ((w >> np.uint64(16)) & m)] += np.uint32(1)
            sub[np.uint64(2048) + ((w >> np.uint64(32)) & m)] += np.uint32(1)
            sub[np.uint64(3072) + ((w >> np.uint64(48)) & m)] += np.uint32(1)
        for s in range(1024):
            counts[s] += np.int64(sub[s]) + np.int64(sub[1024 + s]) + np.int64(sub[2048 + s]) + np.int64(sub[3072 + s])
        sub[:] = 0
        e += 4 * block
    for i in range(e, stop):
        counts[(np.int64(values[i]) >> shift) & 0x3FF] += 1


@njit(nogil=True, cache=True)
def histogram(values, W, R, rotate, start, stop, counts):
    """Add the symbol counts of values[start:stop] to `counts` (int64, 2^S entries). Four
    sub-histograms, so that runs of one symbol do not serialise on a single counter."""
    if W == 16 and R == 6:
        _histogram16(values, 5 if rotate else 6, start, stop, counts)
        return
    nsym = len(counts)
    sub = np.zeros((4, nsym), dtype=np.int64)
    e = start
    while e + 4 <= stop:
        for j in range(4):
            w = np.int64(values[e + j])
            if rotate:
                w = _rotl(w, W)
            sub[j, w >> R] += 1
        e += 4
    for i in range(e, stop):
        w = np.int64(values[i])
        if rotate:
            w = _rotl(w, W)
        sub[0, w >> R] += 1
    for j in range(4):
        for s in range(nsym):
            counts[s] += sub[j, s]


@njit(nogil=True, cache=True)
def encoder_tables(freq, P):
    """Per symbol s of frequency f (summing to 2^P): c(s), the division magic of f, and the vector
    encoder's entry (int64, int64, uint64).

    The magic divides exactly for x < 2^32 (Granlund and Montgomery, 1994): with
    l = ceil(log2 f), m' = floor(2^32 (2^l − f) / f) + 1 and the shifts min(l, 1), max(l − 1, 0),
    packed as m' | sh1 << 32 | sh2 << 40. The vector entry is m' | c(s) << 32 | (2^P − f) << 48:
    it has no room for the shifts, which the vector encoder recomputes from f. Symbols of
    frequency 0 are never encoded and get 0."""
    n = len(freq)
    cum = np.zeros(n, dtype=np.int64)
    magic = np.zeros(n, dtype=np.int64)
    entry = np.zeros(n, dtype=np.uint64)
    c = 0
    for s in range(n):
        d = freq[s]
        cum[s] = c
        if d > 0:
            shift = 0
            while (1 << shift) < d:
                shift += 1
            m = ((((1 << shift) - d) << 32) // d) + 1
            magic[s] = m | (min(shift, 1) << 32) | (max(shift - 1, 0) << 40)
            entry[s] = (
                np.uint64(m & 0xFFFFFFFF) | (np.uint64(c) << np.uint64(32)) | (np.uint64((1 << P) - d) << np.uint64(48))
            )
        c += d
    return cum, magic, entry


def division_magic(freq: np.ndarray) -> np.ndarray:
    """The packed division magic of every frequency (see encoder_tables)."""
    freq = np.asarray(freq, dtype=np.int64)
    return encoder_tables(freq, 15)[1]


@njit(nogil=True, cache=True, inline="always")
def _enc(x, f, cum, magic, P, scratch, wp):
    """Encode one symbol into state x; returns (x, wp). Branch-free renormalisation: the low word
    is always stored at wp-1 (inside this chunk's scratch) and kept only if x needed to shrink.
    x div f is a multiply and shifts (Granlund and Montgomery, 1994), exact for x < 2^32: magic
    packs m' (low 32 bits) and the two shifts (bits 32-39 and 40-47), see encoder_tables()."""
    emit = np.int64(x >= (f << (32 - P)))
    scratch[wp - 1] = x & 0xFFFF
    wp -= emit
    x >>= emit << 4
    xu = np.uint64(x)
    mu = np.uint64(magic)
    t1 = (xu * (mu & np.uint64(0xFFFFFFFF))) >> np.uint64(32)
    q = np.int64((t1 + ((xu - t1) >> ((mu >> np.uint64(32)) & np.uint64(0xFF)))) >> (mu >> np.uint64(40)))
    return (q << P) + (x - q * f) + cum, wp


@njit(nogil=True, cache=True, inline="always")
def _put_raw(raw, v, e, R):
    """OR the R-bit raw field v of element e into `raw` (LSB-first at bit e*R)."""
    bit = e * R
    while v:
        idx = bit >> 3
        sh = bit & 7
        raw[idx] |= np.uint8((v << sh) & 0xFF)
        v >>= 8 - sh
        bit += 8 - sh


@njit(nogil=True, cache=True)
def _pack_raw6(values, rotate, start, stop, raw):
    """Raw fields of elements [start, stop) of 16-bit words into 3-byte groups (start is a
    multiple of 4; a partial last group is zero-padded). No carried state: LLVM vectorises it."""
    full = start + ((stop - start) >> 2 << 2)
    for g in range(start >> 2, full >> 2):
        v = np.int64(0)
        for j in range(4):
            w = np.int64(values[4 * g + j])
            r = ((w << 1) | (w >> 15)) & 63 if rotate else w & 63
            v |= r << (6 * j)
        raw[3 * g] = v & 0xFF
        raw[3 * g + 1] = (v >> 8) & 0xFF
        raw[3 * g + 2] = v >> 16
    for e in range(full, stop):
        w = np.int64(values[e])
        if rotate:
            w = _rotl(w, 16)
        _put_raw(raw, w & 63, e, 6)


@njit(nogil=True, cache=True)
def encode_prologue(values, W, R, rotate, start, stop, wp, freq, cum, magic, P, scratch, xs, raw, pack16):
    """Start encoding the chunk of elements [start, stop) whose words end at scratch[wp]: pack
    16-bit raw fields if pack16 (R = 6; other R are packed as the elements are coded), set the eight lanes to
    RANS_L and code the last, partial round, last element first. Returns (full, wp): the end of
    the full rounds, which the caller codes from the last round down, and the write pointer."""
    rmask = (1 << R) - 1
    if R == 6 and W == 16 and pack16:
        _pack_raw6(values, rotate, start, stop, raw)
    for lane in range(LANES):
        xs[lane] = RANS_L
    full = start + ((stop - start) // LANES) * LANES  # elements [full, stop): a partial round
    for e in range(stop - 1, full - 1, -1):
        w = np.int64(values[e])
        if rotate:
            w = _rotl(w, W)
        s = w >> R
        if R > 0 and not (R == 6 and W == 16):
            _put_raw(raw, w & rmask, e, R)
        lane = (e - start) % LANES
        xs[lane], wp = _enc(xs[lane], freq[s], cum[s], magic[s], P, scratch, wp)
    return full, wp


@njit(nogil=True, cache=True)
def encode_chunks(values, W, R, rotate, n, chunk, c0, c1, freq, cum, magic, P, scratch, nwords, states, raw):
    """Encode chunks c0..c1-1 of `values` (unsigned W-bit integers, 1-D).

    Chunk c's words go to the end of scratch[c*chunk:(c+1)*chunk] (they are written backwards, so
    the slice scratch[(c+1)*chunk - nwords[c] : (c+1)*chunk] is already in decode order); its eight
    final states to states[8c:8c+8]; the raw fields are OR-ed into `raw` (zeroed by the caller).
    `magic` is encoder_tables()[1]. Full rounds of eight elements take an unrolled path.
    """
    rmask = (1 << R) - 1
    xs = np.empty(LANES, dtype=np.int64)
    for c in range(c0, c1):
        start = c * chunk
        stop = min(start + chunk, n)
        full, wp = encode_prologue(
            values, W, R, rotate, start, stop, (c + 1) * chunk, freq, cum, magic, P, scratch, xs, raw, True
        )
        x0, x1, x2, x3, x4, x5, x6, x7 = xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7]
        if W == 16 and R == 6:
            for g in range(full - LANES, start - 1, -LANES):  # full rounds, last first, lanes 7..0
                s7 = _sym16(values[g + 7], rotate)
                s6 = _sym16(values[g + 6], rotate)
                s5 = _sym16(values[g + 5], rotate)
                s4 = _sym16(values[g + 4], rotate)
                s3 = _sym16(values[g + 3], rotate)
                s2 = _sym16(values[g + 2], rotate)
                s1 = _sym16(values[g + 1], rotate)
                s0 = _sym16(values[g], rotate)
                x7, wp = _enc(x7, freq[s7], cum[s7], magic[s7], P, scratch, wp)
                x6, wp = _enc(x6, freq[s6], cum[s6], magic[s6], P, scratch, wp)
                x5, wp = _enc(x5, freq[s5], cum[s5], magic[s5], P, scratch, wp)
                x4, wp = _enc(x4, freq[s4], cum[s4], magic[s4], P, scratch, wp)
                x3, wp = _enc(x3, freq[s3], cum[s3], magic[s3], P, scratch, wp)
                x2, wp = _enc(x2, freq[s2], cum[s2], magic[s2], P, scratch, wp)
                x1, wp = _enc(x1, freq[s1], cum[s1], magic[s1], P, scratch, wp)
                x0, wp = _enc(x0, freq[s0], cum[s0], magic[s0], P, scratch, wp)
            xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7] = x0, x1, x2, x3, x4, x5, x6, x7
        else:
            for e in range(full - 1, start - 1, -1):
                w = np.int64(values[e])
                if rotate:
                    w = _rotl(w, W)
                s = w >> R
                if R > 0:
                    _put_raw(raw, w & rmask, e, R)
                lane = (e - start) % LANES
                xs[lane], wp = _enc(xs[lane], freq[s], cum[s], magic[s], P, scratch, wp)
        nwords[c] = (c + 1) * chunk - wp
        for lane in range(LANES):
            states[LANES * c + lane] = xs[lane]


@njit(nogil=True, cache=True, inline="always")
def _sym16(v, rotate):
    """The 10-bit symbol of a 16-bit word: bits 14..5 after rotation, bits 15..6 without."""
    w = np.int64(v)
    return (w >> 5) & 0x3FF if rotate else w >> 6


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
def _merge_raw6(raw, raw_pairs, g0, g1, out32):
    """OR the raw fields of groups g0..g1-1 (four elements, three bytes each) into the output,
    seen as uint32 pairs of elements; raw_pairs maps 12 raw bits (two fields) to their output bits.
    Kept out of the rANS loop, where it would lengthen every round."""
    for g in range(g0, g1):
        b = 3 * g
        v = np.int64(raw[b]) | (np.int64(raw[b + 1]) << 8) | (np.int64(raw[b + 2]) << 16)
        out32[2 * g] |= raw_pairs[v & 0xFFF]
        out32[2 * g + 1] |= raw_pairs[v >> 12]


@njit(nogil=True, cache=True)
def _decode_fast16(words, pos, end, xs, tab, P, e, stop, out):
    """The branch-free 16-bit path: eight lanes, one element each per round, symbols only (the raw
    bits are merged afterwards). Runs whole rounds while at least eight words remain; returns
    (e, pos) and leaves the lane states in xs."""
    um = np.uint64((1 << P) - 1)
    x0, x1, x2, x3, x4, x5, x6, x7 = xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7]
    while True:
        # Each round of eight reads at most eight words: this many rounds need no checks.
        rounds = min((stop - e) >> 3, (end - pos) >> 3)
        if rounds <= 0:
            break
        for _ in range(rounds):
            q0 = np.uint64(x0) & um
            q1 = np.uint64(x1) & um
            q2 = np.uint64(x2) & um
            q3 = np.uint64(x3) & um
            q4 = np.uint64(x4) & um
            q5 = np.uint64(x5) & um
            q6 = np.uint64(x6) & um
            q7 = np.uint64(x7) & um
            a0 = np.int64(tab[q0])
            x0 = (a0 & 0xFFFF) * (x0 >> P) + ((a0 >> 16) & 0xFFFF)
            a1 = np.int64(tab[q1])
            x1 = (a1 & 0xFFFF) * (x1 >> P) + ((a1 >> 16) & 0xFFFF)
            a2 = np.int64(tab[q2])
            x2 = (a2 & 0xFFFF) * (x2 >> P) + ((a2 >> 16) & 0xFFFF)
            a3 = np.int64(tab[q3])
            x3 = (a3 & 0xFFFF) * (x3 >> P) + ((a3 >> 16) & 0xFFFF)
            a4 = np.int64(tab[q4])
            x4 = (a4 & 0xFFFF) * (x4 >> P) + ((a4 >> 16) & 0xFFFF)
            a5 = np.int64(tab[q5])
            x5 = (a5 & 0xFFFF) * (x5 >> P) + ((a5 >> 16) & 0xFFFF)
            a6 = np.int64(tab[q6])
            x6 = (a6 & 0xFFFF) * (x6 >> P) + ((a6 >> 16) & 0xFFFF)
            a7 = np.int64(tab[q7])
            x7 = (a7 & 0xFFFF) * (x7 >> P) + ((a7 >> 16) & 0xFFFF)
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
            ue = np.uint64(e)
            out[ue] = tab[q0] >> np.uint64(32)
            out[ue + np.uint64(1)] = tab[q1] >> np.uint64(32)
            out[ue + np.uint64(2)] = tab[q2] >> np.uint64(32)
            out[ue + np.uint64(3)] = tab[q3] >> np.uint64(32)
            out[ue + np.uint64(4)] = tab[q4] >> np.uint64(32)
            out[ue + np.uint64(5)] = tab[q5] >> np.uint64(32)
            out[ue + np.uint64(6)] = tab[q6] >> np.uint64(32)
            out[ue + np.uint64(7)] = tab[q7] >> np.uint64(32)
            e += 8
    xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7] = x0, x1, x2, x3, x4, x5, x6, x7
    return e, pos


@njit(nogil=True, cache=True)
def decode_chunks(words, offsets, states, tab, raw_pairs, P, raw, W, R, rotate, n, chunk, c0, c1, out, out32, status):
    """Decode chunks c0..c1-1 into `out` (unsigned W-bit integers); status[c] gets OK or an error.

    `words` is the words stream as uint16; `tab` is freq_table.slots_from_stream(), raw_pairs
    freq_table.raw_pairs(); `out32` is `out` seen as uint32 (16-bit words only). For BF16/F16,
    _decode_fast16 decodes rounds of eight elements (one per lane), branch-free, and
    _merge_raw6 then ORs the raw bits in; tails and nearly exhausted chunks take the checked path,
    which also serves 8- and 32-bit words.
    """
    xs = np.empty(LANES, dtype=np.int64)
    one_level = np.empty(0, dtype=np.uint8)
    for c in range(c0, c1):
        start = c * chunk
        stop = min(start + chunk, n)
        pos = np.int64(offsets[c])
        end = np.int64(offsets[c + 1])
        if not load_states(states, c, xs):
            status[c] = ERR_BAD_STATE
            continue
        e = start
        if R == 6 and W == 16:
            e, pos = _decode_fast16(words, pos, end, xs, tab, P, e, stop, out)
            _merge_raw6(raw, raw_pairs, start >> 2, e >> 2, out32)
        status[c] = checked_tail(words, pos, end, xs, tab, one_level, P, raw, W, R, rotate, start, e, stop, out)


@njit(nogil=True, cache=True, inline="always")
def load_states(states, c, xs):
    """Chunk c's eight initial states into xs; False if one lies outside [2^16, 2^32)."""
    ok = True
    for lane in range(LANES):
        x = np.int64(states[LANES * c + lane])
        xs[lane] = x
        if x < RANS_L or x >= (np.int64(1) << 32):
            ok = False
    return ok


@njit(nogil=True, cache=True)
def checked_tail(words, pos, end, xs, tab, index, P, raw, W, R, rotate, start, e, stop, out):
    """Decode elements [e, stop) of the chunk that starts at `start` (e - start a multiple of 8
    when the lanes hold states mid-chunk) one at a time, checking every word read, then check the
    chunk's end: all its words used and every lane back at RANS_L. Returns OK or an error code.
    Serves every W and R, the tails of the fast paths and chunks they leave early. `tab` is the
    slot table when `index` is empty, else the vector decoder's two-level lookup: its symbol
    entries and slot indices (freq_table.slot_entry)."""
    mask = (1 << P) - 1
    while e < stop:
        lane = (e - start) % LANES
        x = xs[lane]
        t = tab[x & mask] if len(index) == 0 else slot_entry(tab, index, x & mask)
        a = np.int64(t & np.uint64(0xFFFFFFFF))
        x = (a & 0xFFFF) * (x >> P) + (a >> 16)
        if x < RANS_L:
            if pos >= end:
                return ERR_UNDERFLOW
            x = (x << 16) | np.int64(words[pos])
            pos += 1
        xs[lane] = x
        w = np.int64(t >> np.uint64(32))
        if R > 0:
            r = _raw_get(raw, e, R)
            w |= _rotr(r, W) if rotate else r
        out[e] = w
        e += 1
    if pos != end:
        return ERR_LEFTOVER
    for lane in range(LANES):
        if xs[lane] != RANS_L:
            return ERR_FINAL_STATE
    return OK
