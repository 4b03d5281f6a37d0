"""The KV hand-off's wire format: a sequence's cache as a header and one frame per layer, each frame
coded losslessly and, off loopback, sealed with ChaCha20-Poly1305.

A transfer (over `unweight serve`'s proven KV group, runtime/serve/kv_link.py, or the vLLM
connector's side channel, runtime/vllm/kv_connector.py) is:
    header      what is coming: request id, tag, dtype, shape, a fresh 16-byte salt, whether the
                frames are sealed (HEADER; sent as is: a changed header gives the receiver another
                key, so the first frame fails to open)
    frame i     layer i's K and V, (2, tokens, kv_heads, head_dim) in the cache's own dtype, for
                i = 0 .. layers-1: one byte of codec, then the raw bytes or the rans streams;
                sent as soon as the prefill is past layer i, so the transfer overlaps the prefill
                (or the single byte ABORT: the request ended during its prefill, nothing follows)

Coding (`encode_layer`): the codec's `rans` on the cache's own words (unweight/codec/rans.py):
each BF16 or FP32 word splits into an entropy-coded symbol (the exponent and the two high
mantissa bits) and raw bits (sign and the rest of the mantissa), decoded bit-exact. A frame is
sent raw when coding does not make it smaller. Measured on SmolLM2's cache for a 512-token prompt:
0.68x the bytes in BF16, 0.84x in FP32 (docs/serving.md, benchmarks/kv_handoff_bench.py).

Sealing (`Sealer`): the key of a transfer is HMAC-SHA256 over the header under the group's session
key, which both sides derive from the control secret and the fresh nonces of the group's proof
(KVLink._prove). The nonce of frame i is i. So a key never seals two transfers (each header has
its own salt, each group its own session), a nonce is never reused under a key, a frame moved to
another place or another transfer does not open, and a truncated transfer is missing a frame the
receiver waits for.

Checking (`add_check`, `strip_check`): an unsealed frame (on loopback, or --kv-encryption off)
carries no tag, so it ends with 4 bytes of CRC-32 over its index and its bytes, checked before it
is decoded: a frame scrambled in flight, cut, or sent in another frame's place is refused, not
decoded into a wrong cache. It is the CRC-32 the codec's containers use (unweight/codec/checksum.py:
ISA-L's, several GB/s where the codec runs at tens of MB/s a thread); it guards against accidents,
not against an attacker (sealing does that).

Every bound the receiver uses comes from what it expects (the shape and dtype the router told it),
never from the peer: a frame longer than the raw layer plus its framing is refused before it is
received.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import time

import numpy as np
import torch

from unweight.codec import rans
from unweight.codec.checksum import crc32

MAGIC = b"UWKV"
VERSION = 2  # 2: unsealed frames end with their CRC-32
SALT_BYTES = 16
TAG_BYTES = 16  # Poly1305's
CHECK = struct.Struct("<I")  # an unsealed frame's CRC-32, after its bytes
RID_MAX = 256
# magic, version, dtype, sealed, 2, layers, tokens, kv_heads, head_dim, salt, tag, length of the request id
HEADER = struct.Struct("<4sBB?BIIII16sIH")
RAW, RANS, ABORT = 0, 1, 0xFF  # a frame's first byte; ABORT: the prefill ended before this layer
FRAME_HEAD = struct.Struct("<BBI4I")  # codec, precision, chunk, table/raw/words/index lengths
PRECISION = 12  # SmolLM2's 512-token BF16 cache: 0.681x its bytes at 12, 0.684x at 10
DTYPE_CODES = {torch.bfloat16: 1, torch.float32: 2, torch.float16: 3}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
WORD = {
    torch.bfloat16: (torch.int16, np.uint16, 16),
    torch.float16: (torch.int16, np.uint16, 16),
    torch.float32: (torch.int32, np.uint32, 32),
}
ROLES = ("table", "raw", "words", "index")


class WireError(ValueError):
    """A header or frame that is not what the receiver expects: the transfer is refused."""


class Aborted(Exception):
    """The sender ended the transfer on purpose (an ABORT frame, sealed like any other): its
    request failed or finished during the prefill. The group stays in step and in use."""


def pack_header(rid: str, tag: int, dtype: torch.dtype, shape: tuple[int, ...], sealed: bool, salt: bytes) -> bytes:
    """The transfer's header: (layers, 2, tokens, kv_heads, head_dim) and what identifies it."""
    layers, two, tokens, heads, dim = shape
    rid_b = rid.encode()
    if len(rid_b) > RID_MAX or two != 2:
        raise ValueError(f"cannot send KV of shape {list(shape)} for request id of {len(rid_b)} bytes")
    return (
        HEADER.pack(MAGIC, VERSION, DTYPE_CODES[dtype], sealed, 2, layers, tokens, heads, dim, salt, tag, len(rid_b))
        + rid_b
    )


