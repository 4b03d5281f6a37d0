"""`unweight serve` for real: the router and its worker processes, HTTP on 127.0.0.1, the real
SmolLM2-135M-Instruct in compressed form, on the CPU.

The servers run with UNWEIGHT_PIPELINE=fused: the fused CPU GEMV computes every row of a batch
exactly as it would alone, so greedy text does not depend on which requests share a batch and
can be compared token for token with `unweight generate`. They compute in FP32 unless a test names
a --dtype, as the in-process references do: `auto` is BF16 on some CPUs and FP32 on others, and
the same tests should test the same thing on both (the BF16 server has its own test).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

import unweight

pytestmark = pytest.mark.slow  # engines and servers: pytest -m 'not slow' leaves them out

KEY = "test-key"
MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "Say hello in Spanish."}],
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`unweight serve` as a subprocess (stderr to a pipe, or to the file object `stderr`)."""

    def __init__(
        self, *args: str, port: int | None = None, wait: bool = True, env: dict | None = None, stderr=subprocess.PIPE
    ):
        self.port = port or free_port()
        env = {**os.environ, "UNWEIGHT_PIPELINE": "fused", **(env or {})}
        if "--dtype" not in args:
            args = (*args, "--dtype", "float32")
        cmd = [sys.executable, "-m", "unweight.cli.main", "serve", *args, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=stderr, text=True
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"})
        if wait:
            self.wait_ready()

    def output(self) -> str:
        """What the server wrote to stderr (from a pipe: once it has exited, else nothing)."""
        return self.proc.stderr.read() if self.proc.poll() is not None else ""

    def wait_ready(self, timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()[-3000:]
            try:
                r = self.http.get("/health")
                if r.status_code == 200:
                    return r.json()
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"server did not become ready: {self.output()[-3000:]}")

    def health(self) -> dict:
        return self.http.get("/health").json()

    def chat(self, messages, **kw) -> httpx.Response:
        return self.http.post(
            "/v1/chat/completions", json={"model": "uw", "messages": messages, "temperature": 0, **kw}
        )

    def stop(self) -> list[int]:
        """SIGTERM, as a user's Ctrl-C would; returns the worker pids it had."""
        pids = [w["pid"] for w in self.health()["workers"]] if self.proc.poll() is None else []
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)
        self.http.close()
        return pids


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split()[2] != "Z"


@pytest.fixture(scope="module")
def server(uw):
    s = Server(str(uw), "--api-key", KEY, "--max-model-len", "512", "--max-queue", "24")
    yield s
    pids = s.stop()
    time.sleep(1)
    assert not [p for p in pids if alive(p)], "worker processes outlived the server"


@pytest.fixture(scope="module")
def expected(uw):
    """What `unweight generate` says, greedy, for each of MESSAGES (16 new tokens at most)."""
    model, tok = unweight.load(uw, dtype="float32"), unweight.load_tokenizer(uw)
    return [unweight.generate(model, tok, m, max_new_tokens=16) for m in MESSAGES]


def test_greedy_chat_equals_unweight_generate(server, expected):
    r = server.chat(MESSAGES[0], max_tokens=16)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == expected[0].text
    assert body["choices"][0]["finish_reason"] == expected[0].finish_reason
    assert body["usage"]["completion_tokens"] == len(expected[0].token_ids)
    assert body["usage"]["prompt_tokens"] == expected[0].prompt_tokens


def test_prefill_and_decode_ran_in_different_processes(server):
    server.chat(MESSAGES[1], max_tokens=4)
    workers = {w["role"]: w for w in server.health()["workers"]}
    assert workers["prefill"]["pid"] != workers["decode"]["pid"] != server.proc.pid
    assert workers["prefill"]["served"] >= 1 and workers["decode"]["served"] >= 1
    metrics = server.http.get("/metrics").text
    assert 'unweight:kv_transfer_bytes_total{decode="decode-0",model_name="uw",prefill="prefill-0"}' in metrics
    assert "vllm:time_to_first_token_seconds_bucket" in metrics and "vllm:inter_token_latency_seconds_count" in metrics


def prefix_counters(server) -> tuple[float, float]:
    from test_serve_http import metric

    text = server.http.get("/metrics").text
    return metric(text, "vllm:prefix_cache_queries_total"), metric(text, "vllm:prefix_cache_hits_total")


