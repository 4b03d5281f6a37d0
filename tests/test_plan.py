"""`unweight plan`: its weight counts against the tensors of real checkpoints that transformers
writes (tiny random ones of each family it knows), and its figures for the two models the
product exists for, from configs written by hand from their model cards (tests/data/configs/)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import resource
import signal
import subprocess
import sys
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
    experts = ws["experts"]  # as the GPU GEMV holds them: codes as stored, scales at their measured ratio
    codes, scales = experts.params // 2, experts.params // 32 * 2
    assert experts.dtype == "int4 (group 32)" and experts.stored_bytes == codes + scales
    assert experts.resident_bytes == codes + round(scales * plan.INT4_SCALES_RATIO)
    asym = json.loads(json.dumps(kimi))  # the same experts with zero points: 4 bits more a group, counted
    for group in asym["quantization_config"]["config_groups"].values():
        group["weights"]["symmetric"] = False
    zeros = {w.name: w for w in plan.weights(asym)}["experts"]
    assert zeros.dtype == "int4 (group 32, zero points)" and zeros.stored_bytes == codes + scales + codes // 32
    assert zeros.resident_bytes == zeros.stored_bytes  # held as stored: the GEMV takes symmetric codes
    tagged, _ = hf_config.tag(json.dumps(kimi).encode())  # the compressed folder's config: the same plan
    assert plan.weights(json.loads(tagged)) == plan.weights(kimi)
    on_1 = plan.plan(scout, plan.GPUS["h200"], tp=1)
    on_2 = plan.plan(scout, plan.GPUS["h200"], tp=2)
    assert on_1.kv_tokens_stored == on_1.kv_tokens_resident == 0  # 216 GB BF16, ~154 GB resident: not on one H200
    assert on_2.kv_tokens_resident > 2 * on_2.kv_tokens_stored > 0  # on two, compression triples the KV room
    assert on_2.kv_bytes_per_token == 48 * 2 * 4 * 128 * 2  # 8 kv heads, 4 per rank
    k8 = plan.plan(kimi, plan.GPUS["h100"], tp=8)
    assert k8.kv_bytes_per_token == 61 * (512 + 64) * 2  # MLA's latent, whole at every rank
    # 74.6 GB a GPU as stored, over 0.9 x 79.11 GiB; in unweight's layouts 70.5 GB, leaving 33,473 tokens
    assert k8.kv_tokens_stored == 0 and 30_000 < k8.kv_tokens_resident < 40_000
    assert plan.plan(kimi, plan.GPUS["h200"], tp=8).kv_tokens_stored > 0
    assert any("does not hold them so yet" in n for n in k8.notes)  # what the plugin holds today


def test_data_and_expert_parallel_shares():
    """Data parallelism replicates attention, the dense and shared MLPs and the embeddings per rank
    and spreads the experts over every GPU; expert parallelism places whole experts (the most any
    rank holds); without it each expert must split over tp x dp ranks, in whole INT4 groups."""
    kimi = json.loads((CONFIGS / "kimi-k2.5.json").read_text())
    tp8 = plan.plan(kimi, plan.GPUS["h200"], tp=8)
    dp8 = plan.plan(kimi, plan.GPUS["h200"], dp=8, expert_parallel=True)
    ws = {w.name: w for w in dp8.weights}
    replicated = sum(ws[n].stored_bytes for n in ("embedding", "attention", "mlp", "shared_experts", "lm_head"))
    assert dp8.gpus == tp8.gpus == 8 and dp8.kv_bytes_per_token == tp8.kv_bytes_per_token
    assert dp8.gpu_weights_stored - tp8.gpu_weights_stored == round(replicated * 7 / 8)
    assert plan.plan(kimi, plan.GPUS["h200"], dp=8).gpu_weights_stored == dp8.gpu_weights_stored  # 384 = 8 x 48
    assert any("8x the tokens" in n for n in dp8.notes)
    odd = plan.plan(kimi, plan.GPUS["h200"], tp=1, dp=5, expert_parallel=True)  # 384 experts: 77 on the first ranks
    assert odd.gpu_weights_stored == round(
        (replicated + ws["router"].stored_bytes + ws["norms"].stored_bytes) + ws["experts"].stored_bytes * 77 / 384
    )
    with pytest.raises(ValueError, match="moe_intermediate_size 2048 does not split over 3 ranks"):
        plan.plan(kimi, plan.GPUS["h200"], dp=3)
    with pytest.raises(ValueError, match="leaves 16 columns of down_proj a rank, not whole INT4 groups of 32"):
        plan.plan(kimi, plan.GPUS["h200"], tp=8, dp=16)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="dp must be an integer"):
            plan.plan(kimi, plan.GPUS["h200"], dp=bad)


def test_the_command_prints_a_table_and_json(tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / "kimi-k2.5.json").read_text())
    r = run_cli("plan", tmp_path, "--gpu", "h100", "--tp", "8")
    assert r.returncode == 0, r.stderr
    assert "experts" in r.stdout and "KV cache" in r.stdout
    r = run_cli("plan", tmp_path, "--gpu", "80", "--tp", "8", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["tp"] == 8 and got["gpu_bytes"] == 80 << 30 and got["dp"] == 1 and not got["expert_parallel"]
    r = run_cli("plan", tmp_path, "--gpu", "h200", "--dp", "8", "--enable-expert-parallel")
    assert r.returncode == 0 and "DP=8, EP" in r.stdout and "139.80 GiB" in r.stdout, r.stderr
    bad = run_cli("plan", tmp_path, "--gpu", "h100", "--tp", "0")
    assert bad.returncode != 0 and "tp" in bad.stderr
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    bad = run_cli("plan", tmp_path, "--gpu", "h100")
    assert bad.returncode == 1 and "model_type 'bert'" in bad.stderr


# A small Llama, and the bad configs made from it and from the two real ones: (name, config, --tp, the field
# the one-line error must name). Before the checks they ended in KeyError, TypeError, ZeroDivisionError,
# a string repeated as a count, negative bytes and tokens, or a plan for a tp that vLLM refuses.
MAX_LAYERS = 1 << 20  # the most num_hidden_layers the plan takes
MAX_CONFIG_BYTES = 16 << 20  # the largest config.json it reads
LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "intermediate_size": 96,
}


def _bad_configs() -> list[tuple[str, object, int, str]]:
    kimi = json.loads((CONFIGS / "kimi-k2.5.json").read_text())
    scout = json.loads((CONFIGS / "llama-4-scout.json").read_text())

    def llama(**fields):
        return {k: v for k, v in {**LLAMA, **fields}.items() if v is not ...}

    def text(config, **fields):
        out = json.loads(json.dumps(config))
        out["text_config"] = {k: v for k, v in {**out["text_config"], **fields}.items() if v is not ...}
        return out

    deep = [0]
    for _ in range(5000):  # nested garbage, deeper than repr can go
        deep = [deep]
    qwen3_moe = llama(model_type="qwen3_moe", moe_intermediate_size=32, num_experts=4)
    cases = [
        ("no hidden_size", llama(hidden_size=...), 1, "hidden_size"),
        ("no num_hidden_layers", llama(num_hidden_layers=...), 1, "num_hidden_layers"),
        ("no vocab_size", llama(vocab_size=...), 1, "vocab_size"),
        ("no intermediate_size", llama(intermediate_size=...), 1, "intermediate_size"),
        ("string", llama(hidden_size="64"), 1, "hidden_size"),
        ("float", llama(vocab_size=128.0), 1, "vocab_size"),
        ("bool for int", llama(num_attention_heads=True), 1, "num_attention_heads"),
        ("zero", llama(hidden_size=0), 1, "hidden_size"),
        ("negative", llama(hidden_size=-64), 1, "hidden_size"),
        ("negative intermediate", llama(intermediate_size=-96), 1, "intermediate_size"),
        ("huge", llama(vocab_size=10**30), 1, "vocab_size"),
        ("layers past the bound", llama(num_hidden_layers=MAX_LAYERS + 1), 1, "num_hidden_layers"),
        ("a billion layers", llama(num_hidden_layers=10**9), 1, "num_hidden_layers"),
        ("zero heads", llama(num_attention_heads=0, head_dim=8), 1, "num_attention_heads"),
        ("zero kv heads", llama(num_key_value_heads=0), 1, "num_key_value_heads"),
        ("kv heads not a divisor", llama(num_key_value_heads=3), 1, "num_key_value_heads"),
        ("head_dim 0 from hidden_size", llama(hidden_size=4), 1, "head_dim"),
        ("negative head_dim", llama(head_dim=-1), 1, "head_dim"),
        ("list", llama(vocab_size=[128]), 1, "vocab_size"),
        ("object", llama(intermediate_size={"a": 1}), 1, "intermediate_size"),
        ("nested garbage", llama(hidden_size=deep), 1, "hidden_size"),
        ("model_type a list", llama(model_type=["llama"]), 1, "model_type"),
        ("model_type null", llama(model_type=None), 1, "model_type"),
        ("text_config a string", {"text_config": "llama"}, 1, "text_config"),
        ("text_config a list", {**LLAMA, "text_config": [LLAMA]}, 1, "text_config"),
        ("nested text_config", {"text_config": {"text_config": LLAMA}}, 1, "model_type"),
        ("not an object", [LLAMA], 1, "JSON object"),
        ("tie_word_embeddings a string", llama(tie_word_embeddings="no"), 1, "tie_word_embeddings"),
        ("attention_bias an int", llama(attention_bias=1), 1, "attention_bias"),
        ("mixtral experts a string", llama(model_type="mixtral", num_local_experts="8"), 1, "num_local_experts"),
        ("qwen3_moe without experts", llama(model_type="qwen3_moe", moe_intermediate_size=32), 1, "num_experts"),
        ("qwen3_moe step 0", {**qwen3_moe, "decoder_sparse_step": 0}, 1, "decoder_sparse_step"),
        ("mlp_only_layers a string", {**qwen3_moe, "mlp_only_layers": "0"}, 1, "mlp_only_layers"),
        ("kimi moe_layer_freq 0", text(kimi, moe_layer_freq=0), 8, "moe_layer_freq"),
        ("kimi no qk_rope_head_dim", text(kimi, qk_rope_head_dim=...), 8, "qk_rope_head_dim"),
        ("kimi negative shared experts", text(kimi, n_shared_experts=-1), 8, "n_shared_experts"),
        ("kimi first_k_dense_replace a float", text(kimi, first_k_dense_replace=1.5), 8, "first_k_dense_replace"),
        ("kimi quantization_config a string", {**kimi, "quantization_config": "int4"}, 8, "quantization_config"),
        (
            "kimi config_groups a list",
            {**kimi, "quantization_config": {"quant_method": "compressed-tensors", "config_groups": [1]}},
            8,
            "config_groups",
        ),
        (
            "kimi negative group_size",
            {
                **kimi,
                "quantization_config": {
                    "quant_method": "compressed-tensors",
                    "config_groups": {"g": {"weights": {"num_bits": 4, "group_size": -32}}},
                },
            },
            8,
            "group_size",
        ),
        ("scout moe_layers a string", text(scout, moe_layers="all"), 2, "moe_layers"),
        ("scout moe_layers of floats", text(scout, moe_layers=[1.5]), 2, "moe_layers"),
        ("scout interleave step 0", text(scout, interleave_moe_layer_step=0), 2, "interleave_moe_layer_step"),
        ("scout no num_local_experts", text(scout, num_local_experts=...), 2, "num_local_experts"),
        # what vLLM refuses: tp must divide the heads, the kv heads (or be a multiple of them), the dense MLP
        ("9 heads on tp 2", llama(num_attention_heads=9, num_key_value_heads=9), 2, "num_attention_heads"),
        ("6 kv heads on tp 4", llama(num_attention_heads=12, num_key_value_heads=6), 4, "num_key_value_heads"),
        ("3 kv heads on tp 8", llama(num_attention_heads=24, num_key_value_heads=3), 8, "num_key_value_heads"),
        ("intermediate 100 on tp 8", llama(num_key_value_heads=8, intermediate_size=100), 8, "intermediate_size"),
        ("scout on tp 3", scout, 3, "num_attention_heads"),
        ("kimi on tp 3", kimi, 3, "num_attention_heads"),
        ("pp past the layers", llama(), 1, "pp"),
    ]
    return cases


@contextlib.contextmanager
def deadline(seconds: int):
    """TimeoutError if the block runs past `seconds` (a bound on a hang, not a measurement)."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_bad_configs_are_refused_with_one_line_naming_the_field():
    for name, config, tp, field in _bad_configs():
        pp = 3 if name == "pp past the layers" else 1
        with deadline(60), pytest.raises(ValueError) as e:
            plan.plan(config, plan.GPUS["h100"], tp, pp)
        message = str(e.value)
        assert field in message and "\n" not in message and len(message) < 300, (name, message)
    for config in (LLAMA, {"text_config": LLAMA}):  # the good one still plans
        assert plan.plan(config, plan.GPUS["h100"], 2).kv_tokens_stored > 0
    for call in (lambda: plan.plan(LLAMA, -1), lambda: plan.plan(LLAMA, 80 << 30, gpu_memory_utilization=math.nan)):
        with pytest.raises(ValueError):
            call()


