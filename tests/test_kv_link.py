"""The KV hand-off's link (runtime/serve/kv_link.py) on its own: two real gloo ranks in one process
over an in-memory torch store, and the router's rendezvous rules.

A KV group is used only after both sides proved that they hold the server's control secret: a peer
with another key gets nothing, and its sends are not taken.
"""

from __future__ import annotations

import base64

import pytest
import torch
import torch.distributed as dist

from unweight.runtime.serve.kv_link import KVLink, Rendezvous, Transfer
from unweight.runtime.serve.protocol import kv_link_key

KEY = kv_link_key("s" * 40)


def pair(prefill_key: bytes, decode_key: bytes) -> tuple[KVLink, KVLink]:
    store = dist.HashStore()
    return KVLink(store, prefill_key, "inc-p", 0), KVLink(store, decode_key, "inc-d", 1)


def hand_off(p: KVLink, d: KVLink, kv: torch.Tensor, tag: int) -> tuple[Transfer, Transfer]:
    p.submit(Transfer(f"r{tag}", tag, "decode-0", "inc-d", tensor=kv))
    d.submit(
        Transfer(
            f"r{tag}", tag, "prefill-0", "inc-p", shape=tuple(kv.shape), dtype=str(kv.dtype).removeprefix("torch.")
        )
    )
    return p.done.get(timeout=60), d.done.get(timeout=60)


def test_a_kv_cache_arrives_bit_exact_over_a_proven_group():
    p, d = pair(KEY, KEY)
    try:
        for tag in (1, 2):  # the second transfer reuses the group
            kv = torch.randn(3, 2, 17, 4, 8).to(torch.bfloat16)
            sent, got = hand_off(p, d, kv, tag)
            assert sent.error is None and got.error is None, (sent.error, got.error)
            assert torch.equal(got.tensor.view(torch.int16), kv.view(torch.int16))
        assert len(p._groups) == len(d._groups) == 1
    finally:
        p.close()
        d.close()


def test_a_peer_without_the_secret_gets_no_kv_and_sends_none_that_is_taken():
    p, d = pair(KEY, kv_link_key("t" * 40))
    try:
        sent, got = hand_off(p, d, torch.ones(1, 2, 3, 1, 4), 1)
        for t in (sent, got):
            assert t.error is not None and "did not prove that it holds this server's control secret" in t.error, (
                t.error
            )
        assert got.tensor is None and sent.tensor is None
        assert not p._groups and not d._groups  # a group that failed its proof is not kept
    finally:
        p.close()
        d.close()


def ask(r: Rendezvous, role: str, incarnation: str, live: dict, op: str, key: str, value: bytes = b"") -> dict:
    msg = {"op": op, "n": 0, "key": key}
    if op == "kv_set":
        msg["value"] = base64.b64encode(value).decode()
    return r.handle(role, incarnation, live, msg)


def test_rendezvous_rules():
    r = Rendezvous()
    live = {"prefill": {"P"}, "decode": {"D", "D2"}}
    assert ask(r, "prefill", "P", live, "kv_set", "kv/P/D/1/0/0", b"addr")["error"] is None
    assert ask(r, "decode", "D", live, "kv_get", "kv/P/D/1/0/0")["value"] == base64.b64encode(b"addr").decode()
    assert ask(r, "decode", "D", live, "kv_get", "kv/P/D/1/0/1")["value"] is None
    for role, inc, key in [
        ("decode", "D2", "kv/P/D/1/0/0"),
        ("prefill", "D", "kv/P/D/1/0/0"),
        ("decode", "P", "kv/P/D/1/0/0"),
        ("worker", "P", "kv/P/D/1/0/0"),
    ]:
        assert ask(r, role, inc, live, "kv_get", key)["error"] == "not a KV group of this worker", (role, inc)
    for key in ("kv/P/D", "kv/P/D/", "kv//D/1", "other/P/D/1"):
        assert ask(r, "prefill", "P", live, "kv_get", key)["error"].startswith("not a KV group key"), key
    assert "not a ready worker" in ask(r, "prefill", "P", live, "kv_set", "kv/P/GONE/1/0/0", b"x")["error"]
    assert "over 4096 bytes" in ask(r, "prefill", "P", live, "kv_set", "kv/P/D/1/big", b"x" * 4097)["error"]
    bad = {"op": "kv_set", "n": 0, "key": "kv/P/D/1/pad", "value": "abc"}  # passes the message's pattern, not base64
    assert r.handle("prefill", "P", live, bad)["error"] == "value is not base64"
    # bounded per pair, the newest kept
    for i in range(Rendezvous.MAX_KEYS_PER_PAIR + 10):
        assert ask(r, "decode", "D", live, "kv_set", f"kv/P/D/2/{i}", b"v")["error"] is None
    assert len(r.pairs[("P", "D")]) == Rendezvous.MAX_KEYS_PER_PAIR and "kv/P/D/2/0" not in r.pairs[("P", "D")]
    # a pair goes when one of its workers is no longer ready
    ask(r, "decode", "D2", live, "kv_set", "kv/P/D2/1/0/1", b"x")
    ask(r, "decode", "D2", {"prefill": {"P"}, "decode": {"D2"}}, "kv_set", "kv/P/D2/1/0/1", b"y")
    assert set(r.pairs) == {("P", "D2")}


@pytest.mark.parametrize("method", ["add", "compare_set", "delete_key", "num_keys"])
def test_the_control_store_refuses_what_gloo_does_not_need(method):
    from unweight.runtime.serve.kv_link import ControlStore

    store = ControlStore(lambda: pytest.fail("no socket is opened for a refused operation"))
    with pytest.raises(RuntimeError, match="only sets, waits for and gets"):
        getattr(store, method)("k", 1)
