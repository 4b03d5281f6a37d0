"""Property tests: any tensor round-trips bit-exactly, and a damaged container is either refused with
a FormatError or (for a harmless change) still decodes to the original bits, never anything else.

Tensors are compared through integer views of their bytes, never with float ==, so NaN payloads,
signed zeros and subnormals count.
"""

from __future__ import annotations

import faulthandler
import math
import struct
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import unweight
from unweight.codec import CODECS
from unweight.codec.entries import check_entry
from unweight.codec.reference import decode_reference
from unweight.formats import ContainerReader

HANG_SECONDS = 120


@pytest.fixture(autouse=True)
def no_hang():
    """A watchdog thread: a hang in native code dumps every stack and ends the run."""
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in C order, as uint8 (a 0-d tensor gives its itemsize bytes)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bit_identical(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert torch.equal(byte_view(got), byte_view(want))


# ------------------------------------------------------------------------ (a) round trips

# dtype -> (integer dtype of the same width, exponent mask) for floats; None for integer types
FLOATS = {
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000),
    torch.float8_e4m3fn: (torch.uint8, 0x78),
    torch.float8_e5m2: (torch.uint8, 0x7C),
    torch.float64: (torch.int64, 0x7FF0000000000000),
}
INTS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)
DTYPES = (*FLOATS, *INTS)
NAMES = ("w", "model.layers.0.self_attn.q_proj.weight", "bias", "ünïcödé/名前", "a b", "lm_head.weight")

shapes = st.one_of(
    st.just(()),
    st.sampled_from([(0,), (0, 7), (5, 0)]),
    st.sampled_from([1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 1023, 1024, 1025, 4095, 4097]).map(lambda n: (n,)),
    st.integers(1, 5000).map(lambda n: (n,)),
    st.tuples(st.integers(1, 70), st.integers(1, 70)),
)
modes = st.sampled_from(["randn", "bits", "specials", "constant", "few"])
scales = st.sampled_from([1e-30, 1e-6, 0.02, 1.0, 300.0, 1e30])


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], mode: str, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    size = torch.empty((), dtype=dtype).element_size()
    if mode == "randn":
        x = torch.randn(n, generator=g, dtype=torch.float64) * scale
        if dtype in FLOATS:
            t = x.to(torch.float32).to(dtype)
        elif dtype is torch.bool:
            t = x > 0
        else:
            info = torch.iinfo(dtype)
            t = x.round().clamp(info.min, info.max).to(dtype)
        return t.reshape(shape)
    bits = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    if dtype is torch.bool:
        bits &= 1  # bool tensors hold 0 or 1
    if mode == "constant" and n:
        bits = bits[:size].repeat(n)
    elif mode == "few" and n:  # a handful of distinct values: a very skewed symbol table
        pool = torch.randint(0, 256, (3, size), dtype=torch.uint8, generator=g)
        if dtype is torch.bool:
            pool &= 1
        bits = pool[torch.randint(0, 3, (n,), generator=g)].reshape(-1)
    t = bits.view(dtype)
    if mode == "specials" and dtype in FLOATS and n:  # NaN payloads, infinities, zeros, subnormals
        idt, exp = FLOATS[dtype]
        iv = t.view(idt).clone()
        pick = torch.randint(0, 4, (n,), generator=g)
        iv[pick == 0] |= exp  # exponent all ones: inf or NaN with a random payload and sign
        iv[pick == 1] &= ~exp  # exponent zero: signed zero or subnormal
        t = iv.view(dtype)
    return t.reshape(shape)


