"""One sequence of a response (a prompt's n-th choice, or a best_of candidate): its events from the
router, its text so far, its logprobs, and what of them a stream has sent."""

from __future__ import annotations

from ...generate import TextStream
from ..logprobs import TokenText
from .errors import HTTPError


class Choice:
    """One sequence of a response: its events from the router, its text, its logprobs. A request
    has one per prompt and per n (or per best_of candidate)."""

    def __init__(self, index: int, r, text: TextStream, prompt: list[int], prefix: str, top: int | None):
        self.index, self.r, self.text, self.prompt, self.prefix, self.top = index, r, text, prompt, prefix, top
        self.finish: str | None = None
        self.entries: list[tuple[int, float, list]] = []  # (token, logprob, alternatives) of each generated token
        self.prompt_logprobs: list | None = None  # [[logprob, alternatives], ...] of prompt tokens 1.. (echo)
        self.cumulative = 0.0  # the chosen tokens' logprobs added up (best_of ranks by it)
        self.unsent = ""  # streaming: text not yet in a chunk
        self.sent = 0  # streaming: entries already in a chunk
        self.head_sent = False  # streaming: the echoed prompt is out
        self.offset = 0  # streaming: text_offset of the next token

    def push(self, token: int | None, logprobs: list | None, finish: str | None) -> str | None:
        """Take one token event; returns the finish reason once the choice is over."""
        if token is not None and not self.text.finished:
            self.unsent += self.text.push(token)
            if logprobs is not None:
                self.entries.append((token, logprobs[0], logprobs[1]))
                self.cumulative += logprobs[0]
        if self.text.finished:  # a stop string
            finish = "stop"
        if finish is not None:
            self.finish = finish
            self.unsent += self.text.flush()
        return finish

    async def collect(self) -> None:
        """Run to the end (non-streaming)."""
        while True:
            kind, value, finish, logprobs = await self.r.events.get()
            if kind == "error":  # finish holds its code
                raise HTTPError(503, value, "server_error", code=finish)
            if kind == "prompt":
                self.prompt_logprobs = value
            elif self.push(value, logprobs, finish) is not None:
                return

    def take_text(self) -> str:
        """Streaming: the text for the next chunk, the echoed prompt first."""
        out, self.unsent = self.unsent, ""
        if self.prefix and not self.head_sent:
            out = self.prefix + out
        return out

    @property
    def pending(self) -> bool:
        return self.top is not None and self.sent < len(self.entries)

    def _entries(self, streaming: bool) -> list:
        if not streaming:
            return self.entries
        out, self.sent = self.entries[self.sent :], len(self.entries)
        return out

    def _prompt_entries(self) -> list:
        lps = self.prompt_logprobs or []
        return [(self.prompt[0], None, None)] + [(t, lp, alts) for t, (lp, alts) in zip(self.prompt[1:], lps)]

    def completion_logprobs(self, texts: TokenText, streaming: bool = False) -> dict | None:
        """The choice's logprobs (streaming: those not sent yet), the echoed prompt's first."""
        if self.top is None:
            return None
        head = self._prompt_entries() if self.prefix and not (streaming and self.head_sent) else []
        offset = self.offset if streaming else 0
        out = texts.completion(head + self._entries(streaming), offset)
        if streaming:
            self.head_sent = True
            self.offset = offset + sum(len(t) for t in out["tokens"])
        return out

    def chat_logprobs(self, texts: TokenText, streaming: bool = False) -> list[dict] | None:
        return None if self.top is None else texts.chat(self._entries(streaming))
