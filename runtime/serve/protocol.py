"""What the router and the workers say to each other, and the settings they share.

Control messages are small JSON objects over ZeroMQ: the router binds a ROUTER socket, every
worker connects a DEALER whose identity is its name (`prefill-0`, `decode-1`, `worker-0`).
Tensors never travel this way: a KV cache goes from a prefill worker to a decode worker over
torch.distributed (runtime/serve/kv_link.py), whose rendezvous keys do (`NAME#kv`: the router
holds them, for the groups the asking worker is in).

Every control connection is ZeroMQ CURVE (encrypted, and authenticated both ways): the router's
key pair and the one key pair all workers share are derived from one per-server secret
(`curve_keys`), the router admits only the workers' public key (a ZAP allow-list) and a worker
accepts only a server holding the router's secret key. Every message is then checked against its
typed model below (`ToWorker`, `ToRouter`: strict types, bounded sizes) before anything reads it.

A sequence's generation state (`seq`: settings, prompt, tokens made, EOS ids, random state) is
`runtime.sampling.Sequence.state()`; the receiving worker rebuilds and checks it with
`Sequence.from_state`. A token's `logprobs` is [logprob, [[id, logprob], ...]] or null.

Router -> worker
    prefill   {id, tag, seq, prompt_logprobs, decode: name, decode_incarnation}   (disaggregated)
    generate  {id, seq, prompt_logprobs}                                          (aggregated worker)
    expect    {id, tag, tokens, prefill: name, prefill_incarnation, discard}   (the prefill worker
              started the prompt: the decode worker posts its receive, and each layer's KV lands as
              it is made; discard: the request is gone, receive the KV and drop it)
    decode    {id, seq}   (after the first token: the sequence joins the batch once its KV is there)
    cancel    {id}
    announce  {}        (a heartbeat came from a worker the router does not know: say hello again)
    shutdown  {}
Worker -> router
    hello     {role, pid, incarnation}   (on the main socket: a worker is used only once it said it)
    beat      {running, queued, kv_blocks_used, kv_blocks_total}  (every HEARTBEAT_S)
    prompt_logprobs {id, items: [[logprob, [[id, logprob], ...]], ...]}  (one per prompt token after
              the first; sent before the first token when prompt_logprobs is not null)
    prefilling {id, tag, tokens}  (a prompt starts: its KV streams to the decode worker from now)
    prefilled {id, tag, first_token, logprobs, seq, kv_bytes, decode}  (the KV is on its way, or there)
    tokens    {items: [[id, token, finish_reason or null, logprobs], ...]}  (one message per step;
              token is null when a stop token ended the sequence)
    failed    {id, error, code}  (code: what clients see, "worker_failed" or "kv_transfer_failed")
    transferred {peer, raw_bytes, wire_bytes, seconds, codec_seconds, compressed, sealed}  (a KV hand-off
              done, from each end: for the metrics)
Worker -> router on NAME#kv, each answered by kv_reply {n, value or null, error or null}
    kv_set    {n, key, value}   (value: base64; key: kv/PREFILL_INCARNATION/DECODE_INCARNATION/...)
    kv_get    {n, key}          (value null: not set yet)
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

ROLES = ("router", "prefill", "decode", "worker")  # "worker": one aggregated process (--no-disagg)
HEARTBEAT_S = 0.5
DEAD_AFTER_S = 10.0  # default --worker-timeout: a worker silent this long is unresponsive and its requests fail
KV_TIMEOUT_S = 20.0  # a KV hand-off that takes longer fails its request instead of hanging
KV_BLOCK_TOKENS = 16  # tokens per KV cache block (the pool is sized in whole blocks)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")
MAX_MESSAGE_BYTES = 64 << 20  # ZeroMQ drops the connection of a peer that sends a bigger message
SECRET_ENV = "UNWEIGHT_CONTROL_SECRET"  # how the router hands its secret to the workers it starts


def pack(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


# -- typed messages ---------------------------------------------------------------------------
# Every field a peer sends is checked here, strictly (no "1" for 1, no extra fields, bounded
# lengths), before the router or a worker looks at it: a bad message is dropped whole.
Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:@-]+$")]
Rid = Annotated[str, Field(min_length=1, max_length=128)]
Incarnation = Annotated[str, Field(min_length=1, max_length=64)]
Count = Annotated[int, Field(ge=0, le=1 << 31)]
Total = Annotated[int, Field(ge=0, le=1 << 62)]  # a counter over the worker's life
Tag = Annotated[int, Field(ge=1, lt=1 << 31)]  # 0 is kv_link.PROOF_TAG
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]
Tokens = Annotated[list[TokenId], Field(min_length=1, max_length=1 << 21)]
Finish = Literal["stop", "length"] | None
ErrorText = Annotated[str, Field(max_length=1 << 13)]


class _Msg(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


Logprob = Annotated[float, Field(allow_inf_nan=False)]
Alternatives = Annotated[list[tuple[TokenId, Logprob]], Field(max_length=20)]
TokenLogprobs = tuple[Logprob, Alternatives] | None  # a token's logprob and the best alternatives


class SeqState(_Msg):
    """A sequence's generation state (runtime.sampling.Sequence.state()). `sampling` is checked by
    the worker's own SamplingParams.from_json, within the message size."""

    sampling: dict
    prompt: Tokens
    output: Annotated[list[TokenId], Field(max_length=1 << 24)]
    eos: Annotated[list[TokenId], Field(max_length=1024)]
    rng: Annotated[list[Annotated[int, Field(ge=0, le=255)]], Field(max_length=1 << 14)] | None


