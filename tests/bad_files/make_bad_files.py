"""(Re)generate the crafted bad files in this folder: hostile or corrupt Unweight containers and
safetensors sources, one rule of SPEC.md broken per file.

    python tests/bad_files/make_bad_files.py            # rewrites tests/bad_files/*.safetensors

Every file starts from one of two small *valid* containers and is edited at the byte level:

- base "A", made with `unweight.save_file`: `weight` BF16 [32, 32] (codec rans, one chunk),
  `bias` F32 [16] (codec raw), `ids` I64 [10] (codec zstd); no source header.
- base "B", made with `unweight.compress(..., chunk=1024)` from a plain safetensors file:
  `weight` BF16 [1501] (codec rans, two chunks, a partial last raw group); source header kept.

A case that edits a stream records the edited stream's CRC-32 (format 1.1's `stream_crc32`), so
that it breaks only its own rule; `tiles_sm_byte_flipped` and the `stream_crc32_*` cases are about
that CRC. Container edits parse the header by hand (SPEC.md §1: 8-byte little-endian length N, N bytes of
JSON padded with spaces to a multiple of 8, then the data) and re-serialise it the way the writer
does, so an unedited round trip is byte-identical (checked below).

The output is deterministic: the tensors come from integer arithmetic and a seeded PCG64, the
codecs are deterministic, and no timestamps or temporary names end up in a file. (A different
zstd library version could in principle compress the I64 tensor differently.)

`CASES` maps each file's stem to (builder, the tensor the error must name or None, the operations
that must refuse it); tests/test_bad_files.py reads it.
"""

from __future__ import annotations

import json
import struct
import sys
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT) not in sys.path:  # runnable as a plain script from anywhere
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import zstandard  # noqa: E402

import unweight  # noqa: E402
from unweight.formats.safetensors_file import write_safetensors  # noqa: E402

# Which operations must refuse a file (tests/test_bad_files.py):
#   "load"       unweight.load_file raises FormatError
#   "verify"     unweight.verify raises FormatError or reports a mismatch
#   "decompress" unweight.decompress raises FormatError
#   "compress"   unweight.compress (of a bad *source* file) raises FormatError
CONTAINER_OPS = ("load", "verify", "decompress")
DECOMPRESS_OPS = ("decompress",)  # the source header only matters when writing the original file back
LOAD_OPS = ("load",)  # only turning the bytes into a torch tensor can fail
VERIFY_OPS = ("verify",)  # only a check of the stored streams (verify, unweight.load) can see it
SOURCE_OPS = ("compress", "load", "verify", "decompress")


# ----------------------------------------------------------------------------------- the bases


def base_tensors() -> dict[str, torch.Tensor]:
    rng = np.random.Generator(np.random.PCG64(20240613))
    w = (rng.standard_normal((32, 32), dtype=np.float32) * np.float32(0.02)).astype(np.float32)
    return {
        "weight": torch.from_numpy(w).to(torch.bfloat16),
        "bias": torch.from_numpy(rng.standard_normal(16, dtype=np.float32)),
        "ids": torch.arange(10, dtype=torch.int64) * 3 - 7,
    }


def base_b_tensor() -> torch.Tensor:
    rng = np.random.Generator(np.random.PCG64(7))
    return torch.from_numpy(rng.standard_normal(1501, dtype=np.float32) * np.float32(0.05)).to(torch.bfloat16)


def base_c_tensor() -> torch.Tensor:
    """A 2-D BF16 weight for the serving layout, with escapes (tiny and large values)."""
    t = base_b_tensor()[:25 * 39].reshape(25, 39).clone()  # 975 elements: the last code group is padded
    t[::5, ::7] = 3.0e-30  # far below the exponent window
    t[1::6, 3::11] = -40.0  # far above it
    return t


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def plain_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """A plain (uncompressed) safetensors file of `tensors`, sorted by name."""
    import io

    dtypes = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64"}
    names = sorted(tensors)
    buf = io.BytesIO()
    write_safetensors(buf, [(n, dtypes[tensors[n].dtype], list(tensors[n].shape)) for n in names], [_bytes_of(tensors[n]) for n in names], metadata)
    return buf.getvalue()


def make_base_a(tmp: Path) -> bytes:
    path = tmp / "a.safetensors"
    unweight.save_file(base_tensors(), path, threads=1)
    return path.read_bytes()


def make_base_c(tmp: Path) -> bytes:
    src = tmp / "c-src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(plain_safetensors({"proj": base_c_tensor()}))
    unweight.compress(src, tmp / "c-out", threads=1, layout="serving")
    return (tmp / "c-out" / "model.safetensors").read_bytes()


def make_base_b(tmp: Path) -> bytes:
    src = tmp / "b-src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(plain_safetensors({"weight": base_b_tensor()}))
    unweight.compress(src, tmp / "b-out", threads=1, chunk=1024)
    return (tmp / "b-out" / "model.safetensors").read_bytes()


# ------------------------------------------------------------------------------- byte editing


