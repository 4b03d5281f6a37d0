"""Defaults defined once, in a module that imports nothing heavy (the CLI reads them for its
options and --help without loading numba): the codec's parameters and where caches live."""

from __future__ import annotations

import os
from pathlib import Path

# rANS frequency precision in bits: the range a container may declare, and the default
PRECISION_RANGE = (10, 15)
DEFAULT_PRECISION = 14
DEFAULT_CHUNK = 1 << 16  # the most elements a rans chunk holds (rans.chunk_for picks the size)


def cache_dir() -> Path:
    """Where fixtures, their wheels and the autotuner's choices are kept: $UNWEIGHT_CACHE, else
    ~/.cache/unweight."""
    return Path(os.environ.get("UNWEIGHT_CACHE", Path.home() / ".cache" / "unweight"))
