"""What the router and the workers say to each other, and the settings they share.

Control messages are small JSON objects over ZeroMQ: the router binds a ROUTER socket, every
worker connects a DEALER whose identity is its name (`prefill-0`, `decode-1`, `worker-0`).
Tensors never travel this way: a KV cache goes from a prefill worker to a decode worker over
torch.distributed (runtime/serve/kv_link.py).

A sequence's generation state (`seq`: settings, prompt, tokens made, EOS ids, random state) is
`runtime.sampling.Sequence.state()`; the receiving worker rebuilds and checks it with
`Sequence.from_state`. A token's `logprobs` is [logprob, [[id, logprob], ...]] or null.

Router -> worker
    prefill   {id, tag, seq, prompt_logprobs, decode: name, decode_incarnation}   (disaggregated)
    generate  {id, seq, prompt_logprobs}                                          (aggregated worker)
    decode    {id, tag, seq, kv_shape, kv_dtype, prefill: name, prefill_incarnation}
              (with discard: true, receive the KV and drop it: its request was cancelled meanwhile)
    cancel    {id}
    shutdown  {}
Worker -> router
    hello     {role, pid, incarnation}
    beat      {running, queued, kv_blocks_used, kv_blocks_total}  (every HEARTBEAT_S)
    prompt_logprobs {id, items: [[logprob, [[id, logprob], ...]], ...]}  (one per prompt token after
              the first; sent before the first token when prompt_logprobs is not null)
    prefilled {id, tag, first_token, logprobs, seq, kv_shape, kv_dtype, kv_bytes, decode}  (the KV is on its way)
    tokens    {items: [[id, token, finish_reason or null, logprobs], ...]}  (one message per step;
              token is null when a stop token ended the sequence)
    failed    {id, error}
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ROLES = ("router", "prefill", "decode", "worker")  # "worker": one aggregated process (--no-disagg)
HEARTBEAT_S = 0.5
DEAD_AFTER_S = 10.0  # a worker silent this long is reported unresponsive
KV_TIMEOUT_S = 20.0  # a KV hand-off that takes longer fails its request instead of hanging


def pack(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def unpack(data: bytes) -> dict:
    msg = json.loads(data)
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ValueError("control message without an op")
    return msg


def parse_address(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {text!r} is not HOST:PORT")
    return host, int(port)


@dataclass(slots=True)
class ServeConfig:
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
    kv_port: int = 0
    served_model_name: str | None = None
    worker_threads: int = 0  # CPU threads per worker; 0: the machine's cores split among the local workers
    public_health: bool = False  # /health and /metrics answer without the API key
    max_body_bytes: int = 16 << 20  # larger request bodies get 413, before they are read
    timeout_keep_alive: float = 5.0  # an idle connection (before or between requests) is closed after this
    timeout_header: float = 10.0  # a request's head must arrive within this (from connect or the last response)
    limit_concurrency: int = 512  # open connections beyond which requests get 503

    def __post_init__(self) -> None:
        for name in ("prefill_workers", "decode_workers"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name.replace('_', '-')} must be an integer >= 0, not {v!r}")
        for name in ("max_batch", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, not {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max-model-len must be >= 2, not {self.max_model_len}")
        if self.worker_threads < 0:
            raise ValueError(f"worker-threads must be >= 0, not {self.worker_threads}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max-body-bytes must be >= 1024, not {self.max_body_bytes}")
        for name in ("timeout_keep_alive", "timeout_header"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name.replace('_', '-')} must be > 0 seconds, not {getattr(self, name)}")
        if self.limit_concurrency < 1:
            raise ValueError(f"limit-concurrency must be >= 1, not {self.limit_concurrency}")
        for name in ("port", "control_port", "kv_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name.replace('_', '-')} {getattr(self, name)} is not a TCP port")
