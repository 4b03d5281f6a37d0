"""The HTTP edge of `unweight serve`: what guards the event loop and the connections before a
request reaches the OpenAI handlers in app.py.

- `BodyLimit` (ASGI middleware): a body over `max_body_bytes` gets 413 as soon as its
  Content-Length says so, or as soon as that many bytes have arrived (chunked bodies); nothing
  larger is ever buffered. A body that has not all arrived `timeout_body` s after its head gets
  408 and the connection is closed (uvicorn has no body timeout: a body sent a byte at a time
  would hold its connection, and a concurrency slot, for as long as the client likes).
- `parse_json`: JSON that is UTF-8, nested at most `MAX_JSON_DEPTH` deep and free of lone
  surrogates, or a `ValueError` saying which of these it is not; `json_object`, a request's body as
  such a JSON object or HTTP 400.
- `GuardedH11Protocol`: uvicorn's h11 protocol plus what uvicorn 0.54 lacks. uvicorn arms its
  keep-alive timer only after a response and cancels it on any byte, so a connection that never
  sends a request, or sends its head a byte a second, stays open forever. Here a connection is
  closed when it is silent for `timeout_keep_alive` s before a request (as uvicorn does between
  requests), or when a request's head has not fully arrived `timeout_header` s after the
  connection opened or the previous response ended. Connections beyond `limit_concurrency` get
  503 (OpenAI's error body, `Connection: close`) for their request.
- `openai_errors`: Starlette's 404/405 and FastAPI's validation errors in OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable

import h11
import numpy as np
from uvicorn.protocols.http.h11_impl import H11Protocol

from . import api
from .routes.errors import HTTPError

DEFAULT_MAX_BODY_BYTES = 16 << 20
MAX_JSON_DEPTH = 64
OVER_LIMIT = "unweight.over_connection_limit"  # set in a connection's ASGI scope["state"] by the protocol
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})  # any other token counts as "other"

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


async def send_error(
    send, status: int, message: str, kind: str, code: str | None, extra_headers: list | None = None
) -> None:
    """An OpenAI error body straight through ASGI, closing the connection (used where the request
    was not read to its end, or before any handler ran)."""
    body = json.dumps(api.error_body(message, kind, None, code)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *(extra_headers or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class BodyLimit:
    """Reads the whole body itself, at most `max_bytes` of it, and hands it to the app in one
    message; later receives (the disconnect) go to the server. Also answers 503 on a connection
    the protocol marked as over the connection limit."""

    def __init__(self, app, max_bytes: int, timeout_body: float = 30.0):
        self.app, self.max_bytes, self.timeout_body = app, max_bytes, timeout_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope.get("state", {}).get(OVER_LIMIT):
            return await send_error(
                send,
                503,
                "too many open connections; retry later",
                "server_error",
                "overloaded",
                [(b"retry-after", b"1")],
            )
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._too_large(send)

        async def read() -> bytes | str:
            chunks, size = [], 0
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return "gone"  # the client left before its body ended: nobody to answer
                chunks.append(msg.get("body", b""))
                size += len(chunks[-1])
                if size > self.max_bytes:
                    return "too large"
                if not msg.get("more_body"):
                    return b"".join(chunks)

        try:
            body = await asyncio.wait_for(read(), self.timeout_body)
        except asyncio.TimeoutError:
            return await send_error(
                send,
                408,
                f"the request body did not arrive within {self.timeout_body:g} s (--timeout-body)",
                "invalid_request_error",
                "request_timeout",
            )
        if body == "too large":
            return await self._too_large(send)
        if body == "gone":
            return
        replay = [{"type": "http.request", "body": body, "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    async def _too_large(self, send):
        await send_error(
            send,
            413,
            f"the request body is larger than {self.max_bytes} bytes (--max-body-bytes)",
            "invalid_request_error",
            "request_too_large",
        )


def json_depth(text: str) -> int:
    """How deep the brackets of JSON text nest (strings skipped), in C-speed passes."""
    bare = _STRING.sub("", text).encode("utf-8", "surrogatepass")
    b = np.frombuffer(bare, np.uint8)
    step = np.isin(b, _OPEN).astype(np.int32) - np.isin(b, _CLOSE).astype(np.int32)
    return int(np.cumsum(step).max(initial=0))


def parse_json(data: bytes):
    """The request body as JSON, or ValueError with the reason it is not acceptable."""
    try:
        text = data.decode("utf-8")  # strict: encoded surrogates and stray bytes are errors
    except UnicodeDecodeError as e:
        raise ValueError(f"the body is not valid UTF-8: {e}") from None
    if json_depth(text) > MAX_JSON_DEPTH:
        raise ValueError(f"the body is not valid JSON: nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"the body is not valid JSON: {e}") from None
    if _SURROGATE_ESCAPE.search(text):  # pairs are fine; a lone half cannot be encoded as UTF-8
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                "the body is not valid JSON: a string holds a lone UTF-16 surrogate (\\ud800-\\udfff)"
            ) from None
    return body


JSON_IN_THREAD_BYTES = 64 << 10  # request bodies larger than this are parsed off the event loop


async def json_object(request) -> dict:
    """A request's body as a JSON object (`parse_json`), or HTTPError 400 saying why it is not one."""
    data = await request.body()
    try:
        body = await asyncio.to_thread(parse_json, data) if len(data) > JSON_IN_THREAD_BYTES else parse_json(data)
    except ValueError as e:
        raise HTTPError(400, str(e)) from None
    if not isinstance(body, dict):
        raise HTTPError(400, "the body must be a JSON object")
    return body


