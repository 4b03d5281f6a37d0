"""`unweight inspect`: per-tensor codec, sizes, exponent entropy and the gap to the order-0 bound."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import numpy as np

from .checkpoint import containers_of, decode_in_order, scratch_for
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


def tensor_stats(file: str, reader: ContainerReader, name: str, data: np.ndarray | None = None) -> TensorStats:
    """A tensor's statistics; `data`, its decoded bytes, is needed where _decodes() holds."""
    e = reader.tensors[name]
    stored = sum(len(reader.stream(s)) for s in e.streams.values())
    numel = e.numel
    bpw = 8 * stored / numel if numel else 0.0
    exp_h = bound = hist = None
    if _decodes(reader, name):
        if e.dtype in EXPONENT_FIELDS:
            word, shift, mask = EXPONENT_FIELDS[e.dtype]
            h = np.bincount((data.view(word) >> shift) & mask, minlength=mask + 1)
            exp_h, hist = entropy_bits(h), h.tolist()
        size = e.nbytes // numel
        if size <= 2:
            bound = entropy_bits(np.bincount(data.view(np.uint16 if size == 2 else np.uint8)))
    return TensorStats(file, name, e.dtype, list(e.shape), e.codec, e.nbytes, stored, bpw, exp_h, bound, hist)


def inspect(path: str | os.PathLike, threads: int | None = None) -> list[TensorStats]:
    """Statistics of every tensor of a compressed folder or file (decodes the float tensors)."""
    root, files, _ = containers_of(path)
    out: list[TensorStats] = []
    for rel in files:
        with ContainerReader(root / rel) as reader:
            decoded = decode_in_order(reader, [n for n in reader.tensors if _decodes(reader, n)], threads, scratch_for([reader]))
            for name in reader.tensors:  # the decoded ones come in this order too, each used before the next
                data = next(decoded)[1]() if _decodes(reader, name) else None
                out.append(tensor_stats(str(rel), reader, name, data))
    return out
