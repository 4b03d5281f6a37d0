"""Typed errors of the library. Libraries raise; only the CLI turns these into one-line messages."""

from __future__ import annotations

from unweight.formats import FormatError


class UnweightError(Exception):
    """Base of the errors about inputs and outputs the user chose (not about file contents)."""


class SourceError(UnweightError):
    """The checkpoint to compress cannot be used (missing, pickle, no safetensors, bad index)."""


class DestinationError(UnweightError):
    """The output location cannot be written (already exists, not a folder, ...)."""


class CorruptDataError(FormatError):
    """A tensor's streams do not decode, or decode to bytes whose checksum is wrong."""


class MemoryLimitError(FormatError):
    """A tensor would need more memory than the budget allows (max_memory / --max-memory, else the
    memory this machine has available): refused before anything is allocated."""


__all__ = ["CorruptDataError", "MemoryLimitError", "DestinationError", "FormatError", "SourceError", "UnweightError"]
