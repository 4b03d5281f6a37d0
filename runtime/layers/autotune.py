"""Choosing a pipeline per (device, layer shape, batch bucket) by timing the candidates once.

The first call for a key times every candidate (one warm-up each, then REPEATS rounds that run the
candidates in turn; each keeps its fastest run, since noise only ever adds time, and taking turns
spreads a slow spell of the machine over all of them; on the CPU each timed run starts with the
caches emptied, `_evict`) and remembers the fastest (keyed also by a
digest of the kernels' code, `code_version`), in memory and in a JSON file
(`$UNWEIGHT_CACHE/autotune.json`), written atomically. The file keeps the choices of the
KEEP_VERSIONS code versions tuned most recently (keys end with `|<code_version()>`), so that it does
not grow with every change of the kernels. `UNWEIGHT_PIPELINE=name` forces one pipeline everywhere
(for debugging).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from unweight.defaults import cache_dir

FORCE_ENV = "UNWEIGHT_PIPELINE"
REPEATS = 5
KEEP_VERSIONS = 4  # code versions whose choices the file keeps (two checkouts or installs may share it)
VERSIONS_KEY = "versions"  # the file's list of code versions, most recently tuned first (no "|": no choice's key)


def batch_bucket(m: int) -> int:
    """Rows of x rounded up to a power of two (1, 2, 4, ... 4096 and above)."""
    return 1 << max(0, (max(m, 1) - 1).bit_length())


@functools.cache
def code_version() -> str:
    """A digest of the kernels' source (runtime/kernels/: the GPU and the CPU kernels): part of every cache key,
    so that a choice timed on other kernels is timed again."""
    kernels = Path(__file__).parent.parent / "kernels"
    digest = hashlib.sha1()
    for f in sorted(kernels.glob("*.py")):
        digest.update(f.read_bytes())
    return digest.hexdigest()[:12]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{os.cpu_count()}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def _scratch() -> np.ndarray:
    """Twice the last-level cache's bytes, 64 MiB at least (made once)."""
    try:
        l3 = max(0, os.sysconf("SC_LEVEL3_CACHE_SIZE"))
    except (ValueError, OSError):
        l3 = 0
    return np.zeros(max(64 << 20, 2 * l3), dtype=np.uint8)


def _evict(device: torch.device) -> None:
    """On the CPU, write the scratch buffer, so that the next timed run reads its weight from DRAM,
    as a model's forward does: each layer's weight is read once a forward, and the other layers'
    evict it. Timed with the weight in cache, decode-then-GEMM (which writes W out and reads it
    back) won the 16-row bucket of SmolLM2's down projection in vLLM, which the fused kernel,
    reading each compressed weight once, wins out of cache."""
    if device.type == "cpu":
        buf = _scratch()
        buf += 1


class Autotuner:
    """In-memory choices backed by a JSON file; safe to share between layers and threads."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else cache_dir() / "autotune.json"
        self._lock = threading.Lock()
        self._choices: dict[str, str] | None = None

    def __getstate__(self) -> dict:
        """Pickled (a layer saved whole, or deep-copied) without its lock; unpickled with a new one."""
        return {"path": self.path, "choices": self._choices}

    def __setstate__(self, state: dict) -> None:
        self.path, self._choices, self._lock = state["path"], state["choices"], threading.Lock()

    def _load(self) -> dict[str, str]:
        if self._choices is None:
            try:
                data = json.loads(self.path.read_text())
                self._choices = {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}
            except (OSError, ValueError):
                self._choices = {}  # no cache yet, or an unreadable one: tune again
        return self._choices

    def _prune(self) -> None:
        """Keep the choices of this code version and of the KEEP_VERSIONS - 1 others tuned last (a file
        from before the list: its versions in the order their keys come)."""
        choices = self._choices
        listed = choices.get(VERSIONS_KEY, "").split()
        found = dict.fromkeys(key.rsplit("|", 1)[1] for key in choices if "|" in key)
        order = list(dict.fromkeys([code_version(), *listed, *found]))[:KEEP_VERSIONS]
        kept = {key: v for key, v in choices.items() if "|" in key and key.rsplit("|", 1)[1] in order}
        kept[VERSIONS_KEY] = " ".join(order)
        self._choices = kept

    def _save(self) -> None:
        self._prune()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.partial")
            tmp.write_text(json.dumps(self._choices, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only home: choices still hold for this process

    def choose(
        self, key: str, candidates: dict[str, Callable[[], torch.Tensor]], device: torch.device
    ) -> tuple[str, torch.Tensor | None]:
        """(name of the pipeline to use, its output if it was just run while timing, else None)."""
        forced = os.environ.get(FORCE_ENV)
        if forced:
            if forced not in candidates:
                raise ValueError(f"{FORCE_ENV}={forced!r} is not a pipeline here; choose from {', '.join(candidates)}")
            return forced, None
        with self._lock:
            known = self._load().get(key)
        if known in candidates:
            return known, None
        outputs = {}
        for name, run in candidates.items():
            outputs[name] = run()  # warm-up (compiles kernels)
            _sync(device)
        timings = dict.fromkeys(candidates, float("inf"))
        for _ in range(REPEATS):
            for name, run in candidates.items():
                _evict(device)
                t0 = time.perf_counter()
                run()
                _sync(device)
                timings[name] = min(timings[name], time.perf_counter() - t0)
        best = min(timings, key=timings.get)
        with self._lock:
            self._load()[key] = best
            self._save()
        return best, outputs[best]


DEFAULT = Autotuner()