def check_header(
    data: bytes, rid: str, tag: int, dtype: torch.dtype, shape: tuple[int, ...], need_sealed: bool
) -> bool:
    """Whether the header's frames are sealed; WireError unless it announces exactly this transfer."""
    if len(data) < HEADER.size:
        raise WireError(f"KV header of {len(data)} bytes, under the {HEADER.size} of its fixed part")
    magic, version, code, sealed, two, layers, tokens, heads, dim, _salt, got_tag, n = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise WireError(f"not a KV header of wire version {VERSION} (magic {magic!r}, version {version})")
    got_rid = data[HEADER.size :].decode(errors="replace")
    if got_tag != tag or n != len(data) - HEADER.size or got_rid != rid:
        raise WireError(f"KV header is for request {got_rid} (tag {got_tag}), not {rid} (tag {tag})")
    got = (layers, two, tokens, heads, dim)
    if CODE_DTYPES.get(code) != dtype or got != tuple(shape):
        raise WireError(
            f"KV header announces {CODE_DTYPES.get(code, code)} {list(got)}, "
            f"the decode worker expects {dtype} {list(shape)} (give every worker the same --kv-cache-dtype)"
        )
    if need_sealed and not sealed:
        raise WireError("KV frames would arrive unsealed; this worker takes only sealed ones off loopback")
    return bool(sealed)


def max_frame_bytes(shape: tuple[int, ...], dtype: torch.dtype, sealed: bool) -> int:
    """The most bytes a frame of one layer may take: raw, framed, and sealed."""
    raw = 1 + int(np.prod(shape[1:])) * torch.empty(0, dtype=dtype).element_size()
    return raw + (TAG_BYTES if sealed else CHECK.size)


def _check(index: int, frame) -> int:
    return crc32(frame, crc32(CHECK.pack(index)))


def add_check(index: int, frame: bytes) -> bytes:
    """Frame `index` of an unsealed transfer as it is sent: its bytes, then their CRC-32."""
    return frame + CHECK.pack(_check(index, frame))


def strip_check(index: int, data: bytes) -> memoryview:
    """Frame `index` of an unsealed transfer without its CRC-32; WireError if the CRC does not match
    (scrambled, cut, or another frame)."""
    view = memoryview(data)
    if len(view) < 1 + CHECK.size or CHECK.unpack_from(view, len(view) - CHECK.size)[0] != _check(
        index, view[: -CHECK.size]
    ):
        raise WireError(f"KV frame {index} failed its checksum (scrambled in flight, cut short, or out of place)")
    return view[: -CHECK.size]


def _words(layer: torch.Tensor) -> np.ndarray:
    tdt, _, _ = WORD[layer.dtype]
    return layer.contiguous().view(tdt).numpy().view(WORD[layer.dtype][1]).reshape(-1)


def encode_layer(layer: torch.Tensor, compress: bool) -> bytes:
    """One layer's (2, tokens, kv_heads, head_dim) host tensor as a frame (not yet sealed)."""
    words = _words(layer)
    raw = words.view(np.uint8)
    if compress:
        p = rans.RansParams.for_word(WORD[layer.dtype][2], True, PRECISION, rans.chunk_for(len(words)))
        streams = rans.encode(words, p, threads=1)
        size = FRAME_HEAD.size + sum(streams[r].nbytes for r in ROLES)
        if size < 1 + raw.nbytes:
            head = FRAME_HEAD.pack(RANS, p.precision, p.chunk, *(streams[r].nbytes for r in ROLES))
            return b"".join([head, *(streams[r].tobytes() for r in ROLES)])
    return bytes([RAW]) + raw.tobytes()


