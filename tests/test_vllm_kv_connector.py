"""UnweightConnector (runtime/vllm/kv_connector.py) between two vLLM-CPU OpenAI servers on one host, on
the layouts of the models it is for, each compressed and run through the plugin: a prefill engine
(kv_producer) and a decode engine (kv_consumer), driven by NixlConnector's kv_transfer_params handshake
as vLLM's proxies drive it, sealed (both engines hold one secret_file).

- Llama-4-Scout's text layout in miniature at TP=2 on both engines: rank r pulls its kv head from
  rank r.
- Kimi K2.5's (DeepSeek-V3, MLA) in miniature: the latent cache moves token-exact, as one head.
- A pull that arrives before the prefill engine's next step waits for it.
- The prefill engine's worker stages a prompt's layers as the forward leaves them: once every one is
  coded its blocks go back to the engine and pulls are served from the frames; a stage that missed a
  layer keeps its blocks held, and staging stays within kv_stage_bytes.

SmolLM2's hand-offs (greedy answers equal to the decode engine's own, n choices, the cache freed once
acknowledged, strangers and bad kv_transfer_params refused, idle connections turned away, the bytes
on the wire) are checked on the engines in front of which tests/test_vllm_router.py runs the router,
on hosts of their own: one pair of SmolLM2 engines for both.

Each engine start takes a minute or more here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
from vllm_serve import PREFILL_PARAMS, engine_pair

from envs import vllm_env

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Summarize the following text. " + " ".join(["The quick brown fox jumps over the lazy dog."] * 30),
]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def secret(tmp_path_factory) -> dict:
    """The engines' kv_connector_extra_config: one secret_file for both."""
    path = tmp_path_factory.mktemp("kv-connector") / "secret"
    path.write_text("k" * 64 + "\n")
    path.chmod(0o600)
    return {"secret_file": str(path)}


def handed_off(prefill, decode, prompts: list[str]) -> list[tuple[int, int, int]]:
    """Each prompt prefilled by `prefill` and decoded by `decode` from the pulled KV: the decode
    engine's first token is the prefill engine's. (Not its whole greedy answer: these tiny models have
    random weights, so their logits are near ties, and after a hand-off vLLM computes the last prompt
    token in a step of its own where a whole prompt computes it in the prompt's batch; FP32 sums in
    another order then flip a near tie a few tokens on. SmolLM2's answers are compared whole, in
    tests/test_vllm_router.py.)
    Each prompt's layers were coded as the prefill engine's forward left them (a log line a rank).
    Returns the pulls the decode engine logged (one per rank and prompt)."""
    for prompt in prompts:
        first = prefill.complete(prompt, 1, PREFILL_PARAMS)
        out = decode.complete(prompt, NEW_TOKENS, first["kv_transfer_params"])["choices"][0]
        assert out["token_ids"][0] == first["choices"][0]["token_ids"][0], out
        assert len(out["token_ids"]) == NEW_TOKENS
    coded = re.findall(r"request \S+: (\d+) tokens of \d+ layers coded in", prefill.text())
    pulled = decode.pulls()
    assert sorted(map(int, coded)) == sorted(t for t, _, _ in pulled), (coded, pulled)
    return pulled