PromptLogprobsTop = Annotated[int, Field(ge=0, le=20)] | None


class Prefill(_Msg):
    op: Literal["prefill"]
    id: Rid
    tag: Tag
    seq: SeqState
    prompt_logprobs: PromptLogprobsTop
    decode: Name
    decode_incarnation: Incarnation | None


class Generate(_Msg):
    op: Literal["generate"]
    id: Rid
    seq: SeqState
    prompt_logprobs: PromptLogprobsTop


class Expect(_Msg):
    op: Literal["expect"]
    id: Rid
    tag: Tag
    tokens: Annotated[int, Field(ge=1, le=1 << 21)]
    prefill: Name
    prefill_incarnation: Incarnation | None
    discard: bool


class Decode(_Msg):
    op: Literal["decode"]
    id: Rid
    seq: SeqState

    @model_validator(mode="after")
    def _complete(self):
        if not self.seq.output:
            raise ValueError("a decode job needs the sequence with its first token")
        return self


class Cancel(_Msg):
    op: Literal["cancel"]
    id: Rid


class Shutdown(_Msg):
    op: Literal["shutdown"]


class Announce(_Msg):
    op: Literal["announce"]


class Hello(_Msg):
    op: Literal["hello"]
    role: Literal["prefill", "decode", "worker"]
    pid: Annotated[int, Field(ge=1, le=1 << 31)]
    incarnation: Incarnation


class Beat(_Msg):
    op: Literal["beat"]
    running: Count
    queued: Count
    kv_blocks_used: Count
    kv_blocks_total: Count
    prompt_tokens: Total = 0  # prompt tokens the worker prefilled or copied from a SharedPrompt, since it started
    prompt_tokens_reused: Total = 0  # those it copied


class Prefilling(_Msg):
    op: Literal["prefilling"]
    id: Rid
    tag: Tag
    tokens: Annotated[int, Field(ge=1, le=1 << 21)]


class Prefilled(_Msg):
    op: Literal["prefilled"]
    id: Rid
    tag: Tag
    first_token: TokenId
    logprobs: TokenLogprobs
    seq: SeqState
    kv_bytes: Annotated[int, Field(ge=0, le=1 << 50)]
    decode: Name


class TokensMsg(_Msg):
    op: Literal["tokens"]
    items: Annotated[list[tuple[Rid, TokenId | None, Finish, TokenLogprobs]], Field(min_length=1, max_length=1 << 16)]


class PromptLogprobs(_Msg):
    op: Literal["prompt_logprobs"]
    id: Rid
    items: Annotated[list[tuple[Logprob, Alternatives]], Field(max_length=1 << 21)]


ErrorCode = Literal["worker_failed", "kv_transfer_failed"]  # the OpenAI error body's `code` a failure gives clients


class Failed(_Msg):
    op: Literal["failed"]
    id: Rid
    error: ErrorText
    code: ErrorCode = "worker_failed"


Seconds = Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False)]


class Transferred(_Msg):
    op: Literal["transferred"]
    peer: Name
    raw_bytes: Annotated[int, Field(ge=0, le=1 << 50)]
    wire_bytes: Annotated[int, Field(ge=0, le=1 << 50)]
    seconds: Seconds
    codec_seconds: Seconds
    compressed: bool
    sealed: bool