def guarded_protocol(timeout_header: float, limit_concurrency: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header deadline, an idle deadline before the first request,
    and a connection limit (see the module docstring)."""

    class GuardedH11Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limit_concurrency:
                self.app_state = {**self.app_state, OVER_LIMIT: True}
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
            self._arm_header_timer()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # a request's head has arrived
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(timeout_header, self._header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self.transport.close()

    return GuardedH11Protocol


def openai_errors(app) -> None:
    """Errors Starlette and FastAPI answer themselves, in OpenAI's body instead of {"detail"}."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        where = f"{request.method} {request.url.path}"
        if e.status_code == 404:
            message, code = f"Invalid URL ({where})", "not_found"
        elif e.status_code == 405:
            message, code = f"Invalid method for URL ({where})", "method_not_allowed"
        else:
            message, code = str(e.detail), None
        kind = "server_error" if e.status_code >= 500 else "invalid_request_error"
        return JSONResponse(api.error_body(message, kind, None, code), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        err = (e.errors() or [{}])[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        return JSONResponse(
            api.error_body(f"{param}: {err.get('msg', 'invalid')}", "invalid_request_error", param, None),
            status_code=400,
        )


class CountResponses:
    """ASGI middleware calling record(handler, method, status) for every response, 5xx included
    (an exception escaping the app counts as the 500 it becomes; a client that left before any
    response as 499, nginx's "client closed request")."""

    def __init__(self, app, record: Callable[[str, str, int], None]):
        self.app, self.record = app, record

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = []

        async def sending(msg):
            if msg["type"] == "http.response.start":
                status.append(msg["status"])
            await send(msg)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            status.append(500)
            raise
        finally:
            route = scope.get("route")  # its path template: a bounded set of label values, like the method's
            method = scope["method"] if scope["method"] in _METHODS else "other"
            self.record(getattr(route, "path", None) or "none", method, status[0] if status else 499)


__all__ = [
    "BodyLimit",
    "DEFAULT_MAX_BODY_BYTES",
    "MAX_JSON_DEPTH",
    "CountResponses",
    "guarded_protocol",
    "openai_errors",
    "parse_json",
]
