"""What a model takes per GPU, from its config.json alone: `unweight plan`.

For a Llama-family, Qwen3-MoE, Mixtral, Llama 4 or DeepSeek-V3/Kimi model, the weights by tensor
class (embedding, attention, MLP, router, routed and shared experts, norms, lm_head) in the
checkpoint's own format (BF16; compressed-tensors INT4 experts as 4-bit codes and BF16 group
scales) and in unweight's resident layout, then what one GPU of a tensor- and pipeline-parallel
deployment holds of them, what vLLM would reserve beside them, and how many tokens of KV cache
fit in the rest (MLA's latent cache for DeepSeek-V3).

No weights are read. The counts follow the layers vLLM builds; the resident layout is an
estimate at RESIDENT_RATIO of the BF16 bytes for the tensors the plugin compresses (a
compressed folder's measured ratio depends on its weights); the activation reserve is an
estimate of what vLLM's start-up profiling finds (see `reserve_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from . import hf_config

GB = 10**9
GIB = 1 << 30
# The vendors' HBM capacities: H100 SXM 80 GB, H200 141 GB.
GPUS = {"h100": 80 * GB, "h200": 141 * GB}
# Resident tiles against BF16, measured on real weights (docs/transformers.md: SmolLM2 0.710,
# Llama-3.1-8B's layer shapes 0.702); random weights of std 0.02 measure about 0.72.
RESIDENT_RATIO = 0.71
# vLLM's defaults that size its reserve: --gpu-memory-utilization, --max-num-batched-tokens,
# --max-num-seqs; and what a CUDA context, NCCL and CUDA graphs take outside torch's allocator.
GPU_MEMORY_UTILIZATION = 0.9
MAX_NUM_BATCHED_TOKENS = 8192
MAX_NUM_SEQS = 256
NON_TORCH_BYTES = 2 * GIB

# The language models' model_type values whose tensors `weights` counts
MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "llama4_text", "deepseek_v3"})
CLASSES = ("embedding", "attention", "mlp", "router", "experts", "shared_experts", "norms", "lm_head")
# Classes the vLLM plugin keeps compressed (the others stay dense there: docs/vllm.md; so does MLA's kv_b_proj)
COMPRESSED = ("embedding", "attention", "mlp", "experts", "shared_experts", "lm_head")


@dataclass(slots=True)
class Weights:
    """One tensor class of the whole model: its parameters, its bytes in the checkpoint's format,
    and in unweight's resident layout."""

    name: str
    params: int = 0
    stored_bytes: int = 0
    resident_bytes: int = 0
    dtype: str = "bfloat16"


@dataclass(slots=True)
class Plan:
    """The model's weights by class, and one GPU's share, reserve and KV room (bytes, tokens)."""

    model_type: str
    gpu_bytes: int
    tp: int
    pp: int
    weights: list[Weights]
    gpu_weights_stored: int  # the most one GPU holds as the checkpoint stores it (the first stage, or the last)
    gpu_weights_resident: int
    reserve_bytes: int
    kv_bytes_per_token: int  # one GPU's, for its layers (and kv heads)
    kv_tokens_stored: int  # tokens of KV cache that fit beside the stored weights (0 if they do not fit)
    kv_tokens_resident: int
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def text_config(config: dict) -> dict:
    """The language model's config: `text_config` of a multimodal one (Llama 4, Kimi K2.5)."""
    return config.get("text_config") or config


def weights(config: dict, resident_ratio: float = RESIDENT_RATIO) -> list[Weights]:
    """The whole model's weights by tensor class (CLASSES), as its checkpoint stores them."""
    c = text_config(config)
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    counts = dict.fromkeys(CLASSES, 0)
    counts["embedding"] = c["vocab_size"] * h
    if not config.get("tie_word_embeddings", c.get("tie_word_embeddings", False)):
        counts["lm_head"] = c["vocab_size"] * h
    counts["norms"] = h  # the final norm
    fp32 = 0  # parameters stored in FP32 (the router's score correction biases)
    for layer in range(layers):
        counts["attention"] += _attention(c)
        counts["norms"] += 2 * h + _attention_norms(c)
        moe = _moe(c, layer)
        if moe is None:
            counts["mlp"] += 3 * h * _dense_intermediate(c)
            continue
        experts, inter, shared = moe
        counts["experts"] += experts * 3 * h * inter
        counts["shared_experts"] += shared
        counts["router"] += experts * h
        if c.get("topk_method") == "noaux_tc":  # DeepSeek-V3's score correction bias, stored in FP32
            fp32 += experts
    int4 = _int4_group(config)
    out = []
    for name in CLASSES:
        n = counts[name]
        w = Weights(name, n, 2 * n, round(2 * n * (resident_ratio if name in COMPRESSED else 1)))
        if name == "attention" and c.get("kv_lora_rank"):  # kv_b_proj stays dense in the plugin
            kv_b = layers * c["kv_lora_rank"] * c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["v_head_dim"])
            w.resident_bytes = round(2 * (n - kv_b) * resident_ratio) + 2 * kv_b
        if name == "router" and fp32:
            w.params, w.stored_bytes, w.resident_bytes = n + fp32, 2 * n + 4 * fp32, w.resident_bytes + 4 * fp32
        if name == "experts" and int4:  # 4-bit codes and one BF16 scale per group, kept as they are
            w.stored_bytes = w.resident_bytes = n // 2 + 2 * (n // int4)
            w.dtype = f"int4 (group {int4})"
        out.append(w)
    return out


