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

from ..generate import TextStream, encode_prompt, load_tokenizer
from ..loader import _generation_eos
from ..model_config import ModelConfig
from . import api
from .http import BodyLimit, CountResponses, guarded_protocol, openai_errors, parse_json
from .metrics import Metrics
from .protocol import ServeConfig
from .router import Overloaded, Router, Unavailable

log = logging.getLogger(__name__)
RETRY_AFTER_S = "1"
JSON_IN_THREAD_BYTES = 64 << 10  # bodies larger than this are parsed off the event loop


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, api.error_body(message, kind, param, code)


def create_app(cfg: ServeConfig) -> FastAPI:
    model_cfg = ModelConfig.from_folder(cfg.model)
    tokenizer = load_tokenizer(cfg.model)
    eos = sorted(set(model_cfg.eos_token_ids) | set(_generation_eos(Path(cfg.model))) | ({tokenizer.eos_token_id} - {None}))
    max_len = min(cfg.max_model_len or model_cfg.max_position_embeddings, model_cfg.max_position_embeddings)
    name = cfg.served_model_name or Path(cfg.model).resolve().name
    metrics = Metrics(name, max_len)
    router = Router(cfg, eos, metrics)
    metrics.watch(lambda: router.workers.values(), lambda: router.requests.values())
    tokenizing = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="tokenize")  # prompts never tokenise on the event loop
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
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes)
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

    async def parse(request: Request, schema):
        data = await request.body()
        try:
            body = await asyncio.to_thread(parse_json, data) if len(data) > JSON_IN_THREAD_BYTES else parse_json(data)
        except ValueError as e:
            raise HTTPError(400, str(e)) from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object")
        try:
            req = schema.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            raise HTTPError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from None
        if req.model != name:
            raise HTTPError(404, f"model {req.model!r} is not served here; this server serves {name!r}", param="model", code="model_not_found")
        return req

    def budget(req, prompt_ids: list[int]) -> int:
        n = len(prompt_ids)
        if n == 0:
            raise HTTPError(400, "the prompt encodes to no tokens", param="prompt")
        if n >= max_len:
            raise HTTPError(400, f"the prompt has {n} tokens; the context length is {max_len}", param="messages" if hasattr(req, "messages") else "prompt", code="context_length_exceeded")
        limit = req.limit()
        if limit is None:
            return min(api.DEFAULT_MAX_TOKENS, max_len - n)
        if n + limit > max_len:
            raise HTTPError(400, f"the prompt has {n} tokens; with max_tokens {limit} that exceeds the context length {max_len}", param="max_tokens", code="context_length_exceeded")
        return limit

    async def tokenize(req, prompt) -> list[int]:
        """Token ids of a prompt, computed on a thread; a prompt with more characters than
        max_len tokens can cover is refused before the tokenizer sees it."""
        if max_chars is not None and _chars(prompt) > max_chars:
            raise HTTPError(400, f"the prompt has more than {max_chars} characters, more than {max_len} tokens of context can hold",
                            param="messages" if hasattr(req, "messages") else "prompt", code="context_length_exceeded")
        return await asyncio.get_running_loop().run_in_executor(tokenizing, encode_prompt, tokenizer, prompt)

    async def handle(request: Request, schema, endpoint: str, chat: bool):
        try:
            check_key(request)
            req = await parse(request, schema)
            prompt = [m.model_dump() for m in req.messages] if chat else req.prompt
            try:
                ids = await tokenize(req, prompt)  # messages go through the chat template
            except ValueError as e:
                raise HTTPError(400, str(e)) from None
            sampling = {"max_tokens": budget(req, ids), "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed}
            rid = api.new_id("chatcmpl" if chat else "cmpl")
            try:
                r = await router.submit(rid, ids, sampling)
            except Overloaded as e:
                raise HTTPError(429, f"server busy: {e}", "rate_limit_error", code="overloaded") from None
            except Unavailable as e:
                raise HTTPError(503, f"server not ready: {e}", "server_error", code="unavailable") from None
        except HTTPError as e:
            return fail(e, endpoint)
        text = TextStream(tokenizer, req.stop or [])
        if req.stream:
            return StreamingResponse(_sse(r, text, req, rid, chat, len(ids)), media_type="text/event-stream")
        try:
            completion, finish = await _unless_disconnected(request, _collect(r, text))
        except HTTPError as e:
            return fail(e, endpoint)
        finally:
            if not r.done:
                await router.cancel(r, "stop" if text.finished else "abort")
        body = (api.chat_body if chat else api.completion_body)(rid, name, text.text, finish, len(ids), len(text.tokens))
        return JSONResponse(body)

    async def _collect(r, text: TextStream) -> tuple[str, str]:
        while True:
            kind, token, finish = await r.events.get()
            if kind == "error":
                raise HTTPError(503, token, "server_error", code="worker_failed")
            if token is not None:
                text.push(token)
            if text.finished:
                return text.text, "stop"
            if finish is not None:
                return text.text, finish

    async def _sse(r, text: TextStream, req, rid: str, chat: bool, n_prompt: int):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece: str, finish: str | None) -> str:
            if chat:
                body = api.chat_chunk(rid, name, {"content": piece} if piece or finish is None else {}, finish)
            else:
                body = api.completion_chunk(rid, name, piece, finish)
            return f"data: {json.dumps(body)}\n\n"

        try:
            if chat:
                yield f"data: {json.dumps(api.chat_chunk(rid, name, {'role': 'assistant', 'content': ''}, None))}\n\n"
            while True:
                kind, token, finish = await r.events.get()
                if kind == "error":
                    yield f"data: {json.dumps(api.error_body(token, 'server_error', code='worker_failed'))}\n\n"
                    break
                piece = text.push(token) if token is not None else ""
                if text.finished:
                    finish = "stop"
                if finish is not None:
                    piece += text.flush()
                if piece:
                    yield chunk(piece, None)
                if finish is not None:
                    yield chunk("", finish)
                    if req.include_usage:
                        yield f"data: {json.dumps(api.usage_chunk(rid, name, obj, n_prompt, len(text.tokens)))}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away mid-stream: free its slot and KV cache
            if not r.done:
                await router.cancel(r, "stop" if text.finished else "abort")

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
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "unweight", "max_model_len": max_len}

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
        body = {"status": "ok" if ok else "starting" if not router.workers or any(w.state == "starting" for w in router.workers.values()) else "degraded",
                "mode": "disaggregated" if cfg.disaggregated else "aggregated", "model": name,
                "workers": [w.to_json() for w in router.workers.values()]}
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
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", timeout_graceful_shutdown=10,
                http=guarded_protocol(cfg.timeout_header, cfg.limit_concurrency), timeout_keep_alive=cfg.timeout_keep_alive)


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


def run_worker(role: str, name: str, cfg: ServeConfig, router_address: tuple[str, int], kv_address: tuple[str, int] | None, parent_pid: int | None) -> None:
    from .worker import main

    main(role, name, cfg.model, router_address, kv_address, cfg.device, cfg.max_batch, cfg.max_model_len, parent_pid, cfg.worker_threads)


__all__ = ["create_app", "run_worker", "serve"]
