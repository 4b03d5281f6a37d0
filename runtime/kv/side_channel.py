"""The side channel of the vLLM KV connector (runtime/vllm/kv_connector.py): one TCP connection per
pull, on which a decode engine (the client) takes a finished prefill's KV blocks from the prefill
engine that holds them (the server). Nothing here imports vLLM: the connector hands in its caches
and its `Layout`, and the tests drive both ends with plain tensors.

A connection, in order (every message is 4 bytes of length, then its bytes):
    client  hello       {"version", "nonce"}: a fresh nonce, or null when it holds no secret
    server  hello       {"nonce", "proof"}: its own nonce and its proof of the secret; or a refusal
    client  proof       its proof of the secret (only when both hold one)
    client  ask         which request, which of its blocks, how many tokens, coded or raw, the cache's geometry
    server  answer      {"ok": true, "from_block"} or {"ok": false, "error"}
    server  header      runtime/kv/wire.py's header: dtype, (layers, 2, tokens, kv_heads, head_dim), salt
    server  frame i     layer i's tokens, coded (wire.encode_layer), i = 0 .. layers-1
    client  ack         the frames are in its cache: the server may free the blocks
A client that only releases the blocks (its request ended before the pull) asks with "release" and
the connection ends at the answer.

Frames come from one of two places. A `Stage`: the prefill's layers, gathered as its forward left
each one (the connector's save_kv_layer) and coded on a thread of their own while the forward goes
on, so a pull finds them coded and the engine may have taken the blocks back already. A stage holds
the prompt from block 0: a pull from a later block (the decode engine held the first ones in its
prefix cache) gets them all, `from_block` 0 in the answer, and the client skips what it holds.
Without a stage, the server gathers and codes each layer from the blocks as it sends it
(`from_block` is then the ask's own first block).

With a secret (both engines read the same file) each side proves it on every connection, answering
the other's fresh nonce with an HMAC under the connector key (runtime/kv/secret.py), and everything
after the proofs is sealed with ChaCha20-Poly1305 under a session key derived from both nonces
(wire.session_key): the ask, answer and ack each under a key of its own label, the frames under the
transfer's key (wire.Sealer: the header's salt makes it fresh, frame i's nonce is i). Without a
secret (loopback only: the connector refuses to start otherwise) nothing is sealed and each frame
carries its CRC-32 (wire.add_check).

Tokens, not blocks: a block's elements are in the attention kernel's order (vLLM-CPU packs K for
its ISA), so `Layout.token_of` says which token each element of a (block, kv_head) plane holds; a
pull moves whole blocks and, of the last, only the elements of the tokens it holds. Without that
map whole blocks move. Both ends must lay their caches out alike: the ask carries the layout's
digest, and a mismatch is refused, not decoded into a scrambled cache.

Every bound comes from what the receiver expects (its ask), never from the peer: a message or frame
longer than that is refused before it is read.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import wire
from .secret import new_nonce, proof

VERSION = 2  # 2: the answer says from which block the frames start
LENGTH = struct.Struct("<I")
MAX_MESSAGE_BYTES = 1 << 20  # a hello or an ask (the block ids of a 512k-token prompt fit)
IO_TIMEOUT_S = 30.0
ACK = b"\x01"


class Refused(wire.WireError):
    """The peer refused the pull, or the pull is not what this side expects: logged, nothing waits."""


class Stage:
    """A finished prefill's frames, one a layer, put by the thread that codes them as the forward
    leaves each layer and taken by pulls (waiting for a frame not yet coded): `tokens` tokens in
    `blocks` from block 0, coded (`compress`) or raw. A stage that could not be made whole is failed
    (`error`), and nothing is served from it."""

    def __init__(self, layers: int, blocks: list[int], tokens: int, compress: bool):
        self.blocks, self.tokens, self.compress = list(blocks), tokens, compress
        self.error: str | None = None
        self.nbytes = 0  # of the frames coded so far
        self.made, self.coded = time.monotonic(), 0.0  # when it was made, and all its frames coded
        self._frames: list[bytes | None] = [None] * layers
        self._missing = layers  # frames not coded yet
        self._changed = threading.Condition()

    def put(self, index: int, frame: bytes) -> None:
        with self._changed:
            self._missing -= self._frames[index] is None
            self._frames[index] = frame
            self.nbytes += len(frame)
            if not self._missing:
                self.coded = time.monotonic()
            self._changed.notify_all()

    def fail(self, why: str) -> None:
        with self._changed:
            self.error = self.error or why
            self._changed.notify_all()

    @property
    def complete(self) -> bool:
        with self._changed:
            return self.error is None and not self._missing

    def covers(self, blocks: list[int], first: int, tokens: int, block_size: int) -> bool:
        """Whether a pull of `tokens` tokens in `blocks` from block `first` on is the end of this prompt."""
        return self.blocks[first : first + len(blocks)] == blocks and first * block_size + tokens == self.tokens

    def frame(self, index: int, timeout: float = IO_TIMEOUT_S) -> bytes:
        """Frame `index`, once coded; Refused if the stage failed or it takes longer than `timeout`."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._frames[index] is not None or self.error, timeout):
                raise Refused(f"frame {index} of a staged prefill not coded within {timeout:.0f} s")
            if self.error:
                raise Refused(f"the staged prefill failed: {self.error}")
            return self._frames[index]


