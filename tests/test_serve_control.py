"""The control plane of `unweight serve` under attack and under faults, with real processes, real
HTTP and real ZeroMQ: who may join as a worker (and as a router), what a worker may say about which
request, malformed messages, which interfaces the sockets listen on, a hung worker, and a KV pool
too small for the requests in flight.

The "attackers" here are plain pyzmq sockets. One kind has no secret (it must get nothing and send
nothing that counts); the other holds the server's secret (an authenticated but buggy or rogue
worker), to check what the router still refuses from a peer it trusts.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid

import pytest
import zmq

import unweight
from test_serve import KEY, MESSAGES, Server, alive, free_port
from unweight.runtime.generate import encode_prompt
from unweight.runtime.kv.secret import read_secret_file
from unweight.runtime.serve.protocol import curve_keys

pytestmark = pytest.mark.slow  # engines and servers: pytest -m 'not slow' leaves them out

PROMPTS = [
    "The history of Rome",
    "Once upon a time, in a small village",
    "The best way to learn a language is",
    "In the year 2050, cities",
]
POOL_TOKENS = 112  # the small KV pool of the module's server: 7 blocks of 16 tokens
POOL_MAX_TOKENS = 64  # each completion: a few prompt tokens + 64 fit the pool alone; four at once need ~3x the pool


class LoggedServer(Server):
    """`unweight serve` as a subprocess whose stderr (router and workers) goes to a file to grep."""

    def __init__(self, log_dir, *args: str, env: dict | None = None):
        port = free_port()
        self.log_path = log_dir / f"serve-{port}.log"
        self._log = open(self.log_path, "w")
        super().__init__(*args, port=port, env=env, stderr=self._log)

    def logs(self) -> str:
        return self.log_path.read_text()

    output = logs

    def workers(self) -> dict[str, dict]:
        return {w["name"]: w for w in self.http.get("/health").json()["workers"]}

    def stop(self) -> None:
        # the test's own sockets posing as workers said hello with this process's pid
        pids = (
            [w["pid"] for w in self.workers().values() if w["pid"] != os.getpid()] if self.proc.poll() is None else []
        )
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)
        self.http.close()
        self._log.close()
        time.sleep(1)
        assert not [p for p in pids if alive(p)], "worker processes outlived the server"


def write_secret(path) -> str:
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return read_secret_file(path)


def dealer(
    ctx: zmq.Context, port: int, identity: str, keys: tuple[bytes, bytes] | None = None, server_key: bytes | None = None
) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, identity.encode())
    s.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        s.curve_publickey, s.curve_secretkey = keys
        s.curve_serverkey = server_key
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def send(sock: zmq.Socket, msg) -> None:
    sock.send(msg if isinstance(msg, bytes) else json.dumps(msg).encode())


def hello(role: str) -> dict:
    return {"op": "hello", "role": role, "pid": os.getpid(), "incarnation": uuid.uuid4().hex}


def received(sock: zmq.Socket, seconds: float) -> list[bytes]:
    got, deadline = [], time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000)):
            got.append(sock.recv())
    return got


def wait_for(predicate, timeout: float, what: str, step: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out waiting for {what}")


def rogue_worker(
    ctx: zmq.Context, srv: LoggedServer, name: str, keys: dict, role: str = "decode"
) -> tuple[zmq.Socket, zmq.Socket, str]:
    """A peer holding the workers' key that says hello as a worker of `role` and beats
    (running=1000, so the router never picks it): its main socket and its heartbeat socket, both
    kept open (a closed socket drops what it queued), and the incarnation it said."""
    sock = dealer(ctx, srv.control, name, keys["worker"], keys["router"][0])
    said = hello(role)
    send(sock, said)
    wait_for(lambda: srv.workers().get(name, {}).get("state") == "ready", 20, f"{name}'s hello")
    beat = retire(ctx, srv.control, name, keys)
    wait_for(lambda: srv.workers()[name]["running"] == 1000, 20, f"{name}'s beat")
    return sock, beat, said["incarnation"]


def sse_text(lines: list[str]) -> str:
    return "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines if line.startswith('data: {"id"'))


@pytest.fixture(scope="module")
def secret(tmp_path_factory):
    path = tmp_path_factory.mktemp("secret") / "control-secret"
    return path, write_secret(path)


@pytest.fixture(scope="module")
def srv(uw, secret, tmp_path_factory):
    """Router + prefill + decode on 127.0.0.1, a known control port, the secret from a file, and a
    KV pool of POOL_TOKENS tokens."""
    control = free_port()
    s = LoggedServer(
        tmp_path_factory.mktemp("logs"),
        str(uw),
        "--api-key",
        KEY,
        "--control-port",
        str(control),
        "--control-secret-file",
        str(secret[0]),
        "--kv-cache-tokens",
        str(POOL_TOKENS),
    )
    s.control = control
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model_and_tokenizer(uw):
    """The model as the servers run it (UNWEIGHT_PIPELINE=fused), so that long greedy completions
    agree token for token."""
    before = os.environ.get("UNWEIGHT_PIPELINE")
    os.environ["UNWEIGHT_PIPELINE"] = "fused"
    yield unweight.load(uw, dtype="float32"), unweight.load_tokenizer(uw)
    if before is None:
        os.environ.pop("UNWEIGHT_PIPELINE")
    else:
        os.environ["UNWEIGHT_PIPELINE"] = before


@pytest.fixture(scope="module")
def expected(model_and_tokenizer):
    model, tok = model_and_tokenizer
    return [unweight.generate(model, tok, m, max_new_tokens=16) for m in MESSAGES]


@pytest.fixture(scope="module")
def expected_long(model_and_tokenizer):
    """Greedy completions of PROMPTS, POOL_MAX_TOKENS tokens each (plain prompts, no template)."""
    model, tok = model_and_tokenizer
    return [unweight.generate(model, tok, p, max_new_tokens=POOL_MAX_TOKENS) for p in PROMPTS]


def chat_ok(s, expected, i: int = 0) -> None:
    r = s.http.post(
        "/v1/chat/completions", json={"model": "uw", "messages": MESSAGES[i], "max_tokens": 16, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == expected[i].text


def retire(ctx: zmq.Context, port: int, name: str, keys: dict) -> zmq.Socket:
    """Make an authenticated test worker the most loaded of its role (a beat from its NAME#beat
    socket), so the router never picks it."""
    beat = dealer(ctx, port, f"{name}#beat", keys["worker"], keys["router"][0])
    send(beat, {"op": "beat", "running": 1000, "queued": 1000, "kv_blocks_used": 0, "kv_blocks_total": 1})
    return beat


# -- fault: the control plane was open ------------------------------------------------------------
def test_a_process_without_the_secret_cannot_join_or_read_prompts(srv, secret, expected):
    keys = curve_keys(secret[1])
    ctx = zmq.Context()
    try:
        # a name that sorts first, so the router would pick it (ties go by name) if it were let in
        plain = dealer(ctx, srv.control, "a-intruder")
        wrong_key = dealer(
            ctx, srv.control, "a-intruder2", zmq.curve_keypair(), keys["router"][0]
        )  # knows the router's public key only
        for sock in (plain, wrong_key):
            send(sock, hello("prefill"))
            send(sock, {"op": "beat", "running": 0, "queued": 0, "kv_blocks_used": 0, "kv_blocks_total": 1})
        time.sleep(1)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(
                srv.http.post,
                "/v1/chat/completions",
                json={"model": "uw", "messages": MESSAGES[0], "max_tokens": 16, "temperature": 0},
                timeout=60,
            )
            got = received(plain, 3) + received(wrong_key, 0.5)
            r = answer.result()
        assert got == [], f"a peer without the secret received {got[:1]}"
        assert not {"a-intruder", "a-intruder2"} & set(srv.workers()), (
            "a peer without the secret was registered as a worker"
        )
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected[0].text
        logs = srv.logs()
        assert "refused a control connection" in logs and "CURVE" in logs
    finally:
        ctx.destroy(linger=0)


def test_a_worker_only_reports_on_requests_it_holds(srv, secret, expected_long):
    """An authenticated peer that is not holding a request cannot inject text into it or end it."""
    keys = curve_keys(secret[1])
    ctx = zmq.Context()
    try:
        rogue, _beat, _ = rogue_worker(ctx, srv, "zz-rogue", keys)
        body = {"model": "uw", "prompt": PROMPTS[0], "max_tokens": POOL_MAX_TOKENS, "temperature": 0, "stream": True}
        with srv.http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            rid = (
                json.loads(first[6:])["id"] + "-0-0"
            )  # the router's id of the request's one sequence (prompt 0, choice 0)
            send(
                rogue,
                {"op": "tokens", "items": [[rid, 1234, None, None], [rid, 567, None, None], [rid, None, "stop", None]]},
            )
            send(rogue, {"op": "failed", "id": rid, "error": "injected failure"})
            seq = {"sampling": {"max_new_tokens": 4}, "prompt": [1, 2], "output": [1], "eos": [2], "rng": None}
            send(
                rogue,
                {
                    "op": "prefilled",
                    "id": rid,
                    "tag": 1,
                    "first_token": 1,
                    "logprobs": None,
                    "seq": seq,
                    "kv_bytes": 0,
                    "decode": "zz-rogue",
                },
            )
            rest = [line for line in lines if line]
        assert sse_text([first, *rest]) == expected_long[0].text
        assert rest[-1] == "data: [DONE]" and not any("injected" in line for line in rest)
        assert "not a request it holds" in srv.logs()
    finally:
        ctx.destroy(linger=0)


def test_malformed_messages_are_dropped_and_nothing_else_is_affected(srv, secret, expected):
    keys = curve_keys(secret[1])
    ctx = zmq.Context()
    try:
        rogue, beat, _ = rogue_worker(ctx, srv, "zz-buggy", keys)
        for bad in [
            {
                "op": "beat",
                "running": "x",
                "queued": 0,
                "kv_blocks_used": 0,
                "kv_blocks_total": 1,
            },  # made every request a 500
            {"op": "beat", "running": -1, "queued": 0, "kv_blocks_used": 0, "kv_blocks_total": 1},
            {"op": "beat", "running": 1.5, "queued": 0, "kv_blocks_used": 0, "kv_blocks_total": 1},
            {"op": "beat", "running": 0, "queued": 0, "kv_blocks_used": 0, "kv_blocks_total": 1, "extra": 1},
            {"op": "hello", "role": "router", "pid": "1", "incarnation": "x"},
            {"op": "tokens", "items": [["a", "b", "c"]]},
            {"op": "tokens", "items": "nope"},
            {"op": "failed", "id": ["x"], "error": None},
            {"op": "prefilled", "id": "x"},
            {"op": "no-such-op"},
            [1, 2, 3],
            b"\xff\xfe not json",
            b"",
        ]:
            send(beat if isinstance(bad, dict) and bad.get("op") == "beat" else rogue, bad)
        send(
            rogue, {"op": "beat", "running": 0, "queued": 0, "kv_blocks_used": 0, "kv_blocks_total": 1}
        )  # a beat on the main socket
        rogue.send_multipart([b"two", b"frames"])
        time.sleep(1)
        assert srv.proc.poll() is None
        for i in range(3):
            chat_ok(srv, expected, i)
        h = srv.http.get("/health")
        assert h.status_code == 200 and srv.http.get("/metrics").status_code == 200
        assert srv.workers()["zz-buggy"]["running"] == 1000  # the valid beat stands; none of the bad ones was applied
        assert "dropped a bad control message" in srv.logs()
    finally:
        ctx.destroy(linger=0)


def test_a_worker_takes_jobs_only_from_its_router_and_survives_bad_ones(uw, secret, tmp_path, expected):
    """The worker side: a fake router (no secret) gets nothing from it; the real one (the test,
    holding the router's key) gets a failure for each bad job and correct tokens for a good one."""
    keys = curve_keys(secret[1])
    port = free_port()
    fake_ctx, ctx = zmq.Context(), zmq.Context()
    fake = fake_ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    fake.bind(f"tcp://127.0.0.1:{port}")
    log_path = tmp_path / "worker.log"
    with open(log_path, "w") as log:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "unweight.cli.main",
                "serve",
                str(uw),
                "--role",
                "worker",
                "--name",
                "worker-t",
                "--router-address",
                f"127.0.0.1:{port}",
                "--control-secret-file",
                str(secret[0]),
                "--worker-threads",
                "1",
                "--dtype",  # as the expected completions were made (and as test_serve's Server runs)
                "float32",
            ],
            env={**os.environ, "UNWEIGHT_PIPELINE": "fused"},
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    try:

        def refused():
            assert worker.poll() is None, log_path.read_text()
            if fake.poll(0):
                raise AssertionError(f"the fake router received {fake.recv_multipart()}")
            return "failed the CURVE handshake" in log_path.read_text()

        wait_for(refused, 120, "the worker to refuse the fake router")
        assert not fake.poll(500)
        fake_ctx.destroy(linger=0)

        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.curve_server = True
        router.curve_publickey, router.curve_secretkey = keys["router"]
        wait_for(lambda: _try_bind(router, port), 10, "the port to be free again")

        def from_worker(timeout: float = 60, announce: bool = False) -> dict:
            """The worker's next message on its main socket (heartbeats skipped, and repeated
            hellos after the first: each announce asked for one)."""
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0:
                if not router.poll(int(left * 1000)):
                    break
                ident, data = router.recv_multipart()
                msg = json.loads(data)
                if not ident.endswith(b"#beat") and (announce or msg["op"] != "hello"):
                    return msg
                if (
                    announce
                ):  # its first hello may have gone down with a refused connection: ask again, as the router does
                    router.send_multipart([b"worker-t", json.dumps({"op": "announce"}).encode()])
            raise AssertionError(f"the worker said nothing in {timeout} s; its log:\n{log_path.read_text()}")

        assert from_worker(announce=True)["op"] == "hello"

        def seq(prompt, **sampling) -> dict:
            return {
                "sampling": {"max_new_tokens": 4, **sampling},
                "prompt": prompt,
                "output": [],
                "eos": [],
                "rng": None,
            }

        bad_jobs = {
            "j-tokens": {"op": "generate", "id": "j-tokens", "seq": seq("x"), "prompt_logprobs": None},
            "j-sampling": {
                "op": "generate",
                "id": "j-sampling",
                "seq": seq([1, 2], max_new_tokens="3"),
                "prompt_logprobs": None,
            },
            "j-vocab": {"op": "generate", "id": "j-vocab", "seq": seq([10**9]), "prompt_logprobs": None},
            "j-extra": {"op": "generate", "id": "j-extra", "seq": seq([1]), "prompt_logprobs": None, "evil": True},
        }
        for job in bad_jobs.values():
            router.send_multipart([b"worker-t", json.dumps(job).encode()])
        for junk in [
            b"not json",
            b"[]",
            json.dumps({"op": "cancel", "id": 5}).encode(),
            json.dumps({"op": "shutdown", "now": 1}).encode(),
        ]:
            router.send_multipart([b"worker-t", junk])
        failed = set()
        while failed != set(bad_jobs):
            msg = from_worker()
            assert msg["op"] == "failed" and msg["id"] in bad_jobs and msg["code"] == "worker_failed", msg
            failed.add(msg["id"])
        assert worker.poll() is None

        tok = unweight.load_tokenizer(uw)
        ids = encode_prompt(tok, MESSAGES[0])
        want = expected[0].token_ids
        router.send_multipart(
            [
                b"worker-t",
                json.dumps(
                    {
                        "op": "generate",
                        "id": "j-good",
                        "seq": seq(ids, max_new_tokens=len(want)),
                        "prompt_logprobs": None,
                    }
                ).encode(),
            ]
        )
        got, finish = [], None
        while finish is None:
            msg = from_worker()
            assert msg["op"] == "tokens", msg
            for rid, token, finish, logprobs in msg["items"]:  # noqa: B007 - the last item's finish ends the loop
                assert rid == "j-good" and logprobs is None
                got.append(token)
        assert got == want and finish == "length"
        assert "dropped a bad control message" in log_path.read_text()
        router.send_multipart([b"worker-t", json.dumps({"op": "shutdown"}).encode()])
        assert worker.wait(timeout=30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        ctx.destroy(linger=0)
        fake_ctx.destroy(linger=0)


def _try_bind(sock: zmq.Socket, port: int) -> bool:
    try:
        sock.bind(f"tcp://127.0.0.1:{port}")
        return True
    except zmq.ZMQError:
        return False


def test_secret_files_readable_by_others_are_refused(uw, tmp_path):
    path = tmp_path / "secret"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o644)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "unweight.cli.main",
            "serve",
            str(uw),
            "--role",
            "decode",
            "--router-address",
            "127.0.0.1:1",
            "--control-secret-file",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "readable by group or others" in r.stderr and "chmod 600" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "unweight.cli.main", "serve", str(uw), "--role", "router"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "--control-secret-file" in r.stderr


