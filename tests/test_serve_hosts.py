"""`unweight serve` across hosts that are really separate: a router, a prefill worker, a decode
worker and a client, each in a network namespace of its own, joined by veth links to a bridge in a
fifth. Their addresses exist only inside namespaces this test makes, and removes.

Checked there, on the real SmolLM2 in compressed form:
- the roles start as docs/serving.md says (`--role`, `--router-address`, one secret file), each
  listening only on its own address;
- a completion and a stream give the same text as `unweight generate` (which `--no-disagg` gives
  too: tests/test_serve.py), with the KV hand-off coded and sealed across the link;
- the decode host's link cut mid-stream gives the client an error chunk, and the server answers
  again once the link is back;
- the prefill host's process killed, then started again, and the server answers again.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), as CI runs: without it the test fails saying so.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from hosts import Hosts
from test_serve import MESSAGES, expected  # noqa: F401 - expected: the fixture, shared

pytestmark = pytest.mark.slow

ROLES = ("router", "prefill", "decode", "client")
CLIENT = r"""
import json, sys, time, httpx
url, what = sys.argv[1], sys.argv[2]
with httpx.Client(base_url=url, timeout=120) as c:
    if what == "health":  # wait until every role has a ready worker
        deadline = time.monotonic() + float(sys.argv[3])
        while time.monotonic() < deadline:
            try:
                r = c.get("/health")
                if r.status_code == 200:
                    print(r.text)
                    sys.exit(0)
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        sys.exit("not ready")
    elif what == "metrics":
        print(c.get("/metrics").text)
    else:
        body = json.loads(what)
        if body.get("stream"):
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                print(r.status_code, flush=True)
                for line in r.iter_lines():
                    if line:
                        print(line, flush=True)
        else:
            r = c.post("/v1/chat/completions", json=body)
            print(r.status_code)
            print(r.text)
"""


def listening(pid: int) -> set[str]:
    """The addresses the process's listening TCP sockets are bound to, read from its own network
    namespace's tables (/proc/PID/net/tcp*, matched by socket inode)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ips = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    raw = bytes.fromhex(fields[1].split(":")[0])
                    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
                    ips.add(socket.inet_ntop(family, raw))
    return ips


@pytest.fixture
def hosts():
    try:
        h = Hosts(ROLES)
    except (RuntimeError, FileNotFoundError) as e:
        pytest.fail(f"cannot make network namespaces here (needs root and iproute2): {e}")
    yield h
    h.close()


def test_router_prefill_and_decode_on_separate_hosts(uw, expected, hosts, tmp_path):  # noqa: F811
    secret = tmp_path / "secret"
    secret.write_text("h" * 48 + "\n")
    secret.chmod(0o600)
    router_addr = hosts.addr["router"]
    url = f"http://{router_addr}:8000"
    env = {**os.environ, "UNWEIGHT_PIPELINE": "fused"}
    serve = [sys.executable, "-m", "unweight.cli.main", "serve", str(uw), "--control-secret-file", str(secret)]
    serve += ["--max-model-len", "512", "--dtype", "float32"]
    log = open(tmp_path / "log.txt", "w")  # noqa: SIM115 - every process writes here until the end

    def worker(role: str) -> subprocess.Popen:
        return hosts.run(
            role,
            *serve,
            *("--role", role, "--name", f"{role}-0", "--router-address", f"{router_addr}:5555"),
            *("--kv-compression", "on"),  # a veth outruns the codec: auto would send these raw
            env=env,
            stderr=log,
        )

    def client(*args: str, timeout: float = 180) -> str:
        r = subprocess.run(
            ["ip", "netns", "exec", hosts.ns["client"], sys.executable, "-c", CLIENT, url, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert r.returncode == 0, r.stderr[-2000:] + open(tmp_path / "log.txt").read()[-3000:]
        return r.stdout

    def chat(i: int, **kw) -> tuple[int, str]:
        status, body = client(
            json.dumps({"model": "uw", "messages": MESSAGES[i], "max_tokens": 16, "temperature": 0, **kw})
        ).split("\n", 1)
        return int(status), body

    procs = {
        "router": hosts.run(
            "router",
            *serve,
            *("--role", "router", "--host", router_addr, "--port", "8000", "--control-port", "5555"),
            *("--worker-timeout", "3"),
            env=env,
            stderr=log,
        ),
        "prefill": worker("prefill"),
        "decode": worker("decode"),
    }
    try:
        health = json.loads(client("health", "240", timeout=260))
        assert sorted(w["name"] for w in health["workers"]) == ["decode-0", "prefill-0"]

        # 1. each process listens on its own host's address only
        for role, p in procs.items():
            ips = listening(p.pid)
            assert ips and ips <= {hosts.addr[role]}, (role, ips)

        # 2. a completion and a stream, the same text as `unweight generate`
        status, body = chat(0)
        assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == expected[0].text
        lines = client(
            json.dumps({"model": "uw", "messages": MESSAGES[1], "max_tokens": 16, "temperature": 0, "stream": True})
        )
        chunks = [json.loads(x[6:]) for x in lines.splitlines()[1:] if x.startswith("data: {")]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == expected[1].text
        metrics = client("metrics")
        wire = sum(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("unweight:kv_wire_bytes_total{"))
        raw = sum(
            float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("unweight:kv_transfer_bytes_total{")
        )
        assert 0 < wire < 0.95 * raw, (wire, raw)  # FP32 KV, coded (and sealed: 16 bytes a layer)

        # 3. the decode host's link cut mid-stream: the client gets an error chunk, not a hang
        body = {"model": "uw", "messages": MESSAGES[2], "max_tokens": 400, "temperature": 0, "stream": True}
        body["ignore_eos"] = True
        stream = subprocess.Popen(
            ["ip", "netns", "exec", hosts.ns["client"], sys.executable, "-c", CLIENT, url, json.dumps(body)],
            stdout=subprocess.PIPE,
            text=True,
        )
        got = []
        for line in stream.stdout:
            got.append(line)
            if len(got) == 6:
                hosts.link("decode", False)
        stream.wait(timeout=60)
        hosts.link("decode", True)
        assert got[0].strip() == "200" and any('"worker_failed"' in x for x in got), got[-3:]
        assert got[-1].strip() == "data: [DONE]"
        client("health", "60")  # the decode worker's beats are back
        status, body = chat(2)
        assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == expected[2].text

        # 4. the prefill host's process killed, then started again
        procs["prefill"].send_signal(signal.SIGKILL)
        procs["prefill"].wait(timeout=30)
        time.sleep(4)  # past --worker-timeout: the router no longer counts on it
        status, _ = chat(3)
        assert status == 503
        procs["prefill"] = worker("prefill")
        client("health", "240", timeout=260)
        status, body = chat(3)
        assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == expected[3].text
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()
