"""Tiny random models of every supported family, made with transformers' own config classes,
saved in BF16, compressed, loaded with `unweight.load`: logits match transformers' (fp32 compute
on both sides, so only accumulation order differs) for a prompt and for cached decode steps."""

from __future__ import annotations

import pytest
import torch

import unweight
from unweight.errors import SourceError
from unweight.runtime.model.config import UnsupportedModelError

ATOL = 2e-4  # fp32 accumulation order on logits of magnitude ~0.1 (random N(0, 0.02) weights)
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    llama3_rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    return {
        "llama3.1-rope-scaling": LlamaConfig(**COMMON, rope_parameters=llama3_rope, tie_word_embeddings=False),
        "llama-linear-rope-tied": LlamaConfig(
            **COMMON,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
            tie_word_embeddings=True,
        ),
        "mistral-sliding-window": MistralConfig(**COMMON, sliding_window=8, tie_word_embeddings=False),
        "llama-attention-and-mlp-bias": LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True),
        "qwen2-qkv-bias": Qwen2Config(**COMMON, tie_word_embeddings=True),
        "qwen3-qk-norm": Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=False),
    }


@pytest.fixture(scope="module")
def configs():
    return _configs()


def make_model(cfg, folder):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    with torch.no_grad():  # give biases and norms values that matter (they start at 0 and 1)
        for name, p in m.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    m.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", list(_configs()))
def test_logits_match_transformers(family, configs, tmp_path):
    from transformers import AutoModelForCausalLM

    src = make_model(configs[family], tmp_path / "bf16")
    unweight.compress(src, tmp_path / "uw")
    ours = unweight.load(tmp_path / "uw", dtype="float32")
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    if family == "qwen2-qkv-bias":
        assert ours.model.layers[0].self_attn.qkv_proj.bias is not None
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(1))  # longer than the window
    seq = ours.new_sequence()
    got = ours.prefill(seq, ids, all_logits=True)
    with torch.no_grad():
        out = ref(ids[None], use_cache=True)
    assert (got - out.logits[0]).abs().max() < ATOL
    past = out.past_key_values
    for step in range(3):  # cached decode steps
        nxt = int(got[-1].argmax()) if step == 0 else int(got.argmax())
        got = ours.decode_step([seq], [nxt])[0]
        with torch.no_grad():
            out = ref(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        assert (got - out.logits[0, -1]).abs().max() < ATOL, f"decode step {step}"


def test_unknown_architecture_is_refused_with_the_list(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).to(torch.bfloat16).save_pretrained(
        tmp_path / "gpt2"
    )
    unweight.compress(tmp_path / "gpt2", tmp_path / "uw")
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*supported: llama, mistral, qwen2, qwen3"):
        unweight.load(tmp_path / "uw")


def without(folder, drop) -> None:
    """Rewrite the folder's model.safetensors without the tensors whose names `drop` accepts."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    save_file({n: t for n, t in tensors.items() if not drop(n)}, folder / "model.safetensors", {"format": "pt"})


def test_a_bias_the_config_gives_and_the_checkpoint_lacks_is_refused_by_both_doors(configs, tmp_path):
    """A qwen2 config (q/k/v biases, always) over weights without them: transformers' door and
    unweight.load refuse the folder, naming the bias."""
    from transformers import AutoModelForCausalLM

    src = make_model(configs["qwen2-qkv-bias"], tmp_path / "bf16")
    without(src, lambda n: n.endswith(".bias"))
    unweight.compress(src, tmp_path / "uw")
    with pytest.raises(SourceError, match=r"lacks model\.layers\.0\.self_attn\.q_proj\.bias, which a qwen2 config"):
        unweight.load(tmp_path / "uw")
    with pytest.raises(SourceError, match=r"self_attn\.q_proj\.bias"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "uw")


def test_a_bias_the_config_gives_no_layer_is_left_as_transformers_leaves_it(configs, tmp_path, caplog):
    """Biases in the checkpoint of a Llama whose config has no attention_bias: the model the config
    describes, as transformers builds it (the biases unused, with a warning), not another."""
    import json

    from transformers import AutoModelForCausalLM

    src = make_model(configs["llama-attention-and-mlp-bias"], tmp_path / "bf16")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "attention_bias": False, "mlp_bias": False}))
    unweight.compress(src, tmp_path / "uw")
    with caplog.at_level("WARNING"):
        ours = unweight.load(tmp_path / "uw", dtype="float32")
    assert "model.layers.0.self_attn.q_proj.bias" in caplog.text and "not used" in caplog.text
    assert ours.model.layers[0].self_attn.qkv_proj.bias is None
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(1))
    got = ours.prefill(ours.new_sequence(), ids, all_logits=True)
    with torch.no_grad():
        assert (got - ref(ids[None]).logits[0]).abs().max() < ATOL
