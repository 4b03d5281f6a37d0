"""Triton kernels against the plain numpy decoders: on CPU through TRITON_INTERPRET=1, on a GPU
when there is one (those tests skip cleanly without CUDA)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

from unweight.codec import tiles  # noqa: E402
from unweight.runtime.kernels.tiles_decode import tiles_decode  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def edge_case_matrix(rows: int, cols: int, seed: int) -> np.ndarray:
    """Trained-like BF16 values with every kind of escape mixed in: ±0, ±inf, NaN payloads,
    subnormals, huge exponents, and arbitrary bit patterns."""
    rng = np.random.default_rng(seed)
    v = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.02).to(torch.bfloat16)
    v = v.view(torch.int16).numpy().view(np.uint16).ravel().copy()
    specials = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0xFFFF, 0x0001, 0x807F, 0x7F7F], dtype=np.uint16)
    idx = rng.choice(v.size, size=v.size // 10, replace=False)
    v[idx[: len(idx) // 2]] = rng.choice(specials, len(idx) // 2)
    v[idx[len(idx) // 2 :]] = rng.integers(0, 1 << 16, len(idx) - len(idx) // 2, dtype=np.uint16)
    return v


def as_u16(t: torch.Tensor) -> np.ndarray:
    return t.cpu().view(torch.int16).numpy().view(np.uint16).ravel()


@pytest.mark.parametrize("rows,cols,block", [(16, 64, 64), (9, 100, 32), (3, 5, 8), (1, 300, 128)])
def test_tiles_decode_kernel_is_bit_exact(rows, cols, block):
    v = edge_case_matrix(rows, cols, seed=rows * cols)
    p, streams = tiles.encode(v, rows, cols, block)
    assert np.array_equal(tiles.decode_reference(streams, p, rows, cols), v)
    out = tiles_decode(streams, p.to_json(), rows, cols, device="cuda" if torch.cuda.is_available() else "cpu")
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (rows, cols)
    assert np.array_equal(as_u16(out), v)


def test_tiles_decode_launcher_checks_its_inputs():
    v = edge_case_matrix(4, 24, seed=1)
    p, streams = tiles.encode(v, 4, 24, 8)
    with pytest.raises(ValueError, match="power-of-two"):
        tiles_decode(streams, {"base": p.base, "block": 24}, 4, 24)
    with pytest.raises(ValueError, match="sm stream"):
        tiles_decode(dict(streams, sm=streams["sm"][:-1]), p.to_json(), 4, 24)


@gpu
def test_tiles_decode_on_gpu_large():
    v = edge_case_matrix(4096, 1024, seed=7)
    p, streams = tiles.encode(v, 4096, 1024)
    assert np.array_equal(as_u16(tiles_decode(streams, p.to_json(), 4096, 1024, device="cuda")), v)
