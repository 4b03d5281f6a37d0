"""The HTTP side of `unweight serve` (FastAPI): OpenAI endpoints, /health, /metrics, and launch.

unweight serve ./smollm2-uw --port 8000
curl localhost:8000/v1/chat/completions -d '{"model": "smollm2-uw", "messages": [{"role": "user", "content": "Hi"}]}'
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import logging
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from ..generate import TextStream, encode_prompt, eos_ids, load_tokenizer
from ..model.loader import model_config
from . import api
from .http import BodyLimit, CountResponses, guarded_protocol, openai_errors, parse_json
from .logprobs import TokenText
from .metrics import Metrics
from .protocol import ServeConfig, context_limits
from .router import Overloaded, Router, Unavailable

log = logging.getLogger(__name__)
RETRY_AFTER_S = "1"
JSON_IN_THREAD_BYTES = 64 << 10  # bodies larger than this are parsed off the event loop


class HTTPError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.body = status, api.error_body(message, kind, param, code)


class Choice:
    """One sequence of a response: its events from the router, its text, its logprobs. A request
    has one per prompt and per n (or per best_of candidate)."""

    def __init__(self, index: int, r, text: TextStream, prompt: list[int], prefix: str, top: int | None):
        self.index, self.r, self.text, self.prompt, self.prefix, self.top = index, r, text, prompt, prefix, top
        self.finish: str | None = None
        self.entries: list[tuple[int, float, list]] = []  # (token, logprob, alternatives) of each generated token
        self.prompt_logprobs: list | None = None  # [[logprob, alternatives], ...] of prompt tokens 1.. (echo)
        self.cumulative = 0.0  # the chosen tokens' logprobs added up (best_of ranks by it)
        self.unsent = ""  # streaming: text not yet in a chunk
        self.sent = 0  # streaming: entries already in a chunk
        self.head_sent = False  # streaming: the echoed prompt is out
        self.offset = 0  # streaming: text_offset of the next token

    def push(self, token: int | None, logprobs: list | None, finish: str | None) -> str | None:
        """Take one token event; returns the finish reason once the choice is over."""
        if token is not None and not self.text.finished:
            self.unsent += self.text.push(token)
            if logprobs is not None:
                self.entries.append((token, logprobs[0], logprobs[1]))
                self.cumulative += logprobs[0]
        if self.text.finished:  # a stop string
            finish = "stop"
        if finish is not None:
            self.finish = finish
            self.unsent += self.text.flush()
        return finish

    async def collect(self) -> None:
        """Run to the end (non-streaming)."""
        while True:
            kind, value, finish, logprobs = await self.r.events.get()
            if kind == "error":
                raise HTTPError(503, value, "server_error", code="worker_failed")
            if kind == "prompt":
                self.prompt_logprobs = value
            elif self.push(value, logprobs, finish) is not None:
                return

    def take_text(self) -> str:
        """Streaming: the text for the next chunk, the echoed prompt first."""
        out, self.unsent = self.unsent, ""
        if self.prefix and not self.head_sent:
            out = self.prefix + out
        return out

    @property
    def pending(self) -> bool:
        return self.top is not None and self.sent < len(self.entries)

    def _entries(self, streaming: bool) -> list:
        if not streaming:
            return self.entries
        out, self.sent = self.entries[self.sent :], len(self.entries)
        return out

    def _prompt_entries(self) -> list:
        lps = self.prompt_logprobs or []
        return [(self.prompt[0], None, None)] + [(t, lp, alts) for t, (lp, alts) in zip(self.prompt[1:], lps)]

    def completion_logprobs(self, texts: TokenText, streaming: bool = False) -> dict | None:
        """The choice's logprobs (streaming: those not sent yet), the echoed prompt's first."""
        if self.top is None:
            return None
        head = self._prompt_entries() if self.prefix and not (streaming and self.head_sent) else []
        offset = self.offset if streaming else 0
        out = texts.completion(head + self._entries(streaming), offset)
        if streaming:
            self.head_sent = True
            self.offset = offset + sum(len(t) for t in out["tokens"])
        return out

    def chat_logprobs(self, texts: TokenText, streaming: bool = False) -> list[dict] | None:
        return None if self.top is None else texts.chat(self._entries(streaming))


def create_app(cfg: ServeConfig) -> FastAPI:
    model_cfg = model_config(cfg.model)
    tokenizer = load_tokenizer(cfg.model)
    eos = sorted(eos_ids(model_cfg, tokenizer))  # the same ids `unweight generate` stops at
    max_len, _ = context_limits(cfg, model_cfg.max_position_embeddings)  # what the workers' KV pools really hold
    name = cfg.served_model_name or Path(cfg.model).resolve().name
    vocab_size = model_cfg.vocab_size
    texts = TokenText(tokenizer)
    metrics = Metrics(name, max_len)
    router = Router(cfg, eos, metrics)
    metrics.watch(lambda: router.workers.values(), lambda: router.requests.values())
    tokenizing = concurrent.futures.ThreadPoolExecutor(
        2, thread_name_prefix="tokenize"
    )  # prompts never tokenise on the event loop
    max_chars = _max_prompt_chars(tokenizer, max_len)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await router.start()
        try:
            yield
        finally:
            await router.stop()
            tokenizing.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="unweight serve", lifespan=lifespan)
    app.state.router = router
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes, timeout_body=cfg.timeout_body)
    app.add_middleware(CountResponses, record=metrics.response)  # outermost: sees the 413s and 503s too
    openai_errors(app)
    expected_auth = f"Bearer {cfg.api_key}".encode() if cfg.api_key else None

    def fail(e: HTTPError, endpoint: str) -> JSONResponse:
        headers = {"Retry-After": RETRY_AFTER_S} if e.status in (429, 503) else None
        return JSONResponse(e.body, status_code=e.status, headers=headers)

    def check_key(request: Request) -> None:
        if expected_auth is None:
            return
        got = request.headers.get("authorization", "").encode("latin-1")  # the header's own bytes
        if not hmac.compare_digest(got, expected_auth):
            raise HTTPError(401, "invalid API key", "authentication_error", code="invalid_api_key")

    async def parse(request: Request, schema, endpoint: str):
        data = await request.body()
        try:
            body = await asyncio.to_thread(parse_json, data) if len(data) > JSON_IN_THREAD_BYTES else parse_json(data)
        except ValueError as e:
            raise HTTPError(400, str(e)) from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object")
        field = api.unsupported(body, endpoint)
        if field is not None:
            raise HTTPError(
                400, f"{field}: this server does not support {field!r}", param=field, code="unsupported_parameter"
            )
        try:
            req = schema.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            raise HTTPError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from None
        if req.model != name:
            raise HTTPError(
                404,
                f"model {req.model!r} is not served here; this server serves {name!r}",
                param="model",
                code="model_not_found",
            )
        return req

    def budget(req, prompt_ids: list[int], param: str) -> int:
        n = len(prompt_ids)
        if n == 0:
            raise HTTPError(400, "the prompt encodes to no tokens", param=param)
        if n >= max_len:
            raise HTTPError(
                400,
                f"the prompt has {n} tokens; the context length is {max_len}",
                param=param,
                code="context_length_exceeded",
            )
        limit = req.limit()
        if limit is None:
            return min(api.DEFAULT_MAX_TOKENS, max_len - n)
        if n + limit > max_len:
            raise HTTPError(
                400,
                f"the prompt has {n} tokens; with max_tokens {limit} that exceeds the context length {max_len}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return limit

    async def encode(req, chat: bool) -> list[list[int]]:
        """Token ids of each prompt: chat messages through the chat template, text through the
        tokenizer (on a thread; a prompt with more characters than max_len tokens can cover is
        refused before the tokenizer sees it), token-id prompts checked against the vocabulary."""
        param = "messages" if chat else "prompt"
        prompts = [[m.template_dict() for m in req.messages]] if chat else req.prompts()
        out = []
        for p in prompts:
            if isinstance(p, list) and p and isinstance(p[0], int):
                bad = [t for t in p if not 0 <= t < vocab_size]
                if bad:
                    raise HTTPError(
                        400,
                        f"prompt: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                        param="prompt",
                    )
                out.append(list(p))
                continue
            if max_chars is not None and _chars(p) > max_chars:
                raise HTTPError(
                    400,
                    f"the prompt has more than {max_chars} characters, more than {max_len} tokens of context can hold",
                    param=param,
                    code="context_length_exceeded",
                )
            try:
                out.append(await asyncio.get_running_loop().run_in_executor(tokenizing, encode_prompt, tokenizer, p))
            except ValueError as e:
                raise HTTPError(400, str(e), param=param) from None
        return out

    async def handle(request: Request, schema, endpoint: str, chat: bool):
        choices: list[Choice] = []
        try:
            check_key(request)
            req = await parse(request, schema, endpoint)
            prompts = await encode(req, chat)
            param = "messages" if chat else "prompt"
            limits = [budget(req, ids, param) for ids in prompts]
            per_prompt, n = req.choices(), req.n or 1
            top = req.token_logprobs()
            echo = not chat and bool(req.echo)
            if len(prompts) * per_prompt > router.room():
                raise HTTPError(
                    429,
                    f"server busy: {len(prompts) * per_prompt} sequences asked, room for {max(router.room(), 0)}",
                    "rate_limit_error",
                    code="overloaded",
                )
            rid = api.new_id("chatcmpl" if chat else "cmpl")
            try:
                for pi, ids in enumerate(prompts):
                    prefix = (
                        ""
                        if not echo
                        else given
                        if isinstance(given := req.prompts()[pi], str)
                        else tokenizer.decode(ids)
                    )
                    for j in range(per_prompt):
                        try:
                            # best_of ranks by the chosen tokens' logprobs: ask for them even if the client did not
                            params = req.params(limits[pi], top if per_prompt == n else (top or 0), choice=j)
                            params.check_vocab(vocab_size)
                        except ValueError as e:
                            raise HTTPError(400, str(e)) from None
                        r = await router.submit(
                            f"{rid}-{pi}-{j}", ids, params, prompt_logprobs=top if echo and top is not None else None
                        )
                        choices.append(
                            Choice(
                                pi * n + j,
                                r,
                                TextStream(tokenizer, req.stop or [], params.min_tokens),
                                ids,
                                prefix,
                                top,
                            )
                        )
            except Overloaded as e:
                raise HTTPError(429, f"server busy: {e}", "rate_limit_error", code="overloaded") from None
            except Unavailable as e:
                raise HTTPError(503, f"server not ready: {e}", "server_error", code="unavailable") from None
        except HTTPError as e:
            for c in choices:
                await router.cancel(c.r)
            return fail(e, endpoint)
        n_prompt = sum(len(ids) for ids in prompts)
        if req.stream:
            return StreamingResponse(_sse(choices, req, rid, chat, n_prompt), media_type="text/event-stream")
        try:
            await _unless_disconnected(request, asyncio.gather(*(c.collect() for c in choices)))
        except HTTPError as e:
            return fail(e, endpoint)
        finally:
            for c in choices:
                if not c.r.done:
                    await router.cancel(c.r, "stop" if c.text.finished else "abort")
        completion = sum(len(c.text.tokens) for c in choices)
        if per_prompt > n:  # best_of: the n most likely of each prompt's candidates
            kept = []
            for pi in range(len(prompts)):
                ranked = sorted(choices[pi * per_prompt : (pi + 1) * per_prompt], key=lambda c: -c.cumulative)
                for j, c in enumerate(ranked[:n]):
                    c.index = pi * n + j
                    kept.append(c)
            choices = kept
        if chat:
            body = api.chat_body(
                rid,
                name,
                [api.chat_choice(c.index, c.text.text, c.finish, c.chat_logprobs(texts)) for c in choices],
                n_prompt,
                completion,
            )
        else:
            body = api.completion_body(
                rid,
                name,
                [
                    api.completion_choice(c.index, c.prefix + c.text.text, c.finish, c.completion_logprobs(texts))
                    for c in choices
                ],
                n_prompt,
                completion,
            )
        return JSONResponse(body)

    async def _sse(choices: list[Choice], req, rid: str, chat: bool, n_prompt: int):
        obj = "chat.completion.chunk" if chat else "text_completion"
        events: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice):
            while True:
                ev = await c.r.events.get()
                await events.put((c, ev))
                if ev[0] == "error" or (ev[0] == "token" and ev[2] is not None):
                    return

        def data(body: dict) -> str:
            return f"data: {json.dumps(body)}\n\n"

        def chunk(c: Choice, piece: str, finish: str | None) -> str:
            if finish is not None:  # the last chunk: its logprobs went out with the text before it
                body = (
                    api.chat_chunk(rid, name, c.index, {}, finish)
                    if chat
                    else api.completion_chunk(rid, name, c.index, "", finish)
                )
                return data(body)
            if chat:
                lp = c.chat_logprobs(texts, streaming=True)
                return data(api.chat_chunk(rid, name, c.index, {"content": piece}, None, lp))
            lp = c.completion_logprobs(texts, streaming=True)
            c.head_sent = True
            return data(api.completion_chunk(rid, name, c.index, piece, None, lp))

        pumps = [asyncio.create_task(pump(c)) for c in choices]
        try:
            if chat:
                for c in choices:
                    yield data(api.chat_chunk(rid, name, c.index, {"role": "assistant", "content": ""}, None))
            open_ = len(choices)
            while open_:
                c, ev = await events.get()
                if ev[0] == "error":
                    yield data(api.error_body(ev[1], "server_error", code="worker_failed"))
                    break
                if ev[0] == "prompt":
                    c.prompt_logprobs = ev[1]
                    continue
                finish = c.push(ev[1], ev[3], ev[2])
                piece = c.take_text()  # with echo, the prompt comes first (and its logprobs)
                if piece or (finish is not None and c.pending):
                    yield chunk(c, piece, None)
                if finish is not None:
                    yield chunk(c, "", finish)
                    open_ -= 1
            else:
                if req.include_usage:
                    yield data(api.usage_chunk(rid, name, obj, n_prompt, sum(len(c.text.tokens) for c in choices)))
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away mid-stream: free its slots and KV caches
            for t in pumps:
                t.cancel()
            for c in choices:
                if not c.r.done:
                    await router.cancel(c.r, "stop" if c.text.finished else "abort")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, api.CompletionRequest, "completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, api.ChatRequest, "chat", chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            check_key(request)
        except HTTPError as e:
            return fail(e, "models")
        return {"object": "list", "data": [model_card()]}

    def model_card() -> dict:
        return {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "unweight",
            "max_model_len": max_len,
        }

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        try:
            check_key(request)
            if model_id != name:
                raise HTTPError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        except HTTPError as e:
            return fail(e, "models")
        return model_card()

    def check_private(request: Request) -> None:
        if not cfg.public_health:
            check_key(request)

    @app.get("/health")
    async def health(request: Request):
        try:
            check_private(request)
        except HTTPError as e:
            return fail(e, "health")
        ok = router.ready()
        body = {
            "status": "ok"
            if ok
            else "starting"
            if not router.workers or any(w.state == "starting" for w in router.workers.values())
            else "degraded",
            "mode": "disaggregated" if cfg.disaggregated else "aggregated",
            "model": name,
            "workers": [w.to_json() for w in router.workers.values()],
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus(request: Request):
        try:
            check_private(request)
        except HTTPError as e:
            return fail(e, "metrics")
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.exception_handler(Exception)
    async def crash(request: Request, e: Exception):  # never a traceback page: an OpenAI-style 500
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(api.error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)

    return app


def serve(cfg: ServeConfig) -> None:
    """Run the router and (unless they live elsewhere) its workers until SIGINT/SIGTERM."""
    import uvicorn

    app = create_app(cfg)
    uvicorn.run(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level="warning",
        timeout_graceful_shutdown=10,
        http=guarded_protocol(cfg.timeout_header, cfg.limit_concurrency),
        timeout_keep_alive=cfg.timeout_keep_alive,
    )


class ClientGone(HTTPError):
    def __init__(self):
        super().__init__(499, "the client closed the connection", code="client_closed_request")


async def _unless_disconnected(request: Request, work):
    """Await `work` (a coroutine) unless the client hangs up first: then cancel it and raise
    ClientGone, so the caller frees the request's slot as a broken stream does. The body is read by
    now, so the next ASGI message is the disconnect."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    job, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not job.done():
            job.cancel()
    if job.done() and not job.cancelled():
        return job.result()
    raise ClientGone()


