"""`unweight serve --role router --engine vllm`: the OpenAI front of `unweight serve` (its body limits,
API key, error bodies and metrics) in front of `vllm serve` engines that hand the KV cache over with
UnweightConnector (runtime/vllm/kv_connector.py), in NixlConnector's kv_transfer_params handshake.

    unweight serve --role router --engine vllm --prefill-url http://10.0.0.2:8100 \\
        --decode-url http://10.0.0.3:8200 --served-model-name smollm2 --port 8000

A completion or chat request:
1. goes to the prefill engine with the fewest requests in flight, as the client sent it but with
   max_tokens 1 (chat: max_completion_tokens 1), stream false, n 1 and kv_transfer_params
   `PREFILL_PARAMS`, without the fields that would enlarge or contradict a one-token answer
   (`PREFILL_DROPS`); its JSON answer's top-level kv_transfer_params says where the KV waits;
2. goes as the client sent it, plus those kv_transfer_params, to the decode engine with the fewest in
   flight, which pulls the KV and generates; its answer (JSON, or the SSE stream event by event as it
   arrives) goes back to the client. Streaming, n, logprobs and the sampling fields are vLLM's own.
"model" is the served name to clients and each engine's own id (its /v1/models, asked at start, on
/health and while an engine is down) to the engines: it is rewritten both ways, and nothing else of
an answer is touched.

Errors: an engine's 4xx passes through as it is. An engine that cannot be reached is skipped for
another of its role; when none of a role answers the client gets 503 `engine_unavailable` before any
prefill runs; an engine that fails mid-request (or answers 5xx) gives 503 `engine_failed`, or in a
stream an error event and [DONE]; a prefill answer without kv_transfer_params (an engine without a
KV connector) is 502 `kv_transfer_params_missing`. A client that hangs up closes the engine's
request, which vLLM then aborts.

This module speaks HTTP to the engines (httpx) and never imports vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from . import api
from .http import BodyLimit, CountResponses, guarded_protocol, json_object, openai_errors
from .metrics import REQUEST_BUCKETS, TTFT_BUCKETS
from .routes.errors import ClientGone, HTTPError, fail, model_not_found

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
# what the prefill request carries (NixlConnector's handshake: the engine keeps the prompt's KV for a decode
# engine to pull and answers where it waits)
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# fields of the client's body the prefill request goes without: its length and count are set anew, and
# the rest would contradict one token (min_tokens) or only enlarge an answer nobody reads
PREFILL_DROPS = frozenset(
    {
        "max_tokens",
        "max_completion_tokens",
        "n",
        "best_of",
        "stream_options",
        "min_tokens",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "echo",
        "kv_transfer_params",
    }
)
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0  # between two reads from an engine: a non-streamed answer comes whole, at its end
PROBE_TIMEOUT_S = 5.0  # an engine's /health and /v1/models
PROBE_INTERVAL_S = 5.0  # engines that are down are asked again this often
MAX_ANSWER_BYTES = 64 << 20  # a non-streamed answer (n choices with logprobs) read whole, at most this
MAX_EVENT_BYTES = 16 << 20  # one SSE event of a stream, at most this
MAX_SMALL_BYTES = 1 << 20  # an error body, /v1/models


@dataclass(slots=True)
class VLLMRouterConfig:
    """The router's settings, one per flag of `unweight serve --engine vllm` (built by keywords)."""

    prefill_urls: list[str]
    decode_urls: list[str]
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    engine_api_key: str | None = None  # what the engines were started with (`vllm serve --api-key`)
    public_health: bool = False
    max_queue: int = 64  # requests in flight beyond which new ones get 429
    max_body_bytes: int = 16 << 20
    timeout_keep_alive: float = 5.0
    timeout_header: float = 10.0
    timeout_body: float = 30.0
    limit_concurrency: int = 512

    def __post_init__(self) -> None:
        for flag, name in (("--prefill-url", "prefill_urls"), ("--decode-url", "decode_urls")):
            urls = [engine_url(u, flag) for u in getattr(self, name) or ()]
            if not urls:
                raise ValueError(f"--engine vllm needs at least one {flag} http://HOST:PORT")
            if len(set(urls)) < len(urls):
                raise ValueError(f"{flag}: an engine is given twice")
            setattr(self, name, urls)
        if not self.served_model_name:
            raise ValueError("--engine vllm needs --served-model-name NAME: the model id clients ask for")
        if self.max_queue < 1:
            raise ValueError(f"max-queue must be >= 1, not {self.max_queue}")


