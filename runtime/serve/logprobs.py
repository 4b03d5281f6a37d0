"""Log-probabilities in OpenAI's two response shapes, from the token ids and numbers the workers send.

A token's text is its own bytes: byte-level BPE vocabularies (GPT-2's, Llama 3's, SmolLM2's) map
each byte to a printable character, and that mapping is undone, so `bytes` is exact even for a
token that holds half of a multi-byte character (its `token` string then shows U+FFFD for the
missing half). Other vocabularies decode the one token alone.
"""

from __future__ import annotations

from functools import lru_cache


def _byte_level_chars() -> dict[str, int]:
    """The character that byte-level BPE uses for each byte: printable Latin-1 bytes stand for
    themselves, the others (controls, space, 0x7f-0xa0, 0xad) are moved to 256, 257, ... in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenText:
    """Token id -> (text, bytes) for one tokenizer, cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = backend is not None and type(backend.decoder).__name__ == "ByteLevel"
        self._chars = _byte_level_chars() if self.byte_level else {}
        self.piece = lru_cache(maxsize=1 << 16)(self._piece)

    def _piece(self, token: int) -> tuple[str, bytes]:
        if self.byte_level:
            s = self.tokenizer.convert_ids_to_tokens(token)
            if isinstance(s, str) and s and all(c in self._chars for c in s):
                raw = bytes(self._chars[c] for c in s)
                return raw.decode("utf-8", errors="replace"), raw
        text = self.tokenizer.decode([token], skip_special_tokens=False)
        return text, text.encode()

    # -- /v1/completions ---------------------------------------------------------------------
    def completion(self, entries: list[tuple[int, float | None, list | None]], offset: int = 0) -> dict:
        """{"tokens", "token_logprobs", "top_logprobs", "text_offset"} for (token id, logprob,
        alternatives) entries; as vLLM does, each top_logprobs dict also holds the chosen token, and
        a token without a logprob (the first of an echoed prompt) has null for both."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp, top in entries:
            text = self.piece(token)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            if lp is None:
                out["top_logprobs"].append(None)
            else:
                alts = {self.piece(t)[0]: v for t, v in top or []}
                alts.setdefault(text, lp)
                out["top_logprobs"].append(alts)
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    # -- /v1/chat/completions ----------------------------------------------------------------
    def chat(self, entries: list[tuple[int, float, list]]) -> list[dict]:
        """choices[].logprobs.content entries: {"token", "logprob", "bytes", "top_logprobs"}."""

        def one(token: int, lp: float) -> dict:
            text, raw = self.piece(token)
            return {"token": text, "logprob": lp, "bytes": list(raw)}

        return [{**one(token, lp), "top_logprobs": [one(t, v) for t, v in top or []]} for token, lp, top in entries]
