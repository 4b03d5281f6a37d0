"""One tensor in, a manifest entry and its streams out (and back): codec choice and checks.

Codecs (SPEC.md §3): `rans` for floats of 1, 2 or 4 bytes, and for integers byte by byte (1-byte
dtypes, and wider ones such as compressed-tensors' INT4 codes packed eight to an I32), `zstd` for
the rest, `raw` when nothing pays. Every tensor carries the CRC-32 of its original bytes, checked on
every decode, and the CRC-32 of each stored stream (`check_stream_crcs`), checked where streams are
used as stored, without a decode (`unweight.load`) and by `verify`.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import zstandard

from unweight import memory
from unweight.errors import CorruptDataError
from unweight.formats import TensorEntry
from unweight.formats.dtypes import FLOAT_DTYPES, tensor_nbytes

from . import rans, tiles
from .checksum import crc32
from .entries import ROLES, _rans_word, _transposable, check_entry, rans_params, transposed, untranspose
from .pieces import decode_pieces

LAYOUTS = ("archive", "serving")
SMALL_TENSOR_BYTES = 1 << 18  # below this, every candidate is tried and the smallest kept
SMALL_PRECISIONS = (10, 12, 14)
TINY_TENSOR_BYTES = 1 << 13  # biases and norms: one rans precision, then zstd and raw
VERIFY_PIECE_BYTES = 32 << 20  # encode_tensor's check decodes this much at a time
ZSTD_PROBE_LEVEL, ZSTD_PROBE_MARGIN = 1, 1.1  # zstd at the configured level only if level 1 is this close


@dataclass(frozen=True, slots=True)
class CodecOptions:
    """How to compress; validated on construction."""

    precision: int = rans.DEFAULT_PRECISION
    chunk: int = rans.DEFAULT_CHUNK  # the most elements a chunk holds (rans.chunk_for picks the size)
    zstd_level: int = 10
    threads: int | None = None  # None or 0: all CPUs
    verify: bool = True  # decode each tensor again before accepting it
    layout: str = "archive"  # "serving": 2-D BF16 weights in the fixed-rate `tiles` codec

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        rans.RansParams.for_word(16, True, self.precision, self.chunk)  # raises ValueError if bad
        if not 1 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level {self.zstd_level!r} is outside 1..22")
        if self.threads is not None and self.threads < 0:
            raise ValueError(f"threads {self.threads!r} is negative")


def _stream_names(name: str, codec: str) -> dict[str, str]:
    return {role: f"{name}#{role}" for role in ROLES[codec]}


_local = threading.local()  # zstd contexts are costly to create and not thread-safe to share


def _zstd_compressor(level: int) -> zstandard.ZstdCompressor:
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


def _zstd_encode(data: np.ndarray, level: int) -> np.ndarray:
    return np.frombuffer(_zstd_compressor(level).compress(memoryview(data)), dtype=np.uint8)


def _zstd_decode(blob: np.ndarray, nbytes: int) -> np.ndarray:
    """Exactly one frame of exactly `nbytes`; memory follows the bytes actually produced, never
    the size a hostile frame claims."""
    params = zstandard.get_frame_parameters(memoryview(blob))
    if params.content_size != nbytes:
        raise ValueError(f"zstd frame declares {params.content_size} bytes, the tensor has {nbytes}")
    reader = zstandard.ZstdDecompressor().stream_reader(memoryview(blob), read_across_frames=False)
    pieces, size = [], 0
    while size <= nbytes:
        piece = reader.read(1 << 20)
        if not piece:
            break
        pieces.append(piece)
        size += len(piece)
    if size != nbytes:
        raise ValueError(f"zstd frame holds {size} bytes, the tensor has {nbytes}")
    tail = zstandard.ZstdDecompressor().decompressobj()
    tail.decompress(memoryview(blob))
    if tail.unused_data:
        raise ValueError(f"{len(tail.unused_data)} stray bytes after the zstd frame")
    return np.frombuffer(b"".join(pieces), dtype=np.uint8)


def _candidates(dtype: str, shape: tuple[int, ...], data: np.ndarray, opts: CodecOptions, transpose: bool = False):
    """Yield (codec, params-json, streams) for each codec worth trying on this tensor. In the
    serving layout a 2-D BF16 weight gets `tiles` and nothing else: kernels need its fixed rate.
    With `transpose` (a 3-D float tensor), rans codes it in the order of its last two dimensions
    swapped."""
    nbytes = len(data)
    if opts.layout == "serving" and tiles.applies(dtype, shape):
        p, streams = tiles.encode(data.view(np.uint16), shape[0], shape[1])
        yield "tiles", p.to_json(), streams
        return
    if nbytes == 0:
        yield "raw", {}, {"data": data}
        return
    small = nbytes <= SMALL_TENSOR_BYTES
    word = _rans_word(dtype)
    rans_size = nbytes
    transpose = transpose and _transposable(dtype, shape)
    if word is not None:
        values = data.view(rans.UINT_OF_BITS[word[0]])
        if transpose:
            values = np.ascontiguousarray(values.reshape(shape).swapaxes(-1, -2)).reshape(-1)
        if nbytes <= TINY_TENSOR_BYTES:  # the table dominates: the smallest precision wins
            precisions = (rans.PRECISION_RANGE[0],)
        elif small:
            precisions = sorted({*SMALL_PRECISIONS, opts.precision})
        else:
            precisions = (opts.precision,)
        counts = None
        n = len(values)
        chunk = rans.chunk_for(n, opts.chunk)
        for precision in precisions:
            p = rans.RansParams.for_word(word[0], word[1], precision, chunk)
            if counts is None:
                counts = rans.symbol_counts(values, p, opts.threads)
                memory.release(data)
            streams = rans.encode(values, p, opts.threads, counts)
            rans_size = min(rans_size, sum(len(s) for s in streams.values()))
            yield "rans", p.to_json() | ({"transpose": True} if transpose else {}), streams
    if word is None or small or dtype not in FLOAT_DTYPES:
        # Integers (INT4 codes packed in I32) have no float's fixed split, and zstd's matches may
        # catch what an order-0 model cannot; the probe below keeps its cost low. On trained weights
        # zstd loses to rans, and its slow levels cost more than the rans candidates together, so a
        # level-1 pass decides whether the configured level could win. On 690 slices
        # (16-250 KiB) of MiniLM and SmolLM2 weights zstd-10 beat rans 3 times, level 1 then within
        # 9.4 % of rans; level 1 is at most 14 % above level 10, so a skipped win is under 4 %.
        if (
            word is None
            or nbytes <= TINY_TENSOR_BYTES
            or len(_zstd_encode(data, ZSTD_PROBE_LEVEL)) < ZSTD_PROBE_MARGIN * rans_size
        ):
            yield "zstd", {}, {"data": _zstd_encode(data, opts.zstd_level)}
    yield "raw", {}, {"data": data}


def encode_tensor(
    name: str, dtype: str, shape: tuple[int, ...], data: np.ndarray, opts: CodecOptions, transpose: bool = False
) -> tuple[TensorEntry, dict[str, np.ndarray]]:
    """Compress one tensor given as its original bytes (uint8, C order); picks the smallest codec.

    With opts.verify, the chosen encoding is decoded again and compared byte for byte. With
    `transpose`, a rans candidate codes a 3-D float tensor in the order of its last two dimensions
    swapped (what `compress` asks for Llama 4's fused gate_up experts).
    """
    data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if len(data) != tensor_nbytes(dtype, shape):
        raise ValueError(f"tensor {name!r}: {len(data)} bytes given for {dtype}{list(shape)}")
    crc = crc32(data)
    memory.release(data)  # a file mapping's pages (else nothing): each pass below reads its own
    best = None
    for codec, params, streams in _candidates(dtype, tuple(shape), data, opts, transpose):
        size = sum(len(s) for s in streams.values())
        if best is None or size < best[0]:
            best = (size, codec, params, streams)
    _, codec, params, streams = best
    stream_crc = {role: crc32(_stream_bytes(s)) for role, s in streams.items()}
    entry = TensorEntry(name, dtype, tuple(shape), codec, params, _stream_names(name, codec), crc, stream_crc)
    if opts.verify and codec != "raw":
        at = 0  # decoded piece by piece against the original: no second whole tensor in memory
        for piece in decode_pieces(entry, streams, VERIFY_PIECE_BYTES, opts.threads):
            if not np.array_equal(piece, data[at : at + len(piece)]):
                raise AssertionError(f"tensor {name!r}: {codec} round trip is not bit-exact (a bug; please report it)")
            memory.release(data[at : at + len(piece)])
            at += len(piece)
    return entry, streams


def _stream_bytes(s) -> np.ndarray | bytes:
    """A stream as the container writer stores it: its bytes, flat."""
    return np.ascontiguousarray(s).reshape(-1).view(np.uint8) if isinstance(s, np.ndarray) else s


def check_stream_crcs(entry: TensorEntry, streams: dict[str, np.ndarray], path=None) -> int:
    """Check each stored stream against its CRC-32 in the manifest (format 1.1); returns the bytes
    checked, or -1 when the entry carries no stream CRCs (a 1.0 container: only a decode, with the
    CRC of the original bytes, checks it). Raises CorruptDataError naming `path`, the tensor and
    the stream. This is a CRC of the stored bytes (several GB/s), far cheaper than a decode."""
    if entry.stream_crc32 is None:
        return -1
    checked = 0
    for role, want in entry.stream_crc32.items():
        data = _stream_bytes(streams[role])
        if crc32(data) != want:
            raise CorruptDataError(
                path, f"stream {entry.streams[role]!r} fails its CRC-32 check (the file is damaged)", entry.name
            )
        checked += len(data)
    return checked


@lru_cache(maxsize=1)
def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX: no cap
        return 1 << 62


def decode_tensor(
    entry: TensorEntry,
    streams: dict[str, np.ndarray],
    threads: int | None = None,
    verify: bool = True,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The original bytes of one tensor (uint8, C order). Raises CorruptDataError on any damage.

    With `out` (entry.nbytes writable uint8, aligned to 8 bytes), the bytes are decoded into it and
    `out` is returned: a caller that decodes tensor after tensor (the runtime's linears) reuses one
    buffer instead of faulting in fresh memory for each, which cost from a tenth to half of the
    decode time on the VM of docs/compression.md. On an error `out` holds partial bytes."""
    nbytes = entry.nbytes
    if out is not None and (
        out.dtype != np.uint8
        or out.shape != (nbytes,)
        or not out.flags.writeable
        or not out.flags.c_contiguous
        or (nbytes and out.ctypes.data % 8)
    ):
        raise TypeError(f"out must be {nbytes} writable, contiguous uint8 bytes aligned to 8")
    if nbytes > _physical_memory():  # a small hostile file can claim a huge constant tensor
        raise CorruptDataError(None, f"{nbytes} bytes exceed this machine's memory", entry.name)
    data, in_place = _decode(entry, nbytes, streams, threads, out)
    if out is not None:
        if not in_place:
            out[:] = data
        data = out
    if verify and crc32(data) != entry.crc32:
        raise CorruptDataError(None, "decoded bytes fail the CRC-32 check (the file is damaged)", entry.name)
    return data


def _decode(
    entry: TensorEntry,
    nbytes: int,
    streams: dict[str, np.ndarray],
    threads: int | None,
    out: np.ndarray | None,
    chunks: np.ndarray | None = None,
) -> tuple[np.ndarray, bool]:
    """decode_tensor's work without the CRC check: (the bytes, whether rans decoded them into
    `out`). `nbytes` is entry.nbytes, which the callers have computed already. With `chunks`
    (rans only), only those chunks are decoded. Errors name the tensor."""
    in_place = False  # rans decodes into `out` itself; the other codecs' bytes are copied there
    try:
        check_entry(entry, streams)
        if entry.codec == "rans":
            p, n = rans_params(entry)
            if chunks is None and transposed(entry):
                coded = rans.decode(streams, p, n, threads).view(np.uint8)
                data = untranspose(coded, entry, entry.shape[0])
            else:  # (with chunks, in coded order: decode_rows puts them back)
                into = None if out is None else out.view(rans.UINT_OF_BITS[p.word_bits])
                data = rans.decode(streams, p, n, threads, into, chunks).view(np.uint8)
                in_place = out is not None
        elif entry.codec == "raw":
            data = np.asarray(streams["data"], dtype=np.uint8)
        elif entry.codec == "zstd":
            data = _zstd_decode(streams["data"], nbytes)
        else:
            p = tiles.TilesParams.from_json(entry.params)
            data = tiles.decode(streams, p, entry.shape[0], entry.shape[1]).view(np.uint8)
    except CorruptDataError as e:
        raise CorruptDataError(None, e.reason, entry.name) from None
    except (ValueError, TypeError, zstandard.ZstdError) as e:
        raise CorruptDataError(None, str(e), entry.name) from None
    except MemoryError:
        raise CorruptDataError(None, f"{nbytes} bytes do not fit in memory", entry.name) from None
    return data, in_place


def _tiles_rows(entry: TensorEntry, streams: dict[str, np.ndarray], ids: np.ndarray) -> np.ndarray:
    """decode_rows of a tiles tensor: rows min(ids)..max(ids), decoded as one range."""
    r0, r1 = int(ids.min()), int(ids.max()) + 1
    try:
        check_entry(entry, streams)
        d = tiles.Decoder(streams, tiles.TilesParams.from_json(entry.params), *entry.shape)
        out = np.empty((r1 - r0) * entry.shape[1], dtype=np.uint16)
        d.run(r0, r1, out)
    except CorruptDataError as e:
        raise CorruptDataError(None, e.reason, entry.name) from None
    except (ValueError, TypeError) as e:
        raise CorruptDataError(None, str(e), entry.name) from None
    return out.view(np.uint8).reshape(r1 - r0, -1)[ids - r0]


def decode_rows(
    entry: TensorEntry, streams: dict[str, np.ndarray], ids: np.ndarray, threads: int | None = None
) -> np.ndarray:
    """Rows `ids` (integers in [0, shape[0])) of a tensor, as a (len(ids), bytes per row) uint8
    array, for lookups such as an embedding's: a `rans` tensor decodes only the chunks that hold
    those rows (an embedding row of SmolLM2 lies in one or two of its 432 chunks), where
    decode_tensor would decode all of them; a `tiles` tensor decodes only the rows from the first
    id to the last. Each chunk or row decoded is checked as decode_tensor checks it, but the
    CRC-32, which covers the whole tensor, is not; other codecs decode the whole tensor, CRC
    included. Raises CorruptDataError on damage, ValueError on bad ids."""
    if len(entry.shape) == 0 or entry.shape[0] == 0:
        raise ValueError(f"tensor {entry.name!r} of shape {list(entry.shape)} has no rows")
    rows = entry.shape[0]
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        raise ValueError(f"row ids must lie in [0, {rows})")
    nbytes = entry.nbytes
    if entry.codec == "tiles" and len(ids) and nbytes <= _physical_memory():
        return _tiles_rows(entry, streams, ids)
    if entry.codec != "rans" or nbytes > _physical_memory():
        return decode_tensor(entry, streams, threads).reshape(rows, -1)[ids]
    try:
        p, words = rans_params(entry)
    except (ValueError, TypeError) as e:
        raise CorruptDataError(None, str(e), entry.name) from None
    chunk, per_row = p.chunk, words // rows
    first, last = ids * per_row // chunk, ((ids + 1) * per_row - 1) // chunk
    span = int((last - first).max()) + 1 if len(ids) else 0
    chunks = np.unique((first[:, None] + np.arange(span)[None, :]).clip(max=last[:, None]))
    data, _ = _decode(entry, nbytes, streams, threads, None, chunks)
    if transposed(entry):  # each row is a matrix, coded transposed
        return untranspose(data.reshape(rows, -1)[ids], entry, len(ids)).reshape(len(ids), -1)
    return data.reshape(rows, -1)[ids]