def test_layers_are_counted_in_closed_form():
    """A model of the most layers a config may have is planned at once, with 2^20 times one layer's
    weights; the MoE layers each family's rule picks (DeepSeek's first dense layers and frequency,
    Qwen3-MoE's step less its mlp_only_layers, Llama 4's interleave step or list) count as the rule,
    layer by layer, gives."""
    one = plan.weights({**LLAMA, "num_hidden_layers": 1})
    with deadline(60):  # (a bound on a loop over the layers, not a measurement)
        many = plan.weights({**LLAMA, "num_hidden_layers": MAX_LAYERS})
        plan.plan({**LLAMA, "num_hidden_layers": MAX_LAYERS}, plan.GPUS["h200"], pp=4)
    for a, b in zip(one, many, strict=True):
        if a.name in ("attention", "mlp"):
            assert b.params == MAX_LAYERS * a.params
    h, dense = LLAMA["hidden_size"], 3 * LLAMA["hidden_size"] * LLAMA["intermediate_size"]
    moe = {"moe_intermediate_size": 32}
    for layers in range(1, 12):
        for step in range(1, 5):
            rules = [
                (
                    {
                        "model_type": "qwen3_moe",
                        "num_experts": 4,
                        "decoder_sparse_step": step,
                        "mlp_only_layers": [0, 3, 7, 40],
                    },
                    lambda n: (n + 1) % step == 0 and n not in (0, 3, 7),
                    32,
                ),
                (
                    {
                        "model_type": "deepseek_v3",
                        "n_routed_experts": 4,
                        "moe_layer_freq": step,
                        "first_k_dense_replace": step + 1,
                    },
                    lambda n: n >= step + 1 and n % step == 0,
                    32,
                ),
                (
                    {"model_type": "llama4_text", "num_local_experts": 4, "interleave_moe_layer_step": step},
                    lambda n: (n + 1) % step == 0,
                    LLAMA["intermediate_size"],
                ),
                (
                    {"model_type": "llama4_text", "num_local_experts": 4, "moe_layers": [step, 2 * step, 50]},
                    lambda n: n in (step, 2 * step),
                    LLAMA["intermediate_size"],
                ),
            ]
            for fields, is_moe, inter in rules:
                config = {k: v for k, v in {**LLAMA, **moe, "num_hidden_layers": layers, **fields}.items() if v}
                n_moe = sum(map(is_moe, range(layers)))
                ws = {w.name: w.params for w in plan.weights(config)}
                assert ws["experts"] == n_moe * 4 * 3 * h * inter, config
                assert ws["mlp"] == (layers - n_moe) * dense, config


