"""`unweight serve --role router --engine vllm` (runtime/serve/vllm_router.py) in front of two real
`vllm serve` engines with UnweightConnector (tests/vllm_serve.py: a prefill engine and a decode engine on
the compressed SmolLM2 in BF16, prefix caching off, one secret file), across hosts that are really
separate: each engine in a network namespace of its own, the router and this module's code in a third
(tests/hosts.py). The router is a subprocess of the real CLI, driven by the official `openai` client
and raw HTTP.

- Greedy completions and chats through the router, streamed and not, give the token ids and text the
  decode engine gives asked directly (computing the prompt itself); the prefill engine served each one;
  logprobs and n pass through (n choices pull once); "model" is the served name both ways.
- --api-key guards every endpoint; the engines' own key (`vllm serve --api-key`) goes to them with
  --engine-api-key, and a router without it names the 401; an unknown model is 404; an engine's 4xx
  passes through as it is.
- /health and /metrics; a client that hangs up (streamed or not) aborts the decode engine's request.
- An engine that cannot be reached is skipped for another of its role; with none of a role left,
  requests get 503 before any prefill runs and /health names the role; a prefill engine without
  the producer's half of the connector is an error naming kv_transfer_params.
- The connector: the prefill engine codes a prompt's layers as its forward runs and takes its blocks
  back before the pull; it frees what it held once acknowledged and neither engine warns;
  a stranger without the secret, or asking for a request not held, is refused and logged; bad
  kv_transfer_params are computed locally with a warning; 64 idle side-channel connections do not
  stop the next hand-off.
- The KV crosses sealed, exactly the prompt's tokens, and every byte the decode host's interface
  received for a 1,000-token prompt is at most 0.72x the prompt's raw BF16 KV.
- Last: the decode engine killed mid-stream: the stream ends with an error event, the router then
  answers 503 and /health 503 naming the decode role.

The two engines start once for the module (a minute or more each here). Needs root (CAP_NET_ADMIN and
CAP_SYS_ADMIN), as CI runs: without it the module fails saying so.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest
import torch
from vllm_serve import PREFILL_PARAMS, engine_pair, free_port

from envs import vllm_env
from hosts import Hosts
from unweight.runtime.kv import side_channel
from unweight.runtime.kv.secret import connector_key

pytestmark = pytest.mark.slow

KEY = "router-key"
SECRET = "r" * 48  # the connectors' secret_file
ENGINE_KEY = "engine-key"  # the engines' own (`vllm serve --api-key`), which the router sends them
NAME = "uw"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TOKENS = 16
LONG = 400  # tokens of a completion that is cut short
DOCUMENT = "Summarize the following text. " + " ".join(
    f"Item {i}: the quick brown fox jumps over the lazy dog number {i}." for i in range(52)
)


class Router:
    """`unweight serve --role router --engine vllm` as a subprocess, its stderr to a file."""

    def __init__(self, tmp, prefill: list[str], decode: list[str], *args: str, engine_key: str | None = ENGINE_KEY):
        self.port, self.log = free_port(), tmp / f"router-{len(list(tmp.glob('router-*.log')))}.log"
        urls = [a for u in prefill for a in ("--prefill-url", u)] + [a for u in decode for a in ("--decode-url", u)]
        cmd = [sys.executable, "-m", "unweight.cli.main", "serve", "--role", "router", "--engine", "vllm", *urls]
        cmd += ["--served-model-name", NAME, "--api-key", KEY, "--port", str(self.port), *args]
        cmd += ["--engine-api-key", engine_key] if engine_key else []
        self.file = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.file, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=300, headers={"Authorization": f"Bearer {KEY}"})
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                self.http.get("/v1/models")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, self.log.read_text()
                time.sleep(0.3)

    def health(self) -> httpx.Response:
        return self.http.get("/health")

    def metrics(self) -> str:
        r = self.http.get("/metrics")
        assert r.status_code == 200, r.text
        return r.text

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=300)

    def stop(self) -> str:
        """SIGTERM; the router must exit cleanly. Returns what it logged."""
        self.http.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)
        self.file.close()
        return self.log.read_text()


def engine_metric(server, name: str, labels: str = "") -> float:
    """The sum of a vLLM engine's series `name` whose labels hold `labels`."""
    return series_sum(httpx.get(f"{server.url}/metrics", timeout=30).text, name, labels)


