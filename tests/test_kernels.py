"""Triton kernels against the plain numpy decoders: on CPU through TRITON_INTERPRET=1, on a GPU
when there is one (those tests skip cleanly without CUDA). The kernels read the resident layout
(runtime/kernels/qtiles.py), which is itself checked against the stored `tiles` codec here."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from unweight.codec import tiles  # noqa: E402
from unweight.runtime.kernels import (
    qtiles,  # noqa: E402
    qtiles_matmul,  # noqa: E402
)
from unweight.runtime.kernels.qtiles_common import bf16_pair  # noqa: E402
from unweight.runtime.kernels.qtiles_decode import qtiles_decode  # noqa: E402
from unweight.runtime.kernels.qtiles_matmul import qtiles_linear  # noqa: E402
from unweight.runtime.kernels.weight import QTilesWeight  # noqa: E402

gpu = pytest.mark.gpu  # skipped without CUDA (conftest.py)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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


def finite_matrix(rows: int, cols: int, seed: int) -> np.ndarray:
    """Trained-like BF16 weights with escapes (subnormals, zeros, large values) but no inf/NaN."""
    v = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.02).to(torch.bfloat16)
    v = v.view(torch.int16).numpy().view(np.uint16).ravel().copy()
    v[::13] = 0x0001  # subnormal: below the exponent window (these zeros and subnormals make the encoder pick mode 1)
    v[5::29] = 0xC200  # -32.0: above it, a listed escape
    v[7::31] = 0x0000
    v[3::37] = 0x3A00  # 2^-11: just below the window, listed
    return v


def as_u16(t: torch.Tensor) -> np.ndarray:
    return t.cpu().view(torch.int16).numpy().view(np.uint16).ravel()


def resident(v: np.ndarray, rows: int, cols: int, device: str = DEVICE, mode: int | None = None) -> QTilesWeight:
    return QTilesWeight.from_streams(qtiles.encode(v, rows, cols, mode=mode), rows, cols, device=device)


# -- the layout ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("rows,cols", [(16, 64), (9, 100), (3, 5), (1, 300), (2, 70000)])
def test_qtiles_round_trip_is_bit_exact(rows, cols, mode):
    v = edge_case_matrix(rows, cols, seed=rows + cols)
    q = qtiles.encode(v, rows, cols, mode=mode)
    assert np.array_equal(qtiles.decode_reference(q, rows, cols).ravel(), v)
    assert q["esc_col"].dtype == (np.uint16 if cols <= 1 << 16 else np.int32)
    assert q["sm"].size == rows * 32 * qtiles.groups(cols) and q["codes"].size == 12 * rows * qtiles.groups(cols)


@pytest.mark.parametrize("mode", [None, 0, 1])
@pytest.mark.parametrize(
    "rows,cols", [(16, 64), (9, 100), (3, 5), (2, 70000), (1100, 2048)]
)  # the last: 9 row ranges on 2 threads
def test_qtiles_encoder_matches_its_reference(rows, cols, mode):
    """The numba encoder (row ranges on threads) writes what the plain numpy one writes, in either
    mode and in the one they choose."""
    v = edge_case_matrix(rows, cols, seed=rows * 7 + cols)
    fast, ref = qtiles.encode(v, rows, cols, threads=2, mode=mode), qtiles.encode_reference(v, rows, cols, mode=mode)
    assert fast.keys() == ref.keys()
    for role in ref:
        assert fast[role].dtype == ref[role].dtype and np.array_equal(fast[role], ref[role]), role


def test_qtiles_every_exponent_and_sign():
    """All 256 exponents under both signs and three mantissas, in one row: each is coded in the
    row's window of eight (code e - base), or listed with code 0 below it and 7 above it."""
    e = np.arange(256, dtype=np.uint16)
    v = np.concatenate([(s << 15) | (e << 7) | m for s in (0, 1) for m in (0, 1, 0x7F)]).astype(np.uint16)
    q = qtiles.encode(v, 1, v.size)
    assert np.array_equal(qtiles.decode_reference(q, 1, v.size).ravel(), v)
    code = qtiles.unpack_codes(q["codes"], 1, v.size).ravel()
    base = int(q["base"][0])
    exp = ((v >> 7) & 0xFF).astype(np.int64)
    window = (exp >= base) & (exp <= base + 7)
    assert np.array_equal(code, np.clip(exp - base, 0, 7))
    assert len(q["esc_exp"]) == np.sum(~window)


