"""`unweight inspect`: per-tensor codec, sizes, exponent entropy and the gap to the order-0 bound."""

from __future__ import annotations

import gc
import multiprocessing
import os
import re
import signal
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from itertools import repeat
from pathlib import Path

import numpy as np
from numba import njit

from unweight.formats import DTYPE_BITS, ContainerReader, declared_header_bytes

from . import memory
from .codec.parallel import default_threads
from .decoding import decode_in_order
from .errors import UnweightError
from .folder import check_members, containers_of, read_index
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
    # int64 counts per exponent value, floats only: an array, not a list, so that 100k tensors' histograms
    # are 100k objects for the garbage collector to walk rather than 25M
    exponent_histogram: np.ndarray | None = field(default=None, repr=False)

    @property
    def gap_to_bound(self) -> float | None:
        """Stored bits/weight above the order-0 bound (None where no bound is computed)."""
        return None if self.order0_bound is None else self.bits_per_weight - self.order0_bound

    def to_json(self, histogram: bool = False) -> dict:
        d = {f: getattr(self, f) for f in _JSON_FIELDS}  # (asdict's deep copies cost a second at 100k tensors)
        d["shape"] = list(self.shape)
        if histogram:
            d["exponent_histogram"] = None if self.exponent_histogram is None else self.exponent_histogram.tolist()
        d["gap_to_bound"] = self.gap_to_bound
        return d


_JSON_FIELDS = [f.name for f in fields(TensorStats) if f.name != "exponent_histogram"]


def _decodes(reader: ContainerReader, name: str) -> bool:
    """Whether inspect decodes this tensor: floats (for the exponent) and 1- and 2-byte dtypes."""
    e = reader.tensors[name]
    return bool(e.numel) and (
        e.dtype in EXPONENT_FIELDS or DTYPE_BITS[e.dtype] in (8, 16)
    )  # not F4, F6: no whole-byte values


@njit(nogil=True, cache=True)
def _count(values, shift, mask, fields, words, seen, n_seen):
    """Add each element's (value >> shift) & mask to `fields` and, when `words` is not empty, the
    value itself to `words`, listing in seen[:n_seen] each value the first time it is counted;
    returns the new n_seen. No np.bincount copy of the input, and no pass over all 65,536 bins."""
    whole = len(words) > 0
    for v in values:
        fields[(v >> shift) & mask] += 1
        if whole:
            if words[v] == 0:
                seen[n_seen] = v
                n_seen += 1
            words[v] += 1
    return n_seen


@njit(nogil=True, cache=True)
def _entropy(counts, total):
    """Shannon entropy in bits per symbol of `counts` (which sum to total > 0)."""
    h = 0.0
    for c in counts:
        if c > 0:
            h += c * np.log2(total / c)
    return max(0.0, h / total)


@njit(nogil=True, cache=True)
def _entropy_of_seen(words, seen, n_seen, total):
    """_entropy of words[seen[:n_seen]], the only nonzero bins, which it sets back to zero."""
    h = 0.0
    for i in range(n_seen):
        c = words[seen[i]]
        h += c * np.log2(total / c)
        words[seen[i]] = 0
    return max(0.0, h / total)


class _Histograms:
    """Exponent and whole-value histograms, filled piece by piece, one tensor at a time: the
    65,536-bin whole-value histogram is allocated once and cleared bin by bin through the values
    seen, so a small tensor costs what its values cost (100k small tensors: 100k histograms)."""

    def __init__(self) -> None:
        self._words = {size: np.zeros(1 << (8 * size), dtype=np.int64) for size in (1, 2)}
        self._seen = {size: np.zeros(1 << (8 * size), dtype=np.int64) for size in (1, 2)}

    def start(self, dtype: str) -> None:
        """Begin a tensor of `dtype` (one that _decodes() takes)."""
        self.size = DTYPE_BITS[dtype] // 8  # whole bytes: _decodes() leaves out F4 and F6
        self.exponent = dtype in EXPONENT_FIELDS
        self.word, self.shift, self.mask = (
            EXPONENT_FIELDS[dtype] if self.exponent else ({1: np.uint8, 2: np.uint16}[self.size], 0, 0)
        )
        self.fields = np.zeros(self.mask + 1, dtype=np.int64)
        self.words = self._words.get(self.size, self._words[1][:0])
        self.seen = self._seen.get(self.size, self._seen[1][:0])
        self.n_seen = self.total = 0

    def add(self, piece: np.ndarray) -> None:
        values = piece.view(self.word)
        self.n_seen = _count(values, self.shift, self.mask, self.fields, self.words, self.seen, self.n_seen)
        self.total += len(values)

    def finish(self) -> tuple[float | None, np.ndarray | None, float | None]:
        """(exponent entropy, exponent histogram, order-0 bound) of the tensor, in bits per weight;
        None where the dtype has no exponent or values too wide for a whole-value histogram."""
        exp = (_entropy(self.fields, self.total), self.fields) if self.exponent else (None, None)
        bound = _entropy_of_seen(self.words, self.seen, self.n_seen, self.total) if len(self.words) else None
        return (*exp, bound)


