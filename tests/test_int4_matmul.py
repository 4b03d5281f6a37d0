"""The W4A16 GEMV for CUDA (runtime/kernels/int4_matmul.py) against a float64 product of the plainly
decoded weights: on CPU through TRITON_INTERPRET=1, on a GPU when there is one. Its weights: INT4
codes as stored with BF16 scales (PlainInt4Weight) or with the `int4` layout's coded scales
(Int4ScalesWeight, whose streams decode back to the source's bits). Products lie within the fp32
summation bound (tests/test_int4.py): BF16, FP16 and FP32 x, groups
of 8, 32 and 128 columns, rows the programs do not fill, more groups than a step takes, scales the
window does not code (listed) in some programs and not others, and the grouped GEMV of a MoE step.
Asymmetric codes are refused (zero points would take the kernel past its instruction budget)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

from test_int4 import asymmetric, dense, fp32_bound, quantized  # noqa: E402

from unweight.runtime.kernels import int4  # noqa: E402
from unweight.runtime.kernels.int4_matmul import int4_experts_linear, int4_linear  # noqa: E402
from unweight.runtime.kernels.weight import Int4ScalesWeight, Int4Weight, PlainInt4Weight, int4_weight  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu  # skipped without CUDA (conftest.py)


def plain(packed: np.ndarray, scales: np.ndarray, cols: int, group: int, zero=None) -> PlainInt4Weight:
    z = np.zeros(0, np.uint8) if zero is None else int4.zero_stream(int4.unpack_zero_points(zero, packed.shape[0]))
    return PlainInt4Weight(
        packed=torch.from_numpy(packed.reshape(-1).copy()),
        scales=torch.from_numpy(scales.view(np.int16).reshape(-1).copy()),
        zero=torch.from_numpy(z),
        rows=packed.shape[0],
        cols=cols,
        group=group,
    )


def weights(kind: str, packed, scales, cols: int, group: int, zero=None):
    if kind == "plain":
        return plain(packed, scales, cols, group, zero).to(DEVICE)
    return Int4ScalesWeight.encode(packed, scales, cols, group, zero).to(DEVICE)


def with_listed(scales: np.ndarray, rows: list[int]) -> np.ndarray:
    """The scales with some the window does not code in `rows`: a negative one, a zero and one far
    below the row's exponents (each still a finite BF16)."""
    s = scales.copy()
    for r in rows:
        s[r, 0] |= 0x8000
        s[r, 1] = 0x0000
        s[r, 2] -= 9 << 7  # the exponent, 9 less
    return s


def check(y: torch.Tensor, x: np.ndarray, W: np.ndarray, bound: np.ndarray) -> None:
    y = y.float().cpu().numpy()
    exact = x.astype(np.float64) @ W.T
    assert y.shape == exact.shape
    err = np.abs(y - exact)
    assert np.all(err <= bound), (err - bound).max()


