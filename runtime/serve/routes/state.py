"""What every endpoint of one server shares: its settings, the router, the metrics, the tokenizer
and the sizes derived from the model, and the API key check."""

from __future__ import annotations

import concurrent.futures
import hmac
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request

from ...generate import eos_ids, load_tokenizer
from ...model.loader import model_config, sampling_defaults
from ..logprobs import TokenText
from ..metrics import Metrics
from ..protocol import ServeConfig, context_limits
from ..router import Router
from .errors import HTTPError


@dataclass(slots=True)
class ServerState:
    cfg: ServeConfig
    name: str  # the model id clients use
    max_len: int  # the admitted context in tokens: what the workers' KV pools really hold
    vocab_size: int
    tokenizer: object
    texts: TokenText
    metrics: Metrics
    router: Router
    tokenizing: concurrent.futures.ThreadPoolExecutor  # prompts never tokenise on the event loop
    max_chars: int | None  # characters beyond which a prompt certainly has more than max_len tokens
    expected_auth: bytes | None  # the Authorization header's bytes when an API key is set
    sampling: dict  # what a request leaves out of temperature, top_p, top_k, min_p, repetition_penalty

    @classmethod
    def from_config(cls, cfg: ServeConfig) -> ServerState:
        model_cfg = model_config(cfg.model)
        tokenizer = load_tokenizer(cfg.model)
        eos = sorted(eos_ids(model_cfg, tokenizer))  # the same ids `unweight generate` stops at
        max_len, _ = context_limits(cfg, model_cfg.max_position_embeddings)
        name = cfg.served_model_name or Path(cfg.model).resolve().name
        metrics = Metrics(name, max_len)
        router = Router(cfg, eos, metrics)
        metrics.watch(lambda: router.workers.values(), lambda: router.requests.values())
        return cls(
            cfg=cfg,
            name=name,
            max_len=max_len,
            vocab_size=model_cfg.vocab_size,
            tokenizer=tokenizer,
            texts=TokenText(tokenizer),
            metrics=metrics,
            router=router,
            tokenizing=concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="tokenize"),
            max_chars=_max_prompt_chars(tokenizer, max_len),
            expected_auth=f"Bearer {cfg.api_key}".encode() if cfg.api_key else None,
            sampling=sampling_defaults(cfg.model) if cfg.generation_config == "auto" else {},
        )

    def check_key(self, request: Request) -> None:
        if self.expected_auth is None:
            return
        got = request.headers.get("authorization", "").encode("latin-1")  # the header's own bytes
        if not hmac.compare_digest(got, self.expected_auth):
            raise HTTPError(401, "invalid API key", "authentication_error", code="invalid_api_key")

    def check_private(self, request: Request) -> None:
        """/health and /metrics: the API key unless --public-health."""
        if not self.cfg.public_health:
            self.check_key(request)


def state_of(request: Request) -> ServerState:
    return request.app.state.served


def _max_prompt_chars(tokenizer, max_len: int) -> int | None:
    """Characters beyond which a prompt certainly needs more than max_len tokens: max_len times the
    longest token. A token's text in the vocabulary has one character per byte (byte-level BPE) or
    per character, never fewer than it decodes to; a normalizer could drop characters, so with one
    there is no such bound (None)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    longest = max(len(t) for t in tokenizer.get_vocab())
    return max_len * max(1, longest)
