"""KV-cache hand-off between a prefill worker and a decode worker over torch.distributed.

Every (prefill, decode) pair gets its own two-rank gloo process group (prefill is rank 0, decode
rank 1), made on first use under a prefix naming both workers' incarnations and the tag of the
transfer that made it. A restarted worker has a new incarnation, so its peers build fresh groups
with it, and a dead worker only breaks the groups it was in: the rest of the server keeps going.

Nothing here trusts the network:
- the rendezvous (where each rank's gloo socket listens) goes over the worker's CURVE control
  channel (`ControlStore`), and the router keeps the keys (`Rendezvous`) only for the groups of
  live pairs, each worker reading and writing only its own groups', within fixed bounds;
- once a group is connected, each side proves to the other that it holds the control secret
  (an HMAC over both sides' fresh nonces, `KVLink._prove`) before any KV is sent on it: a
  process that reached a gloo socket first gets no data and can send none that is accepted;
- off loopback (`encryption="auto"`), every frame of KV is sealed with ChaCha20-Poly1305 under a
  key of its transfer, derived from the secret and the group's nonces (wire.py): nothing of a
  prompt's KV crosses a network in clear, and an altered, replayed or misplaced frame fails its
  request, not the worker.

A transfer is a header and one frame per layer (wire.py), each frame coded losslessly when that
pays: `compression="auto"` codes them off loopback when the link, measured on each new group with
a probe of PROBE_BYTES (timed until the receiver says it has all of it: what the socket buffers take
at once is not the link's rate), is slower than the codec, measured once per dtype. On loopback it
sends them raw: no byte crosses a network there, and the codec's CPU time is the model's (a
1,400-token prompt's first token came 50-60 ms later of 2.0 s with the frames coded, SmolLM2 on 2
cores). A sender with compression on or off, or auto on loopback, measures nothing and sends no
probe: its announcement says 0 bytes.
A send is a whole cache, or one streamed as the prefill makes it (`Transfer.layers`); either way
frame i + 1 is coded while frame i is on the wire.

Transfers run on one background thread per peer (the worker's loop never blocks on the network);
results come back through a queue that the worker's loop drains between steps. Each transfer's
tag is the request's number (from 1; tag 0 is the proof's), so concurrent hand-offs on one pair
cannot be confused. A side that fails a transfer drops its group and closes its sockets, so the
other side's waits on it fail at once, not at KV_TIMEOUT_S; a transfer whose first exchange finds
its group closed runs again at once on a fresh one (`_transfer`), so a failure costs its own
request only. The error a failed transfer reports is short (`_reason`): gloo's own (file paths,
addresses) stays in the worker's log.
"""

from __future__ import annotations

import base64
import datetime
import gc
import hashlib
import hmac
import itertools
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..kv import wire
from .protocol import KV_TIMEOUT_S, KV_VALUE_BYTES, BadMessage, RateLimitedLog, ToKVClient, pack, unpack

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True, eq=False)
class Transfer:
    """What a worker asks of its link: send a request's KV cache to a peer, or receive one from it.
    A send is a whole cache (`tensor`) or one streamed as the prefill makes it (`shape`, `dtype` and
    `layers`); a receive gives the `shape` and `dtype` it expects. The link answers with a
    TransferResult."""

    rid: str
    tag: int
    peer: str
    peer_incarnation: str
    tensor: torch.Tensor | None = None  # a whole cache to send
    shape: tuple[int, ...] = ()  # (layers, 2, tokens, kv_heads, head_dim)
    dtype: str = "float32"
    # a streamed send: each layer's (2, tokens, kv_heads, head_dim) host tensor put here in order as
    # the prefill makes it; None in its place aborts the transfer
    layers: queue.Queue | None = None

    def __post_init__(self) -> None:
        if self.tensor is None and not self.shape:
            raise ValueError(f"transfer of {self.rid}: neither a tensor to send nor a shape to expect")


