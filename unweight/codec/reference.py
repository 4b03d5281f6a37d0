"""Plain-Python/numpy reference decoder for the `rans` codec, written to read like SPEC.md §3.3.

It is slow (a Python loop per element) and exists as the oracle the fast numba decoder is tested
against; it shares no code with it beyond the table parser.
"""

from __future__ import annotations

import numpy as np

from .freq_table import parse

L = 1 << 16
LANES = 8  # SPEC.md §3.3: interleaved rANS states per chunk


def unpack_raw(raw: np.ndarray, n: int, R: int) -> np.ndarray:
    """Raw fields of n elements: R bits each, LSB-first, groups of four."""
    if R == 0:
        return np.zeros(n, dtype=np.int64)
    bits = np.unpackbits(np.asarray(raw, dtype=np.uint8), bitorder="little")
    bits = bits[: n * R].reshape(n, R).astype(np.int64)
    return (bits << np.arange(R, dtype=np.int64)).sum(axis=1)


def decode_reference(params: dict, streams: dict[str, np.ndarray], n: int) -> np.ndarray:
    """Decode n elements; returns them as unsigned integers of params['word_bits'] bits."""
    W, S, P, C = params["word_bits"], params["sym_bits"], params["precision"], params["chunk"]
    R = W - S
    freq = parse(streams["table"], S, P)
    cum = np.concatenate(([0], np.cumsum(freq)))
    k = -(-n // C)
    index = np.asarray(streams["index"], dtype=np.uint8)
    offsets = index[: 8 * (k + 1)].view("<u8").astype(np.int64)
    states = index[8 * (k + 1) :].view("<u4").astype(np.int64).reshape(k, LANES)
    words = np.asarray(streams["words"], dtype=np.uint8).view("<u2").astype(np.int64)
    raw = unpack_raw(streams["raw"], n, R)
    out = np.zeros(n, dtype=np.int64)
    for i in range(k):
        x = [int(s) for s in states[i]]
        pos = int(offsets[i])
        for e in range(min(C, n - i * C)):
            lane = e % LANES
            q = x[lane] % (1 << P)
            s = int(np.searchsorted(cum, q, side="right")) - 1  # c(s) <= q < c(s) + f(s)
            x[lane] = int(freq[s]) * (x[lane] >> P) + q - int(cum[s])
            if x[lane] < L:
                if pos >= offsets[i + 1]:
                    raise ValueError(f"chunk {i} runs out of words")
                x[lane] = (x[lane] << 16) | int(words[pos])
                pos += 1
            out[i * C + e] = (s << R) | int(raw[i * C + e])
        if pos != offsets[i + 1] or any(v != L for v in x):
            raise ValueError(f"chunk {i} does not end where the encoder began")
    if params["rotate"]:
        out = (out >> 1) | ((out & 1) << (W - 1))
    return out.astype({8: np.uint8, 16: np.uint16, 32: np.uint32}[W])
