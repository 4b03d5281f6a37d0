"""benchmarks/goodput_bench.py's own parts, without a model: how it counts failures, and how its
hosts set-up starts the server.

- Every request that did not finish has an error, counted by kind: against a real HTTP server that
  answers 429, sends an error event, cuts a stream, sends what the client cannot read, ends a stream
  short, or does not finish before the drain deadline (the last three failed with no kind before).
- The schedule asks for the usage chunk: TPOT divides by the tokens, and a count of chunks with text
  misses tokens whose text is not yet whole.
- The hosts set-up starts its router and workers with the loopback set-ups' options and with the
  kernels' pipelines the autotuner picks (it forced `fused` everywhere, a prefill several times
  slower, and the server's defaults: --max-queue 64, the model's --max-model-len).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import goodput_bench  # noqa: E402
from kv_handoff_bench import commands  # noqa: E402
from serve_bench import Job, Server  # noqa: E402

TOKENS = 4
KV_FAILED = "KV transfer with prefill-0 failed: the KV link failed"


class Misbehaving(BaseHTTPRequestHandler):
    """/v1/completions, streamed; the prompt's first token id says how to answer (CASES)."""

    protocol_version = "HTTP/1.0"  # the body ends when the connection closes

    def log_message(self, *_):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        case = CASES[body["prompt"][0]]
        if case == "queue full":
            self.send_response(429)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "queue full"}}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def data(x) -> None:
            self.wfile.write(f"data: {x if isinstance(x, str) else json.dumps(x)}\n\n".encode())
            self.wfile.flush()

        tokens = {"ok": TOKENS, "short": TOKENS - 2}.get(case, 1)
        for _ in range(tokens):
            data({"choices": [{"index": 0, "text": "a"}]})
        if case == "error event":
            data({"error": {"message": KV_FAILED}})
        elif case == "unreadable":
            data({"error": "not an object"})  # the client reads error.message: AttributeError
        elif case == "hangs":
            time.sleep(4)
        if case != "cut":
            data("[DONE]")


CASES = ["ok", "queue full", "error event", "cut", "unreadable", "short", "hangs"]


@pytest.fixture
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Misbehaving)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_every_failed_request_is_counted_by_kind(url):
    args = argparse.Namespace(duration=0.2, drain_timeout=2.0, concurrency=8, request_timeout=30)
    args.slo_ttft, args.slo_tpot = 10.0, 10.0
    jobs = [
        Job(i, "mixed", 0.0, "/v1/completions", {"prompt": [i], "max_tokens": TOKENS, "stream": True}, 1)
        for i in range(len(CASES))
    ]
    rows = goodput_bench.measure(url, args, 1.0, "uw", jobs)
    summary = goodput_bench.goodput(rows, args)
    assert [r["error"] is None for r in rows] == [True] + [False] * (len(CASES) - 1), rows
    assert summary["good"] == 1 and summary["errors"] == len(CASES) - 1
    assert summary["error_kinds"] == {
        "HTTP 429": 1,
        f"error event: {KV_FAILED.replace('0', 'N')}": 1,
        "stream ended without [DONE]": 1,
        "client AttributeError": 1,
        "short stream": 1,
        "not finished": 1,
    }, summary


def test_the_schedule_asks_for_the_servers_count_of_tokens():
    args = argparse.Namespace(seed=0, prompt_tokens="8-16", output_tokens="4-8", duration=20.0)
    jobs = goodput_bench.schedule(args, 1.0, "uw")
    assert jobs and all(j.body["stream_options"] == {"include_usage": True} for j in jobs)


@pytest.mark.slow  # starts `unweight serve` (which exits at once, without a model)
def test_the_hosts_setup_starts_the_server_as_the_loopback_one_does(tmp_path, monkeypatch):
    monkeypatch.delenv("UNWEIGHT_PIPELINE", raising=False)
    args = argparse.Namespace(max_batch=16, max_queue=256, max_model_len=2048, worker_threads=0)
    loopback = Server(tmp_path / "no-model", "disagg", args, tmp_path / "log")  # exits at once: only its cmd counts
    loopback.stop()
    cmds = commands("10.0.0.1", tmp_path, tmp_path / "secret", "auto", "auto", goodput_bench.server_options(args))

    def value(cmd: list[str], flag: str) -> str | None:
        return cmd[cmd.index(flag) + 1] if flag in cmd else None

    for role, (cmd, env) in cmds.items():
        for flag in ("--max-batch", "--max-queue", "--max-model-len"):
            assert value(loopback.cmd, flag) is not None and value(cmd, flag) == value(loopback.cmd, flag), (role, flag)
        assert "UNWEIGHT_PIPELINE" not in env, role  # the autotuner's pipelines, as the loopback server's
