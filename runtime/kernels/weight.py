"""The resident compressed weight: one typed value per layout, what every launcher takes and every
layer holds.

A weight W (rows, cols) in BF16 (or in INT4 codes and BF16 group scales) lies in memory as a few
byte streams plus a handful of layout numbers. Each kind below holds its streams (torch tensors on
one device), W's shape and the layout parameters the kernels need, validated once when the value
is made; the launchers (cpu_gemv.py, qtiles_matmul.py, qtiles_decode.py, cpu_int4.py) take the
value and hand the numba or Triton kernels its streams and numbers as flat arguments.

| kind | layout | device | streams | parameters |
| --- | --- | --- | --- | --- |
| `TilesWeight` | `tiles` (unweight/codec/tiles.py), stored | CPU | sm, codes, esc, esc_index | base, block |
| `QTilesWeight` | `qtiles` (qtiles.py), resident | CUDA | sm, codes, base, esc_row, esc_col, esc_exp | mode |
| `Int4Weight` | `int4` (int4.py) | CPU | sym, esc, esc_row, smant, sexp, sbase, sesc, sesc_row | group, lut, bits |

A value is immutable and compares by identity: whoever caches something made from its streams
(the CPU GEMV's plan over their addresses) keys the cache by the value, and a layer makes a new
value whenever its streams change (moved, transcoded, replaced). The transcoders between the two
layouts are in transcode.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

if TYPE_CHECKING:
    from unweight.codec import tiles


def _tiles_params(base: int, block: int) -> tiles.TilesParams:
    """tiles.TilesParams(base, block), checked (ValueError naming the bad one). Imported here, not
    with the module: the codec package needs zstandard, which the GPU machine lacks, and the CUDA
    launchers import this module for QTilesWeight alone."""
    from unweight.codec import tiles

    return tiles.TilesParams(base, block)


def _check_streams(kind: str, streams: dict[str, torch.Tensor], dtypes: dict[str, tuple[torch.dtype, ...]]):
    """The streams' one device; each stream a 1-D tensor of one of its dtypes (ValueError naming it)."""
    device = None
    for role, t in streams.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{kind} stream {role!r} must be a torch.Tensor, not {type(t).__name__}")
        if t.dtype not in dtypes[role]:
            raise ValueError(f"{kind} stream {role!r} must be {' or '.join(map(str, dtypes[role]))}, not {t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"{kind} stream {role!r} must be 1-D, not of shape {tuple(t.shape)}")
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(f"{kind} streams lie on {device} and {t.device} ({role!r}): they must share a device")
    return device


def _check_shape(kind: str, rows, cols) -> None:
    for name, v in (("rows", rows), ("cols", cols)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{kind} {name} {v!r} is not a non-negative integer")


class _Streams:
    """What both kinds share: their streams by role, bytes and device."""

    __slots__ = ()
    ROLES: ClassVar[tuple[str, ...]]

    def streams(self) -> dict[str, torch.Tensor]:
        """The streams by role, in ROLES order."""
        return {role: getattr(self, role) for role in self.ROLES}

    @property
    def stored_bytes(self) -> int:
        """Bytes the streams hold on their device."""
        return sum(t.numel() * t.element_size() for t in self.streams().values())

    nbytes = stored_bytes

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    def with_streams(self, streams: dict[str, torch.Tensor]):
        """The same weight over other tensors of its streams (moved, shared, replaced), validated again."""
        return replace(self, **streams)

    def to(self, device: torch.device | str):
        """The same weight, its streams on `device` (in the same layout)."""
        return self.with_streams({role: t.to(device) for role, t in self.streams().items()})

    def __repr__(self) -> str:
        sizes = ", ".join(f"{role}={getattr(self, role).numel()}" for role in self.ROLES)
        return f"{type(self).__name__}({self.rows}x{self.cols}, {self._params_repr()}, {sizes}, device={self.device})"


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class TilesWeight(_Streams):
    """W (rows, cols) BF16 in the stored `tiles` layout, as the CPU kernels read it: every weight
    its sign+mantissa byte and a 3-bit exponent code (base + code, 7 an escape), escapes' exponents
    listed in `esc`, indexed per block of `block` columns."""

    sm: torch.Tensor  # (rows * cols,) uint8: sign and mantissa bits of each weight, row-major
    codes: torch.Tensor  # (ceil(rows * cols / 8) * 3,) uint8: 3-bit codes, 8 weights in 3 bytes
    esc: torch.Tensor  # (escapes, at least 1) uint8: escaped weights' exponents in row-major order
    esc_index: torch.Tensor  # (rows * ceil(cols / block) + 1,) int64: escapes before each block
    rows: int
    cols: int
    base: int  # exponent of code 0
    block: int  # columns per escape-index block (a multiple of 8)
    device: torch.device = field(init=False)

    ROLES: ClassVar[tuple[str, ...]] = ("sm", "codes", "esc", "esc_index")
    layout: ClassVar[str] = "tiles"

    def __post_init__(self) -> None:
        _check_shape("tiles", self.rows, self.cols)
        _tiles_params(self.base, self.block)  # ValueError naming base or block
        u8, i64 = (torch.uint8,), (torch.int64,)
        device = _check_streams("tiles", self.streams(), {"sm": u8, "codes": u8, "esc": u8, "esc_index": i64})
        n = self.rows * self.cols
        want = {"sm": n, "codes": -(-n // 8) * 3, "esc_index": self.rows * -(-self.cols // self.block) + 1}
        for role, length in want.items():
            if getattr(self, role).numel() != length:
                raise ValueError(
                    f"tiles stream {role!r} holds {getattr(self, role).numel()} entries; a ({self.rows}, {self.cols}) "
                    f"weight in blocks of {self.block} needs {length}"
                )
        if self.esc.numel() < 1:
            raise ValueError("tiles stream 'esc' must hold at least one byte (kernels take its address)")
        object.__setattr__(self, "device", device)

    @property
    def params(self) -> tiles.TilesParams:
        return _tiles_params(self.base, self.block)

    def _params_repr(self) -> str:
        return f"base={self.base}, block={self.block}"

    @classmethod
    def from_numpy(
        cls,
        streams: dict[str, np.ndarray],
        params: tiles.TilesParams,
        rows: int,
        cols: int,
        device: torch.device | str = "cpu",
    ) -> TilesWeight:
        """A weight from the tiles streams as the codec writes them (esc_index in little-endian uint32
        bytes), laid out as the kernels read them (tile_tensors: in the stream arena on the CPU)."""
        from .tile_tensors import tile_tensors

        return cls(**tile_tensors(streams, device), rows=rows, cols=cols, base=params.base, block=params.block)


_QTILES_DTYPES = {
    "sm": (torch.uint8,),
    "codes": (torch.uint8,),
    "base": (torch.uint8,),
    "esc_row": (torch.int32,),
    "esc_col": (torch.uint16, torch.int32),
    "esc_exp": (torch.uint8,),
}


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class QTilesWeight(_Streams):
    """W (rows, cols) BF16 in the resident `qtiles` layout (qtiles.py), as the CUDA kernels read it:
    groups of 32 columns, four weights per 32-bit word, a base exponent per row, escapes listed per
    row. `mode` (0 or 1) picks the kernels' variant; it is kept on the host, so no launch waits to
    read it."""

    sm: torch.Tensor  # (rows * 32 G,) uint8, G = ceil(cols / 32): sign and mantissa bits
    codes: torch.Tensor  # (rows * G * 12,) uint8: three words of code bits per group
    base: torch.Tensor  # (rows,) uint8: each row's base exponent
    esc_row: torch.Tensor  # (rows + 1,) int32: first listed escape of each row
    esc_col: torch.Tensor  # (escapes,) uint16 (cols <= 65536) or int32: their columns
    esc_exp: torch.Tensor  # (escapes,) uint8: their exponents
    rows: int
    cols: int
    mode: int  # 0: eight-exponent windows; 1: seven and a zero code
    device: torch.device = field(init=False)

    ROLES: ClassVar[tuple[str, ...]] = ("sm", "codes", "base", "esc_row", "esc_col", "esc_exp")
    layout: ClassVar[str] = "qtiles"

    def __post_init__(self) -> None:
        _check_shape("qtiles", self.rows, self.cols)
        if self.mode not in (0, 1) or isinstance(self.mode, bool):
            raise ValueError(f"qtiles mode must be 0 or 1, not {self.mode!r}")
        device = _check_streams("qtiles", self.streams(), _QTILES_DTYPES)
        held, g = self.base.numel(), -(-self.cols // 32)
        if held != self.rows or self.sm.numel() != held * 32 * g or self.codes.numel() != held * 12 * g:
            raise ValueError(
                f"the qtiles streams hold a {held}-row matrix of {self.sm.numel() // max(held, 1)} stored columns, "
                f"not ({self.rows}, {self.cols})"
            )
        if self.esc_row.numel() != held + 1 or self.esc_col.numel() != self.esc_exp.numel():
            raise ValueError(
                f"qtiles escape lists do not match: esc_row holds {self.esc_row.numel()} entries for {held} rows, "
                f"esc_col {self.esc_col.numel()} and esc_exp {self.esc_exp.numel()}"
            )
        object.__setattr__(self, "device", device)

    def _params_repr(self) -> str:
        return f"mode={self.mode}"

    @classmethod
    def from_streams(
        cls, streams: dict, rows: int, cols: int, mode: int | None = None, device: torch.device | str | None = None
    ) -> QTilesWeight:
        """A weight from qtiles streams as qtiles.encode returns them (numpy arrays) or as tensors;
        `mode` as given, else read from the `mode` stream (a wait, if that lies on a GPU). With
        `device`, the streams are moved there."""
        if mode is None:
            m = streams["mode"]
            mode = int((m.cpu().numpy() if isinstance(m, torch.Tensor) else np.asarray(m)).reshape(-1)[0])
        tensors = {}
        for role in cls.ROLES:
            t = streams[role]
            t = torch.from_numpy(np.ascontiguousarray(t)) if isinstance(t, np.ndarray) else t
            tensors[role] = t if device is None else t.to(device)
        return cls(**tensors, rows=rows, cols=cols, mode=mode)


_INT4_DTYPES = {
    "sym": (torch.int64,),
    "esc": (torch.int32,),
    "esc_row": (torch.int32,),
    "smant": (torch.uint8,),
    "sexp": (torch.int32,),
    "sbase": (torch.uint8,),
    "sesc": (torch.int16,),
    "sesc_row": (torch.int32,),
    "zero": (torch.uint8,),
}


class _Int4(_Streams):
    """What both INT4 kinds share: their zero points (a `zero` stream, empty for symmetric codes)
    and the size of the compressed-tensors tensors they hold."""

    __slots__ = ()

    @property
    def symmetric(self) -> bool:
        """Whether the codes have no zero points (w = (nibble - 8) * scale)."""
        return self.zero.numel() == 0

    @property
    def source_bytes(self) -> int:
        """Bytes of the compressed-tensors tensors it holds: codes, scales and zero points."""
        from . import int4

        return int4.stored_bytes(self.rows, self.cols, self.group, not self.symmetric)

    def zero_points(self) -> np.ndarray | None:
        """The source's zero-point words back (`weight_zero_point`, (ceil(rows / 8), G) int32), bit for
        bit, or None for symmetric codes."""
        from . import int4

        return int4.zero_words({"zero": self.zero.cpu().numpy()}, self.rows, self.cols, self.group)


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class Int4Weight(_Int4):
    """W (rows, cols) as compressed-tensors INT4 codes, w = (nibble - zero) * scale with one BF16
    scale per `group` columns and, for asymmetric codes, one zero point per group (symmetric: zero
    = 8), in the resident `int4` layout (int4.py): 3-bit symbols in bit planes, escaped nibbles'
    indices apart, scales as a mantissa byte and a 2-bit exponent code, zero points as nibbles."""

    sym: torch.Tensor  # (rows * B * 3,) int64, B = ceil(cols / 64): three symbol planes per block
    esc: torch.Tensor  # (ceil(E * payload_bits / 32) + 16,) int32: escapes' indices, packed
    esc_row: torch.Tensor  # (rows + 1,) int32: escapes of the rows before
    smant: torch.Tensor  # (rows * G,) uint8, G = cols / group: exponent code bit 0, mantissa
    sexp: torch.Tensor  # (rows * ceil(G / 32),) int32: exponent code bit 1
    sbase: torch.Tensor  # (rows,) uint8: each row's base exponent
    sesc: torch.Tensor  # (listed scales, at least 1) int16: their bits
    sesc_row: torch.Tensor  # (rows + 1,) int32: listed scales of the rows before
    zero: torch.Tensor  # (rows * ceil(G / 2),) uint8, or empty (symmetric): zero-point nibbles
    rows: int
    cols: int
    group: int
    lut: int  # 16 nibbles, nibble i in bits 4i: short symbols' at 0..6, long ones' from 8
    payload_bits: int  # bits of an escape's index, 0 to 4 (`bits` in the table above)
    device: torch.device = field(init=False)

    ROLES: ClassVar[tuple[str, ...]] = ("sym", "esc", "esc_row", "smant", "sexp", "sbase", "sesc", "sesc_row", "zero")
    layout: ClassVar[str] = "int4"

    def __post_init__(self) -> None:
        _check_shape("int4", self.rows, self.cols)
        for name, v, lo, hi in (
            ("group", self.group, 1, self.cols or 1),
            ("lut", self.lut, 0, (1 << 64) - 1),
            ("payload_bits", self.payload_bits, 0, 4),
        ):
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ValueError(f"int4 {name} {v!r} is not an integer in [{lo}, {hi}]")
        if self.cols % self.group:
            raise ValueError(f"int4 group {self.group} does not divide cols {self.cols}")
        device = _check_streams("int4", self.streams(), _INT4_DTYPES)
        g = self.cols // self.group
        want = {
            "sym": self.rows * -(-self.cols // 64) * 3,
            "esc_row": self.rows + 1,
            "smant": self.rows * g,
            "sexp": self.rows * -(-g // 32),
            "sbase": self.rows,
            "sesc_row": self.rows + 1,
        }
        for role, length in want.items():
            if getattr(self, role).numel() != length:
                raise ValueError(
                    f"int4 stream {role!r} holds {getattr(self, role).numel()} entries; a ({self.rows}, {self.cols}) "
                    f"weight in groups of {self.group} needs {length}"
                )
        if self.zero.numel() not in (0, self.rows * -(-g // 2)):
            raise ValueError(
                f"int4 stream 'zero' holds {self.zero.numel()} entries; a ({self.rows}, {self.cols}) weight in groups "
                f"of {self.group} has none (symmetric) or {self.rows * -(-g // 2)}"
            )
        if self.esc.numel() < 16 or self.sesc.numel() < 1:
            raise ValueError(
                f"int4 streams 'esc' ({self.esc.numel()} words) and 'sesc' ({self.sesc.numel()}) do not hold the "
                "escapes' indices and 16 words after them, and at least one listed scale"
            )
        object.__setattr__(self, "device", device)

    def _params_repr(self) -> str:
        kind = "symmetric" if self.symmetric else "asymmetric"
        return f"group={self.group}, {kind}, lut={self.lut:#018x}, payload_bits={self.payload_bits}"

    @classmethod
    def encode(cls, packed: np.ndarray, scales: np.ndarray, cols: int, group: int, zero=None) -> Int4Weight:
        """W coded from compressed-tensors' `weight_packed` (rows, ceil(cols / 8)) int32,
        `weight_scale` (rows, cols / group) BF16 bits and, for asymmetric codes, `weight_zero_point`
        (ceil(rows / 8), cols / group) int32 (int4_encode.encode), on the CPU."""
        from .int4_encode import encode

        coded = encode(packed, scales, cols, group, zero)
        tensors = {role: torch.from_numpy(np.ascontiguousarray(a)) for role, a in coded["streams"].items()}
        return cls(
            **tensors,
            rows=packed.shape[0],
            cols=cols,
            group=group,
            lut=coded["lut"],
            payload_bits=coded["payload_bits"],
        )

    def decode(self) -> tuple[np.ndarray, np.ndarray]:
        """(weight_packed int32, weight_scale uint16 bits) back, bit for bit (int4.decode_reference)."""
        from . import int4

        streams = {role: t.cpu().numpy() for role, t in self.streams().items()}
        return int4.decode_reference(streams, self.rows, self.cols, self.group, self.lut, self.payload_bits)


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class PlainInt4Weight(_Int4):
    """W (rows, cols) as compressed-tensors stores INT4 codes, unchanged: the packed words, the BF16
    scales and (asymmetric codes) the zero points as `Int4Weight` keeps them. What `int4_weight`
    holds where coding would not make the weight smaller (codes spread over all 16 nibbles, as
    min-max codes are): never more bytes than the source."""

    packed: torch.Tensor  # (rows * ceil(cols / 8),) int32: eight codes a word, the first in the low bits
    scales: torch.Tensor  # (rows * G,) int16: BF16 bits
    zero: torch.Tensor  # (rows * ceil(G / 2),) uint8, or empty (symmetric): as Int4Weight's
    rows: int
    cols: int
    group: int
    device: torch.device = field(init=False)

    ROLES: ClassVar[tuple[str, ...]] = ("packed", "scales", "zero")
    layout: ClassVar[str] = "int4-plain"

    def __post_init__(self) -> None:
        _check_shape("int4-plain", self.rows, self.cols)
        if not isinstance(self.group, int) or isinstance(self.group, bool) or not 1 <= self.group <= (self.cols or 1):
            raise ValueError(f"int4-plain group {self.group!r} is not an integer in [1, {self.cols or 1}]")
        if self.cols % self.group:
            raise ValueError(f"int4-plain group {self.group} does not divide cols {self.cols}")
        dtypes = {"packed": (torch.int32,), "scales": (torch.int16,), "zero": (torch.uint8,)}
        device = _check_streams("int4-plain", self.streams(), dtypes)
        g = self.cols // self.group
        for role, lengths in (
            ("packed", (self.rows * -(-self.cols // 8),)),
            ("scales", (self.rows * g,)),
            ("zero", (0, self.rows * -(-g // 2))),
        ):
            if getattr(self, role).numel() not in lengths:
                raise ValueError(
                    f"int4-plain stream {role!r} holds {getattr(self, role).numel()} entries; a ({self.rows}, "
                    f"{self.cols}) weight in groups of {self.group} needs {' or '.join(map(str, lengths))}"
                )
        object.__setattr__(self, "device", device)

    def _params_repr(self) -> str:
        return f"group={self.group}, {'symmetric' if self.symmetric else 'asymmetric'}"

    def decode(self) -> tuple[np.ndarray, np.ndarray]:
        """(weight_packed int32, weight_scale uint16 bits): the source's, as held."""
        return (
            self.packed.cpu().numpy().reshape(self.rows, -1).copy(),
            self.scales.cpu().numpy().view(np.uint16).reshape(self.rows, -1).copy(),
        )


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class Int4ScalesWeight(_Int4):
    """W (rows, cols) as compressed-tensors INT4 codes with only the scales coded: the packed words
    as stored (a GPU multiplies a nibble with a mask and an add, where decoding the `int4` layout's
    symbols and escapes costs about twice the instructions a weight that an H200's bandwidth leaves:
    docs/kernels.md), the scales and zero points as `Int4Weight` keeps them."""

    packed: torch.Tensor  # (rows * ceil(cols / 8),) int32: eight codes a word, the first in the low bits
    smant: torch.Tensor  # (rows * G,) uint8: as Int4Weight's
    sexp: torch.Tensor  # (rows * ceil(G / 32),) int32
    sbase: torch.Tensor  # (rows,) uint8
    sesc: torch.Tensor  # (listed scales, at least 1) int16
    scol: torch.Tensor  # (as sesc) int32: each listed scale's group (a GPU adds them apart)
    sesc_row: torch.Tensor  # (rows + 1,) int32
    zero: torch.Tensor  # (rows * ceil(G / 2),) uint8, or empty (symmetric)
    rows: int
    cols: int
    group: int
    device: torch.device = field(init=False)

    ROLES: ClassVar[tuple[str, ...]] = ("packed", "smant", "sexp", "sbase", "sesc", "scol", "sesc_row", "zero")
    layout: ClassVar[str] = "int4-scales"

    def __post_init__(self) -> None:
        _check_shape("int4-scales", self.rows, self.cols)
        if not isinstance(self.group, int) or isinstance(self.group, bool) or not 1 <= self.group <= (self.cols or 1):
            raise ValueError(f"int4-scales group {self.group!r} is not an integer in [1, {self.cols or 1}]")
        if self.cols % self.group:
            raise ValueError(f"int4-scales group {self.group} does not divide cols {self.cols}")
        dtypes = {"packed": (torch.int32,), "scol": (torch.int32,), **_INT4_DTYPES}
        device = _check_streams("int4-scales", self.streams(), dtypes)
        g = self.cols // self.group
        for role, lengths in (
            ("packed", (self.rows * -(-self.cols // 8),)),
            ("smant", (self.rows * g,)),
            ("sexp", (self.rows * -(-g // 32),)),
            ("sbase", (self.rows,)),
            ("sesc_row", (self.rows + 1,)),
            ("zero", (0, self.rows * -(-g // 2))),
        ):
            if getattr(self, role).numel() not in lengths:
                raise ValueError(
                    f"int4-scales stream {role!r} holds {getattr(self, role).numel()} entries; a ({self.rows}, "
                    f"{self.cols}) weight in groups of {self.group} needs {' or '.join(map(str, lengths))}"
                )
        if self.sesc.numel() < 1 or self.scol.numel() != self.sesc.numel():
            raise ValueError(
                f"int4-scales streams 'sesc' ({self.sesc.numel()}) and 'scol' ({self.scol.numel()}) must hold one "
                "entry a listed scale, and at least one"
            )
        object.__setattr__(self, "device", device)

    def _params_repr(self) -> str:
        return f"group={self.group}, {'symmetric' if self.symmetric else 'asymmetric'}"

    @classmethod
    def encode(cls, packed: np.ndarray, scales: np.ndarray, cols: int, group: int, zero=None) -> Int4ScalesWeight:
        """As Int4Weight.encode takes the source, the codes kept as they are (int4_encode.encode_scales)."""
        from . import int4
        from .int4_encode import encode_scales

        packed, scales = np.asarray(packed), np.asarray(scales)
        int4.check_source(packed, scales, cols, group)
        rows = packed.shape[0]
        zeros = np.zeros(0, np.uint8) if zero is None else int4.zero_stream(int4.zero_source(zero, rows, cols // group))
        arrays = {"packed": np.ascontiguousarray(packed).view(np.int32).reshape(-1), **encode_scales(scales)}
        arrays["scol"] = cls._scol(arrays, rows, cols // group)
        tensors = {role: torch.from_numpy(np.ascontiguousarray(a).copy()) for role, a in arrays.items()}
        return cls(**tensors, zero=torch.from_numpy(zeros), rows=rows, cols=cols, group=group)

    @staticmethod
    def _scol(streams: dict, rows: int, groups: int) -> np.ndarray:
        from . import int4

        cols = int4.listed_groups(streams, rows, groups)
        return cols if cols.size else np.zeros(1, np.int32)

    @classmethod
    def from_int4(cls, w: Int4Weight | PlainInt4Weight) -> Int4ScalesWeight:
        """The same weight with its codes as stored: an Int4Weight's scale streams kept, its codes
        decoded (transcoding at load, on the CPU); a PlainInt4Weight's scales coded."""
        packed, scales = w.decode()
        if isinstance(w, PlainInt4Weight):
            return cls.encode(packed, scales, w.cols, w.group, w.zero_points())
        kept = {role: getattr(w, role).cpu() for role in cls.ROLES if role not in ("packed", "scol")}
        scol = cls._scol({r: t.numpy() for r, t in kept.items()}, w.rows, w.cols // w.group)
        return cls(
            packed=torch.from_numpy(packed.reshape(-1)),
            scol=torch.from_numpy(scol),
            **kept,
            rows=w.rows,
            cols=w.cols,
            group=w.group,
        )

    def decode(self) -> tuple[np.ndarray, np.ndarray]:
        """(weight_packed int32, weight_scale uint16 bits) back, bit for bit."""
        from . import int4

        streams = {role: t.cpu().numpy() for role, t in self.streams().items()}
        scales = int4.decode_scales_reference(streams, self.rows, self.cols // self.group)
        return streams["packed"].reshape(self.rows, -1).copy(), scales


def int4_weight(
    packed: np.ndarray, scales: np.ndarray, cols: int, group: int, zero=None
) -> Int4Weight | PlainInt4Weight:
    """compressed-tensors INT4 (as Int4Weight.encode takes it) in the `int4` layout where that holds
    it in fewer bytes than the source, else as a PlainInt4Weight (ValueError names what does not fit).
    The layout's size is weighed from the nibbles' histogram and the coded scales before any code
    is written: min-max codes, which it would not shrink, are not coded at all."""
    from . import int4
    from .int4_encode import code_bytes, encode_scales

    packed, scales = np.asarray(packed), np.asarray(scales)
    int4.check_source(packed, scales, cols, group)
    rows = packed.shape[0]
    zeros = np.zeros(0, np.uint8) if zero is None else int4.zero_stream(int4.zero_source(zero, rows, cols // group))
    coded = code_bytes(packed, cols) + int4.resident_bytes(encode_scales(scales)) + zeros.nbytes
    if coded < int4.stored_bytes(rows, cols, group, zero is not None):
        return Int4Weight.encode(packed, scales, cols, group, zero)
    streams = {
        "packed": torch.from_numpy(np.ascontiguousarray(packed).view(np.int32).reshape(-1).copy()),
        "scales": torch.from_numpy(np.ascontiguousarray(scales).view(np.int16).reshape(-1).copy()),
        "zero": torch.from_numpy(zeros),
    }
    return PlainInt4Weight(**streams, rows=rows, cols=cols, group=group)


CompressedWeight = TilesWeight | QTilesWeight | Int4Weight | PlainInt4Weight | Int4ScalesWeight