def router_metric(router: Router, name: str, labels: str = "") -> float:
    return series_sum(router.metrics(), name, labels)


def series_sum(text: str, name: str, labels: str) -> float:
    """The sum of the Prometheus series `name` in `text` whose labels hold `labels`."""
    return sum(float(v) for lab, v in re.findall(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", text, re.M) if labels in lab)


def wait_for(check, what, timeout: float = 60) -> None:
    """Until check() holds; past `timeout` s, fail with `what` (a string, or a callable for one read then)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.5)


def prefilled(prefill) -> float:
    """Requests the prefill engine has finished."""
    return engine_metric(prefill, "vllm:request_success_total")


@pytest.fixture(scope="module")
def net():
    """Three hosts: the prefill engine's, the decode engine's, and the client's, where this module's
    test code runs (the pytest thread moves into its network namespace for the module, so the
    router and the plain server it starts run there too)."""
    python = vllm_env()  # built (or checked) before the client's host, which reaches no package index
    try:
        hosts = Hosts(("prefill", "decode", "client"))
    except (RuntimeError, FileNotFoundError) as e:
        pytest.fail(f"cannot make network namespaces here (needs root and iproute2): {e}")
    leave = hosts.enter("client")
    try:
        yield hosts, python
    finally:
        leave()
        hosts.close()


@pytest.fixture(scope="module")
def engines(net, smollm2_uw, tmp_path_factory):
    """The two engines on hosts of their own, BF16 (the KV the byte count compares with), one secret."""
    hosts, python = net
    tmp = tmp_path_factory.mktemp("vllm-router")
    secret = tmp / "secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    extra = {"secret_file": str(secret)}
    args = ["--dtype", "bfloat16", "--max-model-len", "2048"]
    kw = {"hosts": hosts, "extra_config": extra, "args": args, "api_key": ENGINE_KEY}
    with engine_pair(python, smollm2_uw[0], tmp, **kw) as pair:
        yield pair


@pytest.fixture(scope="module")
def router(engines, tmp_path_factory):
    prefill, decode, _ = engines
    r = Router(tmp_path_factory.mktemp("router"), [prefill.url], [decode.url])
    wait_for(lambda: r.health().status_code == 200, "the router did not see both engines")
    yield r
    log = r.stop()
    assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def client(router):
    with router.client() as c:
        yield c


def direct(server, path: str, body: dict, status: int = 200) -> dict:
    """An engine's answer to `body`, asked directly (with its own model id)."""
    r = httpx.post(f"{server.url}{path}", json={**body, "model": server.model}, headers=server.headers, timeout=300)
    assert r.status_code == status, r.text
    return r.json()


GREEDY = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}


def test_completions_equal_a_hand_off_made_by_hand(engines, client):
    """The router's answer is the decode engine's after the test hands the KV over itself (handed_off),
    token for token, streamed or not."""
    prefill, _, _ = engines
    base = handed_off(engines, "/v1/completions", {**GREEDY, "return_token_ids": True})["choices"][0]
    before = prefilled(prefill)
    r = client.completions.create(model=NAME, **GREEDY, extra_body={"return_token_ids": True})
    got = r.model_dump()
    assert got["model"] == NAME
    assert got["choices"][0]["token_ids"] == base["token_ids"], (r.choices[0].text, base["text"])
    assert r.choices[0].text == base["text"]
    chunks = list(client.completions.create(model=NAME, **GREEDY, stream=True))
    assert {c.model for c in chunks} == {NAME}
    assert "".join(c.choices[0].text for c in chunks if c.choices) == base["text"]
    assert prefilled(prefill) == before + 2  # each went through the prefill engine


def test_chat_streamed_and_not_equals_a_hand_off_made_by_hand(engines, client):
    base = handed_off(engines, "/v1/chat/completions", {"messages": CHAT, "max_tokens": NEW_TOKENS, "temperature": 0})
    want = base["choices"][0]["message"]["content"]
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=NEW_TOKENS, temperature=0)
    assert r.model == NAME and r.choices[0].message.content == want, (r.choices[0].message.content, want)
    assert r.usage.completion_tokens == base["usage"]["completion_tokens"]
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=CHAT,
            max_completion_tokens=NEW_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert {c.model for c in chunks} == {NAME}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == base["usage"]["completion_tokens"]  # the usage chunk, last


