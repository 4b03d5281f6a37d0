"""Reading a container's tensors: one whole, or several in order, each in pieces or whole, on
threads (what the reader, inspect, verify and decompress share)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from unweight import memory
from unweight.codec import decode_tensor
from unweight.codec.parallel import default_threads, map_in_order
from unweight.codec.pieces import check_streams, decode_pieces
from unweight.errors import FormatError, MemoryLimitError
from unweight.formats import ContainerReader

# Tensors above this many bytes are encoded or decoded one at a time, their chunks shared out among
# the threads; smaller ones, whose few chunks leave threads idle, go several at once, one thread each.
PARALLEL_TENSOR_BYTES = 8 << 20
INLINE_TENSOR_BYTES = 64 << 10


def decode_one(
    reader: ContainerReader, name: str, threads: int | None = None, max_memory: int | None = None
) -> np.ndarray:
    """One tensor's original bytes, whole (new memory); FormatError subclasses name the file and
    tensor on damage. MemoryLimitError refuses a tensor over the budget (max_memory, else available
    memory), but only once its streams pass check_streams: a damaged file is called damaged, not too
    big. Within the budget the decode's own checks come before its allocation, so the streams are
    not checked twice (which was a third of inspect's time on 100k small tensors)."""
    entry = reader.tensors[name]
    streams = reader.streams_of(entry)
    try:
        try:
            memory.require(entry.nbytes, max_memory, "decoding it whole", reader.path, name)
        except MemoryLimitError:
            check_streams(entry, streams)
            raise
        return decode_tensor(entry, streams, threads)
    except FormatError as e:
        raise type(e)(reader.path, e.reason, name) from None
    finally:
        for view in streams.values():  # raw tensors are returned as views: their pages stay
            if entry.codec != "raw":
                memory.release(view)


def _pieces_of(reader: ContainerReader, name: str, threads: int | None, piece_bytes: int) -> Iterator[np.ndarray]:
    entry = reader.tensors[name]
    streams = reader.streams_of(entry)
    try:
        yield from decode_pieces(entry, streams, piece_bytes, threads)
    except FormatError as e:
        raise type(e)(reader.path, e.reason, name) from None
    finally:
        for view in streams.values():  # its mapped pages leave the resident set (a verify of a whole
            memory.release(view)  # checkpoint would otherwise end holding all of it)


def decode_in_order(
    reader: ContainerReader, names: list[str], threads: int | None, piece_bytes: int = memory.PIECE_BYTES
) -> Iterator[tuple[str, Callable[[], Iterator[np.ndarray]]]]:
    """(name, get) for each name in order, where get() returns an iterator of the tensor's bytes
    in consecutive pieces, each valid until the next, or raises its FormatError (naming file and
    tensor), possibly partway. Tensors over PARALLEL_TENSOR_BYTES run alone on all threads, in
    pieces of at most piece_bytes (codec.pieces); on more than one thread, smaller ones are decoded
    ahead of the consumer, several at once (parallel.map_in_order), whole, into their own memory."""
    threads = threads or default_threads()

    def decode(name: str, inner: int) -> Iterator[np.ndarray]:
        if reader.tensors[name].nbytes > PARALLEL_TENSOR_BYTES:
            return _pieces_of(reader, name, inner, piece_bytes)
        return iter((decode_one(reader, name, inner),))

    yield from map_in_order(
        decode,
        names,
        threads,
        lambda name: reader.tensors[name].nbytes > PARALLEL_TENSOR_BYTES,
        lambda name: reader.tensors[name].nbytes <= INLINE_TENSOR_BYTES,
    )
