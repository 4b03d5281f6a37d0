"""UnweightExperts (runtime/layers/experts.py): routed MoE experts in the serving layout, against the
plain fp32 computation on the dense weights (`reference_experts`), each pipeline forced."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the CUDA pipeline's kernels, on the CPU; before triton loads

from unweight.runtime.layers.autotune import FORCE_ENV  # noqa: E402
from unweight.runtime.layers.experts import UnweightExperts, act_and_mul, reference_experts  # noqa: E402
from unweight.runtime.layers.experts_kernels import CudaFused  # noqa: E402


def make_experts(e: int, h: int, i: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Trained-like BF16 w13 (E, 2I, H) and w2 (E, H, I), escapes (zeros, subnormals, large) mixed in."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g) * 0.05).to(torch.bfloat16)
    for w in (w13, w2):
        flat = w.view(torch.int16).view(-1)
        flat[::41] = 0x0001
        flat[7::53] = -15872  # -32.0
        flat[3::61] = 0
    return w13, w2


def u16(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def routing(t: int, k: int, e: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return torch.softmax(torch.randn(t, k, generator=g), -1), ids


@pytest.mark.parametrize("pipeline", ["fused", "decode_matmul"])
@pytest.mark.parametrize("h,i", [(64, 48), (40, 24)])  # 40: rows whose length is not a multiple of 8 (portable path)
def test_pipelines_match_the_reference(pipeline, h, i, monkeypatch):
    monkeypatch.setenv(FORCE_ENV, pipeline)
    e, k = 6, 2
    w13, w2 = make_experts(e, h, i, seed=h)
    layer = UnweightExperts.from_values(u16(w13), u16(w2), e, h, i)
    for t, on_input in ((1, False), (5, False), (3, True)):
        kk = 1 if on_input else k  # vLLM applies router weights on the input only at top-1
        weights, ids = routing(t, kk, e, seed=t)
        x = torch.randn(t, h, generator=torch.Generator().manual_seed(t))
        got = layer(x, weights, ids, "silu", on_input)
        want = reference_experts(x, w13, w2, weights, ids, "silu", on_input)
        assert got.shape == (t, h) and got.dtype == x.dtype
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pipeline", ["fused", "decode_matmul"])
def test_bf16_input_computes_in_bf16_on_the_cpu(pipeline, monkeypatch):
    """BF16 x on the CPU stays BF16 (as a BF16 model's UnweightLinear does): the fused pipeline's
    grouped GEMV takes it through vdpbf16ps where the CPU has it (groups padded past x among the
    routed experts), decode_matmul multiplies BF16 experts; both within BF16 rounding of the fp32
    reference and of each other."""
    from unweight.runtime.kernels import cpu_gemv

    monkeypatch.setenv(FORCE_ENV, pipeline)
    calls = []
    kernel = cpu_gemv._gemv_grouped_chunk_bf16_at
    monkeypatch.setattr(cpu_gemv, "_gemv_grouped_chunk_bf16_at", lambda *a: calls.append(a[1]) or kernel(*a))
    e, h, i, k = 6, 128, 64, 2
    w13, w2 = make_experts(e, h, i, seed=11)
    layer = UnweightExperts.from_values(u16(w13), u16(w2), e, h, i)
    weights, ids = routing(9, k, e, seed=2)
    x = torch.randn(9, h, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    got = layer(x, weights, ids)
    want = reference_experts(x, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16 and got.shape == (9, h)
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05 * want.abs().mean().item())
    fp32 = layer(x.float(), weights, ids).to(torch.bfloat16)  # computed in fp32, rounded once
    assert not torch.equal(got.view(torch.int16), fp32.view(torch.int16)), "BF16 x was computed in fp32"
    fused_bf16 = pipeline == "fused" and cpu_gemv.CHUNK_DOT
    assert calls == ([18, 18] if fused_bf16 else []), calls  # w13 and w2, 9 tokens x 2 slots


def test_expert_weights_are_the_stored_experts_bit_for_bit():
    e, h, i = 5, 32, 16
    w13, w2 = make_experts(e, h, i, seed=3)
    layer = UnweightExperts.from_values(u16(w13), u16(w2), e, h, i)
    a, b = layer.expert_weights([4, 0, 4], torch.bfloat16)
    assert torch.equal(a.view(torch.int16), w13[[4, 0, 4]].view(torch.int16))
    assert torch.equal(b.view(torch.int16), w2[[4, 0, 4]].view(torch.int16))
    assert layer.stored_bytes < (w13.numel() + w2.numel()) * 2


def test_gelu_and_a_repeated_expert():
    e, h, i = 3, 32, 16
    w13, w2 = make_experts(e, h, i, seed=5)
    layer = UnweightExperts.from_values(u16(w13), u16(w2), e, h, i)
    ids = torch.tensor([[1, 1], [2, 0]])  # one token routed twice to the same expert: both slots count
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    x = torch.randn(2, h)
    torch.testing.assert_close(
        layer(x, weights, ids, "gelu"), reference_experts(x, w13, w2, weights, ids, "gelu"), rtol=1e-4, atol=1e-5
    )


def test_bad_input_is_refused_with_the_reason():
    e, h, i = 3, 32, 16
    w13, w2 = make_experts(e, h, i)
    layer = UnweightExperts.from_values(u16(w13), u16(w2), e, h, i)
    x = torch.randn(2, h)
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 3\)"):
        layer(x, torch.ones(2, 1), torch.tensor([[0], [3]]))
    with pytest.raises(ValueError, match="activation 'relu'"):
        layer(x, torch.ones(2, 1), torch.tensor([[0], [1]]), "relu")
    with pytest.raises(ValueError, match="hidden size 32"):
        layer(torch.randn(2, 31), torch.ones(2, 1), torch.tensor([[0], [1]]))
    with pytest.raises(ValueError, match="need"):
        UnweightExperts.from_values(u16(w13), u16(w2)[:-1], e, h, i)


@pytest.mark.parametrize("on_input", [False, True])
@pytest.mark.slow
def test_cuda_fused_pipeline_composes_the_grouped_gemv(on_input):
    """The CUDA `fused` pipeline (two grouped GEMV launches and the activation between them) on
    experts encoded for a GPU (qtiles), through Triton's interpreter without one: BF16 compute,
    so within BF16 rounding of the fp32 reference."""
    e, h, i, t = 4, 64, 32, 3
    k = 1 if on_input else 2
    w13, w2 = make_experts(e, h, i, seed=11)
    layer = UnweightExperts.from_values(u16(w13), u16(w2), e, h, i, device="cuda")  # qtiles, still on the CPU
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layer = layer.to(device) if device == "cuda" else layer
    weights, ids = routing(t, k, e, seed=2)
    ids[0, 0] = ids[-1, 0]  # an expert taken by two tokens
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    wb = weights.to(torch.bfloat16)
    got = CudaFused.apply(layer, x.to(device), wb.to(device), ids.to(device), "silu", on_input)
    # the reference, rounded to BF16 where the pipeline rounds: each GEMV's output and the activation's
    want = torch.zeros(t, h)
    for tok in range(t):
        for j in range(k):
            ex, wj = int(ids[tok, j]), wb[tok, j]
            xt = (x[tok] * wj) if on_input else x[tok]
            hid = act_and_mul((xt.float() @ w13[ex].float().T).to(torch.bfloat16), "silu")
            y = (hid.float() @ w2[ex].float().T).to(torch.bfloat16).float()
            want[tok] += y if on_input else wj.float() * y
    assert got.shape == (t, h)
    err = (got.float().cpu() - want).abs().max()
    assert err <= 2**-6 * want.abs().max(), (err, want.abs().max())  # the -32.0 escapes make large sums that cancel