def decode_layer(frame: memoryview | bytes, out: torch.Tensor) -> None:
    """Decode a frame into `out`, a (2, tokens, kv_heads, head_dim) host tensor of the expected
    dtype; WireError (or the codec's ValueError) if the frame is not a whole, valid one of that size."""
    frame = memoryview(frame)
    words = _words(out)  # a view: decoding writes into out
    if len(frame) < 1:
        raise WireError("empty KV frame")
    if frame[0] == ABORT and len(frame) == 1:
        raise Aborted("the prefill worker ended this request before its KV cache was whole")
    if frame[0] == RAW:
        if len(frame) != 1 + words.nbytes:
            raise WireError(f"raw KV frame of {len(frame) - 1} bytes, the layer has {words.nbytes}")
        words.view(np.uint8)[:] = np.frombuffer(frame, dtype=np.uint8, offset=1)
        return
    if frame[0] != RANS or len(frame) < FRAME_HEAD.size:
        raise WireError(f"KV frame of unknown codec {frame[0]} or cut short ({len(frame)} bytes)")
    _, precision, chunk, *lengths = FRAME_HEAD.unpack_from(frame)
    if FRAME_HEAD.size + sum(lengths) != len(frame):
        raise WireError(f"KV frame of {len(frame)} bytes does not hold the {sum(lengths)} its head declares")
    p = rans.RansParams.for_word(WORD[out.dtype][2], True, precision, chunk)  # ValueError if out of range
    streams, at = {}, FRAME_HEAD.size
    for role, n in zip(ROLES, lengths):
        streams[role] = np.frombuffer(frame, dtype=np.uint8, count=n, offset=at)
        at += n
    if not (words.flags.aligned and words.flags.writeable):
        raise WireError("KV layer buffer is not aligned")
    rans.decode(streams, p, len(words), threads=1, out=words)


def recode(frame: bytes, shape: tuple[int, ...], dtype: torch.dtype, compress: bool) -> bytes:
    """A frame of a (2, tokens, kv_heads, head_dim) layer coded again, as `encode_layer(..., compress)`
    would code the layer it holds."""
    layer = torch.empty(shape, dtype=dtype)
    decode_layer(frame, layer)
    return encode_layer(layer, compress)


class Sealer:
    """ChaCha20-Poly1305 over the frames of one transfer (see the module's docstring)."""

    def __init__(self, session_key: bytes, header: bytes):
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

        self._aead = ChaCha20Poly1305(hmac.new(session_key, b"unweight-kv-frames/" + header, hashlib.sha256).digest())

    @staticmethod
    def _nonce(index: int) -> bytes:
        return index.to_bytes(12, "little")

    def seal(self, index: int, frame: bytes) -> bytes:
        return self._aead.encrypt(self._nonce(index), frame, None)

    def open(self, index: int, sealed: bytes) -> bytes:
        from cryptography.exceptions import InvalidTag

        try:
            return self._aead.decrypt(self._nonce(index), bytes(sealed), None)
        except InvalidTag:
            raise WireError(
                f"KV frame {index} failed authentication (altered, replayed, or sealed under another key)"
            ) from None


def new_salt() -> bytes:
    return secrets.token_bytes(SALT_BYTES)


def session_key(link_key: bytes, sender_nonce: bytes, receiver_nonce: bytes, sender: str, receiver: str) -> bytes:
    """The key a proven group seals its transfers under: fresh with each group's nonces."""
    return hmac.new(
        link_key,
        b"unweight-kv-session/" + f"{sender}/{receiver}/".encode() + sender_nonce + receiver_nonce,
        hashlib.sha256,
    ).digest()


def codec_rate(dtype: torch.dtype, mib: int = 2, rounds: int = 3) -> float:
    """Bytes a second the slower of encoding and decoding a frame runs at, on one thread, measured on
    normally distributed values (what a KV cache looks like to the coder): the best of `rounds`, after
    a small frame coded and decoded, so that both the encoder's and the decoder's kernels are compiled
    (or loaded from numba's cache) first. Timed with the decoder cold, a BF16 server's first link
    measured 1 MB/s against 1.3 GB/s warm, and `--kv-compression auto` left the KV uncoded on any link."""
    g = torch.Generator().manual_seed(0)
    layer = torch.randn(2, (mib << 20) // (2 * 4 * 64 * torch.empty(0, dtype=dtype).element_size()), 4, 64, generator=g)
    layer = layer.to(dtype)
    out = torch.empty_like(layer)
    decode_layer(encode_layer(layer[:, :64], True), out[:, :64])
    slowest = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        frame = encode_layer(layer, True)
        t1 = time.perf_counter()
        decode_layer(frame, out)
        slowest.append(max(time.perf_counter() - t1, t1 - t0))
    return layer.numel() * layer.element_size() / max(min(slowest), 1e-9)
