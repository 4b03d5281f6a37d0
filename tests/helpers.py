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
