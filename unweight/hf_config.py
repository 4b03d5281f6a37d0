"""The compressed folder's config.json: the source's, with a `quantization_config` that makes vLLM
pick the unweight plugin (`vllm serve ./model-uw`, no flag), added so that it comes off exactly.

`compress` inserts one member as text just before the object's closing brace; `decompress` and
`verify --against` remove exactly that text, so the source's bytes come back whatever their
formatting. Being the last member, it wins over a `"quantization_config": null` earlier in the
file (JSON readers keep the last of duplicate keys). A config that is not a JSON object, or that
already declares a quantization_config (a checkpoint quantized by another method), is copied
unchanged, and compress says so.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

CONFIG_NAME = "config.json"
QUANTIZATION_CONFIG = {"quant_method": "unweight"}
_FIELD = ('"quantization_config": ' + json.dumps(QUANTIZATION_CONFIG)).encode()
_INSERT = b"\n  " + _FIELD  # after the last member (and a comma, unless the object is empty)
_TAIL = re.compile(rb"\}\s*\Z")  # the closing brace, and whitespace after it
MAX_CONFIG_BYTES = 16 << 20  # real configs are kilobytes; a larger file is copied as it is, never parsed


def is_config(path: Path, rel: Path) -> bool:
    """Whether `path` (the folder's file `rel`) is the config.json that tag() and untag() apply to."""
    return rel == Path(CONFIG_NAME) and path.stat().st_size <= MAX_CONFIG_BYTES + len(_INSERT) + 1


def tag(data: bytes) -> tuple[bytes, str | None]:
    """(config.json with the unweight quantization_config added, None), or (data unchanged, the
    reason it was left alone)."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:
        return data, f"config.json is not valid JSON ({e.__class__.__name__}); copied unchanged"
    if not isinstance(obj, dict):
        return data, "config.json is not a JSON object; copied unchanged"
    if obj.get("quantization_config") is not None:
        q = obj["quantization_config"]
        method = q.get("quant_method") if isinstance(q, dict) else None
        return data, (
            f"config.json already declares a quantization_config (quant_method {method!r}); copied unchanged, so vLLM "
            f"will not load this folder through the unweight plugin"
        )
    head = data[: _TAIL.search(data).start()].rstrip()  # a JSON object ends with its brace
    sep = b"" if head.endswith(b"{") else b","
    return head + sep + _INSERT + data[len(head) :], None


def untag(data: bytes) -> bytes:
    """The source's config.json from the compressed folder's (data itself if tag() left it alone)."""
    m = _TAIL.search(data)
    if m is None:
        return data
    head = data[: m.start()].rstrip()
    # tag() wrote the last member's text, then "," unless the object was empty, then _INSERT, then
    # the whitespace and brace that followed it: so the insertion ends where that whitespace starts
    end = len(head)
    if not head.endswith(_INSERT):
        return data
    start = end - len(_INSERT)
    before = data[:start]
    if before.endswith(b","):
        return before[:-1] + data[end:]
    if before.rstrip().endswith(b"{"):
        return before + data[end:]
    return data
