"""A CPU decode step's plan of native calls (runtime/model/native_step.py) gives the bits of the
layers' own native path, for every family it takes (rope scaling, a sliding window, biases), in
fp32 and BF16, at one row and at several; it makes way for the layers' path where the kernels do not
take a model, and is made again when a layer's weights are replaced."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_families import _configs, make_model
from torch import nn

import unweight
from unweight.runtime.kernels.cpu_gemv import gemv_call

FAMILIES = ["llama3.1-rope-scaling", "mistral-sliding-window", "llama-attention-and-mlp-bias", "qwen2-qkv-bias"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root, configs = tmp_path_factory.mktemp("native"), _configs()
    out = {}
    for family in [*FAMILIES, "qwen3-qk-norm"]:
        src = make_model(configs[family], root / family / "bf16")
        unweight.compress(src, root / family / "uw")
        out[family] = root / family / "uw"
    return out


class Dense(nn.Module):
    """A plain linear of another kind than nn.Linear (benchmarks/step_profile.py's dense twin is one)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def pair(folder, dtype: str):
    """The model twice: with the plan, and without it (the layers' native path)."""
    planned, layered = unweight.load(folder, dtype=dtype), unweight.load(folder, dtype=dtype)
    layered._native_step = lambda x: None
    return planned, layered


def prefilled(folder, length: int) -> tuple:
    """pair() in fp32 with one prompt of `length` ids prefilled on both: (planned, layered, their
    sequences, the first greedy token)."""
    planned, layered = pair(folder, "float32")
    prompt = torch.arange(length)
    seqs = planned.new_sequence(), layered.new_sequence()
    token = int(planned.prefill(seqs[0], prompt).argmax())
    layered.prefill(seqs[1], prompt)
    return planned, layered, seqs, token


def steps(planned, layered, prompts, count: int) -> list[torch.Tensor]:
    """Prefill `prompts` on both, then `count` greedy decode steps of all of them and one of the
    first alone; each step's logits must be the same bits. Returns the planned model's logits."""
    seqs = [(planned.new_sequence(), layered.new_sequence()) for _ in prompts]
    tokens = []
    for (a, b), prompt in zip(seqs, prompts):
        first = planned.prefill(a, prompt)
        assert torch.equal(first.view(torch.int32), layered.prefill(b, prompt).view(torch.int32))
        tokens.append(int(first.argmax()))
    out = []
    for i in range(count):
        rows = seqs if i % 2 == 0 else seqs[:1]
        got = planned.decode_step([a for a, _ in rows], tokens[: len(rows)])
        want = layered.decode_step([b for _, b in rows], tokens[: len(rows)])
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"step {i}"
        tokens[: len(rows)] = got.argmax(-1).tolist()
        out.append(got)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_plan_gives_the_layers_bits(family, dtype, folders, monkeypatch):
    monkeypatch.setenv("UNWEIGHT_PIPELINE", "fused")  # tiny layers: the autotuner may pick decode_matmul
    planned, layered = pair(folders[family], dtype)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (20, 3, 9)]  # 20: past the window of 8
    steps(planned, layered, prompts, 6)
    compute = planned.compute_dtype
    taken = gemv_call(planned.model.layers[0].self_attn.qkv_proj.compressed_weight, compute) is not None
    # BF16 where the chunk kernels write BF16 (avx512_bf16 with VBMI2 and GFNI), fp32 wherever they run
    assert {k: v is not None for k, v in planned._native_steps.items()} == {(3, compute): taken, (1, compute): taken}


