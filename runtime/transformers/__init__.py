"""transformers' door: `from_pretrained` on a compressed folder, its weights kept compressed.

transformers has no plugin discovery, so `import unweight` registers the `unweight` quantization
method (`UnweightConfig`, `UnweightHfQuantizer`: quantizer.py, whose `register` does it) when
transformers' quantizer registry is imported: at once if it already is, else right after it loads
(a one-shot import hook, so that importing unweight never imports transformers). `register()` does
it by hand.

A compressed folder opened by transformers without unweight fails loudly: every tensor has a
placeholder of the wrong shape under its name (formats/SPEC.md §1).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_REGISTRY = "transformers.quantizers.auto"


def register() -> None:
    """Register the quantizer and its config with transformers (idempotent)."""
    from transformers.quantizers import auto

    from unweight.hf_config import QUANT_METHOD

    if QUANT_METHOD in auto.AUTO_QUANTIZER_MAPPING:
        return
    being_imported = sys.modules.get(f"{__name__}.quantizer")
    if being_imported is not None and not hasattr(being_imported, "register"):
        return  # its own import loaded transformers' registry: it registers itself once it is done
    from .quantizer import register as register_quantizer

    register_quantizer()


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when transformers' quantizer registry is imported, it wraps the real
    loader so that `register()` runs as soon as the module has executed, then leaves sys.meta_path."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _REGISTRY:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            register()

        spec.loader.exec_module = exec_module
        return spec


def install_hook() -> None:
    """Register now if transformers' registry is loaded, else as soon as it is."""
    if _REGISTRY in sys.modules:
        register()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
