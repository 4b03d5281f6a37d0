"""`unweight serve`'s KV link and control connections under faults, with real processes: what a client
that hangs up leaves in the router's log, a worker holding the wrong secret, a KV link left unsealed
across hosts, and a refused KV transfer (the pair serves the next request at once)."""

from __future__ import annotations

import json
import secrets
import socket
import subprocess
import sys
import time

import pytest
import zmq
from test_serve_control import LoggedServer, wait_for, write_secret

from test_serve import KEY, MESSAGES
from unweight.runtime.serve.protocol import curve_keys

pytestmark = pytest.mark.slow  # servers and worker processes: pytest -m 'not slow' leaves them out


@pytest.fixture(scope="module")
def srv(uw, tmp_path_factory):
    s = LoggedServer(tmp_path_factory.mktemp("logs"), str(uw), "--api-key", KEY)
    yield s
    s.stop()


def load(s: LoggedServer) -> int:
    return sum(w["running"] + w["queued"] for w in s.workers().values())


def test_a_client_that_hangs_up_leaves_no_traceback_in_the_log(srv):
    """#51 item 10: a non-streaming client that hangs up while its request runs is one cancelled
    request, not an 8-line CancelledError traceback in the router's log (any client could flood it)."""
    body = json.dumps({"model": "uw", "prompt": "The history of Rome", "max_tokens": 400, "temperature": 0}).encode()
    for _ in range(3):
        c = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        c.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n" % KEY.encode()
            + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            + body
        )
        wait_for(lambda: load(srv) > 0, 60, "the request to reach a worker", step=0.05)
        c.close()
        wait_for(lambda: load(srv) == 0, 30, "the abandoned request to be dropped")
    r = srv.http.post("/v1/chat/completions", json={"model": "uw", "messages": MESSAGES[0], "max_tokens": 4})
    assert r.status_code == 200, r.text
    time.sleep(1)
    logs = srv.logs()
    assert "Traceback" not in logs and "CancelledError" not in logs, logs[-3000:]


def test_a_worker_with_the_wrong_secret_gives_up_naming_the_cause(uw, tmp_path):
    """#51 item 9: a worker whose secret is not its router's retried its handshake about 23 times a
    second, forever. It retries at most about once a second per socket, and after 3 x --worker-timeout
    of refusals it exits non-zero, saying why."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)  # a router of another secret, as `unweight serve --role router` binds it
    router.setsockopt(zmq.LINGER, 0)
    router.curve_server = True
    router.curve_publickey, router.curve_secretkey = curve_keys(secrets.token_hex(32))["router"]
    monitor = router.get_monitor_socket(zmq.EVENT_ACCEPTED)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    write_secret(tmp_path / "secret")
    worker = subprocess.Popen(
        [sys.executable, "-m", "unweight.cli.main", "serve", str(uw), "--role", "decode", "--name", "decode-x"]
        + ["--router-address", f"127.0.0.1:{port}", "--control-secret-file", str(tmp_path / "secret")]
        + ["--worker-timeout", "2", "--worker-threads", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        accepted, deadline = [], time.monotonic() + 180  # the model loads first
        while worker.poll() is None and time.monotonic() < deadline:
            if monitor.poll(100):
                monitor.recv_multipart()
                accepted.append(time.monotonic())
                deadline = min(deadline, accepted[0] + 60)  # about 3 x 2 s after its first refusal
        assert accepted, "the worker never connected"
        assert worker.poll() is not None, f"the worker still retries after {len(accepted)} handshakes in 60 s"
        code = worker.returncode
        err = worker.stderr.read()
        assert code != 0 and "CURVE handshake" in err and "control secret" in err, (code, err[-2000:])
        assert "Traceback" not in err, err[-2000:]
        seconds = max(accepted[-1] - accepted[0], 1.0)
        assert len(accepted) <= 3 * seconds + 4, f"{len(accepted)} handshakes in {seconds:.1f} s"
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        ctx.destroy(linger=0)
