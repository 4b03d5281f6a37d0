"""The KV hand-off's frames (runtime/kv/wire.py): bit-exact in the cache's own dtype whatever
the words (signed zeros, infinities, NaN payloads, subnormals), and a frame that is cut or whose
head lies is refused with WireError or the codec's ValueError, never decoded into a wrong cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unweight.runtime.kv import wire

SPECIAL = {
    torch.bfloat16: [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x0001, 0x807F, 0x3F80],
    torch.float32: [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 1, 0x807FFFFF],
}
VIEW = {torch.bfloat16: (torch.int16, np.uint16, np.int16), torch.float32: (torch.int32, np.uint32, np.int32)}


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    tokens=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
    special_share=st.floats(0, 1),
    compress=st.booleans(),
)
def test_frames_are_bit_exact_on_every_word(dtype, tokens, seed, special_share, compress):
    rng = np.random.default_rng(seed)
    n = 2 * tokens * 2 * 32
    normal = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(dtype)
    words = normal.view(VIEW[dtype][0]).numpy().view(VIEW[dtype][1]).copy()
    pick = rng.random(n) < special_share
    words[pick] = rng.choice(np.array(SPECIAL[dtype], dtype=VIEW[dtype][1]), size=int(pick.sum()))
    layer = torch.from_numpy(words.view(VIEW[dtype][2])).view(dtype).reshape(2, tokens, 2, 32)
    out = torch.full_like(layer, 7)
    wire.decode_layer(wire.encode_layer(layer, compress), out)
    assert torch.equal(out.view(VIEW[dtype][0]), layer.view(VIEW[dtype][0]))


def test_a_compressed_frame_is_smaller_and_a_raw_one_is_chosen_when_coding_does_not_pay():
    g = torch.Generator().manual_seed(0)
    layer = torch.randn(2, 64, 4, 64, generator=g).to(torch.bfloat16)
    assert len(wire.encode_layer(layer, True)) < 0.8 * layer.numel() * 2
    noise = torch.randint(-(2**15), 2**15, (2, 64, 4, 64), dtype=torch.int16, generator=g).view(torch.bfloat16)
    frame = wire.encode_layer(noise, True)
    assert frame[0] == wire.RAW and len(frame) == 1 + noise.numel() * 2


def test_cut_or_lying_frames_are_refused():
    g = torch.Generator().manual_seed(1)
    layer = torch.randn(2, 48, 4, 64, generator=g).to(torch.bfloat16)
    frame = wire.encode_layer(layer, True)
    out = torch.empty_like(layer)
    bad = [
        b"",
        frame[:1],
        frame[: len(frame) // 2],
        frame + b"\0",
        bytes([9]) + frame[1:],
        bytes([wire.RAW]) + frame[1:],  # a raw frame of the wrong size
        frame[:1] + bytes([30]) + frame[2:],  # a precision out of range
    ]
    for b in bad:
        with pytest.raises(ValueError):
            wire.decode_layer(b, out)
    # a head whose stream lengths are shuffled (same total): the codec's own checks refuse it
    head = list(wire.FRAME_HEAD.unpack_from(frame))
    head[3], head[5] = head[5], head[3]
    with pytest.raises(ValueError):
        wire.decode_layer(wire.FRAME_HEAD.pack(*head) + frame[wire.FRAME_HEAD.size :], out)


def test_headers_name_their_request_shape_and_dtype():
    shape = (30, 2, 5, 3, 64)
    h = wire.pack_header("cmpl-1", 7, torch.bfloat16, shape, True, wire.new_salt())
    assert wire.check_header(h, "cmpl-1", 7, torch.bfloat16, shape, True) is True
    for args, words in [
        (("cmpl-2", 7, torch.bfloat16, shape, True), "is for request cmpl-1"),
        (("cmpl-1", 8, torch.bfloat16, shape, True), "is for request cmpl-1"),
        (("cmpl-1", 7, torch.float32, shape, True), "announces torch.bfloat16"),
        (("cmpl-1", 7, torch.bfloat16, (30, 2, 6, 3, 64), True), "announces"),
    ]:
        with pytest.raises(wire.WireError, match=words):
            wire.check_header(h, *args)
    plain = wire.pack_header("cmpl-1", 7, torch.bfloat16, shape, False, wire.new_salt())
    with pytest.raises(wire.WireError, match="only sealed"):
        wire.check_header(plain, "cmpl-1", 7, torch.bfloat16, shape, True)
    with pytest.raises(wire.WireError):
        wire.check_header(h[:10], "cmpl-1", 7, torch.bfloat16, shape, True)


def test_unsealed_frames_carry_a_checksum_checked_before_decoding():
    """#51 item 7: a scrambled unsealed frame decoded into a wrong cache (a 200 with garbage text);
    its CRC-32, over its index and bytes, refuses it first."""
    layer = torch.randn(2, 8, 2, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for compress in (False, True):
        frame = wire.encode_layer(layer, compress)
        sent = wire.add_check(3, frame)
        assert len(sent) <= wire.max_frame_bytes((1, *layer.shape), layer.dtype, False)
        out = torch.empty_like(layer)
        wire.decode_layer(wire.strip_check(3, sent), out)
        assert torch.equal(out.view(torch.int16), layer.view(torch.int16))
        rng = np.random.default_rng(compress)
        for at in [0, 1, len(sent) // 2, len(sent) - 1, *rng.integers(0, len(sent), 20)]:
            bad = bytearray(sent)
            bad[at] ^= 1 << int(rng.integers(0, 8))
            with pytest.raises(wire.WireError, match="failed its checksum"):
                wire.strip_check(3, bytes(bad))
        for bad, index in [(sent, 4), (sent[:-1], 3), (sent[1:], 3), (sent + b"\0", 3), (b"\0" * 4, 3)]:
            with pytest.raises(wire.WireError, match="failed its checksum"):
                wire.strip_check(index, bad)


def test_the_codec_rate_is_timed_with_both_coders_warm(monkeypatch):
    """codec_rate codes and decodes a small frame before it times a whole one: timed with the decoder
    cold (its kernels loaded or compiled in the timed call), a server's first link measured the BF16
    codec at 1 MB/s, and `--kv-compression auto` then left the KV uncoded on every link."""
    calls = []
    encode, decode = wire.encode_layer, wire.decode_layer
    monkeypatch.setattr(wire, "encode_layer", lambda t, *a: calls.append(("encode", t.numel())) or encode(t, *a))
    monkeypatch.setattr(wire, "decode_layer", lambda f, out: calls.append(("decode", out.numel())) or decode(f, out))
    assert wire.codec_rate(torch.bfloat16, mib=1, rounds=2) > 0
    whole = (1 << 20) // 2
    assert calls[:2] == [("encode", calls[0][1]), ("decode", calls[0][1])] and calls[0][1] < whole
    assert calls[2:] == [("encode", whole), ("decode", whole)] * 2
