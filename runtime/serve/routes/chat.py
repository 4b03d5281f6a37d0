"""POST /v1/chat/completions: messages through the model's chat template, OpenAI's chat API."""

from __future__ import annotations

from fastapi import APIRouter, Request

from .. import api
from .generation import generate

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await generate(request, api.ChatRequest, "chat", chat=True)