# -- fault: the KV rendezvous TCPStore listened on every interface -----------------------------------
def listening(pid: int) -> set[tuple[str, int]]:
    import psutil

    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


def test_every_socket_listens_on_the_requested_host(srv, expected):
    chat_ok(srv, expected, 1)  # the KV groups (and gloo's own sockets) exist once a request has been handed off
    pids = [srv.proc.pid] + [w["pid"] for w in srv.workers().values() if w["name"] in ("prefill-0", "decode-0")]
    assert len(pids) == 3
    sockets = {pid: listening(pid) for pid in pids}
    everything = set().union(*sockets.values())
    # HTTP and control, nothing else: the KV rendezvous goes over the control socket
    assert sockets[srv.proc.pid] == {("127.0.0.1", srv.port), ("127.0.0.1", srv.control)}, sockets
    assert all(sockets[pid] for pid in pids[1:]), f"no KV sockets in the workers: {sockets}"  # gloo's pairs
    assert {ip for ip, _ in everything} == {"127.0.0.1"}, sockets


# -- fault: the KV rendezvous took unauthenticated keys without limit --------------------------------
def test_kv_rendezvous_keys_are_kept_to_their_pair_and_bounded(srv, secret):
    """Over the control channel (CURVE, so only holders of the secret reach it at all), a worker
    sets and reads only the keys of its own (prefill, decode) groups, a pair keeps a bounded
    number of keys, and a value over the limit is dropped."""
    keys = curve_keys(secret[1])
    ctx = zmq.Context()
    numbers = iter(range(10**6))

    def ask(sock: zmq.Socket, op: str, key: str, value: bytes | None = None) -> dict | None:
        n = next(numbers)
        send(
            sock,
            {
                "op": op,
                "n": n,
                "key": key,
                **({"value": base64.b64encode(value).decode()} if value is not None else {}),
            },
        )
        if not sock.poll(10_000):
            return None
        reply = json.loads(sock.recv())
        assert reply["op"] == "kv_reply" and reply["n"] == n, reply
        return reply

    try:
        rogues = {
            n: rogue_worker(ctx, srv, n, keys, role)
            for n, role in [("zz-kv-p", "prefill"), ("zz-kv-d", "decode"), ("zz-kv-d2", "decode")]
        }
        inc = {n: r[2] for n, r in rogues.items()}
        kv = {n: dealer(ctx, srv.control, f"{n}#kv", keys["worker"], keys["router"][0]) for n in rogues}
        group = f"kv/{inc['zz-kv-p']}/{inc['zz-kv-d']}/7"
        assert ask(kv["zz-kv-p"], "kv_set", f"{group}/0/0", b"where p listens")["error"] is None
        assert ask(kv["zz-kv-d"], "kv_get", f"{group}/0/1") == {
            "op": "kv_reply",
            "n": 1,
            "value": None,
            "error": None,
        }  # not set yet
        assert base64.b64decode(ask(kv["zz-kv-d"], "kv_get", f"{group}/0/0")["value"]) == b"where p listens"
        # the same secret, but not in this pair: neither reads nor writes its keys
        for op, value in (("kv_get", None), ("kv_set", b"x")):
            assert ask(kv["zz-kv-d2"], op, f"{group}/0/0", value)["error"] == "not a KV group of this worker"
        assert base64.b64decode(ask(kv["zz-kv-d"], "kv_get", f"{group}/0/0")["value"]) == b"where p listens"
        # a pair with a worker that is not one of this server's, a key outside any group, a name without a hello
        assert (
            "not a ready worker"
            in ask(kv["zz-kv-p"], "kv_set", f"kv/{inc['zz-kv-p']}/{uuid.uuid4().hex}/1/0/0", b"x")["error"]
        )
        assert ask(kv["zz-kv-p"], "kv_set", "elsewhere/0/0", b"x")["error"].startswith("not a KV group key")
        stranger = dealer(ctx, srv.control, "zz-kv-stranger#kv", keys["worker"], keys["router"][0])
        assert "not a ready worker of this server" in ask(stranger, "kv_get", f"{group}/0/0")["error"]
        # bounded: a pair keeps its newest keys only
        for i in range(100):
            assert ask(kv["zz-kv-d"], "kv_set", f"{group}/k{i}", b"v%d" % i)["error"] is None
        assert ask(kv["zz-kv-p"], "kv_get", f"{group}/k0")["value"] is None
        assert base64.b64decode(ask(kv["zz-kv-p"], "kv_get", f"{group}/k99")["value"]) == b"v99"
        # too big a value, or a kv op on the main socket: dropped, no answer
        assert ask(kv["zz-kv-p"], "kv_set", f"{group}/big", b"x" * 8192) is None
        send(rogues["zz-kv-p"][0], {"op": "kv_get", "n": 0, "key": f"{group}/0/0"})
        assert received(rogues["zz-kv-p"][0], 1) == []
        logs = srv.logs()
        assert "dropped a bad control message" in logs and "it comes on NAME#kv" in logs and "refused kv_get" in logs
    finally:
        ctx.destroy(linger=0)