@dataclass(frozen=True, eq=False)
class Layout:
    """One engine's KV cache as the side channel sees it: `layers` tensors of (blocks, heads,
    block_size, 2 * dim) in `dtype`, and `token_of`, (2 * block_size * dim,) the token each element
    of a (block, head) plane holds (the same for every plane), or None where the kernel's order is
    not known (then whole blocks move)."""

    layers: int
    heads: int
    dim: int
    dtype: torch.dtype
    block_size: int
    token_of: torch.Tensor | None = None
    _positions_of: dict = field(default_factory=dict, repr=False)  # n -> the plane's elements of tokens < n

    def __post_init__(self):
        if self.token_of is not None:
            counts = torch.bincount(self.token_of.long(), minlength=self.block_size)
            if self.token_of.numel() != 2 * self.block_size * self.dim or not bool((counts == 2 * self.dim).all()):
                raise ValueError(f"token_of does not give each of {self.block_size} tokens its 2 x {self.dim} elements")

    @functools.cached_property
    def digest(self) -> str:
        """Equal on two engines whose blocks hold the same tokens at the same places."""
        h = hashlib.sha256(f"{self.dtype}/{self.heads}/{self.dim}/{self.block_size}/".encode())
        h.update(b"blocks" if self.token_of is None else self.token_of.to(torch.int32).numpy().tobytes())
        return h.hexdigest()[:32]

    def geometry(self) -> dict:
        dtype = str(self.dtype).removeprefix("torch.")
        return {"layers": self.layers, "heads": self.heads, "head_dim": self.dim, "dtype": dtype, "layout": self.digest}

    def wire_tokens(self, blocks: int, tokens: int) -> int:
        """The tokens a pull of `tokens` tokens in `blocks` blocks moves: those, or whole blocks."""
        return tokens if self.token_of is not None else blocks * self.block_size

    def shape(self, blocks: int, tokens: int) -> tuple[int, ...]:
        """The transfer's shape as wire.pack_header takes it."""
        return (self.layers, 2, self.wire_tokens(blocks, tokens), self.heads, self.dim)

    def _positions(self, n: int) -> torch.Tensor:
        if n not in self._positions_of:
            self._positions_of[n] = torch.nonzero(self.token_of < n).flatten()
        return self._positions_of[n]

    def _split(self, blocks: list[int], tokens: int) -> tuple[list[int], int]:
        """(blocks moved whole, tokens moved of the last block: 0 when it moves whole too)."""
        n = tokens - (len(blocks) - 1) * self.block_size
        if self.token_of is None or n == self.block_size:
            return blocks, 0
        return blocks[:-1], n

    def gather(self, cache: torch.Tensor, blocks: list[int], tokens: int) -> torch.Tensor:
        """One layer's share of a pull as wire.encode_layer takes it: (2, wire tokens, heads, dim),
        which holds those elements in the cache's own order."""
        full, n = self._split(blocks, tokens)
        parts = [cache[torch.tensor(full)].reshape(-1)] if full else []
        if n:
            parts.append(cache[blocks[-1]].view(self.heads, -1)[:, self._positions(n)].reshape(-1))
        return torch.cat(parts).view(2, -1, self.heads, self.dim)

    def scatter(self, cache: torch.Tensor, blocks: list[int], tokens: int, data: torch.Tensor) -> None:
        """Write what `gather` gave on the other side into this engine's `blocks` of one layer."""
        full, n = self._split(blocks, tokens)
        flat = data.reshape(-1)
        whole = len(full) * cache[0].numel()
        if full:
            cache[torch.tensor(full)] = flat[:whole].view(len(full), *cache.shape[1:])
        if n:
            cache[blocks[-1]].view(self.heads, -1)[:, self._positions(n)] = flat[whole:].view(self.heads, -1)


