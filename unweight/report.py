"""What compress / verify / inspect return: plain dataclasses that render as tables or JSON."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from unweight.formats.dtypes import STORED_DTYPE_BITS

# Tensor classes for the summary, first match wins (names of Llama, Mistral, Qwen, BERT, GPT-2).
TENSOR_CLASSES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("embeddings", re.compile(r"(embed|wte|wpe|lm_head|shared\.weight)", re.I)),
    ("attention", re.compile(r"(attn|attention|\.(q|k|v|o)_proj|query|key|value|qkv)", re.I)),
    ("mlp", re.compile(r"(mlp|ffn|feed_forward|(gate|up|down)_proj|intermediate|\.output\.dense|experts|fc\d)", re.I)),
)
CLASS_ORDER = ("attention", "mlp", "embeddings", "other")


def tensor_class(name: str) -> str:
    """attention / mlp / embeddings / other, by the tensor's name (norms and biases of any block
    count as their block; a LayerNorm on its own is `other`)."""
    if re.search(r"(layernorm|layer_norm|_norm\.|\.norm\.|^norm\.|ln_\w)", name, re.I):
        return "other"
    for cls, pattern in TENSOR_CLASSES:
        if pattern.search(name):
            return cls
    return "other"


@dataclass(slots=True)
class TensorReport:
    file: str
    name: str
    dtype: str
    shape: list[int]
    codec: str
    original_bytes: int
    stored_bytes: int

    @property
    def tensor_class(self) -> str:
        return tensor_class(self.name)


@dataclass(slots=True)
class Totals:
    tensors: int = 0
    weights: int = 0
    original_bytes: int = 0
    stored_bytes: int = 0

    def add(self, t: TensorReport, numel: int) -> None:
        self.tensors += 1
        self.weights += numel
        self.original_bytes += t.original_bytes
        self.stored_bytes += t.stored_bytes

    @property
    def saving(self) -> float:
        """Fraction of the original bytes saved (0.34 = 34 %)."""
        return 1 - self.stored_bytes / self.original_bytes if self.original_bytes else 0.0

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.stored_bytes / self.weights if self.weights else 0.0

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "saving_percent": round(100 * self.saving, 3),
            "bits_per_weight": round(self.bits_per_weight, 4),
        }


@dataclass(slots=True)
class CompressReport:
    source: str
    destination: str
    tensors: list[TensorReport] = field(default_factory=list)
    files_written: int = 0
    file_bytes_in: int = 0  # safetensors files, headers included
    file_bytes_out: int = 0
    copied_files: list[str] = field(default_factory=list)
    skipped_files: list[str] = field(default_factory=list)
    seconds: float = 0.0
    file_notes: list[str] = field(default_factory=list)  # what compress did not do to a copied file, and why

    def totals(self) -> Totals:
        t = Totals()
        for r in self.tensors:
            t.add(r, _numel(r.shape))
        return t

    def by_class(self) -> dict[str, Totals]:
        out = {c: Totals() for c in CLASS_ORDER}
        for r in self.tensors:
            out[r.tensor_class].add(r, _numel(r.shape))
        return {c: t for c, t in out.items() if t.tensors}

    def by_dtype(self) -> dict[str, Totals]:
        out: dict[str, Totals] = {}
        for r in self.tensors:
            out.setdefault(r.dtype, Totals()).add(r, _numel(r.shape))
        return out

    def notes(self) -> list[str]:
        """What the summary says besides its numbers: tensors of dtypes the codec has no model of
        (F8_E8M0, C64, ...: formats/dtypes.py STORED_DTYPE_BITS), kept bit-exact with zstd or raw;
        then the notes on copied files (a config.json that could not take the vLLM plugin's tag)."""
        out = []
        for dtype, t in self.by_dtype().items():
            if dtype in STORED_DTYPE_BITS:
                codecs = sorted({r.codec for r in self.tensors if r.dtype == dtype})
                out.append(
                    f"{t.tensors} {dtype} tensor{'s' if t.tensors > 1 else ''} ({t.original_bytes:,} bytes) stored "
                    f"with "
                    f"{' or '.join(codecs)}, bit-exact: the codec has no model of {dtype} values"
                )
        return out + self.file_notes

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "destination": self.destination,
            "seconds": round(self.seconds, 3),
            "files_written": self.files_written,
            "file_bytes_in": self.file_bytes_in,
            "file_bytes_out": self.file_bytes_out,
            "total": self.totals().to_json(),
            "by_class": {c: t.to_json() for c, t in self.by_class().items()},
            "by_dtype": {d: t.to_json() for d, t in self.by_dtype().items()},
            "copied_files": self.copied_files,
            "skipped_files": self.skipped_files,
            "notes": self.notes(),
            "tensors": [{**asdict(t), "class": t.tensor_class} for t in self.tensors],
        }


@dataclass(slots=True)
class VerifyReport:
    checked_tensors: int = 0
    checked_bytes: int = 0
    checked_files: int = 0
    mismatches: list[str] = field(default_factory=list)  # one line each, first found first
    missing: list[str] = field(default_factory=list)  # tensors the shard index lists that are not where it says
    vouched: bool = False  # the containers were checked against the folder's manifest (one compress of one model)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def to_json(self) -> dict:
        return {"ok": self.ok, **asdict(self)}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
