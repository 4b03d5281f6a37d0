"""In-memory tensors to a container file and back: save_file and load_file, as safetensors.torch has them."""

from __future__ import annotations

import os

import numpy as np

from unweight.codec import CodecOptions, encode_tensor
from unweight.formats import ContainerWriter
from unweight.formats.dtypes import TORCH_DTYPES
from unweight.formats.safetensors_file import RESERVED_NAME

DTYPE_OF_TORCH = {v: k for k, v in TORCH_DTYPES.items()}  # torch dtype name -> safetensors dtype


def tensor_bytes(t) -> tuple[str, tuple[int, ...], np.ndarray]:
    """(safetensors dtype, shape, original bytes) of a torch tensor; non-contiguous is fine."""
    import torch

    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPE_OF_TORCH:
        raise TypeError(f"dtype {t.dtype} cannot be stored (supported: {', '.join(sorted(DTYPE_OF_TORCH))})")
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return DTYPE_OF_TORCH[name], tuple(t.shape), np.zeros(0, dtype=np.uint8)
    return DTYPE_OF_TORCH[name], tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy()


def save_file(tensors: dict, path: str | os.PathLike, threads: int | None = None, verify: bool = True) -> int:
    opts = CodecOptions(threads=threads, verify=verify)
    for name in tensors:
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be strings, not {name!r}")
        if name == RESERVED_NAME:
            raise ValueError(
                "a tensor may not be named '__metadata__': safetensors reserves that key, so the file decompressed "
                "from it would not load"
            )
    with ContainerWriter(os.fspath(path)) as writer:
        for name in sorted(tensors):
            dtype, shape, data = tensor_bytes(tensors[name])
            entry, streams = encode_tensor(name, dtype, shape, data, opts)
            writer.add(entry, streams)
        return writer.finish(source_header=None)


def load_file(path: str | os.PathLike, threads: int | None = None, max_memory: int | None = None) -> dict:
    from .reader import CompressedCheckpoint

    with CompressedCheckpoint(path, threads, max_memory=max_memory) as ckpt:
        return {name: ckpt.get_tensor(name) for name in ckpt.keys()}