def tensor_stats(file: str, reader: ContainerReader, name: str, hist: _Histograms | None = None) -> TensorStats:
    """A tensor's statistics; `hist`, filled from its decoded bytes, is needed where _decodes() holds."""
    e = reader.tensors[name]
    stored = reader.stored_bytes(e)
    numel = e.numel
    bpw = 8 * stored / numel if numel else 0.0
    exp_h, hists, bound = hist.finish() if _decodes(reader, name) else (None, None, None)
    return TensorStats(file, name, e.dtype, list(e.shape), e.codec, e.nbytes, stored, bpw, exp_h, bound, hists)


# inspect reads a checkpoint's files in worker processes, one file each at a time, when their headers
# (which grow with the tensor count: ~100 bytes a stream, 4 streams a tensor) add up to this much: its
# work per tensor is Python's and holds the GIL, and a worker costs ~0.4 s to start.
PARALLEL_HEADER_BYTES = 4 << 20


def inspect(
    path: str | os.PathLike, threads: int | None = None, max_memory: int | None = None, processes: int = 1
) -> list[TensorStats]:
    """Statistics of every tensor of a compressed folder or file (decodes the float tensors, in
    pieces of memory.piece_bytes(max_memory): no whole-tensor buffer). With processes > 1, a
    checkpoint of many files and tensors is read by up to that many spawned worker processes,
    which share the threads and max_memory. The CLI asks for as many as threads; the default is 1
    because a spawned worker imports the caller's main module, which a script without an
    `if __name__ == "__main__":` guard would then run again."""
    budget = memory.check_budget(max_memory)
    root, files, _ = containers_of(path)
    index = read_index(root) if Path(path).is_dir() else None
    if index is not None:  # a missing shard is named before anything is decoded
        index.check_files()
    check_members(root, files, index, whole=Path(path).is_dir())  # no container of another model or compress
    stats = _inspect_files(root, files, threads or default_threads(), budget, processes)
    if index is not None:  # the shards hold what the index lists, no more and no less
        held: dict[Path, list[str]] = {Path(rel): [] for rel in files}
        for s in stats:
            held[Path(s.file)].append(s.name)
        index.check(held)
    return stats


def _inspect_files(
    root: Path, files: list[Path], threads: int, budget: int | None, processes: int
) -> list[TensorStats]:
    workers = min(processes, threads, len(files))
    if budget is not None:
        workers = min(workers, budget // memory.MIN_PIECE_BYTES)
    if workers < 2 or sum(declared_header_bytes(root / rel) for rel in files) < PARALLEL_HEADER_BYTES:
        return [s for rel in files for s in _inspect_file(root, rel, threads, budget)]
    share = (max(1, threads // workers), None if budget is None else budget // workers)
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_start)
    try:
        with _collector_paused():  # (unpickling the workers' results makes as many objects as they did)
            parts = pool.map(_inspect_file, repeat(root), files, *map(repeat, share))
            out = [s for part in parts for s in part]  # in file order; the first file's error in that order
    except BrokenProcessPool:
        raise UnweightError("an inspect worker process died (out of memory?); --threads 1 reads in this one") from None
    except BaseException:  # an error, or Ctrl-C: the others' files are not waited for
        _stop(pool)
        raise
    pool.shutdown()
    return out


def _inspect_file(root: Path, rel: Path, threads: int, max_memory: int | None) -> list[TensorStats]:
    """The statistics of the tensors of the container root / rel, in its order."""
    out: list[TensorStats] = []
    hist = _Histograms()
    with _collector_paused(), ContainerReader(root / rel) as reader:
        piece = memory.piece_bytes(max_memory)
        decoded = decode_in_order(reader, [n for n in reader.tensors if _decodes(reader, n)], threads, piece)
        for name in reader.tensors:  # the decoded ones come in this order too, each used before the next
            if _decodes(reader, name):
                hist.start(reader.tensors[name].dtype)
                for data in next(decoded)[1]():
                    hist.add(data)
            out.append(tensor_stats(str(rel), reader, name, hist))
    return out


def _worker_start() -> None:
    """A worker leaves Ctrl-C to the process that started it, which stops it (no traceback from each)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _stop(pool: ProcessPoolExecutor) -> None:
    """Shut the pool down without waiting for the files its workers are reading."""
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in list((getattr(pool, "_processes", None) or {}).values()):  # (no public way before 3.14)
        proc.terminate()


@contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the duration (and back as it was): inspect makes no
    cycles, but its headers, manifests and results are millions of objects that each full
    collection walks again: a third of the time at 100k tensors."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


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
