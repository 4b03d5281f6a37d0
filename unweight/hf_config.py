"""The compressed folder's config.json: the source's, with a `quantization_config` that makes vLLM
pick the unweight plugin (`vllm serve ./model-uw`, no flag), added so that it comes off exactly.

`compress` inserts one member as text just before the object's closing brace; `decompress` and
`verify --against` remove exactly that text, so the source's bytes come back whatever their
formatting. Being the last member, it wins over a `"quantization_config": null` earlier in the
file (JSON readers keep the last of duplicate keys). A checkpoint quantized with
compressed-tensors (Kimi K2.5's INT4 experts) keeps its own quantization_config, nested under
`source_quantization_config`: vLLM's plugin hands the layers it quantizes to vLLM's
compressed-tensors method, their tensors decoded to what the source stores, and other tools see
`unweight`, which they refuse by name rather than load wrong tensors. A config that is not a JSON
object, or that declares another quantization method, is copied unchanged, and compress says so.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

CONFIG_NAME = "config.json"
QUANT_METHOD = "unweight"  # the quantization method transformers and vLLM know compressed folders by
QUANTIZATION_CONFIG = {"quant_method": QUANT_METHOD}
SOURCE_KEY = "source_quantization_config"  # the source's own, when NESTED names its method
NESTED = ("compressed-tensors",)  # quantization methods whose checkpoints compress and serve (through vLLM)
_TAIL = re.compile(rb"\}\s*\Z")  # the closing brace, and whitespace after it
MAX_CONFIG_BYTES = 16 << 20  # real configs are kilobytes; a larger file is copied as it is, never parsed


def is_config(path: Path, rel: Path) -> bool:
    """Whether `path` (the folder's file `rel`) is the config.json that tag() and untag() apply to."""
    # (a tagged config holds at most the source's and a copy of its quantization_config)
    return rel == Path(CONFIG_NAME) and path.stat().st_size <= 2 * MAX_CONFIG_BYTES + 1024


def tag(data: bytes) -> tuple[bytes, str | None]:
    """(config.json with the unweight quantization_config added, None), or (data unchanged, the
    reason it was left alone)."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:
        return data, f"config.json is not valid JSON ({e.__class__.__name__}); copied unchanged"
    if not isinstance(obj, dict):
        return data, "config.json is not a JSON object; copied unchanged"
    q = obj.get("quantization_config")
    if q is not None:
        method = q.get("quant_method") if isinstance(q, dict) else None
        if method not in NESTED:
            return data, (
                f"config.json already declares a quantization_config (quant_method {method!r}); copied unchanged, so "
                f"vLLM will not load this folder through the unweight plugin"
            )
    insert = _insert(None if q is None else {**QUANTIZATION_CONFIG, SOURCE_KEY: q})
    head = data[: _TAIL.search(data).start()].rstrip()  # a JSON object ends with its brace
    sep = b"" if head.endswith(b"{") else b","
    return head + sep + insert + data[len(head) :], None


def _insert(config: dict | None) -> bytes:
    """The text tag() inserts: a last member, after the others (and a comma, unless the object is empty)."""
    return b"\n  " + ('"quantization_config": ' + json.dumps(config or QUANTIZATION_CONFIG)).encode()


def source_quantization(config: dict) -> dict | None:
    """The source checkpoint's own quantization_config, kept in a compressed folder's (None: a
    BF16 source, or `config` is not an unweight one)."""
    q = config.get("quantization_config")
    return q.get(SOURCE_KEY) if isinstance(q, dict) and q.get("quant_method") == QUANT_METHOD else None


def untag(data: bytes) -> bytes:
    """The source's config.json from the compressed folder's (data itself if tag() left it alone)."""
    m = _TAIL.search(data)
    if m is None:
        return data
    head = data[: m.start()].rstrip()
    # tag() wrote the last member's text, then "," unless the object was empty, then _insert(), then
    # the whitespace and brace that followed it: so the insertion ends where that whitespace starts
    end = len(head)
    try:
        q = json.loads(data).get("quantization_config")
    except (ValueError, RecursionError, AttributeError):
        return data
    if not isinstance(q, dict) or q.get("quant_method") != QUANT_METHOD:
        return data
    insert = _insert(q)
    if not head.endswith(insert):
        return data
    start = end - len(insert)
    before = data[:start]
    if before.endswith(b","):
        return before[:-1] + data[end:]
    if before.rstrip().endswith(b"{"):
        return before + data[end:]
    return data