def engine_url(text: str, flag: str) -> str:
    """http(s)://HOST:PORT (a trailing slash allowed), or ValueError naming the flag."""
    bad = ValueError(f"{flag} {text!r}: not an http://HOST:PORT URL")
    try:
        u = urlsplit(text.strip())
        port = u.port
    except ValueError:
        raise bad from None
    if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/") or u.query or u.fragment:
        raise bad
    if u.username is not None or port == 0:
        raise bad
    return f"{u.scheme}://{u.netloc}"


class Passthrough(Exception):
    """An engine's 4xx answer, for the client as it is."""

    def __init__(self, status: int, body: bytes, media_type: str):
        super().__init__(status)
        self.status, self.body, self.media_type = status, body, media_type

    def code(self) -> str:
        try:
            err = json.loads(self.body)["error"]
            return str(err.get("code") or self.status)
        except (ValueError, KeyError, TypeError, AttributeError):
            return str(self.status)


class _Down(Exception):
    """An engine answered its probe, but not as an engine that serves."""


@dataclass(slots=True, eq=False)
class Engine:
    """One `vllm serve` behind the router, as the router knows it."""

    role: str
    url: str
    model: str | None = None  # the engine's own model id (its /v1/models)
    max_model_len: int | None = None
    up: bool | None = None  # None: not asked yet
    error: str | None = None  # why it is down
    in_flight: int = 0
    requests: int = 0  # requests sent to it, over the router's life
    _pattern: re.Pattern | None = None

    def set_model(self, model: str, max_model_len: int | None) -> None:
        if model != self.model:
            # the id as JSON writes it (vLLM: pydantic and Starlette, neither escapes non-ASCII or "/"); a
            # JSON string's own quotes are escaped, so this matches the "model" field and no text
            forms = {json.dumps(model), json.dumps(model, ensure_ascii=False)}
            alts = b"|".join(re.escape(f.encode()) for f in sorted(forms))
            self._pattern = re.compile(rb'"model"\s*:\s*(?:' + alts + rb")")
        self.model, self.max_model_len = model, max_model_len

    def rename(self, data: bytes, served: str) -> bytes:
        """An answer of this engine with its model id replaced by the served name."""
        if self._pattern is None:
            return data
        field = b'"model":' + json.dumps(served).encode()
        return self._pattern.sub(lambda _: field, data)

    def mark_up(self) -> None:
        if self.up is False:
            log.warning("%s engine %s answers again", self.role, self.url)
        self.up, self.error = True, None

    def mark_down(self, reason: str) -> None:
        if self.up is not False:
            log.warning("%s engine %s is down: %s", self.role, self.url, reason)
        self.up, self.error = False, reason

    def to_json(self) -> dict:
        return {
            "url": self.url,
            "role": self.role,
            "up": bool(self.up),
            "model": self.model,
            "in_flight": self.in_flight,
            "requests": self.requests,
            "error": self.error,
        }


def _reason(e: BaseException) -> str:
    text = str(e)
    if isinstance(e, httpx.ConnectError):
        return f"cannot connect ({text or 'connection refused'})"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _failed(e: Engine, x: BaseException) -> HTTPError:
    """An engine that failed mid-request (it is marked down until it answers a probe)."""
    e.mark_down(_reason(x))
    return HTTPError(
        503, f"{e.role} engine {e.url} failed mid-request: {_reason(x)}", "server_error", code="engine_failed"
    )


async def _read(resp: httpx.Response, limit: int, e: Engine) -> bytes:
    """An answer's whole body, at most `limit` bytes."""
    buf = bytearray()
    async for chunk in resp.aiter_bytes():
        buf += chunk
        if len(buf) > limit:
            raise HTTPError(
                502,
                f"{e.role} engine {e.url} answered more than {limit} bytes",
                "server_error",
                code="engine_answer_too_large",
            )
    return bytes(buf)


async def _refusal(e: Engine, resp: httpx.Response) -> Exception:
    """An engine's answer other than 200: a 4xx for the client as it is, anything else a 503."""
    data = await _read(resp, MAX_SMALL_BYTES, e)
    if 400 <= resp.status_code < 500:
        return Passthrough(resp.status_code, data, resp.headers.get("content-type", "application/json"))
    try:
        message = json.loads(data)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = data[:200].decode("utf-8", "replace")
    return HTTPError(
        503,
        f"{e.role} engine {e.url} answered HTTP {resp.status_code}: {message}",
        "server_error",
        code="engine_failed",
    )


