"""The resident INT4 layout (runtime/kernels/int4.py) and its CPU kernels (cpu_int4.py): coded
streams decode back to the source's INT32 words, BF16 scale bits and zero-point words exactly,
whatever nibbles, scales and zero points they hold; the Int4Weight value checks its streams; the
kernels rebuild every weight exactly and their products lie within the fp32 summation bound of a
float64 product on the plainly decoded weights; the AVX-512 and AVX2 rows agree with the portable
ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unweight.runtime.kernels import cpu_int4, int4, int4_encode
from unweight.runtime.kernels.cpu_int4_avx2 import FAST_PATH as AVX2_PATH
from unweight.runtime.kernels.cpu_int4_avx512 import FAST_PATH
from unweight.runtime.kernels.weight import Int4Weight, PlainInt4Weight, int4_weight

needs_avx512 = pytest.mark.skipif(not FAST_PATH, reason="the CPU has no AVX-512 (BW) and BMI2")


def quantized(rows: int, cols: int, group: int, seed: int = 0, heavy: bool = False):
    """Symmetric absmax codes of Gaussian (or Student-t(5)) weights, as compressed-tensors packs
    them: (packed int32 (rows, cols / 8), BF16 scale bits uint16 (rows, cols / group))."""
    rng = np.random.default_rng(seed)
    w = rng.standard_t(5, (rows, cols)) if heavy else rng.standard_normal((rows, cols))
    g = w.astype(np.float32).reshape(rows, cols // group, group)
    scale = (np.abs(g).max(-1, keepdims=True) / 7).astype(np.float32)
    scale_bits = (scale.view(np.uint32) >> 16).astype(np.uint16)
    scale = (scale_bits.astype(np.uint32) << 16).view(np.float32)
    codes = (np.clip(np.rint(g / scale), -8, 7) + 8).astype(np.uint8).reshape(rows, cols)
    return int4.pack_nibbles(codes), scale_bits.reshape(rows, cols // group)


def asymmetric(rows: int, cols: int, group: int, seed: int = 0):
    """Asymmetric min-max codes of Gaussian weights with a random offset a row, as compressed-tensors
    packs them: (packed int32 (rows, cols / 8), BF16 scale bits (rows, cols / group), zero-point
    words int32 (ceil(rows / 8), cols / group), packed along the rows)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)) + rng.standard_normal((rows, 1))
    g = w.astype(np.float32).reshape(rows, cols // group, group)
    lo, hi = np.minimum(g.min(-1, keepdims=True), 0), np.maximum(g.max(-1, keepdims=True), 0)
    scale = ((hi - lo) / 15).astype(np.float32)
    scale_bits = (scale.view(np.uint32) >> 16).astype(np.uint16)
    scale = (scale_bits.astype(np.uint32) << 16).view(np.float32)
    zp = np.clip(np.rint(-lo / scale) - 8, -8, 7)
    codes = (np.clip(np.rint(g / scale) + zp, -8, 7) + 8).astype(np.uint8).reshape(rows, cols)
    zero = (zp[..., 0] + 8).astype(np.uint8)
    return int4.pack_nibbles(codes), scale_bits.reshape(rows, cols // group), int4.pack_zero_points(zero)


def dense(packed: np.ndarray, scales: np.ndarray, cols: int, group: int, zero=None) -> np.ndarray:
    """W in float64, (nibble - zero) * scale (zero 8 without zero points): the plain dequantization."""
    s = (scales.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    z = 8 if zero is None else np.repeat(int4.unpack_zero_points(zero, packed.shape[0]), group, axis=1)
    return (int4.unpack_nibbles(packed, cols).astype(np.float64) - z) * np.repeat(s, group, axis=1)


def same_streams(a: dict, b: dict) -> bool:
    """Two encodings' parameters equal and streams identical, byte for byte."""
    return (a["lut"], a["payload_bits"]) == (b["lut"], b["payload_bits"]) and all(
        x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x.view(np.uint8), y.view(np.uint8))
        for x, y in zip(a["streams"].values(), b["streams"].values(), strict=True)
    )


def round_trip(packed, scales, cols, group, zero=None) -> Int4Weight:
    """The weight coded on threads: the reference encoder's streams, and decoded, the source's bits."""
    assert same_streams(
        int4_encode.encode(packed, scales, cols, group, zero), int4.encode_reference(packed, scales, cols, group, zero)
    )
    w = Int4Weight.encode(packed, scales, cols, group, zero)
    back_p, back_s = w.decode()
    assert np.array_equal(back_p.view(np.uint32), packed.view(np.uint32))
    assert np.array_equal(back_s.view(np.uint16), scales.view(np.uint16))
    if zero is None:
        assert w.symmetric and w.zero_points() is None and w.zero.numel() == 0
    else:
        assert not w.symmetric and np.array_equal(w.zero_points().view(np.uint32), zero.view(np.uint32))
    return w


@pytest.mark.parametrize("heavy", [False, True])
def test_quantized_weights_round_trip_and_shrink(heavy):
    rows, cols, group = 64, 1024, 32
    packed, scales = quantized(rows, cols, group, heavy=heavy)
    w = round_trip(packed, scales, cols, group)
    assert w.payload_bits == 3  # symmetric codes use 15 nibbles: 7 short, 8 long
    s = {role: t.numpy() for role, t in w.streams().items()}
    codes = s["sym"].nbytes + s["esc"].nbytes + s["esc_row"].nbytes
    assert codes < packed.nbytes * (0.90 if heavy else 0.96)
    assert w.stored_bytes == int4.resident_bytes(s) < int4.stored_bytes(rows, cols, group)


@pytest.mark.parametrize("used", [1, 6, 7, 8, 9, 12, 15, 16])
def test_any_nibbles_round_trip(used):
    """From one used nibble (no escapes) to all 16 (the nibbles themselves listed in 4 bits), with
    columns that are not whole blocks, groups that are not 32, and more rows than the encoder's
    threads take ranges of (the ranges share index words)."""
    rng = np.random.default_rng(used)
    for rows, cols, group in ((5, 40, 8), (3, 200, 40), (1, 64, 64), (7, 8, 8), (130, 96, 32)):
        nib = rng.choice(rng.permutation(16)[:used], size=(rows, cols), p=None).astype(np.uint8)
        scales = rng.integers(0x3C00, 0x3E00, (rows, cols // group)).astype(np.uint16)
        w = round_trip(int4.pack_nibbles(nib), scales, cols, group)
        longs = max(0, used - int4.SHORT)
        assert w.payload_bits == (4 if longs > 8 else int4.payload_bits(longs) if longs else 0)


def test_any_scales_round_trip():
    """Scales the window does not code are listed: zeros, negative ones, infinities, NaN payloads,
    subnormals, exponents far apart in one row; a row of only those keeps base 0."""
    rng = np.random.default_rng(3)
    packed, scales = quantized(6, 256, 32, seed=3)
    odd = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x807F, 0x3F80, 0x4780, 0x0F80], np.uint16)
    scales[0, :8] = odd[:8]
    scales[1] = rng.choice(odd, 8)
    scales[2] = rng.integers(0, 1 << 16, 8)
    w = round_trip(packed, scales, 256, 32)
    assert int(w.sesc_row[-1]) > 8


def test_zero_points_round_trip():
    """Asymmetric codes keep their zero points, whatever nibbles they hold, for rows that fill their
    words and rows that leave padding (7, 13), odd group counts (a last half-filled byte) and the
    encoder's row ranges; they cost what the source's words hold."""
    rng = np.random.default_rng(7)
    for rows, cols, group in ((8, 256, 32), (7, 200, 40), (13, 96, 32), (130, 64, 64), (300, 512, 32)):
        nib = rng.integers(0, 16, (rows, cols)).astype(np.uint8)
        scales = rng.integers(0x3C00, 0x3E00, (rows, cols // group)).astype(np.uint16)
        zero = int4.pack_zero_points(rng.integers(0, 16, (rows, cols // group)).astype(np.uint8))
        w = round_trip(int4.pack_nibbles(nib), scales, cols, group, zero)
        assert w.zero.numel() == rows * -(-(cols // group) // 2)
    packed, scales, zero = asymmetric(64, 1024, 32)
    w = round_trip(packed, scales, 1024, 32, zero)
    assert w.zero.numel() == zero.nbytes  # as many bytes as the source's words


def test_bad_inputs_are_refused():
    packed, scales = quantized(4, 128, 32)
    for encode in (int4_encode.encode, int4.encode_reference):
        with pytest.raises(ValueError, match="group size 48 does not divide 128"):
            encode(packed, scales, 128, 48)
        with pytest.raises(ValueError, match="do not hold 136 columns"):
            encode(packed, scales, 136, 8)
        with pytest.raises(ValueError, match=r"scales must be \(4, 4\) BF16 bits"):
            encode(packed, scales.astype(np.float32), 128, 32)
        with pytest.raises(ValueError, match="2-D int32"):
            encode(packed.astype(np.int64), scales, 128, 32)
    w = Int4Weight.encode(packed, scales, 128, 32)
    s = w.streams()
    with pytest.raises(ValueError, match="'sym' holds 23 entries"):
        w.with_streams({"sym": s["sym"][:-1]})
    with pytest.raises(ValueError, match="'smant' must be torch.uint8"):
        w.with_streams({"smant": s["smant"].int()})
    with pytest.raises(ValueError, match="payload_bits 5"):
        Int4Weight(**s, rows=4, cols=128, group=32, lut=w.lut, payload_bits=5)
    with pytest.raises(ValueError, match="group 48 does not divide cols 128"):
        Int4Weight(**s, rows=4, cols=128, group=48, lut=w.lut, payload_bits=3)
    with pytest.raises(ValueError, match="16 words after them"):
        w.with_streams({"esc": s["esc"][:15]})
    with pytest.raises(ValueError, match="'zero' holds 3 entries; .* has none \\(symmetric\\) or 8"):
        w.with_streams({"zero": torch.zeros(3, dtype=torch.uint8)})
    zero = int4.pack_zero_points(np.full((4, 4), 8, np.uint8))
    for encode in (int4_encode.encode, int4.encode_reference):
        with pytest.raises(ValueError, match=r"zero points must be \[1, 4\] int32 words, not int32\[4, 4\]"):
            encode(packed, scales, 128, 32, np.zeros((4, 4), np.int32))
        padded = zero.copy()
        padded[0, 1] |= 1 << 28  # row 7 of a 4-row weight
        with pytest.raises(ValueError, match="padding past row 4 is not zero"):
            encode(packed, scales, 128, 32, padded)


def fp32_bound(x: np.ndarray, W: np.ndarray) -> np.ndarray:
    """|y - exact| of an fp32 sum of K products: at most K * 2^-24 * sum |x| |w| (each product of an
    fp32 x and an exact fp32 weight rounded once, then each of K additions)."""
    return (W.shape[1] + 1) * 2.0**-24 * (np.abs(x) @ np.abs(W).T)


def zero_bound(x: np.ndarray, packed, scales, zero, cols: int, group: int) -> np.ndarray:
    """The bound of an asymmetric product taken as the kernels take it: the symmetric sum over
    (nibble - 8) * scale, less the sum over groups of (zero - 8) * scale times x summed over the
    group; each of the K + G + group additions and every product rounded once, on |terms|."""
    sym = dense(packed, scales, cols, group)
    s = np.repeat((scales.astype(np.uint32) << 16).view(np.float32).astype(np.float64), group, axis=1)
    terms = np.repeat(int4.unpack_zero_points(zero, packed.shape[0]).astype(np.float64) - 8, group, axis=1) * s
    return (cols + cols // group + group + 2) * 2.0**-24 * (np.abs(x) @ (np.abs(sym) + np.abs(terms)).T)


needs_avx2 = pytest.mark.skipif(not AVX2_PATH, reason="the CPU has no AVX2 and FMA")


def kernels(fast: bool | str):
    """The `fast` argument of the CPU kernels, skipped where the CPU lacks what it asks for."""
    if fast == "avx2":
        return pytest.param(fast, marks=needs_avx2, id="avx2")
    return pytest.param(fast, marks=needs_avx512 if fast else (), id="avx512" if fast else "portable")


@pytest.mark.parametrize("fast", [kernels(False), kernels(True), kernels("avx2")])
@pytest.mark.parametrize("heavy", [False, True])
def test_rows_and_products(fast, heavy):
    rows, cols, group = 300, 512, 32
    packed, scales = quantized(rows, cols, group, seed=5, heavy=heavy)
    scales[7, 3] = 0x8000 | scales[7, 3]  # a listed scale, negative
    w = Int4Weight.encode(packed, scales, cols, group)
    W = dense(packed, scales, cols, group)
    got = cpu_int4.int4_rows_cpu(w, 0, rows, fast=fast).numpy()
    assert np.array_equal(got.view(np.uint32), W.astype(np.float32).view(np.uint32))
    assert np.array_equal(cpu_int4.int4_rows_cpu(w, 10, 13, fast=fast).numpy(), got[10:13])
    rng = np.random.default_rng(1)
    for m in (1, 3, 6, cpu_int4.GEMV_ROWS, cpu_int4.GEMV_ROWS + 1, 40):
        x = rng.standard_normal((m, cols)).astype(np.float32)
        exact, bound = x.astype(np.float64) @ W.T, fp32_bound(x, W)
        for y in (
            cpu_int4.int4_linear_cpu(torch.from_numpy(x), w, fast=fast),
            cpu_int4.plain_int4_linear_cpu(
                torch.from_numpy(x),
                torch.from_numpy(packed),
                torch.from_numpy(scales).view(torch.bfloat16),
                group,
                fast=fast,
            ),
        ):
            assert y.shape == (m, rows) and np.all(np.abs(y.numpy() - exact) <= bound), m
    xb = torch.from_numpy(x).to(torch.bfloat16)  # BF16 x is widened exactly
    exact = xb.float().numpy().astype(np.float64) @ W.T
    assert np.all(
        np.abs(cpu_int4.int4_linear_cpu(xb, w, fast=fast).numpy() - exact) <= fp32_bound(xb.float().numpy(), W)
    )


@needs_avx512
@pytest.mark.parametrize("cols, group", [(1152, 32), (2048, 1024)])
def test_chunked_product_over_tiles(cols, group):
    """More than GEMV_ROWS rows of x (GEMV_ROWS_BF16 for BF16 x) take the chunked AVX-512 product:
    column tiles (a last one part filled) whose escapes carry over, several chunks of x's rows and
    a last one part-filled, row blocks of W and a row range; coded and uncoded, fp32 and BF16 x,
    within the fp32 bound."""
    rows = 2 * cpu_int4.CHUNK_W + 7
    packed, scales = quantized(rows, cols, group, seed=cols, heavy=True)
    w = Int4Weight.encode(packed, scales, cols, group)
    W = dense(packed, scales, cols, group)
    rng = np.random.default_rng(2)
    for m in (3, 6, cpu_int4.GEMV_ROWS + 1, 17, 3 * cpu_int4.CHUNK):  # BF16: chunks of 4, 8 and 16 rows
        x = rng.standard_normal((m, cols)).astype(np.float32)
        exact, bound = x.astype(np.float64) @ W.T, fp32_bound(x, W)
        plain = cpu_int4.plain_int4_linear_cpu(
            torch.from_numpy(x), torch.from_numpy(packed), torch.from_numpy(scales).view(torch.bfloat16), group
        )
        for y in (cpu_int4.int4_linear_cpu(torch.from_numpy(x), w), plain):
            assert y.shape == (m, rows) and np.all(np.abs(y.numpy() - exact) <= bound), m
        part = cpu_int4.int4_linear_cpu(torch.from_numpy(x), w, rows=(5, rows - 3)).numpy()
        assert np.all(np.abs(part - exact[:, 5 : rows - 3]) <= bound[:, 5 : rows - 3]), m
        # BF16 x: integer weights and BF16 pairs (vdpbf16ps) where the CPU has AVX512_BF16
        xb = torch.from_numpy(x).to(torch.bfloat16)
        xf = xb.float().numpy()
        exact, bound = xf.astype(np.float64) @ W.T, fp32_bound(xf, W)
        plain = cpu_int4.plain_int4_linear_cpu(
            xb, torch.from_numpy(packed), torch.from_numpy(scales).view(torch.bfloat16), group
        )
        for y in (cpu_int4.int4_linear_cpu(xb, w), plain):
            assert np.all(np.abs(y.numpy() - exact) <= bound), m
        part = cpu_int4.int4_linear_cpu(xb, w, rows=(5, rows - 3)).numpy()
        assert np.all(np.abs(part - exact[:, 5 : rows - 3]) <= bound[:, 5 : rows - 3]), m


@pytest.mark.parametrize("fast", [kernels(False), kernels(True), kernels("avx2")])
def test_asymmetric_rows_and_products(fast):
    """Zero points through every product: rows decoded exactly as (nibble - zero) * scale, the GEMV,
    the chunked products (fp32 and BF16 x) and the GEMM past GEMV_ROWS, a row range, within the
    bound of the symmetric sum and the zero points' terms."""
    rows, cols, group = 300, 512, 32
    packed, scales, zero = asymmetric(rows, cols, group, seed=6)
    scales[7, 3] = 0x8000 | scales[7, 3]  # a listed scale, negative
    w = Int4Weight.encode(packed, scales, cols, group, zero)
    W = dense(packed, scales, cols, group, zero)
    got = cpu_int4.int4_rows_cpu(w, 0, rows, fast=fast).numpy()
    assert np.array_equal(got.view(np.uint32), W.astype(np.float32).view(np.uint32))
    assert np.array_equal(cpu_int4.int4_rows_cpu(w, 10, 13, fast=fast).numpy(), got[10:13])
    rng = np.random.default_rng(3)
    for m in (1, 3, cpu_int4.GEMV_ROWS, cpu_int4.GEMV_ROWS + 1, 40):
        x = rng.standard_normal((m, cols)).astype(np.float32)
        xb = torch.from_numpy(x).to(torch.bfloat16)
        for xt in (torch.from_numpy(x), xb):
            xf = xt.float().numpy()
            exact, bound = xf.astype(np.float64) @ W.T, zero_bound(xf, packed, scales, zero, cols, group)
            y = cpu_int4.int4_linear_cpu(xt, w, fast=fast).numpy()
            assert y.shape == (m, rows) and np.all(np.abs(y - exact) <= bound), (m, xt.dtype)
            part = cpu_int4.int4_linear_cpu(xt, w, fast=fast, rows=(5, rows - 3)).numpy()
            assert np.all(np.abs(part - exact[:, 5 : rows - 3]) <= bound[:, 5 : rows - 3]), (m, xt.dtype)
    sym = Int4Weight.encode(packed, scales, cols, group)  # the same codes read as symmetric: other weights
    x = torch.from_numpy(rng.standard_normal((1, cols)).astype(np.float32))
    assert not torch.allclose(cpu_int4.int4_linear_cpu(x, sym, fast=fast), cpu_int4.int4_linear_cpu(x, w, fast=fast))


@pytest.mark.parametrize("fast", [kernels(False), kernels(True), kernels("avx2")])
@pytest.mark.parametrize("zero_points", [False, True])
def test_codes_the_layout_would_not_shrink_are_held_as_stored(fast, zero_points):
    """Codes spread evenly over the 16 nibbles (min-max codes come near it) would take more bytes
    coded than stored: int4_weight holds them as the source does (PlainInt4Weight, no byte more),
    with the same rows, products and bits back; peaked codes it codes."""
    rows, cols, group = 96, 512, 32
    rng = np.random.default_rng(12)
    packed = int4.pack_nibbles(rng.integers(0, 16, (rows, cols)).astype(np.uint8))
    scales = rng.integers(0x3C00, 0x3C80, (rows, cols // group)).astype(np.uint16)
    zero = int4.pack_zero_points(rng.integers(0, 16, (rows, cols // group)).astype(np.uint8)) if zero_points else None
    w = int4_weight(packed, scales, cols, group, zero)
    assert isinstance(w, PlainInt4Weight) and w.symmetric is not zero_points
    assert w.stored_bytes == w.source_bytes == int4.stored_bytes(rows, cols, group, zero_points)
    assert Int4Weight.encode(packed, scales, cols, group, zero).stored_bytes > w.stored_bytes
    back_p, back_s = w.decode()
    assert np.array_equal(back_p.view(np.uint32), packed.view(np.uint32)) and np.array_equal(back_s, scales)
    assert zero is None and w.zero_points() is None or np.array_equal(w.zero_points(), zero)
    W = dense(packed, scales, cols, group, zero)
    assert np.array_equal(cpu_int4.int4_rows_cpu(w, 0, rows).numpy(), W.astype(np.float32))
    assert np.array_equal(cpu_int4.int4_rows_cpu(w, 7, 20).numpy(), W[7:20].astype(np.float32))
    for m in (1, 3, cpu_int4.ZERO_FUSED_ROWS + 1, 40):
        x = rng.standard_normal((m, cols)).astype(np.float32)
        for xt in (torch.from_numpy(x), torch.from_numpy(x).to(torch.bfloat16)):
            xf = xt.float().numpy()
            exact = xf.astype(np.float64) @ W.T
            bound = zero_bound(xf, packed, scales, zero, cols, group) if zero_points else fp32_bound(xf, W)
            y = cpu_int4.int4_linear_cpu(xt, w, fast=fast).numpy()
            assert np.all(np.abs(y - exact) <= bound), (m, xt.dtype)
            part = cpu_int4.int4_linear_cpu(xt, w, fast=fast, rows=(5, rows - 3)).numpy()
            assert np.all(np.abs(part - exact[:, 5 : rows - 3]) <= bound[:, 5 : rows - 3]), (m, xt.dtype)
    peaked, peaked_scales = quantized(rows, cols, group)
    assert isinstance(int4_weight(peaked, peaked_scales, cols, group), Int4Weight)
    with pytest.raises(ValueError, match="int4-plain stream 'zero' holds 3 entries"):
        w.with_streams({"zero": torch.zeros(3, dtype=torch.uint8)})


@pytest.mark.parametrize("case", ["gaussian", "student-t", "asymmetric", "flat", "one nibble", "odd columns"])
def test_code_bytes_weighs_the_layout_before_coding(case):
    """int4_weight decides from the nibbles' histogram and the coded scales (int4_encode.code_bytes):
    those bytes are the coded weight's, exactly, whatever the codes."""
    rows, cols, group, zero = 40, 320 if case != "odd columns" else 200, 8 if case == "odd columns" else 32, None
    if case == "asymmetric":
        packed, scales, zero = asymmetric(rows, cols, group, seed=4)
    else:
        packed, scales = quantized(rows, cols, group, seed=4, heavy=case == "student-t")
    if case in ("flat", "one nibble"):
        nib = np.random.default_rng(4).integers(0, 16, (rows, cols)) if case == "flat" else np.full((rows, cols), 9)
        packed = int4.pack_nibbles(nib.astype(np.uint8))
    coded = Int4Weight.encode(packed, scales, cols, group, zero)
    scale_bytes = int4.resident_bytes(int4_encode.encode_scales(scales))
    assert int4_encode.code_bytes(packed, cols) + scale_bytes + coded.zero.numel() == coded.stored_bytes
    w = int4_weight(packed, scales, cols, group, zero)
    assert isinstance(w, Int4Weight if coded.stored_bytes < coded.source_bytes else PlainInt4Weight)
    assert all(np.array_equal(a, b) for a, b in zip(w.decode(), coded.decode()))


def test_portable_kernels_take_any_shape():
    """Columns that are not whole blocks and groups under 32 or not powers of two go to the portable
    kernels, which the AVX-512 ones refuse by name."""
    for rows, cols, group in ((9, 200, 40), (4, 96, 16)):
        packed, scales = quantized(rows, cols, group, seed=cols)
        w = Int4Weight.encode(packed, scales, cols, group)
        W = dense(packed, scales, cols, group)
        assert np.array_equal(cpu_int4.int4_rows_cpu(w, 0, rows).numpy(), W.astype(np.float32))
        x = np.random.default_rng(0).standard_normal((2, cols)).astype(np.float32)
        y = cpu_int4.int4_linear_cpu(torch.from_numpy(x), w).numpy()
        assert np.all(np.abs(y - x.astype(np.float64) @ W.T) <= fp32_bound(x, W))
        with pytest.raises(ValueError, match="AVX-512 INT4 rows need"):
            cpu_int4.int4_linear_cpu(torch.from_numpy(x), w, fast=True)
    with pytest.raises(ValueError, match=r"x must be a \(M, 96\) CPU tensor"):
        cpu_int4.int4_linear_cpu(torch.zeros(2, 95), w)
    with pytest.raises(ValueError, match="rows 3..9 are not within"):
        cpu_int4.int4_rows_cpu(w, 3, 9)


@pytest.mark.parametrize("fast", [kernels(False), kernels(True), kernels("avx2")])
def test_rows_for_every_payload_width(fast):
    """The kernels' escapes at 0 to 4 index bits (1, 8, 9, 11, 15 and 16 nibbles used)."""
    rng = np.random.default_rng(9)
    for used in (1, 8, 9, 11, 15, 16):
        nib = rng.choice(rng.permutation(16)[:used], size=(33, 256)).astype(np.uint8)
        packed, scales = int4.pack_nibbles(nib), rng.integers(0x3C00, 0x3E00, (33, 8)).astype(np.uint16)
        w = Int4Weight.encode(packed, scales, 256, 32)
        W = dense(packed, scales, 256, 32).astype(np.float32)
        assert np.array_equal(cpu_int4.int4_rows_cpu(w, 0, 33, fast=fast).numpy(), W), used
        x = rng.standard_normal((1, 256)).astype(np.float32)
        y = cpu_int4.int4_linear_cpu(torch.from_numpy(x), w, fast=fast).numpy()
        assert np.all(np.abs(y - x.astype(np.float64) @ W.T.astype(np.float64)) <= fp32_bound(x, W)), used


@pytest.mark.parametrize("fast", [kernels(False), kernels(True), kernels("avx2")])
def test_a_row_range_of_a_stacked_weight(fast):
    """An expert of a stacked experts weight: rows r0 .. r1 alone, for one row of x and for many."""
    packed, scales = quantized(96, 128, 32, seed=11)
    w = Int4Weight.encode(packed, scales, 128, 32)
    W = dense(packed, scales, 128, 32)
    x = np.random.default_rng(2).standard_normal((12, 128)).astype(np.float32)
    for m in (1, 12):
        y = cpu_int4.int4_linear_cpu(torch.from_numpy(x[:m]), w, fast=fast, rows=(32, 64)).numpy()
        assert y.shape == (m, 32)
        assert np.all(np.abs(y - x[:m].astype(np.float64) @ W[32:64].T) <= fp32_bound(x[:m], W[32:64]))
    with pytest.raises(ValueError, match="rows 64..97 are not within"):
        cpu_int4.int4_linear_cpu(torch.from_numpy(x), w, rows=(64, 97))


def test_int4_experts_layer_runs_the_routed_experts():
    """Int4Experts from vLLM's stacked compressed-tensors tensors: each routed expert on its tokens,
    weighted on the output or on the input, against the plain fp64 product on the decoded weights;
    bad ids and shapes are named."""
    from unweight.runtime.layers.int4_experts import Int4Experts, reference_int4_experts

    e, h, i, group = 4, 128, 64, 32
    w13 = [quantized(2 * i, h, group, seed=s) for s in range(e)]
    w2 = [quantized(h, i, group, seed=10 + s) for s in range(e)]

    def stack(parts, k):
        return torch.from_numpy(np.stack([p[k] for p in parts]))

    scales13, scales2 = stack(w13, 1).view(torch.bfloat16), stack(w2, 1).view(torch.bfloat16)
    layer = Int4Experts.from_packed(stack(w13, 0), scales13, stack(w2, 0), scales2.float(), group)
    assert layer.stored_bytes == sum(b.numel() * b.element_size() for b in layer.buffers())  # what vLLM counts
    rng = np.random.default_rng(4)
    x = torch.from_numpy(rng.standard_normal((11, h)).astype(np.float32))
    ids = torch.from_numpy(rng.integers(0, e, (11, 2)))
    weights = torch.from_numpy(rng.random((11, 2)).astype(np.float32))
    for on_input in (False, True):
        got = layer(x, weights, ids, "silu", on_input).double()
        want = reference_int4_experts(layer, x, weights, ids, "silu", on_input)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()
    with pytest.raises(ValueError, match="expert ids 0..4 are not within the 4 experts"):
        layer(x, weights, torch.full_like(ids, 4).index_fill_(0, torch.tensor([0]), 0))
    with pytest.raises(ValueError, match="not BF16 values"):
        Int4Experts.from_packed(stack(w13, 0), scales13.float() * 1.001, stack(w2, 0), scales2, group)


def test_asymmetric_int4_experts():
    """Experts whose codes have zero points (vLLM's w13/w2_weight_zero_point, packed along each
    expert's rows), against the plain fp64 product on their dequantized weights."""
    from unweight.runtime.layers.int4_experts import Int4Experts, reference_int4_experts

    e, h, i, group = 3, 128, 64, 32
    w13 = [asymmetric(2 * i, h, group, seed=s) for s in range(e)]
    w2 = [asymmetric(h, i, group, seed=10 + s) for s in range(e)]

    def stack(parts, k):
        return torch.from_numpy(np.stack([p[k] for p in parts]))

    args = (stack(w13, 0), stack(w13, 1).view(torch.bfloat16), stack(w2, 0), stack(w2, 1).view(torch.bfloat16))
    layer = Int4Experts.from_packed(*args, group, stack(w13, 2), stack(w2, 2))
    assert not layer.w13.symmetric and not layer.w2.symmetric
    assert isinstance(layer.w13, PlainInt4Weight)  # min-max codes: held as stored (coded they would be larger)
    w13_dense, _ = layer.dense()
    assert np.array_equal(w13_dense[1].numpy(), dense(*w13[1][:2], h, group, w13[1][2]).astype(np.float32))
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.standard_normal((9, h)).astype(np.float32))
    ids = torch.from_numpy(rng.integers(0, e, (9, 2)))
    weights = torch.from_numpy(rng.random((9, 2)).astype(np.float32))
    got = layer(x, weights, ids).double()
    want = reference_int4_experts(layer, x, weights, ids)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()
    with pytest.raises(ValueError, match=r"zero points \[3, 128, 4\] do not fit codes"):
        Int4Experts.from_packed(*args, group, stack(w13, 2).repeat(1, 8, 1), stack(w2, 2))
