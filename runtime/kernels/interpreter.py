"""What the Triton kernels need to know of Triton's CPU interpreter (TRITON_INTERPRET=1, how CI runs
them): whether it is on (a launcher then asks for a kernel's integer model of its inline PTX), and a
fix it needs before Triton 3.7, applied when this module is imported."""

from __future__ import annotations

import os

import triton


def interpreted() -> bool:
    """Whether Triton runs kernels through its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _index_fix() -> None:
    """Triton before 3.7 turns a scalar of its CPU interpreter into an int with int() on a 1-element
    array, which numpy 2.4 made an error (`only 0-dimensional arrays can be converted`): every kernel
    that loops over a runtime bound failed under TRITON_INTERPRET=1. Later tritons squeeze the array
    first; so does this, on the interpreter only (compiled kernels never take this path)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_unweight_index_fix", False):
        return

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch._unweight_index_fix = True
    interpreter._patch_lang_tensor = patch


if os.environ.get("TRITON_INTERPRET") == "1" and tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7):
    _index_fix()
