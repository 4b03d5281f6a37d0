"""POST /v1/completions: text (or token-id) prompts, OpenAI's legacy completions API."""

from __future__ import annotations

from fastapi import APIRouter, Request

from .. import api
from .generation import generate

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request):
    return await generate(request, api.CompletionRequest, "completions", chat=False)