@dataclass(slots=True)
class TransferResult:
    """What the link reports about one Transfer once it is over: the cache received, or the error,
    and what it cost (for the metrics)."""

    request: Transfer
    tensor: torch.Tensor | None = None  # what was received (None for a send, and for a failed receive)
    error: str | None = None
    aborted: bool = False  # the request ended during its prefill (the sender said so): nobody's fault
    raw_bytes: int = 0  # the cache's own bytes
    wire_bytes: int = 0  # the bytes on the wire, framing included
    seconds: float = 0.0  # the transfer's wall time
    codec_seconds: float = 0.0  # the part of it this side spent coding and sealing
    compressed: bool = False
    sealed: bool = False

    @property
    def rid(self) -> str:
        return self.request.rid

    @property
    def peer(self) -> str:
        return self.request.peer


@dataclass(slots=True)
class Group:
    """A proven two-rank group with one peer: the process group, the key its transfers are sealed
    under, and the rate its probe was sent at."""

    pg: dist.ProcessGroup
    session: bytes
    link_rate: float  # bytes/s of the probe (measured by the sender; 0 on the receiving side, and with no probe)


PROOF_TAG = 0  # the tag of the proof exchange on a new group; transfers use request tags, from 1
NONCE_BYTES = 32
PROBE_BYTES = 4 << 20  # sent once on each new group whose sender codes on "auto", to measure the link
CHOICES = ("auto", "on", "off")
LOOPBACK = ("127.0.0.1", "::1", "localhost")


class StaleGroup(Exception):
    """The first exchange of a transfer failed on the link (`cause`): the group may have been torn
    down by the peer after an earlier failure."""

    def __init__(self, cause: Exception):
        super().__init__(str(cause))
        self.cause = cause


def _reason(e: Exception) -> str:
    """A failed transfer's error as the client sees it: short, and free of gloo's internals (its
    file paths, addresses and ports; they go to the worker's log)."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if not isinstance(e, RuntimeError):  # this module's and the wire format's own refusals, and the rendezvous's
        return text
    if "Timed out" in text or "timeout" in text:
        return f"the KV link did not move within {KV_TIMEOUT_S:.0f} s (KV_TIMEOUT_S)"
    if "closed" in text or "reset" in text.lower() or "Broken pipe" in text:
        return "the KV link was closed mid-transfer (the peer gave it up, or its process ended)"
    return "the KV link failed"


class ControlStore(dist.Store):
    """A torch.distributed store whose keys live in the router, reached over a control socket of
    this worker's own (`connect()` makes it: a CURVE DEALER named NAME#kv). gloo builds a group
    with set, wait and get only; the other operations are refused. Used from the link's threads,
    one request at a time."""

    def __init__(self, connect: Callable[[], object], timeout: float = KV_TIMEOUT_S):
        super().__init__()
        self._connect, self.answer_within = connect, timeout
        self._sock = None
        self._lock = threading.Lock()
        self._numbers = itertools.count()
        self._closed = False

    def _ask(self, msg: dict) -> dict:
        """Send one request, return its reply; TimeoutError if the router does not answer."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the KV rendezvous store is closed")
            if self._sock is None:
                self._sock = self._connect()
            n = next(self._numbers)
            self._sock.send(pack({**msg, "n": n}))
            deadline = time.monotonic() + self.answer_within
            while (left := deadline - time.monotonic()) > 0 and not self._closed:
                if not self._sock.poll(int(min(left, 0.1) * 1000) + 1):
                    continue
                try:
                    reply = unpack(self._sock.recv(), ToKVClient)
                except BadMessage as e:
                    log.warning("dropped a bad KV rendezvous reply: %s", e)
                    continue
                if reply["n"] != n:  # the late answer to a request that timed out
                    continue
                if reply["error"] is not None:
                    raise PermissionError(f"KV rendezvous refused {msg['key']}: {reply['error']}")
                return reply
            self._sock.close(linger=0)  # a lost connection or a router gone: start afresh next time
            self._sock = None
            if self._closed:
                raise RuntimeError("the KV rendezvous store is closed")
            raise TimeoutError(f"the router did not answer a KV rendezvous request within {self.answer_within:.0f} s")

    def _value(self, key: str) -> bytes | None:
        value = self._ask({"op": "kv_get", "key": key})["value"]
        return None if value is None else base64.b64decode(value)

    def set(self, key: str, value) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        if len(value) > KV_VALUE_BYTES:
            raise ValueError(f"KV rendezvous value for {key} is {len(value)} bytes, over {KV_VALUE_BYTES}")
        self._ask({"op": "kv_set", "key": key, "value": base64.b64encode(value).decode()})

    def _wait_one(self, key: str, deadline: float) -> bytes:
        pause = 0.005
        while (value := self._value(key)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"KV rendezvous: the peer did not publish {key} in time")
            time.sleep(pause)
            pause = min(2 * pause, 0.1)
        return value

    def get(self, key: str) -> bytes:
        return self._wait_one(key, time.monotonic() + self.answer_within)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        deadline = time.monotonic() + (timeout.total_seconds() if timeout else self.answer_within)
        for key in keys:
            self._wait_one(key, deadline)

    def check(self, keys: list[str]) -> bool:
        return all(self._value(k) is not None for k in keys)

    def _refuse(self, *_args, **_kwargs):
        raise RuntimeError("the KV rendezvous store only sets, waits for and gets keys")

    add = compare_set = delete_key = num_keys = _refuse

    def close(self) -> None:
        self._closed = True
        with self._lock:
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None


