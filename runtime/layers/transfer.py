"""Host-to-device copies that do not wait for the device.

A plain `tensor.to("cuda")` from pageable host memory synchronises the stream: the host waits for
every kernel queued before it. Each decode step copies a few small index tensors (positions, token
ids, KV block ids), so each would stall the step. Staged through pinned memory and copied with
non_blocking=True, the copy is queued behind the kernels instead; torch's pinned-memory cache
keeps the staging buffer until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (on the CPU) on `device`, without waiting for a GPU to drain its queue."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
