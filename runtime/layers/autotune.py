"""Choosing a pipeline per (device, layer shape, batch bucket) by timing the candidates once.

The first call for a key times every candidate (one warm-up each, then rounds that run the
candidates in turn; each keeps its fastest run, since noise only ever adds time, and taking turns
spreads a slow spell of the machine over all of them; on the CPU each timed run starts with the
caches emptied, `_evict`) and remembers the fastest (keyed also by a digest of the kernels' code
and of this file, `code_version`), in memory and in a JSON file (`$UNWEIGHT_CACHE/autotune.json`),
written atomically.

A run during which one of this process's threads was preempted (an involuntary context switch:
another process wanted the core) does not count: a parallel kernel then waits a whole scheduler
slice for its preempted thread, milliseconds against tens of microseconds, and on a busy 2-core
host every run of one candidate can meet that, so that the fastest of five still loses by 100x
(measured: SmolLM2's qkv GEMV at one row took 5.6 ms in its best of five runs beside three busy
processes, against 65 us alone, and the slower pipeline won). Rounds go on until every candidate
has REPEATS clean runs, MAX_ROUNDS at most; a choice timed with fewer than CLEAN_TO_SAVE clean runs
of some candidate holds for this process only and is not saved, so that the next process times it
again instead of keeping a choice that the machine's load made. A preemption can also come from
this process's own threads: numba's and torch's thread pools, both spinning, take turns on the cores
(a decode + matmul run of SmolLM2's lm_head, 15 ms, met one or more in nearly every run on an idle
2-core host, so that its choice was never saved and every process timed it again, a third of a
second before its first token). So the rounds also read how much CPU time other processes took
while they ran (`other_cpu`: the machine's busy time from /proc/stat less this process's own): where
that stayed under QUIET_SHARE of the cores over a window of at least QUIET_WINDOW_S, every run counts
as clean. The file keeps the choices of the
KEEP_VERSIONS code versions tuned most recently (keys end with `|<code_version()>`), so that it does
not grow with every change of the kernels. `UNWEIGHT_PIPELINE=name` forces one pipeline everywhere
(for debugging).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from unweight.defaults import cache_dir

log = logging.getLogger(__name__)

try:
    import resource
except ImportError:  # Windows: no rusage, every run counts as clean
    resource = None

FORCE_ENV = "UNWEIGHT_PIPELINE"
REPEATS = 5
MAX_ROUNDS = 2 * REPEATS  # rounds a choice takes at most while other processes preempt its runs
CLEAN_TO_SAVE = 2  # clean runs every candidate needs for the choice to be saved
KEEP_VERSIONS = 4  # code versions whose choices the file keeps (two checkouts or installs may share it)
VERSIONS_KEY = "versions"  # the file's list of code versions, most recently tuned first (no "|": no choice's key)
QUIET_WINDOW_S = 0.2  # core-seconds of rounds at least, for other processes' CPU time (in 10 ms ticks) to tell
QUIET_SHARE = 0.05  # other processes' share of the cores under which the rounds' preemptions were this process's own


def batch_bucket(m: int) -> int:
    """Rows of x rounded up to a power of two (1, 2, 4, ... 4096 and above)."""
    return 1 << max(0, (max(m, 1) - 1).bit_length())


@functools.cache
def code_version() -> str:
    """A digest of the kernels' source (runtime/kernels/: the GPU and the CPU kernels) and of this file (how
    choices are timed): part of every cache key, so that a choice timed on other kernels, or by another
    method, is timed again."""
    kernels = Path(__file__).parent.parent / "kernels"
    digest = hashlib.sha1()
    for f in [*sorted(kernels.glob("*.py")), Path(__file__)]:
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


def preemptions() -> int:
    """Involuntary context switches of this process's threads so far (Linux sums every thread's in
    RUSAGE_SELF): one between two readings means a thread lost its core to another process."""
    if resource is None:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw


def other_cpu() -> float | None:
    """CPU seconds every process but this one has spent so far, all cores together: /proc/stat's
    ticks less idle and iowait, less this process's user and system time (None where there is no
    /proc/stat). What other processes took while this one timed its runs; the thread governor
    (runtime/threads.py) reads it too."""
    if resource is None:
        return None
    try:
        with open("/proc/stat") as f:
            ticks = [int(t) for t in f.readline().split()[1:]]  # user nice system idle iowait irq softirq steal
        busy = (sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    own = resource.getrusage(resource.RUSAGE_SELF)
    return busy - own.ru_utime - own.ru_stime


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
        self._unsaved: dict[str, str] = {}  # choices timed under load: this process's only

    def __getstate__(self) -> dict:
        """Pickled (a layer saved whole, or deep-copied) without its lock; unpickled with a new one."""
        return {"path": self.path, "choices": self._choices, "unsaved": self._unsaved}

    def __setstate__(self, state: dict) -> None:
        self.path, self._choices, self._lock = state["path"], state["choices"], threading.Lock()
        self._unsaved = state.get("unsaved", {})

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
            known = self._load().get(key) or self._unsaved.get(key)
        if known in candidates:
            return known, None
        outputs = {}
        for name, run in candidates.items():
            outputs[name] = run()  # warm-up (compiles kernels)
            _sync(device)
        clean, disturbed = self._time(candidates, device)
        # the fastest clean run; a candidate without one competes with its least disturbed run
        best = min(candidates, key=lambda name: min(clean[name] or disturbed[name]))
        fewest = min(len(runs) for runs in clean.values())
        with self._lock:
            if fewest >= CLEAN_TO_SAVE:
                self._load()[key] = best
                self._save()
            else:
                self._unsaved[key] = best
                log.info(
                    "autotune %s: %s for this process only, not saved (%d clean runs in %d rounds: other "
                    "processes held the cores)",
                    key,
                    best,
                    fewest,
                    MAX_ROUNDS,
                )
        return best, outputs[best]

    def _time(self, candidates: dict[str, Callable[[], torch.Tensor]], device: torch.device) -> tuple[dict, dict]:
        """(clean, disturbed): each candidate's run times in seconds, split by whether a thread of this
        process was preempted during the run, from rounds that take the candidates in turn until each
        has REPEATS clean runs, MAX_ROUNDS at most. Where other processes took next to no CPU time
        over the rounds, the preemptions were this process's own threads' and every run is clean."""
        clean = {name: [] for name in candidates}
        disturbed = {name: [] for name in candidates}
        start, others = time.perf_counter(), other_cpu()
        for _ in range(MAX_ROUNDS):
            for name, run in candidates.items():
                _evict(device)
                before = preemptions()
                t0 = time.perf_counter()
                run()
                _sync(device)
                took = time.perf_counter() - t0
                (clean if preemptions() == before else disturbed)[name].append(took)
            if min(len(runs) for runs in clean.values()) >= REPEATS:
                break
        if others is not None and any(disturbed.values()):
            cores = (time.perf_counter() - start) * (os.cpu_count() or 1)
            taken = other_cpu()
            if taken is not None and cores >= QUIET_WINDOW_S and taken - others <= QUIET_SHARE * cores:
                return {name: clean[name] + disturbed[name] for name in candidates}, {name: [] for name in candidates}
        return clean, disturbed


DEFAULT = Autotuner()