def x_of(m: int, cols: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return x.to(DEVICE), x.float().numpy()


@pytest.mark.parametrize("kind", ["plain", "scales"])
@pytest.mark.parametrize(
    "rows,cols,group,dtype",
    [
        (21, 256, 32, torch.bfloat16),  # rows past the last program's (BLOCK_N 2: 11 programs)
        (16, 4160, 32, torch.float32),  # 130 groups: two steps, the second nearly empty
        (12, 384, 128, torch.float16),
        (10, 64, 8, torch.bfloat16),
    ],
)
def test_products_within_the_fp32_bound(kind, rows, cols, group, dtype):
    packed, scales = quantized(rows, cols, group, seed=rows)
    scales = with_listed(scales, [3, 4, rows - 1])  # some programs list scales, others not; the last
    # program's rows past the matrix (21 rows) beside a listed one
    W = dense(packed, scales, cols, group)
    w = weights(kind, packed, scales, cols, group)
    if kind == "scales":
        assert int(w.sesc_row[-1]) > 0 and all(np.array_equal(a, b) for a, b in zip(w.decode(), (packed, scales)))
    x, xf = x_of(1, cols, dtype, seed=cols)
    check(int4_linear(x, w, torch.float32), xf, W, fp32_bound(xf, W))
    y = int4_linear(x[0], w)  # one token, no batch dimension; out in x's dtype
    assert y.shape == (rows,) and y.dtype == dtype


def test_inf_and_nan_scales_give_non_finite_rows():
    """A group's sum is scaled once: where an infinite scale meets nibble 8, the dequantized weight is
    NaN (0 x inf) and the kernel's row may be +-inf instead; finite rows stay as they are."""
    rows, cols, group = 8, 64, 32
    packed, scales = quantized(rows, cols, group)
    scales[1, 0], scales[5, 1] = 0x7F80, 0x7FC1  # +inf, a NaN: listed
    W = dense(packed, scales, cols, group)
    x, xf = x_of(1, cols, torch.float32, seed=2)
    exact = xf.astype(np.float64) @ W.T
    for kind in ("plain", "scales"):
        y = int4_linear(x, weights(kind, packed, scales, cols, group)).cpu().numpy()
        assert np.array_equal(np.isfinite(y), np.isfinite(exact)) and np.isnan(y[0, 5])
        assert np.all(np.abs(y - exact)[np.isfinite(exact)] <= fp32_bound(xf, W)[np.isfinite(exact)])


def test_many_listed_scales_and_rows_of_zeros():
    """Rows with half their scales far below the rest (listed: the listed pass takes several steps
    of the program) and rows whose scales are all zero (coded, exponent 0: their products exactly 0)."""
    rows, cols, group = 12, 8192, 32  # 256 groups a row
    packed, scales = quantized(rows, cols, group, seed=9)
    scales[2:5, 1::2] -= 20 << 7  # exponents 20 less
    scales[7, ::3] |= 0x8000  # negative
    scales[9:11] = 0
    W = dense(packed, scales, cols, group)
    w = weights("scales", packed, scales, cols, group)
    assert int(w.sesc_row[-1]) > 3 * 128 + 64
    x, xf = x_of(1, cols, torch.bfloat16, seed=6)
    y = int4_linear(x, w, torch.float32)
    check(y, xf, W, fp32_bound(xf, W))
    assert torch.all(y[0, 9:11] == 0)


@pytest.mark.parametrize("kind", ["plain", "scales"])
def test_grouped_gemv_takes_each_pairs_expert(kind):
    """y[p] = x[p // x_div] @ W_e^T, e = ids[p], four experts of 10 rows stacked (one lists scales),
    top-2 of two tokens and top-1 with int64 ids."""
    experts, n, cols, group = 4, 10, 128, 32
    packed, scales = quantized(experts * n, cols, group, seed=7)
    scales = with_listed(scales, [2 * n + 4])
    W = dense(packed, scales, cols, group)
    w = weights(kind, packed, scales, cols, group)
    x, xf = x_of(2, cols, torch.bfloat16, seed=4)
    for ids, x_div in (([2, 0, 3, 2], 2), ([1, 2], 1)):
        t = torch.tensor(ids, dtype=torch.int32 if x_div > 1 else torch.int64, device=DEVICE)
        y = int4_experts_linear(x[: len(ids) // x_div], w, t, n, x_div, torch.float32)
        for p, e in enumerate(ids):
            We, xp = W[e * n : (e + 1) * n], xf[p // x_div : p // x_div + 1]
            check(y[p : p + 1], xp, We, fp32_bound(xp, We))


def test_int4_scales_weight_round_trips_and_transcodes():
    rows, cols, group = 64, 1024, 32
    packed, scales, zero = asymmetric(rows, cols, group, seed=5)
    scales = with_listed(scales, [0, 63])
    w = Int4ScalesWeight.encode(packed, scales, cols, group, zero)
    assert all(np.array_equal(a, b) for a, b in zip(w.decode(), (packed, scales)))
    assert np.array_equal(w.zero_points(), zero)
    ref = int4.encode_scales_reference(scales)
    assert all(np.array_equal(getattr(w, role).numpy(), ref[role]) for role in int4.SCALE_ROLES)
    assert w.stored_bytes < w.source_bytes  # the scales shrink; the codes stay as they are
    coded, held = Int4Weight.encode(packed, scales, cols, group, zero), int4_weight(packed, scales, cols, group, zero)
    assert isinstance(held, PlainInt4Weight)  # min-max codes: held as stored
    for source in (coded, held):
        t = Int4ScalesWeight.from_int4(source)
        assert all(np.array_equal(getattr(t, role), getattr(w, role)) for role in Int4ScalesWeight.ROLES)


def test_bad_calls_are_refused():
    rows, cols, group = 8, 64, 32
    packed, scales = quantized(rows, cols, group)
    w = weights("scales", packed, scales, cols, group)
    x = torch.zeros(1, cols, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="at most 1 rows"):
        int4_linear(torch.zeros(2, cols, dtype=torch.bfloat16, device=DEVICE), w)
    with pytest.raises(ValueError, match="features"):
        int4_linear(torch.zeros(1, cols + 8, dtype=torch.bfloat16, device=DEVICE), w)
    with pytest.raises(ValueError, match="float16 or float32"):
        int4_linear(x.to(torch.float64), w)
    with pytest.raises(TypeError, match="Int4Weight"):
        int4_linear(x, Int4Weight.encode(packed, scales, cols, group).to(DEVICE))
    odd = quantized(4, 36, 12)
    pa, sa, za = asymmetric(rows, cols, group)
    with pytest.raises(ValueError, match="symmetric codes"):
        int4_linear(x, weights("scales", pa, sa, cols, group, za))
    with pytest.raises(ValueError, match="multiple of 8"):
        int4_linear(torch.zeros(1, 36, device=DEVICE), plain(*odd, 36, 12).to(DEVICE))
    ids = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="do not stack|does not stack"):
        int4_experts_linear(x, w, ids[:1], 3)
    with pytest.raises(ValueError, match="ids for"):
        int4_experts_linear(x, w, ids, 4)
    with pytest.raises(ValueError, match="int4-scales stream 'sbase'"):
        Int4ScalesWeight(**{r: getattr(w, r).cpu() for r in Int4ScalesWeight.ROLES if r != "sbase"},
                         sbase=torch.zeros(rows + 1, dtype=torch.uint8), rows=rows, cols=cols, group=group)  # fmt: skip


@gpu
def test_on_the_gpu_the_two_weights_give_the_same_product():
    """On CUDA: coded scales change nothing in the sum (the same fp32 operations)."""
    rows, cols, group = 512, 7168, 32
    packed, scales = quantized(rows, cols, group, seed=11)
    x, _ = x_of(1, cols, torch.bfloat16, seed=3)
    a = int4_linear(x, weights("plain", packed, scales, cols, group), torch.float32)
    b = int4_linear(x, weights("scales", packed, scales, cols, group), torch.float32)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.slow  # about a minute through the interpreter: 2 x 6 pairs of 32 programs
def test_int4_layers_in_the_gpu_layout_run_the_gemv():
    """Int4Experts and Int4Linear moved to the GPU's layout (gpu_layout(): codes as stored, scales
    coded) run the W4A16 GEMV, grouped over every (token, slot) pair, and give the reference's
    products; asymmetric codes have no GPU layout."""
    from unweight.runtime.layers.int4_experts import Int4Experts, reference_int4_experts
    from unweight.runtime.layers.int4_linear import Int4Linear

    e, h, i, group = 3, 64, 32, 32
    w13 = [quantized(2 * i, h, group, seed=s) for s in range(e)]
    w2 = [quantized(h, i, group, seed=10 + s) for s in range(e)]

    def stack(parts, k):
        return torch.from_numpy(np.stack([p[k] for p in parts]))

    cpu = Int4Experts.from_packed(stack(w13, 0), stack(w13, 1).view(torch.bfloat16), stack(w2, 0),
                                  stack(w2, 1).view(torch.bfloat16), group)  # fmt: skip
    layer = cpu.gpu_layout().to(DEVICE)
    assert layer.on_gpu_layout and layer.w13.device.type == DEVICE and not cpu.on_gpu_layout
    rng = np.random.default_rng(4)
    x = torch.from_numpy(rng.standard_normal((3, h)).astype(np.float32))
    ids = torch.from_numpy(rng.integers(0, e, (3, 2)))
    weights = torch.from_numpy(rng.random((3, 2)).astype(np.float32))
    for on_input in (False, True):
        got = layer(x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), "silu", on_input).double().cpu()
        want = reference_int4_experts(cpu, x, weights, ids, "silu", on_input)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()

    lin = Int4Linear.from_packed(torch.from_numpy(w2[0][0]), torch.from_numpy(w2[0][1]).view(torch.bfloat16), group)
    g = lin.gpu_layout().to(DEVICE)
    xs = torch.from_numpy(rng.standard_normal((2, 2, i)).astype(np.float32))
    assert torch.allclose(g(xs.to(DEVICE)).cpu(), lin(xs), rtol=1e-5, atol=1e-5)
    assert g(xs[:0].to(DEVICE)).shape == (0, 2, lin.out_features)

    pa, sa, za = asymmetric(h, i, group)
    asym = Int4Linear.from_packed(torch.from_numpy(pa), torch.from_numpy(sa).view(torch.bfloat16), group,
                                  torch.from_numpy(za))  # fmt: skip
    with pytest.raises(ValueError, match="no GPU layout"):
        asym.gpu_layout()
