"""The HTTP side of `unweight serve` (FastAPI): OpenAI endpoints, /health, /metrics, and launch.

    unweight serve ./smollm2-uw --port 8000
    curl localhost:8000/v1/chat/completions -d '{"model": "smollm2-uw", "messages": [{"role": "user", "content": "Hi"}]}'
"""

from __future__ import annotations

import contextlib
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
from .metrics import Metrics
from .protocol import ServeConfig, context_limits
from .router import Overloaded, Router, Unavailable

log = logging.getLogger(__name__)
RETRY_AFTER_S = "1"


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, api.error_body(message, kind, param, code)


def create_app(cfg: ServeConfig) -> FastAPI:
    model_cfg = ModelConfig.from_folder(cfg.model)
    tokenizer = load_tokenizer(cfg.model)
    eos = sorted(set(model_cfg.eos_token_ids) | set(_generation_eos(Path(cfg.model))) | ({tokenizer.eos_token_id} - {None}))
    max_len, _ = context_limits(cfg, model_cfg.max_position_embeddings)  # what the workers' KV pools really hold
    name = cfg.served_model_name or Path(cfg.model).resolve().name
    metrics = Metrics()
    router = Router(cfg, eos, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="unweight serve", lifespan=lifespan)
    app.state.router = router

    def fail(e: HTTPError, endpoint: str) -> JSONResponse:
        metrics.requests.labels(endpoint, str(e.status)).inc()
        headers = {"Retry-After": RETRY_AFTER_S} if e.status in (429, 503) else None
        return JSONResponse(e.body, status_code=e.status, headers=headers)

    def check_key(request: Request) -> None:
        if cfg.api_key and request.headers.get("authorization") != f"Bearer {cfg.api_key}":
            raise HTTPError(401, "invalid API key", "authentication_error", code="invalid_api_key")

    async def parse(request: Request, schema):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HTTPError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object")
        try:
            req = schema.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            raise HTTPError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from None
        if req.model != name:
            raise HTTPError(400, f"model {req.model!r} is not served here; this server serves {name!r}", param="model", code="model_not_found")
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

    async def handle(request: Request, schema, endpoint: str, chat: bool):
        try:
            check_key(request)
            req = await parse(request, schema)
            prompt = [m.model_dump() for m in req.messages] if chat else req.prompt
            try:
                ids = encode_prompt(tokenizer, prompt)  # messages go through the chat template
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
            metrics.requests.labels(endpoint, "200").inc()
            return StreamingResponse(_sse(r, text, req, rid, chat, len(ids)), media_type="text/event-stream")
        try:
            completion, finish = await _collect(r, text)
        except HTTPError as e:
            return fail(e, endpoint)
        finally:
            if not r.done:
                await router.cancel(r)
        metrics.requests.labels(endpoint, "200").inc()
        metrics.tokens.inc(len(text.tokens))
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
                    metrics.tokens.inc(len(text.tokens))
                    if req.include_usage:
                        yield f"data: {json.dumps(api.usage_chunk(rid, name, obj, n_prompt, len(text.tokens)))}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away mid-stream: free its slot and KV cache
            if not r.done:
                await router.cancel(r)

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
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()), "owned_by": "unweight", "max_model_len": max_len}]}

    @app.get("/health")
    async def health():
        ok = router.ready()
        body = {"status": "ok" if ok else "starting" if not router.workers or any(w.state == "starting" for w in router.workers.values()) else "degraded",
                "mode": "disaggregated" if cfg.disaggregated else "aggregated", "model": name,
                "workers": [w.to_json() for w in router.workers.values()]}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus():
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
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", timeout_graceful_shutdown=10)


def run_worker(role: str, name: str, cfg: ServeConfig, router_address: tuple[str, int], kv_address: tuple[str, int] | None, parent_pid: int | None) -> None:
    """A worker process. Its control secret comes from --control-secret-file, else from the
    environment of the router that started it (taken out of the environment at once)."""
    import os

    from .protocol import SECRET_ENV, read_secret_file
    from .worker import main

    secret = os.environ.pop(SECRET_ENV, None)
    if cfg.control_secret_file:
        secret = read_secret_file(cfg.control_secret_file)
    if not secret:
        raise ValueError(f"--role {role} needs --control-secret-file PATH (the file the router was given), unless the router started it")
    main(role, name, cfg.model, router_address, kv_address, cfg.device, cfg.max_batch, cfg.max_model_len, parent_pid, cfg.worker_threads,
         secret=secret, kv_cache_tokens=cfg.kv_cache_tokens)


__all__ = ["create_app", "run_worker", "serve"]
