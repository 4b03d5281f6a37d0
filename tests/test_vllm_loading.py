"""The vLLM plugin's pieces that need no vLLM: the config.json tag, a rank's block of each kind of
layer, LazyWeight's slices against the original bytes, and row decoding of the serving layout."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_models import tiny_qwen3_moe, w4a16

import unweight
from helpers import random_bf16, rewrite_container, run_cli, write_checkpoint
from unweight import hf_config
from unweight.codec import decode_rows
from unweight.errors import CorruptDataError
from unweight.reader import CompressedCheckpoint
from unweight.runtime.vllm import shards
from unweight.runtime.vllm.lazy import LazyWeight

CONFIGS = [
    b"{}",
    b'{\n  "a": 1\n}\n',
    b' {"a": [1, {"b": 2}], "quantization_config": null}  \n',
    b'{"quantization_config": {"quant_method": "fp8"}}',
    b'{"a": 1, "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized"}}\n',
    b"[1, 2]",
    b"\xef\xbb\xbf{}",
    b"not json",
]


@pytest.mark.parametrize("data", CONFIGS)
def test_the_config_tag_comes_off_exactly(data):
    tagged, note = hf_config.tag(data)
    assert hf_config.untag(tagged) == data
    if note is None:
        source = json.loads(data).get("quantization_config")  # kept: compressed-tensors layers stay INT4
        expected = {"quant_method": "unweight"} | ({"source_quantization_config": source} if source else {})
        assert json.loads(tagged)["quantization_config"] == expected
        assert hf_config.source_quantization(json.loads(tagged)) == source
    else:
        assert tagged == data


def test_compress_tags_config_and_decompress_and_verify_undo_it(tmp_path):
    src = write_checkpoint(tmp_path / "src" / "model.safetensors", {"w": random_bf16(64, 32)}).parent
    original = b'{\n  "architectures": ["LlamaForCausalLM"],\n  "quantization_config": null\n}\n'
    (src / "config.json").write_bytes(original)
    out, back = tmp_path / "uw", tmp_path / "back"
    unweight.compress(src, out)
    assert json.loads((out / "config.json").read_bytes())["quantization_config"] == {"quant_method": "unweight"}
    r = run_cli("verify", out, "--against", src)
    assert r.returncode == 0 and r.stdout.startswith("OK:"), r.stdout + r.stderr
    unweight.decompress(out, back)
    assert (back / "config.json").read_bytes() == original
    (src / "config.json").write_bytes(b'{"quantization_config": {"quant_method": "awq"}}')
    r = run_cli("compress", src, tmp_path / "uw2")
    assert r.returncode == 0 and "already declares a quantization_config (quant_method 'awq')" in r.stderr, r.stderr


def layer(tp_rank=0, tp_size=2, **kw):
    return SimpleNamespace(tp_rank=tp_rank, tp_size=tp_size, **kw)


def test_blocks_of_each_kind_of_layer():
    # q/k/v of 4 heads, 2 kv heads of 64 at TP=2: rank 1 takes the second half of each
    qkv = layer(1, 2, num_heads=2, num_kv_heads=1, head_size=64, v_head_size=64, num_kv_head_replicas=1)
    qkv.total_num_heads, qkv.total_num_kv_heads = 4, 2
    qkv.input_size_per_partition = qkv.input_size = 256
    assert shards.plan("qkv", qkv, "q", (256, 256), "q") == shards.Block(0, 128, 128, 0, 256)
    assert shards.plan("qkv", qkv, "k", (128, 256), "k") == shards.Block(128, 64, 64, 0, 256)
    assert shards.plan("qkv", qkv, "v", (128, 256), "v") == shards.Block(192, 64, 64, 0, 256)
    # 1 kv head at TP=2: replicated, both ranks take kv head 0
    rep = layer(1, 2, num_heads=2, num_kv_heads=1, head_size=64, v_head_size=64, num_kv_head_replicas=2)
    rep.total_num_heads, rep.total_num_kv_heads = 4, 1
    rep.input_size_per_partition = rep.input_size = 256
    assert shards.plan("qkv", rep, "k", (64, 256), "k") == shards.Block(128, 0, 64, 0, 256)
    merged = layer(1, 2, output_sizes=[640, 640], input_size_per_partition=256, input_size=256)
    assert shards.plan("merged", merged, 1, (640, 256), "up") == shards.Block(320, 320, 320, 0, 256)
    row = layer(1, 2, input_size_per_partition=320, input_size=640, output_size=256)
    assert shards.plan("row", row, None, (256, 640), "down") == shards.Block(0, 0, 256, 320, 320)
    col = layer(0, 2, output_size_per_partition=24576, input_size_per_partition=256, input_size=256, output_size=49152)
    assert shards.plan("column", col, None, (49152, 256), "lm_head") == shards.Block(0, 0, 24576, 0, 256)
    assert shards.shard_ids("qkv", qkv) == frozenset("qkv") and shards.shard_ids("merged", merged) == {0, 1}


def test_a_tensor_that_does_not_fit_its_layer_is_named():
    row = layer(1, 2, input_size_per_partition=320, input_size=640, output_size=256)
    with pytest.raises(
        ValueError, match="tensor 'x.down' has shape \\[256, 600\\], but layer '\\?' needs \\[256, 640\\]"
    ):
        shards.plan("row", row, None, (256, 600), "x.down")
    with pytest.raises(ValueError, match="has shape \\[200, 640\\]"):  # rows the rank's weight would lack
        shards.plan("row", row, None, (200, 640), "x.down")
    # wider than the layer: vLLM refuses it in BF16, so it must not be cropped to fit
    q = layer(0, 1, output_size=576, input_size=576, input_size_per_partition=576, prefix="m.q_proj")
    with pytest.raises(ValueError, match="'m.q_proj' needs \\[576, 576\\]"):
        shards.plan("replicated", q, None, (576, 1152), "m.q_proj.weight")
    merged = layer(0, 2, output_sizes=[640, 640], input_size_per_partition=256, input_size=256)
    with pytest.raises(ValueError, match="shard id 2 of a merged layer"):
        shards.plan("merged", merged, 2, (640, 256), "x.gate")
    with pytest.raises(ValueError, match="not a 2-D linear weight"):
        shards.plan("column", merged, None, (640,), "x.bias")


@pytest.mark.parametrize("layout", ["archive", "serving"])
def test_lazy_slices_are_the_original_bytes(tmp_path, layout):
    w = random_bf16(300, 200, seed=3)
    src = write_checkpoint(tmp_path / "src" / "model.safetensors", {"w": w, "n": torch.ones(5, dtype=torch.bfloat16)})
    out = tmp_path / "uw"
    unweight.compress(src.parent, out, layout=layout, threads=1)
    with CompressedCheckpoint(out) as ckpt:
        lazy = LazyWeight(ckpt, "w")
        assert (lazy.shape, lazy.dtype, lazy.dim(), lazy.size(1)) == (torch.Size([300, 200]), torch.bfloat16, 2, 200)
        assert ckpt.integrity.decoded == 0  # shape and dtype decode nothing

        def same(a, b):
            return torch.equal(a.view(torch.int16), b.view(torch.int16))

        assert same(lazy.narrow(0, 17, 101), w[17:118])
        assert same(lazy.narrow(1, 33, 70), w[:, 33:103])
        assert same(lazy.block(5, 290, 100, 200), w[5:290, 100:200])
        dense = torch.empty(300, 200, dtype=torch.bfloat16)
        dense.copy_(lazy)  # any other use decodes the tensor
        assert same(dense, w) and same(lazy.to(torch.float32).to(torch.bfloat16), w)
        with pytest.raises(ValueError, match="lies outside"):
            lazy.block(0, 301, 0, 1)
        # copy_ compares shapes before it decodes: a tensor that does not fit its parameter costs nothing
        before = ckpt.integrity.decoded
        with pytest.raises(
            ValueError, match=r"tensor 'w' of shape \[300, 200\] cannot load into a parameter of shape \[300, 100\]"
        ):
            torch.empty(300, 100, dtype=torch.bfloat16).copy_(lazy)
        assert ckpt.integrity.decoded == before
        norms = torch.empty(2, 5, dtype=torch.bfloat16).copy_(LazyWeight(ckpt, "n"))  # broadcasting still works
        assert torch.equal(norms, torch.ones(2, 5, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="more than the model's largest parameter holds"):
            LazyWeight(ckpt, "w", limit=300 * 200).narrow(0, 0, 200).materialize()  # 200 rows: 80,000 bytes
        # vLLM's MoE loader: unsqueeze(0), then unbind(), before the expert's own loader slices it
        before = ckpt.integrity.decoded
        (back,) = lazy.unsqueeze(0).unbind()
        assert isinstance(back, LazyWeight) and back.shape == (300, 200) and ckpt.integrity.decoded == before
        assert lazy.unsqueeze(0).shape == (1, 300, 200) and same(lazy.unsqueeze(0).unsqueeze(0).sum(0).sum(0), w)
        assert same(back.narrow(0, 10, 5), w[10:15]) and same(lazy.unsqueeze(0)[0, 3], w[3])


def test_decode_rows_of_the_serving_layout_decodes_only_their_range(tmp_path):
    w = random_bf16(256, 96, seed=4)
    src = write_checkpoint(tmp_path / "src" / "model.safetensors", {"w": w})
    unweight.compress(src.parent, tmp_path / "uw", layout="serving")
    with CompressedCheckpoint(tmp_path / "uw") as ckpt:
        entry, streams = ckpt.entry("w"), ckpt.streams("w")
        assert entry.codec == "tiles"
        ids = np.array([200, 3, 17, 17, 255])
        got = decode_rows(entry, streams, ids)
        want = w.view(torch.int16).numpy().view(np.uint8).reshape(256, -1)[ids]
        assert np.array_equal(got, want)


@pytest.mark.parametrize("gate_up", ["gate_up", "model.layers.0.feed_forward.experts.gate_up_proj"])
def test_a_fused_experts_tensor_is_taken_expert_by_expert_as_vllms_llama4_loader_views_it(
    tmp_path, monkeypatch, gate_up
):
    """Llama 4 stores gate_up_proj as (E, H, 2I); vLLM's loader transposes it and chunks gate from
    up. That view stays undecoded, and `expert` decodes one expert's block from only its rows;
    experts decoded whole, in order, are checked against the tensor's CRC-32 as a whole decode is.
    Under Llama 4's own name, `compress` codes the tensor transposed: a rank's rows of gate or up
    (stored columns) then decode from only the chunks that hold them, not from the whole expert."""
    experts, hidden, inter = 4, 64, 1536  # each expert's rows span several rans chunks
    w = random_bf16(experts, hidden, 2 * inter, seed=5)
    src = write_checkpoint(tmp_path / "src" / "model.safetensors", {gate_up: w})
    unweight.compress(src.parent, tmp_path / "uw", threads=1)
    transposed = gate_up != "gate_up"

    def same(a, b):
        return torch.equal(a.view(torch.int16), b.view(torch.int16))

    from unweight.codec import rans, tensor_codec

    decoded, decode = [], rans.decode  # the rans chunks each decode asks for (all of them: None)

    def counted(streams, p, n, threads=None, out=None, chunks=None):
        decoded.append(None if chunks is None else len(chunks))
        return decode(streams, p, n, threads, out, chunks)

    monkeypatch.setattr(tensor_codec.rans, "decode", counted)
    with CompressedCheckpoint(tmp_path / "uw") as ckpt:
        gate_up_entry = ckpt.entry(gate_up)
        assert gate_up_entry.codec == "rans" and gate_up_entry.params.get("transpose", False) is transposed
        gate, up = LazyWeight(ckpt, gate_up).transpose(-1, -2).chunk(2, dim=-2)
        want = w.transpose(-1, -2).chunk(2, dim=-2)
        assert same(up.expert(2, [(10, 20)], 0, hidden), want[1][2, 10:20])  # ten of up's rows of expert 2
        chunks_per_expert = (
            rans.RansParams.from_json({k: v for k, v in gate_up_entry.params.items() if k != "transpose"}).nchunks(
                w.numel()
            )
            // experts
        )
        (asked,) = decoded
        assert asked <= 2 if transposed else asked >= chunks_per_expert, decoded  # the rows' chunks, or the expert's
    monkeypatch.undo()
    with CompressedCheckpoint(tmp_path / "uw") as ckpt:
        assert ckpt.entry(gate_up).codec == "rans"
        gate, up = LazyWeight(ckpt, gate_up).transpose(-1, -2).chunk(2, dim=-2)
        assert isinstance(gate, LazyWeight) and gate.shape == up.shape == (experts, inter, hidden)
        assert ckpt.integrity.decoded == 0
        want = w.transpose(-1, -2).chunk(2, dim=-2)
        assert same(
            up.expert(2, [(10, 20), (100, 103)], 5, 40), torch.cat([want[1][2, 10:20], want[1][2, 100:103]])[:, 5:40]
        )
        assert same(gate.materialize(), want[0]) and same(up.narrow(0, 1, 2).materialize(), want[1][1:3])
        assert same(up.unchunked().expert(3, [(0, 2 * inter)], 0, hidden), w[3].t())
        # (E, I, H) down_proj seen untransposed: a block of an expert's rows decodes only those rows' chunks
        assert same(LazyWeight(ckpt, gate_up).expert(1, [(7, 9)], 100, 3000), w[1, 7:9, 100:3000])
        with pytest.raises(ValueError, match="lie outside"):
            gate.expert(4, [(0, 1)], 0, 1)
    with CompressedCheckpoint(tmp_path / "uw") as ckpt:
        whole = LazyWeight(ckpt, gate_up).transpose(1, 2)
        for e in (0, 2, 1, 3):  # out of order: checked by the streams' CRC-32s only
            whole.expert(e, [(0, 2 * inter)], 0, hidden)
        assert ckpt.checked_tensors() == 1 and gate_up not in ckpt._decoded
        for e in range(experts):  # every expert whole, in order: the tensor's CRC-32 is checked too
            whole.expert(e, [(0, 2 * inter)], 0, hidden)
        assert gate_up in ckpt._decoded

    def wrong_crc(tensors):  # streams intact, the original bytes' CRC-32 not theirs
        (entry, streams) = tensors[gate_up]
        return {gate_up: (dataclasses.replace(entry, crc32=entry.crc32 ^ 1), streams)}

    rewrite_container(tmp_path / "uw" / "model.safetensors", wrong_crc)
    with CompressedCheckpoint(tmp_path / "uw") as ckpt:
        whole = LazyWeight(ckpt, gate_up).transpose(1, 2)
        for e in range(experts - 1):
            whole.expert(e, [(0, 2 * inter)], 0, hidden)
        with pytest.raises(CorruptDataError, match="gate_up.*fail the CRC-32 check"):
            whole.expert(experts - 1, [(0, 2 * inter)], 0, hidden)


def test_int4_experts_reach_vllms_loaders_as_the_source_stores_them(tmp_path):
    """Kimi K2.5's routed experts in compressed-tensors INT4 (which vLLM-CPU's own method cannot run
    without AMX on an AVX2 host; the plugin runs them coded: test_vllm.py): each expert's packed
    codes, BF16 scales and shape, whole and in the halves a TP=2 rank narrows them to (rows of gate
    and up; packed columns and scale groups of down), are the source's bytes. The packed codes are
    entropy-coded byte by byte (or zstd, when smaller)."""
    from safetensors.torch import load_file

    src = w4a16(tiny_qwen3_moe(tmp_path / "moe", tmp_path), tmp_path / "moe-w4a16", quantize=lambda n: ".experts." in n)
    out = tmp_path / "uw"
    report = unweight.compress(src, out, threads=1)
    original = load_file(src / "model.safetensors")
    experts = sorted(name for name in original if ".experts." in name)
    assert len(experts) == 2 * 4 * 3 * 3  # layers x experts x (gate, up, down) x (weight_packed, _scale, _shape)
    codecs = {t.name: (t.codec, t.stored_bytes, t.original_bytes) for t in report.tensors}
    packed = [codecs[name] for name in experts if name.endswith(".weight_packed")]
    assert all(codec in ("rans", "zstd") and stored < size for codec, stored, size in packed), packed

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:  # integer views: bit for bit
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(bits), b.view(bits))

    with CompressedCheckpoint(out) as ckpt:
        for name in experts:
            want = original[name]
            (lazy,) = LazyWeight(ckpt, name).unsqueeze(0).unbind()  # as vLLM's MoE loader takes each tensor
            assert same(lazy.materialize(), want), name
            if want.dim() == 2:
                dim = 1 if ".down_proj." in name else 0
                half = want.shape[dim] // 2
                for rank in range(2):
                    part = torch.empty_like(want.narrow(dim, rank * half, half)).copy_(
                        lazy.narrow(dim, rank * half, half)
                    )
                    assert same(part, want.narrow(dim, rank * half, half)), (name, rank)