# -- fault: a full KV pool crashed the decode worker ------------------------------------------------
def test_a_full_kv_pool_queues_and_swaps_but_never_fails(srv, model_and_tokenizer, expected_long):
    tok = model_and_tokenizer[1]
    models = srv.http.get("/v1/models").json()["data"][0]
    assert models["max_model_len"] == POOL_TOKENS  # what the pool really admits, not the model's 8192
    too_long = srv.http.post("/v1/completions", json={"model": "uw", "prompt": "word " * POOL_TOKENS, "max_tokens": 1})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    lengths = [len(tok(p)["input_ids"]) + POOL_MAX_TOKENS for p in PROMPTS]
    assert max(lengths) < POOL_TOKENS and sum(lengths) > 2 * POOL_TOKENS
    decode_pid = srv.workers()["decode-0"]["pid"]

    def ask(i: int) -> str:
        body = {
            "model": "uw",
            "prompt": PROMPTS[i % 4],
            "max_tokens": POOL_MAX_TOKENS,
            "temperature": 0,
            "stream": i % 2 == 1,
        }
        r = srv.http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        if i % 2:
            lines = [line for line in r.text.splitlines() if line]
            assert lines[-1] == "data: [DONE]" and "error" not in r.text, r.text[-500:]
            return sse_text(lines)
        return r.json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(ask, range(4)))
    assert texts == [e.text for e in expected_long]
    d = srv.workers()["decode-0"]
    assert d["pid"] == decode_pid and d["restarts"] == 0 and d["state"] == "ready"
    assert "swapped out" in srv.logs()  # the pool really ran full: a sequence was preempted and came back
    wait_for(lambda: srv.workers()["decode-0"]["kv_blocks_used"] == 0, 10, "the pool to empty")


