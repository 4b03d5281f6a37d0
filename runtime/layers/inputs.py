"""What the linear layers take: the dtype a device computes in, inputs cast to it, row ids checked
before a kernel indexes with them, and checkpoint tensors that can be stacked by rows."""

from __future__ import annotations

import torch

from unweight.codec import tiles


def compute_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype activations take on a device: fp32 on the CPU, BF16 on CUDA."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def compute_input(x: torch.Tensor, device: torch.device, note) -> torch.Tensor:
    if x.dtype is torch.bfloat16 or x.dtype is torch.float32 and device.type != "cuda":
        return x  # (the common case first: every forward passes here)
    want = compute_dtype(device)
    note(f"input is {x.dtype}; computing in {want}")
    return x.to(want)


def check_parts(entries) -> int:
    """in_features shared by 2-D BF16 tensors that are stacked by rows; errors name the tensor."""
    for e in entries:
        if not tiles.applies(e.dtype, e.shape):
            raise ValueError(f"tensor {e.name!r}: a linear weight must be 2-D BF16, not {e.dtype}{list(e.shape)}")
        if e.shape[1] != entries[0].shape[1]:
            raise ValueError(
                f"tensor {e.name!r} has {e.shape[1]} columns, {entries[0].name!r} {entries[0].shape[1]}: they cannot "
                f"be stacked"
            )
    return entries[0].shape[1]


def check_row_ids(ids: torch.Tensor | None, rows: int) -> None:
    """Row ids (None: all rows) must lie in [0, rows): a bad token id is refused before any
    kernel indexes with it."""
    if ids is not None and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        raise ValueError(f"row ids must lie in [0, {rows})")
