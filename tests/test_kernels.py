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
from unweight.runtime.tile_tensors import tile_tensors  # noqa: E402

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
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = tiles_decode(tile_tensors(streams, device), p.to_json(), rows, cols)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (rows, cols)
    assert np.array_equal(as_u16(out), v)


@pytest.mark.parametrize("rows,cols,block", [(16, 64, 64), (9, 100, 32)])
def test_tiles_decode_gathers_rows_bit_exact(rows, cols, block):
    """The embedding lookup: the Triton kernel and the numba CPU path decode only the rows asked
    for (repeats and any order), bit-exact against the reference decoder."""
    from unweight.runtime.cpu_gemv import tiles_rows_cpu

    v = edge_case_matrix(rows, cols, seed=rows + cols)
    p, streams = tiles.encode(v, rows, cols, block)
    full = tiles.decode_reference(streams, p, rows, cols).reshape(rows, cols)
    ids = torch.tensor([rows - 1, 0, 3, 3, rows // 2])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    got = tiles_decode(tile_tensors(streams, device), p.to_json(), rows, cols, ids.to(device))
    assert np.array_equal(as_u16(got).reshape(len(ids), cols), full[ids.numpy()])
    cpu = tiles_rows_cpu(tile_tensors(streams), p.base, p.block, rows, cols, ids)  # fp32: BF16 bits << 16
    assert np.array_equal((cpu.numpy().view(np.uint32) >> 16).astype(np.uint16), full[ids.numpy()])
    with pytest.raises(ValueError, match="row ids"):
        tiles_decode(tile_tensors(streams, device), p.to_json(), rows, cols, torch.tensor([rows], device=device))


def test_tiles_decode_launcher_checks_its_inputs():
    v = edge_case_matrix(4, 24, seed=1)
    p, streams = tiles.encode(v, 4, 24, 8)
    w = tile_tensors(streams, "cpu")
    with pytest.raises(ValueError, match="power-of-two"):
        tiles_decode(w, {"base": p.base, "block": 24}, 4, 24)
    with pytest.raises(ValueError, match="sm stream"):
        tiles_decode(dict(w, sm=w["sm"][:-1]), p.to_json(), 4, 24)


@gpu
def test_tiles_decode_on_gpu_large():
    v = edge_case_matrix(4096, 1024, seed=7)
    p, streams = tiles.encode(v, 4096, 1024)
    assert np.array_equal(as_u16(tiles_decode(tile_tensors(streams, "cuda"), p.to_json(), 4096, 1024)), v)


def weight_streams(v: np.ndarray, rows: int, cols: int, block: int, device: str = "cpu"):
    """(params, torch streams as tiles_linear takes them, decoded BF16 weight)."""
    p, s = tiles.encode(v, rows, cols, block)
    dense = torch.from_numpy(tiles.decode_reference(s, p, rows, cols).view(np.int16)).view(torch.bfloat16).reshape(rows, cols)
    return p, tile_tensors(s, device), dense.to(device)


def finite_matrix(rows: int, cols: int, seed: int) -> np.ndarray:
    """Trained-like BF16 weights with escapes (subnormals, large values) but no inf/NaN."""
    v = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.02).to(torch.bfloat16)
    v = v.view(torch.int16).numpy().view(np.uint16).ravel().copy()
    v[::13] = 0x0001  # subnormal: below the exponent window
    v[5::29] = 0xC200  # -32.0: above it
    return v


@pytest.mark.parametrize("m,split_k", [(1, 1), (3, 1), (16, 1), (33, 1), (1, 2), (2, 4), (17, 3)])
def test_tiles_linear_matches_f_linear(m, split_k):
    """Fused decode+matmul vs F.linear on the decoded weight, both accumulated in fp32. The weights
    are bit-identical and products of bf16 values are exact in fp32, so only the order of the fp32
    additions differs: |error| <= K * 2^-24 * sum_k |x_k w_k| per output (the standard bound for
    recursive summation), which is the tolerance."""
    rows, cols = 70, 200
    from unweight.runtime.kernels.tiles_matmul import tiles_linear

    p, w, dense = weight_streams(finite_matrix(rows, cols, seed=m), rows, cols, block=64)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    y = tiles_linear(x, w, p.to_json(), rows, cols, out_dtype=torch.float32, split_k=split_k)
    ref = torch.nn.functional.linear(x.float(), dense.float())
    bound = torch.nn.functional.linear(x.float().abs(), dense.float().abs())
    assert y.shape == (m, rows)
    assert torch.all((y - ref).abs() <= cols * 2.0**-24 * bound)


def test_tiles_linear_propagates_nan_and_inf_like_f_linear():
    from unweight.runtime.kernels.tiles_matmul import tiles_linear

    v = finite_matrix(8, 64, seed=9)
    v[3] = 0x7FC0  # NaN in row 0
    v[64 + 2] = 0x7F80  # +inf in row 1
    p, w, dense = weight_streams(v, 8, 64, block=64)
    x = torch.ones(2, 64, dtype=torch.bfloat16)
    y = tiles_linear(x, w, p.to_json(), 8, 64, out_dtype=torch.float32)
    ref = torch.nn.functional.linear(x.float(), dense.float())
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.equal(torch.isinf(y), torch.isinf(ref))