tensor_specs = st.tuples(st.sampled_from(DTYPES), shapes, modes, scales, st.integers(0, 2**31 - 1), st.booleans())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(tensor_specs, min_size=1, max_size=3), threads=st.sampled_from([1, 2]))
@example(specs=[(torch.bfloat16, (4097,), "specials", 1.0, 1, False)], threads=2)
@example(
    specs=[(torch.float8_e4m3fn, (1025,), "bits", 1.0, 2, False), (torch.bool, (), "bits", 1.0, 3, False)], threads=1
)
@example(specs=[(torch.float32, (33, 31), "constant", 1.0, 4, True)], threads=1)
def test_round_trip_bit_exact(work_dir, specs, threads):
    tensors, expected = {}, {}
    for name, (dtype, shape, mode, scale, seed, transpose) in zip(NAMES, specs):
        t = make_tensor(dtype, shape, mode, scale, seed)
        if transpose and t.dim() == 2:
            t = t.t()  # a non-contiguous view: stored as its contiguous copy
        tensors[name] = t
        expected[name] = t.contiguous()
    path = work_dir / "round-trip.safetensors"
    unweight.save_file(tensors, path, threads=threads)
    got = unweight.load_file(path, threads=threads)
    assert set(got) == set(expected)
    for name in expected:
        assert_bit_identical(got[name], expected[name])
    report = unweight.verify(path, threads=threads)
    assert report.ok, report.mismatches


def test_all_bf16_bit_patterns(tmp_path):
    """Every one of the 65,536 BF16 bit patterns (NaNs, infinities, subnormals, -0), in order and
    shuffled: bit-exact, with a valid codec whose streams the reference decoder agrees with."""
    ordered = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    perm = torch.randperm(65536, generator=torch.Generator().manual_seed(20240613))
    tensors = {"ordered": ordered, "shuffled": ordered[perm].reshape(256, 256)}
    path = tmp_path / "all.safetensors"
    unweight.save_file(tensors, path)
    got = unweight.load_file(path)
    for name, t in tensors.items():
        assert_bit_identical(got[name], t)
    assert sorted(byte_view(got["shuffled"]).view(torch.int16).tolist()) == list(range(-32768, 32768))
    with ContainerReader(path) as reader:
        for name, t in tensors.items():
            entry = reader.tensors[name]
            assert entry.codec in CODECS
            assert (entry.dtype, entry.shape) == ("BF16", tuple(t.shape))
            streams = reader.streams_of(entry)
            check_entry(entry, streams)
            if entry.codec == "rans":
                assert entry.params["word_bits"] == 16 and entry.params["rotate"] is True
                ref = decode_reference(entry.params, streams, entry.numel)
                assert np.array_equal(ref, byte_view(t).numpy().view(np.uint16))
    assert unweight.verify(path).ok


@pytest.mark.parametrize("precision", [10, 12, 15])
def test_all_bf16_bit_patterns_forced_rans(tmp_path, precision):
    """The same 65,536 patterns coded with `rans` (the writer stores them raw: nothing pays), so
    that every symbol of the 1024-symbol alphabet and every raw field occurs; read back through a
    container, and checked against the reference decoder."""
    import zlib

    from unweight.codec import rans
    from unweight.formats import ContainerWriter, TensorEntry

    perm = torch.randperm(65536, generator=torch.Generator().manual_seed(precision))
    values = np.arange(65536, dtype=np.uint16)[perm.numpy()]
    p = rans.RansParams.for_word(16, True, precision)
    streams = rans.encode(values, p, threads=1)
    entry = TensorEntry(
        "all", "BF16", (256, 256), "rans", p.to_json(), {r: f"all#{r}" for r in streams}, zlib.crc32(values.tobytes())
    )
    path = tmp_path / "rans.safetensors"
    with ContainerWriter(str(path)) as writer:
        writer.add(entry, streams)
        writer.finish()
    got = unweight.load_file(path, threads=2)["all"]
    assert_bit_identical(got, torch.from_numpy(values.view(np.int16).copy()).view(torch.bfloat16).reshape(256, 256))
    if precision == 10:  # every frequency is 1: the table is as flat as it gets
        assert np.array_equal(decode_reference(p.to_json(), streams, len(values)), values)