@pytest.mark.parametrize("mode", [0, 1])
def test_qtiles_windows_reach_the_inf_exponent_without_carrying(mode):
    """A row of huge values, infs and NaNs gets the highest base its mode allows (the codes of
    exponent 255 still fit their byte lanes) and decodes exactly; every stand-in below the window
    (mode 0: the base) is finite."""
    v = ((np.full(64, 250, dtype=np.uint16) << 7) | np.arange(64, dtype=np.uint16)).astype(np.uint16)
    v[::2], v[1::4] = 0x7F80, 0xFFC1  # +inf, a NaN
    q = qtiles.encode(v, 1, 64, mode=mode)
    assert int(q["base"][0]) == qtiles.MAX_BASE[mode]
    assert np.array_equal(qtiles.decode_reference(q, 1, 64).ravel(), v)
    assert all(np.array_equal(q[k], r) for k, r in qtiles.encode_reference(v, 1, 64, mode=mode).items())


def test_qtiles_mode_follows_the_zeros():
    """Trained weights (few exact zeros) take the eight-exponent windows; a pruned matrix, whose
    zeros mode 0 would all list, takes the zero code. Each lists fewer escapes than the other mode."""
    dense = (
        (torch.randn(64, 256, generator=torch.Generator().manual_seed(5)) * 0.02)
        .to(torch.bfloat16)
        .view(torch.int16)
        .numpy()
        .view(np.uint16)
    )
    pruned = dense.copy()
    pruned.reshape(-1)[::2] = 0  # every other weight (a row of zeros alone mode 0 takes with base 0)
    for v, want in ((dense, 0), (pruned, 1)):
        got = qtiles.encode(v, 64, 256)
        other = qtiles.encode(v, 64, 256, mode=1 - want)
        assert int(got["mode"][0]) == want == qtiles.choose_mode(v.reshape(64, 256))
        assert len(got["esc_exp"]) < len(other["esc_exp"])


def test_qtiles_transcodes_the_stored_tiles_layout():
    v = edge_case_matrix(12, 96, seed=3)
    p, streams = tiles.encode(v, 12, 96, block=32)
    q = qtiles.from_tiles(streams, p.to_json(), 12, 96)
    assert np.array_equal(qtiles.decode_reference(q, 12, 96).ravel(), v)


def test_row_windows_cover_each_row():
    """Rows of very different scales each get their own window."""
    v = np.concatenate(
        [
            finite_matrix(1, 256, seed=1),
            (torch.randn(256) * 300).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
        ]
    )
    q = qtiles.encode(v, 2, 256)
    assert q["base"][1] > q["base"][0] + 10
    assert np.diff(q["esc_row"])[1] < 256 * 0.1


# -- the PTX fragment and its integer model ----------------------------------------------------


def prmt_reference(a: np.ndarray, b: np.ndarray, selector: int) -> np.ndarray:
    """PTX `prmt.b32 d, a, b, c` (default mode), from the PTX ISA: byte i of d is byte
    (c >> 4i) & 7 of the eight bytes b:a (a's bytes 0-3, b's 4-7); bit 3 of a selector nibble
    would replicate the byte's sign (not used by the kernels)."""
    src = np.stack([(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)])
    return sum(src[(selector >> (4 * i)) & 7].astype(np.uint64) << (8 * i) for i in range(4)).astype(np.uint32)


