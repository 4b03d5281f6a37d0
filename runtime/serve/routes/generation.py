"""What a completion or chat request goes through: checked, its prompts tokenised, each choice
submitted to the router, then either streamed (stream.py) or collected into one response. A choice
whose request ends early (an error, the client gone) is cancelled, freeing its slot and KV cache."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ...generate import TextStream
from .. import api
from ..router import Overloaded, Unavailable
from .choice import Choice
from .errors import ClientGone, HTTPError, fail
from .prompts import budget, encode, parse
from .state import ServerState, state_of
from .stream import sse


async def generate(request: Request, schema, endpoint: str, chat: bool):
    """The response to a completion (`chat` False) or chat request whose body is `schema`."""
    s = state_of(request)
    choices: list[Choice] = []
    try:
        s.check_key(request)
        req = await parse(s, request, schema, endpoint)
        prompts = await encode(s, req, chat)
        rid = await _submit(s, req, prompts, chat, choices)
    except HTTPError as e:
        for c in choices:
            await s.router.cancel(c.r)
        return fail(e, endpoint)
    n_prompt = sum(len(ids) for ids in prompts)
    if req.stream:
        return StreamingResponse(sse(s, choices, req, rid, chat, n_prompt), media_type="text/event-stream")
    try:
        await _unless_disconnected(request, asyncio.gather(*(c.collect() for c in choices)))
    except HTTPError as e:
        return fail(e, endpoint)
    finally:
        for c in choices:
            if not c.r.done:
                await s.router.cancel(c.r, "stop" if c.text.finished else "abort")
    return JSONResponse(_body(s, req, choices, len(prompts), rid, chat, n_prompt))


async def _submit(s: ServerState, req, prompts: list[list[int]], chat: bool, choices: list[Choice]) -> str:
    """Submit every choice of every prompt to the router, appending each to `choices` as it goes
    (so that the caller can cancel them should a later one be refused); returns the request's id."""
    param = "messages" if chat else "prompt"
    limits = [budget(s, req, ids, param) for ids in prompts]
    per_prompt, n = req.choices(), req.n or 1
    top = req.token_logprobs()
    echo = not chat and bool(req.echo)
    router = s.router
    if len(prompts) * per_prompt > router.room():
        raise HTTPError(
            429,
            f"server busy: {len(prompts) * per_prompt} sequences asked, room for {max(router.room(), 0)}",
            "rate_limit_error",
            code="overloaded",
        )
    rid = api.new_id("chatcmpl" if chat else "cmpl")
    try:
        for pi, ids in enumerate(prompts):
            given = req.prompts()[pi] if echo else None
            prefix = "" if not echo else given if isinstance(given, str) else s.tokenizer.decode(ids)
            for j in range(per_prompt):
                try:
                    # best_of ranks by the chosen tokens' logprobs: ask for them even if the client did not
                    params = req.params(
                        limits[pi], top if per_prompt == n else (top or 0), choice=j, defaults=s.sampling
                    )
                    params.check_vocab(s.vocab_size)
                except ValueError as e:
                    raise HTTPError(400, str(e)) from None
                r = await router.submit(
                    f"{rid}-{pi}-{j}", ids, params, prompt_logprobs=top if echo and top is not None else None
                )
                text = TextStream(s.tokenizer, req.stop or [], params.min_tokens)
                choices.append(Choice(pi * n + j, r, text, ids, prefix, top))
    except Overloaded as e:
        raise HTTPError(429, f"server busy: {e}", "rate_limit_error", code="overloaded") from None
    except Unavailable as e:
        raise HTTPError(503, f"server not ready: {e}", "server_error", code="unavailable") from None
    return rid


def _body(s: ServerState, req, choices: list[Choice], prompts: int, rid: str, chat: bool, n_prompt: int) -> dict:
    """The whole response of collected choices; with best_of, the n most likely of each prompt's candidates."""
    completion = sum(len(c.text.tokens) for c in choices)
    per_prompt, n = req.choices(), req.n or 1
    if per_prompt > n:
        kept = []
        for pi in range(prompts):
            ranked = sorted(choices[pi * per_prompt : (pi + 1) * per_prompt], key=lambda c: -c.cumulative)
            for j, c in enumerate(ranked[:n]):
                c.index = pi * n + j
                kept.append(c)
        choices = kept
    if chat:
        made = [api.chat_choice(c.index, c.text.text, c.finish, c.chat_logprobs(s.texts)) for c in choices]
        return api.chat_body(rid, s.name, made, n_prompt, completion)
    made = [
        api.completion_choice(c.index, c.prefix + c.text.text, c.finish, c.completion_logprobs(s.texts))
        for c in choices
    ]
    return api.completion_body(rid, s.name, made, n_prompt, completion)


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
            job.add_done_callback(_retrieved)  # else asyncio logs the gather's CancelledError with a traceback
    if job.done() and not job.cancelled():
        return job.result()
    raise ClientGone()


def _retrieved(future: asyncio.Future) -> None:
    """Take a cancelled gather's outcome: cancelling a gather cancels its children, and it then ends
    with their CancelledError as its exception, which asyncio logs, traceback and all, unless
    someone asked for it: a traceback per client that hangs up, for any client to flood the log with."""
    if not future.cancelled():
        future.exception()
