"""What a model takes per GPU, from its config.json alone: `unweight plan`.

For a Llama-family, Qwen3-MoE, Mixtral, Llama 4 or DeepSeek-V3/Kimi model, the weights by tensor
class (embedding, attention, MLP, router, routed and shared experts, norms, lm_head) in the
checkpoint's own format (BF16; compressed-tensors INT4 experts as 4-bit codes and BF16 group
scales) and in unweight's resident layout, then what one GPU of a tensor- and pipeline-parallel
deployment holds of them, what vLLM would reserve beside them, and how many tokens of KV cache
fit in the rest (MLA's latent cache for DeepSeek-V3).

No weights are read. The counts follow the layers vLLM builds; the resident layout is an
estimate at RESIDENT_RATIO of the BF16 bytes for the tensors the plugin compresses (a
compressed folder's measured ratio depends on its weights), and INT4 experts as a GPU holds them:
their codes as stored and their scales coded (INT4_SCALES_RATIO, runtime/kernels/int4_matmul.py);
the activation
reserve is an estimate of what vLLM's start-up profiling finds (see `reserve_bytes`). A GPU holds
what CUDA reports of it (GPUS), the total vLLM's --gpu-memory-utilization takes its share of.
Data parallelism (vLLM's --data-parallel-size, attention replicated per data-parallel rank) and
expert parallelism (--enable-expert-parallel: whole experts per rank) change each GPU's share.

A config is checked before anything is counted (`check_config`): every field the counts read has
its type and bounds, and tp must divide what vLLM's layers divide; what fails is refused with a
ValueError naming the field. Layers are counted in closed form, not one by one.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import hf_config
from .errors import SourceError
from .folder import read_json

GB = 10**9
MIB, GIB = 1 << 20, 1 << 30
# What CUDA reports of each GPU (cudaMemGetInfo's total, which torch's out-of-memory message prints
# and vLLM's --gpu-memory-utilization takes its share of), below the vendors' 80 GB and 141 GB of
# HBM: an H100 SXM 80 GB, "a total capacity of 79.11 GiB" (vllm-project/vllm#27508, driver
# 535.247.01); an H200, total_memory=143156MB, 139.80 GiB (torch's device properties, in
# ai-bot-pro/achatbot deploy/modal/src/llm/vllm/vlm/skywork_r1v.py). Drivers differ by a few MiB.
GPUS = {"h100": int(79.11 * GIB), "h200": 143156 * MIB}
# Resident tiles against BF16, measured on real weights (docs/transformers.md: SmolLM2 0.710,
# Llama-3.1-8B's layer shapes 0.702); random weights of std 0.02 measure about 0.72.
RESIDENT_RATIO = 0.71
# INT4 experts on a GPU (runtime/kernels/int4_matmul.py, Int4ScalesWeight): the codes as stored (decoding
# the `int4` layout's coded ones, 0.944 of them for Gaussian weights, costs about 7.5 instructions a
# weight where an H200's bandwidth leaves 4.2: docs/kernels.md) and the BF16 group scales coded as that
# layout codes them, 0.591 of their bytes for Student-t(5) weights (0.583 Gaussian), measured on
# Kimi-shaped experts by benchmarks/int4_resident_bench.py (docs/compression.md). Asymmetric codes
# (zero points) are held as stored: the GEMV takes symmetric ones.
INT4_SCALES_RATIO = 0.591
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

CONFIG_NAME = "config.json"
MAX_CONFIG_BYTES = 16 << 20  # a real config.json is a few KiB; a bigger one is not read
# Bounds of the config's fields, far past any real model's (Kimi K2: 61 layers, 384 experts, hidden
# 7168, vocab 163840), that keep every count a number of bits a float carries
MAX_SIZE = 1 << 24  # widths: hidden, intermediate, vocabulary, head and LoRA dimensions
MAX_COUNT = 1 << 20  # layers, heads, experts, and the layer numbers and steps that pick MoE layers
# field -> (least, most) of the ints the counts read; null (or absence) is allowed where the counts
# have a default, and 0 where it means "none" (kv_lora_rank 0: no MLA)
INT_FIELDS = {
    "hidden_size": (1, MAX_SIZE),
    "num_hidden_layers": (1, MAX_COUNT),
    "num_attention_heads": (1, MAX_COUNT),
    "num_key_value_heads": (1, MAX_COUNT),
    "head_dim": (1, MAX_SIZE),
    "vocab_size": (1, MAX_SIZE),
    "intermediate_size": (1, MAX_SIZE),
    "intermediate_size_mlp": (1, MAX_SIZE),
    "moe_intermediate_size": (1, MAX_SIZE),
    "kv_lora_rank": (0, MAX_SIZE),
    "q_lora_rank": (0, MAX_SIZE),
    "qk_nope_head_dim": (1, MAX_SIZE),
    "qk_rope_head_dim": (1, MAX_SIZE),
    "v_head_dim": (1, MAX_SIZE),
    "n_routed_experts": (0, MAX_COUNT),
    "n_shared_experts": (0, MAX_COUNT),
    "num_local_experts": (0, MAX_COUNT),
    "num_experts": (0, MAX_COUNT),
    "first_k_dense_replace": (0, MAX_COUNT),
    "moe_layer_freq": (1, MAX_COUNT),
    "interleave_moe_layer_step": (1, MAX_COUNT),
    "decoder_sparse_step": (1, MAX_COUNT),
    "num_nextn_predict_layers": (0, MAX_COUNT),
    "attention_chunk_size": (0, 1 << 40),
}
LIST_FIELDS = ("moe_layers", "mlp_only_layers")  # layer numbers
BOOL_FIELDS = ("tie_word_embeddings", "attention_bias")
STR_FIELDS = ("model_type", "topk_method")


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
    dp: int  # data-parallel ranks, each tp x pp GPUs with its own attention and requests
    expert_parallel: bool  # whole experts per rank (else each expert split over the tp x dp ranks)
    weights: list[Weights]
    gpu_weights_stored: int  # the most one GPU holds as the checkpoint stores it (the first stage, or the last)
    gpu_weights_resident: int
    reserve_bytes: int
    kv_bytes_per_token: int  # one GPU's, for its layers (and kv heads)
    kv_tokens_stored: int  # tokens of KV cache that fit beside the stored weights (0 if they do not fit)
    kv_tokens_resident: int
    notes: list[str] = field(default_factory=list)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def to_json(self) -> dict:
        return asdict(self)


def text_config(config: dict) -> dict:
    """The language model's config: `text_config` of a multimodal one (Llama 4, Kimi K2.5)."""
    return config.get("text_config") or config