@dataclass
class Parsed:
    header: dict  # the JSON header, __metadata__ included, in file order
    data: bytes

    @property
    def meta(self) -> dict:
        return self.header["__metadata__"]

    @property
    def manifest(self) -> dict:
        return json.loads(self.meta["unweight"])

    @manifest.setter
    def manifest(self, m: dict) -> None:
        self.meta["unweight"] = json.dumps(m, separators=(",", ":"))

    def stream(self, name: str) -> bytes:
        b, e = self.header[name]["data_offsets"]
        return self.data[b:e]

    def tensor(self, name: str) -> dict:
        return self.manifest["tensors"][name]

    def edit_tensor(self, name: str, fn: Callable[[dict], None]) -> None:
        m = self.manifest
        fn(m["tensors"][name])
        self.manifest = m

    def replace_streams(self, new: dict[str, bytes], refresh_crcs: bool = True) -> None:
        """Swap the bytes of some streams, keeping stream order and recomputing every offset, and
        (unless told not to) the stream CRC-32s of the manifest, so that the file breaks only the
        rule its case is about."""
        if refresh_crcs:
            m = self.manifest
            for entry in m["tensors"].values():
                for role, stream in entry["streams"].items():
                    if stream in new and "stream_crc32" in entry:
                        entry["stream_crc32"][role] = zlib.crc32(new[stream])
            self.manifest = m
        names = sorted((k for k in self.header if k != "__metadata__"), key=lambda k: self.header[k]["data_offsets"][0])
        parts, cursor = [], 0
        for k in names:
            blob = new.get(k, self.stream(k))
            self.header[k] = {"dtype": "U8", "shape": [len(blob)], "data_offsets": [cursor, cursor + len(blob)]}
            parts.append(blob)
            cursor += len(blob)
        self.data = b"".join(parts)

    def to_bytes(self) -> bytes:
        return pack_header(json.dumps(self.header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")) + self.data


def pad_header(raw: bytes) -> bytes:
    return raw + b" " * (-len(raw) % 8)


def pack_header(raw: bytes, pad: bool = True) -> bytes:
    """The 8-byte length plus the header bytes (space-padded to a multiple of 8 by default)."""
    if pad:
        raw = pad_header(raw)
    return struct.pack("<Q", len(raw)) + raw


def parse(blob: bytes) -> Parsed:
    (n,) = struct.unpack("<Q", blob[:8])
    return Parsed(json.loads(blob[8 : 8 + n].decode("utf-8")), blob[8 + n :])


def header_len(blob: bytes) -> int:
    return struct.unpack("<Q", blob[:8])[0]


def varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def read_varints(blob: bytes) -> list[int]:
    vals, v, shift = [], 0, 0
    for b in blob:
        v |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            vals.append(v)
            v, shift = 0, 0
    assert shift == 0, "table ends inside a varint"
    return vals


def flip(blob: bytes, i: int, mask: int = 0xFF) -> bytes:
    b = bytearray(blob)
    b[i] ^= mask
    return bytes(b)


def index_parts(p: Parsed, tensor: str) -> tuple[list[int], list[int]]:
    """(word offsets, initial states) of a rans tensor's index stream."""
    e = p.tensor(tensor)
    n = 1
    for d in e["shape"]:
        n *= d
    k = -(-n // e["params"]["chunk"])
    idx = p.stream(e["streams"]["index"])
    offsets = list(struct.unpack(f"<{k + 1}Q", idx[: 8 * (k + 1)]))
    rest = idx[8 * (k + 1) :]
    states = list(struct.unpack(f"<{len(rest) // 4}I", rest))
    return offsets, states


def pack_index(offsets: list[int], states: list[int]) -> bytes:
    return struct.pack(f"<{len(offsets)}Q", *offsets) + struct.pack(f"<{len(states)}I", *states)


def zstd_fcs_pos(frame: bytes) -> int:
    """Offset of a zstd frame's 1-byte Frame_Content_Size field (single-segment frames)."""
    assert frame[:4] == b"\x28\xb5\x2f\xfd", "not a zstd frame"
    fhd = frame[4]
    assert fhd >> 6 == 0 and (fhd >> 5) & 1, "expected a single-segment frame with a 1-byte content size"
    return 5 + (0, 1, 2, 4)[fhd & 3]


# ------------------------------------------------------------------------------------- the cases
# Each builder gets the two base containers (bytes) and returns the bad file's bytes.


@dataclass(frozen=True)
class Bases:
    a: bytes
    b: bytes
    c: bytes  # serving layout: one `tiles` tensor "proj"


def _edit(blob: bytes, fn: Callable[[Parsed], None]) -> bytes:
    p = parse(blob)
    fn(p)
    return p.to_bytes()


def _set_meta(key: str, value) -> Callable[[Parsed], None]:
    def fn(p: Parsed) -> None:
        if value is _DELETE:
            del p.meta[key]
        else:
            p.meta[key] = value

    return fn


_DELETE = object()


def _tensor_edit(name: str, fn: Callable[[dict], None]) -> Callable[[Parsed], None]:
    return lambda p: p.edit_tensor(name, fn)


def _set(key: str, value) -> Callable[[dict], None]:
    def fn(d: dict) -> None:
        d[key] = value

    return fn


def _set_param(key: str, value) -> Callable[[dict], None]:
    def fn(d: dict) -> None:
        d["params"][key] = value

    return fn


def _stream_edit(tensor: str, role: str, fn: Callable[[bytes], bytes]) -> Callable[[Parsed], None]:
    def edit(p: Parsed) -> None:
        name = p.tensor(tensor)["streams"][role]
        p.replace_streams({name: fn(p.stream(name))})

    return edit


def _index_edit(tensor: str, fn: Callable[[list[int], list[int]], None]) -> Callable[[Parsed], None]:
    def edit(p: Parsed) -> None:
        offsets, states = index_parts(p, tensor)
        fn(offsets, states)
        p.replace_streams({p.tensor(tensor)["streams"]["index"]: pack_index(offsets, states)})

    return edit


# -- file level


def truncated_in_data(b: Bases) -> bytes:
    return b.a[: len(b.a) - 100]


def truncated_in_header(b: Bases) -> bytes:
    return b.a[: 8 + header_len(b.a) // 2]


def truncated_to_5_bytes(b: Bases) -> bytes:
    return b.a[:5]


def header_length_huge(b: Bases) -> bytes:
    return struct.pack("<Q", 1 << 62) + b.a[8:]


def header_length_past_eof(b: Bases) -> bytes:
    return struct.pack("<Q", len(b.a)) + b.a[8:]


def header_not_json(b: Bases) -> bytes:
    n = header_len(b.a)
    text = b"this is not JSON, it only sits where the header should be"
    return pack_header(text.ljust(n)[:n], pad=False) + b.a[8 + n :]


def header_json_array(b: Bases) -> bytes:
    p = parse(b.a)
    return pack_header(json.dumps([p.header], separators=(",", ":")).encode()) + p.data


def header_invalid_utf8(b: Bases) -> bytes:
    # An extra metadata key is allowed; a byte that is not UTF-8 (0xFF) is not (SPEC §4 rule 2).
    p = parse(b.a)
    p.meta["note"] = "MARK"
    raw = json.dumps(p.header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw = raw.replace(b"MARK", b"\xff\xfe")
    return pack_header(raw) + p.data


def header_not_padded_with_spaces(b: Bases) -> bytes:
    # Bytes after the JSON object that are not whitespace.
    p = parse(b.a)
    raw = json.dumps(p.header, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\x00" * 8
    return pack_header(raw) + p.data


def _header_with(p: Parsed, marker: str, text: str) -> bytes:
    """The container with the JSON value `"<marker>"` in its header replaced by raw `text` (for
    values json.dumps cannot write: numbers of thousands of digits, deep nesting)."""
    raw = json.dumps(p.header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    quoted = json.dumps(marker).encode()
    assert raw.count(quoted) == 1
    return pack_header(raw.replace(quoted, text.encode())) + p.data


def _manifest_with(p: Parsed, marker: str, text: str) -> bytes:
    """The same inside the manifest (itself a JSON string inside the header)."""
    m = p.manifest.copy()
    raw = json.dumps(m, separators=(",", ":"))
    quoted = json.dumps(marker)
    assert raw.count(quoted) == 1
    p.meta["unweight"] = raw.replace(quoted, text)
    return p.to_bytes()


LONG_NUMBER = "7" * 4400  # Python refuses to convert integers of more than 4300 digits
DEEP_LIST = "[" * 2000 + "]" * 2000  # deeper than Python's recursion limit


def header_number_too_long(b: Bases) -> bytes:
    p = parse(b.a)
    p.header["weight#table"]["data_offsets"][1] = "MARK"
    return _header_with(p, "MARK", LONG_NUMBER)


def header_deeply_nested(b: Bases) -> bytes:
    p = parse(b.a)
    p.header["weight#table"]["dtype"] = "MARK"
    return _header_with(p, "MARK", DEEP_LIST)


# -- stream table (safetensors header entries)


def stream_entry_extra_key(b: Bases) -> bytes:
    return _edit(b.a, lambda p: p.header["weight#table"].__setitem__("extra", 1))


def stream_offsets_out_of_range(b: Bases) -> bytes:
    def fn(p: Parsed) -> None:
        e = p.header["weight#index"]
        e["data_offsets"][1] += 64
        e["shape"] = [e["shape"][0] + 64]

    return _edit(b.a, fn)


def stream_offsets_overlap(b: Bases) -> bytes:
    def fn(p: Parsed) -> None:
        e = p.header["weight#raw"]  # starts 8 bytes early: overlaps weight#table, leaves 8 bytes uncovered
        e["data_offsets"] = [e["data_offsets"][0] - 8, e["data_offsets"][1] - 8]

    return _edit(b.a, fn)


def stream_offsets_gap(b: Bases) -> bytes:
    def fn(p: Parsed) -> None:
        start = p.header["weight#raw"]["data_offsets"][0]
        for k, e in p.header.items():  # 8 junk bytes before weight#raw, every later stream moves up
            if k != "__metadata__" and e["data_offsets"][0] >= start:
                e["data_offsets"] = [e["data_offsets"][0] + 8, e["data_offsets"][1] + 8]
        p.data = p.data[:start] + b"\xaa" * 8 + p.data[start:]

    return _edit(b.a, fn)


def stream_shape_mismatches_offsets(b: Bases) -> bytes:
    return _edit(b.a, lambda p: p.header["weight#words"].__setitem__("shape", [p.header["weight#words"]["shape"][0] - 2]))


def stream_dtype_not_u8(b: Bases) -> bytes:
    def fn(p: Parsed) -> None:
        e = p.header["weight#words"]  # U16 of half the length: a valid safetensors entry, not a stream
        e["dtype"], e["shape"] = "U16", [e["shape"][0] // 2]

    return _edit(b.a, fn)


def stream_dtype_not_a_string(b: Bases) -> bytes:
    return _edit(b.a, lambda p: p.header["weight#table"].__setitem__("dtype", ["U8"]))


def stream_not_referenced(b: Bases) -> bytes:
    def fn(p: Parsed) -> None:
        p.header["orphan"] = {"dtype": "U8", "shape": [8], "data_offsets": [len(p.data), len(p.data) + 8]}
        p.data += b"\x00" * 8

    return _edit(b.a, fn)


def placeholder_not_empty(b: Bases) -> bytes:
    # weight's placeholder (SPEC.md §1) holds a byte: a plain reader would load it as data
    def fn(p: Parsed) -> None:
        p.header["weight"] = {"dtype": "U8", "shape": [1], "data_offsets": [len(p.data), len(p.data) + 1]}
        p.data += b"\x00"

    return _edit(b.a, fn)


def placeholder_not_u8(b: Bases) -> bytes:
    def fn(p: Parsed) -> None:
        p.header["weight"] = {"dtype": "BF16", "shape": [0], "data_offsets": [0, 0]}

    return _edit(b.a, fn)


def trailing_bytes_after_streams(b: Bases) -> bytes:
    return b.a + b"\x00" * 16


# -- metadata


def metadata_format_missing(b: Bases) -> bytes:
    return _edit(b.a, _set_meta("format", _DELETE))


def plain_safetensors_file(b: Bases) -> bytes:
    return plain_safetensors(base_tensors())


def format_version_3_0(b: Bases) -> bytes:
    return _edit(b.a, _set_meta("format_version", "3.0"))


def format_version_garbage(b: Bases) -> bytes:
    return _edit(b.a, _set_meta("format_version", "one point oh"))


def format_version_missing(b: Bases) -> bytes:
    return _edit(b.a, _set_meta("format_version", _DELETE))


def metadata_value_not_a_string(b: Bases) -> bytes:
    return _edit(b.a, _set_meta("format_version", 1.0))


# -- manifest


def manifest_not_json(b: Bases) -> bytes:
    return _edit(b.a, _set_meta("unweight", '{"tensors": {"weight": '))


def manifest_missing(b: Bases) -> bytes:
    return _edit(b.a, _set_meta("unweight", _DELETE))


def manifest_tensors_not_an_object(b: Bases) -> bytes:
    return _edit(b.a, _set_meta("unweight", json.dumps({"tensors": [], "source_header": None})))


def manifest_number_too_long(b: Bases) -> bytes:
    p = parse(b.a)
    p.edit_tensor("weight", lambda d: d.__setitem__("crc32", "MARK"))
    return _manifest_with(p, "MARK", LONG_NUMBER)


def manifest_deeply_nested(b: Bases) -> bytes:
    p = parse(b.a)
    p.edit_tensor("weight", lambda d: d["params"].__setitem__("precision", "MARK"))
    return _manifest_with(p, "MARK", DEEP_LIST)


def manifest_empty_tensor_dim_past_int64(b: Bases) -> bytes:
    # An empty tensor (0 bytes, so within the 2^48-byte limit) with a dimension of 2^64, which
    # no tensor library can represent.
    def fn(p: Parsed) -> None:
        p.edit_tensor("bias", lambda d: d.update(shape=[0, 1 << 64], crc32=zlib.crc32(b"")))
        p.replace_streams({"bias#data": b""})

    return _edit(b.a, fn)


def manifest_tensor_named_metadata(b: Bases) -> bytes:
    # safetensors reserves the key __metadata__: a file decompressed with such a tensor would not load.
    def fn(p: Parsed) -> None:
        m = p.manifest
        m["tensors"]["__metadata__"] = m["tensors"].pop("bias")
        p.manifest = m

    return _edit(b.a, fn)


def manifest_missing_stream_reference(b: Bases) -> bytes:
    # weight no longer lists its words stream: the stream belongs to no tensor, the role is missing.
    return _edit(b.a, _tensor_edit("weight", lambda d: d["streams"].pop("words")))


def manifest_references_missing_stream(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("weight", lambda d: d["streams"].__setitem__("words", "weight#nowhere")))


def manifest_stream_used_twice(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("ids", lambda d: d["streams"].__setitem__("data", "bias#data")))


def manifest_entry_missing_crc32(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("bias", lambda d: d.pop("crc32")))


def manifest_unknown_dtype(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("bias", _set("dtype", "F31")))


def manifest_dtype_not_a_string(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("bias", _set("dtype", ["F32"])))


def manifest_shape_negative(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("weight", _set("shape", [-32, -32])))


def manifest_shape_too_big(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("weight", _set("shape", [1 << 40, 1 << 40])))


def manifest_shape_wrong(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("weight", _set("shape", [32, 31])))


def manifest_shape_not_a_list(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("weight", _set("shape", 1024)))


def codec_unknown_palette(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("weight", _set("codec", "palette")))


def codec_raw_with_wrong_length(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("bias", _set("shape", [15])))


def codec_zstd_with_params(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("ids", _set("params", {"level": 10})))


def codec_roles_of_another_codec(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("weight", _set("codec", "zstd")))


# -- rans parameters


def rans_precision_16(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("weight", _set_param("precision", 16)))


def rans_chunk_1000(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("weight", _set_param("chunk", 1000)))


def rans_word_bits_12(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("weight", _set_param("word_bits", 12)))


def rans_word_bits_not_the_dtype(b: Bases) -> bytes:
    def fn(d: dict) -> None:
        d["params"].update(word_bits=8, sym_bits=8)

    return _edit(b.a, _tensor_edit("weight", fn))


def rans_transpose_of_a_2d_tensor(b: Bases) -> bytes:  # (format 2.1: only 3-D tensors are coded transposed)
    return _edit(b.a, _tensor_edit("weight", _set_param("transpose", True)))


def rans_transpose_not_a_bool(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("weight", _set_param("transpose", 1)))


def rans_rotate_not_a_bool(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("weight", _set_param("rotate", 1)))


def rans_params_missing(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("weight", lambda d: d.pop("params")))


def rans_params_extra_key(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("weight", _set_param("lanes", 4)))


# -- rans table


def _table_edit(fn: Callable[[list[int]], bytes]) -> Callable[[bytes], bytes]:
    return lambda blob: fn(read_varints(blob))


def rans_table_sum_wrong(b: Bases) -> bytes:
    def fn(vals: list[int]) -> bytes:
        i = 2 + max(range(len(vals) - 2), key=lambda j: vals[2 + j])  # the largest frequency, minus one
        vals[i] -= 1
        return b"".join(varint(v) for v in vals)

    return _edit(b.a, _stream_edit("weight", "table", _table_edit(fn)))


def rans_table_varint_6_bytes(b: Bases) -> bytes:
    def fn(vals: list[int]) -> bytes:
        lo = vals[0]  # the same value, spelled in six bytes (overlong)
        six = bytes([(lo & 0x7F) | 0x80, ((lo >> 7) & 0x7F) | 0x80, 0x80, 0x80, 0x80, 0x00])
        return six + b"".join(varint(v) for v in vals[1:])

    return _edit(b.a, _stream_edit("weight", "table", _table_edit(fn)))


def rans_table_ends_inside_varint(b: Bases) -> bytes:
    return _edit(b.a, _stream_edit("weight", "table", lambda blob: blob + b"\x80"))


def rans_table_past_alphabet(b: Bases) -> bytes:
    def fn(vals: list[int]) -> bytes:
        vals[0] = 1024 - vals[1] + 1  # lo + count = 1025 > 2^10
        return b"".join(varint(v) for v in vals)

    return _edit(b.a, _stream_edit("weight", "table", _table_edit(fn)))


def rans_table_count_mismatch(b: Bases) -> bytes:
    def fn(vals: list[int]) -> bytes:
        vals[1] += 1  # declares one frequency more than it holds
        return b"".join(varint(v) for v in vals)

    return _edit(b.a, _stream_edit("weight", "table", _table_edit(fn)))


def rans_table_empty(b: Bases) -> bytes:
    return _edit(b.a, _stream_edit("weight", "table", lambda blob: b""))


# -- rans index


def rans_index_offsets_decreasing(b: Bases) -> bytes:
    def fn(offsets: list[int], states: list[int]) -> None:
        assert len(offsets) == 3
        offsets[1] = offsets[2] + 1  # 0, last+1, last: starts at 0, ends at the word count, decreases

    return _edit(b.b, _index_edit("weight", fn))


def rans_index_offsets_not_ending_at_word_count(b: Bases) -> bytes:
    def fn(offsets: list[int], states: list[int]) -> None:
        offsets[-1] -= 1

    return _edit(b.b, _index_edit("weight", fn))


def rans_index_first_offset_not_zero(b: Bases) -> bytes:
    def fn(offsets: list[int], states: list[int]) -> None:
        offsets[0] = 1

    return _edit(b.b, _index_edit("weight", fn))


def rans_index_offset_huge(b: Bases) -> bytes:
    def fn(offsets: list[int], states: list[int]) -> None:
        offsets[1] = (1 << 64) - 1

    return _edit(b.b, _index_edit("weight", fn))


def rans_index_wrong_length(b: Bases) -> bytes:
    return _edit(b.a, _stream_edit("weight", "index", lambda blob: blob[:-4]))


def rans_state_below_2_16(b: Bases) -> bytes:
    def fn(offsets: list[int], states: list[int]) -> None:
        states[0] = 0x1234

    return _edit(b.a, _index_edit("weight", fn))


def rans_state_changed(b: Bases) -> bytes:
    def fn(offsets: list[int], states: list[int]) -> None:
        states[1] ^= 0x00010000  # still in [2^16, 2^32), but not the encoder's

    return _edit(b.a, _index_edit("weight", fn))


def rans_second_chunk_state_below_2_16(b: Bases) -> bytes:
    def fn(offsets: list[int], states: list[int]) -> None:
        states[-1] = 0

    return _edit(b.b, _index_edit("weight", fn))


# -- rans words and raw fields


def rans_words_byte_flipped(b: Bases) -> bytes:
    return _edit(b.a, _stream_edit("weight", "words", lambda blob: flip(blob, len(blob) // 2)))


def rans_words_first_byte_flipped(b: Bases) -> bytes:
    return _edit(b.b, _stream_edit("weight", "words", lambda blob: flip(blob, 0, 0x10)))


def rans_words_odd_length(b: Bases) -> bytes:
    return _edit(b.a, _stream_edit("weight", "words", lambda blob: blob[:-1]))


def rans_words_swapped_chunks(b: Bases) -> bytes:
    # Same words and states, with chunk 1's words moved in front: every check but decoding passes.
    def edit(p: Parsed) -> None:
        offsets, states = index_parts(p, "weight")
        words = p.stream("weight#words")
        a, m, z = offsets[0] * 2, offsets[1] * 2, offsets[2] * 2
        p.replace_streams({"weight#words": words[m:z] + words[a:m]})

    return _edit(b.b, edit)


def rans_raw_byte_flipped(b: Bases) -> bytes:
    return _edit(b.a, _stream_edit("weight", "raw", lambda blob: flip(blob, 5)))


def rans_raw_padding_not_zero(b: Bases) -> bytes:
    # 1501 elements: the last group of four holds one, so its top 18 bits are padding.
    return _edit(b.b, _stream_edit("weight", "raw", lambda blob: flip(blob, len(blob) - 1, 0x80)))


def rans_raw_wrong_length(b: Bases) -> bytes:
    return _edit(b.a, _stream_edit("weight", "raw", lambda blob: blob + b"\x00\x00\x00"))


# -- checksums and the other codecs


def raw_data_byte_flipped(b: Bases) -> bytes:
    return _edit(b.a, _stream_edit("bias", "data", lambda blob: flip(blob, 7)))


def crc32_changed(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("weight", lambda d: d.__setitem__("crc32", d["crc32"] ^ 1)))


def crc32_out_of_range(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("ids", lambda d: d.__setitem__("crc32", d["crc32"] + (1 << 32))))


def crc32_not_an_integer(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("ids", lambda d: d.__setitem__("crc32", str(d["crc32"]))))


def tiles_sm_byte_flipped(b: Bases) -> bytes:
    """Damage as a disk makes it: a stream byte changed, its recorded CRC-32 left as it was."""
    def edit(p: Parsed) -> None:
        name = p.tensor("proj")["streams"]["sm"]
        p.replace_streams({name: flip(p.stream(name), 11)}, refresh_crcs=False)

    return _edit(b.c, edit)


def stream_crc32_changed(b: Bases) -> bytes:
    """The streams are intact, one recorded stream CRC-32 is not: a decode (which checks the CRC of
    the original bytes) gets the tensor right; verify and unweight.load refuse it."""
    return _edit(b.c, _tensor_edit("proj", lambda d: d["stream_crc32"].__setitem__("esc", d["stream_crc32"]["esc"] ^ 1)))


def stream_crc32_not_an_integer(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("weight", lambda d: d["stream_crc32"].__setitem__("raw", str(d["stream_crc32"]["raw"]))))


def stream_crc32_missing_role(b: Bases) -> bytes:
    return _edit(b.a, _tensor_edit("weight", lambda d: d["stream_crc32"].pop("words")))


def zstd_declares_wrong_size(b: Bases) -> bytes:
    def fn(blob: bytes) -> bytes:
        i = zstd_fcs_pos(blob)
        assert blob[i] == 80
        return blob[:i] + bytes([72]) + blob[i + 1 :]

    return _edit(b.a, _stream_edit("ids", "data", fn))


def zstd_holds_more_than_declared(b: Bases) -> bytes:
    # A frame of 88 bytes whose header claims the tensor's 80: must not expand past 80.
    def fn(blob: bytes) -> bytes:
        frame = zstandard.ZstdCompressor(level=10, write_content_size=True).compress(bytes(range(88)))
        i = zstd_fcs_pos(frame)
        assert frame[i] == 88
        return frame[:i] + bytes([80]) + frame[i + 1 :]

    return _edit(b.a, _stream_edit("ids", "data", fn))


def zstd_no_content_size(b: Bases) -> bytes:
    def fn(blob: bytes) -> bytes:
        original = _bytes_of(base_tensors()["ids"]).tobytes()
        return zstandard.ZstdCompressor(level=10, write_content_size=False).compress(original)

    return _edit(b.a, _stream_edit("ids", "data", fn))


def zstd_not_a_frame(b: Bases) -> bytes:
    return _edit(b.a, _stream_edit("ids", "data", lambda blob: b"\x00" * len(blob)))


def zstd_empty_stream(b: Bases) -> bytes:
    return _edit(b.a, _stream_edit("ids", "data", lambda blob: b""))


def zstd_declares_huge_size(b: Bases) -> bytes:
    # I64 [2^45] is 2^48 bytes, the largest tensor SPEC §4 allows; the frame declares exactly that
    # size (so every declared-size check passes) and holds one 16-byte RLE block.
    size = 1 << 48
    block = 1 | (1 << 1) | (16 << 3)  # last block, type RLE, 16 bytes
    frame = b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + struct.pack("<Q", size) + struct.pack("<I", block)[:3] + b"\x07"

    def fn(p: Parsed) -> None:
        p.edit_tensor("ids", _set("shape", [size // 8]))
        p.replace_streams({"ids#data": frame})

    return _edit(b.a, fn)


def zstd_trailing_bytes(b: Bases) -> bytes:
    # SPEC §3.2: the data stream is *one* frame; eight bytes after it are not part of any tensor.
    return _edit(b.a, _stream_edit("ids", "data", lambda blob: blob + b"trailing"))


def zstd_frame_byte_flipped(b: Bases) -> bytes:
    return _edit(b.a, _stream_edit("ids", "data", lambda blob: flip(blob, len(blob) - 3)))


# -- source header (used when decompressing back to the original file)


def source_header_lists_other_tensor(b: Bases) -> bytes:
    def fn(p: Parsed) -> None:
        m = p.manifest
        m["source_header"] = m["source_header"].replace('"weight"', '"wieght"')
        p.manifest = m

    return _edit(b.b, fn)


def source_header_wrong_shape(b: Bases) -> bytes:
    def fn(p: Parsed) -> None:
        m = p.manifest
        m["source_header"] = m["source_header"].replace('"dtype":"BF16","shape":[1501]', '"dtype":"F16","shape":[1501]')
        assert '"F16"' in m["source_header"]
        p.manifest = m

    return _edit(b.b, fn)


def source_header_offsets_out_of_range(b: Bases) -> bytes:
    def fn(p: Parsed) -> None:
        m = p.manifest
        m["source_header"] = m["source_header"].replace("[0,3002]", "[2,3004]")
        assert "[2,3004]" in m["source_header"]
        p.manifest = m

    return _edit(b.b, fn)


def source_header_not_a_string(b: Bases) -> bytes:
    def fn(p: Parsed) -> None:
        m = p.manifest
        m["source_header"] = {"weight": {}}
        p.manifest = m

    return _edit(b.b, fn)


# -- bad *sources*: plain safetensors files that unweight.compress must refuse


def source_file_invalid_utf8_header(b: Bases) -> bytes:
    blob = plain_safetensors({"weight": base_b_tensor()}, metadata={"note": "MARK"})
    n = header_len(blob)
    head = blob[8 : 8 + n].replace(b"MARK", b"\xff\xfe\xfd\xfc")
    return struct.pack("<Q", n) + head + blob[8 + n :]


def source_file_offsets_overlap(b: Bases) -> bytes:
    p = parse(plain_safetensors(base_tensors()))
    p.header["ids"]["data_offsets"] = [p.header["ids"]["data_offsets"][0] - 8, p.header["ids"]["data_offsets"][1] - 8]
    return pack_header(json.dumps(p.header, separators=(",", ":")).encode()) + p.data


def source_file_truncated(b: Bases) -> bytes:
    blob = plain_safetensors(base_tensors())
    return blob[:-10]


# -- the serving layout (`tiles`, base C)


def _u32(blob: bytes) -> list[int]:
    return list(np.frombuffer(blob, dtype="<u4"))


def _pack_u32(vals: list[int]) -> bytes:
    return np.asarray(vals, dtype="<u4").tobytes()


def tiles_esc_index_off_by_one(b: Bases) -> bytes:
    return _edit(b.c, _stream_edit("proj", "esc_index", lambda x: _pack_u32([v + (i == 3) for i, v in enumerate(_u32(x))])))


def tiles_esc_index_short(b: Bases) -> bytes:
    return _edit(b.c, _stream_edit("proj", "esc_index", lambda x: x[:-4]))


def tiles_esc_extra_byte(b: Bases) -> bytes:
    return _edit(b.c, _stream_edit("proj", "esc", lambda x: x + b"\x7f"))


def tiles_escape_code_cleared(b: Bases) -> bytes:
    return _edit(b.c, _stream_edit("proj", "codes", lambda x: bytes(3) + x[3:]))  # element 0 escaped


def tiles_codes_padding_bits_set(b: Bases) -> bytes:
    return _edit(b.c, _stream_edit("proj", "codes", lambda x: x[:-1] + bytes([x[-1] | 0x80])))


def tiles_base_out_of_range(b: Bases) -> bytes:
    return _edit(b.c, _tensor_edit("proj", _set_param("base", 250)))


def tiles_block_not_multiple_of_8(b: Bases) -> bytes:
    return _edit(b.c, _tensor_edit("proj", _set_param("block", 100)))


def tiles_on_a_1d_shape(b: Bases) -> bytes:
    return _edit(b.c, _tensor_edit("proj", _set("shape", [975])))


# ------------------------------------------------------------------------------------ the table

CASES: dict[str, tuple[Callable[[Bases], bytes], str | None, tuple[str, ...]]] = {
    # name: (builder, tensor the error must name (None: file-level), operations that must refuse it)
    "truncated_in_data": (truncated_in_data, None, CONTAINER_OPS),
    "tiles_esc_index_off_by_one": (tiles_esc_index_off_by_one, "proj", CONTAINER_OPS),
    "tiles_esc_index_short": (tiles_esc_index_short, "proj", CONTAINER_OPS),
    "tiles_esc_extra_byte": (tiles_esc_extra_byte, "proj", CONTAINER_OPS),
    "tiles_escape_code_cleared": (tiles_escape_code_cleared, "proj", CONTAINER_OPS),
    "tiles_codes_padding_bits_set": (tiles_codes_padding_bits_set, "proj", CONTAINER_OPS),
    "tiles_base_out_of_range": (tiles_base_out_of_range, "proj", CONTAINER_OPS),
    "tiles_block_not_multiple_of_8": (tiles_block_not_multiple_of_8, "proj", CONTAINER_OPS),
    "tiles_on_a_1d_shape": (tiles_on_a_1d_shape, "proj", CONTAINER_OPS),
    "truncated_in_header": (truncated_in_header, None, CONTAINER_OPS),
    "truncated_to_5_bytes": (truncated_to_5_bytes, None, CONTAINER_OPS),
    "header_length_huge": (header_length_huge, None, CONTAINER_OPS),
    "header_length_past_eof": (header_length_past_eof, None, CONTAINER_OPS),
    "header_not_json": (header_not_json, None, CONTAINER_OPS),
    "header_json_array": (header_json_array, None, CONTAINER_OPS),
    "header_invalid_utf8": (header_invalid_utf8, None, CONTAINER_OPS),
    "header_not_padded_with_spaces": (header_not_padded_with_spaces, None, CONTAINER_OPS),
    "header_number_too_long": (header_number_too_long, None, CONTAINER_OPS),
    "header_deeply_nested": (header_deeply_nested, None, CONTAINER_OPS),
    "stream_entry_extra_key": (stream_entry_extra_key, "weight#table", CONTAINER_OPS),
    "stream_offsets_out_of_range": (stream_offsets_out_of_range, "weight#index", CONTAINER_OPS),
    "stream_offsets_overlap": (stream_offsets_overlap, "weight#raw", CONTAINER_OPS),
    "stream_offsets_gap": (stream_offsets_gap, "weight#raw", CONTAINER_OPS),
    "stream_shape_mismatches_offsets": (stream_shape_mismatches_offsets, "weight#words", CONTAINER_OPS),
    "stream_dtype_not_u8": (stream_dtype_not_u8, "weight", CONTAINER_OPS),
    "stream_dtype_not_a_string": (stream_dtype_not_a_string, "weight#table", CONTAINER_OPS),
    "stream_not_referenced": (stream_not_referenced, "orphan", CONTAINER_OPS),
    "placeholder_not_empty": (placeholder_not_empty, "weight", CONTAINER_OPS),
    "placeholder_not_u8": (placeholder_not_u8, "weight", CONTAINER_OPS),
    "trailing_bytes_after_streams": (trailing_bytes_after_streams, None, CONTAINER_OPS),
    "metadata_format_missing": (metadata_format_missing, None, CONTAINER_OPS),
    "plain_safetensors_file": (plain_safetensors_file, None, CONTAINER_OPS),
    "format_version_3_0": (format_version_3_0, None, CONTAINER_OPS),
    "format_version_garbage": (format_version_garbage, None, CONTAINER_OPS),
    "format_version_missing": (format_version_missing, None, CONTAINER_OPS),
    "metadata_value_not_a_string": (metadata_value_not_a_string, None, CONTAINER_OPS),
    "manifest_not_json": (manifest_not_json, None, CONTAINER_OPS),
    "manifest_missing": (manifest_missing, None, CONTAINER_OPS),
    "manifest_tensors_not_an_object": (manifest_tensors_not_an_object, None, CONTAINER_OPS),
    "manifest_number_too_long": (manifest_number_too_long, None, CONTAINER_OPS),
    "manifest_deeply_nested": (manifest_deeply_nested, None, CONTAINER_OPS),
    "manifest_empty_tensor_dim_past_int64": (manifest_empty_tensor_dim_past_int64, "bias", LOAD_OPS),
    "manifest_tensor_named_metadata": (manifest_tensor_named_metadata, "__metadata__", CONTAINER_OPS),
    "manifest_missing_stream_reference": (manifest_missing_stream_reference, "weight", CONTAINER_OPS),
    "manifest_references_missing_stream": (manifest_references_missing_stream, "weight", CONTAINER_OPS),
    "manifest_stream_used_twice": (manifest_stream_used_twice, "bias", CONTAINER_OPS),
    "manifest_entry_missing_crc32": (manifest_entry_missing_crc32, "bias", CONTAINER_OPS),
    "manifest_unknown_dtype": (manifest_unknown_dtype, "bias", CONTAINER_OPS),
    "manifest_dtype_not_a_string": (manifest_dtype_not_a_string, "bias", CONTAINER_OPS),
    "manifest_shape_negative": (manifest_shape_negative, "weight", CONTAINER_OPS),
    "manifest_shape_too_big": (manifest_shape_too_big, "weight", CONTAINER_OPS),
    "manifest_shape_wrong": (manifest_shape_wrong, "weight", CONTAINER_OPS),
    "manifest_shape_not_a_list": (manifest_shape_not_a_list, "weight", CONTAINER_OPS),
    "codec_unknown_palette": (codec_unknown_palette, "weight", CONTAINER_OPS),
    "codec_raw_with_wrong_length": (codec_raw_with_wrong_length, "bias", CONTAINER_OPS),
    "codec_zstd_with_params": (codec_zstd_with_params, "ids", CONTAINER_OPS),
    "codec_roles_of_another_codec": (codec_roles_of_another_codec, "weight", CONTAINER_OPS),
    "rans_precision_16": (rans_precision_16, "weight", CONTAINER_OPS),
    "rans_chunk_1000": (rans_chunk_1000, "weight", CONTAINER_OPS),
    "rans_word_bits_12": (rans_word_bits_12, "weight", CONTAINER_OPS),
    "rans_word_bits_not_the_dtype": (rans_word_bits_not_the_dtype, "weight", CONTAINER_OPS),
    "rans_transpose_of_a_2d_tensor": (rans_transpose_of_a_2d_tensor, "weight", CONTAINER_OPS),
    "rans_transpose_not_a_bool": (rans_transpose_not_a_bool, "weight", CONTAINER_OPS),
    "rans_rotate_not_a_bool": (rans_rotate_not_a_bool, "weight", CONTAINER_OPS),
    "rans_params_missing": (rans_params_missing, "weight", CONTAINER_OPS),
    "rans_params_extra_key": (rans_params_extra_key, "weight", CONTAINER_OPS),
    "rans_table_sum_wrong": (rans_table_sum_wrong, "weight", CONTAINER_OPS),
    "rans_table_varint_6_bytes": (rans_table_varint_6_bytes, "weight", CONTAINER_OPS),
    "rans_table_ends_inside_varint": (rans_table_ends_inside_varint, "weight", CONTAINER_OPS),
    "rans_table_past_alphabet": (rans_table_past_alphabet, "weight", CONTAINER_OPS),
    "rans_table_count_mismatch": (rans_table_count_mismatch, "weight", CONTAINER_OPS),
    "rans_table_empty": (rans_table_empty, "weight", CONTAINER_OPS),
    "rans_index_offsets_decreasing": (rans_index_offsets_decreasing, "weight", CONTAINER_OPS),
    "rans_index_offsets_not_ending_at_word_count": (rans_index_offsets_not_ending_at_word_count, "weight", CONTAINER_OPS),
    "rans_index_first_offset_not_zero": (rans_index_first_offset_not_zero, "weight", CONTAINER_OPS),
    "rans_index_offset_huge": (rans_index_offset_huge, "weight", CONTAINER_OPS),
    "rans_index_wrong_length": (rans_index_wrong_length, "weight", CONTAINER_OPS),
    "rans_state_below_2_16": (rans_state_below_2_16, "weight", CONTAINER_OPS),
    "rans_state_changed": (rans_state_changed, "weight", CONTAINER_OPS),
    "rans_second_chunk_state_below_2_16": (rans_second_chunk_state_below_2_16, "weight", CONTAINER_OPS),
    "rans_words_byte_flipped": (rans_words_byte_flipped, "weight", CONTAINER_OPS),
    "rans_words_first_byte_flipped": (rans_words_first_byte_flipped, "weight", CONTAINER_OPS),
    "rans_words_odd_length": (rans_words_odd_length, "weight", CONTAINER_OPS),
    "rans_words_swapped_chunks": (rans_words_swapped_chunks, "weight", CONTAINER_OPS),
    "rans_raw_byte_flipped": (rans_raw_byte_flipped, "weight", CONTAINER_OPS),
    "rans_raw_padding_not_zero": (rans_raw_padding_not_zero, "weight", CONTAINER_OPS),
    "rans_raw_wrong_length": (rans_raw_wrong_length, "weight", CONTAINER_OPS),
    "raw_data_byte_flipped": (raw_data_byte_flipped, "bias", CONTAINER_OPS),
    "crc32_changed": (crc32_changed, "weight", CONTAINER_OPS),
    "crc32_out_of_range": (crc32_out_of_range, "ids", CONTAINER_OPS),
    "crc32_not_an_integer": (crc32_not_an_integer, "ids", CONTAINER_OPS),
    "tiles_sm_byte_flipped": (tiles_sm_byte_flipped, "proj", CONTAINER_OPS),
    "stream_crc32_changed": (stream_crc32_changed, "proj", VERIFY_OPS),
    "stream_crc32_not_an_integer": (stream_crc32_not_an_integer, "weight", CONTAINER_OPS),
    "stream_crc32_missing_role": (stream_crc32_missing_role, "weight", CONTAINER_OPS),
    "zstd_declares_wrong_size": (zstd_declares_wrong_size, "ids", CONTAINER_OPS),
    "zstd_holds_more_than_declared": (zstd_holds_more_than_declared, "ids", CONTAINER_OPS),
    "zstd_no_content_size": (zstd_no_content_size, "ids", CONTAINER_OPS),
    "zstd_not_a_frame": (zstd_not_a_frame, "ids", CONTAINER_OPS),
    "zstd_empty_stream": (zstd_empty_stream, "ids", CONTAINER_OPS),
    "zstd_declares_huge_size": (zstd_declares_huge_size, "ids", CONTAINER_OPS),
    "zstd_trailing_bytes": (zstd_trailing_bytes, "ids", CONTAINER_OPS),
    "zstd_frame_byte_flipped": (zstd_frame_byte_flipped, "ids", CONTAINER_OPS),
    "source_header_lists_other_tensor": (source_header_lists_other_tensor, "weight", DECOMPRESS_OPS),
    "source_header_wrong_shape": (source_header_wrong_shape, "weight", DECOMPRESS_OPS),
    "source_header_offsets_out_of_range": (source_header_offsets_out_of_range, "weight", DECOMPRESS_OPS),
    "source_header_not_a_string": (source_header_not_a_string, None, CONTAINER_OPS),
    "source_file_invalid_utf8_header": (source_file_invalid_utf8_header, None, SOURCE_OPS),
    "source_file_offsets_overlap": (source_file_offsets_overlap, "ids", SOURCE_OPS),
    "source_file_truncated": (source_file_truncated, None, SOURCE_OPS),
}


def _check_bases(bases: Bases) -> None:
    """The bases are what the cases assume, and an unedited parse/serialise round trip is exact."""
    for blob in (bases.a, bases.b, bases.c):
        assert parse(blob).to_bytes() == blob, "header re-serialisation is not byte-identical"
    c = parse(bases.c).manifest["tensors"]["proj"]
    assert c["codec"] == "tiles" and len(parse(bases.c).stream(c["streams"]["esc"])) > 0, c
    a = parse(bases.a).manifest["tensors"]
    assert {k: v["codec"] for k, v in a.items()} == {"weight": "rans", "bias": "raw", "ids": "zstd"}, a
    bm = parse(bases.b).manifest
    assert bm["tensors"]["weight"]["codec"] == "rans" and bm["tensors"]["weight"]["params"]["chunk"] == 1024
    assert isinstance(bm["source_header"], str)
    ids = _bytes_of(base_tensors()["ids"])
    assert zlib.crc32(ids.tobytes()) == a["ids"]["crc32"]
    for blob in (bases.a, bases.b, bases.c):  # format 1.1: every stream's CRC-32 is recorded
        p = parse(blob)
        for t in p.manifest["tensors"].values():
            assert t["stream_crc32"] == {role: zlib.crc32(p.stream(s)) for role, s in t["streams"].items()}, t


def build_all() -> dict[str, bytes]:
    """Every case's bytes, by file stem."""
    with tempfile.TemporaryDirectory(prefix="unweight-bad-files-") as tmp:
        bases = Bases(make_base_a(Path(tmp)), make_base_b(Path(tmp)), make_base_c(Path(tmp)))
    _check_bases(bases)
    out = {}
    for name, (builder, _, _) in CASES.items():
        blob = builder(bases)
        assert blob not in (bases.a, bases.b, bases.c), f"{name}: the edit changed nothing"
        out[name] = blob
    return out


def main(out_dir: str | Path | None = None) -> list[Path]:
    """Write every case to `out_dir` (default: this folder) as <name>.safetensors; stale
    *.safetensors files there are removed. Returns the written paths, sorted."""
    out_dir = Path(out_dir) if out_dir is not None else HERE
    out_dir.mkdir(parents=True, exist_ok=True)
    blobs = build_all()
    for old in out_dir.glob("*.safetensors"):
        if old.stem not in blobs:
            old.unlink()
    paths = []
    for name, blob in blobs.items():
        path = out_dir / f"{name}.safetensors"
        path.write_bytes(blob)
        paths.append(path)
    return sorted(paths)


if __name__ == "__main__":
    written = main(sys.argv[1] if len(sys.argv) > 1 else None)
    total = sum(p.stat().st_size for p in written)
    print(f"wrote {len(written)} files, {total} bytes, to {written[0].parent if written else '-'}")
