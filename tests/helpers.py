"""Helpers the tests share: small checkpoints written with our own writer, the CLI as a process."""

from __future__ import annotations

import os
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
