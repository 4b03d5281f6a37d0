"""Whole checkpoints: compress, decompress and verify Hugging Face folders (sharded or not). What
a folder holds is folder.py's; reading tensors is decoding.py's (the reader imports those two,
not this module).

A compressed checkpoint mirrors its source folder: every `*.safetensors` file becomes an Unweight
container of the same name, and every other file (config, tokenizer, the shard index) is copied as
is: the index stays valid because shard file names and tensor names do not change. One file is
added: the member list (folder.MEMBERS_NAME), which lists the containers with their header digests,
so that readers take the folder as one model or refuse it. Outputs are built in a hidden sibling
folder and renamed into place at the end, so an interrupted run never leaves a folder that looks
complete.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Protocol

try:
    import fcntl
except ImportError:  # not POSIX: stale staging folders are recognised by their PID alone
    fcntl = None

import numpy as np

from unweight import memory
from unweight.codec import CodecOptions, check_stream_crcs, encode_tensor
from unweight.codec.parallel import map_in_order
from unweight.codec.pieces import check_streams
from unweight.errors import DestinationError, FormatError, SourceError
from unweight.formats import ContainerReader, ContainerWriter, SafetensorsFile, write_safetensors
from unweight.formats.safetensors_file import parse_header, safetensors_header

from . import hf_config
from .decoding import INLINE_TENSOR_BYTES, PARALLEL_TENSOR_BYTES, decode_in_order
from .folder import (
    MEMBERS_NAME,
    check_members,
    check_source,
    containers_of,
    member_problems,
    read_index,
    walk,
    write_members,
)
from .report import CompressReport, TensorReport, VerifyReport

# Memory a tensor takes while it is encoded, its mapped source pages included, as a multiple of
# its size: benchmarks/memory_bench.py measures what compress really peaks at.
ENCODE_MEMORY_FACTOR = 1.5
# Tensors that `rans` codes in the order of their last two dimensions swapped (SPEC.md §3.3), by
# name: Llama 4's fused gate_up experts (E, H, 2I), which tensor parallelism splits along 2I, so
# that a rank's rows of gate and of up decode alone (its down_proj (E, I, H) splits along I, the
# stored rows already).
TRANSPOSED = re.compile(r"(^|\.)feed_forward\.experts\.gate_up_proj$")


class Progress(Protocol):
    """What the library reports while it works (the CLI draws bars from it; None ignores it)."""

    def start(self, total_bytes: int) -> None: ...

    def advance(self, label: str, nbytes: int) -> None: ...


class _NoProgress:
    def start(self, total_bytes: int) -> None:
        pass

    def advance(self, label: str, nbytes: int) -> None:
        pass


PARTIAL_INFIX = ".partial-"  # staging folders are ".DST.partial-PID", next to DST


@contextmanager
def _staging(dst: Path, verb: str = "writing") -> Iterator[Path]:
    """A hidden sibling folder `.DST.partial-PID` that becomes `dst` only if the block finishes.

    The folder is removed when the block raises (KeyboardInterrupt included; the CLI turns SIGTERM
    and SIGHUP into one). A process killed outright (SIGKILL, power loss) cannot clean up: the next
    run to the same destination removes such a folder once its process is gone (_remove_stale).
    While a run lives it holds an flock on its folder, so no other run removes it. A write that
    finds the device full (or the quota spent) is a DestinationError naming `dst`.
    """
    if dst.exists():
        raise DestinationError(f"{dst}: already exists; choose a new destination or remove it first")
    parent = dst.parent if str(dst.parent) else Path(".")
    if not parent.is_dir():
        raise DestinationError(f"{parent}: the destination's parent folder does not exist")
    _remove_stale(parent, dst.name)
    tmp = parent / f".{dst.name}{PARTIAL_INFIX}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # this pid's own leftover (a reused pid): no one else's
    tmp.mkdir()
    lock = _lock(tmp)
    try:
        try:
            yield tmp
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # first: the free space reported is then the destination's
            raise _no_space(dst, parent, verb, e) from None
        if dst.exists():
            raise DestinationError(
                f"{dst}: appeared while {verb} (another run, or someone else, wrote it); this run's output was removed"
            )
        try:
            os.replace(tmp, dst)
        except OSError as e:
            if dst.exists():  # created between the check and the rename
                raise DestinationError(
                    f"{dst}: appeared while {verb} (another run, or someone else, wrote it); this run's output was "
                    f"removed"
                ) from None
            raise DestinationError(f"{dst}: cannot move the finished output into place: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            os.close(lock)


def _no_space(dst: Path, parent: Path, verb: str, e: OSError) -> DestinationError:
    """The error for a write that found the destination's device full or the user's quota spent: it
    names `dst`, not the file inside the staging folder (or the source file being copied) that
    the OSError names."""
    why = "no space left on the device" if e.errno == errno.ENOSPC else "no space left: disk quota exceeded"
    try:
        free = f"; {parent} has {_size_text(shutil.disk_usage(parent).free)} free without this run's output"
    except OSError:
        free = ""
    return DestinationError(f"{dst}: {why} while {verb}{free}")


def _lock(folder: Path) -> int | None:
    """An open descriptor of `folder` holding an exclusive flock (released by the kernel when the
    process dies, however it dies), or None where flock is not available."""
    if fcntl is None:
        return None
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _remove_stale(parent: Path, name: str) -> None:
    """Remove `.NAME.partial-PID` folders left by runs that are gone: the PID is not a live process
    here and no process holds the folder's flock. A live run's folder (and anything not named so,
    or not ours to remove) is left alone."""
    prefix = f".{name}{PARTIAL_INFIX}"
    try:
        candidates = [p for p in parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return
    for p in candidates:
        pid = p.name[len(prefix) :]
        if not pid.isdigit() or int(pid) == os.getpid() or _pid_alive(int(pid)) or p.is_symlink() or not p.is_dir():
            continue
        if fcntl is not None:
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: its run is alive (in another PID namespace, say)
                os.close(fd)
                continue
            try:
                shutil.rmtree(p, ignore_errors=True)
            finally:
                os.close(fd)
        else:
            shutil.rmtree(p, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # someone else's process, or not a pid at all: leave it alone
    return True


def compress(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    options: CodecOptions | None = None,
    progress: Progress | None = None,
    max_memory: int | None = None,
) -> CompressReport:
    """Compress a local Hugging Face folder (or one .safetensors file) into `dst`.

    `dst` must not exist. With options.verify (the default) every tensor is decoded again and
    compared with its original bytes before it is written. With max_memory, a tensor whose
    encoding would need more (ENCODE_MEMORY_FACTOR × its size, once more its size for a tensor
    coded transposed) is refused, MemoryLimitError, before anything is written.
    """
    memory.check_budget(max_memory)
    options = options or CodecOptions()
    progress = progress or _NoProgress()
    src, dst = Path(src), Path(dst)
    t0 = time.perf_counter()
    tensor_files, others, pickles = check_source(src)
    root = src if src.is_dir() else src.parent
    if Path(MEMBERS_NAME) in others:
        raise SourceError(f"{root / MEMBERS_NAME}: this folder is compressed already (decompress gives it back)")
    report = CompressReport(str(src), str(dst), skipped_files=[str(p) for p in pickles])
    if src.is_file() and dst.suffix == ".safetensors":
        raise DestinationError(f"{dst}: the destination is a folder; drop the .safetensors suffix")
    index = read_index(root) if src.is_dir() else None
    sources = [SafetensorsFile(root / f) for f in tensor_files]
    try:
        if index is not None:  # the index is copied as it is: the shards must hold what it lists
            index.check({f: sf.tensors for f, sf in zip(tensor_files, sources)})
        if max_memory is not None:
            for sf in sources:
                for t in sf.tensors.values():
                    factor = ENCODE_MEMORY_FACTOR + (1 if TRANSPOSED.search(t.name) else 0)  # (a transposed copy)
                    memory.require(int(factor * t.nbytes), max_memory, "compressing it", sf.path, t.name)
        progress.start(sum(t.nbytes for s in sources for t in s.tensors.values()))
        with _staging(dst, "compressing") as tmp:
            for rel, sf in zip(tensor_files, sources):
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                _compress_file(sf, tmp / rel, str(rel), options, progress, report)
                report.files_written += 1
                report.file_bytes_in += os.path.getsize(sf.path)
                report.file_bytes_out += os.path.getsize(tmp / rel)
            for rel in others:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(root / rel, tmp / rel)  # the shard index stays valid as it is
                if hf_config.is_config(tmp / rel, rel):  # the quantization_config that vLLM's plugin is picked by
                    data, note = hf_config.tag((root / rel).read_bytes())
                    (tmp / rel).write_bytes(data)
                    report.file_notes += [note] if note else []
                report.copied_files.append(str(rel))
            write_members(tmp, tensor_files)  # last: what the folder holds, as one model
    finally:
        for sf in sources:
            sf.close()
    report.seconds = time.perf_counter() - t0
    return report


def _compress_file(
    sf: SafetensorsFile, out: Path, rel: str, options: CodecOptions, progress: Progress, report: CompressReport
) -> None:
    def encode(info, inner: int):  # big tensors alone on every thread; small ones several at once
        transpose = TRANSPOSED.search(info.name) is not None
        data = sf.bytes_of(info.name)
        return encode_tensor(info.name, info.dtype, info.shape, data, replace(options, threads=inner), transpose)

    infos = sorted(sf.tensors.values(), key=lambda t: t.begin)
    with ContainerWriter(str(out)) as writer:
        for info, get in map_in_order(
            encode,
            infos,
            options.threads,
            lambda t: t.nbytes > PARALLEL_TENSOR_BYTES,
            lambda t: t.nbytes <= INLINE_TENSOR_BYTES,
        ):
            entry, streams = get()
            writer.add(entry, streams)
            memory.release(sf.bytes_of(info.name))  # its mapped source pages: a shard is not kept resident
            stored = sum(len(s) for s in streams.values())
            report.tensors.append(
                TensorReport(rel, info.name, info.dtype, list(info.shape), entry.codec, info.nbytes, stored)
            )
            progress.advance(f"{rel}: {info.name}", info.nbytes)
        writer.finish(source_header=sf.header_text)


def decompress(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    threads: int | None = None,
    progress: Progress | None = None,
    max_memory: int | None = None,
) -> int:
    """Write the original safetensors files (byte-identical where the source header was kept) and
    copy the other files; returns the number of tensors written. Large tensors are decoded and
    written in pieces (memory.piece_bytes(max_memory)), so memory does not follow tensor sizes."""
    progress = progress or _NoProgress()
    piece = memory.piece_bytes(memory.check_budget(max_memory))
    root, containers, others = containers_of(src)
    dst = Path(dst)
    index = read_index(root) if Path(src).is_dir() else None
    readers = [ContainerReader(root / c) for c in containers]
    count = 0
    try:
        if Path(src).is_dir():  # one model: no container of another one, no shard of another revision
            check_members(root, containers, index, digests={c: r.header_digest for c, r in zip(containers, readers)})
        if index is not None:  # the folder written must be the whole checkpoint, not what is left of it
            index.check({c: r.tensors for c, r in zip(containers, readers)})
        total = sum(e.nbytes for r in readers for e in r.tensors.values())
        _check_disk(dst, total + sum((root / rel).stat().st_size for rel in others), readers)
        progress.start(total)
        with _staging(dst, "decompressing") as tmp:
            for rel, reader in zip(containers, readers):
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                count += _decompress_file(reader, tmp / rel, str(rel), threads, progress, piece)
            for rel in others:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(root / rel, tmp / rel)
                if hf_config.is_config(tmp / rel, rel):  # the source's bytes, without compress's tag
                    (tmp / rel).write_bytes(hf_config.untag((root / rel).read_bytes()))
    finally:
        for r in readers:
            r.close()
    return count


def _check_disk(dst: Path, nbytes: int, readers: list[ContainerReader]) -> None:
    """Refuse before writing anything what the destination's file system cannot hold (a container
    may declare far more than it stores: a valid one of 1 KB can decode to terabytes). Streams
    that cannot produce what they declare are refused as corrupt first, whatever the disk; they
    are checked here only when the space is short (each tensor's decode checks them anyway).
    `nbytes` is the tensors' data and the copied files; each safetensors file's header is added here."""
    nbytes += sum(8 + _header_bytes(r) for r in readers)
    parent = dst.parent if str(dst.parent) else Path(".")
    if parent.is_dir():
        _remove_stale(parent, dst.name)  # what interrupted runs left there is not taken space
    try:
        free = shutil.disk_usage(parent).free
    except OSError:
        return  # no parent folder: _staging says so
    if nbytes > free:
        for reader in readers:
            for name, entry in reader.tensors.items():
                try:
                    check_streams(entry, reader.streams_of(entry))
                except FormatError as e:
                    raise type(e)(reader.path, e.reason, name) from None
        raise DestinationError(
            f"{dst}: the decompressed files need {_size_text(nbytes)}, and {parent} has {_size_text(free)} free"
        )


def _size_text(nbytes: int) -> str:
    """A disk size for a message: in GB from 1 GB, else in MB (a small disk is not "0.00 GB")."""
    return f"{nbytes / 1e9:,.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:,.2f} MB"


def _header_bytes(reader: ContainerReader) -> int:
    """The length of the header `_decompress_file` writes for `reader`, without its 8-byte length:
    the stored source header, else the one write_safetensors builds (the tensors by name, their
    data back to back, no metadata)."""
    entries = [(name, e.dtype, list(e.shape)) for name, e in sorted(reader.tensors.items())]
    return len(safetensors_header(entries, None, reader.source_header))


def _source_layout(reader: ContainerReader) -> list[str]:
    """Tensor names in the order of the source file's data, after checking that the stored source
    header describes exactly the manifest's tensors (SPEC.md §2)."""
    if reader.source_header is None:
        return sorted(reader.tensors)
    raw = reader.source_header.encode("utf-8")
    data_len = sum(e.nbytes for e in reader.tensors.values())
    try:
        infos, _ = parse_header(reader.path, raw, data_len)
    except FormatError as e:
        raise FormatError(reader.path, f"stored source header is invalid: {e.reason}", e.tensor) from None
    if set(infos) != set(reader.tensors):
        odd = sorted(set(infos) ^ set(reader.tensors))[0]
        raise FormatError(reader.path, "stored source header and manifest list different tensors", odd)
    for name, info in infos.items():
        e = reader.tensors[name]
        if (info.dtype, info.shape) != (e.dtype, e.shape):
            raise FormatError(
                reader.path,
                f"source header says {info.dtype}{list(info.shape)}, manifest {e.dtype}{list(e.shape)}",
                name,
            )
    return [t.name for t in sorted(infos.values(), key=lambda t: t.begin)]


def _decompress_file(
    reader: ContainerReader, out: Path, rel: str, threads: int | None, progress: Progress, piece_bytes: int
) -> int:
    order = _source_layout(reader)
    entries = [reader.tensors[n] for n in order]

    def blobs() -> Iterator[Iterator[np.ndarray]]:  # each piece is written before the next reuses its buffer
        for name, get in decode_in_order(reader, order, threads, piece_bytes):
            yield _advancing(get(), progress, f"{rel}: {name}")

    tmp_out = Path(f"{out}.partial")
    try:
        with open(tmp_out, "wb") as f:
            write_safetensors(
                f,
                [(e.name, e.dtype, list(e.shape)) for e in entries],
                blobs(),
                metadata=None,
                header_text=reader.source_header,
            )
        os.replace(tmp_out, out)
    except BaseException:
        tmp_out.unlink(missing_ok=True)
        raise
    return len(entries)


def _advancing(pieces: Iterator[np.ndarray], progress: Progress, label: str) -> Iterator[np.ndarray]:
    for piece in pieces:
        yield piece
        progress.advance(label, len(piece))


def verify(
    path: str | os.PathLike,
    against: str | os.PathLike | None = None,
    threads: int | None = None,
    progress: Progress | None = None,
    max_memory: int | None = None,
) -> VerifyReport:
    """Decode every tensor and check its CRC-32; with `against` (the original folder or file),
    also compare every tensor's bytes, dtype and shape, and every copied file's bytes. Large
    tensors are checked in pieces (memory.piece_bytes(max_memory)): no whole-tensor buffer."""
    progress = progress or _NoProgress()
    piece = memory.piece_bytes(memory.check_budget(max_memory))
    root, containers, others = containers_of(path)
    report = VerifyReport()
    orig_root = None
    if against is not None:
        against = Path(against)
        if not against.exists():
            raise SourceError(f"{against}: no such file or folder")
        orig_root = against if against.is_dir() else against.parent
        if against.is_file():
            containers = [c for c in containers if c.name == against.name] or containers
    index = read_index(root) if Path(path).is_dir() else None
    readers = [ContainerReader(root / c) for c in containers]
    try:
        if index is not None:  # a partial download: its missing shards and tensors are mismatches
            report.mismatches, report.missing = index.problems({c: r.tensors for c, r in zip(containers, readers)})
        # and containers of another model or another compress
        whole = Path(path).is_dir() and not (against is not None and against.is_file())
        digests = {c: r.header_digest for c, r in zip(containers, readers)}
        lines, report.vouched = member_problems(root, containers, index, whole, digests)
        report.mismatches += lines
        progress.start(sum(e.nbytes for r in readers for e in r.tensors.values()))
        for rel, reader in zip(containers, readers):
            original = None
            if orig_root is not None:
                opath = orig_root / rel
                if not opath.exists():
                    report.mismatches.append(f"{rel}: missing from {orig_root}")
                    continue
                original = SafetensorsFile(opath)
            try:
                _verify_file(reader, original, str(rel), threads, progress, report, piece)
            finally:
                if original is not None:
                    original.close()
            report.checked_files += 1
    finally:
        for r in readers:
            r.close()
    if orig_root is not None and Path(path).is_dir():
        for rel in others:
            o = orig_root / rel
            ours = (root / rel).read_bytes()
            if hf_config.is_config(root / rel, rel):
                ours = hf_config.untag(ours)
            if not o.is_file() or o.read_bytes() != ours:  # is_file: a FIFO would hang
                report.mismatches.append(f"{rel}: differs from {o}")
        for rel in walk(orig_root):
            if rel.suffix == ".safetensors" and not (root / rel).exists():
                report.mismatches.append(f"{rel}: in {orig_root} but not compressed")
    return report


def _check_stream_crcs(reader: ContainerReader, entry) -> None:
    """The tensor's stored streams against their CRC-32s (format 1.1), their pages then unmapped."""
    streams = reader.streams_of(entry)
    try:
        check_stream_crcs(entry, streams, reader.path)
    finally:
        for view in streams.values():
            memory.release(view)


def _verify_file(
    reader: ContainerReader,
    original: SafetensorsFile | None,
    rel: str,
    threads: int | None,
    progress: Progress,
    report: VerifyReport,
    piece_bytes: int,
) -> None:
    if original is not None:
        missing = sorted(set(original.tensors) - set(reader.tensors))
        extra = sorted(set(reader.tensors) - set(original.tensors))
        for name in missing:
            report.mismatches.append(f"{rel}: tensor {name!r} is missing from the compressed file")
        for name in extra:
            report.mismatches.append(f"{rel}: tensor {name!r} is not in the original")
    for name, get in decode_in_order(reader, list(reader.tensors), threads, piece_bytes):
        entry = reader.tensors[name]
        ob = None
        if original is not None and name in original.tensors:
            o = original.tensors[name]
            if (o.dtype, o.shape) != (entry.dtype, entry.shape):
                report.mismatches.append(
                    f"{rel}: tensor {name!r} is {entry.dtype}{list(entry.shape)}, the original {o.dtype}{list(o.shape)}"
                )
            else:
                ob = original.bytes_of(name)
        at, differs = 0, None
        try:
            _check_stream_crcs(reader, entry)  # what load checks, where it keeps the streams as stored
            for data in get():  # CRC-32 checked inside, after the last piece
                if ob is not None and differs is None:
                    part = ob[at : at + len(data)]
                    if not np.array_equal(part, data):
                        differs = at + int(np.flatnonzero(part != data)[0])
                    memory.release(part)  # the original's mapped pages, once compared
                at += len(data)
                progress.advance(f"{rel}: {name}", len(data))
        except FormatError as e:
            report.mismatches.append(str(e))
            continue
        if differs is not None:
            report.mismatches.append(f"{rel}: tensor {name!r} differs from the original at byte {differs}")
        report.checked_tensors += 1
        report.checked_bytes += entry.nbytes
