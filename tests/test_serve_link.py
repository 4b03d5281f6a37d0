"""`unweight serve`'s KV link and control connections under faults, with real processes: what a client
that hangs up leaves in the router's log, a worker holding the wrong secret, a KV link left unsealed
across hosts, and a refused KV transfer (the pair serves the next request at once)."""

from __future__ import annotations

import json
import socket
import time

import pytest
from test_serve_control import LoggedServer, wait_for

from test_serve import KEY, MESSAGES

pytestmark = pytest.mark.slow  # servers and worker processes: pytest -m 'not slow' leaves them out


@pytest.fixture(scope="module")
def srv(uw, tmp_path_factory):
    s = LoggedServer(tmp_path_factory.mktemp("logs"), str(uw), "--api-key", KEY)
    yield s
    s.stop()


def load(s: LoggedServer) -> int:
    return sum(w["running"] + w["queued"] for w in s.workers().values())


@pytest.mark.xfail(
    strict=True,
    reason="the fix is in runtime/serve/routes/generation.py (_unless_disconnected must retrieve the cancelled "
    "gather's outcome), a file being changed by another hand; see #51 item 10",
)
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