# -- fault: a failed KV hand-off reached clients as a worker's failure -----------------------------
def test_a_kv_hand_off_that_fails_gives_the_client_a_typed_error(srv, secret, expected):
    """A decode peer that never takes its KV: an authenticated worker that says hello and beats as
    idle, so the router picks it (its name sorts first), and then joins no KV group. The prefill
    worker's hand-off to it fails within KV_TIMEOUT_S (20 s), and the client gets 503 with code
    kv_transfer_failed (a worker that died gives worker_failed); with the peer retired, the next
    request is served."""
    keys = curve_keys(secret[1])
    ctx = zmq.Context()
    idle = {"op": "beat", "running": 0, "queued": 0, "kv_blocks_used": 0, "kv_blocks_total": 1}
    try:
        _sock, beat, _ = rogue_worker(ctx, srv, "aa-sink", keys)
        send(beat, idle)
        wait_for(lambda: srv.workers()["aa-sink"]["running"] == 0, 20, "aa-sink's idle beat")
        body = {"model": "uw", "messages": MESSAGES[0], "max_tokens": 16, "temperature": 0}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(srv.http.post, "/v1/chat/completions", json=body, timeout=120)
            while not answer.done():  # beats, so that the router keeps it as a ready worker
                send(beat, idle)
                time.sleep(1)
            r = answer.result()
        error = r.json()["error"]
        assert r.status_code == 503 and error["code"] == "kv_transfer_failed", r.text
        assert error["type"] == "server_error" and "gloo" not in error["message"], r.text
        send(beat, {**idle, "running": 1000, "queued": 1000})
        wait_for(lambda: srv.workers()["aa-sink"]["running"] == 1000, 20, "aa-sink's busy beat")
        chat_ok(srv, expected)
    finally:
        ctx.destroy(linger=0)


