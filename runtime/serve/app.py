"""The HTTP side of `unweight serve` (FastAPI): the app assembled from its endpoint families
(routes/: completions, chat, models and health, metrics) around one ServerState, with its
middleware, its error pages and its router's start and stop.

unweight serve ./smollm2-uw --port 8000
curl localhost:8000/v1/chat/completions -d '{"model": "smollm2-uw", "messages": [{"role": "user", "content": "Hi"}]}'
"""

from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from . import api
from .http import BodyLimit, CountResponses, openai_errors
from .protocol import ServeConfig
from .routes import chat, completions, metrics, models
from .routes.state import ServerState

log = logging.getLogger(__name__)


def create_app(cfg: ServeConfig) -> FastAPI:
    state = ServerState.from_config(cfg)
    if state.sampling:  # said once, as vLLM says it: what a request leaves out is no longer OpenAI's default
        log.warning(
            "sampling defaults from the model's generation_config.json (--generation-config vllm for OpenAI's): %s",
            state.sampling,
        )

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await state.router.start()
        try:
            yield
        finally:
            await state.router.stop()
            state.tokenizing.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="unweight serve", lifespan=lifespan)
    app.state.served = state
    app.state.router = state.router
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes, timeout_body=cfg.timeout_body)
    app.add_middleware(CountResponses, record=state.metrics.response)  # outermost: sees the 413s and 503s too
    openai_errors(app)
    for family in (completions, chat, models, metrics):
        app.include_router(family.router)
    app.add_exception_handler(Exception, _crash)
    return app


async def _crash(request: Request, e: Exception) -> JSONResponse:
    """Never a traceback page: an OpenAI-style 500."""
    log.exception("unhandled error on %s", request.url.path)
    return JSONResponse(api.error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)


__all__ = ["create_app"]