@triton.jit
def _pairs_kernel(h_ptr, lo_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    h, lo = tl.load(h_ptr + i), tl.load(lo_ptr + i)
    tl.store(out_ptr + i, bf16_pair(h, lo, 0, False))
    tl.store(out_ptr + N + i, bf16_pair(h, lo, 1, False))


def test_bf16_pair_model_is_prmt():
    """The interpreter runs `bf16_pair`'s integer model where a GPU runs prmt.b32: both selectors
    give the same words on random inputs."""
    rng = np.random.default_rng(0)
    h, lo = (rng.integers(0, 2**32, 1024, dtype=np.uint64).astype(np.uint32) for _ in range(2))
    out = torch.empty(2048, dtype=torch.uint32)
    if torch.cuda.is_available():
        pytest.skip("the integer model runs under the interpreter")
    _pairs_kernel[(1,)](torch.from_numpy(h), torch.from_numpy(lo), out, N=1024)
    got = out.numpy()
    assert np.array_equal(got[:1024], prmt_reference(lo, h, 0x5140))
    assert np.array_equal(got[1024:], prmt_reference(lo, h, 0x7362))


# -- decode to BF16 ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("rows,cols", [(16, 64), (9, 100), (3, 5), (1, 300), (5, 1100)])
@pytest.mark.slow
def test_qtiles_decode_kernel_is_bit_exact(rows, cols, mode):
    v = edge_case_matrix(rows, cols, seed=rows * cols)
    out = qtiles_decode(resident(v, rows, cols, mode=mode))
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (rows, cols)
    assert np.array_equal(as_u16(out), v)


@pytest.mark.parametrize("rows,cols", [(16, 64), (9, 100)])
def test_qtiles_decode_gathers_rows_bit_exact(rows, cols):
    """The embedding lookup: only the rows asked for (repeats and any order), bit-exact."""
    v = edge_case_matrix(rows, cols, seed=rows + cols)
    ids = torch.tensor([rows - 1, 0, 3, 3, rows // 2, rows - 1])
    got = qtiles_decode(resident(v, rows, cols), ids.to(DEVICE))
    assert np.array_equal(as_u16(got).reshape(len(ids), cols), v.reshape(rows, cols)[ids.numpy()])
    assert qtiles_decode(resident(v, rows, cols), torch.zeros(0, dtype=torch.int64, device=DEVICE)).shape == (0, cols)


@gpu
def test_qtiles_decode_on_gpu_large():
    v = edge_case_matrix(4096, 1024, seed=7)
    assert np.array_equal(as_u16(qtiles_decode(resident(v, 4096, 1024))), v)


# -- fused products ----------------------------------------------------------------------------


def check_product(v: np.ndarray, rows: int, cols: int, m: int, seed: int = 0, mode: int | None = None) -> None:
    """Fused decode+matmul vs F.linear on the decoded weight, both accumulated in fp32. Products
    of bf16 values are exact in fp32, so the error comes from the order of the fp32 additions,
    over the K stand-in products and each row's escape corrections x (w - w0) (w - w0 rounded
    once): |error| <= (K + escapes + 1) * 2^-24 * sum_k |x_k| (|w0_k| + |w_k - w0_k|) per output,
    the standard bound for recursive summation."""
    q = qtiles.encode(v, rows, cols, mode=mode)
    dense = torch.from_numpy(v.view(np.int16)).view(torch.bfloat16).reshape(rows, cols).to(DEVICE)
    stand = (
        torch.from_numpy(qtiles.stand_ins_reference(q, rows, cols).view(np.int16))
        .view(torch.bfloat16)
        .reshape(rows, cols)
        .to(DEVICE)
        .float()
    )
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).to(DEVICE)
    y = qtiles_linear(x, resident(v, rows, cols, mode=mode), out_dtype=torch.float32)
    ref = F.linear(x.float(), dense.float())
    bound = F.linear(x.float().abs(), stand.abs() + (dense.float() - stand).abs())
    terms = cols + int(np.diff(q["esc_row"]).max(initial=0)) + 1
    assert y.shape == (m, rows)
    assert torch.all((y - ref).abs() <= terms * 2.0**-24 * bound), (y - ref).abs().max()


# every batch the launcher maps to a distinct kernel: GEMV at BLOCK_M 1, 2; tensor cores at 16, 32
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 16, 17, 32])
@pytest.mark.slow
def test_qtiles_linear_matches_f_linear(m, mode):
    rows, cols = 70, 200
    check_product(finite_matrix(rows, cols, seed=m), rows, cols, m, seed=m, mode=mode)