def test_a_prompts_choices_share_one_prefill(server, expected):
    """n choices of one prompt: the prefill worker runs the prompt once and starts the others from
    a copy of its KV cache and logits (vLLM's prefix-cache counters say so, in tokens); each choice
    is still what `generate` says. test_aggregated_mode checks the same of --no-disagg."""
    check_shared_prefill(server, expected)


def settled_prefix_counters(server) -> tuple[float, float]:
    """The counters once the heartbeats (every 0.5 s) have reported the requests before: the same twice, 1 s apart."""
    now = prefix_counters(server)
    for _ in range(30):
        time.sleep(1.0)
        now, was = prefix_counters(server), now
        if now == was:
            break
    return now


def check_shared_prefill(server, expected) -> None:
    """n=4 on an idle worker (its first job runs while the others arrive), then on a busy one (a long
    prompt runs while all four arrive, and they are taken in together): either way the prompt is
    prefilled once, and the counters say so."""
    import threading

    from test_serve_http import metric

    for busy in (False, True):
        before = settled_prefix_counters(server)
        long = [100 + i % 5000 for i in range(400)]
        if busy:
            body = {"model": "uw", "prompt": long, "max_tokens": 1}
            first = threading.Thread(target=server.http.post, args=("/v1/completions",), kwargs={"json": body})
            first.start()
            deadline = time.monotonic() + 60
            while not metric(server.http.get("/metrics").text, "vllm:num_requests_waiting"):
                assert time.monotonic() < deadline, "the long prompt never reached the router"
                time.sleep(0.05)
            time.sleep(0.5)  # on to its worker (sub-millisecond), whose prefill of it takes seconds
        i = int(busy)  # another prompt: one kept from the round before is a hit for every choice
        r = server.chat(MESSAGES[i], max_tokens=16, n=4)
        if busy:
            first.join(timeout=300)
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["message"]["content"] for c in body["choices"]] == [expected[i].text] * 4
        prompt = body["usage"]["prompt_tokens"]
        want = (before[0] + 4 * prompt + (len(long) if busy else 0), before[1] + 3 * prompt)
        deadline = time.monotonic() + 30
        while prefix_counters(server) != want and time.monotonic() < deadline:  # they come with heartbeats
            time.sleep(0.2)
        assert prefix_counters(server) == want, busy


@pytest.fixture(scope="module")
def chunked(uw):
    """A server whose prompts may take several PREFILL_CHUNK turns (a context of four chunks), with
    the prefill pipeline (seconds for a long prompt, not minutes)."""
    from unweight.runtime.serve.prefill_worker import PREFILL_CHUNK

    s = Server(
        str(uw), "--api-key", KEY, "--max-model-len", str(4 * PREFILL_CHUNK), env={"UNWEIGHT_PIPELINE": "decode_matmul"}
    )
    yield s
    s.stop()


def test_a_prompt_behind_a_long_one_waits_one_chunk_not_the_whole_prompt(chunked):
    """Prompts take turns PREFILL_CHUNK tokens at a time, and one that arrives during a chunk runs
    next. A prompt of two chunks, sent while the first of a three-chunk prompt runs, is answered
    first: its chunks run between the long one's (long 1, it 1, long 2, it 2). First in, first out,
    it waited for the whole long prefill; taken in only after the long prompt's next chunk, as the
    round robin first did, it finished after it (long 1, long 2, it 1, long 3)."""
    import threading

    from unweight.runtime.serve.prefill_worker import PREFILL_CHUNK

    s, finished = chunked, []

    def ask(name: str, chunks: int) -> None:
        prompt = [100 + i % 5000 for i in range(chunks * PREFILL_CHUNK - 8)]
        body = {"model": "uw", "prompt": prompt, "max_tokens": 1}
        finished.append((name, s.http.post("/v1/completions", json=body).status_code))

    long = threading.Thread(target=ask, args=("long", 3))
    long.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until the long one is in the prefill worker (its first chunk runs)
        if {w["role"]: w for w in s.health()["workers"]}["prefill"]["queued"]:
            break
        time.sleep(0.05)
    ask("two chunks", 2)
    long.join(timeout=300)
    assert finished == [("two chunks", 200), ("long", 200)]