def _card(data: bytes) -> tuple[str, int | None]:
    """The model id and context length an engine's /v1/models lists first."""
    try:
        card = json.loads(data)["data"][0]
        model, max_len = card["id"], card.get("max_model_len")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise _Down("its /v1/models lists no model") from None
    if not isinstance(model, str) or not model:
        raise _Down("its /v1/models lists no model")
    return model, max_len if isinstance(max_len, int) else None


async def _close(resp: httpx.Response) -> None:
    """Close an engine's answer whatever happens around it (a stream closed early drops its
    connection: vLLM aborts the request)."""
    await asyncio.shield(resp.aclose())


class RouterMetrics:
    """GET /metrics: vLLM's names where the meaning is vLLM's (metrics.py), the rest `unweight:`."""

    def __init__(self, model_name: str, front: Front):
        r = self.registry = CollectorRegistry()
        m = ["model_name"]
        self.model_name = model_name
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds (streams: arrival at the router to the first event).",
            m,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            m,
            buckets=REQUEST_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.prefill = Histogram(
            "unweight:router_prefill_seconds",
            "Wall time of a request's prefill request on its prefill engine, as the router sees it.",
            m,
            buckets=REQUEST_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.http = Counter(
            "http_requests",
            "Total number of requests by method, status and handler.",
            [*m, "method", "status", "handler"],
            registry=r,
        )
        self.errors = Counter(
            "unweight:router_errors",
            "Errors the router answered, by OpenAI error code (an engine's HTTP status where it gave none).",
            [*m, "code"],
            registry=r,
        )
        r.register(_EngineCollector(model_name, front))

    def response(self, handler: str, method: str, status: int) -> None:
        self.http.labels(self.model_name, method, str(status), handler).inc()

    def error(self, code: str) -> None:
        self.errors.labels(self.model_name, code).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Per-engine series, read from the router's state at each scrape."""

    def __init__(self, model_name: str, front: Front):
        self.name, self.front = model_name, front

    def collect(self):
        g = GaugeMetricFamily(
            "unweight:router_requests_in_flight", "Requests the router is serving.", labels=["model_name"]
        )
        g.add_metric([self.name], self.front.in_flight)
        yield g
        labels = ["model_name", "engine", "role"]
        series = (
            (GaugeMetricFamily, "unweight:engine_up", "1 if the engine answered its last probe or request.", "up"),
            (GaugeMetricFamily, "unweight:engine_requests_in_flight", "Requests open on the engine.", "in_flight"),
            (CounterMetricFamily, "unweight:engine_requests", "Requests sent to the engine.", "requests"),
        )
        for family, metric, doc, attr in series:
            f = family(metric, doc, labels=labels)
            for e in self.front.engines:
                f.add_metric(
                    [self.name, e.url, e.role], int(bool(getattr(e, attr))) if attr == "up" else getattr(e, attr)
                )
            yield f


class Front:
    """The router's state: the engines, the HTTP client to them, the metrics, the API key."""

    def __init__(self, cfg: VLLMRouterConfig):
        self.cfg, self.name = cfg, cfg.served_model_name
        self.engines = [Engine("prefill", u) for u in cfg.prefill_urls] + [Engine("decode", u) for u in cfg.decode_urls]
        self.in_flight = 0
        self.metrics = RouterMetrics(self.name, self)
        self.expected_auth = f"Bearer {cfg.api_key}".encode() if cfg.api_key else None
        self.client: httpx.AsyncClient | None = None
        self._probing: asyncio.Future | None = None
        self._watching: asyncio.Task | None = None

    # -- life ------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S, pool=CONNECT_TIMEOUT_S * 3),
            limits=httpx.Limits(max_connections=self.cfg.max_queue + 2 * len(self.engines) + 8),
            trust_env=False,  # engines are reached directly, never through a proxy from the environment
            headers={"Authorization": f"Bearer {self.cfg.engine_api_key}"} if self.cfg.engine_api_key else None,
        )
        await self.probe()
        self._watching = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
        if self.client is not None:
            await self.client.aclose()

    async def _watch(self) -> None:
        """Ask the engines again while any is down, so that one that comes back is used again."""
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            if any(e.up is not True for e in self.engines):
                await self.probe()

    # -- engines ---------------------------------------------------------------------------------
    def of(self, role: str) -> list[Engine]:
        return [e for e in self.engines if e.role == role]

    async def probe(self) -> None:
        """Ask every engine its /health and /v1/models (one round at a time: callers meanwhile share it)."""
        if self._probing is None or self._probing.done():
            self._probing = asyncio.ensure_future(asyncio.gather(*(self._probe(e) for e in self.engines)))
        await asyncio.shield(self._probing)

    async def _probe(self, e: Engine) -> None:
        try:
            status, _ = await self._get(e, "/health")
            if status != 200:
                raise _Down(f"its /health answered HTTP {status}")
            status, data = await self._get(e, "/v1/models")
            if status == 401:
                why = "refused the router's key" if self.cfg.engine_api_key else "wants an API key"
                raise _Down(f"its /v1/models answered HTTP 401: it {why} (--engine-api-key: `vllm serve --api-key`)")
            if status != 200:
                raise _Down(f"its /v1/models answered HTTP {status}")
            e.set_model(*_card(data))
            e.mark_up()
        except (httpx.HTTPError, HTTPError, _Down) as x:
            e.mark_down(str(x) if isinstance(x, _Down | HTTPError) else _reason(x))

    async def _get(self, e: Engine, path: str) -> tuple[int, bytes]:
        async with self.client.stream("GET", e.url + path, timeout=PROBE_TIMEOUT_S) as resp:
            return resp.status_code, await _read(resp, MAX_SMALL_BYTES, e)

    async def ready(self, role: str) -> None:
        """Return if an engine of `role` answers (asking them again if none did); else 503."""
        if any(e.up for e in self.of(role)):
            return
        await self.probe()
        if not any(e.up for e in self.of(role)):
            raise self._unavailable(role, self.of(role))

    def _unavailable(self, role: str, engines: list[Engine]) -> HTTPError:
        why = "; ".join(f"{e.url}: {e.error or 'not answering'}" for e in engines)
        return HTTPError(503, f"no {role} engine answers ({why})", "server_error", code="engine_unavailable")

    async def send(self, role: str, path: str, body: dict) -> tuple[Engine, httpx.Response]:
        """POST `body` (its model set to the engine's id) to the engine of `role` with the fewest requests
        in flight that accepts the connection (those down last); the answer's head is read. The caller
        closes the answer and calls `done`."""
        tried = []
        for e in sorted(self.of(role), key=lambda e: (e.up is False, e.in_flight)):  # stable: given order next
            if e.model is None:
                await self._probe(e)
                if e.model is None:
                    tried.append(e)
                    continue
            content = json.dumps({**body, "model": e.model}).encode()
            req = self.client.build_request(
                "POST", e.url + path, content=content, headers={"content-type": "application/json"}
            )
            e.in_flight += 1
            try:
                resp = await self.client.send(req, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as x:
                e.in_flight -= 1
                e.mark_down(_reason(x))
                tried.append(e)
                continue
            except httpx.TransportError as x:
                e.in_flight -= 1
                raise _failed(e, x) from None
            except BaseException:
                e.in_flight -= 1
                raise
            e.requests += 1
            return e, resp
        raise self._unavailable(role, tried)

    @staticmethod
    def done(e: Engine) -> None:
        e.in_flight -= 1

    # -- a request's two legs --------------------------------------------------------------------
    async def prefill(self, path: str, body: dict, chat: bool) -> dict:
        """The prefill engine's kv_transfer_params for this request's prompt."""
        ask = {k: v for k, v in body.items() if k not in PREFILL_DROPS}
        ask |= {"stream": False, "n": 1, "kv_transfer_params": dict(PREFILL_PARAMS)}
        ask["max_completion_tokens" if chat else "max_tokens"] = 1
        started = time.monotonic()
        e, resp = await self.send("prefill", path, ask)
        try:
            if resp.status_code != 200:
                raise await _refusal(e, resp)
            data = await _read(resp, MAX_ANSWER_BYTES, e)
        except httpx.TransportError as x:
            raise _failed(e, x) from None
        finally:
            await _close(resp)
            self.done(e)
        try:
            kv = json.loads(data).get("kv_transfer_params")
        except (ValueError, AttributeError):
            kv = None
        if not isinstance(kv, dict) or not kv:
            raise HTTPError(
                502,
                f"prefill engine {e.url} answered without kv_transfer_params: it needs a KV connector as "
                "kv_producer (vllm serve --kv-transfer-config '{\"kv_connector\": \"UnweightConnector\", "
                '"kv_role": "kv_producer", ...}\')',
                "server_error",
                code="kv_transfer_params_missing",
            )
        self.metrics.prefill.observe(time.monotonic() - started)
        return kv

    async def decode(self, path: str, body: dict, started: float) -> Response:
        """The decode engine's answer: the JSON, or (stream) a Relay of its events."""
        e, resp = await self.send("decode", path, body)
        try:
            if resp.status_code != 200:
                raise await _refusal(e, resp)
            if body.get("stream"):
                relay, resp = Relay(self, e, resp, started), None  # the relay closes it
                return relay
            data = await _read(resp, MAX_ANSWER_BYTES, e)
        except httpx.TransportError as x:
            raise _failed(e, x) from None
        finally:
            if resp is not None:
                await _close(resp)
                self.done(e)
        self.metrics.e2e.observe(time.monotonic() - started)
        return Response(e.rename(data, self.name), media_type="application/json")

    # -- HTTP ------------------------------------------------------------------------------------
    def check_key(self, request: Request, private: bool = False) -> None:
        """The API key (for /health and /metrics only without --public-health), or 401."""
        if self.expected_auth is None or (private and self.cfg.public_health):
            return
        got = request.headers.get("authorization", "").encode("latin-1")
        if not hmac.compare_digest(got, self.expected_auth):
            raise HTTPError(401, "invalid API key", "authentication_error", code="invalid_api_key")

    def refuse(self, e: HTTPError) -> JSONResponse:
        self.metrics.error(str(e.body["error"]["code"] or e.status))
        return fail(e, "")

    async def generate(self, request: Request, path: str, chat: bool) -> Response:
        started = time.monotonic()
        try:
            self.check_key(request)
            body = await self._parse(request, chat)
            if self.in_flight >= self.cfg.max_queue:
                raise HTTPError(
                    429, f"server busy: {self.in_flight} requests in flight", "rate_limit_error", code="overloaded"
                )
        except HTTPError as e:
            return self.refuse(e)
        self.in_flight += 1
        answer = None
        try:

            async def both_legs() -> Response:
                await self.ready("decode")  # before the prefill: KV held for a decode engine that is not there
                await self.ready("prefill")
                kv = await self.prefill(path, body, chat)
                return await self.decode(path, {**body, "kv_transfer_params": kv}, started)

            answer = await _unless_gone(request, both_legs())
            return answer
        except HTTPError as e:
            return self.refuse(e)
        except Passthrough as p:
            self.metrics.error(p.code())
            return Response(p.body, status_code=p.status, media_type=p.media_type)
        finally:
            if not isinstance(answer, Relay):
                self.in_flight -= 1

    async def _parse(self, request: Request, chat: bool) -> dict:
        body = await json_object(request)
        model = body.get("model")
        if not isinstance(model, str):
            raise HTTPError(400, "model: a string is required", param="model")
        if model != self.name:
            raise model_not_found(model, self.name)
        if not isinstance(body.get("stream", False), bool | None):
            raise HTTPError(400, "stream: must be true or false", param="stream")
        prompt = body.get("prompt")
        if not chat and isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str | list):
            raise HTTPError(
                400,
                f"prompt: this router takes one prompt per request, not {len(prompt)} (a prefill engine answers "
                "one KV hand-off per request)",
                param="prompt",
                code="unsupported_parameter",
            )
        return body

    def model_card(self) -> dict:
        lens = [e.max_model_len for e in self.of("decode") if e.max_model_len]
        card = {"id": self.name, "object": "model", "created": int(time.time()), "owned_by": "unweight"}
        return card | ({"max_model_len": min(lens)} if lens else {})

    async def health(self) -> JSONResponse:
        await self.probe()
        missing = [role for role in ROLES if not any(e.up for e in self.of(role))]
        body = {
            "status": "degraded" if missing else "ok",
            "engine": "vllm",
            "model": self.name,
            "engines": [e.to_json() for e in self.engines],
        }
        if missing:
            body["missing"] = missing
            body["message"] = "; ".join(self._unavailable(role, self.of(role)).args[0] for role in missing)
        return JSONResponse(body, status_code=503 if missing else 200)


