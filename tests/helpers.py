"""Helpers the tests share: small checkpoints written with our own writer, the CLI as a process."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import torch

from unweight.formats import write_safetensors
from unweight.tensors import tensor_bytes


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> Path:
    """A safetensors file of torch tensors written with our own writer (any dtype)."""
    entries, blobs = [], []
    for name in sorted(tensors):
        dtype, shape, data = tensor_bytes(tensors[name])
        entries.append((name, dtype, list(shape)))
        blobs.append(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        write_safetensors(f, entries, blobs, metadata=metadata)
    return path


def random_bf16(*shape: int, seed: int = 0, std: float = 0.02) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)


def run_cli(
    *args: str, cwd: Path | None = None, merged: bool = False, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run the real `unweight` console entry point in a separate process; with `merged`, stderr
    goes into the same pipe as stdout (as `2>&1` would), so the order of the two is kept."""
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "unweight.cli.main", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merged else subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )


def container_header(path: Path) -> tuple[int, dict]:
    """(header length, header JSON) of a safetensors file."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return n, json.loads(blob[8 : 8 + n])


def container_manifest(path: Path) -> dict:
    """The manifest's tensors of a container."""
    return json.loads(container_header(path)[1]["__metadata__"]["unweight"])["tensors"]


def flip_stream_byte(folder: Path, tensor: str, role: str, at: int = 0, mask: int = 0x01) -> Path:
    """XOR byte `at` of the stream (tensor, role) of the folder's model.safetensors with `mask`."""
    path = folder / "model.safetensors"
    n, header = container_header(path)
    stream = container_manifest(path)[tensor]["streams"][role]
    b, e = header[stream]["data_offsets"]
    assert 0 <= at < e - b
    blob = bytearray(path.read_bytes())
    blob[8 + n + b + at] ^= mask
    path.write_bytes(bytes(blob))
    return path


def fake_hub_cache(root: Path, repo_id: str, files_from: Path) -> None:
    """The layout huggingface_hub uses: models--org--name/{refs/main, snapshots/<commit>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(files_from, repo / "snapshots" / commit)


def shard_of(folder: Path, tensor: str) -> Path:
    """The container file of `folder` that holds `tensor` (by its index, else model.safetensors)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return folder / json.loads(index.read_text())["weight_map"][tensor]
    return folder / "model.safetensors"


def rewrite_container(path: Path, edit) -> None:
    """Write the container at `path` again, its tensors passed through `edit`: a function of
    {name: (TensorEntry, {role: stream bytes})} that returns such a dict (a crafted file: the
    CRCs are whatever the edit leaves them). The folder's member list, if it names the file, records
    the new header, as a hostile producer would write it: the list says which files make one
    folder, it seals nothing, and the checks behind it must hold alone."""
    from unweight.formats import ContainerReader, ContainerWriter

    with ContainerReader(path) as r:
        tensors = {n: (e, {role: bytes(v) for role, v in r.streams_of(e).items()}) for n, e in r.tensors.items()}
        source_header = r.source_header
    tensors = edit(tensors)
    tmp = path.with_name(path.name + ".new")
    with ContainerWriter(str(tmp)) as w:
        for entry, streams in tensors.values():
            w.add(entry, streams)
        w.finish(source_header=None if source_header is None else _drop_header(source_header, tensors))
    tmp.replace(path)
    record_in_members(path)


def record_in_members(path: Path) -> None:
    """Make the member list of `path`'s folder, if it names the file, record the file's header as it is now."""
    from unweight.folder import MEMBERS_NAME
    from unweight.formats.safetensors_file import file_header_digest

    members = path.parent / MEMBERS_NAME
    if members.exists():
        data = json.loads(members.read_text())
        if path.name in data["containers"]:
            data["containers"][path.name] = file_header_digest(path)
            members.write_text(json.dumps(data))


def _drop_header(source_header: str, tensors: dict) -> str | None:
    """The stored source header, or None once a tensor's dtype or shape no longer matches it."""
    infos = json.loads(source_header)
    for name, (entry, _) in tensors.items():
        info = infos.get(name)
        if info is None or (info["dtype"], tuple(info["shape"])) != (entry.dtype, tuple(entry.shape)):
            return None
    return source_header


def zstd_bomb(folder: Path, tensor: str, shape: tuple[int, ...]) -> int:
    """Make `tensor` a valid zstd-coded tensor of zeros declared as `shape` (BF16): a few hundred KB
    on disk that decode to the full size (all CRCs honest). Returns the stored stream's size."""
    import dataclasses

    import zstandard

    from unweight.codec.checksum import crc32

    numel = 1
    for d in shape:
        numel *= d
    nbytes, piece = 2 * numel, bytes(64 << 20)
    z = zstandard.ZstdCompressor(level=3).compressobj(size=nbytes)
    blob, crc, left = [], 0, nbytes
    while left:
        part = piece[: min(left, len(piece))]
        blob.append(z.compress(part))
        crc = crc32(part, crc)
        left -= len(part)
    blob.append(z.flush())
    data = b"".join(blob)

    def edit(tensors):
        entry, _ = tensors[tensor]
        bomb = dataclasses.replace(
            entry,
            dtype="BF16",
            shape=tuple(shape),
            codec="zstd",
            params={},
            streams={"data": f"{tensor}#data"},
            crc32=crc,
            stream_crc32={"data": crc32(data)},
        )
        return {**tensors, tensor: (bomb, {"data": data})}

    rewrite_container(shard_of(folder, tensor), edit)
    return len(data)


def swap_streams(folder: Path, a: str, b: str) -> None:
    """Give tensors `a` and `b` (same shape, same file) each other's streams, stream CRCs, codec
    and parameters: every stream CRC matches, only the whole-tensor CRC-32s do not."""
    import dataclasses

    def edit(tensors):
        (ea, sa), (eb, sb) = tensors[a], tensors[b]

        def take(mine, theirs, streams):
            names = {role: f"{mine.name}#{role}" for role in theirs.streams}
            entry = dataclasses.replace(
                mine, codec=theirs.codec, params=theirs.params, streams=names, stream_crc32=theirs.stream_crc32
            )
            return entry, streams

        return {**tensors, a: take(ea, eb, sb), b: take(eb, ea, sa)}

    assert shard_of(folder, a) == shard_of(folder, b)
    rewrite_container(shard_of(folder, a), edit)
