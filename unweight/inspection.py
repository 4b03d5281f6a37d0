"""`unweight inspect`: per-tensor codec, sizes, exponent entropy and the gap to the order-0 bound."""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field

import numpy as np
from numba import njit

from unweight.formats import DTYPE_BITS, ContainerReader

from . import memory
from .decoding import decode_in_order
from .folder import containers_of
from .report import CLASS_ORDER, TensorReport

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
    return bool(e.numel) and (
        e.dtype in EXPONENT_FIELDS or DTYPE_BITS[e.dtype] in (8, 16)
    )  # not F4, F6: no whole-byte values


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
        self.size = DTYPE_BITS[e.dtype] // 8  # whole bytes: _decodes() leaves out F4 and F6
        self.exponent = e.dtype in EXPONENT_FIELDS
        word, self.shift, self.mask = (
            EXPONENT_FIELDS[e.dtype] if self.exponent else ({1: np.uint8, 2: np.uint16}[self.size], 0, 0)
        )
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


LAYER_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")


def layer_type(name: str) -> str:
    """A tensor's name with its layer and expert numbers as `*`: every layer's q_proj (or every
    expert's down_proj) is one type (model.layers.*.self_attn.q_proj.weight)."""
    return LAYER_INDEX.sub("*", name)


@dataclass(slots=True)
class GroupStats:
    """The TensorStats of several tensors added up: sizes summed; bits/weight, exponent entropy
    and the order-0 bound averaged over their weights (the bound of coding each tensor alone)."""

    tensor_class: str
    layer_type: str
    dtypes: list[str]
    codecs: list[str]
    tensors: int = 0
    weights: int = 0
    original_bytes: int = 0
    stored_bytes: int = 0
    _exp: list[float] = field(
        default_factory=lambda: [0.0, 0.0], repr=False
    )  # sum of entropy * weights, weights with one
    _bound: list[float] = field(default_factory=lambda: [0.0, 0.0], repr=False)

    def add(self, s: TensorStats, numel: int) -> None:
        self.tensors += 1
        self.weights += numel
        self.original_bytes += s.original_bytes
        self.stored_bytes += s.stored_bytes
        if s.dtype not in self.dtypes:
            self.dtypes.append(s.dtype)
        if s.codec not in self.codecs:
            self.codecs.append(s.codec)
        for acc, value in ((self._exp, s.exponent_entropy), (self._bound, s.order0_bound)):
            if value is not None:
                acc[0] += value * numel
                acc[1] += numel

    def merge(self, other: GroupStats) -> None:
        """Add another group's tensors to this one (a class's total from its layer types)."""
        self.tensors += other.tensors
        self.weights += other.weights
        self.original_bytes += other.original_bytes
        self.stored_bytes += other.stored_bytes
        self.dtypes += [d for d in other.dtypes if d not in self.dtypes]
        self.codecs += [c for c in other.codecs if c not in self.codecs]
        for mine, theirs in ((self._exp, other._exp), (self._bound, other._bound)):
            mine[0] += theirs[0]
            mine[1] += theirs[1]

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.stored_bytes / self.weights if self.weights else 0.0

    @property
    def exponent_entropy(self) -> float | None:
        return self._exp[0] / self._exp[1] if self._exp[1] else None

    @property
    def order0_bound(self) -> float | None:
        return self._bound[0] / self._bound[1] if self._bound[1] else None

    @property
    def gap_to_bound(self) -> float | None:
        return (
            None
            if self.order0_bound is None or self._bound[1] != self.weights
            else self.bits_per_weight - self.order0_bound
        )

    def to_json(self) -> dict:
        return {
            "tensor_class": self.tensor_class,
            "layer_type": self.layer_type,
            "dtypes": self.dtypes,
            "codecs": self.codecs,
            "tensors": self.tensors,
            "weights": self.weights,
            "original_bytes": self.original_bytes,
            "stored_bytes": self.stored_bytes,
            "bits_per_weight": self.bits_per_weight,
            "exponent_entropy": self.exponent_entropy,
            "order0_bound": self.order0_bound,
            "gap_to_bound": self.gap_to_bound,
        }


def group(stats: list[TensorStats]) -> list[GroupStats]:
    """The statistics by layer type, in class order (attention, mlp, embeddings, other), the
    largest types first within a class."""
    groups: dict[str, GroupStats] = {}
    for s in stats:
        key = layer_type(s.name)
        g = groups.get(key)
        if g is None:
            g = groups[key] = GroupStats(s.tensor_class, key, [], [])
        g.add(s, int(np.prod(s.shape, dtype=np.int64)) if s.shape else 1)
    order = {c: i for i, c in enumerate(CLASS_ORDER)}
    return sorted(groups.values(), key=lambda g: (order[g.tensor_class], -g.original_bytes, g.layer_type))
