"""The one error type of the format layer: every failure names the file, the tensor and the rule."""

from __future__ import annotations

import os


class FormatError(ValueError):
    """A file is not what it claims to be (truncated, corrupt, hostile or of an unknown version)."""

    def __init__(self, path: str | os.PathLike | None, message: str, tensor: str | None = None):
        self.path = None if path is None else os.fspath(path)
        self.tensor = tensor
        self.reason = message
        where = [p for p in (self.path, f"tensor {tensor!r}" if tensor is not None else None) if p]
        super().__init__(": ".join([*where, message]))

    def __reduce__(self):  # pickled as its parts (a worker process raises it to its parent)
        return type(self), (self.path, self.reason, self.tensor)
