"""A validating, memory-mapped safetensors reader and a streaming safetensors writer.

Both the checkpoints we compress and our own containers are safetensors files, so both are read
through `SafetensorsFile`, which trusts nothing in the header (SPEC.md §4, rules 1-3).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import operator
import os
import stat
import struct
import weakref
from collections.abc import Callable, Iterable
from typing import BinaryIO, NamedTuple

import numpy as np

from .dtypes import MAX_TENSOR_BYTES, tensor_nbytes
from .errors import FormatError

MAX_HEADER_BYTES = 64 << 20  # 64 MiB: real headers are kilobytes, a hostile one can claim exabytes
HEADER_ALIGN = 8
RESERVED_NAME = "__metadata__"  # the header key of the metadata: no tensor may have this name
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}
_SPAN = operator.itemgetter(3, 4)  # a TensorInfo's (begin, end)

# Observers of the files SafetensorsFile maps (unweight/mapguard.py, which names a file that
# shrinks while mapped instead of dying of SIGBUS): each is called as observer(path, address,
# length) in the thread that maps, right after the mapping is made and before any of it is read,
# and may return a callable that is then called once when the mapping goes (closed, or freed with
# the last view of it). An observer must not raise.
MAP_OBSERVERS: list[Callable[[str, int, int], Callable[[], None] | None]] = []


class TensorInfo(NamedTuple):
    """One header entry: where a tensor's bytes lie in the data section (a named tuple, which
    builds in a third of a frozen dataclass's time: a container's header has 4 entries a tensor)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offset into the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def parse_header(path: str, raw: bytes, data_len: int) -> tuple[dict[str, TensorInfo], dict[str, str] | None]:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise FormatError(path, f"header is not valid UTF-8 JSON ({e.__class__.__name__}: {e})") from None
    if not isinstance(header, dict):
        raise FormatError(path, "header is not a JSON object")
    metadata = header.pop(RESERVED_NAME, None)
    if metadata is not None and (
        not isinstance(metadata, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise FormatError(path, "__metadata__ must map strings to strings")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():  # (a container has 4 entries a tensor: this loop is kept lean)
        if type(entry) is not dict or entry.keys() != _ENTRY_KEYS:
            raise FormatError(path, "header entry must have exactly dtype, shape, data_offsets", name)
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if type(shape) is not list:
            raise FormatError(path, f"shape {shape!r} is not a list", name)
        if dtype == "U8" and len(shape) == 1 and type(shape[0]) is int and 0 <= shape[0] <= MAX_TENSOR_BYTES:
            nbytes = shape[0]  # a stream: tensor_nbytes' answer without the call
        else:
            try:
                nbytes = tensor_nbytes(dtype, shape)
            except ValueError as e:
                raise FormatError(path, str(e), name) from None
        if type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int or type(offsets[1]) is not int:
            raise FormatError(path, f"data_offsets {offsets!r} is not a pair of integers", name)
        begin, end = offsets
        if not 0 <= begin <= end <= data_len:
            raise FormatError(path, f"data_offsets {offsets} lie outside the {data_len}-byte data section", name)
        if end - begin != nbytes:
            raise FormatError(path, f"data_offsets span {end - begin} bytes but {dtype}{shape} needs {nbytes}", name)
        tensors[name] = TensorInfo(name, dtype, tuple(shape), begin, end)
    # Rule 3: the entries tile the data section, no gaps and no overlaps.
    cursor = 0
    for t in sorted(tensors.values(), key=_SPAN):
        if t.begin != cursor:
            what = "overlaps the previous tensor" if t.begin < cursor else f"leaves a gap at byte {cursor}"
            raise FormatError(path, f"data_offsets [{t.begin}, {t.end}] {what}", t.name)
        cursor = t.end
    if cursor != data_len:
        raise FormatError(path, f"tensors cover {cursor} bytes but the data section has {data_len}")
    return tensors, metadata


def declared_header_bytes(path: str | os.PathLike) -> int:
    """The header size a safetensors file declares in its first 8 bytes, unchecked (0 if it cannot
    be read): a cheap measure of how many tensors a file holds, for planning work, not for parsing."""
    try:
        with open_regular(os.fspath(path)) as f:
            head = f.read(8)
    except (FormatError, OSError):
        return 0
    return struct.unpack("<Q", head)[0] if len(head) == 8 else 0


def read_raw_header(f: BinaryIO, path: str) -> bytes:
    """The header (its JSON with the padding) of the safetensors file open as `f`, read from its
    start; FormatError for a file too short, a length over MAX_HEADER_BYTES or past the file's end."""
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise FormatError(path, f"file is {size} bytes, too short to be safetensors (truncated?)")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > MAX_HEADER_BYTES:
        raise FormatError(path, f"header claims {n} bytes, over the {MAX_HEADER_BYTES}-byte cap")
    if 8 + n > size:
        raise FormatError(path, f"header claims {n} bytes but the file has {size - 8} after the length (truncated?)")
    raw = f.read(n)
    if len(raw) != n:  # the file shrank under us
        raise FormatError(path, f"header claims {n} bytes but only {len(raw)} could be read (truncated?)")
    return raw


def file_header_digest(path: str | os.PathLike) -> str:
    """digest_header of the safetensors file at `path`, reading its header only."""
    with open_regular(os.fspath(path)) as f:
        return digest_header(read_raw_header(f, os.fspath(path)))


def digest_header(raw: bytes) -> str:
    """ "sha256:" and the hex SHA-256 of a safetensors header (its 8-byte length, then `raw`, the
    JSON with its padding): a container's header holds every tensor's CRC-32 and its streams'."""
    return "sha256:" + hashlib.sha256(struct.pack("<Q", len(raw)) + raw).hexdigest()


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words, from its st_mode."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str) -> BinaryIO:
    """`path` opened for binary reading, refused with FormatError unless it is a regular file.
    The open does not block: a FIFO (which a plain open would wait on forever) is refused too."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise FormatError(path, f"cannot open: {e.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise FormatError(path, f"not a regular file ({file_kind(mode)})")
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


class SafetensorsFile:
    """A safetensors file, validated on open and memory-mapped; tensors come out as uint8 views.

    Use as a context manager, or call `close()`; views taken from it die with the mapping.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._file: BinaryIO = open_regular(self.path)
        try:
            self._open()
        except BaseException:
            self._file.close()
            raise

    def _open(self) -> None:
        size = os.fstat(self._file.fileno()).st_size
        raw = read_raw_header(self._file, self.path)
        n = len(raw)
        self.header_digest = digest_header(raw)  # of the header this mapping's tensors are read by
        try:
            self.header_text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise FormatError(self.path, f"header is not valid UTF-8 ({e.reason} at byte {e.start})") from None
        self.data_start = 8 + n
        self.tensors, self.metadata = parse_header(self.path, raw, size - self.data_start)
        self._mmap = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = np.frombuffer(self._mmap, dtype=np.uint8)
        self._unmapped = _announce_mapping(self.path, self._mmap, self._buf) if MAP_OBSERVERS else None

    def bytes_of(self, name: str) -> np.ndarray:
        """The raw bytes of tensor `name`, a read-only uint8 view into the mapping (no copy)."""
        t = self.tensors[name]
        return self._buf[self.data_start + t.begin : self.data_start + t.end]

    def close(self) -> None:
        buf = getattr(self, "_buf", None)
        self._buf = None
        if buf is not None:
            del buf
            try:
                self._mmap.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes when it does
            else:
                if self._unmapped is not None:
                    self._unmapped()  # (a finalizer runs once: not again when the mmap object is freed)
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _announce_mapping(path: str, mapping: mmap.mmap, buf: np.ndarray) -> weakref.finalize | None:
    """Tell MAP_OBSERVERS that `path` is mapped at buf's address; the finalizer returned (None if
    no observer asked) tells them it went: called by close(), else run when the mmap is freed."""
    goodbyes = [g for observe in MAP_OBSERVERS if (g := observe(path, buf.ctypes.data, len(mapping))) is not None]
    if not goodbyes:
        return None
    done = weakref.finalize(mapping, _call_each, goodbyes)
    done.atexit = False  # at exit the mappings stay registered until they are really gone
    return done


def _call_each(fns: list[Callable[[], None]]) -> None:
    for fn in fns:
        fn()


def encode_header(entries: Iterable[tuple[str, str, list[int], int, int]], metadata: dict[str, str] | None) -> bytes:
    """The padded header bytes (without the 8-byte length) for (name, dtype, shape, begin, end) rows."""
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, begin, end in entries:
        if name == RESERVED_NAME:
            raise ValueError(
                "a tensor may not be named '__metadata__': safetensors reserves that key for the file's metadata"
            )
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return raw + b" " * (-len(raw) % HEADER_ALIGN)


def safetensors_header(
    entries: list[tuple[str, str, list[int]]], metadata: dict[str, str] | None = None, header_text: str | None = None
) -> bytes:
    """The header bytes (without the 8-byte length) write_safetensors writes for these arguments:
    `header_text` as it is, else the (name, dtype, shape) entries' data back to back, in order."""
    if header_text is not None:
        return header_text.encode("utf-8")
    rows, cursor = [], 0
    for name, dtype, shape in entries:
        n = tensor_nbytes(dtype, shape)
        rows.append((name, dtype, shape, cursor, cursor + n))
        cursor += n
    return encode_header(rows, metadata)


def write_safetensors(
    out: BinaryIO,
    entries: list[tuple[str, str, list[int]]],
    data: Iterable[bytes | memoryview | np.ndarray],
    metadata: dict[str, str] | None = None,
    header_text: str | None = None,
) -> None:
    """Write a safetensors file to the open binary `out`, streaming one tensor at a time.

    `entries` are (name, dtype, shape) in data order and `data` yields each one's bytes in that
    order (whole, or an iterator of consecutive pieces), so a caller can decode lazily. With
    `header_text`, that exact header is written instead of one built from `entries` (a
    byte-identical reconstruction): the caller has checked that it lists the same tensors and that
    `entries` follow its offsets.
    """
    head = safetensors_header(entries, metadata, header_text)
    out.write(struct.pack("<Q", len(head)))
    out.write(head)
    for (name, dtype, shape), blob in zip(entries, data, strict=True):
        # a tensor's bytes come whole, or as an iterator of consecutive pieces (each written
        # before the next is asked for: a decoder can reuse one buffer)
        size = 0
        for piece in (blob,) if isinstance(blob, (bytes, bytearray, memoryview, np.ndarray)) else blob:
            view = (
                np.ascontiguousarray(piece).reshape(-1).view(np.uint8)
                if isinstance(piece, np.ndarray)
                else memoryview(piece).cast("B")
            )
            size += len(view)
            if size > tensor_nbytes(dtype, shape):
                break
            out.write(view.data if isinstance(view, np.ndarray) else view)
        if size != tensor_nbytes(dtype, shape):
            raise ValueError(f"tensor {name!r}: got {size} bytes for {dtype}{list(shape)}")
