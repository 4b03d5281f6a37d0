"""GET /metrics: the server's Prometheus metrics (vLLM's names, runtime/serve/metrics.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .errors import HTTPError, fail
from .state import state_of

router = APIRouter()


@router.get("/metrics")
async def prometheus(request: Request):
    s = state_of(request)
    try:
        s.check_private(request)
    except HTTPError as e:
        return fail(e, "metrics")
    return Response(s.metrics.render(), media_type="text/plain; version=0.0.4")
