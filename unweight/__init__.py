"""Unweight: lossless LLM weight compression.

    import unweight
    unweight.compress("path/or/hub-id", "out-dir")          # a compressed mirror of the folder
    ckpt = unweight.open("out-dir")                          # lazy, mmap-backed reader
    w = ckpt.get_tensor("model.layers.0.mlp.up_proj.weight")
    unweight.decompress("out-dir", "restored")               # bit-identical safetensors back
    assert unweight.verify("out-dir", against="path").ok
    model = unweight.load("out-dir")                         # nn.Module; weights stay compressed
    print(unweight.generate(model, unweight.load_tokenizer("out-dir"), "Hello", max_new_tokens=20).text)

This module is the public facade; nothing heavy happens at import time.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .errors import CorruptDataError, DestinationError, FormatError, MemoryLimitError, SourceError, UnweightError

if TYPE_CHECKING:
    from .checkpoint import Progress
    from .reader import CompressedCheckpoint
    from .report import CompressReport, VerifyReport

__version__ = "0.1.0"


def compress(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    threads: int | None = None,
    verify: bool = True,
    precision: int | None = None,
    chunk: int | None = None,
    layout: str = "archive",
    revision: str | None = None,
    progress: Progress | None = None,
    max_memory: int | None = None,
) -> CompressReport:
    """Compress a Hugging Face checkpoint (local folder, .safetensors file or Hub repo id) into
    the folder `dst`, which must not exist. Returns the per-tensor report.

    layout="archive" (default) is the smallest; layout="serving" stores 2-D BF16 weights in the
    fixed-rate tiles that GPU kernels read directly (formats/SPEC.md §3.4). max_memory (bytes):
    refuse, with MemoryLimitError, a tensor whose encoding would need more."""
    from .checkpoint import compress as _compress
    from .codec import CodecOptions

    kw = {k: v for k, v in {"precision": precision, "chunk": chunk}.items() if v is not None}
    options = CodecOptions(threads=threads, verify=verify, layout=layout, **kw)
    if not os.path.exists(src) and _looks_like_repo_id(str(src)):
        from .hub import resolve_source  # the only code that reaches the Hub, imported only for a Hub id

        src = resolve_source(str(src), revision)
    return _compress(src, dst, options, progress, max_memory)


def _register_with_transformers() -> None:
    """transformers' `from_pretrained` loads compressed folders once unweight is imported
    (unweight.runtime.transformers); transformers itself is not imported here."""
    from unweight.runtime.transformers import install_hook

    install_hook()


_register_with_transformers()


def _guard_mappings() -> None:
    """A checkpoint file that shrinks while mapped ends the process with a line naming it instead
    of a silent SIGBUS (unweight/mapguard.py, loaded and compiled at the first mapping, not here)."""
    from .formats.safetensors_file import MAP_OBSERVERS

    def observe(path: str, address: int, length: int):
        from .mapguard import observe

        return observe(path, address, length)

    MAP_OBSERVERS.append(observe)


_guard_mappings()


def _looks_like_repo_id(s: str) -> bool:
    parts = s.split("/")
    return len(parts) == 2 and all(parts) and not s.startswith((".", "/", "~"))


def decompress(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    threads: int | None = None,
    progress: Progress | None = None,
    max_memory: int | None = None,
) -> int:
    """Write bit-identical safetensors files of a compressed folder into `dst` (must not exist).
    Large tensors go in pieces, smaller under a max_memory budget (bytes)."""
    from .checkpoint import decompress as _decompress

    return _decompress(src, dst, threads, progress, max_memory)


def verify(
    path: str | os.PathLike,
    against: str | os.PathLike | None = None,
    *,
    threads: int | None = None,
    progress: Progress | None = None,
    max_memory: int | None = None,
) -> VerifyReport:
    """Decode every tensor and check checksums; with `against`, compare with the original bytes.
    Large tensors go in pieces, smaller under a max_memory budget (bytes)."""
    from .checkpoint import verify as _verify

    return _verify(path, against, threads, progress, max_memory)


def inspect(path: str | os.PathLike, *, threads: int | None = None, max_memory: int | None = None, processes: int = 1):
    """Per-tensor statistics (codec, sizes, exponent entropy, order-0 bound); processes > 1 reads
    a checkpoint of many tensors in that many worker processes (the caller's script needs an
    `if __name__ == "__main__":` guard)."""
    from .inspection import inspect as _inspect

    return _inspect(path, threads, max_memory, processes)


def open(path: str | os.PathLike, *, threads: int | None = None, max_memory: int | None = None) -> CompressedCheckpoint:  # noqa: A001
    """A lazy reader of a compressed folder or file: `.keys()`, `.get_tensor(name)`. A tensor
    that would need more than max_memory bytes (default: the memory available) is refused with
    MemoryLimitError before it is decoded."""
    from .reader import CompressedCheckpoint

    return CompressedCheckpoint(path, threads, max_memory)


def load(
    path: str | os.PathLike,
    device: str = "cpu",
    layout: str = "serving",
    *,
    threads: int | None = None,
    max_cache_tokens: int | None = None,
    kv_cache_dtype: str = "auto",
    dtype: str = "auto",
):
    """A compressed Llama-family checkpoint as an nn.Module whose linears stay compressed.

    layout="serving" (the default) keeps 2-D weights in the fixed-rate tiles the fused kernels read
    (archive-layout checkpoints are transcoded at load); layout="archive" keeps the stored streams
    and decodes each weight at every use (smallest memory, slow). device: "cpu" or "cuda[:n]".
    dtype: the compute dtype, as vLLM's --dtype: "auto" (BF16 on a GPU and on a CPU with
    AVX512_BF16, FP32 on other CPUs), "bfloat16" or "float32"; the weights are exact in either, and
    FP32 gives transformers' FP32 tokens (docs/runtime.md). kv_cache_dtype: "auto" (the compute
    dtype), "bfloat16" or "float32", as vLLM's --kv-cache-dtype."""
    from unweight.runtime.model.loader import load as _load

    return _load(
        path,
        device,
        layout,
        threads=threads,
        max_cache_tokens=max_cache_tokens,
        kv_cache_dtype=kv_cache_dtype,
        dtype=dtype,
    )


