"""GET /v1/models, /v1/models/ID (the one model served) and /health (the workers' states)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .errors import HTTPError, fail
from .state import ServerState, state_of

router = APIRouter()


def model_card(s: ServerState) -> dict:
    return {
        "id": s.name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "unweight",
        "max_model_len": s.max_len,
    }


@router.get("/v1/models")
async def models(request: Request):
    s = state_of(request)
    try:
        s.check_key(request)
    except HTTPError as e:
        return fail(e, "models")
    return {"object": "list", "data": [model_card(s)]}


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str):
    s = state_of(request)
    try:
        s.check_key(request)
        if model_id != s.name:
            raise HTTPError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
    except HTTPError as e:
        return fail(e, "models")
    return model_card(s)


@router.get("/health")
async def health(request: Request):
    s = state_of(request)
    try:
        s.check_private(request)
    except HTTPError as e:
        return fail(e, "health")
    router_ = s.router
    ok = router_.ready()
    starting = not router_.workers or any(w.state == "starting" for w in router_.workers.values())
    body = {
        "status": "ok" if ok else "starting" if starting else "degraded",
        "mode": "disaggregated" if s.cfg.disaggregated else "aggregated",
        "model": s.name,
        "workers": [w.to_json() for w in router_.workers.values()],
    }
    return JSONResponse(body, status_code=200 if ok else 503)
