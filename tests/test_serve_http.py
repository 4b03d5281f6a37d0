"""The HTTP edge of `unweight serve`, with real sockets against the real server: body limits,
JSON that cannot be parsed safely, OpenAI error bodies, /v1/models/{id}, keys on /health and
/metrics, header and idle timeouts, the connection limit, tokenisation off the event loop,
non-streaming clients that hang up, and vLLM-named metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time

import httpx
import pytest

from test_serve import KEY, MESSAGES, Server

pytestmark = pytest.mark.slow  # engines and servers: pytest -m 'not slow' leaves them out

LIMIT_BODY = 4_000_000
LIMIT_CONNECTIONS = 64
MAX_LEN = 8192
AUTH = f"Authorization: Bearer {KEY}\r\n".encode()


@pytest.fixture(scope="module")
def server(uw):  # noqa: F811
    s = Server(
        str(uw),
        "--api-key",
        KEY,
        "--max-model-len",
        str(MAX_LEN),
        "--max-batch",
        "4",
        "--max-queue",
        "8",
        "--timeout-keep-alive",
        "1",
        "--timeout-header",
        "2",
        "--timeout-body",
        "2",
        "--limit-concurrency",
        str(LIMIT_CONNECTIONS),
        "--max-body-bytes",
        str(LIMIT_BODY),
    )
    yield s
    s.stop()


def connect(server: Server, timeout: float = 10) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=timeout)
    return s


def read_response(s: socket.socket) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response with a Content-Length body from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        body += s.recv(65536)
    return int(lines[0].split()[1]), headers, body


def metric(text: str, name: str, **labels) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([^{\s]+)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def closed_within(s: socket.socket, seconds: float) -> bool:
    """True if the server closes the connection (EOF or reset) within `seconds`."""
    s.settimeout(seconds)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


# -- bodies --------------------------------------------------------------------------------------
def test_a_body_announced_too_large_gets_413_before_it_is_sent(server):
    s = connect(server)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        + AUTH
        + b"Content-Type: application/json\r\nContent-Length: 314572800\r\n\r\n"
        + b"{" * 1000
    )
    status, headers, body = read_response(s)  # the other 300 MiB are never sent
    assert status == 413 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_a_chunked_body_gets_413_once_the_limit_has_arrived(server):
    s = connect(server)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * 65536
    for _ in range(LIMIT_BODY // len(chunk) + 2):  # past the limit, and no final chunk ever
        s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    status, _, body = read_response(s)
    assert status == 413 and json.loads(body)["error"]["type"] == "invalid_request_error"


# -- errors in OpenAI's body ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "method,path,content,status,code",
    [
        ("GET", "/v1/nothing-here", None, 404, "not_found"),
        ("DELETE", "/v1/models", None, 405, "method_not_allowed"),
        ("GET", "/v1/chat/completions", None, 405, "method_not_allowed"),
        ("GET", "/v1/models/gpt-4", None, 404, "model_not_found"),
        (
            "POST",
            "/v1/chat/completions",
            json.dumps({"model": "gpt-4", "messages": MESSAGES[0]}).encode(),
            404,
            "model_not_found",
        ),
        (
            "POST",
            "/v1/chat/completions",
            b'{"model": "uw", "messages": [{"role": "user", "content": "\\ud800 alone"}]}',
            400,
            None,
        ),
        ("POST", "/v1/completions", b'{"model": "uw", "prompt": "\\udc00"}', 400, None),
        (
            "POST",
            "/v1/chat/completions",
            b'{"model": "uw", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
            400,
            None,
        ),
        (
            "POST",
            "/v1/chat/completions",
            b'{"model": "uw", "stream_options": ' + b'{"a": ' * 2000 + b"1" + b"}" * 2000 + b', "messages": []}',
            400,
            None,
        ),
        ("POST", "/v1/chat/completions", b"\xff\xfe{}", 400, None),
    ],
)
def test_errors_have_openai_bodies(server, method, path, content, status, code):
    r = server.http.request(method, path, content=content)
    body = r.json()
    assert r.status_code == status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code and body["error"]["message"]


def test_a_paired_surrogate_escape_is_fine(server):
    r = server.http.post(
        "/v1/completions",
        content=b'{"model": "uw", "prompt": "smile \\ud83d\\ude00", "max_tokens": 2, "temperature": 0}',
    )
    assert r.status_code == 200, r.text


def test_models_retrieve_with_the_openai_client(server):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    m = client.models.retrieve("uw")
    assert m.id == "uw" and m.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found"


# -- keys ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models", "/v1/models/uw"])
def test_every_endpoint_needs_the_key(server, path):
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": f"Bearer {KEY}x"}):
        r = httpx.get(server.url + path, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert server.http.get(path).status_code == 200


def test_public_health_opens_health_and_metrics_only(uw):  # noqa: F811
    s = Server(str(uw), "--no-disagg", "--api-key", KEY, "--public-health", "--max-model-len", "256")
    try:
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert "vllm:num_requests_running" in httpx.get(f"{s.url}/metrics").text
        assert httpx.get(f"{s.url}/v1/models").status_code == 401
    finally:
        s.stop()


# -- connections ---------------------------------------------------------------------------------
def test_silent_connections_are_closed(server):
    socks = [connect(server) for _ in range(150)]
    deadline = time.monotonic() + 10  # keep-alive is 1 s here
    try:
        for s in socks:
            assert closed_within(s, max(0.01, deadline - time.monotonic())), "a silent connection stayed open"
    finally:
        for s in socks:
            s.close()


def test_a_header_sent_a_byte_at_a_time_is_cut_off(server):
    s = connect(server)
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + AUTH + b"X-Slow: " + b"s" * 200
    started = time.monotonic()
    for byte in head:  # a byte every 0.2 s: 50 s for the whole head, far past the 2 s header timeout
        try:
            s.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            break
        if closed_within(s, 0.2):
            break
    else:
        pytest.fail("the server read a byte-a-second header to its end")
    assert time.monotonic() - started < 30
    s.close()


def test_a_body_sent_a_byte_at_a_time_gets_408(server):
    body = json.dumps({"model": "uw", "prompt": "x" * 400, "max_tokens": 1}).encode()
    s = connect(server)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        + AUTH
        + b"Content-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
    )
    started = time.monotonic()
    try:
        for byte in body:  # a byte every 0.1 s: 40 s for the whole body, far past the 2 s body timeout
            s.sendall(bytes([byte]))
            if _readable(s, 0.1):  # the answer came
                break
        else:
            pytest.fail("the server read a byte-a-second body to its end")
        status, headers, answer = read_response(s)
    finally:
        s.close()
    assert status == 408 and headers["connection"] == "close", (status, answer)
    assert (
        json.loads(answer)["error"]["code"] == "request_timeout"
        and "--timeout-body" in json.loads(answer)["error"]["message"]
    )
    assert time.monotonic() - started < 10
    assert server.http.get("/v1/models").status_code == 200


def _readable(s: socket.socket, seconds: float) -> bool:
    import select

    return bool(select.select([s], [], [], seconds)[0])


def test_connections_over_the_limit_get_503(server):
    before = metric(server.http.get("/metrics").text, "http_requests_total", status="503")
    held = [connect(server) for _ in range(LIMIT_CONNECTIONS + 4)]  # the newest ones are over the limit
    try:
        held[-1].sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n")
        status, headers, body = read_response(held[-1])
        assert status == 503 and headers["connection"] == "close" and headers["retry-after"]
        assert json.loads(body)["error"]["code"] == "overloaded"
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while metric(server.http.get("/metrics").text, "http_requests_total", status="503") < before + 1:
        assert time.monotonic() < deadline, "the 503 was not counted"
        time.sleep(0.2)
    assert server.http.get("/v1/models").status_code == 200  # once they are gone, requests are served again


# -- the event loop ------------------------------------------------------------------------------
def test_a_prompt_certainly_too_long_is_refused_before_tokenising(server):
    r = server.http.post("/v1/completions", json={"model": "uw", "prompt": "word " * 300_000, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "characters" in r.json()["error"]["message"]


def test_health_answers_while_a_long_prompt_is_tokenised(server):
    """A prompt just under the character pre-check takes the tokenizer a while; /health is
    answered meanwhile (the tokenizer runs on a thread, not on the event loop)."""
    random = __import__("random").Random(0)
    prompt = "".join(
        chr(0x4E00 + random.randrange(20_000)) for _ in range(MAX_LEN * 80)
    )  # ~2 s of tokenizer time, 2 MB
    order, big = [], {}

    def send_big():
        big["r"] = server.http.post("/v1/completions", json={"model": "uw", "prompt": prompt, "max_tokens": 4})
        order.append("prompt")

    t = threading.Thread(target=send_big)
    t.start()
    time.sleep(0.5)  # the request is in (a 2 MB body on localhost)
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}) as c:
        for _ in range(3):
            assert c.get("/health").status_code == 200
            order.append("health")
    t.join()
    assert (
        big["r"].status_code == 400 and big["r"].json()["error"]["code"] == "context_length_exceeded"
    )  # too many tokens
    assert order[:3] == ["health"] * 3, order


def wait_for(server: Server, name: str, check, timeout: float, **labels) -> float:
    deadline = time.monotonic() + timeout
    while True:
        v = metric(server.http.get("/metrics").text, name, **labels)
        if check(v):
            return v
        assert time.monotonic() < deadline, f"{name} stayed at {v}"
        time.sleep(0.2)


def worker_load(server: Server) -> int:
    """Sequences the workers hold: running, queued, or with their KV cache on the way."""
    return sum(w["running"] + w["queued"] for w in server.health()["workers"])


def test_non_streaming_clients_that_hang_up_free_their_slots(server):
    """Eight clients (every queue slot) ask for 1,000 tokens without streaming and hang up; their
    requests are cancelled, so the workers drop them and the next client is served, not 429."""
    before = metric(server.http.get("/metrics").text, "vllm:request_success_total", finished_reason="abort")
    counting = ", ".join(str(i) for i in range(1, 30)) + ","  # greedy, the model counts on: no early EOS
    body = json.dumps({"model": "uw", "prompt": counting, "max_tokens": 1000, "temperature": 0}).encode()
    socks = []
    for _ in range(8):
        s = connect(server)
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            + AUTH
            + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            + body
        )
        socks.append(s)
    deadline = time.monotonic() + 60
    while worker_load(server) < 8:  # all prefilled: 4 in the decode batch, 4 waiting for a place
        assert time.monotonic() < deadline, "the requests did not reach the workers"
        time.sleep(0.2)
    assert server.chat(MESSAGES[0], max_tokens=2).status_code == 429  # every slot is taken
    for s in socks:
        s.close()
    deadline = time.monotonic() + 20  # 8 x 1,000 tokens at batch 4 would take minutes here
    while (load := worker_load(server)) > 0:
        assert time.monotonic() < deadline, f"{load} abandoned requests still run"
        time.sleep(0.2)
    assert server.chat(MESSAGES[0], max_tokens=4).status_code == 200
    assert metric(server.http.get("/metrics").text, "vllm:request_success_total", finished_reason="abort") == before + 8


# -- metrics -------------------------------------------------------------------------------------
def test_metrics_use_vllms_names_types_and_labels(server):
    text0 = server.http.get("/metrics").text
    r = server.chat(MESSAGES[0], max_tokens=5)
    assert r.status_code == 200
    prompt, completion = r.json()["usage"]["prompt_tokens"], r.json()["usage"]["completion_tokens"]
    server.http.get("/v1/nothing-here")
    text = server.http.get("/metrics").text
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    for name, kind in {
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_prefill_time_seconds": "histogram",
        "vllm:request_decode_time_seconds": "histogram",
        "vllm:prompt_tokens_total": "counter",
        "vllm:generation_tokens_total": "counter",
        "vllm:request_success_total": "counter",
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "http_requests_total": "counter",
        "unweight:worker_requests_total": "counter",
        "unweight:worker_restarts_total": "counter",
    }.items():
        assert types.get(name) == kind, name
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert all('model_name="uw"' in line for line in samples)
    grew = {
        n: metric(text, n) - metric(text0, n)
        for n in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count")
    }
    assert grew == {
        "vllm:prompt_tokens_total": prompt,
        "vllm:generation_tokens_total": completion,
        "vllm:time_to_first_token_seconds_count": 1,
    }
    assert (
        metric(text, "vllm:request_success_total", finished_reason="length")
        - metric(text0, "vllm:request_success_total", finished_reason="length")
        == 1
    )
    assert (
        metric(text, "vllm:inter_token_latency_seconds_count") - metric(text0, "vllm:inter_token_latency_seconds_count")
        == completion - 1
    )
    assert metric(text, "http_requests_total", status="404") >= 1 + metric(text0, "http_requests_total", status="404")
    for i in range(3):  # client-chosen methods do not become label values (one series each would grow without bound)
        server.http.request(f"X{i}", "/v1/models")
    assert "X0" not in server.http.get("/metrics").text
    assert 'le="2560.0"' in text and 'le="7680.0"' in text  # vLLM's TTFT and request-latency buckets


def test_a_stop_string_counts_as_stop(server):
    full = server.chat(MESSAGES[0], max_tokens=16).json()["choices"][0]["message"]["content"]
    before = metric(server.http.get("/metrics").text, "vllm:request_success_total", finished_reason="stop")
    r = server.chat(MESSAGES[0], max_tokens=16, stop=[full.split()[2]])
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert metric(server.http.get("/metrics").text, "vllm:request_success_total", finished_reason="stop") == before + 1


def test_a_restarted_worker_leaves_no_stale_series(server):
    """Last in this module: it kills the decode worker."""
    workers = {w["role"]: w for w in server.health()["workers"]}
    old = workers["decode"]["pid"]
    served = metric(server.http.get("/metrics").text, "unweight:worker_requests_total", worker="decode-0")
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:
        d = next(w for w in server.http.get("/health").json()["workers"] if w["role"] == "decode")
        if d["state"] == "ready" and d["pid"] != old:
            break
        assert time.monotonic() < deadline, "the decode worker did not come back"
        time.sleep(0.5)
    text = server.http.get("/metrics").text
    assert f'pid="{old}"' not in text and f'pid="{d["pid"]}"' in text
    assert metric(text, "unweight:worker_restarts_total", worker="decode-0") == 1
    assert (
        metric(text, "unweight:worker_requests_total", worker="decode-0") == served
    )  # a counter: it does not restart from 0
    assert metric(text, "unweight:worker_up", worker="decode-0") == 1