def read_config(folder: str | os.PathLike) -> dict:
    """The config.json of `folder`, read by folder.read_json (a FIFO, a device or a link to one, bad
    UTF-8 or JSON, nesting past the recursion limit: SourceError naming the file), and refused
    unread past MAX_CONFIG_BYTES. Its fields are checked by `check_config`."""
    path = Path(folder) / CONFIG_NAME
    try:
        size = path.stat().st_size  # (0 for a FIFO or a device: read_json refuses those)
    except FileNotFoundError:
        raise SourceError(f"{path}: no such file (the plan reads the model's config.json)") from None
    except OSError as e:
        raise SourceError(f"{path}: cannot read: {e.strerror}") from None
    if size > MAX_CONFIG_BYTES:
        raise SourceError(f"{path}: {size} bytes, over the {MAX_CONFIG_BYTES >> 20} MiB a config.json may have")
    return read_json(path, MAX_CONFIG_BYTES)  # (bounded as it reads, should the file grow since)


def _show(value) -> str:
    """A field's value for a one-line message: a scalar's repr, cut short; a list or an object by
    its kind (its repr may be megabytes, or nested past the recursion limit)."""
    if isinstance(value, list | dict):
        return "a list" if isinstance(value, list) else "an object"
    text = repr(value) if isinstance(value, str | int | float | bool | None) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _check_int(c: dict, key: str, lo: int, hi: int, where: str) -> None:
    value = c.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{CONFIG_NAME}: {where}{key} is {_show(value)}, not an integer")
    if not lo <= value <= hi:
        raise ValueError(f"{CONFIG_NAME}: {where}{key} is {value}, outside [{lo}, {hi}]")