class Rendezvous:
    """The router's side of the KV rendezvous: the keys of live (prefill, decode) pairs' groups.
    A key is kv/PREFILL_INCARNATION/DECODE_INCARNATION/...; a worker reads and writes only keys
    of pairs it is in, with a live worker of the other role. Bounded: at most MAX_KEYS_PER_PAIR
    keys a pair (the oldest go first), each of at most KV_VALUE_BYTES; a pair's keys go when either
    worker is no longer live."""

    MAX_KEYS_PER_PAIR = 64

    def __init__(self):
        self.pairs: dict[tuple[str, str], dict[str, str]] = {}

    def handle(self, role: str, incarnation: str, live: dict[str, set[str]], msg: dict) -> dict:
        """The reply (kv_reply) to a kv_set or kv_get from a worker of `role` and `incarnation`;
        `live` is the incarnations of the ready workers, by role."""
        reply = {"op": "kv_reply", "n": msg["n"], "value": None, "error": None}
        parts = msg["key"].split("/", 3)
        pair = (parts[1], parts[2]) if len(parts) == 4 and parts[0] == "kv" and all(parts[1:]) else None
        if pair is None:
            reply["error"] = "not a KV group key (kv/PREFILL/DECODE/...)"
        elif role not in ("prefill", "decode") or pair[role == "decode"] != incarnation:
            reply["error"] = "not a KV group of this worker"
        elif pair[role == "prefill"] not in live["decode" if role == "prefill" else "prefill"]:
            reply["error"] = "the other worker of this KV group is not a ready worker of this server"
        elif msg["op"] == "kv_get":
            reply["value"] = self.pairs.get(pair, {}).get(msg["key"])
        else:
            try:
                size = len(base64.b64decode(msg["value"], validate=True))
            except ValueError:  # binascii.Error: the padding does not fit
                reply["error"] = "value is not base64"
                return reply
            if size > KV_VALUE_BYTES:
                reply["error"] = f"value over {KV_VALUE_BYTES} bytes"
                return reply
            for p in [p for p in self.pairs if p[0] not in live["prefill"] or p[1] not in live["decode"]]:
                del self.pairs[p]
            keys = self.pairs.setdefault(pair, {})
            keys.pop(msg["key"], None)
            while len(keys) >= self.MAX_KEYS_PER_PAIR:
                del keys[next(iter(keys))]
            keys[msg["key"]] = msg["value"]
        return reply


