"""A completion or chat request's body and prompts, checked: the JSON parsed and validated against
its schema, the model named, each prompt tokenised (off the event loop) and its token budget within
the context. Every refusal is an HTTPError naming the parameter."""

from __future__ import annotations

import asyncio

from fastapi import Request
from pydantic import ValidationError

from ...generate import encode_prompt
from .. import api
from ..http import json_object
from .errors import HTTPError, model_not_found
from .state import ServerState


async def parse(s: ServerState, request: Request, schema, endpoint: str):
    """The request body as `schema` (api.CompletionRequest or api.ChatRequest), for this server's model."""
    body = await json_object(request)
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
    if req.model != s.name:
        raise model_not_found(req.model, s.name)
    return req


def budget(s: ServerState, req, prompt_ids: list[int], param: str) -> int:
    """The tokens a prompt may generate: max_tokens, or what the context leaves (at most the default)."""
    n, max_len = len(prompt_ids), s.max_len
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


async def encode(s: ServerState, req, chat: bool) -> list[list[int]]:
    """Token ids of each prompt: chat messages through the chat template, text through the
    tokenizer (on a thread; a prompt with more characters than max_len tokens can cover is
    refused before the tokenizer sees it), token-id prompts checked against the vocabulary."""
    param = "messages" if chat else "prompt"
    prompts = [[m.template_dict() for m in req.messages]] if chat else req.prompts()
    out = []
    for p in prompts:
        if isinstance(p, list) and p and isinstance(p[0], int):
            bad = [t for t in p if not 0 <= t < s.vocab_size]
            if bad:
                raise HTTPError(
                    400,
                    f"prompt: token id {bad[0]} is outside the vocabulary (0..{s.vocab_size - 1})",
                    param="prompt",
                )
            out.append(list(p))
            continue
        if s.max_chars is not None and _chars(p) > s.max_chars:
            raise HTTPError(
                400,
                f"the prompt has more than {s.max_chars} characters, more than {s.max_len} tokens of context can hold",
                param=param,
                code="context_length_exceeded",
            )
        try:
            out.append(await asyncio.get_running_loop().run_in_executor(s.tokenizing, encode_prompt, s.tokenizer, p))
        except ValueError as e:
            raise HTTPError(400, str(e), param=param) from None
    return out


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