class Relay(Response):
    """The decode engine's SSE answer for the client (an ASGI response), event by event as it arrives,
    "model" renamed. A client that hangs up closes it (vLLM aborts the request); an engine that fails
    mid-stream ends it with an error event and [DONE], as the server's own streams end (routes/stream.py)."""

    def __init__(self, front: Front, engine: Engine, resp: httpx.Response, started: float):
        super().__init__(media_type="text/event-stream")  # (FastAPI passes a Response through; the head is sent below)
        self.front, self.engine, self.resp, self.started = front, engine, resp, started

    async def __call__(self, scope, receive, send) -> None:
        try:
            headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            pump, watch = asyncio.ensure_future(self._pump(send)), asyncio.ensure_future(_gone(receive))
            try:
                await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (pump, watch):
                    t.cancel()
                await asyncio.wait({pump, watch})
            if not pump.cancelled() and pump.exception() is not None:
                raise pump.exception()
        finally:
            await _close(self.resp)
            self.front.done(self.engine)
            self.front.in_flight -= 1

    async def _pump(self, send) -> None:
        e, front = self.engine, self.front
        buf, first = bytearray(), True
        try:
            async for chunk in self.resp.aiter_bytes():
                scan = max(0, len(buf) - 1)  # an event ends at a blank line: "\n\n"
                buf += chunk
                end = buf.rfind(b"\n\n", scan)
                if end < 0:
                    if len(buf) > MAX_EVENT_BYTES:
                        raise _TooLarge()
                    continue
                events, buf = bytes(buf[: end + 2]), buf[end + 2 :]
                if first:
                    front.metrics.ttft.observe(time.monotonic() - self.started)
                    first = False
                await send({"type": "http.response.body", "body": e.rename(events, front.name), "more_body": True})
            if buf:
                await send({"type": "http.response.body", "body": e.rename(bytes(buf), front.name), "more_body": True})
            front.metrics.e2e.observe(time.monotonic() - self.started)
        except (httpx.TransportError, _TooLarge) as x:
            if isinstance(x, _TooLarge):
                message, code = (
                    f"decode engine {e.url} sent an event over {MAX_EVENT_BYTES} bytes",
                    "engine_answer_too_large",
                )
            else:
                message, code = _failed(e, x).args[0], "engine_failed"
            front.metrics.error(code)
            event = json.dumps(api.error_body(message, "server_error", code=code))
            await send(
                {"type": "http.response.body", "body": f"data: {event}\n\ndata: [DONE]\n\n".encode(), "more_body": True}
            )
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class _TooLarge(Exception):
    pass