KVKey = Annotated[str, Field(min_length=1, max_length=256)]
KV_VALUE_BYTES = 4096  # a gloo device address is about 170 bytes
KVValue = Annotated[str, Field(max_length=4 * KV_VALUE_BYTES // 3 + 4, pattern=r"^[A-Za-z0-9+/]*={0,2}$")]  # base64


class KVSet(_Msg):
    op: Literal["kv_set"]
    n: Count
    key: KVKey
    value: KVValue


class KVGet(_Msg):
    op: Literal["kv_get"]
    n: Count
    key: KVKey


class KVReply(_Msg):
    op: Literal["kv_reply"]
    n: Count
    value: KVValue | None = None
    error: ErrorText | None = None


ToWorker = TypeAdapter(
    Annotated[Prefill | Generate | Expect | Decode | Cancel | Shutdown | Announce, Field(discriminator="op")]
)
ToRouter = TypeAdapter(
    Annotated[
        Hello | Beat | PromptLogprobs | Prefilling | Prefilled | TokensMsg | Failed | Transferred | KVSet | KVGet,
        Field(discriminator="op"),
    ]
)
ToKVClient = TypeAdapter(KVReply)


class BadMessage(ValueError):
    """A control message that does not match its op's model; `rid` is its request id if it had one."""

    def __init__(self, text: str, rid: str | None):
        super().__init__(text)
        self.rid = rid


def unpack(data: bytes, schema: TypeAdapter) -> dict:
    """The message as a dict, every field checked against its op's model; else BadMessage (one line)."""
    return parse(data, schema).model_dump()


def parse(data: bytes, schema: TypeAdapter) -> BaseModel:
    """The message as its op's typed model (Hello, Beat, ...), every field checked; else BadMessage (one line)."""
    try:
        return schema.validate_json(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"])
        rid = None
        try:
            raw = json.loads(data)
            rid = raw.get("id") if isinstance(raw, dict) and isinstance(raw.get("id"), str) else None
        except ValueError:
            pass
        raise BadMessage(
            f"{where + ': ' if where else ''}{err['msg']} ({e.error_count()} error(s), {len(data)} bytes)", rid
        ) from None


class RateLimitedLog:
    """Warnings about hostile or broken peers: at most one per kind (format string) every `every`
    seconds, the rest counted, so a flood of junk cannot flood the log."""

    def __init__(self, logger: logging.Logger, every: float = 5.0):
        self.logger, self.every = logger, every
        self.kinds: dict[str, list] = {}  # format -> [last logged, suppressed since]; the formats are the code's own

    def warning(self, fmt: str, *args) -> None:
        now = time.monotonic()
        kind = self.kinds.setdefault(fmt, [-float("inf"), 0])
        if now - kind[0] < self.every:
            kind[1] += 1
            return
        if kind[1]:
            fmt += f" ({kind[1]} similar in the last {now - kind[0]:.0f} s not shown)"
        kind[0], kind[1] = now, 0
        self.logger.warning(fmt, *args)


# -- the control secret -----------------------------------------------------------------------
def curve_keys(secret: str) -> dict[str, tuple[bytes, bytes]]:
    """{"router": (public, secret), "worker": (public, secret)} Z85 CURVE keys derived from the secret."""
    import zmq
    from zmq.utils import z85

    keys = {}
    for who in ("router", "worker"):
        sk = z85.encode(
            hmac.new(secret.encode(), f"unweight serve control: {who} key".encode(), hashlib.sha256).digest()
        )
        keys[who] = (zmq.curve_public(sk), sk)
    return keys


def context_limits(cfg: ServeConfig, model_context: int) -> tuple[int, int]:
    """The one place the sizes come from: (admitted context in tokens, KV pool tokens of a decode
    or aggregated worker). The pool holds --kv-cache-tokens (default: --max-batch sequences of the
    full context), rounded up to whole blocks; the admitted context is never more than the model's
    context, --max-model-len, or the pool, so one admitted sequence always fits."""
    max_len = min(cfg.max_model_len or model_context, model_context)
    pool = cfg.kv_cache_tokens or max_len * cfg.max_batch
    pool = -(-pool // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    return min(max_len, pool), pool


def parse_address(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {text!r} is not HOST:PORT")
    return host, int(port)


@dataclass(slots=True, kw_only=True)
class ServeConfig:
    """The server's settings, one per CLI flag of `unweight serve` (built by keywords only)."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_workers: int = 1
    decode_workers: int = 1
    max_batch: int = 16
    max_model_len: int | None = None  # default: the model's context length
    max_queue: int = 64  # requests admitted but not finished, beyond which new ones get 429
    device: str = "cpu"
    api_key: str | None = None
    disaggregated: bool = True
    control_port: int = 0  # 0: pick a free port (all roles on one host)
    served_model_name: str | None = None
    worker_threads: int = 0  # CPU threads per worker; 0: the machine's cores split among the local workers
    public_health: bool = False  # /health and /metrics answer without the API key
    max_body_bytes: int = 16 << 20  # larger request bodies get 413, before they are read
    timeout_keep_alive: float = 5.0  # an idle connection (before or between requests) is closed after this
    timeout_header: float = 10.0  # a request's head must arrive within this (from connect or the last response)
    timeout_body: float = 30.0  # and its body within this after the head
    limit_concurrency: int = 512  # open connections beyond which requests get 503
    control_secret_file: str | None = None  # None: the router makes a secret for the workers it starts
    worker_timeout: float = DEAD_AFTER_S  # seconds of silence after which a worker's requests fail
    kv_cache_tokens: int | None = None  # KV pool of a decode/aggregated worker; None: max_batch full contexts
    dtype: str = "auto"  # the compute dtype (vLLM's --dtype): auto (loader.auto_dtype), bfloat16, float32
    kv_cache_dtype: str = "auto"  # the KV cache's dtype (vLLM's name); auto: the compute dtype
    kv_compression: str = "auto"  # code the KV hand-off: auto (off loopback, link slower than codec), on, off
    kv_encryption: str = "auto"  # seal the KV hand-off: auto (off loopback), on, off
    generation_config: str = "auto"  # sampling defaults: auto (the model's generation_config.json), vllm (none)

    def __post_init__(self) -> None:
        for name, choices in (
            ("dtype", KV_CACHE_DTYPES),
            ("kv_cache_dtype", KV_CACHE_DTYPES),
            ("kv_compression", ("auto", "on", "off")),
            ("kv_encryption", ("auto", "on", "off")),
            ("generation_config", ("auto", "vllm")),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name.replace('_', '-')} {getattr(self, name)!r} is not one of {', '.join(choices)}")
        for name in ("prefill_workers", "decode_workers"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name.replace('_', '-')} must be an integer >= 0, not {v!r}")
        for name in ("max_batch", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, not {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max-model-len must be >= 2, not {self.max_model_len}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 2:
            raise ValueError(f"kv-cache-tokens must be >= 2, not {self.kv_cache_tokens}")
        if not self.worker_timeout > 0:
            raise ValueError(f"worker-timeout must be > 0 seconds, not {self.worker_timeout}")
        if self.worker_threads < 0:
            raise ValueError(f"worker-threads must be >= 0, not {self.worker_threads}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max-body-bytes must be >= 1024, not {self.max_body_bytes}")
        for name in ("timeout_keep_alive", "timeout_header", "timeout_body"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name.replace('_', '-')} must be > 0 seconds, not {getattr(self, name)}")
        if self.limit_concurrency < 1:
            raise ValueError(f"limit-concurrency must be >= 1, not {self.limit_concurrency}")
        for name in ("port", "control_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name.replace('_', '-')} {getattr(self, name)} is not a TCP port")


SPEC_ENV = "UNWEIGHT_WORKER_SPEC"  # how the router hands a worker it starts its WorkerSpec


@dataclass(slots=True, kw_only=True)
class WorkerSpec:
    """Everything a worker process needs, whole: the server's config, its role and name, where the
    router's control socket is. The router starts its workers with this (as JSON
    in SPEC_ENV, `python -m unweight.runtime.serve.worker`), not with the CLI's flags; a worker
    started by hand (`unweight serve --role decode ...`) builds the same from its flags."""

    cfg: ServeConfig
    role: Literal["prefill", "decode", "worker"]
    name: str
    router: tuple[str, int]
    parent_pid: int | None = None  # stop when this process (the router that started it) is gone
    threads: int = 0  # CPU threads for torch and numba; 0: leave them as they are

    def to_json(self) -> str:
        from dataclasses import asdict

        return json.dumps({**asdict(self), "cfg": asdict(self.cfg)})

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        d = json.loads(text)
        d["cfg"] = ServeConfig(**d["cfg"])
        d["router"] = tuple(d["router"])
        return cls(**d)
