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
  process that reached a gloo socket first gets no data and can send none that is accepted.
The KV bytes themselves travel in the clear on the gloo connection.

Transfers run on one background thread per peer (the worker's loop never blocks on the network);
results come back through a queue that the worker's loop drains between steps. Each transfer's
tag is the request's number (from 1; tag 0 is the proof's), so concurrent hand-offs on one pair
cannot be confused.
"""

from __future__ import annotations

import base64
import datetime
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

from .protocol import KV_TIMEOUT_S, KV_VALUE_BYTES, BadMessage, ToKVClient, pack, unpack

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class Transfer:
    rid: str
    tag: int
    peer: str
    peer_incarnation: str
    tensor: torch.Tensor | None = None  # what to send, or what was received
    shape: tuple[int, ...] = ()
    dtype: str = "float32"
    error: str | None = None


PROOF_TAG = 0  # the tag of the proof exchange on a new group; transfers use request tags, from 1
NONCE_BYTES = 32


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
    hold (protocol.kv_link_key)."""

    def __init__(self, store: dist.Store, key: bytes, incarnation: str, rank: int, bind_host: str = "127.0.0.1"):
        timeout = datetime.timedelta(seconds=KV_TIMEOUT_S)
        self.store, self.key = store, key
        # gloo's own listening socket: on the address this worker reaches the router from, not
        # wherever gloo's default (the hostname's address) would put it
        self.options = dist.ProcessGroupGloo._Options()
        self.options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
        self.options._timeout = timeout
        self.incarnation, self.rank, self.timeout = incarnation, rank, timeout
        self.done: queue.Queue[Transfer] = queue.Queue()  # finished transfers, for the worker loop
        self._groups: dict[tuple[str, str], dist.ProcessGroup] = {}
        self._queues: dict[tuple[str, str], queue.Queue] = {}
        self._lock = threading.Lock()

    def submit(self, t: Transfer) -> None:
        """Queue a send (rank 0, t.tensor set) or a receive (rank 1, t.shape/t.dtype set)."""
        key = (t.peer, t.peer_incarnation)
        with self._lock:
            q = self._queues.get(key)
            if q is None:
                q = self._queues[key] = queue.Queue()
                threading.Thread(target=self._serve_peer, args=(key, q), name=f"kv-{t.peer}", daemon=True).start()
        q.put(t)

    def _group(self, key: tuple[str, str], tag: int) -> dist.ProcessGroup:
        """The group with this peer; a new one (its prefix carries the tag of the transfer that
        needs it, which both sides agree on) is proven before it is used."""
        g = self._groups.get(key)
        if g is None:
            pre, dec = (self.incarnation, key[1]) if self.rank == 0 else (key[1], self.incarnation)
            g = dist.ProcessGroupGloo(dist.PrefixStore(f"kv/{pre}/{dec}/{tag}", self.store), self.rank, 2, self.options)
            self._prove(g, key[1])
            self._groups[key] = g
        return g

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

    def _prove(self, g: dist.ProcessGroup, peer_incarnation: str) -> None:
        """Both sides send a fresh nonce, then the HMAC of the other's nonce (and their own) under
        the link key; a peer whose answer is wrong holds no secret of this server."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        challenge = self._exchange(g, nonce)
        answer = self._exchange(g, self._proof(self.rank, self.incarnation, peer_incarnation, challenge, nonce))
        if not hmac.compare_digest(
            answer, self._proof(1 - self.rank, peer_incarnation, self.incarnation, nonce, challenge)
        ):
            raise PermissionError("the peer on this KV group did not prove that it holds this server's control secret")

    def _serve_peer(self, key: tuple[str, str], q: queue.Queue) -> None:
        while True:
            t = q.get()
            if t is None:
                return
            try:
                g = self._group(key, t.tag)
                if self.rank == 0:
                    g.send([t.tensor], 1, t.tag).wait()
                else:
                    buf = torch.empty(t.shape, dtype=DTYPES[t.dtype])
                    g.recv([buf], 0, t.tag).wait()
                    t.tensor = buf
            except Exception as e:  # noqa: BLE001 - a dead peer surfaces as many error types; the request fails, the worker lives
                t.error = f"KV transfer with {t.peer} failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                self._groups.pop(key, None)  # the group is broken: rebuild it for the next transfer
                if self.rank == 0:
                    t.tensor = None
            self.done.put(t)

    def close(self) -> None:
        with self._lock:
            for q in self._queues.values():
                q.put(None)