def test_tensor_parallel_2_pulls_each_ranks_heads_from_the_same_rank(secret, smollm2_dir, tmp_path):
    """Llama-4-Scout's text layout in miniature (2 kv heads: one a rank) at TP=2 on both engines:
    rank r of the decode engine pulls its head from rank r of the prefill engine."""
    from test_vllm import compress
    from tiny_models import tiny_llama4

    uw = compress(tiny_llama4(tmp_path / "tiny-llama4", smollm2_dir), tmp_path / "tiny-llama4-uw")
    args = ["--tensor-parallel-size", "2"]
    # vLLM's CPU workers bind a NUMA node each unless told their cores: one core each here (as tests/vllm_driver.py)
    cores = sorted(os.sched_getaffinity(0))
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}|{cores[-1]}"}
    with engine_pair(vllm_env(), uw, tmp_path, extra_config=secret, args=args, env=env) as (p, d, _):
        done = handed_off(p, d, PROMPTS)
    heads = sorted(raw // (t * 2 * 2 * 64 * 4) for t, _, raw in done)  # 2 layers, K and V, head_dim 64, FP32
    assert len(done) == 2 * len(PROMPTS) and heads == [1] * len(done), done  # each rank one of the 2 kv heads


def test_mla_latent_cache_moves_as_one_head(secret, smollm2_dir, tmp_path):
    """Kimi K2.5's architecture (DeepSeek-V3: MLA, 512 + 64 latent values a token) in miniature:
    the latent cache, blocks of 16 tokens on vLLM-CPU, moves token-exact."""
    from test_vllm import compress
    from tiny_models import tiny_deepseek_v3

    uw = compress(tiny_deepseek_v3(tmp_path / "tiny-deepseek-v3", smollm2_dir), tmp_path / "tiny-deepseek-v3-uw")
    with engine_pair(vllm_env(), uw, tmp_path, extra_config=secret) as (p, d, _):
        done = handed_off(p, d, PROMPTS)
    layers = json.loads((uw / "config.json").read_text())["num_hidden_layers"]
    assert [raw for _, _, raw in done] == [t * layers * 576 * 4 for t, _, _ in done], done  # FP32 latents
    assert all(wire < raw for _, wire, raw in done), done


WAITS = """
import threading, time
from unweight.runtime.vllm.kv_worker import KVWorker, Send, Settings
w = KVWorker(Settings(block_size=16, producer=False), None)
out = {}
ask = {"request_id": "r", "blocks": [3], "first_block": 0, "tokens": 5}
t = threading.Thread(target=lambda: out.setdefault("early", w._check(ask)))
t.start()
time.sleep(1)
w.hold({"r": Send([3], 5, 60)})
t.join(30)
w._free("r")
print(repr(out.get("early")), repr(w._check(ask)))
"""


def test_a_pull_that_comes_before_the_engines_step_waits_for_it():
    """vLLM answers a prefill's kv_transfer_params as the request finishes, but tells the worker it
    holds the blocks at its next step, which may come after another prompt's whole forward: a pull
    arriving in between waits for that step instead of being refused (2 of 5 overlapping requests
    were, in a goodput run); once freed, a request is refused at once."""
    r = subprocess.run([str(vllm_env()), "-c", WAITS], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    early, late = r.stdout.strip().splitlines()[-1].split(" ", 1)
    assert early == "None" and "no request r held here" in late, r.stdout


STAGES = """
import json, os, threading, time, torch
from unweight.runtime.kv import wire
from unweight.runtime.kv.side_channel import Layout
from unweight.runtime.vllm.kv_worker import KVWorker, Save, Send, Settings

def worker(stage_bytes):
    w = KVWorker(Settings(block_size=4, producer=False, stage_bytes=stage_bytes), None)
    w.layout = Layout(2, 1, 8, torch.bfloat16, 4, None)  # 2 layers of (blocks, 1 head, 4 tokens, 2 x 8)
    g = torch.Generator().manual_seed(0)
    w.caches = [torch.randn(6, 1, 4, 16, generator=g).to(torch.bfloat16) for _ in range(2)]
    w.index = {"l0": 0, "l1": 1}
    w.coder = threading.Thread(target=w._code, daemon=True)
    w.coder.start()
    return w

out = {}
every = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, every[:1])  # as vLLM-CPU binds a worker's main thread
w = worker(1 << 20)
before = [c[[3, 1]].clone() for c in w.caches]
w.stage({"a": Save([3, 1], 7), "b": Save([2], 3)})  # the step whose forward completes a and b
w.save("l0")
w.save("l1")
w.saved()
w.stage({"c": Save([5], 2)})  # a step whose forward saves one layer of c's two
w.save("l0")
w.saved()
for c in w.caches:
    c.fill_(-1.0)  # the engine reuses the blocks
w.hold({"a": Send([3, 1], 7, 60), "c": Send([5], 2, 60)})
done, deadline = set(), time.monotonic() + 60
while "a" not in done and time.monotonic() < deadline:
    done |= w.results().finished_sending
    time.sleep(0.05)
out["freed"] = sorted(done)
ask = {"request_id": "a", "blocks": [1], "first_block": 1, "tokens": 3, "release": False}
out["check"] = w._check(ask)
stage = w._stage_of(ask)
ok = []
for i in range(2):
    layer = torch.empty(2, 8, 1, 8, dtype=torch.bfloat16)
    wire.decode_layer(stage.frame(i), layer)
    ok.append(torch.equal(layer.view(-1).view(torch.int16), before[i].reshape(-1).view(torch.int16)))
out["frames"] = ok
out["short"] = w._check(ask | {"tokens": 2})
out["c_failed"] = w.held["c"].stage.error
w.drop({"b"})
w._free("a")
w._free("c")
out["staged_bytes"] = w.staged_bytes
w0 = worker(0)
w0.stage({"a": Save([3, 1], 7)})
out["over_budget"] = sorted(w0.stages)
out["coder_cores"] = [sorted(os.sched_getaffinity(w.coder.native_id)), every]
print(json.dumps(out))
"""


def test_a_prefill_is_staged_as_its_forward_leaves_each_layer():
    """The prefill worker's stages, without an engine: the layers saved in a step are coded from what the
    cache held then; a request whose every layer is coded goes back to the engine (finished_sending)
    once its hand-off is held, and a pull of its end from a later block is checked and served from the
    frames, bit-exact though the blocks were since overwritten; a pull of fewer tokens is refused; a
    stage that missed a layer fails and keeps its blocks; dropped and freed stages give back their
    bytes; with kv_stage_bytes 0 nothing is staged. The coding thread, started from a main thread bound
    to one core (as vLLM-CPU binds it), may run on every core."""
    r = subprocess.run([str(vllm_env()), "-c", STAGES], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["freed"] == ["a"] and out["check"] is None and out["frames"] == [True, True], out
    assert "are not their end" in out["short"] and "1 of 2 layers" in out["c_failed"], out
    assert out["staged_bytes"] == 0 and out["over_budget"] == [], out
    assert out["coder_cores"][0] == out["coder_cores"][1], out