def test_the_choices_of_a_prompt_of_several_chunks_share_one_prefill(chunked):
    """n=4 on a prompt of two chunks: its other choices wait for the first to finish and start from its
    copy. Taking turns as separate prompts, each choice's first chunk ran before the first choice's
    last (fairness_bench: 12,000 of n=16's 16,000 prompt tokens shared, where 15,000 are due)."""
    from unweight.runtime.serve.prefill_worker import PREFILL_CHUNK

    before = settled_prefix_counters(chunked)
    prompt = [200 + i % 5000 for i in range(2 * PREFILL_CHUNK - 8)]
    r = chunked.http.post("/v1/completions", json={"model": "uw", "prompt": prompt, "max_tokens": 2, "n": 4})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text
    want = (before[0] + 4 * len(prompt), before[1] + 3 * len(prompt))
    deadline = time.monotonic() + 30
    while prefix_counters(chunked) != want and time.monotonic() < deadline:  # they come with heartbeats
        time.sleep(0.2)
    assert prefix_counters(chunked) == want


def test_streaming_equals_non_streaming_with_the_openai_client(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    assert [m.id for m in client.models.list()] == ["uw"]
    whole = client.completions.create(model="uw", prompt="The history of Rome", max_tokens=20, temperature=0)
    pieces = client.completions.create(
        model="uw", prompt="The history of Rome", max_tokens=20, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in pieces) == whole.choices[0].text and whole.usage.completion_tokens == 20
    chat = client.chat.completions.create(model="uw", messages=MESSAGES[0], max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model="uw", messages=MESSAGES[0], max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content


def test_sixteen_concurrent_clients_get_complete_correct_answers(server, expected):
    def ask(i: int) -> tuple[int, str, str]:
        r = server.chat(MESSAGES[i % 4], max_tokens=16, stream=(i % 2 == 1))
        if i % 2:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            return (
                i,
                "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks),
                r.text.rstrip().splitlines()[-1],
            )
        return i, r.json()["choices"][0]["message"]["content"], "data: [DONE]"

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(ask, range(16)))
    for i, text, last in results:
        assert text == expected[i % 4].text and last == "data: [DONE]", f"client {i}"


@pytest.mark.parametrize(
    "body,status,fragment",
    [
        (b"{not json", 400, "not valid JSON"),
        ({"model": "uw", "messages": MESSAGES[0], "max_tokens": "ten"}, 400, "max_tokens"),
        ({"model": "uw", "messages": MESSAGES[0], "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "gpt-4", "messages": MESSAGES[0]}, 404, "is not served here"),
        ({"model": "uw", "messages": [{"role": "user", "content": "word " * 600}]}, 400, "context length"),
        ({"model": "uw", "messages": MESSAGES[0], "n": 65}, 400, "n"),
        (
            {"model": "uw", "messages": MESSAGES[0], "tools": [{"type": "function", "function": {"name": "f"}}]},
            400,
            "tools",
        ),
        ({"model": "uw", "messages": "hello"}, 400, "messages"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, fragment):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = server.http.post("/v1/chat/completions", **kw)
    assert r.status_code == status and fragment in r.json()["error"]["message"]


def test_wrong_api_key_is_401(server):
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "uw", "messages": MESSAGES[0]},
        headers={"Authorization": "Bearer nope"},
    )
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def wait_idle(server: Server, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = {w["name"]: w for w in server.health()["workers"]}
        d = workers["decode-0"]
        if d["running"] == 0 and d["kv_blocks_used"] == 0 and d["queued"] == 0:
            return workers
        time.sleep(0.3)
    raise AssertionError(f"decode worker still busy: {workers}")


def test_disconnect_mid_stream_frees_the_slot_and_cache(server):
    body = {"model": "uw", "messages": MESSAGES[1], "max_tokens": 300, "temperature": 0, "stream": True, "stop": None}
    with server.http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
    wait_idle(server)  # long before 300 tokens could have been made


def test_overload_gets_429_with_retry_after(server):
    # a prompt whose greedy answer runs to max_tokens (a short one, "What is 2 + 2?", ends after 11
    # tokens: with fast kernels those drained the queue as quickly as the 64 requests arrived)
    story = [{"role": "user", "content": "Write a long story about a dragon who learns to paint."}]
    body = {"model": "uw", "messages": story, "max_tokens": 200, "temperature": 0, "stream": True}

    def start(_):
        c = httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
        cm = c.stream("POST", "/v1/chat/completions", json=body)
        r = cm.__enter__()
        return c, cm, r

    # 64 at once: the server holds at most --max-batch (16) decoding, one prefilling and --max-queue
    # (24) waiting, and none of these 200-token answers ends before the last request arrives (on a
    # fast CPU, 32 could all be taken in as the first ones left the queue for the decode batch)
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        opened = list(pool.map(start, range(64)))
    codes = [r.status_code for _, _, r in opened]
    busy = [r for _, _, r in opened if r.status_code == 429]
    message = json.loads(busy[0].read())["error"]["message"] if busy else ""
    for c, cm, _ in opened:
        cm.__exit__(None, None, None)
        c.close()
    assert set(codes) <= {200, 429} and busy and codes.count(200) >= 16
    assert busy[0].headers["Retry-After"] and "busy" in message
    wait_idle(server)


def test_killed_worker_fails_its_requests_then_comes_back(server, expected):
    decode_pid = {w["role"]: w for w in server.health()["workers"]}["decode"]["pid"]
    body = {"model": "uw", "messages": MESSAGES[3], "max_tokens": 400, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    with server.http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        os.kill(decode_pid, signal.SIGKILL)
        rest = [line for line in lines if line]
    assert time.monotonic() - t0 < 60
    assert any('"worker_failed"' in line for line in rest) and rest[-1] == "data: [DONE]"
    assert server.proc.poll() is None  # the router stayed up
    # the request can fail first through the prefill worker, whose KV hand-off to the dead worker
    # breaks, before the router's 0.2 s watcher polls the process: give the watcher a few rounds
    deadline = time.monotonic() + 10
    while True:
        d = next(w for w in server.health()["workers"] if w["role"] == "decode")
        if d["restarts"] >= 1 or d["state"] == "dead" or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert d["restarts"] >= 1 or d["state"] == "dead"
    h = server.wait_ready()
    d = next(w for w in h["workers"] if w["role"] == "decode")
    assert d["restarts"] == 1 and d["pid"] != decode_pid and d["state"] == "ready"
    r = server.chat(MESSAGES[0], max_tokens=16)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected[0].text


def staggered_chats(s: Server) -> list[str]:
    """Each of MESSAGES as a greedy chat of 16 tokens at most, sent 0.3 s apart from threads of their
    own, so that the later prompts arrive while the first ones decode; the answers' texts."""

    def ask(i: int) -> str:
        time.sleep(0.3 * i)
        body = {"model": "uw", "messages": MESSAGES[i], "max_tokens": 16, "temperature": 0}
        return s.http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]

    with concurrent.futures.ThreadPoolExecutor(len(MESSAGES)) as pool:
        return list(pool.map(ask, range(len(MESSAGES))))


def test_aggregated_mode(uw, expected):
    """--no-disagg answers as `generate` does, also when prompts arrive beside a running batch (they
    are prefilled in the same forward as its next step)."""
    s = Server(str(uw), "--no-disagg")
    try:
        h = s.health()
        assert h["mode"] == "aggregated" and [w["role"] for w in h["workers"]] == ["worker"]
        assert staggered_chats(s) == [e.text for e in expected]
        check_shared_prefill(s, expected)
    finally:
        s.stop()


def test_auto_dtype_server_answers_as_generate_in_the_same_dtype(uw, monkeypatch):
    """`--dtype auto` (the default): BF16 where the CPU has AVX512_BF16, FP32 elsewhere, in the workers
    as in `unweight.load`; the KV handed from prefill to decode is in that dtype. Concurrent greedy
    chats give `generate`'s text in that dtype, the fused pipeline in both."""
    from unweight.runtime.kernels.cpu_avx2 import BF16_DOT

    monkeypatch.setenv("UNWEIGHT_PIPELINE", "fused")
    model, tok = unweight.load(uw), unweight.load_tokenizer(uw)
    assert model.compute_dtype == (torch.bfloat16 if BF16_DOT else torch.float32)
    want = [unweight.generate(model, tok, m, max_new_tokens=16).text for m in MESSAGES]
    s = Server(str(uw), "--dtype", "auto", "--max-model-len", "512")
    try:
        assert staggered_chats(s) == want
    finally:
        s.stop()