def load_tokenizer(path: str | os.PathLike):
    """The checkpoint's tokenizer and chat template (transformers' AutoTokenizer)."""
    from unweight.runtime.generate import load_tokenizer as _load_tokenizer

    return _load_tokenizer(path)


def generate(model, tokenizer, prompt, *, chat: bool = False, **sampling):
    """A whole completion (`GenerationResult`: text, token_ids, finish_reason, timings).
    prompt: a string, or a list of chat messages; sampling: max_new_tokens, temperature, top_p,
    top_k, seed, stop."""
    from unweight.runtime.generate import generate as _generate

    return _generate(model, tokenizer, prompt, chat=chat, **sampling)


def stream(model, tokenizer, prompt, *, chat: bool = False, **sampling):
    """Like generate, but an iterator of text pieces as they are made (`.result` at the end)."""
    from unweight.runtime.generate import stream as _stream

    return _stream(model, tokenizer, prompt, chat=chat, **sampling)


def save_file(tensors: dict, path: str | os.PathLike, *, threads: int | None = None, verify: bool = True) -> int:
    """Compress a dict of torch tensors (any dtype; 0-d, empty and non-contiguous work) into one
    container file, like safetensors.torch.save_file; returns the file size."""
    from .tensors import save_file as _save

    return _save(tensors, path, threads=threads, verify=verify)


def load_file(path: str | os.PathLike, *, threads: int | None = None, max_memory: int | None = None) -> dict:
    """All tensors of a container file as a dict of torch tensors (bit-exact)."""
    from .tensors import load_file as _load

    return _load(path, threads=threads, max_memory=max_memory)


__all__ = [
    "CorruptDataError",
    "DestinationError",
    "FormatError",
    "MemoryLimitError",
    "SourceError",
    "UnweightError",
    "compress",
    "decompress",
    "generate",
    "inspect",
    "load",
    "load_file",
    "load_tokenizer",
    "open",
    "save_file",
    "stream",
    "verify",
]