def _check_fields(c: dict, where: str) -> None:
    """Type and bounds of every field of INT_FIELDS, LIST_FIELDS, BOOL_FIELDS and STR_FIELDS in `c`."""
    for key, (lo, hi) in INT_FIELDS.items():
        _check_int(c, key, lo, hi, where)
    for key in LIST_FIELDS:
        value = c.get(key)
        if value is not None and not isinstance(value, list):
            raise ValueError(f"{CONFIG_NAME}: {where}{key} is {_show(value)}, not a list of layer numbers")
        for n in value or ():
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_COUNT:
                raise ValueError(f"{CONFIG_NAME}: {where}{key} holds {_show(n)}, not a layer number")
    for key, kind, name in [(k, bool, "true or false") for k in BOOL_FIELDS] + [
        (k, str, "a string") for k in STR_FIELDS
    ]:
        value = c.get(key)
        if value is not None and not isinstance(value, kind):
            raise ValueError(f"{CONFIG_NAME}: {where}{key} is {_show(value)}, not {name}")


def check_config(config) -> dict:
    """The language model's config (`text_config`), once every field the counts read has its JSON
    type and lies in its bounds (INT_FIELDS), the fields its family needs are there, and the
    attention heads split into whole kv groups and head dimensions; else ValueError naming the field."""
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG_NAME}: not a JSON object but a {type(config).__name__}")
    inner = config.get("text_config")
    if inner is not None and not isinstance(inner, dict):
        raise ValueError(f"{CONFIG_NAME}: text_config is {_show(inner)}, not an object")
    c, where = (inner, "text_config.") if inner else (config, "")
    model_type = c.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        raise ValueError(
            f"{CONFIG_NAME}: {where}model_type {_show(model_type)}: the plan knows the layers of "
            + ", ".join(sorted(MODEL_TYPES))
        )
    _check_fields(c, where)
    if c is not config:
        _check_fields({k: config.get(k) for k in BOOL_FIELDS}, "")
    needed = ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
    if c.get("kv_lora_rank"):
        needed += ["qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
    kind = _moe_kind(c)
    needed += {"deepseek": ["moe_intermediate_size"], "qwen3_moe": ["moe_intermediate_size"]}.get(kind, [])
    needed += {"llama4": ["intermediate_size", "num_local_experts"], "mixtral": ["intermediate_size"]}.get(kind, [])
    missing = [k for k in needed if c.get(k) is None]
    if kind == "qwen3_moe" and not (c.get("num_experts") or c.get("num_local_experts")):
        missing.append("num_experts")
    if not missing and _moe_layer_count(c) < c["num_hidden_layers"] and not _dense_intermediate(c):
        missing.append("intermediate_size")  # the dense layers' MLP
    if missing:
        raise ValueError(f"{CONFIG_NAME} has no {', '.join(where + k for k in missing)}")
    if not c.get("kv_lora_rank"):
        heads, kv_heads = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
        if not (c.get("head_dim") or c["hidden_size"] // heads):
            raise ValueError(
                f"{CONFIG_NAME}: {where}hidden_size {c['hidden_size']} is less than num_attention_heads {heads}, "
                "and there is no head_dim"
            )
        if heads % kv_heads:  # (transformers' repeat_kv and vLLM's attention both need whole groups)
            raise ValueError(
                f"{CONFIG_NAME}: {where}num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
    _int4_group(config)
    return c


def weights(config: dict, resident_ratio: float = RESIDENT_RATIO) -> list[Weights]:
    """The whole model's weights by tensor class (CLASSES), as its checkpoint stores them; ValueError
    names a field of `config` that `check_config` refuses."""
    return _weights(config, check_config(config), resident_ratio)


def _weights(config: dict, c: dict, resident_ratio: float) -> list[Weights]:
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    moe, n_moe = _moe(c), _moe_layer_count(c)  # every MoE layer has the same experts
    counts = dict.fromkeys(CLASSES, 0)
    counts["embedding"] = c["vocab_size"] * h
    if not config.get("tie_word_embeddings", c.get("tie_word_embeddings", False)):
        counts["lm_head"] = c["vocab_size"] * h
    counts["attention"] = layers * _attention(c)
    counts["norms"] = h + layers * (2 * h + _attention_norms(c))  # the final norm, and each layer's
    fp32 = 0  # parameters stored in FP32 (the router's score correction biases)
    if n_moe < layers:
        counts["mlp"] = (layers - n_moe) * 3 * h * _dense_intermediate(c)
    if moe is not None:
        experts, inter, shared = moe
        counts["experts"] = n_moe * experts * 3 * h * inter
        counts["shared_experts"] = n_moe * shared
        counts["router"] = n_moe * experts * h
        if c.get("topk_method") == "noaux_tc":  # DeepSeek-V3's score correction bias, stored in FP32
            fp32 = n_moe * experts
    int4, symmetric = _int4_scheme(config)
    out = []
    for name in CLASSES:
        n = counts[name]
        w = Weights(name, n, 2 * n, round(2 * n * (resident_ratio if name in COMPRESSED else 1)))
        if name == "attention" and c.get("kv_lora_rank"):  # kv_b_proj stays dense in the plugin
            kv_b = layers * c["kv_lora_rank"] * c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["v_head_dim"])
            w.resident_bytes = round(2 * (n - kv_b) * resident_ratio) + 2 * kv_b
        if name == "router" and fp32:
            w.params, w.stored_bytes, w.resident_bytes = n + fp32, 2 * n + 4 * fp32, w.resident_bytes + 4 * fp32
        if name == "experts" and int4:  # 4-bit codes and one BF16 scale per group (and a 4-bit zero point)
            codes, scales = n // 2, 2 * (n // int4)
            w.stored_bytes = codes + scales + (0 if symmetric else n // int4 // 2)
            w.resident_bytes = codes + round(scales * INT4_SCALES_RATIO) if symmetric else w.stored_bytes
            w.dtype = f"int4 (group {int4}{'' if symmetric else ', zero points'})"
        out.append(w)
    return out


def _head_dim(c: dict) -> int:
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def _attention(c: dict) -> int:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    if c.get("kv_lora_rank"):  # MLA: a LoRA'd query (or a plain one), the latent kv projections
        qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        q = h * c["q_lora_rank"] + c["q_lora_rank"] * heads * qk if c.get("q_lora_rank") else h * heads * qk
        kv = h * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
        kv += c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"])
        return q + kv + heads * c["v_head_dim"] * h
    head = _head_dim(c)
    kv_heads = c.get("num_key_value_heads") or heads
    bias = (heads + 2 * kv_heads) * head if c.get("model_type") == "qwen2" or c.get("attention_bias") else 0
    return 2 * h * heads * head + 2 * h * kv_heads * head + bias


def _attention_norms(c: dict) -> int:
    if c.get("kv_lora_rank"):
        return c["kv_lora_rank"] + (c.get("q_lora_rank") or 0)
    if c.get("model_type") in ("qwen3", "qwen3_moe"):  # q_norm and k_norm, per head
        return 2 * _head_dim(c)
    return 0  # Llama 4's qk-norm has no weights


def _dense_intermediate(c: dict) -> int | None:
    return c.get("intermediate_size_mlp") or c.get("intermediate_size")  # Llama 4 names its dense MLP's so


def _moe_kind(c: dict) -> str | None:
    """Which family's MoE layers the model has: deepseek (DeepSeek-V3, Kimi), llama4, qwen3_moe,
    mixtral (any other with num_local_experts), or None (dense)."""
    if c.get("n_routed_experts"):
        return "deepseek"
    if c.get("model_type", "").startswith("llama4"):
        return "llama4"
    if c.get("model_type") == "qwen3_moe":  # (transformers 5 writes num_experts as num_local_experts)
        return "qwen3_moe"
    return "mixtral" if c.get("num_local_experts") else None


def _moe(c: dict) -> tuple[int, int, int] | None:
    """(routed experts, their intermediate size, shared experts' parameters) of each MoE layer, or
    None for a dense model."""
    kind, h = _moe_kind(c), c["hidden_size"]
    if kind == "deepseek":
        inter = c["moe_intermediate_size"]
        return c["n_routed_experts"], inter, 3 * h * inter * (c.get("n_shared_experts") or 0)
    if kind == "llama4":
        return c["num_local_experts"], c["intermediate_size"], 3 * h * c["intermediate_size"]
    if kind == "qwen3_moe":
        return c.get("num_experts") or c["num_local_experts"], c["moe_intermediate_size"], 0
    if kind == "mixtral":
        return c["num_local_experts"], c["intermediate_size"], 0
    return None


def _is_moe_layer(c: dict, layer: int) -> bool:
    kind, layers = _moe_kind(c), c["num_hidden_layers"]
    if kind == "deepseek":
        return layer >= (c.get("first_k_dense_replace") or 0) and layer % (c.get("moe_layer_freq") or 1) == 0
    if kind == "llama4":
        step = c.get("interleave_moe_layer_step") or 1
        return layer in (c.get("moe_layers") or range(step - 1, layers, step))
    if kind == "qwen3_moe":
        return layer not in (c.get("mlp_only_layers") or ()) and (layer + 1) % (c.get("decoder_sparse_step") or 1) == 0
    return kind == "mixtral"


def _moe_layer_count(c: dict) -> int:
    """How many of the layers are MoE layers (those `_is_moe_layer` picks), in closed form."""
    kind, layers = _moe_kind(c), c["num_hidden_layers"]
    if kind == "deepseek":  # the multiples of the frequency in [first_k_dense_replace, layers)
        first, freq = min(c.get("first_k_dense_replace") or 0, layers), c.get("moe_layer_freq") or 1
        return -(-layers // freq) + (-first // freq)  # ceil(layers / freq) - ceil(first / freq)
    if kind == "llama4":
        if c.get("moe_layers"):
            return len({n for n in c["moe_layers"] if n < layers})
        step = c.get("interleave_moe_layer_step") or 1
        return len(range(step - 1, layers, step))
    if kind == "qwen3_moe":  # the layers n with (n + 1) a multiple of the step, less the dense ones among them
        step = c.get("decoder_sparse_step") or 1
        dense = {n for n in c.get("mlp_only_layers") or () if n < layers and (n + 1) % step == 0}
        return layers // step - len(dense)
    return layers if kind == "mixtral" else 0


def _int4_group(config: dict) -> int:
    """The group size of compressed-tensors INT4 weights (applied to the routed experts, as Kimi
    K2.5 quantizes them), or 0. A folder compressed from such a checkpoint keeps its config.
    ValueError names a part of the quantization_config that is not what it should be."""
    return _int4_scheme(config)[0]


def _int4_scheme(config: dict) -> tuple[int, bool]:
    """(_int4_group, whether its codes are symmetric: no zero points)."""
    name = "quantization_config"
    q = config.get(name) or text_config(config).get(name) or {}
    if not isinstance(q, dict):
        raise ValueError(f"{CONFIG_NAME}: {name} is {_show(q)}, not an object")
    q = hf_config.source_quantization({name: q}) or q
    if not isinstance(q, dict):
        raise ValueError(f"{CONFIG_NAME}: {name}.{hf_config.SOURCE_KEY} is {_show(q)}, not an object")
    if q.get("quant_method") != "compressed-tensors":
        return 0, True
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
        raise ValueError(f"{CONFIG_NAME}: {name}.config_groups is {_show(groups)}, not an object of objects")
    for key, group in groups.items():
        w = group.get("weights") or {}
        if not isinstance(w, dict):
            raise ValueError(f"{CONFIG_NAME}: {name}.config_groups.{key}.weights is {_show(w)}, not an object")
        _check_int(w, "group_size", 1, MAX_SIZE, f"{name}.config_groups.{key}.weights.")
        if w.get("num_bits") == 4:
            return w.get("group_size") or 0, w.get("symmetric", True) is not False
    return 0, True


def kv_bytes_per_token(config: dict, tp: int, pp: int, dtype_bytes: int = 2) -> int:
    """One GPU's KV cache per token: its layers' K and V for its share of the kv heads (replicated
    where there are fewer kv heads than ranks, as vLLM does); for MLA, the latent and its RoPE
    part, which every rank holds whole."""
    return _kv_bytes_per_token(check_config(config), tp, pp, dtype_bytes)


def _kv_bytes_per_token(c: dict, tp: int, pp: int, dtype_bytes: int) -> int:
    layers = math.ceil(c["num_hidden_layers"] / pp)
    if c.get("kv_lora_rank"):
        return layers * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * dtype_bytes
    kv_heads = max(1, (c.get("num_key_value_heads") or c["num_attention_heads"]) // tp)
    return layers * 2 * kv_heads * _head_dim(c) * dtype_bytes


def reserve_bytes(config: dict, tp: int) -> int:
    """What vLLM keeps beside weights and KV cache, estimated: the activations of one batch of
    MAX_NUM_BATCHED_TOKENS (residual, attention and MLP intermediates in FP32, per rank), the
    sampler's FP32 logits for MAX_NUM_SEQS sequences, and NON_TORCH_BYTES."""
    return _reserve_bytes(check_config(config), tp)


def _reserve_bytes(c: dict, tp: int) -> int:
    h = c["hidden_size"]
    moe = _moe(c) if _is_moe_layer(c, c["num_hidden_layers"] - 1) else None
    inter = max(_dense_intermediate(c) if c.get("intermediate_size") else 0, moe[1] * 2 if moe else 0)
    activations = MAX_NUM_BATCHED_TOKENS * (4 * h + 2 * inter // tp) * 4
    logits = MAX_NUM_SEQS * c["vocab_size"] * 4 * 2
    return activations + logits + NON_TORCH_BYTES


def _is_count(value, lo: int = 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= lo


def check_parallel(config: dict, tp: int, pp: int) -> None:
    """ValueError unless vLLM would build `config`'s model on tp × pp ranks: at least one stage a
    layer, and tp dividing what its tensor-parallel layers split (the attention heads, the kv heads
    or tp a multiple of them where each is replicated, the dense and shared MLPs' intermediate size)."""
    _check_parallel(check_config(config), tp, pp)


def _check_parallel(c: dict, tp: int, pp: int) -> None:
    if not (_is_count(tp) and _is_count(pp)):
        raise ValueError(f"tp and pp must be at least 1, not {_show(tp)} and {_show(pp)}")
    layers, heads = c["num_hidden_layers"], c["num_attention_heads"]
    if layers < pp:
        raise ValueError(f"pp={pp} is more stages than the model's {layers} layers")
    refuse = "vLLM refuses a tensor-parallel size that does not divide it"
    if heads % tp:
        raise ValueError(f"tp={tp} does not divide num_attention_heads {heads}: {refuse}")
    kv_heads = c.get("num_key_value_heads") or heads
    if not c.get("kv_lora_rank"):  # (MLA's latent is held whole at every rank)
        if kv_heads >= tp and kv_heads % tp:
            raise ValueError(f"tp={tp} does not divide num_key_value_heads {kv_heads}: {refuse}")
        if kv_heads < tp and tp % kv_heads:
            raise ValueError(
                f"tp={tp} is not a multiple of num_key_value_heads {kv_heads}: vLLM replicates each kv head on "
                "a whole number of ranks"
            )
    sizes = []
    if _moe_layer_count(c) < layers:
        sizes.append(("intermediate_size_mlp" if c.get("intermediate_size_mlp") else "intermediate_size", None))
    moe = _moe(c)
    if moe is not None and moe[2]:
        sizes.append(
            ("moe_intermediate_size", "n_shared_experts") if _moe_kind(c) == "deepseek" else ("intermediate_size", None)
        )
    for key, times in sizes:
        size = c[key] * (c[times] if times else 1)
        if size % tp:
            what = f"{key} x {times} = {size}" if times else f"{key} {size}"
            raise ValueError(f"tp={tp} does not divide {what}: {refuse}")


def _check_expert_split(c: dict, config: dict, inter: int, ranks: int) -> None:
    """ValueError unless each expert's intermediate size splits over `ranks` (vLLM's MoE layers
    without expert parallelism shard every expert over all tp x dp ranks), and for INT4 experts in
    whole groups (a rank's part of down_proj's input is whole groups of its scales)."""
    key = "moe_intermediate_size" if c.get("moe_intermediate_size") else "intermediate_size"
    if inter % ranks:
        raise ValueError(
            f"{key} {inter} does not split over {ranks} ranks (tp x dp): vLLM shards each expert over them "
            "without --enable-expert-parallel"
        )
    group = _int4_group(config)
    if group and (inter // ranks) % group:
        raise ValueError(
            f"{key} {inter} over {ranks} ranks (tp x dp) leaves {inter // ranks} columns of down_proj a rank, "
            f"not whole INT4 groups of {group}: use --enable-expert-parallel"
        )


def plan(
    config: dict,
    gpu_bytes: int,
    tp: int = 1,
    pp: int = 1,
    *,
    dp: int = 1,
    expert_parallel: bool = False,
    kv_dtype_bytes: int = 2,
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
    resident_ratio: float = RESIDENT_RATIO,
) -> Plan:
    """One GPU's share of `config`'s model on dp × tp × pp GPUs of `gpu_bytes` each (see the module
    docstring): attention, dense and shared MLPs, embedding and lm_head split over a data-parallel
    rank's tp GPUs; the routed experts over all dp × tp (an expert's rows and columns, or with
    `expert_parallel` whole experts, the most any rank holds). Raises ValueError naming the
    config's field that `check_config` refuses, or what vLLM would refuse of the sizes
    (`check_parallel`), or the bad argument."""
    if not _is_count(gpu_bytes):
        raise ValueError(f"gpu_bytes must be a positive integer, not {_show(gpu_bytes)}")
    if not _is_count(kv_dtype_bytes) or kv_dtype_bytes > 8:
        raise ValueError(f"kv_dtype_bytes must be 1 to 8, not {_show(kv_dtype_bytes)}")
    for name, share in (("gpu_memory_utilization", gpu_memory_utilization), ("resident_ratio", resident_ratio)):
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:  # (NaN fails too)
            raise ValueError(f"{name} must lie in (0, 1], not {_show(share)}")
    c = check_config(config)
    _check_parallel(c, tp, pp)
    if not _is_count(dp) or dp > MAX_COUNT:
        raise ValueError(f"dp must be an integer from 1 to {MAX_COUNT}, not {_show(dp)}")
    if not isinstance(expert_parallel, bool):
        raise ValueError(f"expert_parallel must be true or false, not {_show(expert_parallel)}")
    moe = _moe(c)
    if moe is not None and not expert_parallel:
        _check_expert_split(c, config, moe[1], tp * dp)
    ws = _weights(config, c, resident_ratio)
    by = {w.name: w for w in ws}
    layers = c["num_hidden_layers"]
    stage = math.ceil(layers / pp) / layers  # the largest stage's share of the layers

    def gpu(attr: str) -> int:
        def share(name: str) -> float:
            w = getattr(by[name], attr)
            if name in ("router", "norms"):  # replicated at every rank
                return w * stage
            if name == "experts" and moe is not None:
                ranks = tp * dp
                return w * stage * (math.ceil(moe[0] / ranks) / moe[0] if expert_parallel else 1 / ranks)
            return w * stage / tp

        body = sum(share(n) for n in ("attention", "mlp", "router", "experts", "shared_experts", "norms"))
        ends = [getattr(by["embedding"], attr) / tp, getattr(by["lm_head"], attr) / tp]
        return round(body + (sum(ends) if pp == 1 else max(ends)))

    total = int(gpu_bytes * gpu_memory_utilization)
    reserve = _reserve_bytes(c, tp)
    per_token = _kv_bytes_per_token(c, tp, pp, kv_dtype_bytes)
    stored, resident = gpu("stored_bytes"), gpu("resident_bytes")
    notes = []
    if "vision_config" in config:
        notes.append("the vision tower is not counted")
    if c.get("kv_lora_rank"):
        notes.append("MLA's latent cache is held whole at every tensor-parallel rank")
    if dp > 1:
        notes.append(f"each of the {dp} data-parallel ranks holds the KV cache of its own requests: {dp}x the tokens")
    if expert_parallel and moe is None:
        notes.append("the model has no experts: expert parallelism changes nothing")
    if by["experts"].dtype.startswith("int4"):
        notes.append(
            "INT4 experts are counted as the W4A16 GEMV holds them (codes as stored, scales coded); the vLLM "
            "plugin does not hold them so yet on CUDA (it hands them to vLLM's own INT4 kernels)"
        )
    if c.get("num_nextn_predict_layers"):
        notes.append("the multi-token-prediction layers are not counted (vLLM serves without them)")
    if c.get("attention_chunk_size"):
        notes.append("chunked-attention layers are counted with a full KV cache (vLLM's hybrid allocator needs less)")
    return Plan(
        model_type=c.get("model_type", "?"),
        gpu_bytes=gpu_bytes,
        tp=tp,
        pp=pp,
        dp=dp,
        expert_parallel=expert_parallel,
        weights=ws,
        gpu_weights_stored=stored,
        gpu_weights_resident=resident,
        reserve_bytes=reserve,
        kv_bytes_per_token=per_token,
        kv_tokens_stored=max(0, total - stored - reserve) // per_token,
        kv_tokens_resident=max(0, total - resident - reserve) // per_token,
        notes=notes,
    )