def _attention(c: dict) -> int:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    if c.get("kv_lora_rank"):  # MLA: a LoRA'd query (or a plain one), the latent kv projections
        qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        q = h * c["q_lora_rank"] + c["q_lora_rank"] * heads * qk if c.get("q_lora_rank") else h * heads * qk
        kv = h * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
        kv += c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"])
        return q + kv + heads * c["v_head_dim"] * h
    head = c.get("head_dim") or h // heads
    kv_heads = c.get("num_key_value_heads") or heads
    bias = (heads + 2 * kv_heads) * head if c.get("model_type") == "qwen2" or c.get("attention_bias") else 0
    return 2 * h * heads * head + 2 * h * kv_heads * head + bias


def _attention_norms(c: dict) -> int:
    if c.get("kv_lora_rank"):
        return c["kv_lora_rank"] + (c.get("q_lora_rank") or 0)
    if c.get("model_type") in ("qwen3", "qwen3_moe"):  # q_norm and k_norm, per head
        return 2 * (c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    return 0  # Llama 4's qk-norm has no weights


def _dense_intermediate(c: dict) -> int:
    return c.get("intermediate_size_mlp") or c["intermediate_size"]  # Llama 4 names its dense MLP's so


def _moe(c: dict, layer: int) -> tuple[int, int, int] | None:
    """(routed experts, their intermediate size, shared experts' parameters) of a MoE layer, else None."""
    h = c["hidden_size"]
    if c.get("n_routed_experts"):  # DeepSeek-V3, Kimi
        if layer < c.get("first_k_dense_replace", 0) or layer % c.get("moe_layer_freq", 1):
            return None
        inter = c["moe_intermediate_size"]
        return c["n_routed_experts"], inter, 3 * h * inter * c.get("n_shared_experts", 0)
    if c.get("model_type", "").startswith("llama4"):
        step = c.get("interleave_moe_layer_step", 1)
        moe_layers = c.get("moe_layers") or list(range(step - 1, c["num_hidden_layers"], step))
        if layer not in moe_layers:
            return None
        return c["num_local_experts"], c["intermediate_size"], 3 * h * c["intermediate_size"]
    if c.get("model_type") == "qwen3_moe":  # (transformers 5 writes num_experts as num_local_experts)
        if layer in c.get("mlp_only_layers", []) or (layer + 1) % c.get("decoder_sparse_step", 1):
            return None
        return c.get("num_experts") or c["num_local_experts"], c["moe_intermediate_size"], 0
    if c.get("num_local_experts"):  # Mixtral
        return c["num_local_experts"], c["intermediate_size"], 0
    return None


def _int4_group(config: dict) -> int:
    """The group size of compressed-tensors INT4 weights (applied to the routed experts, as Kimi
    K2.5 quantizes them), or 0. A folder compressed from such a checkpoint keeps its config."""
    q = config.get("quantization_config") or text_config(config).get("quantization_config") or {}
    q = hf_config.source_quantization({"quantization_config": q}) or q
    if q.get("quant_method") != "compressed-tensors":
        return 0
    for group in (q.get("config_groups") or {}).values():
        w = group.get("weights") or {}
        if w.get("num_bits") == 4:
            return int(w.get("group_size") or 0)
    return 0


def kv_bytes_per_token(config: dict, tp: int, pp: int, dtype_bytes: int = 2) -> int:
    """One GPU's KV cache per token: its layers' K and V for its share of the kv heads (replicated
    where there are fewer kv heads than ranks, as vLLM does); for MLA, the latent and its RoPE
    part, which every rank holds whole."""
    c = text_config(config)
    layers = math.ceil(c["num_hidden_layers"] / pp)
    if c.get("kv_lora_rank"):
        return layers * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * dtype_bytes
    heads = c["num_attention_heads"]
    head = c.get("head_dim") or c["hidden_size"] // heads
    kv_heads = max(1, (c.get("num_key_value_heads") or heads) // tp)
    return layers * 2 * kv_heads * head * dtype_bytes


def reserve_bytes(config: dict, tp: int) -> int:
    """What vLLM keeps beside weights and KV cache, estimated: the activations of one batch of
    MAX_NUM_BATCHED_TOKENS (residual, attention and MLP intermediates in FP32, per rank), the
    sampler's FP32 logits for MAX_NUM_SEQS sequences, and NON_TORCH_BYTES."""
    c = text_config(config)
    h = c["hidden_size"]
    moe = _moe(c, c["num_hidden_layers"] - 1)
    inter = max(_dense_intermediate(c) if "intermediate_size" in c else 0, moe[1] * 2 if moe else 0)
    activations = MAX_NUM_BATCHED_TOKENS * (4 * h + 2 * inter // tp) * 4
    logits = MAX_NUM_SEQS * c["vocab_size"] * 4 * 2
    return activations + logits + NON_TORCH_BYTES


def plan(
    config: dict,
    gpu_bytes: int,
    tp: int = 1,
    pp: int = 1,
    *,
    kv_dtype_bytes: int = 2,
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
    resident_ratio: float = RESIDENT_RATIO,
) -> Plan:
    """One GPU's share of `config`'s model on tp × pp GPUs of `gpu_bytes` each (see the module
    docstring). Raises ValueError naming what the config lacks or the bad value."""
    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be at least 1, not {tp} and {pp}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must lie in (0, 1], not {gpu_memory_utilization}")
    c = text_config(config)
    if c.get("model_type") not in MODEL_TYPES:
        raise ValueError(
            f"model_type {c.get('model_type')!r}: the plan knows the layers of {', '.join(sorted(MODEL_TYPES))}"
        )
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in c]
    if missing:
        raise ValueError(f"config.json has no {', '.join(missing)}")
    if c["num_hidden_layers"] < pp:
        raise ValueError(f"pp={pp} is more stages than the model's {c['num_hidden_layers']} layers")
    ws = weights(config, resident_ratio)
    by = {w.name: w for w in ws}
    layers = c["num_hidden_layers"]
    stage = math.ceil(layers / pp) / layers  # the largest stage's share of the layers

    def gpu(attr: str) -> int:
        def share(name: str) -> float:
            w = getattr(by[name], attr)
            if name in ("router", "norms"):  # replicated at every rank
                return w * stage
            return w * stage / tp

        body = sum(share(n) for n in ("attention", "mlp", "router", "experts", "shared_experts", "norms"))
        ends = [getattr(by["embedding"], attr) / tp, getattr(by["lm_head"], attr) / tp]
        return round(body + (sum(ends) if pp == 1 else max(ends)))

    total = int(gpu_bytes * gpu_memory_utilization)
    reserve = reserve_bytes(config, tp)
    per_token = kv_bytes_per_token(config, tp, pp, kv_dtype_bytes)
    stored, resident = gpu("stored_bytes"), gpu("resident_bytes")
    notes = []
    if "vision_config" in config:
        notes.append("the vision tower is not counted")
    if c.get("kv_lora_rank"):
        notes.append("MLA's latent cache is held whole at every tensor-parallel rank")
    if c.get("num_nextn_predict_layers"):
        notes.append("the multi-token-prediction layers are not counted (vLLM serves without them)")
    if c.get("attention_chunk_size"):
        notes.append("chunked-attention layers are counted with a full KV cache (vLLM's hybrid allocator needs less)")
    return Plan(
        model_type=c.get("model_type", "?"),
        gpu_bytes=gpu_bytes,
        tp=tp,
        pp=pp,
        weights=ws,
        gpu_weights_stored=stored,
        gpu_weights_resident=resident,
        reserve_bytes=reserve,
        kv_bytes_per_token=per_token,
        kv_tokens_stored=max(0, total - stored - reserve) // per_token,
        kv_tokens_resident=max(0, total - resident - reserve) // per_token,
        notes=notes,
    )
