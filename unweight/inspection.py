"""`unweight inspect`: per-tensor codec, sizes, exponent entropy and the gap to the order-0 bound."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import numpy as np
from numba import njit

from . import memory
from .checkpoint import containers_of, decode_in_order
from .report import TensorReport
from unweight.formats import ContainerReader

# dtype -> (word dtype, exponent shift, exponent mask)
EXPONENT_FIELDS = {
    "BF16": (np.uint16, 7, 0xFF),
    "F16": (np.uint16, 10, 0x1F),
    "F32": (np.uint32, 23, 0xFF),
    "F8_E4M3": (np.uint8, 3, 0xF),
    "F8_E5M2": (np.uint8, 2, 0x1F),
}


def entropy_bits(counts: np.ndarray) -> float:
    """Shannon entropy in bits per symbol of a histogram."""
    counts = counts[counts > 0].astype(np.float64)
    if counts.size == 0:
        return 0.0
    p = counts / counts.sum()
    return max(0.0, float(-(p * np.log2(p)).sum()))


@dataclass(slots=True)
class TensorStats(TensorReport):
    """A TensorReport plus what `inspect` measures by decoding the tensor."""

    bits_per_weight: float
    exponent_entropy: float | None  # bits per weight, floats only
    order0_bound: float | None  # bits per weight, entropy of whole values (1- and 2-byte dtypes)
    exponent_histogram: list[int] | None = field(default=None, repr=False)

    @property
    def gap_to_bound(self) -> float | None:
        """Stored bits/weight above the order-0 bound (None where no bound is computed)."""
        return None if self.order0_bound is None else self.bits_per_weight - self.order0_bound

    def to_json(self, histogram: bool = False) -> dict:
        d = asdict(self)
        if not histogram:
            d.pop("exponent_histogram")
        d["gap_to_bound"] = self.gap_to_bound
        return d


def _decodes(reader: ContainerReader, name: str) -> bool:
    """Whether inspect decodes this tensor: floats (for the exponent) and 1- and 2-byte dtypes."""
    e = reader.tensors[name]
    return bool(e.numel) and (e.dtype in EXPONENT_FIELDS or e.nbytes // max(e.numel, 1) <= 2)


@njit(nogil=True, cache=True)
def _count_fields(values, shift, mask, fields, words):
    """Add each element's (value >> shift) & mask to `fields` and, when `words` is not empty, the
    value itself to `words`: histograms without np.bincount's int64 copy of the input."""
    whole = len(words) > 0
    for v in values:
        fields[(v >> shift) & mask] += 1
        if whole:
            words[v] += 1


class _Histograms:
    """A tensor's exponent histogram and whole-value histogram, piece by piece."""

    def __init__(self, e) -> None:
        self.size = e.nbytes // e.numel
        self.exponent = e.dtype in EXPONENT_FIELDS
        word, self.shift, self.mask = EXPONENT_FIELDS[e.dtype] if self.exponent else ({1: np.uint8, 2: np.uint16}[self.size], 0, 0)
        self.word = word
        self.fields = np.zeros(self.mask + 1, dtype=np.int64)
        self.words = np.zeros(1 << (8 * self.size) if self.size <= 2 else 0, dtype=np.int64)

    def add(self, piece: np.ndarray) -> None:
        _count_fields(piece.view(self.word), self.shift, self.mask, self.fields, self.words)


def tensor_stats(file: str, reader: ContainerReader, name: str, hist: _Histograms | None = None) -> TensorStats:
    """A tensor's statistics; `hist`, filled from its decoded bytes, is needed where _decodes() holds."""
    e = reader.tensors[name]
    stored = sum(len(reader.stream(s)) for s in e.streams.values())
    numel = e.numel
    bpw = 8 * stored / numel if numel else 0.0
    exp_h = bound = hists = None
    if _decodes(reader, name):
        if hist.exponent:
            exp_h, hists = entropy_bits(hist.fields), hist.fields.tolist()
        if hist.size <= 2:
            bound = entropy_bits(hist.words)
    return TensorStats(file, name, e.dtype, list(e.shape), e.codec, e.nbytes, stored, bpw, exp_h, bound, hists)


def inspect(path: str | os.PathLike, threads: int | None = None, max_memory: int | None = None) -> list[TensorStats]:
    """Statistics of every tensor of a compressed folder or file (decodes the float tensors, in
    pieces of memory.piece_bytes(max_memory): no whole-tensor buffer)."""
    piece = memory.piece_bytes(memory.check_budget(max_memory))
    root, files, _ = containers_of(path)
    out: list[TensorStats] = []
    for rel in files:
        with ContainerReader(root / rel) as reader:
            decoded = decode_in_order(reader, [n for n in reader.tensors if _decodes(reader, n)], threads, piece)
            for name in reader.tensors:  # the decoded ones come in this order too, each used before the next
                hist = None
                if _decodes(reader, name):
                    hist = _Histograms(reader.tensors[name])
                    for data in next(decoded)[1]():
                        hist.add(data)
                out.append(tensor_stats(str(rel), reader, name, hist))
    return out
