"""Tiny random BF16 checkpoints that transformers writes, for the vLLM plugin's tests: a Llama
whose head counts divide by two (SmolLM2's nine heads do not, so it cannot run at TP=2), a
Qwen3-MoE, Llama-4-Scout's text model and Kimi K2.5's (DeepSeek-V3's). Each takes SmolLM2's
tokenizer and chat template, so vLLM's chat entry points work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from helpers import write_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _save(model, dst: Path, tokenizer_from: Path, dtype: torch.dtype | None = torch.bfloat16) -> Path:
    """`model` saved in `dtype` (None: as it is) with SmolLM2's tokenizer files beside it."""
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (model if dtype is None else model.to(dtype)).save_pretrained(tmp, safe_serialization=True)
    for f in TOKENIZER_FILES:
        if (tokenizer_from / f).exists():
            shutil.copy2(tokenizer_from / f, tmp / f)
    tmp.rename(dst)
    return dst


def tiny_llama(dst: Path, tokenizer_from: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Two layers, 4 query heads and 2 kv heads of 64 (so TP=2 splits them; at TP=4 kv heads
    would be replicated), an untied lm_head: every kind of linear layer vLLM shards."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if dst.exists():
        return dst
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=640,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _save(LlamaForCausalLM(cfg), dst, tokenizer_from, dtype)


def tiny_qwen3_moe(dst: Path, tokenizer_from: Path, dtype: torch.dtype = torch.bfloat16, **sizes) -> Path:
    """Two layers of 4 experts (top 2) and a router, Qwen3-MoE's architecture; `sizes` override
    the config's (benchmarks/vllm_bench.py makes a larger one)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if dst.exists():
        return dst
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        **{
            "vocab_size": 49152,
            "hidden_size": 256,
            "intermediate_size": 512,
            "moe_intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            **sizes,
        }
    )
    return _save(Qwen3MoeForCausalLM(cfg), dst, tokenizer_from, dtype)


def tiny_llama4(dst: Path, tokenizer_from: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Llama-4-Scout's text model in miniature, in its text layout (`Llama4ForCausalLM`, keys under
    `model.`): every layer MoE, 4 experts (top 1) as two fused 3-D tensors per layer (gate_up_proj
    (E, H, 2I), down_proj (E, I, H)) beside a shared expert, qk-norm, chunked attention (a chunk of
    128, the smallest vLLM's CPU attention takes) on its RoPE layer, a NoPE layer. The experts'
    intermediate size (384) differs from the hidden size so a transposition cannot pass unseen."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    if dst.exists():
        return dst
    torch.manual_seed(0)
    cfg = Llama4TextConfig(
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=384,
        intermediate_size_mlp=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        no_rope_layers=[1, 0],  # 1: RoPE (and chunked attention), 0: NoPE, as Scout alternates them
        attention_chunk_size=128,
        use_qk_norm=True,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _save(Llama4ForCausalLM(cfg), dst, tokenizer_from, dtype)


def tiny_deepseek_v3(dst: Path, tokenizer_from: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Kimi K2.5's language model (DeepSeek-V3's architecture) in miniature: MLA with a 512-wide
    latent and 64 RoPE dims (what vLLM's CPU MLA backend takes), a LoRA'd query, a dense first
    layer, then a MoE layer of 4 routed experts (top 2, sigmoid scores with a random FP32
    `e_score_correction_bias`, as the real checkpoints store it) and a shared expert."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    if dst.exists():
        return dst
    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=128,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        topk_method="noaux_tc",  # as DeepSeek-V3's and Kimi's configs say (vLLM reads them; transformers does not)
        scoring_func="sigmoid",
        rope_scaling=None,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = DeepseekV3ForCausalLM(cfg).to(dtype)
    for layer in model.model.layers[cfg.first_k_dense_replace :]:
        gate = layer.mlp.gate
        gate.e_score_correction_bias = torch.randn(cfg.n_routed_experts) * 0.1  # a buffer, kept FP32
    return _save(model, dst, tokenizer_from, dtype=None)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' `pack-quantized` INT4: signed codes in [-8, 7] stored as code + 8, eight
    to an int32 along the last dimension, the first code in the lowest four bits."""
    u = (codes.to(torch.int64) + 8).reshape(*codes.shape[:-1], -1, 8)
    word = sum(u[..., i] << (4 * i) for i in range(8))
    return (word - ((word >> 31) << 32)).to(torch.int32)  # the same 32 bits, as a signed int32


def w4a16(
    src: Path, dst: Path, quantize=lambda name: ".layers." in name, group: int = 32, symmetric: bool = True
) -> Path:
    """`src` (a BF16 folder) with the weights of the linear layers that `quantize(name)` picks made
    compressed-tensors W4A16, as Kimi K2.5 ships its routed experts: symmetric INT4, groups of
    `group` along the input, BF16 scales (`weight_packed`, `weight_scale`, `weight_shape`), and
    the config's `quantization_config` naming the rest of the linears in `ignore`. Not `symmetric`:
    min-max codes with a zero point a group (`weight_zero_point`, code + 8 packed eight rows to an
    int32 along the output dimension), as llm-compressor writes asymmetric W4A16."""
    from safetensors.torch import load_file, save_file

    if dst.exists():
        return dst
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    config = json.loads((tmp / "config.json").read_text())
    out, ignore = {}, []
    for f in sorted(tmp.glob("*.safetensors")):
        for name, t in load_file(f).items():
            linear = name.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in name  # routers too
            if not (linear and quantize(name)):
                ignore += [name[: -len(".weight")]] if linear else []
                out[name] = t
                continue
            rows, cols = t.shape
            g = t.float().reshape(rows, cols // group, group)
            base = name[: -len(".weight")]
            if symmetric:
                scale = (g.abs().amax(-1, keepdim=True) / 7).clamp(min=1e-8).to(torch.bfloat16)
                codes = torch.round(g / scale.float()).clamp(-8, 7).reshape(rows, cols)
            else:
                lo, hi = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
                scale = ((hi - lo) / 15).clamp(min=1e-8).to(torch.bfloat16)
                zero = (torch.round(-lo / scale.float()) - 8).clamp(-8, 7)
                codes = (torch.round(g / scale.float()) + zero).clamp(-8, 7).reshape(rows, cols)
                out[base + ".weight_zero_point"] = pack_int4(zero.reshape(rows, -1).T.contiguous()).T.contiguous()
            out[base + ".weight_packed"] = pack_int4(codes)
            out[base + ".weight_scale"] = scale.reshape(rows, cols // group)
            out[base + ".weight_shape"] = torch.tensor([rows, cols], dtype=torch.int64)
        f.unlink()
    save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "model.safetensors.index.json").unlink(missing_ok=True)
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": group}
    weights.update(dynamic=False, actorder=None, observer="minmax")
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tmp.rename(dst)
    return dst


def dequantized(src: Path, dst: Path) -> Path:
    """`src` (a compressed-tensors W4A16 folder made by `w4a16`) with every quantized linear's codes
    and scales multiplied back into an FP32 `weight` ((code - zero) * scale, zero 8 where the codes
    are symmetric: exact, where BF16 would round it) and its quantization_config dropped: what vLLM
    runs unquantized as the reference of the INT4 kernels."""
    from safetensors.torch import load_file, save_file

    if dst.exists():
        return dst
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    config = json.loads((tmp / "config.json").read_text())
    group = config.pop("quantization_config")["config_groups"]["group_0"]["weights"]["group_size"]
    tensors = load_file(tmp / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".weight_shape", ".weight_zero_point")):
            continue
        if not name.endswith(".weight_packed"):
            out[name] = t
            continue
        base = name[: -len(".weight_packed")]
        words = t.to(torch.int64) & 0xFFFFFFFF
        codes = torch.stack([(words >> (4 * i)) & 15 for i in range(8)], dim=-1).reshape(t.shape[0], -1)
        zero = tensors.get(base + ".weight_zero_point")
        if zero is None:
            zero = torch.full_like(codes, 8)
        else:  # eight rows to a word, along the output dimension
            zw = zero.to(torch.int64) & 0xFFFFFFFF
            zero = torch.stack([(zw >> (4 * i)) & 15 for i in range(8)], dim=1).reshape(-1, zw.shape[1])
            zero = zero[: t.shape[0]].repeat_interleave(group, dim=1)
        scale = tensors[base + ".weight_scale"].float().repeat_interleave(group, dim=1)
        out[base + ".weight"] = (codes - zero).float() * scale
    save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tmp.rename(dst)
    return dst


# Tiny random models of the architectures the transformers quantizer is tested on (tests/test_hf.py):
# model_type -> (config class, causal LM class, config overrides). Each has a vocabulary of 512, no
# tokenizer, two or three layers, and the family's own parts (MoE experts, MLA, qk-norm, sliding and
# chunked attention, a tied or untied head).
_SMALL = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=128, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=128, tie_word_embeddings=False)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            tie_word_embeddings=False,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(intermediate_size=128, sliding_window=16, query_pre_attn_scalar=16, tie_word_embeddings=True),
    ),
    "llama4_text": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            intermediate_size=32,
            intermediate_size_mlp=128,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=1,
            attention_chunk_size=128,
            no_rope_layers=[1, 0],
            tie_word_embeddings=False,
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_hidden_layers=3,
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            head_dim=8,
            num_key_value_heads=4,
            tie_word_embeddings=False,
        ),
    ),
}


