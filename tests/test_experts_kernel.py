"""The grouped ("MoE") GEMV, `qtiles_experts_linear`, against the plain numpy decoder: on CPU
through TRITON_INTERPRET=1, on a GPU when there is one (those tests skip cleanly without CUDA).
E experts' (N, K) weights are stacked into one (E N, K) resident matrix; pair p multiplies x row
p // x_div by expert ids[p]. Under the interpreter each pair of an N=48 expert is 24 programs, the
bulk of this file's time, so the cases below cover the modes, K and x_div pairwise (every two of
them meet in each combination of their values) with 3-4 pairs each."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

from unweight.runtime.kernels import (
    qtiles,  # noqa: E402
    qtiles_matmul,  # noqa: E402
)
from unweight.runtime.kernels.qtiles_matmul import qtiles_experts_linear  # noqa: E402
from unweight.runtime.kernels.weight import QTilesWeight  # noqa: E402

gpu = pytest.mark.gpu  # skipped without CUDA (conftest.py)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E = 4  # experts


def stacked_experts(experts: int, rows: int, cols: int, seed: int) -> np.ndarray:
    """(experts rows, cols) BF16 bits, expert after expert: trained-like values at scale 0.02 * 8^e
    (so that each expert's rows take different windows, and a wrong expert shows), with escapes:
    subnormals and 2^-11 below the windows, -32.0 above the lower ones, zeros (listed in mode 0)."""
    parts = []
    for e in range(experts):
        g = torch.Generator().manual_seed(seed * 16 + e)
        v = (torch.randn(rows, cols, generator=g) * (0.02 * 8.0**e)).to(torch.bfloat16)
        v = v.view(torch.int16).numpy().view(np.uint16).ravel().copy()
        v[e::13] = 0x0001
        v[5 + e :: 29] = 0xC200
        v[7::31] = 0x0000
        v[3::37] = 0x3A00
        parts.append(v)
    return np.concatenate(parts)


def on_device(
    q: dict[str, np.ndarray], rows: int, cols: int, device: str = DEVICE, mode: int | None = None
) -> QTilesWeight:
    """The stacked experts' weight (rows, cols) as the launcher takes it, in q's mode unless `mode` is given."""
    return QTilesWeight.from_streams(q, rows, cols, mode, device)


def as_bf16(bits: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).reshape(rows, cols).to(DEVICE).float()


def check_experts(
    v: np.ndarray,
    rows: int,
    cols: int,
    ids: list[int],
    x_div: int,
    mode: int | None,
    id_dtype: torch.dtype = torch.int64,
    seed: int = 0,
) -> None:
    """Each pair's row of y against F.linear(x[p // x_div].float(), W_e.float()), W_e the expert's
    rows of the numpy decoder's matrix, within the GEMV's bound in tests/test_kernels.py
    (check_product): (K + escapes + 1) 2^-24 sum_k |x_k| (|w0_k| + |w_k - w0_k|), w0 the stand-ins."""
    q = qtiles.encode(v, E * rows, cols, mode=mode)
    decoded = qtiles.decode_reference(q, E * rows, cols)
    assert np.array_equal(decoded.ravel(), v)
    dense = as_bf16(decoded, E * rows, cols)
    stand = as_bf16(qtiles.stand_ins_reference(q, E * rows, cols), E * rows, cols)
    tokens = len(ids) // x_div
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).to(DEVICE)
    y = qtiles_experts_linear(
        x,
        on_device(q, E * rows, cols, mode=mode),
        torch.tensor(ids, dtype=id_dtype, device=DEVICE),
        rows,
        x_div,
        torch.float32,
    )
    assert y.shape == (len(ids), rows) and y.dtype == torch.float32
    terms = cols + int(np.diff(q["esc_row"]).max(initial=0)) + 1
    for p, e in enumerate(ids):
        w, s = dense[e * rows : (e + 1) * rows], stand[e * rows : (e + 1) * rows]
        xp = x[p // x_div].float()
        ref = F.linear(xp, w)
        bound = F.linear(xp.abs(), s.abs() + (w - s).abs())
        assert torch.all((y[p] - ref).abs() <= terms * 2.0**-24 * bound), (p, e, (y[p] - ref).abs().max())


# N = 48 rows an expert (BLOCK_N 2: 24 programs a pair); K 96 (three whole groups) and 100 (a
# partial fourth); both modes; x_div 1 (three tokens, expert 3 twice) and 2 (two tokens sharing
# expert 1); int64 and int32 ids
@pytest.mark.parametrize(
    "mode,cols,x_div,ids,id_dtype",
    [
        (0, 96, 1, [3, 0, 3], torch.int64),
        (0, 100, 2, [2, 1, 1, 0], torch.int32),
        (1, 96, 2, [1, 3, 0, 1], torch.int64),
        (1, 100, 1, [0, 2, 2], torch.int32),
    ],
)
@pytest.mark.slow
def test_experts_linear_matches_f_linear_per_pair(mode, cols, x_div, ids, id_dtype):
    v = stacked_experts(E, 48, cols, seed=cols + mode)
    check_experts(v, 48, cols, ids, x_div, mode, id_dtype, seed=mode)


class CountingLaunches:
    """Stands in for the kernel: records each launch's grid, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


@pytest.mark.slow
def test_experts_linear_chunks_pairs_past_the_grid_limit(monkeypatch):
    """More pairs than grid dimension 1 takes go in launches of whole rows of x (MAX_PAIRS lowered
    to 3: x_div 2 gives launches of 2 pairs); N = 47 leaves a dead lane in every expert's last
    program; the mode is read from the streams."""
    monkeypatch.setattr(qtiles_matmul, "MAX_PAIRS", 3)
    counting = CountingLaunches(qtiles_matmul.qtiles_gemv_kernel)
    monkeypatch.setattr(qtiles_matmul, "qtiles_gemv_kernel", counting)
    v = stacked_experts(E, 47, 100, seed=5)
    check_experts(v, 47, 100, [3, 0, 0, 3], 2, None, seed=5)
    assert counting.grids == [(24, 2), (24, 2)]  # BLOCK_N 2: 24 programs an expert, the last half dead


def test_experts_linear_reads_only_its_rows_of_x():
    """K odd, x a view whose rows are each followed by an inf, ids a strided view: the launcher
    pads x to whole 32-bit pairs and makes ids contiguous, so no load reaches past a row."""
    rows, cols = 3, 45
    v = stacked_experts(E, rows, cols, seed=7)
    q = qtiles.encode(v, E * rows, cols)
    dense = as_bf16(qtiles.decode_reference(q, E * rows, cols), E * rows, cols)
    buf = torch.full((2, cols + 1), float("inf")).to(torch.bfloat16)
    buf[:, :cols] = torch.randn(2, cols, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    x = buf.to(DEVICE)[:, :cols]
    ids = torch.tensor([[2, 9], [0, 9]], device=DEVICE)[:, 0]  # stride 2
    y = qtiles_experts_linear(x, on_device(q, E * rows, cols), ids, rows, out_dtype=torch.float32)
    assert torch.isfinite(y).all()
    for p, e in enumerate((2, 0)):
        ref = F.linear(x[p].float(), dense[e * rows : (e + 1) * rows])
        assert torch.allclose(y[p], ref, rtol=1e-4, atol=1e-4)


def test_experts_linear_no_pairs():
    v = stacked_experts(E, 48, 96, seed=1)
    q = on_device(qtiles.encode(v, E * 48, 96), E * 48, 96, mode=0)
    x = torch.ones(0, 96, dtype=torch.bfloat16, device=DEVICE)
    for dt in (torch.int32, torch.int64):
        y = qtiles_experts_linear(x, q, torch.zeros(0, dtype=dt, device=DEVICE), 48, x_div=2)
        assert y.shape == (0, 48) and y.dtype == torch.bfloat16


def test_experts_linear_checks_its_inputs():
    v = stacked_experts(E, 48, 96, seed=2)
    streams = qtiles.encode(v, E * 48, 96)
    q = on_device(streams, E * 48, 96)
    x = torch.ones(2, 96, dtype=torch.bfloat16, device=DEVICE)
    ids = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="bfloat16"):
        qtiles_experts_linear(x.float(), q, ids, 48)
    with pytest.raises(ValueError, match="96"):
        qtiles_experts_linear(x[:, :95], q, ids, 48)
    with pytest.raises(ValueError, match="tokens"):
        qtiles_experts_linear(x.reshape(2, 1, 96), q, ids, 48)
    with pytest.raises(ValueError, match="float32"):
        qtiles_experts_linear(x, q, ids.float(), 48)
    with pytest.raises(ValueError, match="int16"):
        qtiles_experts_linear(x, q, ids.to(torch.int16), 48)
    with pytest.raises(ValueError, match=r"\(2, 1\)"):
        qtiles_experts_linear(x, q, ids.reshape(2, 1), 48)
    with pytest.raises(ValueError, match="2 ids for 2 rows of x with x_div 2"):
        qtiles_experts_linear(x, q, ids, 48, x_div=2)
    with pytest.raises(ValueError, match="x_div"):
        qtiles_experts_linear(x, q, ids, 48, x_div=0)
    with pytest.raises(ValueError, match="192-row matrix"):
        qtiles_experts_linear(x, q, ids, 50)  # 192 rows are not whole experts of 50
    with pytest.raises(ValueError, match="192-row matrix"):
        qtiles_experts_linear(x[:, :64], on_device(streams, E * 48, 64), ids, 48)  # 96 stored columns, not 64
    with pytest.raises(ValueError, match="mode"):
        qtiles_experts_linear(x, on_device(streams, E * 48, 96, mode=2), ids, 48)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="ids on cpu"):
            qtiles_experts_linear(x, q, ids.cpu(), 48)


@gpu
def test_experts_linear_on_gpu_without_a_sync_and_in_a_graph():
    """Realistic sizes on a GPU; the launch waits for nothing (the sync debug mode raises on a
    wait), and a CUDA graph captured once follows ids rewritten in place between replays."""
    rows, cols, topk = 512, 1024, 4
    v = stacked_experts(E, rows, cols, seed=11)
    check_experts(v, rows, cols, [3, 1, 0, 2, 2, 2, 1, 3], topk, 0, seed=11)
    q = on_device(qtiles.encode(v, E * rows, cols, mode=0), E * rows, cols, mode=0)
    x = torch.randn(2, cols, device=DEVICE).to(torch.bfloat16)
    ids = torch.tensor([0, 1, 2, 3, 3, 2, 1, 0], dtype=torch.int32, device=DEVICE)
    eager = qtiles_experts_linear(x, q, ids, rows, topk)  # compiles outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        qtiles_experts_linear(x, q, ids, rows, topk)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = qtiles_experts_linear(x, q, ids, rows, topk)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)
    ids.copy_(ids.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, qtiles_experts_linear(x, q, ids, rows, topk))
