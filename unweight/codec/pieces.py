"""A tensor's original bytes in pieces: what verify, inspect and decompress read.

`decode_pieces` yields the bytes of one tensor front to back, a piece at a time, each decoded
into a buffer of at most `piece_bytes` that the next piece reuses, and checks the CRC-32 over
them as they go: memory stays a few pieces whatever size a file declares (a 31 KB container of
one rANS symbol declares 3 GiB, and is valid). Whole-tensor decode_tensor is its oracle.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import zstandard

from unweight.errors import CorruptDataError
from unweight.formats import TensorEntry

from . import rans, tiles
from .checksum import crc32
from .entries import check_entry, rans_params, transposed, untranspose


def decode_pieces(
    entry: TensorEntry,
    streams: dict[str, np.ndarray],
    piece_bytes: int,
    threads: int | None = None,
    verify: bool = True,
) -> Iterator[np.ndarray]:
    """Consecutive uint8 pieces of the tensor's original bytes, together exactly entry.nbytes;
    each valid until the next is asked for. The streams are checked before the first piece; the
    CRC-32 after the last (with `verify`). Raises CorruptDataError naming the tensor."""
    crc, total = 0, 0
    try:
        check_entry(entry, streams)
        for piece in _pieces(entry, streams, piece_bytes, threads):
            if verify:
                crc = crc32(piece, crc)
            total += len(piece)
            yield piece
    except CorruptDataError as e:
        raise CorruptDataError(None, e.reason, entry.name) from None
    except (ValueError, TypeError, zstandard.ZstdError) as e:
        raise CorruptDataError(None, str(e), entry.name) from None
    if total != entry.nbytes:
        raise CorruptDataError(None, f"decoded {total} bytes, the tensor has {entry.nbytes}", entry.name)
    if verify and crc != entry.crc32:
        raise CorruptDataError(None, "decoded bytes fail the CRC-32 check (the file is damaged)", entry.name)


def check_streams(entry: TensorEntry, streams: dict[str, np.ndarray]) -> None:
    """The checks a decode makes before it allocates anything of the declared size (stream
    lengths, tables, chunk offsets, a zstd frame's declared size), without decoding: a caller
    then allocates only for streams that can produce the tensor. Raises CorruptDataError."""
    try:
        check_entry(entry, streams)
        if entry.codec == "rans":
            rans.Decoder(streams, *rans_params(entry))
        elif entry.codec == "tiles":
            tiles.Decoder(streams, tiles.TilesParams.from_json(entry.params), *entry.shape)
        elif entry.codec == "zstd":
            size = zstandard.get_frame_parameters(memoryview(np.asarray(streams["data"], dtype=np.uint8))).content_size
            if size != entry.nbytes:
                raise ValueError(f"zstd frame declares {size} bytes, the tensor has {entry.nbytes}")
    except CorruptDataError as e:
        raise CorruptDataError(None, e.reason, entry.name) from None
    except (ValueError, TypeError, zstandard.ZstdError) as e:
        raise CorruptDataError(None, str(e), entry.name) from None


def _pieces(
    entry: TensorEntry, streams: dict[str, np.ndarray], piece_bytes: int, threads: int | None
) -> Iterator[np.ndarray]:
    nbytes = entry.nbytes
    if entry.codec == "raw":
        data = np.asarray(streams["data"], dtype=np.uint8)
        for at in range(0, nbytes, piece_bytes):
            yield data[at : at + piece_bytes]
    elif entry.codec == "zstd":
        yield from _zstd_pieces(streams["data"], nbytes, piece_bytes)
    elif entry.codec == "rans":
        p, n = rans_params(entry)
        d = rans.Decoder(streams, p, n)
        if transposed(entry):
            yield from _transposed_pieces(entry, d, p, n, piece_bytes, threads)
            return
        size = p.word_bits // 8
        # whole groups of chunks per piece, so the vector decoder never runs a chunk alone
        group = rans.rans_avx2.MAX_GROUP
        per = max(group, piece_bytes // (size * p.chunk) // group * group)
        buf = np.empty(min(d.nchunks, per) * p.chunk, dtype=rans.UINT_OF_BITS[p.word_bits])
        for c0 in range(0, d.nchunks, per):
            c1 = min(d.nchunks, c0 + per)
            out = buf[: min(c1 * p.chunk, n) - c0 * p.chunk]
            d.run(c0, c1, out, threads)
            yield out.view(np.uint8)
    else:
        p = tiles.TilesParams.from_json(entry.params)
        rows, cols = entry.shape
        d = tiles.Decoder(streams, p, rows, cols)
        per = max(1, piece_bytes // (2 * cols))
        buf = np.empty(min(rows, per) * cols, dtype=np.uint16)
        for r0 in range(0, rows, per):
            r1 = min(rows, r0 + per)
            out = buf[: (r1 - r0) * cols]
            d.run(r0, r1, out)
            yield out.view(np.uint8)


ZSTD_MAX_RATIO = 1 << 15  # a zstd block of 128 KiB can be coded in 4 bytes (an RLE block)


def _zstd_pieces(blob: np.ndarray, nbytes: int, piece_bytes: int) -> Iterator[np.ndarray]:
    """One frame of exactly `nbytes`, fed to the decoder a little input at a time so that no call
    makes more than about `piece_bytes`: memory follows the piece size, never the size the frame
    claims. The same checks as tensor_codec._zstd_decode: declared size, size, no stray bytes."""
    params = zstandard.get_frame_parameters(memoryview(blob))
    if params.content_size != nbytes:
        raise ValueError(f"zstd frame declares {params.content_size} bytes, the tensor has {nbytes}")
    dobj = zstandard.ZstdDecompressor().decompressobj()
    data = memoryview(np.asarray(blob, dtype=np.uint8))
    step = max(64, piece_bytes // ZSTD_MAX_RATIO)
    size = 0
    for at in range(0, len(data), step):
        if dobj.eof:
            raise ValueError(f"{len(data) - at + len(dobj.unused_data)} stray bytes after the zstd frame")
        got = dobj.decompress(data[at : at + step])
        if got:
            size += len(got)
            if size > nbytes:
                raise ValueError(f"zstd frame holds more than the tensor's {nbytes} bytes")
            yield np.frombuffer(got, dtype=np.uint8)
    if dobj.unused_data:
        raise ValueError(f"{len(dobj.unused_data)} stray bytes after the zstd frame")
    if size != nbytes or not dobj.eof:
        raise ValueError(f"zstd frame holds {size} bytes, the tensor has {nbytes}")


def _transposed_pieces(
    entry: TensorEntry, d: rans.Decoder, p: rans.RansParams, n: int, piece_bytes: int, threads: int | None
) -> Iterator[np.ndarray]:
    """A transposed entry's bytes, whole matrices at a time (as many as fit in `piece_bytes`, at
    least one: SPEC.md §3.3 bounds a matrix): each is decoded from the chunks that hold it, then
    put back in the tensor's order."""
    per = entry.shape[-1] * entry.shape[-2]  # elements of a matrix
    matrices = n // per
    step = max(1, piece_bytes // (per * p.word_bits // 8))
    for m0 in range(0, matrices, step):
        m1 = min(matrices, m0 + step)
        c0, c1 = m0 * per // p.chunk, -(-m1 * per // p.chunk)
        buf = np.empty(min(c1 * p.chunk, n) - c0 * p.chunk, dtype=rans.UINT_OF_BITS[p.word_bits])
        d.run(c0, c1, buf, threads)
        at = m0 * per - c0 * p.chunk
        yield untranspose(buf[at : at + (m1 - m0) * per].view(np.uint8), entry, m1 - m0)