# -- fault: requests on a hung worker waited forever ------------------------------------------------
def test_requests_on_a_hung_worker_fail_then_the_server_recovers(uw, expected, tmp_path):
    s = LoggedServer(
        tmp_path, str(uw), "--api-key", KEY, "--max-model-len", "512", env={"UNWEIGHT_WORKER_TIMEOUT": "3"}
    )
    decode_pid = s.workers()["decode-0"]["pid"]
    stopped = False
    try:
        stream_body = {"model": "uw", "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "stream": True}
        with (
            concurrent.futures.ThreadPoolExecutor(1) as pool,
            s.http.stream("POST", "/v1/completions", json=stream_body, timeout=30) as r,
        ):
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            plain = pool.submit(s.http.post, "/v1/completions", json={**stream_body, "stream": False}, timeout=30)
            wait_for(
                lambda: s.workers()["decode-0"]["running"] == 2, 30, "both requests on the decode worker", step=0.1
            )
            os.kill(decode_pid, signal.SIGSTOP)
            stopped = True
            t0 = time.monotonic()
            rest = [line for line in lines if line]
            waited = time.monotonic() - t0
            answer = plain.result()
        assert waited < 10
        assert rest[-1] == "data: [DONE]" and any('"worker_failed"' in line for line in rest), rest[-3:]
        assert (
            answer.status_code == 503
            and answer.json()["error"]["type"] == "server_error"
            and "stopped responding" in answer.json()["error"]["message"]
        )
        h = s.http.get("/health")
        assert (
            h.status_code == 503 and {w["name"]: w for w in h.json()["workers"]}["decode-0"]["state"] == "unresponsive"
        )
        os.kill(decode_pid, signal.SIGCONT)
        stopped = False
        s.wait_ready(timeout=30)
        chat_ok(s, expected, 0)
        d = s.workers()["decode-0"]
        assert d["pid"] == decode_pid and d["state"] == "ready"
        # the requests it held were cancelled on it when it came back: its batch and pool empty out
        wait_for(
            lambda: (lambda d: d["running"] == 0 and d["kv_blocks_used"] == 0)(s.workers()["decode-0"]),
            20,
            "the woken worker to drop its old requests",
        )
    finally:
        if stopped:
            os.kill(decode_pid, signal.SIGCONT)
        s.stop()