def handed_off(engines, path: str, body: dict) -> dict:
    """The decode engine's answer to `body` after the test itself hands the prompt's KV over (the
    prefill engine asked with max_tokens 1 and NixlConnector's parameters): what the router's answer
    must be, logprobs included. (Asked directly, without a hand-off, the decode engine computes the
    last prompt token inside the prompt's batch, not alone: in BF16 its logprobs differ by up to 0.13,
    and in FP32 on an avx512_bf16 Zen 5 SmolLM2's greedy answer to PROMPT parts from the hand-off's at
    its sixth token, " The answer is" against " The United States", where it holds on other CPUs.)"""
    prefill, decode, _ = engines
    asked = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
    first = direct(prefill, path, {**asked, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS})
    params = first["kv_transfer_params"]
    # where the prefill engine's side channel listens, and the prompt it holds
    assert params and params["do_remote_prefill"] and params["remote_port"] == engines[2], first
    assert params["remote_num_tokens"] == first["usage"]["prompt_tokens"], first
    out = direct(decode, path, {**body, "kv_transfer_params": params})
    if path == "/v1/completions":  # the decode engine's first token is the prefill engine's own
        assert out["choices"][0]["text"].startswith(first["choices"][0]["text"]), (first, out)
    return out


def test_logprobs_pass_through(engines, client):
    base = handed_off(engines, "/v1/completions", {**GREEDY, "logprobs": 2})["choices"][0]["logprobs"]
    got = client.completions.create(model=NAME, **GREEDY, logprobs=2).choices[0].logprobs
    assert got.tokens == base["tokens"]
    assert got.token_logprobs == base["token_logprobs"]
    for mine, theirs in zip(got.top_logprobs, base["top_logprobs"]):
        assert mine == theirs
    body = {"messages": CHAT, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    want = [e["token"] for e in handed_off(engines, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]]
    entries = []
    for c in client.chat.completions.create(model=NAME, **body, stream=True):
        if c.choices and c.choices[0].logprobs is not None:
            entries += c.choices[0].logprobs.content
    assert [e.token for e in entries] == want
    assert all(len(e.top_logprobs) == 2 for e in entries)


def test_n_choices_come_back_from_one_pull(engines, client):
    """vLLM makes n requests of a request with n choices, all with the prefill's kv_transfer_params:
    one pulls, the others wait for it and compute the prompt themselves; none fails. Those two answer
    as the decode engine alone does; the one that pulled computes the prompt's last token in a step
    beside the others' prompts (FP32 sums in another order), so only its first token is held to
    theirs (on an avx512_bf16 Zen 5 its answer parts from theirs at the last of 16 tokens)."""
    _, decode, _ = engines
    alone = direct(decode, "/v1/completions", GREEDY)["choices"][0]["text"]
    before = len(decode.pulls())
    # vLLM refuses n > 1 when greedy (temperature below 1e-5); it raises 1e-4 to 0.01, seeded here
    r = client.completions.create(model=NAME, **{**GREEDY, "temperature": 1e-4}, n=3, seed=1)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert texts.count(alone) >= 2 and all(t.split()[0] == alone.split()[0] for t in texts), (texts, alone)
    assert len(decode.pulls()) == before + 1, decode.text()[-3000:]


def test_the_api_key_guards_every_endpoint(router):
    for method, path in (
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("GET", f"/v1/models/{NAME}"),
        ("GET", "/health"),
        ("GET", "/metrics"),
    ):
        for auth in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.request(method, f"{router.url}{path}", headers=auth, json={"model": NAME, "prompt": PROMPT})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
    with openai.OpenAI(base_url=f"{router.url}/v1", api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.completions.create(model=NAME, **GREEDY)


def test_models_and_an_unknown_model(router, client):
    assert [m.id for m in client.models.list()] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="other", **GREEDY)
    assert e.value.body["code"] == "model_not_found"
    r = router.http.post("/v1/chat/completions", json={"model": "other", "messages": CHAT})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


def test_an_engines_4xx_passes_through_as_it_is(engines, router, client):
    _, decode, _ = engines
    bad = {**GREEDY, "temperature": -1}
    r = router.http.post("/v1/completions", json={**bad, "model": NAME})
    assert r.status_code == 400 and r.json() == direct(decode, "/v1/completions", bad, status=400), r.text
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=CHAT, temperature=-1)
    assert "temperature" in str(e.value)
    r = router.http.post("/v1/completions", json={"model": NAME, "prompt": [PROMPT, PROMPT]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text  # one hand-off per request


def test_health_and_metrics(engines, router, client):
    prefill, decode, _ = engines
    h = router.health()
    assert h.status_code == 200, h.text
    got = {(e["role"], e["url"]): (e["up"], e["model"]) for e in h.json()["engines"]}
    assert got == {("prefill", prefill.url): (True, prefill.model), ("decode", decode.url): (True, decode.model)}
    ttft = router_metric(router, "vllm:time_to_first_token_seconds_count")
    list(client.completions.create(model=NAME, **GREEDY, stream=True))
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", **GREEDY)
    assert router_metric(router, "vllm:time_to_first_token_seconds_count") == ttft + 1
    assert router_metric(router, "http_requests_total", 'handler="/v1/completions",method="POST"') >= 2
    assert router_metric(router, "unweight:router_errors_total", 'code="model_not_found"') >= 1
    for role, url in (("prefill", prefill.url), ("decode", decode.url)):
        labels = f'engine="{url}",model_name="{NAME}",role="{role}"'
        assert router_metric(router, "unweight:engine_requests_total", labels) >= 1
        assert router_metric(router, "unweight:engine_requests_in_flight", labels) == 0
        assert router_metric(router, "unweight:engine_up", labels) == 1


def test_a_client_that_hangs_up_aborts_the_engines_request(engines, router):
    """Streamed: closed after the first event; not streamed: the socket closed while the decode
    engine runs it. Either way the decode engine stops well before the LONG tokens asked."""
    _, decode, _ = engines
    body = {"model": NAME, **GREEDY, "max_tokens": LONG, "ignore_eos": True}
    made = engine_metric(decode, "vllm:generation_tokens_total")
    with router.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: {"))
    idle = lambda: engine_metric(decode, "vllm:num_requests_running") == 0  # noqa: E731
    wait_for(idle, "the decode engine still runs the stream's request")
    assert engine_metric(decode, "vllm:generation_tokens_total") - made < LONG
    made = engine_metric(decode, "vllm:generation_tokens_total")
    data = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", router.port)) as s:
        s.sendall(head.encode() + data)
        wait_for(lambda: engine_metric(decode, "vllm:num_requests_running") == 1, "the decode engine never ran it")
    wait_for(idle, "the decode engine still runs the hung-up request")
    assert engine_metric(decode, "vllm:generation_tokens_total") - made < LONG
    wait_for(lambda: router_metric(router, "unweight:router_requests_in_flight") == 0, "the router still holds it")


def test_an_engine_that_cannot_be_reached_is_skipped_or_named(engines, tmp_path_factory):
    prefill, decode, _ = engines
    tmp, dead = tmp_path_factory.mktemp("routers"), f"http://127.0.0.1:{free_port()}"
    r = Router(tmp, [prefill.url], [dead, decode.url])
    try:
        h = r.health()
        assert h.status_code == 200, h.text
        assert {e["url"]: e["up"] for e in h.json()["engines"]}[dead] is False
        with r.client() as c:
            text = c.completions.create(model=NAME, **GREEDY).choices[0].text
        assert text == handed_off(engines, "/v1/completions", GREEDY)["choices"][0]["text"]
    finally:
        assert "Traceback" not in r.stop()
    r = Router(tmp, [prefill.url], [dead])
    try:
        before = prefilled(prefill)
        a = r.http.post("/v1/completions", json={"model": NAME, **GREEDY})
        assert a.status_code == 503 and a.json()["error"]["code"] == "engine_unavailable", a.text
        assert dead in a.json()["error"]["message"] and a.headers["retry-after"]
        assert prefilled(prefill) == before  # no prefill for a decode engine that is not there
        h = r.health()
        assert h.status_code == 503 and h.json()["missing"] == ["decode"], h.text
        assert "decode" in h.json()["message"] and dead in h.json()["message"]
    finally:
        assert "Traceback" not in r.stop()


def test_engines_that_want_a_key_the_router_lacks_are_named(engines, tmp_path_factory):
    """The engines run with `vllm serve --api-key`: a router started without their key, or with
    another, sees them down and says why, in /health and in the 503 a client gets."""
    prefill, decode, _ = engines
    tmp = tmp_path_factory.mktemp("routers")
    for key, why in ((None, "wants an API key"), ("wrong", "refused the router's key")):
        r = Router(tmp, [prefill.url], [decode.url], engine_key=key)
        try:
            h = r.health()
            assert h.status_code == 503 and h.json()["missing"] == ["prefill", "decode"], h.text
            a = r.http.post("/v1/completions", json={"model": NAME, **GREEDY})
            assert a.status_code == 503 and a.json()["error"]["code"] == "engine_unavailable", a.text
            message = a.json()["error"]["message"]
            assert "HTTP 401" in message and why in message and "--engine-api-key" in message, message
        finally:
            assert "Traceback" not in r.stop()


def test_a_prefill_engine_without_the_connector_is_named(engines, uw, tmp_path_factory):
    """`unweight serve` itself stands for an OpenAI server without a KV connector: it answers the
    prefill request, but no kv_transfer_params."""
    from test_serve import Server

    _, decode, _ = engines
    plain = Server(str(uw), "--no-disagg", "--max-model-len", "512")
    r = Router(tmp_path_factory.mktemp("routers"), [plain.url], [decode.url])
    try:
        a = r.http.post("/v1/completions", json={"model": NAME, **GREEDY})
        assert a.status_code == 502, a.text
        err = a.json()["error"]
        assert err["code"] == "kv_transfer_params_missing" and plain.url in err["message"], err
        assert "kv_transfer_params" in err["message"] and "kv_producer" in err["message"]
    finally:
        log = r.stop()
        plain.stop()
    assert "Traceback" not in log


def test_serve_engine_vllm_refuses_what_it_cannot_use():
    run = [sys.executable, "-m", "unweight.cli.main", "serve"]
    for args, fragment in (
        (["--engine", "vllm", "--prefill-url", "http://a:1", "--decode-url", "http://b:2"], "--role router"),
        (["--engine", "vllm", "--role", "router", "--decode-url", "http://b:2"], "--prefill-url"),
        (["--engine", "vllm", "--role", "router", "--prefill-url", "a:1", "--decode-url", "http://b:2"], "'a:1'"),
        (["--engine", "vllm", "--role", "router", "--prefill-url", "http://a:1", "--decode-url", "http://b:2"],
         "--served-model-name"),
        (["--engine", "vllm", "--role", "router", "--prefill-url", "http://a:1", "--decode-url", "http://b:2",
          "--served-model-name", "m", "--max-batch", "4"], "--max-batch"),
        (["./m", "--engine", "vllm", "--role", "router"], "no MODEL"),
        (["--prefill-url", "http://a:1", "./m"], "--engine vllm"),
        (["./m", "--engine-api-key", "k"], "--engine-api-key"),
        ([], "MODEL"),
    ):  # fmt: skip
        r = subprocess.run([*run, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and fragment in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)


def test_a_prefill_is_coded_as_it_runs_and_its_blocks_freed_before_the_pull(engines):
    """The prefill engine codes each layer of a prompt for a decode engine as its forward leaves it,
    and once every layer is coded takes the blocks back, before any decode engine asked: the lease is
    an hour and nothing pulled, so nothing else frees them. The pull, served from the frames, moves
    exactly the prompt's tokens and the decode engine's answer is a hand-off's."""
    prefill, decode, _ = engines
    body = {"prompt": DOCUMENT, "max_tokens": 1, "temperature": 0}
    first = direct(prefill, "/v1/completions", {**body, "kv_transfer_params": PREFILL_PARAMS})
    wait_for(lambda: prefill.kv_usage() == 0, lambda: prefill.text()[-3000:])
    pulls = len(decode.pulls())
    out = direct(
        decode, "/v1/completions", {**body, "max_tokens": 8, "kv_transfer_params": first["kv_transfer_params"]}
    )
    assert (
        out["choices"][0]["text"]
        == handed_off(engines, "/v1/completions", {**body, "max_tokens": 8})["choices"][0]["text"]
    )
    assert out["choices"][0]["text"].startswith(first["choices"][0]["text"]), (first, out)
    tokens = first["usage"]["prompt_tokens"]
    assert [t for t, _, _ in decode.pulls()[pulls:]] == [tokens, tokens], decode.pulls()


def test_the_prefill_engine_frees_what_it_held_once_acknowledged(engines):
    """Every hand-off so far was acknowledged: the prefill engine's KV cache usage is back to 0 (its
    lease is an hour), and neither engine's connector warned."""
    prefill, decode, _ = engines
    wait_for(lambda: prefill.kv_usage() == 0, lambda: prefill.text()[-3000:])
    ours = [
        line
        for s in (prefill, decode)
        for line in s.text().splitlines()
        if "[kv_connector.py:" in line or "[kv_worker.py:" in line
    ]
    assert not [line for line in ours if " WARNING " in line], ours


def test_a_pull_without_the_secret_or_for_a_request_not_held_is_refused(net, engines):
    """The side channel as a stranger on another host sees it: without the engines' secret it learns
    nothing, and even with it, a request the engine does not hold is refused; both are logged at
    WARNING, nothing stops."""
    hosts, _ = net
    prefill, _, side = engines
    lay = side_channel.Layout(30, 3, 64, torch.bfloat16, 128, None)
    ask = {"request_id": "cmpl-nobody", "blocks": [0], "first_block": 0, "tokens": 1, "release": False}
    where = (hosts.addr["prefill"], side)
    with pytest.raises(PermissionError, match="did not prove"):
        side_channel.pull(where, connector_key("x" * 40), ask, lay, [], [0])
    with pytest.raises(side_channel.Refused, match="no request cmpl-nobody held here"):
        side_channel.pull(where, connector_key(SECRET), ask, lay, [], [0])
    refused = rf"WARNING .*refused a pull from {re.escape(hosts.addr['client'])}"
    wait_for(lambda: len(re.findall(refused, prefill.text())) == 2, lambda: prefill.text()[-3000:], timeout=10)
    assert prefill.complete(PROMPT, 1)["choices"], "the prefill engine still answers"


def test_kv_transfer_params_that_no_prefill_engine_answers_are_refused_not_fatal(engines):
    """kv_transfer_params come with the request, from whoever sends it: a decode request whose
    parameters are not what a prefill engine answers (a port that is not a number, block ids that
    are not a list, another TP size) is computed on the decode engine, with a WARNING, and the
    engine goes on serving (a ValueError inside vLLM's scheduler would end the engine)."""
    _, decode, _ = engines
    base = decode.complete(PROMPT, 4)["choices"][0]["token_ids"]
    good = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "cmpl-x", "remote_block_ids": [0]}
    good |= {"remote_host": "127.0.0.1", "remote_port": 1, "remote_num_tokens": 5, "tp_size": 1}
    for bad in ({"remote_port": "x"}, {"remote_block_ids": "nope"}, {"remote_num_tokens": -1}, {"tp_size": 2}):
        out = decode.complete(PROMPT, 4, good | bad)
        assert out["choices"][0]["token_ids"] == base, (bad, out)
    refused = re.findall(r"WARNING .*(kv_transfer_params refused|pairs equal sizes only)", decode.text())
    assert len(refused) == 4, decode.text()[-3000:]


def test_idle_connections_cannot_take_the_side_channel(net, engines, client):
    """Peers that connect and say nothing hold a thread each until the timeout: past MAX_CONNECTIONS
    (64) a connection is closed at once, and once they leave a pull is served again."""
    hosts, _ = net
    prefill, decode, side = engines
    where = (hosts.addr["prefill"], side)
    idle = [socket.create_connection(where, timeout=30) for _ in range(64)]
    try:
        time.sleep(1)  # accepted, each on its thread
        with socket.create_connection(where, timeout=30) as extra:
            assert extra.recv(1) == b""  # closed by the engine, not left waiting
    finally:
        for s in idle:
            s.close()
    full = "side-channel connections turned away: 64 already open"
    wait_for(lambda: full in prefill.text(), lambda: prefill.text()[-3000:], timeout=10)
    before = len(decode.pulls())
    client.completions.create(model=NAME, **{**GREEDY, "max_tokens": 4})
    assert len(decode.pulls()) == before + 1, decode.text()[-3000:]


def test_the_kv_crosses_sealed_in_under_072x_its_bf16_bytes(net, engines, client, smollm2_uw):
    """Every byte the decode host's interface received while it served a 1,000-token prompt (the
    frames, their headers, the proofs, the router's request, TCP/IP and Ethernet headers as the
    kernel counted them, acknowledgements) is at most 0.72x the prompt's raw BF16 KV cache, and the
    decode engine logged one sealed pull of exactly the prompt's tokens."""
    hosts, _ = net
    _, decode, _ = engines
    before = hosts.counters("decode")
    r = client.completions.create(model=NAME, prompt=DOCUMENT, max_tokens=1, temperature=0)
    after = hosts.counters("decode")
    tokens = r.usage.prompt_tokens
    config = json.loads((smollm2_uw[0] / "config.json").read_text())
    kv_heads, dim = config["num_key_value_heads"], config["hidden_size"] // config["num_attention_heads"]
    raw = tokens * config["num_hidden_layers"] * 2 * kv_heads * dim * 2
    pulled = decode.pulls()
    assert pulled and pulled[-1][0] == tokens and pulled[-1][2] == raw, (pulled[-1:], tokens, raw)
    received = after["rx_bytes"] - before["rx_bytes"]
    print(
        f"decode host received {received:,} bytes in {after['rx_packets'] - before['rx_packets']:,} packets for a "
        f"{tokens}-token prompt whose BF16 KV is {raw:,} ({received / raw:.4f}x; the side channel's own bytes "
        f"{pulled[-1][1]:,}, {pulled[-1][1] / raw:.4f}x)"
    )
    assert tokens > 900 and after["tcp_retrans_segs"] == before["tcp_retrans_segs"]
    assert received <= 0.72 * raw, (received, raw)


def test_zz_the_decode_engine_killed_mid_stream(engines, router, client):
    """Last in the module: the decode engine is gone after it."""
    _, decode, _ = engines
    stream = client.completions.create(
        model=NAME, **{**GREEDY, "max_tokens": LONG}, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    next(chunks)
    procs = [psutil.Process(decode.proc.pid), *psutil.Process(decode.proc.pid).children(recursive=True)]
    for p in procs:
        p.kill()
    psutil.wait_procs(procs, timeout=60)
    with pytest.raises(openai.APIError) as e:
        for _ in chunks:
            pass
    assert "decode engine" in str(e.value) and "failed mid-request" in str(e.value), e.value
    a = router.http.post("/v1/completions", json={"model": NAME, **GREEDY}, timeout=60)
    assert a.status_code == 503 and a.json()["error"]["code"] in ("engine_unavailable", "engine_failed"), a.text
    h = router.http.get("/health", timeout=60)
    assert h.status_code == 503 and h.json()["missing"] == ["decode"], h.text
    assert router.http.get("/v1/models").status_code == 200
