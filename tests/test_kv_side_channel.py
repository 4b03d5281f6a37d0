"""The vLLM KV connector's side channel (runtime/kv/side_channel.py) between two real sockets, without
vLLM: a server holding caches laid out as a kernel packs them (a permutation per block plane), a
client pulling a prompt's tokens into blocks of its own.

- The pulled tokens are bit-exact (integer views), the rest of the client's blocks untouched, and
  only the prompt's tokens cross: a partial last block costs its tokens, not the whole block.
- With a secret on both sides the peers prove it and the frames are sealed; with a wrong secret, or
  a secret on one side only, the pull is refused before any frame and nothing is written.
- A frame altered in flight (sealed, or only checked by its CRC), a transfer cut short, a frame
  longer than the layer it claims to be, another request's blocks, and a cache laid out another
  way are refused, each with a message naming it.
- A staged prefill (its frames coded as its forward left each layer) is served from its frames,
  bit-exact once the blocks they came from hold something else, raw or coded as the client asks,
  from block 0 to a client that holds the first blocks, and frames not yet coded are waited for.
"""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from unweight.runtime.kv import side_channel, wire
from unweight.runtime.kv.secret import connector_key

LAYERS, HEADS, DIM, SIZE = 3, 2, 16, 32
KEY, OTHER_KEY = connector_key("s" * 40), connector_key("t" * 40)
INT = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def layout(dtype=torch.bfloat16, seed=0, packed=True) -> side_channel.Layout:
    """A layout whose blocks hold their tokens in a scrambled order, as a packing kernel's would."""
    token_of = torch.arange(SIZE).repeat_interleave(DIM).repeat(2)  # K rows, then V rows
    if packed:
        token_of = token_of[torch.randperm(token_of.numel(), generator=torch.Generator().manual_seed(seed))]
    return side_channel.Layout(LAYERS, HEADS, DIM, dtype, SIZE, token_of)


def caches(dtype, blocks=8, seed=0, fill=None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if fill is not None:
        return [torch.full((blocks, HEADS, SIZE, 2 * DIM), fill, dtype=dtype) for _ in range(LAYERS)]
    return [torch.randn(blocks, HEADS, SIZE, 2 * DIM, generator=g).to(dtype) for _ in range(LAYERS)]


class Server:
    """One engine's side channel: answers each connection with side_channel.serve, holding
    request "r1" in blocks [5, 2, 6] of 75 tokens; what each connection ended in goes to `results`."""

    HELD = {"r1": ([5, 2, 6], 75)}

    def __init__(self, key, lay, kv):
        self.key, self.layout, self.caches, self.results = key, lay, kv, []
        self.stage: side_channel.Stage | None = None  # r1's, when a test stages it
        self.changed = threading.Condition()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.addr = self.sock.getsockname()[:2]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def check(self, ask: dict) -> str | None:
        held = self.HELD.get(ask["request_id"])
        if held is None:
            return f"no request {ask['request_id']} held here"
        blocks, first = ask["blocks"], ask["first_block"]
        return None if blocks == held[0][first : first + len(blocks)] else f"blocks {blocks} are not this request's"

    def stage_of(self, ask: dict) -> side_channel.Stage | None:
        st = self.stage
        return st if st and st.covers(ask["blocks"], ask["first_block"], ask["tokens"], SIZE) else None

    def _run(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    result = side_channel.serve(conn, self.key, self.check, self.layout, self.caches, self.stage_of)
                except Exception as e:  # noqa: BLE001 (what the connector logs)
                    result = e
            with self.changed:
                self.results.append(result)
                self.changed.notify_all()

    def ended(self, n: int = 1, timeout: float = 30) -> list:
        """`results` once `n` connections have ended (the client returns as it sends its last bytes, before
        the server has read them)."""
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.results) >= n, timeout), self.results
            return list(self.results)

    def close(self):
        self.sock.close()


@pytest.fixture
def server(request):
    made = []

    def make(key=KEY, dtype=torch.bfloat16, lay=None):
        s = Server(key, lay or layout(dtype), caches(dtype))
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


ASK = {"request_id": "r1", "blocks": [5, 2, 6], "first_block": 0, "tokens": 75, "release": False}


def pull(addr, key=KEY, dtype=torch.bfloat16, ask=ASK, lay=None):
    mine = caches(dtype, fill=3.0)
    sent, received = side_channel.pull(addr, key, ask, lay or layout(dtype), mine, [1, 7, 0], timeout=120)
    return mine, sent + received


