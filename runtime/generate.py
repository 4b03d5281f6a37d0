"""Text generation over a `CausalLM`: prompt encoding, the prefill/decode loop, streaming text.

    model = unweight.load("smollm2-uw")
    tok = unweight.load_tokenizer("smollm2-uw")
    for piece in unweight.stream(model, tok, [{"role": "user", "content": "Hi"}], max_new_tokens=32):
        print(piece, end="", flush=True)

`TextStream` turns tokens into text increasingly (holding back an incomplete UTF-8 character or
the start of a stop string) and is shared with the server, which runs its own batched loop.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .model.config import ModelConfig
from .model.llama import CausalLM
from .model.sampling import SamplingParams, Sequence
from .threads import governor


def load_tokenizer(path: str | os.PathLike):
    """The checkpoint's tokenizer (and chat template) through transformers' AutoTokenizer."""
    if not Path(path).is_dir():
        raise ValueError(f"{path}: no such model folder")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError("generation needs the tokenizer from transformers: pip install transformers") from None
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: no usable tokenizer ({str(e).splitlines()[0]})") from None


def encode_prompt(tokenizer, prompt: str | list[dict], chat: bool = False) -> list[int]:
    """Token ids of a plain prompt, or of chat messages (a list of {"role", "content"}, or a string
    with chat=True) rendered by the checkpoint's chat template with the assistant turn opened."""
    if isinstance(prompt, str) and not chat:
        return list(tokenizer(prompt)["input_ids"])
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise ValueError("messages must be a list of {'role': str, 'content': str}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this checkpoint's tokenizer has no chat template; pass a plain prompt")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def eos_ids(config: ModelConfig, tokenizer) -> set[int]:
    """The ids that end a generation: the model config's (with generation_config.json's, see
    loader.model_config) and the tokenizer's EOS."""
    ids = set(config.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class TextStream:
    """Incremental detokenisation with stop strings: `push(token)` returns the new text that is
    safe to show; `finished` turns true when a stop string appears (the text ends before it);
    `flush()` returns what was held back. `text` is always `tokenizer.decode(tokens)` (special
    tokens skipped), cut before the first stop string.

    Each push decodes only a window, as vLLM and TGI do (and tokenizers' DecodeStream): the
    tokens since the last two *clean* boundaries (`_prefix`, `_read`), where the text decoded so far
    ends on a whole character. The new text is decode(window) minus decode(tokens[_prefix:_read]);
    while it ends in U+FFFD (a character whose bytes have not all arrived) the boundary does not
    move. Text before a clean boundary never changes, so the window holds the last piece of text
    plus any unfinished character: a few tokens, whatever the length of the completion. Stop
    strings are searched only where a new one can appear (the unsettled tail and the
    len(stop) - 1 characters before it), and the start of one is held back until it is decided.
    As in vLLM, no stop string ends the text before `min_tokens` tokens are in (the first search
    after that looks at that same recent tail only).
    """

    def __init__(self, tokenizer, stop: list[str] = (), min_tokens: int = 0):
        self.tokenizer, self.stop, self.min_tokens = tokenizer, list(stop), min_tokens
        self.tokens: list[int] = []
        self.text = ""  # the final text so far (stop string excluded)
        self.sent = 0  # characters of text already returned
        self.finished = False
        self._settled = ""  # decode(tokens[:_read]): text that later tokens cannot change
        self._prefix = self._read = 0  # token offsets of the last two clean boundaries
        self._prefix_text = ""  # decode(tokens[_prefix:_read])
        self._longest_stop = max((len(s) for s in self.stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        if self.finished:
            return ""
        self.tokens.append(token)
        searched = len(self._settled)  # no stop string lies wholly before this (checked at the last push)
        window = self._decode(self.tokens[self._prefix :])
        tail = window[len(self._prefix_text) :]
        if len(window) > len(self._prefix_text) and not window.endswith("\ufffd"):  # a clean boundary
            self._settled += tail
            self._prefix, self._read = self._read, len(self.tokens)
            self._prefix_text = self._decode(self.tokens[self._prefix : self._read])
            tail = ""
        full = self._settled + tail if tail else self._settled
        cut = (
            self._find_stop(full, max(0, searched - self._longest_stop + 1))
            if len(self.tokens) > self.min_tokens
            else None
        )
        if cut is not None:
            full, self.finished = full[:cut], True
        self.text = full
        end = safe = min(len(self._settled), len(full))  # the unsettled tail is never shown early
        if not self.finished:
            for s in self.stop:  # what ends the settled text may begin a stop string: hold it back
                for k in range(min(len(s) - 1, end), 0, -1):
                    if full.endswith(s[:k], 0, end):
                        safe = min(safe, end - k)
                        break
        return self.flush(safe)

    def _find_stop(self, text: str, start: int) -> int | None:
        hits = [at for at in (text.find(s, start) for s in self.stop) if at >= 0]
        return min(hits) if hits else None

    def flush(self, upto: int | None = None) -> str:
        upto = len(self.text) if upto is None else upto
        out = self.text[self.sent : upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out


@dataclass(slots=True)
class GenerationResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    finish_reason: str = "length"  # "stop" (EOS or a stop string) or "length"
    time_to_first_token_s: float = 0.0
    total_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second of decoding."""
        n = len(self.token_ids) - 1
        t = self.total_s - self.time_to_first_token_s
        return n / t if n > 0 and t > 0 else 0.0


class Generation:
    """An iterator of text pieces; `result` holds the tokens, text and timings as it runs."""

    def __init__(
        self, model: CausalLM, tokenizer, prompt: str | list[dict], params: SamplingParams, chat: bool = False
    ):
        self.model, self.params = model, params
        self.prompt_ids = encode_prompt(tokenizer, prompt, chat)
        n, limit = len(self.prompt_ids), model.max_context
        if n == 0:
            raise ValueError("the prompt encodes to no tokens")
        if n + params.max_new_tokens > limit:
            raise ValueError(
                f"the prompt has {n} tokens; with max_new_tokens {params.max_new_tokens} that exceeds the context "
                f"length {limit}"
            )
        self.text = TextStream(tokenizer, params.stop, params.min_tokens)
        self.eos = eos_ids(model.config, tokenizer)
        self.result = GenerationResult(prompt_tokens=n)
        self._it = self._run()

    def __iter__(self) -> Iterator[str]:
        return self._it

    def __next__(self) -> str:
        return next(self._it)

    def _run(self) -> Iterator[str]:
        model, r = self.model, self.result
        state = Sequence(self.params, self.prompt_ids, self.eos)
        cores = governor() if model.device.type == "cpu" else None
        seq = model.new_sequence()
        t0 = time.perf_counter()
        try:
            logits = model.prefill(seq, torch.tensor(self.prompt_ids))
            while True:
                token = state.choose(logits).token
                if not state.output:
                    r.time_to_first_token_s = time.perf_counter() - t0
                reason = state.append(token)
                if reason == "stop":  # a stop token: not part of the text
                    r.finish_reason = "stop"
                    break
                r.token_ids.append(token)
                piece = self.text.push(token)
                r.text, r.total_s = self.text.text, time.perf_counter() - t0
                if piece:
                    yield piece
                if self.text.finished:
                    r.finish_reason = "stop"
                    break
                if reason == "length":
                    break
                if cores is not None:
                    cores.step()  # fewer threads while another process holds a core
                logits = model.decode_step([seq], torch.tensor([token]))[0]
            rest = self.text.flush()
            r.text, r.total_s = self.text.text, time.perf_counter() - t0
            if rest:
                yield rest
        finally:
            model.free(seq)


def stream(model: CausalLM, tokenizer, prompt: str | list[dict], *, chat: bool = False, **sampling) -> Generation:
    """Generate lazily: iterate for text pieces as they are made; `.result` has the totals."""
    return Generation(model, tokenizer, prompt, SamplingParams(**sampling), chat)


def generate(
    model: CausalLM, tokenizer, prompt: str | list[dict], *, chat: bool = False, **sampling
) -> GenerationResult:
    """Generate a whole completion. sampling: the fields of `SamplingParams` (max_new_tokens,
    temperature, top_p, top_k, min_p, seed, stop, penalties, logit_bias, min_tokens, ...).
    A list of messages (or chat=True) goes through the checkpoint's chat template."""
    g = stream(model, tokenizer, prompt, chat=chat, **sampling)
    for _ in g:
        pass
    return g.result
