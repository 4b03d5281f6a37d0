"""A streamed response (`stream: true`): server-sent events, one chunk per piece of text as the
router's token events come in from every choice, then the usage chunk if asked, then [DONE]. A
stream that ends early (an error, the client gone) cancels what is still running."""

from __future__ import annotations

import asyncio
import json

from .. import api
from .choice import Choice
from .state import ServerState


async def sse(s: ServerState, choices: list[Choice], req, rid: str, chat: bool, n_prompt: int):
    """The stream's events, as text."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    if len(choices) == 1:  # one choice: its own queue, with no task and second queue between
        events, pumps = _Tagged(choices[0]), []
    else:  # several: each choice's events, as they come, into one queue
        events = asyncio.Queue()

        async def pump(c: Choice):
            while True:
                ev = await c.r.events.get()
                await events.put((c, ev))
                if ev[0] == "error" or (ev[0] == "token" and ev[2] is not None):
                    return

        pumps = [asyncio.create_task(pump(c)) for c in choices]
    try:
        if chat:
            for c in choices:
                yield _data(api.chat_chunk(rid, s.name, c.index, {"role": "assistant", "content": ""}, None))
        open_ = len(choices)
        while open_:
            c, ev = await events.get()
            if ev[0] == "error":
                yield _data(api.error_body(ev[1], "server_error", code=ev[2]))
                break
            if ev[0] == "prompt":
                c.prompt_logprobs = ev[1]
                continue
            finish = c.push(ev[1], ev[3], ev[2])
            piece = c.take_text()  # with echo, the prompt comes first (and its logprobs)
            if piece or (finish is not None and c.pending):
                yield _chunk(s, c, rid, chat, piece, None)
            if finish is not None:
                yield _chunk(s, c, rid, chat, "", finish)
                open_ -= 1
        else:
            if req.include_usage:
                yield _data(api.usage_chunk(rid, s.name, obj, n_prompt, sum(len(c.text.tokens) for c in choices)))
        yield "data: [DONE]\n\n"
    finally:  # also when the client went away mid-stream: free its slots and KV caches
        for t in pumps:
            t.cancel()
        for c in choices:
            if not c.r.done:
                await s.router.cancel(c.r, "stop" if c.text.finished else "abort")


class _Tagged:
    """One choice's own event queue, read as the merged queue of several is: (choice, event)."""

    def __init__(self, c: Choice):
        self.c = c

    async def get(self) -> tuple[Choice, tuple]:
        return self.c, await self.c.r.events.get()


def _data(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _chunk(s: ServerState, c: Choice, rid: str, chat: bool, piece: str, finish: str | None) -> str:
    """A choice's next chunk: its text and the logprobs not sent yet, or (finish set) its last one."""
    if finish is not None:  # the last chunk: its logprobs went out with the text before it
        body = (
            api.chat_chunk(rid, s.name, c.index, {}, finish)
            if chat
            else api.completion_chunk(rid, s.name, c.index, "", finish)
        )
        return _data(body)
    if chat:
        lp = c.chat_logprobs(s.texts, streaming=True)
        return _data(api.chat_chunk(rid, s.name, c.index, {"content": piece}, None, lp))
    lp = c.completion_logprobs(s.texts, streaming=True)
    c.head_sent = True
    return _data(api.completion_chunk(rid, s.name, c.index, piece, None, lp))