async def _gone(receive) -> None:
    """Return when the client has hung up (the body is read by now: the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, work):
    """Await `work` unless the client hangs up first: then cancel it (closing its engine request) and
    raise ClientGone."""
    job, watch = asyncio.ensure_future(work), asyncio.ensure_future(_gone(request.receive))
    try:
        await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not job.done():
            job.cancel()
            await asyncio.wait({job})
    if job.cancelled():
        raise ClientGone()
    return job.result()


def create_app(cfg: VLLMRouterConfig) -> FastAPI:
    front = Front(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await front.start()
        try:
            yield
        finally:
            await front.stop()

    app = FastAPI(title="unweight serve (vLLM engines)", lifespan=lifespan)
    app.state.front = front
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes, timeout_body=cfg.timeout_body)
    app.add_middleware(CountResponses, record=front.metrics.response)
    openai_errors(app)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await front.generate(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await front.generate(request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            front.check_key(request)
        except HTTPError as e:
            return front.refuse(e)
        return {"object": "list", "data": [front.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        try:
            front.check_key(request)
            if model_id != front.name:
                raise HTTPError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        except HTTPError as e:
            return front.refuse(e)
        return front.model_card()

    @app.get("/health")
    async def health(request: Request):
        try:
            front.check_key(request, private=True)
        except HTTPError as e:
            return front.refuse(e)
        return await front.health()

    @app.get("/metrics")
    async def metrics(request: Request):
        try:
            front.check_key(request, private=True)
        except HTTPError as e:
            return front.refuse(e)
        return Response(front.metrics.render(), media_type="text/plain; version=0.0.4")

    app.add_exception_handler(Exception, _crash)
    return app


async def _crash(request: Request, e: Exception) -> JSONResponse:
    """Never a traceback page: an OpenAI-style 500."""
    log.exception("unhandled error on %s", request.url.path)
    return JSONResponse(api.error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)


def serve(cfg: VLLMRouterConfig) -> None:
    """Run the router until SIGINT/SIGTERM."""
    import uvicorn

    uvicorn.run(
        create_app(cfg),
        host=cfg.host,
        port=cfg.port,
        log_level="warning",
        timeout_graceful_shutdown=10,
        http=guarded_protocol(cfg.timeout_header, cfg.limit_concurrency),
        timeout_keep_alive=cfg.timeout_keep_alive,
    )


__all__ = ["PREFILL_PARAMS", "VLLMRouterConfig", "create_app", "engine_url", "serve"]
