"""benchmarks/step_profile.py's two instruments: its dense twin is the compressed model with plain
BF16 linears (the same logits, bit for bit, where both multiply by decode-then-GEMM), and its hooks
split a step into parts that each get time and add up to the step (no module counted twice, the
tied lm_head counted as lm_head)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import unweight

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import step_profile  # noqa: E402


def test_the_dense_twin_and_the_parts_of_a_step(smollm2_uw, monkeypatch):
    monkeypatch.setenv("UNWEIGHT_PIPELINE", "decode_matmul")
    ours, dense = unweight.load(smollm2_uw[0]), unweight.load(smollm2_uw[0])
    step_profile.densify(dense)
    assert not any(isinstance(m, step_profile.UnweightLinear) for n, m in dense.named_modules() if "embed" not in n)
    prompt = list(range(100, 124))
    logits = []
    for model in (ours, dense):
        seq = model.new_sequence()
        logits.append(model.prefill(seq, prompt).view(torch.int32))
        model.free(seq)
    assert torch.equal(*logits)

    bytes_read = step_profile.weight_bytes(ours)
    assert set(bytes_read) == set(step_profile.LINEARS)
    dense_read = step_profile.weight_bytes(dense)  # the weights in the compute dtype: BF16's 2 bytes or FP32's 4
    assert all(dense_read[p] > 1.3 * bytes_read[p] for p in step_profile.LINEARS), (dense_read, bytes_read)
    hooks = step_profile.Hooks(ours)
    try:
        times, parts = step_profile.run_steps(ours, prompt, 3, hooks)
    finally:
        hooks.remove()
    assert len(times) == len(parts) == 3
    for took, p in zip(times, parts):
        assert set(p) == set(step_profile.PARTS) and all(ns > 0 for ns in p.values()), p
        assert sum(p.values()) == round(took * 1e9)  # the rest is what the modules leave: none counted twice


def test_llama_cpp_nodes_go_to_the_same_parts():
    """llamacpp_step_profile.py files llama.cpp's graph nodes (operator, the name its graph gives)
    under step_profile's parts: a product by the weight it reads, the rest by operator."""
    import llamacpp_step_profile as lsp

    nodes = {
        ("MUL_MAT", "Qcur-3"): "qkv_proj",
        ("MUL_MAT", "Vcur-29"): "qkv_proj",
        ("MUL_MAT", "attn_out-0"): "o_proj",
        ("MUL_MAT", "ffn_up-7"): "gate_up_proj",
        ("MUL_MAT", "ffn_out-7"): "down_proj",
        ("MUL_MAT", "result_output"): "lm_head",
        ("MUL_MAT", "kq-4"): "attention",
        ("ROPE", "Qcur-4"): "attention",  # the same name on the product's result, then on the rope's
        ("RESHAPE", "Qcur-4"): "rest",
        ("RMS_NORM", "norm-2"): "norms",
        ("MUL", "attn_norm-2"): "norms",
        ("GLU", "ffn_swiglu-2"): "activation",
        ("ADD", "ffn_inp-2"): "residuals",
        ("GET_ROWS", "inp_embd"): "rest",
    }
    assert {(op, name): lsp.part_of(name, op) for op, name in nodes} == nodes
