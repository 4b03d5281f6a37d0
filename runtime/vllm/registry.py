"""The layers the plugin's custom ops run, by number: an op's arguments must be tensors and plain
values, so `unweight::linear` and `unweight::experts` name their layer by an int.

The registry holds its layers weakly: when an engine is dropped, its layers go with it, and a
process that builds several engines in turn keeps only the live ones. `warn_once` is the plugin's one
warning of each fallback (a layer left dense, a tied head it does not hold), shared by plugin.py and
experts.py.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref

from torch import nn


class Registry:
    """int -> a live nn.Module; numbers are never reused within a process."""

    def __init__(self) -> None:
        self._layers: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
        self._numbers = itertools.count()
        self._lock = threading.Lock()

    def add(self, layer: nn.Module) -> int:
        with self._lock:
            number = next(self._numbers)
            self._layers[number] = layer
        return number

    def __getitem__(self, number: int) -> nn.Module:
        return self._layers[number]

    def __len__(self) -> int:
        return len(self._layers)

    def values(self) -> list[nn.Module]:
        return list(self._layers.values())


log = logging.getLogger("vllm.unweight")  # under vLLM's logger: its handler and level, its format
_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """Log `message` at WARNING the first time this process sees it."""
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning("unweight: %s", message)
