"""A real trained Llama-architecture chat model (SmolLM2-135M-Instruct) through the whole archive
path: compress, verify, decompress byte for byte, and transformers still answers correctly from
the decompressed folder."""

from __future__ import annotations

import hashlib

import pytest

import unweight
from helpers import run_cli


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


@pytest.fixture(scope="module")
def compressed(smollm2_uw):
    return smollm2_uw


@pytest.mark.slow
def test_smollm2_round_trip_is_byte_identical(smollm2_dir, compressed, tmp_path):
    out, summary = compressed
    # Weights from 4-bit blocks compress far better than trained BF16; only check that it shrank.
    assert summary["total"]["saving_percent"] > 20
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(summary["copied_files"])
    assert run_cli("verify", out, "--against", smollm2_dir).returncode == 0
    back = tmp_path / "back"
    assert unweight.decompress(out, back) > 0
    assert sha256(back / "model.safetensors") == sha256(smollm2_dir / "model.safetensors")


def test_transformers_answers_from_the_decompressed_folder(compressed, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = compressed
    back = tmp_path / "back"
    unweight.decompress(out, back)
    tok = AutoTokenizer.from_pretrained(back)
    model = AutoModelForCausalLM.from_pretrained(back, dtype=torch.bfloat16)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    new = model.generate(**ids, max_new_tokens=10, do_sample=False)[0, ids["input_ids"].shape[1] :]
    assert "Paris" in tok.decode(new, skip_special_tokens=True)


def test_smollm2_serving_layout(smollm2_dir, tmp_path):
    report = unweight.compress(smollm2_dir, tmp_path / "sv", layout="serving")
    tiles = [t for t in report.tensors if t.codec == "tiles"]
    assert len(tiles) >= 7 * 30  # every linear weight of the 30 layers is in tiles
    assert unweight.verify(tmp_path / "sv", against=smollm2_dir).ok
