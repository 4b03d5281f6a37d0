"""`unweight plan`: its weight counts against the tensors of real checkpoints that transformers
writes (tiny random ones of each family it knows), and its figures for the two models the
product exists for, from configs written by hand from their model cards (tests/data/configs/)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from safetensors import safe_open
from tiny_models import tiny_deepseek_v3, tiny_family, tiny_llama4

from helpers import run_cli
from unweight import hf_config, plan

CONFIGS = Path(__file__).with_name("data") / "configs"
# checkpoint tensor names -> the plan's tensor classes, first match wins
CLASS_OF = [
    (r"embed_tokens", "embedding"),
    (r"lm_head", "lm_head"),
    (r"norm\.weight$|layernorm", "norms"),
    (r"self_attn\.", "attention"),
    (r"shared_expert", "shared_experts"),
    (r"experts\.", "experts"),
    (r"(mlp|feed_forward|block_sparse_moe)\.(gate|router)\.", "router"),
    (r"(mlp|feed_forward)\.", "mlp"),
]


def stored_by_class(folder: Path) -> dict[str, int]:
    out = dict.fromkeys(plan.CLASSES, 0)
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                t = st.get_slice(name)
                cls = next(c for pattern, c in CLASS_OF if re.search(pattern, name))
                out[cls] += math.prod(t.get_shape()) * {"F32": 4, "BF16": 2}[t.get_dtype()]
    return out


@pytest.fixture(scope="module")
def tiny_folders(smollm2_dir, tmp_path_factory) -> list[Path]:
    d = tmp_path_factory.mktemp("plan")
    folders = [tiny_family(t, d / t) for t in ("llama", "qwen3", "qwen3_moe", "mixtral", "llama4_text")]
    return [*folders, tiny_llama4(d / "llama4", smollm2_dir), tiny_deepseek_v3(d / "deepseek-v3", smollm2_dir)]


def test_weights_by_class_equal_the_checkpoints_tensors(tiny_folders):
    for folder in tiny_folders:
        config = json.loads((folder / "config.json").read_text())
        counted = {w.name: w.stored_bytes for w in plan.weights(config)}
        assert counted == stored_by_class(folder), folder.name


def test_scout_and_kimi_k2_5_from_their_model_cards():
    """The parameter totals the model cards publish (Scout: 109B with its vision tower; Kimi K2:
    1.04T) and Kimi K2.5's checkpoint size (594 GB, 85 % INT4 codes), from the configs alone."""
    scout = json.loads((CONFIGS / "llama-4-scout.json").read_text())
    kimi = json.loads((CONFIGS / "kimi-k2.5.json").read_text())
    scout_params = sum(w.params for w in plan.weights(scout))
    assert 105e9 < scout_params < 109e9  # the text model (the vision tower is the rest)
    ws = {w.name: w for w in plan.weights(kimi)}
    assert abs(sum(w.params for w in ws.values()) / 1.04e12 - 1) < 0.02
    assert abs(sum(w.stored_bytes for w in ws.values()) / 594e9 - 1) < 0.01
    assert ws["experts"].dtype == "int4 (group 32)" and ws["experts"].resident_bytes == ws["experts"].stored_bytes
    tagged, _ = hf_config.tag(json.dumps(kimi).encode())  # the compressed folder's config: the same plan
    assert plan.weights(json.loads(tagged)) == plan.weights(kimi)
    on_1 = plan.plan(scout, plan.GPUS["h200"], tp=1)
    on_2 = plan.plan(scout, plan.GPUS["h200"], tp=2)
    assert on_1.kv_tokens_stored == on_1.kv_tokens_resident == 0  # 216 GB BF16, ~154 GB resident: not on one H200
    assert on_2.kv_tokens_resident > 2 * on_2.kv_tokens_stored > 0  # on two, compression triples the KV room
    assert on_2.kv_bytes_per_token == 48 * 2 * 4 * 128 * 2  # 8 kv heads, 4 per rank
    k8 = plan.plan(kimi, plan.GPUS["h100"], tp=8)
    assert k8.kv_bytes_per_token == 61 * (512 + 64) * 2  # MLA's latent, whole at every rank
    assert k8.gpu_weights_resident < k8.gpu_weights_stored and k8.kv_tokens_stored == 0  # 74.6 GB a GPU: over 0.9 x 80
    assert plan.plan(kimi, plan.GPUS["h200"], tp=8).kv_tokens_resident > 0


def test_the_command_prints_a_table_and_json(tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / "kimi-k2.5.json").read_text())
    r = run_cli("plan", tmp_path, "--gpu", "h100", "--tp", "8")
    assert r.returncode == 0, r.stderr
    assert "experts" in r.stdout and "KV cache" in r.stdout
    r = run_cli("plan", tmp_path, "--gpu", "80", "--tp", "8", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["tp"] == 8 and got["gpu_bytes"] == 80 << 30
    bad = run_cli("plan", tmp_path, "--gpu", "h100", "--tp", "0")
    assert bad.returncode != 0 and "tp" in bad.stderr
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    bad = run_cli("plan", tmp_path, "--gpu", "h100")
    assert bad.returncode == 1 and "model_type 'bert'" in bad.stderr