def tiny_family(model_type: str, dst: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A tiny random `model_type` (a key of FAMILIES) saved by transformers, in BF16."""
    import transformers

    if dst.exists():
        return dst
    config_cls, model_cls, overrides = FAMILIES[model_type]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(**{**_SMALL, **overrides})
    model = getattr(transformers, model_cls)(cfg)
    with torch.no_grad():  # random norms (ones and zeros would hide a mix-up), experts' init is often empty
        for p in model.parameters():
            p.normal_(0, 0.05)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(dtype).save_pretrained(tmp)
    tmp.rename(dst)
    return dst


# A tiny Llama cut into four shards of our own (four_shards): one holds only the RMSNorm weights, one a
# whole decoder layer's linears, so that losing either is a partial download that leaves a model to build.
INDEX = "model.safetensors.index.json"
NORMS = "model-00004-of-00004.safetensors"  # every RMSNorm weight, and nothing else
LAYER_1 = "model-00003-of-00004.safetensors"  # layer 1's linears


def shard_for(name: str) -> str:
    """The shard four_shards puts tensor `name` in."""
    if "norm" in name:
        return NORMS
    if name.startswith("model.layers.1."):
        return LAYER_1
    if name.startswith("model.layers."):
        return "model-00002-of-00004.safetensors"
    return "model-00001-of-00004.safetensors"  # the embedding and the lm_head


def four_shards(src: Path, dst: Path, edit=None) -> Path:
    """`src` (a one-file BF16 folder) as four shards cut by shard_for, with its index; `edit` may
    change the tensors first (a dict of name -> tensor)."""
    from safetensors.torch import load_file

    tensors = load_file(src / "model.safetensors")
    if edit is not None:
        tensors = edit(tensors)
    dst.mkdir(parents=True)
    groups: dict[str, dict] = {}
    for name, t in tensors.items():
        groups.setdefault(shard_for(name), {})[name] = t
    for shard, group in groups.items():
        write_checkpoint(dst / shard, group, {"format": "pt"})
    weight_map = {name: shard_for(name) for name in tensors}
    (dst / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy2(f, dst / f.name)
    return dst
