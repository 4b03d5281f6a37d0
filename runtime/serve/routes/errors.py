"""An endpoint's refusal as it reaches the client: an OpenAI-style error body with its HTTP status."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from .. import api

RETRY_AFTER_S = "1"


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


class ClientGone(HTTPError):
    def __init__(self):
        super().__init__(499, "the client closed the connection", code="client_closed_request")


def model_not_found(asked, served: str) -> HTTPError:
    return HTTPError(
        404, f"model {asked!r} is not served here; this server serves {served!r}", param="model", code="model_not_found"
    )


def fail(e: HTTPError, endpoint: str) -> JSONResponse:
    """The error's response; 429 and 503 say when to retry."""
    headers = {"Retry-After": RETRY_AFTER_S} if e.status in (429, 503) else None
    return JSONResponse(e.body, status_code=e.status, headers=headers)