class KVLink:
    """One worker's end of its hand-offs. `rank` 0 sends (prefill), 1 receives (decode); `store` is
    the rendezvous (a ControlStore; any torch store in tests) and `key` what both sides prove they
    hold (runtime/kv/secret.py: kv_link_key). `compression` and `encryption` are "auto", "on" or "off" (see the
    module's docstring); a receiver whose encryption is on (or auto off loopback) refuses unsealed
    frames."""

    def __init__(
        self,
        store: dist.Store,
        key: bytes,
        incarnation: str,
        rank: int,
        bind_host: str = "127.0.0.1",
        compression: str = "auto",
        encryption: str = "auto",
    ):
        for name, value in (("compression", compression), ("encryption", encryption)):
            if value not in CHOICES:
                raise ValueError(f"KV {name} {value!r} is not one of {', '.join(CHOICES)}")
        timeout = datetime.timedelta(seconds=KV_TIMEOUT_S)
        self.store, self.key = store, key
        # gloo's own listening socket: on the address this worker reaches the router from, not
        # wherever gloo's default (the hostname's address) would put it
        self.options = dist.ProcessGroupGloo._Options()
        self.options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
        self.options._timeout = timeout
        self.incarnation, self.rank, self.timeout = incarnation, rank, timeout
        self.compression, self.bind_host = compression, bind_host
        self.sealed = encryption == "on" or (encryption == "auto" and bind_host not in LOOPBACK)
        if not self.sealed and bind_host not in LOOPBACK:
            log.warning(
                "--kv-encryption off: this worker's KV link listens on %s, not loopback: every prompt's KV cache "
                "will cross the network in clear (readable, and alterable, by anyone on the path); use "
                "--kv-encryption auto",
                bind_host,
            )
        self._codec_rates: dict[torch.dtype, float] = {}
        self.done: queue.Queue[TransferResult] = queue.Queue()  # finished transfers, for the worker loop
        self._groups: dict[tuple[str, str], Group] = {}
        self._queues: dict[tuple[str, str], queue.Queue] = {}
        self._lock = threading.Lock()
        self.rejected = RateLimitedLog(log)  # refused frames and failed proofs: logged, rate-limited

    def submit(self, t: Transfer) -> None:
        """Queue a send (rank 0, t.tensor set) or a receive (rank 1, t.shape/t.dtype set)."""
        key = (t.peer, t.peer_incarnation)
        with self._lock:
            q = self._queues.get(key)
            if q is None:
                q = self._queues[key] = queue.Queue()
                threading.Thread(target=self._serve_peer, args=(key, q), name=f"kv-{t.peer}", daemon=True).start()
        q.put(t)

    def _group(self, key: tuple[str, str], tag: int) -> Group:
        """The group with this peer; a new one (its prefix carries the tag of the transfer that
        needs it, which both sides agree on) is proven, and its link measured, before it is used."""
        g = self._groups.get(key)
        if g is None:
            pre, dec = (self.incarnation, key[1]) if self.rank == 0 else (key[1], self.incarnation)
            pg = dist.ProcessGroupGloo(
                dist.PrefixStore(f"kv/{pre}/{dec}/{tag}", self.store), self.rank, 2, self.options
            )
            mine, theirs = self._prove(pg, key[1])
            nonces = (mine, theirs) if self.rank == 0 else (theirs, mine)
            session = wire.session_key(self.key, *nonces, pre, dec)
            rate = self._probe(pg)
            g = self._groups[key] = Group(pg, session, rate)
            if self.rank == 0:
                clear = not self.sealed and self.bind_host not in LOOPBACK
                (log.warning if clear else log.info)(
                    "KV link to %s: %s; frames %s",
                    key[0],
                    f"{rate / 1e6:.0f} MB/s measured" if rate else f"not measured (compression {self.compression})",
                    "sealed (ChaCha20-Poly1305)"
                    if self.sealed
                    else f"UNSEALED over the network ({self.bind_host}): --kv-encryption off"
                    if clear
                    else "unsealed (loopback)",
                )
        return g

    def _probe(self, pg: dist.ProcessGroup) -> float:
        """The link's rate on a new group, in bytes/s (the sender's side; 0 on the receiver's, and
        where the sender does not choose: compression on or off, or auto on loopback). The sender
        announces the probe's size (0: none), sends it, and times it until the receiver's 8-byte
        acknowledgement is back."""
        size = torch.tensor([PROBE_BYTES if self.rank == 0 and self._chooses() else 0], dtype=torch.int64)
        if self.rank == 0:
            t0 = time.perf_counter()
            pg.send([size], 1, PROOF_TAG).wait()
            if not size[0]:
                return 0.0
            pg.send([torch.zeros(PROBE_BYTES, dtype=torch.uint8)], 1, PROOF_TAG).wait()
            pg.recv([size], 1, PROOF_TAG).wait()
            return PROBE_BYTES / max(time.perf_counter() - t0, 1e-9)
        pg.recv([size], 0, PROOF_TAG).wait()
        n = int(size[0])
        if not 0 <= n <= PROBE_BYTES:
            raise wire.WireError(f"the peer announced a link probe of {n} bytes, over the {PROBE_BYTES} it may send")
        if n:
            pg.recv([torch.empty(n, dtype=torch.uint8)], 0, PROOF_TAG).wait()
            pg.send([size], 0, PROOF_TAG).wait()
        return 0.0

    def _proof(self, rank: int, incarnation: str, peer_incarnation: str, challenge: bytes, own_nonce: bytes) -> bytes:
        """What the rank-`rank` side answers to `challenge`: bound to both incarnations, its rank
        (no reflecting a proof back) and its own nonce."""
        return hmac.new(
            self.key, f"{rank}/{incarnation}/{peer_incarnation}/".encode() + challenge + own_nonce, hashlib.sha256
        ).digest()

    def _exchange(self, g: dist.ProcessGroup, data: bytes) -> bytes:
        peer = 1 - self.rank
        got = torch.empty(len(data), dtype=torch.uint8)
        sent = g.send([torch.frombuffer(bytearray(data), dtype=torch.uint8)], peer, PROOF_TAG)
        received = g.recv([got], peer, PROOF_TAG)
        sent.wait()
        received.wait()
        return got.numpy().tobytes()

    def _prove(self, g: dist.ProcessGroup, peer_incarnation: str) -> tuple[bytes, bytes]:
        """Both sides send a fresh nonce, then the HMAC of the other's nonce (and their own) under
        the link key; a peer whose answer is wrong holds no secret of this server. Returns (this
        side's nonce, the peer's)."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        challenge = self._exchange(g, nonce)
        answer = self._exchange(g, self._proof(self.rank, self.incarnation, peer_incarnation, challenge, nonce))
        if not hmac.compare_digest(
            answer, self._proof(1 - self.rank, peer_incarnation, self.incarnation, nonce, challenge)
        ):
            raise PermissionError("the peer on this KV group did not prove that it holds this server's control secret")
        return nonce, challenge

    def _chooses(self) -> bool:
        """Whether this link decides per group whether to code (auto, off loopback)."""
        return self.compression == "auto" and self.bind_host not in LOOPBACK

    def _compress(self, g: Group, dtype: torch.dtype) -> bool:
        """Whether to code frames of `dtype` on this group: always, never, or (auto) off loopback
        when the link is slower than the codec."""
        if not self._chooses():
            return self.compression == "on"
        if dtype not in self._codec_rates:
            self._codec_rates[dtype] = wire.codec_rate(dtype)
            log.info("KV codec (%s): %.0f MB/s on one thread", dtype, self._codec_rates[dtype] / 1e6)
        return g.link_rate < self._codec_rates[dtype]

    @staticmethod
    def _post(pg: dist.ProcessGroup, data: bytes, tag: int) -> list:
        """Send a length, then the bytes (both kept alive with their work until it is waited on)."""
        length = torch.tensor([len(data)], dtype=torch.int64)
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return [(pg.send([length], 1, tag), length), (pg.send([body], 1, tag), body)]

    @staticmethod
    def _take(pg: dist.ProcessGroup, tag: int, most: int) -> bytes:
        """Receive a length, refuse it if over `most`, then receive that many bytes."""
        length = torch.empty(1, dtype=torch.int64)
        pg.recv([length], 0, tag).wait()
        n = int(length[0])
        if not 0 < n <= most:
            raise wire.WireError(f"the peer announced a KV block of {n} bytes, over the {most} it may send")
        body = torch.empty(n, dtype=torch.uint8)
        pg.recv([body], 0, tag).wait()
        return body.numpy().tobytes()

    def _send(self, g: Group, t: Transfer, out: TransferResult) -> None:
        shape, dtype = (
            (tuple(t.shape), DTYPES[t.dtype]) if t.tensor is None else (tuple(t.tensor.shape), t.tensor.dtype)
        )
        header = wire.pack_header(t.rid, t.tag, dtype, shape, self.sealed, wire.new_salt())
        sealer = wire.Sealer(g.session, header) if self.sealed else None
        out.compressed, out.sealed = self._compress(g, dtype), self.sealed
        inflight = self._opening(lambda: self._wait(self._post(g.pg, header, t.tag)))
        out.wire_bytes = len(header)
        for i in range(shape[0]):
            layer = t.tensor[i] if t.layers is None else t.layers.get()
            c0 = time.perf_counter()
            if layer is None:  # the request ended during its prefill: say so, sealed, and stop
                out.aborted, out.error = True, "the request ended during its prefill"
                frame = bytes([wire.ABORT])
            else:
                if tuple(layer.shape) != shape[1:] or layer.dtype != dtype:
                    raise ValueError(
                        f"layer {i} of KV is {layer.dtype} {list(layer.shape)}, not {dtype} {list(shape[1:])}"
                    )
                frame = wire.encode_layer(layer, out.compressed)
                out.raw_bytes += layer.numel() * layer.element_size()
            frame = sealer.seal(i, frame) if sealer is not None else wire.add_check(i, frame)
            out.codec_seconds += time.perf_counter() - c0
            self._wait(inflight)  # layer i - 1 leaves while layer i was coded
            inflight = self._post(g.pg, frame, t.tag)
            out.wire_bytes += len(frame)
            if out.aborted:
                break
        self._wait(inflight)

    @staticmethod
    def _wait(inflight: list) -> list:
        for work, _ in inflight:
            work.wait()
        return []

    @staticmethod
    def _opening(exchange: Callable):
        """A transfer's first exchange (its header): a gloo error here, before anything of the
        transfer has passed, is StaleGroup (the peer tore the group down after a failure of its own)."""
        try:
            return exchange()
        except RuntimeError as e:
            raise StaleGroup(e) from None

    def _receive(self, g: Group, t: Transfer, out: TransferResult) -> None:
        shape, dtype = tuple(t.shape), DTYPES[t.dtype]
        header = self._opening(lambda: self._take(g.pg, t.tag, wire.HEADER.size + wire.RID_MAX))
        out.sealed = wire.check_header(header, t.rid, t.tag, dtype, shape, self.sealed)
        sealer = wire.Sealer(g.session, header) if out.sealed else None
        most = wire.max_frame_bytes(shape, dtype, out.sealed)
        kv = torch.empty(shape, dtype=dtype)
        out.wire_bytes = len(header)
        for i in range(shape[0]):
            frame = self._take(g.pg, t.tag, most)
            out.wire_bytes += len(frame)
            c0 = time.perf_counter()
            frame = sealer.open(i, frame) if sealer is not None else wire.strip_check(i, frame)
            out.compressed |= frame[0] != wire.RAW
            wire.decode_layer(frame, kv[i])
            out.codec_seconds += time.perf_counter() - c0
        out.tensor = kv

    def _serve_peer(self, key: tuple[str, str], q: queue.Queue) -> None:
        while True:
            t = q.get()
            if t is None:
                return
            out = TransferResult(t)
            t0 = time.perf_counter()
            failed = False
            try:
                t0 = self._transfer(key, t, out)
            except wire.Aborted as e:  # on purpose, and both sides are in step: the group stays
                out.aborted, out.error, out.tensor = True, str(e), None
            except Exception as e:  # noqa: BLE001 - a dead or hostile peer surfaces as many error types; the request fails, the worker lives
                out.error, out.tensor, failed = f"KV transfer with {t.peer} failed: {_reason(e)}", None, True
                self._log_failure(t, e)
                self._groups.pop(key, None)  # broken, or out of step: the next transfer builds a new one
            if failed:  # the group's last references (in the traceback's frames) are gone: its sockets
                gc.collect()  # close now, and the peer's waits on it fail at once instead of at their timeout
            out.seconds = time.perf_counter() - t0
            self.done.put(out)

    def _transfer(self, key: tuple[str, str], t: Transfer, out: TransferResult) -> float:
        """Run one transfer on the group with this peer; returns when it started (after any group
        was made). A side that fails a transfer tears its group down, which the other side finds
        at its next exchange: a transfer whose first exchange finds its (older) group torn down
        runs again at once on a fresh one, which the other side makes for the same transfer."""
        for again in (False, True):
            fresh = key not in self._groups
            g = self._group(key, t.tag)
            t0 = time.perf_counter()
            try:
                self._send(g, t, out) if self.rank == 0 else self._receive(g, t, out)
            except StaleGroup as e:
                del g
                self._groups.pop(key, None)
                if fresh or again or "Timed out" in str(e.cause):
                    raise e.cause from None
                continue
            if self.rank == 1:
                out.raw_bytes = out.tensor.numel() * out.tensor.element_size()
            return t0
        raise AssertionError("unreachable")

    def _log_failure(self, t: Transfer, e: Exception) -> None:
        """Every failed transfer, in full (gloo's own words stay in this log, not in the client's
        error), rate-limited; a refused frame or a failed proof as the security event it is."""
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        if isinstance(e, PermissionError) or (self.rank == 1 and isinstance(e, ValueError)):
            self._log_refusal(t, e, detail)
        else:
            self.rejected.warning(
                "KV link: the transfer of request %s (tag %d) with %s (incarnation %s) failed: %s",
                t.rid,
                t.tag,
                t.peer,
                t.peer_incarnation,
                detail,
            )

    def _log_refusal(self, t: Transfer, e: Exception, reason: str) -> None:
        """A security event (a frame that failed authentication, belongs to another request or is
        too big; a peer that failed its proof): one WARNING naming the peer, the request and the
        reason, rate-limited so that a hostile peer cannot flood the log."""
        if isinstance(e, PermissionError):
            self.rejected.warning(
                "KV link: %s (incarnation %s) failed its proof for request %s (tag %d): %s",
                t.peer,
                t.peer_incarnation,
                t.rid,
                t.tag,
                reason,
            )
        elif self.rank == 1 and isinstance(e, ValueError):  # WireError, or the codec's check of a frame
            self.rejected.warning(
                "KV link: refused a KV frame from %s (incarnation %s) for request %s (tag %d): %s",
                t.peer,
                t.peer_incarnation,
                t.rid,
                t.tag,
                reason,
            )

    def close(self) -> None:
        with self._lock:
            for q in self._queues.values():
                q.put(None)
