"""The OpenAI-compatible surface: request schemas, response and stream-chunk bodies, error bodies.

Unknown fields are ignored (clients send many). `null` means "the default" for every optional
field. Known fields of the wrong type and values out of range are 400 errors naming the field,
in OpenAI's error body {"error": {"message", "type", "param", "code"}}; so are fields this server
does not implement (`UNSUPPORTED`), instead of being silently ignored.

Sampling fields beyond OpenAI's are vLLM's extensions, with vLLM's names and meanings: top_k,
min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from ..model.sampling import MAX_LOGPROBS, SamplingParams, Sequence

DEFAULT_MAX_TOKENS = 256
MAX_N = 64  # choices (n, best_of) per request; each one is a sequence of its own

# Fields that would change what a client gets and that this server does not implement, with the
# value that means "not used" (a request that sends that value, or null, is served).
UNSUPPORTED_COMMON = {
    "tools": [],
    "tool_choice": "none",
    "functions": [],
    "function_call": "none",
    "response_format": {"type": "text"},
    "parallel_tool_calls": False,
    "audio": None,
    "prediction": None,
    "web_search_options": None,
    "modalities": ["text"],
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "structured_outputs": None,
    "use_beam_search": False,
    "logits_processors": None,
    "prompt_logprobs": None,
    "truncate_prompt_tokens": None,
}
UNSUPPORTED = {
    "completions": {**UNSUPPORTED_COMMON, "suffix": ""},
    "chat": {**UNSUPPORTED_COMMON, "echo": False, "best_of": 1, "continue_final_message": False},
}


def unsupported(body: dict, endpoint: str) -> str | None:
    """The first field of a request body that asks for something this server does not do."""
    no_tools = not body.get("tools")
    for name, unused in UNSUPPORTED[endpoint].items():
        v = body.get(name)
        if v is None or v == unused:
            continue
        if no_tools and (name == "parallel_tool_calls" or (name == "tool_choice" and v == "auto")):
            continue  # about tools, and there are none
        return name
    return None


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=1000)
    logit_bias: dict[str, float] | None = None
    seed: StrictInt | None = Field(default=None, ge=-(2**63), lt=2**63)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    min_tokens: StrictInt | None = Field(default=None, ge=0)
    ignore_eos: StrictBool | None = None
    stream: StrictBool | None = None
    stream_options: dict | None = None
    n: StrictInt | None = Field(default=None, ge=1, le=MAX_N)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is None:
            return v
        out = {}
        for k, b in v.items():
            if not k.isdigit() or len(k) > 12:
                raise ValueError(f"logit_bias keys are token ids, not {k!r}")
            if not -100 <= b <= 100:
                raise ValueError(f"logit_bias values lie in [-100, 100], not {b}")
            out[int(k)] = b
        return out

    def limit(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def choices(self) -> int:
        """Sequences to run per prompt (best_of where it is larger than n)."""
        return max(self.n or 1, getattr(self, "best_of", None) or 1)

    def params(
        self, max_new_tokens: int, logprobs: int | None, choice: int = 0, defaults: dict | None = None
    ) -> SamplingParams:
        """The sampling settings of one choice, with defaults for what the request left out (raises
        ValueError): `defaults`' (the model's generation_config.json, loader.sampling_defaults), else
        OpenAI's (temperature 1, no truncation, no penalty). Choice i draws with seed + i."""
        given = dict(defaults or {}) | {
            k: getattr(self, k)
            for k in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
                "logit_bias",
                "stop_token_ids",
                "min_tokens",
                "ignore_eos",
            )
            if getattr(self, k) is not None
        }
        given["seed"] = Sequence.seed_for(self.seed, choice)
        if given.get("top_k") == -1:
            given["top_k"] = 0
        if given.get("min_tokens", 0) > max_new_tokens:
            raise ValueError(f"min_tokens {given['min_tokens']} is more than max_tokens {max_new_tokens}")
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=given.get("temperature", 1.0),
            stop=self.stop or [],
            logprobs=logprobs,
            **{k: v for k, v in given.items() if k != "temperature"},
        )


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: StrictBool | None = None
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: StrictInt | None = Field(default=None, ge=1, le=MAX_N)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("the prompt list is empty")
        if isinstance(v, list) and isinstance(v[0], list) and any(not p for p in v):
            raise ValueError("a prompt of token ids is empty")
        return v

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None and self.best_of < (self.n or 1):
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.best_of is not None and self.best_of > (self.n or 1) and self.stream:
            raise ValueError("best_of larger than n cannot be streamed")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: text, or token ids."""
        v = self.prompt
        if isinstance(v, str):
            return [v]
        if isinstance(v[0], int):
            return [v]
        return list(v)

    def token_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[dict] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: StrictStr | None = None

    @field_validator("content")
    @classmethod
    def _parts(cls, v):
        """Content parts: text ones are joined with newlines (as vLLM does); other kinds are refused."""
        if not isinstance(v, list):
            return v
        texts = []
        for i, part in enumerate(v):
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"content part {i} has type {kind!r}; only 'text' parts are supported")
            texts.append(TextPart.model_validate(part).text)
        return "\n".join(texts)

    @model_validator(mode="after")
    def _needs_content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def template_dict(self) -> dict:
        """The message as chat templates take it (content "" when an assistant turn only called tools)."""
        d = {"role": self.role, "content": self.content or ""}
        for k in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)  # the chat API's newer name for max_tokens
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def token_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# -- bodies ------------------------------------------------------------------------------------
def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_body(rid: str, model: str, choices: list[dict], prompt: int, completion: int) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(prompt, completion),
    }


def completion_choice(index: int, text: str, finish: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def completion_chunk(
    rid: str, model: str, index: int, text: str, finish: str | None, logprobs: dict | None = None
) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [completion_choice(index, text, finish, logprobs)],
    }


def chat_body(rid: str, model: str, choices: list[dict], prompt: int, completion: int) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(prompt, completion),
    }


def chat_choice(index: int, text: str, finish: str | None, logprobs: list[dict] | None) -> dict:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "finish_reason": finish,
        "logprobs": None if logprobs is None else {"content": logprobs},
    }


def chat_chunk(
    rid: str, model: str, index: int, delta: dict, finish: str | None, logprobs: list[dict] | None = None
) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "finish_reason": finish,
                "logprobs": None if logprobs is None else {"content": logprobs},
            }
        ],
    }


def usage_chunk(rid: str, model: str, obj: str, prompt: int, completion: int) -> dict:
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage(prompt, completion),
    }