@pytest.mark.parametrize("m,split_k", [(3, 2), (20, 3), (32, 8)])
@pytest.mark.slow
def test_qtiles_dot_split_k(m, split_k):
    """Split K: each program adds its columns and every split_k-th escape of its rows; the last of
    a tile adds the partials in order and leaves the tile counter at 0 for the next call."""
    rows, cols = 70, 1000
    v = finite_matrix(rows, cols, seed=m)
    q = resident(v, rows, cols)
    dense = torch.from_numpy(v.view(np.int16)).view(torch.bfloat16).reshape(rows, cols).to(DEVICE)
    for seed in (0, 1):  # twice: the counters must be back at 0
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).to(DEVICE)
        y = qtiles_linear(x, q, out_dtype=torch.float32, split_k=split_k)
        ref = F.linear(x.float(), dense.float())
        assert torch.all((y - ref).abs() <= cols * 2.0**-24 * F.linear(x.float().abs(), dense.float().abs()))
    assert not qtiles_matmul._WORKSPACES[torch.device(DEVICE) if DEVICE == "cpu" else x.device][1].any()


@pytest.mark.parametrize("m", [1, 9])
def test_qtiles_linear_odd_widths(m):
    """K not a multiple of 32 (a partial last group) and of 2, rows not a multiple of the block."""
    check_product(finite_matrix(7, 45, seed=2), 7, 45, m)


def test_qtiles_gemv_reads_only_its_rows_of_x():
    """The GEMV reads x as 32-bit pairs: with K odd, or x a view starting off a 4-byte boundary,
    the launcher pads or copies, so no pair reaches past a row (an inf placed right after each
    row would turn the product into NaN through the padding weight 0)."""
    v = finite_matrix(5, 45, seed=3)
    dense = torch.from_numpy(v.view(np.int16)).view(torch.bfloat16).reshape(5, 45)
    q = resident(v, 5, 45)
    for m in (1, 2):
        buf = torch.full((m, 46), float("inf")).to(torch.bfloat16)
        buf[:, :45] = torch.randn(m, 45).to(torch.bfloat16)
        x = buf[:, :45]  # rows of odd length, each followed by an inf
        y = qtiles_linear(x.to(DEVICE), q, out_dtype=torch.float32).cpu()
        assert torch.isfinite(y).all()
        assert torch.allclose(y, F.linear(x.float(), dense.float()), rtol=1e-4, atol=1e-5)
        flat = torch.full((m * 45 + 1,), float("inf")).to(torch.bfloat16)
        flat[1:] = x.reshape(-1)
        shifted = flat[1:].view(m, 45)  # 2 bytes past an aligned start
        y = qtiles_linear(shifted.to(DEVICE) if DEVICE == "cpu" else shifted.cuda(), q, out_dtype=torch.float32).cpu()
        assert torch.isfinite(y).all()