def _plan_cli(folder: Path, *args: str, memory: int = 0) -> subprocess.CompletedProcess:
    """`unweight plan folder ...` as a process, bounded in time; with `memory`, its address space too
    (for the file that would otherwise be read without end)."""
    if not memory:
        return run_cli("plan", folder, *args, timeout=120)

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return subprocess.run(
        [sys.executable, "-m", "unweight.cli.main", "plan", str(folder), *args],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
        env={**os.environ, "COLUMNS": "200"},
    )


@pytest.mark.slow
def test_the_command_refuses_bad_configs_in_one_line(tmp_path):
    """A FIFO, a link to /dev/zero, a file past 16 MiB, bad UTF-8, nesting past the recursion limit, a
    billion layers, a negative size and a tp that vLLM refuses: exit 1 and one line naming the problem,
    no traceback, in bounded time (the FIFO hung, a billion layers spun for minutes, /dev/zero was read
    until the OOM killer came)."""

    def folder(name: str, body: bytes | dict | None = None) -> Path:
        d = tmp_path / name
        d.mkdir()
        if body is not None:
            (d / "config.json").write_bytes(body if isinstance(body, bytes) else json.dumps(body).encode())
        return d

    fifo = folder("fifo")
    os.mkfifo(fifo / "config.json")
    huge = folder("huge")
    with open(huge / "config.json", "wb") as f:
        f.truncate(MAX_CONFIG_BYTES + 1)  # sparse: nothing written
    cases = [
        (fifo, [], "FIFO"),
        (huge, [], "16 MiB"),
        (folder("missing"), [], "no such file"),
        (folder("utf8", b'{"model_type": "llama\xff"}'), [], "UTF-8"),
        (folder("deep", b"[" * 100_000 + b"]" * 100_000), [], "RecursionError"),
        (folder("billion", {**LLAMA, "num_hidden_layers": 10**9}), [], "num_hidden_layers"),
        (folder("negative", {**LLAMA, "hidden_size": -4096}), [], "hidden_size"),
        (
            folder("heads9", {**LLAMA, "num_attention_heads": 9, "num_key_value_heads": 9}),
            ["--tp", "2"],
            "num_attention_heads",
        ),
        (folder("gpu_inf"), ["--gpu", "inf"], "--gpu"),
        (folder("gpu_negative"), ["--gpu", "-80"], "--gpu"),
    ]
    zero = folder("zero")
    (zero / "config.json").symlink_to("/dev/zero")
    cases.append((zero, [], "character device"))
    for where, args, words in cases:
        r = _plan_cli(where, *args, memory=2 << 30 if where == zero else 0)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1, (where.name, r.returncode, r.stderr[-2000:])
        assert words in lines[0] and "Traceback" not in r.stderr and r.stdout == "", (where.name, r.stderr)
