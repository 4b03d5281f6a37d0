"""Tiny random BF16 checkpoints that transformers writes, for the vLLM plugin's tests: a Llama
whose head counts divide by two (SmolLM2's nine heads do not, so it cannot run at TP=2) and a
Qwen3-MoE. Both take SmolLM2's tokenizer and chat template, so vLLM's chat entry points work."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _save(model, dst: Path, tokenizer_from: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(dtype).save_pretrained(tmp, safe_serialization=True)
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