@pytest.fixture
def interpreter_bf16_dot(monkeypatch):
    """Triton 3.9's interpreter multiplies bf16 tl.dot operands as integers (a 16x32 product is off
    by 4.7e10). Patch its dot to widen bf16 operands to fp32 first, exactly, so that the kernel's
    GPU branch (bf16 operands into tl.dot, fp32 accumulation) runs here."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the bf16 branch runs as it is")
    import triton.language as tl
    from triton.runtime import interpreter

    real = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widen(h):
            if h.dtype.scalar == tl.bfloat16:
                return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
            return h

        return real(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    monkeypatch.setattr(qtiles_matmul, "INTERPRETER_BF16_DOT", True)


@pytest.mark.parametrize("m", [3, 30])
def test_qtiles_dot_bf16_operands(interpreter_bf16_dot, m):
    check_product(finite_matrix(70, 200, seed=m), 70, 200, m, seed=m)


def test_qtiles_linear_propagates_nan_and_inf_like_f_linear():
    v = finite_matrix(8, 64, seed=9)
    v[3] = 0x7FC0  # NaN in row 0
    v[64 + 2] = 0x7F80  # +inf in row 1
    v[2 * 64 + 5] = 0xFF80  # -inf in row 2
    dense = torch.from_numpy(v.view(np.int16)).view(torch.bfloat16).reshape(8, 64)
    for m in (1, 6):
        x = torch.ones(m, 64, dtype=torch.bfloat16)
        y = qtiles_linear(x.to(DEVICE), resident(v, 8, 64), out_dtype=torch.float32).cpu()
        ref = F.linear(x.float(), dense.float())
        assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.equal(torch.isinf(y), torch.isinf(ref))
        assert torch.equal(y[torch.isinf(ref)], ref[torch.isinf(ref)])


def test_qtiles_linear_zero_rows_are_exact():
    """Zero weights decode to zero without a list entry: an all-zero row gives exactly 0."""
    v = finite_matrix(6, 96, seed=4)
    v[2 * 96 : 3 * 96] = 0
    for m in (1, 8):
        x = torch.randn(m, 96).to(torch.bfloat16)
        y = qtiles_linear(x.to(DEVICE), resident(v, 6, 96), out_dtype=torch.float32).cpu()
        assert torch.all(y[:, 2] == 0)


def test_qtiles_linear_checks_its_inputs():
    v = finite_matrix(4, 64, seed=1)
    q = resident(v, 4, 64)
    with pytest.raises(ValueError, match="bfloat16"):
        qtiles_linear(torch.ones(1, 64, device=DEVICE), q)
    with pytest.raises(ValueError, match="features"):
        qtiles_linear(torch.ones(1, 63, dtype=torch.bfloat16, device=DEVICE), q)
    with pytest.raises(ValueError, match="at most"):
        qtiles_linear(torch.ones(qtiles_matmul.MAX_M + 1, 64, dtype=torch.bfloat16, device=DEVICE), q)
    x = torch.ones(3, 64, dtype=torch.bfloat16, device=DEVICE)
    assert qtiles_linear(x[:0], q).shape == (0, 4)
    assert qtiles_linear(x.reshape(3, 1, 64), q).shape == (3, 1, 4)


@gpu
def test_qtiles_linear_on_gpu_every_bucket():
    finite = finite_matrix(1000, 4096, seed=5)
    for m in (1, 2, 4, 8, 16, 32):
        check_product(finite, 1000, 4096, m, seed=m)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_kernels_launch_on_the_inputs_device():
    """A layer on cuda:1 runs there although cuda:0 is the current device."""
    v = finite_matrix(64, 256, seed=6)
    q = resident(v, 64, 256, device="cuda:1")
    dense = torch.from_numpy(v.view(np.int16)).view(torch.bfloat16).reshape(64, 256).to("cuda:1")
    assert torch.cuda.current_device() == 0
    for m in (1, 8):
        x = torch.randn(m, 256, device="cuda:1").to(torch.bfloat16)
        y = qtiles_linear(x, q, out_dtype=torch.float32)
        assert y.device == x.device
        assert torch.allclose(y, F.linear(x.float(), dense.float()), rtol=1e-4, atol=1e-4)
    assert torch.equal(qtiles_decode(q).view(torch.int16), dense.view(torch.int16))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 200), seed=st.integers(0, 2**32 - 1), specials=st.floats(0, 0.5))
def test_qtiles_round_trip_on_any_matrix(rows, cols, seed, specials):
    """Any shape, any mix of trained-like values and arbitrary bit patterns: both encoders agree and
    the reference decoder gives the matrix back."""
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal(rows * cols) * 0.02).astype(np.float32).view(np.uint32) >> 16
    v = v.astype(np.uint16)
    odd = rng.random(v.size) < specials
    v[odd] = rng.integers(0, 1 << 16, int(odd.sum()), dtype=np.uint16)
    fast, ref = qtiles.encode(v, rows, cols), qtiles.encode_reference(v, rows, cols)
    assert all(np.array_equal(fast[k], ref[k]) for k in ref)
    assert np.array_equal(qtiles.decode_reference(fast, rows, cols).ravel(), v)