# ------------------------------------------------------------------------ (b) damaged files


@lru_cache(maxsize=1)
def valid_container() -> tuple[bytes, torch.Tensor]:
    """A valid container of one BF16 tensor of 3001 elements (a partial last raw group)."""
    import tempfile

    g = torch.Generator().manual_seed(99)
    t = (torch.randn(3001, generator=g) * 0.02).to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "valid.safetensors"
        unweight.save_file({"weight": t}, path, threads=1)
        blob = path.read_bytes()
    assert unweight_codec(blob) == "rans"
    return blob, t


def unweight_codec(blob: bytes) -> str:
    import json

    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(json.loads(blob[8 : 8 + n])["__metadata__"]["unweight"])["tensors"]["weight"]["codec"]


def header_end(blob: bytes) -> int:
    return 8 + struct.unpack("<Q", blob[:8])[0]


def load_damaged(path: Path, blob: bytes, original: torch.Tensor) -> str:
    """Load a damaged file: a FormatError naming it, or the original bits (the tensor's *name* is
    covered by no checksum in the format, so a renamed tensor counts as the original)."""
    path.write_bytes(blob)
    try:
        got = unweight.load_file(path, threads=1)
    except unweight.FormatError as e:
        assert str(path) in str(e), f"the error does not name the file: {e}"
        return "refused"
    assert len(got) == 1, f"a damaged one-tensor file gave {sorted(got)}"
    (value,) = got.values()
    assert_bit_identical(value, original)
    return "benign"


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory) -> Path:
    """One folder for this module's hypothesis examples (each example overwrites its file)."""
    return tmp_path_factory.mktemp("damaged")


CONTAINER_SIZE = len(valid_container()[0])
HEADER_END = header_end(valid_container()[0])

positions = st.one_of(st.integers(0, HEADER_END - 1), st.integers(0, CONTAINER_SIZE - 1))  # half in the header


def test_whitespace_in_header_padding_is_harmless(tmp_path):
    blob, original = valid_container()
    assert blob[HEADER_END - 1] == 0x20, "this container's header happens to need no padding"
    for ws in b"\t\n\r":
        damaged = blob[: HEADER_END - 1] + bytes([ws]) + blob[HEADER_END:]
        assert load_damaged(tmp_path / "ws.safetensors", damaged, original) == "benign"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes=st.lists(st.tuples(positions, st.integers(0, 255)), min_size=1, max_size=8))
@example(changes=[(HEADER_END - 1, ord("\t"))])  # whitespace in the header padding: harmless
@example(changes=[(HEADER_END - 1, 0xFF)])  # not UTF-8, where padding should be
@example(changes=[(0, 0)])  # header length
@example(changes=[(7, 1)])
@example(changes=[(CONTAINER_SIZE - 1, 0x55)])  # the last state byte
def test_replaced_bytes_are_refused_or_harmless(work_dir, changes):
    blob, original = valid_container()
    damaged = bytearray(blob)
    for pos, value in changes:
        damaged[pos] = value
    path = work_dir / "damaged.safetensors"
    outcome = load_damaged(path, bytes(damaged), original)
    if bytes(damaged) == blob:
        assert outcome == "benign"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(length=st.integers(0, CONTAINER_SIZE - 1))
@example(length=0)
@example(length=5)
@example(length=8)
@example(length=HEADER_END - 1)
@example(length=HEADER_END)
@example(length=CONTAINER_SIZE - 1)
def test_truncated_files_are_refused(work_dir, length):
    blob, original = valid_container()
    path = work_dir / "cut.safetensors"
    assert load_damaged(path, blob[:length], original) == "refused"


@settings(max_examples=30, deadline=None)
@given(extra=st.binary(min_size=1, max_size=64))
def test_appended_bytes_are_refused(work_dir, extra):
    blob, original = valid_container()
    path = work_dir / "longer.safetensors"
    assert load_damaged(path, blob + extra, original) == "refused"
