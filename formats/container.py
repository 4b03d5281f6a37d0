"""The Unweight container (SPEC.md §1-2): streams in a safetensors file, described by a manifest.

`ContainerReader` validates the container-level rules (format name and version, manifest shape,
stream references) and hands out streams as uint8 views; what a codec's streams mean is checked by
the codec layer. `ContainerWriter` writes each stream once into `PATH.partial`, puts the header
before the data on `finish()` and renames the file into place only when complete.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .dtypes import tensor_nbytes
from .errors import FormatError
from .safetensors_file import MAX_HEADER_BYTES, RESERVED_NAME, SafetensorsFile, encode_header

FORMAT_NAME = "unweight"
FORMAT_VERSION = "2.1"  # 1.1 added per-stream CRC-32s; 2.0 placeholders; 2.1 integers in rans (SPEC.md §5)
SUPPORTED_MAJORS = (1, 2)
_VERSION_RE = re.compile(r"([0-9]{1,4})\.([0-9]{1,4})")


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One original tensor as the manifest describes it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    codec: str
    params: dict[str, Any]
    streams: dict[str, str]  # role -> stream name
    crc32: int
    # role -> CRC-32 of the stored stream bytes (format 1.1; None in containers written before)
    stream_crc32: dict[str, int] | None = None
    nbytes: int = field(init=False, repr=False, compare=False)  # the original bytes' size
    numel: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Computed once: readers ask for them several times per tensor, and checkpoints hold 100k tensors.
        object.__setattr__(self, "nbytes", tensor_nbytes(self.dtype, self.shape))
        numel = 1
        for d in self.shape:
            numel *= d
        object.__setattr__(self, "numel", numel)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape), "codec": self.codec}
        if self.params:
            out["params"] = self.params
        out["streams"] = self.streams
        out["crc32"] = self.crc32
        if self.stream_crc32 is not None:
            out["stream_crc32"] = self.stream_crc32
        return out


def _is_crc(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 32


def _entry_from_json(path: str, name: str, obj: Any) -> TensorEntry:
    def bad(msg: str) -> FormatError:
        return FormatError(path, msg, name)

    if name == RESERVED_NAME:
        raise bad(
            "a tensor may not be named __metadata__: safetensors reserves that key, so the file decompressed from it "
            "would not load"
        )
    if not isinstance(obj, dict):
        raise bad("manifest entry is not an object")
    if not _ENTRY_KEYS <= obj.keys():
        raise bad(f"manifest entry lacks {next(k for k in _ENTRY_KEYS_ORDER if k not in obj)!r}")
    shape = obj["shape"]
    if type(shape) is not list:
        raise bad(f"shape {shape!r} is not a list")
    if not isinstance(obj["codec"], str):
        raise bad("codec is not a string")
    params = obj.get("params", {})
    if not isinstance(params, dict):
        raise bad("params is not an object")
    streams = obj["streams"]
    if type(streams) is not dict or not all(type(k) is str and type(v) is str for k, v in streams.items()):
        raise bad("streams must map role names to stream names")
    crc = obj["crc32"]
    if not _is_crc(crc):
        raise bad(f"crc32 {crc!r} is not a 32-bit unsigned integer")
    stream_crc = obj.get("stream_crc32")
    if stream_crc is not None:
        if not isinstance(stream_crc, dict) or set(stream_crc) != set(streams):
            raise bad(f"stream_crc32 must map exactly the roles {sorted(streams)} to CRC-32s")
        odd = [r for r, v in stream_crc.items() if not _is_crc(v)]
        if odd:
            raise bad(f"stream_crc32 of role {odd[0]!r}, {stream_crc[odd[0]]!r}, is not a 32-bit unsigned integer")
        stream_crc = dict(stream_crc)
    try:  # (the entry checks dtype and shape as it computes its size)
        return TensorEntry(name, obj["dtype"], tuple(shape), obj["codec"], params, dict(streams), crc, stream_crc)
    except ValueError as e:
        raise bad(str(e)) from None


_ENTRY_KEYS_ORDER = ("dtype", "shape", "codec", "streams", "crc32")
_ENTRY_KEYS = frozenset(_ENTRY_KEYS_ORDER)


class ContainerReader:
    """An open Unweight container: `tensors` (the manifest) and `stream(name)` (zero-copy bytes)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._file = SafetensorsFile(self.path)
        try:
            self._validate()
        except BaseException:
            self._file.close()
            raise

    def _validate(self) -> None:
        meta = self._file.metadata or {}
        if meta.get("format") != FORMAT_NAME:
            raise FormatError(
                self.path, "not an Unweight container (a plain safetensors file? its metadata has no format=unweight)"
            )
        version = meta.get("format_version", "")
        m = _VERSION_RE.fullmatch(version) if isinstance(version, str) else None
        if not m:
            raise FormatError(self.path, f"format_version {version!r} is not MAJOR.MINOR")
        if int(m.group(1)) not in SUPPORTED_MAJORS:
            known = ", ".join(f"{v}.x" for v in SUPPORTED_MAJORS)
            raise FormatError(
                self.path, f"format version {version} is not supported (this reader knows {known}); upgrade unweight"
            )
        self.format_version = version
        try:
            manifest = json.loads(meta.get("unweight", ""))
        except (ValueError, RecursionError) as e:  # JSONDecodeError, too-long integers, deep nesting
            raise FormatError(self.path, f"manifest is not valid JSON ({e})") from None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("tensors"), dict):
            raise FormatError(self.path, "manifest has no 'tensors' object")
        self.tensors: dict[str, TensorEntry] = {
            name: _entry_from_json(self.path, name, obj) for name, obj in manifest["tensors"].items()
        }
        src = manifest.get("source_header")
        if src is not None and not isinstance(src, str):
            raise FormatError(self.path, "source_header is neither a string nor null")
        self.source_header: str | None = src
        # Every stream referenced exactly once, every reference resolves.
        used: dict[str, str] = {}
        infos = self._file.tensors
        for entry in self.tensors.values():
            for role, stream in entry.streams.items():
                info = infos.get(stream)
                if info is None:
                    raise FormatError(self.path, f"stream {stream!r} (role {role!r}) is missing", entry.name)
                if stream in used:
                    raise FormatError(
                        self.path, f"stream {stream!r} is also used by tensor {used[stream]!r}", entry.name
                    )
                used[stream] = entry.name
                if info.dtype != "U8" or len(info.shape) != 1:
                    raise FormatError(self.path, f"stream {stream!r} is not a 1-D U8 tensor", entry.name)
        if len(used) != len(
            infos
        ):  # every stream used is in the file: the rest are placeholders or belong to no tensor
            for name in sorted(set(infos) - set(used)):
                info = infos[name]
                if name not in self.tensors:
                    raise FormatError(self.path, f"stream {name!r} belongs to no tensor")
                if info.dtype != "U8" or info.shape != (0,):
                    raise FormatError(
                        self.path, f"the placeholder of tensor {name!r} is {info.dtype}{list(info.shape)}, not U8[0]"
                    )

    def stream(self, name: str) -> np.ndarray:
        return self._file.bytes_of(name)

    def stored_bytes(self, entry: TensorEntry) -> int:
        """The bytes of the tensor's streams in the file."""
        return sum(self._file.tensors[s].nbytes for s in entry.streams.values())

    def streams_of(self, entry: TensorEntry) -> dict[str, np.ndarray]:
        return {role: self._file.bytes_of(s) for role, s in entry.streams.items()}

    @property
    def header_digest(self) -> str:
        """The SHA-256 of the header this reader reads the file by (safetensors_file.digest_header)."""
        return self._file.header_digest

    @property
    def file_size(self) -> int:
        return os.path.getsize(self.path)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ContainerReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class ContainerWriter:
    """Builds a container at `path`; nothing appears at `path` until `finish()` succeeds.

    Each stream is written once, to `PATH.partial`, as it is added (so a shard never sits in
    memory whole, and the disk never holds its data twice): from the file's start, since the
    header's length is known only at the end. `finish()` moves the data up by the header's size,
    writes the header before it, fsyncs and renames the file into place: the disk needs room for
    the finished file and nothing more.

    Every even-length stream starts at an even offset of the data section (and the data section
    at a multiple of 8), so readers can view uint16 streams without a copy. Odd-length streams
    are held back, by reference, and written together once an even number of them holds at least
    _HOLD_BYTES or _HOLD_STREAMS (an even number of odd lengths adds up to an even length), the
    rest at the end: memory holds at most _HOLD_BYTES and one stream more than the caller's, and a
    small container comes out as it always has, its even-length streams first, then the odd-length
    ones.
    """

    path: str
    _entries: list[TensorEntry] = field(default_factory=list)
    # [name, begin, end] in the data section, in the order added (the header's); a held stream's
    # begin and end are set when it is written
    _streams: list[list] = field(default_factory=list)
    _names: set[str] = field(default_factory=set)
    _tensor_names: set[str] = field(default_factory=set)
    _HOLD_BYTES = 16 << 20  # (class constants, not fields)
    _HOLD_STREAMS = 1024
    _MOVE_BYTES = 16 << 20  # bytes moved at a time by finish()

    def __post_init__(self) -> None:
        self.path = os.fspath(self.path)
        self._partial = f"{self.path}.partial"
        self._file = open(self._partial, "w+b")  # w+: finish() reads the data back to move it
        self._size = 0  # bytes of the data section written so far
        self._held: list[tuple[list, memoryview]] = []  # odd-length streams not yet written
        self._held_bytes = 0

    def add(self, entry: TensorEntry, streams: dict[str, bytes | np.ndarray]) -> None:
        """Record one tensor: its manifest entry and the bytes of each of its streams by role.
        The bytes must not change until `finish()`: an odd-length stream may be written only then."""
        if entry.name in self._tensor_names:
            raise ValueError(f"tensor {entry.name!r} added twice")
        if entry.name == RESERVED_NAME:
            raise ValueError(
                "a tensor may not be named '__metadata__': safetensors reserves that key for the file's metadata"
            )
        if set(streams) != set(entry.streams):
            raise ValueError(f"tensor {entry.name!r}: stream roles {sorted(streams)} != {sorted(entry.streams)}")
        for role, blob in streams.items():
            name = entry.streams[role]
            if name in self._names:
                raise ValueError(f"stream name {name!r} is used twice (a tensor name collides with a stream name)")
            self._names.add(name)
            view = memoryview(
                np.ascontiguousarray(blob).reshape(-1).view(np.uint8) if isinstance(blob, np.ndarray) else blob
            ).cast("B")
            row = [name, 0, 0]
            self._streams.append(row)
            if view.nbytes % 2 == 0:
                self._write(row, view)
            else:
                self._hold(row, view)
        self._tensor_names.add(entry.name)
        self._entries.append(entry)

    def _hold(self, row: list, view: memoryview) -> None:
        self._held.append((row, view))
        self._held_bytes += view.nbytes
        if len(self._held) % 2 == 0 and (self._held_bytes >= self._HOLD_BYTES or len(self._held) >= self._HOLD_STREAMS):
            self._write_held()

    def _write_held(self) -> None:
        for row, view in self._held:
            self._write(row, view)
        self._held, self._held_bytes = [], 0

    def _write(self, row: list, view: memoryview) -> None:
        self._file.write(view)
        row[1:] = self._size, self._size + view.nbytes
        self._size += view.nbytes

    def finish(self, source_header: str | None = None) -> int:
        """Assemble the file; returns its size in bytes."""
        self._write_held()  # (nothing even-length follows them)
        manifest = {
            "tensors": {e.name: e.to_json() for e in self._entries},
            "source_header": source_header,
        }
        metadata = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "unweight": json.dumps(manifest, separators=(",", ":")),
        }
        rows = [(n, "U8", [e - b], b, e) for n, b, e in self._streams]
        # Each tensor's placeholder (SPEC.md §1): an empty entry under the tensor's own name, so that a
        # reader that takes the file for a plain checkpoint finds every tensor with the wrong shape
        # and fails, instead of missing them all and loading a model of random weights.
        rows += [(e.name, "U8", [0], 0, 0) for e in self._entries if e.name not in self._names]
        head = encode_header(rows, metadata)  # padded to 8 bytes: the data section starts 8-aligned
        if len(head) > MAX_HEADER_BYTES:  # readers would refuse the file: say so now, not when it is opened
            self.abort()
            raise FormatError(
                self.path,
                f"its header would be {len(head):,} bytes for {len(self._entries):,} tensors, over the "
                f"{MAX_HEADER_BYTES:,}-byte cap that readers apply: split the tensors over several files (shards)",
            )
        self._file.flush()
        fd = self._file.fileno()
        self._move_data_up(fd, 8 + len(head))
        self._pwrite_all(fd, struct.pack("<Q", len(head)) + head, 0)
        os.fsync(fd)
        self._file.close()
        os.replace(self._partial, self.path)
        return 8 + len(head) + self._size

    def _move_data_up(self, fd: int, by: int) -> None:
        """Move the data section from offset 0 to offset `by`, last piece first (the two ranges
        overlap): the file grows by `by` bytes, never by a second copy of the data."""
        end = self._size
        while end > 0:
            begin = max(0, end - self._MOVE_BYTES)
            piece = os.pread(fd, end - begin, begin)
            if len(piece) != end - begin:
                raise OSError(f"{self._partial}: read {len(piece)} bytes at {begin}, expected {end - begin}")
            self._pwrite_all(fd, piece, begin + by)
            end = begin

    @staticmethod
    def _pwrite_all(fd: int, data: bytes, at: int) -> None:
        """`data` written at offset `at`, all of it (one pwrite may write less)."""
        view = memoryview(data)
        while view:
            n = os.pwrite(fd, view, at)
            view, at = view[n:], at + n

    def abort(self) -> None:
        """Remove everything this writer created."""
        self._held, self._held_bytes = [], 0
        try:
            self._file.close()
        except OSError:  # what it buffered did not fit (a full disk): the file goes anyway
            pass
        try:
            os.remove(self._partial)
        except FileNotFoundError:
            pass

    def __enter__(self) -> ContainerWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.abort()
