"""The OpenAI-compatible surface: request schemas, response and stream-chunk bodies, error bodies.

Unknown fields are ignored (clients send many); known fields of the wrong type, `n` other than 1,
and values out of range are 400 errors with OpenAI's error body
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

DEFAULT_MAX_TOKENS = 256


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: StrictInt | None = Field(default=None)
    max_completion_tokens: StrictInt | None = None  # the chat API's newer name for max_tokens
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: StrictInt = Field(default=0, ge=0)
    seed: StrictInt | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: dict | None = None
    n: StrictInt = 1

    @field_validator("n")
    @classmethod
    def _one(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError("must be a positive integer")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Sampling):
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("exactly one prompt is supported")
            return v[0]
        return v


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_body(rid: str, model: str, text: str, finish: str | None, prompt: int, completion: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}], "usage": usage(prompt, completion)}


def completion_chunk(rid: str, model: str, text: str, finish: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}


def chat_body(rid: str, model: str, text: str, finish: str | None, prompt: int, completion: int) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "logprobs": None}],
            "usage": usage(prompt, completion)}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}


def usage_chunk(rid: str, model: str, obj: str, prompt: int, completion: int) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": usage(prompt, completion)}
