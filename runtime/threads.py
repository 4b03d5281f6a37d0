"""CPU threads that give way when another process takes a core.

A decode step on the CPU is hundreds of short parallel regions (torch's OpenMP, numba's kernels),
each ending in a barrier. With as many threads as cores, a process that takes one core makes
every barrier wait for a thread the kernel has descheduled, and decoding collapses (2 cores:
from ~50 to ~15 tokens/s beside one busy loop, `benchmarks/contention_bench.py`); with one
thread fewer it merely loses that core's share.

`CoreGovernor.step()`, called once per decode step, reads every `INTERVAL_S` how much CPU the
other processes used since its last look (/proc/stat less this process's own time), and runs
torch and numba with the cores they leave: `max_threads` while they use less than `RELEASE` of a
core, one thread fewer for each further core they hold past `TAKE`. Without /proc (not Linux)
it does nothing. `UNWEIGHT_THREAD_GOVERNOR=0` turns it off.
"""

from __future__ import annotations

import math
import os
import time

from .layers.autotune import other_cpu

INTERVAL_S = 0.5
TAKE = 0.6  # another process using this much of a core takes it from us
RELEASE = 0.3  # ... and gives it back below this much (the gap keeps the count from flapping)


def threads_for(others: float, max_threads: int, current: int) -> int:
    """Threads to run with when other processes used `others` cores (averaged) and we run
    `current`: one fewer than max_threads for each core they hold (from TAKE of it on), and back
    up only once they hold less (under RELEASE of a core)."""
    fewest = max(1, max_threads - math.floor(others + 1 - TAKE))
    most = max(1, max_threads - math.floor(others + 1 - RELEASE))
    return min(max(current, most), fewest)


class CoreGovernor:
    def __init__(self, max_threads: int | None = None, enabled: bool | None = None):
        import torch

        self.max_threads = max_threads or torch.get_num_threads()
        self.threads = self.max_threads
        if enabled is None:
            enabled = os.environ.get("UNWEIGHT_THREAD_GOVERNOR", "1") not in ("0", "", "false")
        self.enabled = enabled and self.max_threads > 1 and other_cpu() is not None
        self._last = time.monotonic()
        self._others_cpu = other_cpu() if self.enabled else None  # their CPU seconds so far, at the last look
        self.others = 0.0  # cores the other processes used, at the last look

    def step(self) -> int:
        """Look again if INTERVAL_S passed; returns the thread count in force."""
        if not self.enabled:
            return self.threads
        now = time.monotonic()
        if now - self._last < INTERVAL_S:
            return self.threads
        spent = other_cpu()
        if spent is None or self._others_cpu is None:
            return self.threads
        self.others = max(0.0, (spent - self._others_cpu) / (now - self._last))
        self._last, self._others_cpu = now, spent
        want = threads_for(self.others, self.max_threads, self.threads)
        if want != self.threads:
            self.apply(want)
        return self.threads

    def apply(self, n: int) -> None:
        import numba
        import torch

        # numba first: its first call starts its OpenMP layer, which sets the OpenMP thread count
        # that torch shares back to NUMBA_NUM_THREADS
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
        torch.set_num_threads(n)
        self.threads = n


_GOVERNOR: CoreGovernor | None = None


def governor() -> CoreGovernor:
    """The process's governor, made on first use with the thread count torch has then."""
    global _GOVERNOR
    if _GOVERNOR is None:
        _GOVERNOR = CoreGovernor()
    return _GOVERNOR


def set_threads(n: int) -> CoreGovernor:
    """Run torch and numba with n threads from now on, the governor's ceiling (serve workers)."""
    global _GOVERNOR
    _GOVERNOR = CoreGovernor(n)
    _GOVERNOR.apply(n)
    return _GOVERNOR