def assert_pulled(src, dst, lay, tokens=75):
    """dst's blocks [1, 7, 0] hold src's [5, 2, 6] for the first `tokens` tokens, bit for bit; the
    last block's other elements are still the 3.0 they were."""
    n = tokens - 2 * SIZE
    for s, d in zip(src, dst):
        a, b = s.view(INT[s.dtype]), d.view(INT[s.dtype])
        assert torch.equal(b[[1, 7]], a[[5, 2]])
        mine = (lay.token_of < n).nonzero().flatten()
        rest = (lay.token_of >= n).nonzero().flatten()
        assert torch.equal(b[0].view(HEADS, -1)[:, mine], a[6].view(HEADS, -1)[:, mine])
        assert bool((d[0].view(HEADS, -1)[:, rest] == 3.0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("key", [KEY, None], ids=["sealed", "loopback"])
def test_a_pull_moves_the_prompts_tokens_bit_exact(server, dtype, key):
    s = server(key, dtype)
    mine, wire_bytes = pull(s.addr, key, dtype)
    assert_pulled(s.caches, mine, s.layout)
    assert s.ended() == [ASK | s.layout.geometry()]
    raw_tokens = LAYERS * 2 * 75 * HEADS * DIM * mine[0].element_size()
    assert wire_bytes < raw_tokens  # only the 75 tokens, coded; whole blocks would be 96
    assert not s.results or not isinstance(s.results[0], Exception)


def test_whole_blocks_move_where_the_layout_is_unknown(server):
    lay = side_channel.Layout(LAYERS, HEADS, DIM, torch.bfloat16, SIZE, None)
    s = server(KEY, lay=lay)
    mine, _ = pull(s.addr, lay=lay)
    for a, b in zip(s.caches, mine):
        assert torch.equal(b[[1, 7, 0]].view(torch.int16), a[[5, 2, 6]].view(torch.int16))


@pytest.mark.parametrize(
    "server_key, client_key, client_error, server_error",
    [
        (KEY, OTHER_KEY, "did not prove", "PermissionError"),
        (KEY, None, "serves only peers that hold its secret", "PermissionError"),
        (None, KEY, "holds no secret", None),
    ],
    ids=["another secret", "client without", "server without"],
)
def test_without_the_same_secret_nothing_moves(server, server_key, client_key, client_error, server_error):
    s = server(server_key)
    with pytest.raises((side_channel.Refused, PermissionError), match=client_error):
        pull(s.addr, client_key)
    if server_error:
        assert type(s.ended()[0]).__name__ == server_error
    assert not [r for r in s.results if isinstance(r, dict)]


@pytest.mark.parametrize(
    "ask, error",
    [
        (ASK | {"request_id": "r2"}, "no request r2 held here"),
        (ASK | {"blocks": [4, 2, 6]}, r"blocks \[4, 2, 6\] are not this request's"),
    ],
    ids=["another request", "other blocks"],
)
def test_what_the_server_does_not_hold_is_refused(server, ask, error):
    s = server()
    with pytest.raises(side_channel.Refused, match=error):
        pull(s.addr, ask=ask)


def test_a_cache_laid_out_another_way_is_refused(server):
    s = server()
    with pytest.raises(side_channel.Refused, match="CPU attention ISA"):
        pull(s.addr, lay=layout(seed=1))


class Tamper:
    """A relay between client and server that changes what the server sends: flips the byte at
    `flip`, or cuts the connection after `cut` bytes."""

    def __init__(self, target, flip=None, cut=None):
        self.target, self.flip, self.cut = target, flip, cut
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.addr = self.sock.getsockname()[:2]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        client, _ = self.sock.accept()
        upstream = socket.create_connection(self.target)
        threading.Thread(target=self._copy, args=(client, upstream, False), daemon=True).start()
        self._copy(upstream, client, True)

    def _copy(self, src, dst, tamper):
        at = 0
        try:
            while data := src.recv(65536):
                data = bytearray(data)
                if tamper and self.flip is not None and at <= self.flip < at + len(data):
                    data[self.flip - at] ^= 0x40
                if tamper and self.cut is not None and at + len(data) > self.cut:
                    dst.sendall(data[: self.cut - at])
                    break
                dst.sendall(data)
                at += len(data)
        except OSError:
            pass
        for s in (src, dst):  # shutdown first: the other direction's thread may be inside recv on it
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


@pytest.mark.parametrize(
    "key, error", [(KEY, "failed authentication"), (None, "failed its checksum")], ids=["sealed", "loopback"]
)
def test_a_frame_altered_in_flight_is_refused(server, key, error):
    s = server(key)
    relay = Tamper(s.addr, flip=3000)  # past the hellos, the answer and the header: inside frame 0
    with pytest.raises(wire.WireError, match=error):
        pull(relay.addr, key)


def test_a_transfer_cut_short_is_refused(server):
    s = server()
    relay = Tamper(s.addr, cut=3000)
    with pytest.raises(ConnectionError, match="closed after"):
        pull(relay.addr)


def test_a_frame_longer_than_its_layer_is_refused_before_it_is_read():
    """A hostile server: proves the secret, accepts the ask, sends a true header, then announces a
    frame of 1 GiB. The client refuses at the length, without reading or allocating it."""
    lay = layout()
    sock = socket.create_server(("127.0.0.1", 0))

    def hostile():
        conn, _ = sock.accept()
        ch = side_channel.Channel(conn)
        ch.server_hello(KEY)
        ask = ch.recv_json(b"ask")
        ch.send_json(b"answer", {"ok": True, "from_block": 0})
        header = wire.pack_header("r1", 0, lay.dtype, lay.shape(3, ask["tokens"]), True, wire.new_salt())
        ch.send_raw(header)
        conn.sendall(side_channel.LENGTH.pack(1 << 30))
        conn.recv(1)
        conn.close()

    threading.Thread(target=hostile, daemon=True).start()
    with pytest.raises(side_channel.Refused, match="over the .* expected"):
        pull(sock.getsockname()[:2], lay=lay)
    sock.close()


def test_a_layout_must_give_each_token_its_elements():
    token_of = torch.arange(SIZE).repeat_interleave(DIM).repeat(2)
    token_of[0] = 1
    with pytest.raises(ValueError, match="does not give each"):
        side_channel.Layout(LAYERS, HEADS, DIM, torch.bfloat16, SIZE, token_of)


def test_a_client_may_ask_for_raw_frames(server):
    """`"compress": false` (kv_compression "off", for a link faster than the codec): raw frames, as exact."""
    s = server()
    mine, raw_bytes = pull(s.addr, ask=ASK | {"compress": False})
    assert_pulled(s.caches, mine, s.layout)
    _, coded_bytes = pull(s.addr)
    payload = LAYERS * 2 * 75 * HEADS * DIM * 2
    assert coded_bytes < payload < raw_bytes


def staged(s: Server, compress: bool = True, coded: bool = True) -> side_channel.Stage:
    """r1's stage as the connector's forward makes it: every layer gathered and (with `coded`) coded."""
    blocks, tokens = Server.HELD["r1"]
    stage = side_channel.Stage(LAYERS, blocks, tokens, compress)
    for i, cache in enumerate(s.caches if coded else ()):
        stage.put(i, wire.encode_layer(s.layout.gather(cache, blocks, tokens), compress))
    return stage


@pytest.mark.parametrize("staged_coded", [True, False], ids=["staged-coded", "staged-raw"])
@pytest.mark.parametrize("asked_coded", [True, False], ids=["asked-coded", "asked-raw"])
def test_a_staged_prefill_is_served_from_its_frames(server, staged_coded, asked_coded):
    """Once staged, the blocks may hold another prompt: the pull is the staged one, bit-exact, raw or
    coded as the client asks whichever way the stage was coded."""
    s = server()
    src = [c.clone() for c in s.caches]
    s.stage = staged(s, compress=staged_coded)
    for c in s.caches:
        c.fill_(-1.0)  # the engine took the blocks back and wrote another prompt into them
    mine, moved = pull(s.addr, ask=ASK | {"compress": asked_coded})
    assert_pulled(src, mine, s.layout)
    payload = LAYERS * 2 * 75 * HEADS * DIM * 2
    assert (moved < payload) if asked_coded else (moved > payload)


def test_a_client_holding_the_first_blocks_gets_the_stage_from_block_0(server):
    """A decode engine whose prefix cache held the prompt's first block asks from block 1: the stage
    holds the prompt from block 0, so all of it comes (from_block 0), and the client writes only its
    blocks, leaving the one it held as it was."""
    s = server()
    s.stage = staged(s)
    mine = caches(torch.bfloat16, fill=3.0)
    ask = ASK | {"blocks": [2, 6], "first_block": 1, "tokens": 75 - SIZE}
    side_channel.pull(s.addr, KEY, ask, s.layout, mine, [7, 0], timeout=120)
    at = (s.layout.token_of < 75 - 2 * SIZE).nonzero().flatten()
    for src, dst in zip(s.caches, mine):
        src, dst = src.view(torch.int16), dst.view(torch.int16)
        assert torch.equal(dst[7], src[2])
        assert torch.equal(dst[0].view(HEADS, -1)[:, at], src[6].view(HEADS, -1)[:, at])
        assert bool((dst[1:7] == torch.tensor(3.0, dtype=torch.bfloat16).view(torch.int16)).all())
    assert isinstance(s.ended()[-1], dict)


def test_frames_not_yet_coded_are_waited_for(server):
    """A pull that comes while the stage's layers are still being coded gets each frame as it is put."""
    s = server()
    s.stage = stage = staged(s, coded=False)
    blocks, tokens = Server.HELD["r1"]

    def code():
        for i, cache in enumerate(s.caches):
            threading.Event().wait(0.3)
            stage.put(i, wire.encode_layer(s.layout.gather(cache, blocks, tokens), True))

    threading.Thread(target=code, daemon=True).start()
    mine, _ = pull(s.addr)
    assert_pulled(s.caches, mine, s.layout)


def test_frames_from_a_block_the_client_did_not_ask_for_are_refused():
    """A server whose answer says its frames start at another block than 0 or the ask's first is refused
    before any frame is read."""
    sock = socket.create_server(("127.0.0.1", 0))

    def odd():
        conn, _ = sock.accept()
        ch = side_channel.Channel(conn)
        ch.server_hello(KEY)
        ch.recv_json(b"ask")
        ch.send_json(b"answer", {"ok": True, "from_block": 2})
        conn.recv(1)
        conn.close()

    threading.Thread(target=odd, daemon=True).start()
    with pytest.raises(side_channel.Refused, match="frames from block 2"):
        pull(sock.getsockname()[:2])
    sock.close()