def test_a_model_the_kernels_do_not_take_steps_through_its_layers(folders, monkeypatch):
    """q/k norms (Qwen3) are not in the plan; nor is a pipeline other than the fused GEMV, nor a
    linear of another kind."""
    monkeypatch.setenv("UNWEIGHT_PIPELINE", "fused")
    planned, layered = pair(folders["qwen3-qk-norm"], "float32")
    steps(planned, layered, [torch.arange(5)], 2)
    assert list(planned._native_steps.values()) == [None]

    monkeypatch.setenv("UNWEIGHT_PIPELINE", "decode_matmul")
    planned, layered = pair(folders["llama3.1-rope-scaling"], "float32")
    steps(planned, layered, [torch.arange(5)], 2)
    assert list(planned._native_steps.values()) == [None]

    monkeypatch.setenv("UNWEIGHT_PIPELINE", "fused")  # one linear a module of another kind, without in_features
    planned, layered = pair(folders["llama3.1-rope-scaling"], "float32")
    for model in (planned, layered):
        mlp = model.model.layers[0].mlp
        mlp.down_proj = Dense(mlp.down_proj.decoded_weight(torch.float32))
    steps(planned, layered, [torch.arange(5)], 2)
    assert list(planned._native_steps.values()) == [None]


def test_weights_replaced_after_a_step_make_a_new_plan(folders, monkeypatch):
    """A norm's weight and a linear's weight value replaced between steps, then a whole linear: each
    next step reads the new ones (a stale plan would read the old addresses)."""
    monkeypatch.setenv("UNWEIGHT_PIPELINE", "fused")
    planned, layered, seqs, token = prefilled(folders["llama3.1-rope-scaling"], 7)

    def replace_values(model):
        layer = model.model.layers[1]
        norm = layer.post_attention_layernorm
        norm.weight = nn.Parameter(norm.weight * 1.5, requires_grad=False)
        down = layer.mlp.down_proj
        down.assign_weight(type(down).from_weight(-down.decoded_weight()).compressed_weight)

    def replace_module(model):
        attn = model.model.layers[0].self_attn
        attn.o_proj = type(attn.o_proj).from_weight(attn.o_proj.decoded_weight().flip(0))

    planned.decode_step([planned.new_sequence(), planned.new_sequence()], [token, token])  # a plan of 2 rows too
    assert list(planned._native_steps) == [(2, torch.float32)]
    for replace in (None, replace_values, replace_module):
        before = planned._native_steps.get((1, torch.float32))
        if replace is not None:
            replace(planned)
            replace(layered)
        got, want = planned.decode_step([seqs[0]], [token]), layered.decode_step([seqs[1]], [token])
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), replace
        plan = planned._native_steps[(1, torch.float32)]
        assert plan is not None and (replace is None or plan is not before)
        # the plan of 2 rows held the old weights too: dropped with the one that found them replaced
        assert len(planned._native_steps) == (2 if replace is None else 1)
        token = int(got.argmax())
    planned.to("cpu")  # a move: the plans held the weights where they lay
    assert planned._native_steps == {}


def test_the_plan_looks_at_the_layers_again_only_after_a_change(folders, monkeypatch):
    """A plan compares itself with the layers only once something was registered or moved since it
    last looked: a module made elsewhere makes it look, and it stays; a norm cast (its weight given
    new storage, with no registration) makes it look, and it is dropped; the final norm replaced too."""
    from unweight.runtime.model import changes

    monkeypatch.setenv("UNWEIGHT_PIPELINE", "fused")
    planned, layered, seqs, token = prefilled(folders["llama3.1-rope-scaling"], 6)

    def step() -> None:
        nonlocal token
        got, want = planned.decode_step([seqs[0]], [token]), layered.decode_step([seqs[1]], [token])
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        token = int(got.argmax())

    step()
    plan = planned._native_steps[(1, torch.float32)]
    assert plan.seen == changes.changes()
    nn.Linear(2, 2)  # registers its parameters: counted
    assert plan.seen != changes.changes()
    step()
    assert planned._native_steps[(1, torch.float32)] is plan and plan.seen == changes.changes()
    for model in (planned, layered):  # a cast that moves the weight's storage, then back: same values
        norm = model.model.layers[1].input_layernorm
        norm.double().float()
    step()
    assert planned._native_steps[(1, torch.float32)] is not plan
    plan = planned._native_steps[(1, torch.float32)]
    for model in (planned, layered):
        old = model.model.norm
        model.model.norm = type(old)(old.weight.shape[0], old.eps)
        model.model.norm.weight = nn.Parameter(old.weight * 0.5, requires_grad=False)
    step()
    assert planned._native_steps[(1, torch.float32)] is not plan
