"""The decode step's native work between the linears (runtime/kernels/cpu_pointwise.py) against its
reference, the model's torch code (runtime/model/llama.py's RMSNorm, Rope.apply with the cache's
store): bit for bit where the kernels round as torch does (the residual add, rope, the cache),
within one unit in the last place where a sum is taken another way."""

from __future__ import annotations

import pytest
import torch

from unweight.runtime.kernels.cpu_pointwise import rms_norm_cpu, rope_store_cpu
from unweight.runtime.model.config import ModelConfig
from unweight.runtime.model.llama import RMSNorm
from unweight.runtime.model.rope import Rope

DTYPES = [torch.float32, torch.bfloat16]
# How far a norm's value may lie from the reference's: in fp32 its scale (one rsqrt of a sum taken in
# another order) may be an ulp off and move every value of its row by an ulp or two; in BF16 that moves
# only the few values that lay that near a rounding boundary, by one.
ULPS = {torch.float32: (4, 1.0), torch.bfloat16: (1, 0.02)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16).to(torch.int64)


def _near(got: torch.Tensor, want: torch.Tensor, ulps: int, share: float) -> None:
    """Every value within `ulps` of want's in the last place (same sign), at most `share` of them not equal."""
    assert got.dtype == want.dtype and got.shape == want.shape
    apart = (_bits(got) - _bits(want)).abs()
    assert int(apart.max()) <= ulps, f"{int(apart.max())} units apart"
    assert float((apart > 0).float().mean()) <= share, f"{float((apart > 0).float().mean()):.4f} of values differ"


def _norm(n: int, dtype: torch.dtype, seed: int = 0) -> RMSNorm:
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(n, 1e-5)
    norm.weight.data = (1 + torch.randn(n, generator=g) / 4).to(dtype)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_rms_norm_is_the_reference_within_an_ulp(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    norm = _norm(576, dtype)
    ulps, share = ULPS[dtype]
    _near(rms_norm_cpu(x, norm.weight, norm.eps), norm(x), ulps, share)
    _near(norm.native(x), norm(x), ulps, share)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_residual_add_is_torchs_sum_bit_for_bit_and_made_in_place(dtype):
    g = torch.Generator().manual_seed(1)
    x, delta = (torch.randn(5, 576, generator=g).to(dtype) for _ in range(2))
    norm = _norm(576, dtype)
    want_sum = x + delta
    want = norm(want_sum)
    stream = x.clone()
    got = norm.native(stream, residual=delta)
    assert torch.equal(_bits(stream), _bits(want_sum))
    _near(got, want, *ULPS[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7])
def test_rope_and_the_cache_store_are_the_references_bit_for_bit(dtype, rows):
    """q and k rotated as Rope.apply rotates them, k and v stored where KVCache.write_slots stores them."""
    nq, nkv, hd, slots_n = 9, 3, 64, 64
    sizes = dict(vocab_size=10, hidden_size=nq * hd, intermediate_size=8, num_layers=1, num_heads=nq)
    cfg = ModelConfig("llama", **sizes, num_kv_heads=nkv, head_dim=hd, rms_norm_eps=1e-5, max_position_embeddings=512)
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, nq + 2 * nkv, hd, generator=g).to(dtype)
    positions = torch.randint(0, 300, (rows,), generator=g)
    cos, sin = Rope(cfg).cos_sin(positions, dtype)
    slots = torch.randperm(slots_n, generator=g)[:rows]
    q, k, v = qkv.split([nq, nkv, nkv], dim=1)
    want_q, want_k = Rope.apply(q, cos, sin), Rope.apply(k, cos, sin)
    want_kc, want_vc = torch.zeros(slots_n, nkv, hd, dtype=dtype), torch.zeros(slots_n, nkv, hd, dtype=dtype)
    want_kc.index_copy_(0, slots, want_k)
    want_vc.index_copy_(0, slots, v)
    kc, vc = torch.zeros_like(want_kc), torch.zeros_like(want_vc)
    got = qkv.clone()
    rope_store_cpu(got, cos, sin, nq, nkv, kc, vc, slots)
    assert torch.equal(_bits(got[:, :nq]), _bits(want_q)) and torch.equal(_bits(got[:, nq : nq + nkv]), _bits(want_k))
    assert torch.equal(_bits(kc), _bits(want_kc)) and torch.equal(_bits(vc), _bits(want_vc))


def test_bfloat16_rounds_as_torch_rounds_nan_inf_and_ties():
    """The kernels' fp32 -> BF16 rounding is torch's over a row: to nearest even, inf kept, every NaN
    0xFFFF (torch's vectorised conversion; its scalar one would give 0x7FC0)."""
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8])
    x = torch.cat([specials, torch.randn(57)]).view(1, -1)
    norm = RMSNorm(x.shape[1], 1e-5)
    stream, delta = torch.zeros_like(x).bfloat16(), x.bfloat16()
    norm.weight.data = torch.ones(x.shape[1], dtype=torch.bfloat16)
    want = stream + delta  # torch's sum: -0.0 + 0 is 0
    norm.native(stream, residual=delta)
    assert torch.equal(_bits(stream), _bits(want))


def test_bad_arguments_are_refused_with_their_shapes():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="RMSNorm of"):
        rms_norm_cpu(x, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="not taken"):
        rms_norm_cpu(x.t(), torch.ones(2), 1e-5)  # not contiguous: its address would be read as if it were
    with pytest.raises(ValueError, match="residual"):
        rms_norm_cpu(x, torch.ones(8), 1e-5, residual=torch.randn(2, 4))
    qkv, cs = torch.randn(1, 5, 8), torch.randn(1, 8)
    kc = torch.zeros(4, 1, 8)
    with pytest.raises(ValueError, match="heads"):
        rope_store_cpu(qkv, cs, cs, 2, 2, kc, kc.clone(), torch.tensor([0]))
    with pytest.raises(ValueError, match="not taken"):
        rope_store_cpu(qkv.half(), cs, cs, 1, 2, kc, kc.clone(), torch.tensor([0]))
    with pytest.raises(ValueError, match="outside the cache"):
        rope_store_cpu(qkv[:, :3], cs, cs, 1, 1, kc, kc.clone(), torch.tensor([4]))