class Channel:
    """One side-channel connection: length-prefixed messages, sealed under the connection's
    session once both sides proved the secret; `sent` and `received` count its bytes."""

    def __init__(self, sock: socket.socket):
        self.sock, self.session = sock, None
        self.sent = self.received = 0

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(LENGTH.pack(len(data)) + data)
        self.sent += LENGTH.size + len(data)

    def recv_raw(self, bound: int) -> bytes:
        (n,) = LENGTH.unpack(self._exact(LENGTH.size))
        if n > bound:
            raise Refused(f"a message of {n} bytes, over the {bound} expected")
        return self._exact(n)

    def _exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if not k:
                raise ConnectionError(f"the peer closed after {got} of {n} bytes")
            got += k
        self.received += n
        return bytes(buf)

    def send(self, label: bytes, data: bytes) -> None:
        """A message: sealed under its own label's key once the connection has a session."""
        self.send_raw(wire.Sealer(self.session, b"side-channel/" + label).seal(0, data) if self.session else data)

    def recv(self, label: bytes, bound: int) -> bytes:
        data = self.recv_raw(bound + (wire.TAG_BYTES if self.session else 0))
        return wire.Sealer(self.session, b"side-channel/" + label).open(0, data) if self.session else data

    def send_json(self, label: bytes, obj: dict) -> None:
        self.send(label, json.dumps(obj).encode())

    def recv_json(self, label: bytes) -> dict:
        try:
            obj = json.loads(self.recv(label, MAX_MESSAGE_BYTES))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise Refused(f"a side-channel {label.decode()} that is not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise Refused(f"a side-channel {label.decode()} that is not a JSON object")
        return obj

    # ---- the proofs: both sides hold the secret, or neither does ----

    def client_hello(self, key: bytes | None) -> None:
        mine = new_nonce() if key else None
        self.send_raw(json.dumps({"version": VERSION, "nonce": mine.hex() if mine else None}).encode())
        hello = _json(self.recv_raw(MAX_MESSAGE_BYTES), "hello")
        if hello.get("error"):
            raise Refused(f"the prefill engine refused: {hello['error']}")
        theirs = _hex(hello.get("nonce"))
        if key is None:
            if theirs is not None:
                raise Refused("the prefill engine holds a secret and this engine none (give both the same secret_file)")
            return
        if theirs is None:
            raise Refused("the prefill engine holds no secret (give both engines the same secret_file)")
        if not hmac.compare_digest(_hex(hello.get("proof")) or b"", proof(key, "producer", mine, theirs)):
            raise PermissionError("the prefill engine did not prove that it holds this engine's secret")
        self.send_raw(proof(key, "consumer", theirs, mine))
        self.session = wire.session_key(key, theirs, mine, "producer", "consumer")

    def server_hello(self, key: bytes | None) -> None:
        hello = _json(self.recv_raw(MAX_MESSAGE_BYTES), "hello")
        if hello.get("version") != VERSION:
            self.send_raw(json.dumps({"error": f"side-channel version {VERSION} only"}).encode())
            raise Refused(f"a peer of side-channel version {hello.get('version')!r}")
        theirs = _hex(hello.get("nonce"))
        if key is None:
            self.send_raw(json.dumps({"nonce": None}).encode())
            return
        if theirs is None:
            self.send_raw(json.dumps({"error": "this engine serves only peers that hold its secret"}).encode())
            raise PermissionError("a peer without the secret (no nonce in its hello)")
        mine = new_nonce()
        self.send_raw(json.dumps({"nonce": mine.hex(), "proof": proof(key, "producer", theirs, mine).hex()}).encode())
        try:
            answer = self.recv_raw(64)
        except ConnectionError:  # a client that found this side's proof wrong says nothing more
            raise PermissionError("the peer closed instead of proving the secret (it holds another one)") from None
        if not hmac.compare_digest(answer, proof(key, "consumer", mine, theirs)):
            raise PermissionError("the peer did not prove that it holds this engine's secret")
        self.session = wire.session_key(key, mine, theirs, "producer", "consumer")


def _json(data: bytes, what: str) -> dict:
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        obj = None
    if not isinstance(obj, dict):
        raise Refused(f"a side-channel {what} that is not a JSON object")
    return obj


def _hex(value) -> bytes | None:
    if value is None:
        return None
    try:
        return bytes.fromhex(value)
    except (TypeError, ValueError):
        raise Refused("a nonce or proof that is not hex") from None


def pull(
    addr: tuple[str, int],
    key: bytes | None,
    ask: dict,
    layout: Layout,
    caches: list[torch.Tensor],
    blocks: list[int],
    timeout: float = IO_TIMEOUT_S,
) -> tuple[int, int]:
    """The client's pull: `ask` (request_id, blocks: the remote ids, first_block, tokens, release,
    compress: whether the frames are coded, where that makes them smaller)
    answered, and unless it releases, the frames written into `blocks` of `caches`. Returns (bytes
    sent, bytes received). Refused, PermissionError, wire.WireError or OSError if anything is not
    as asked."""
    with socket.create_connection(addr, timeout=timeout) as s:
        ch = Channel(s)
        ch.client_hello(key)
        ch.send_json(b"ask", ask | layout.geometry())
        answer = ch.recv_json(b"answer")
        if not answer.get("ok"):
            raise Refused(f"the prefill engine refused: {answer.get('error')}")
        if not ask.get("release"):
            first, start = int(ask["first_block"]), answer.get("from_block")
            if type(start) is not int or start not in (0, first):
                raise Refused(f"frames from block {start!r}, where the pull asked from block {first}")
            _receive(ch, str(ask["request_id"]), layout, caches, blocks, int(ask["tokens"]), first - start)
            ch.send(b"ack", ACK)
        return ch.sent, ch.received


def _receive(
    ch: Channel, rid: str, layout: Layout, caches: list[torch.Tensor], blocks: list[int], tokens: int, skip: int
) -> None:
    """The frames of `tokens` tokens into `blocks`, after `skip` whole blocks this side holds already
    (the frames carry them too: they come from a stage)."""
    shape = layout.shape(skip + len(blocks), skip * layout.block_size + tokens)
    sealed = ch.session is not None
    header = ch.recv_raw(wire.HEADER.size + wire.RID_MAX)
    wire.check_header(header, rid, 0, layout.dtype, shape, need_sealed=sealed)
    sealer = wire.Sealer(ch.session, header) if sealed else None
    bound = wire.max_frame_bytes(shape, layout.dtype, sealed)
    out = torch.empty(shape[1:], dtype=layout.dtype)
    held = skip * layout.heads * layout.block_size * 2 * layout.dim  # elements of the skipped blocks
    for i, cache in enumerate(caches):
        data = ch.recv_raw(bound)
        wire.decode_layer(sealer.open(i, data) if sealed else wire.strip_check(i, data), out)
        layout.scatter(cache, blocks, tokens, out.view(-1)[held:])


def serve(
    conn: socket.socket,
    key: bytes | None,
    check: Callable[[dict], str | None],
    layout: Layout,
    caches: list[torch.Tensor],
    stage_of: Callable[[dict], Stage | None] = lambda ask: None,
) -> dict:
    """The server's answer to one connection: the proofs, the ask, `check(ask)` (None: the request
    holds those blocks; else why not), and the frames: from `stage_of(ask)`, the request's stage if
    it has one that covers the ask, else coded from the blocks. Returns the ask once the client
    acknowledged the frames or released the blocks; raises (Refused, PermissionError, OSError, ...)
    otherwise, having told the client why where it could."""
    conn.settimeout(IO_TIMEOUT_S)
    ch = Channel(conn)
    ch.server_hello(key)
    ask = ch.recv_json(b"ask")
    error = check(ask) or _geometry(ask, layout)
    if error:
        ch.send_json(b"answer", {"ok": False, "error": error})
        raise Refused(error)
    if ask.get("release"):
        ch.send_json(b"answer", {"ok": True})
        return ask
    stage = stage_of(ask)
    blocks, tokens = (stage.blocks, stage.tokens) if stage else (list(ask["blocks"]), int(ask["tokens"]))
    ch.send_json(b"answer", {"ok": True, "from_block": 0 if stage else ask["first_block"]})
    shape = layout.shape(len(blocks), tokens)
    header = wire.pack_header(str(ask["request_id"]), 0, layout.dtype, shape, bool(ch.session), wire.new_salt())
    ch.send_raw(header)
    sealer = wire.Sealer(ch.session, header) if ch.session else None
    compress = bool(ask.get("compress", True))
    for i, cache in enumerate(caches):
        if stage is None:
            frame = wire.encode_layer(layout.gather(cache, blocks, tokens), compress)
        elif stage.compress != compress:  # coded the other way than this decode engine asks
            frame = wire.recode(stage.frame(i), shape[1:], layout.dtype, compress)
        else:
            frame = stage.frame(i)
        ch.send_raw(sealer.seal(i, frame) if sealer else wire.add_check(i, frame))
    if ch.recv(b"ack", len(ACK)) != ACK:
        raise Refused("the decode engine's acknowledgement is not one")
    return ask


def _geometry(ask: dict, layout: Layout) -> str | None:
    ours = layout.geometry()
    theirs = {k: ask.get(k) for k in ours}
    if theirs != ours:
        return (
            f"the decode engine's KV cache is {theirs}, this engine's {ours} "
            "(same model, dtype and block size on both, and the same CPU attention ISA)"
        )
    return None