def _chars(prompt) -> int:
    """Characters of text in a prompt: a string, or the contents of chat messages (strings or
    lists of {"type": "text", "text": ...} parts). Anything else counts 0 (no pre-check)."""
    if isinstance(prompt, str):
        return len(prompt)
    if not isinstance(prompt, list) or not all(isinstance(m, dict) for m in prompt):
        return 0
    n = 0
    for m in prompt:
        content = m.get("content")
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):
            n += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return n


def _max_prompt_chars(tokenizer, max_len: int) -> int | None:
    """Characters beyond which a prompt certainly needs more than max_len tokens: max_len times the
    longest token. A token's text in the vocabulary has one character per byte (byte-level BPE) or
    per character, never fewer than it decodes to; a normalizer could drop characters, so with one
    there is no such bound (None)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    longest = max(len(t) for t in tokenizer.get_vocab())
    return max_len * max(1, longest)


def run_worker(role: str, name: str, cfg: ServeConfig, router_address: tuple[str, int], parent_pid: int | None) -> None:
    """A worker started by hand (`unweight serve --role prefill|decode|worker`), its control secret
    from --control-secret-file. (The router starts its own workers without the CLI, with the same
    WorkerSpec.)"""
    from .protocol import WorkerSpec, read_secret_file
    from .worker import main

    if not cfg.control_secret_file:
        raise ValueError(f"--role {role} needs --control-secret-file PATH (the file the router was given)")
    main(
        WorkerSpec(cfg, role, name, router_address, parent_pid, cfg.worker_threads),
        read_secret_file(cfg.control_secret_file),
    )


__all__ = ["create_app", "run_worker", "serve"]
