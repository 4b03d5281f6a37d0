"""The serving layout's streams as the runtime holds them: torch tensors on one device."""

from __future__ import annotations

import numpy as np
import torch

from unweight.codec import tiles


def tile_tensors(streams: dict[str, np.ndarray], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """uint8 sm, codes and esc (at least one byte, so kernels always get a valid pointer) and
    esc_index widened to int64 entries (kernels add it to 64-bit element offsets). Writable
    streams are taken over, not copied: the caller must not change them afterwards."""
    esc = np.asarray(streams["esc"], dtype=np.uint8)
    out = {
        "sm": np.asarray(streams["sm"], dtype=np.uint8),
        "codes": np.asarray(streams["codes"], dtype=np.uint8),
        "esc": esc if len(esc) else np.zeros(1, dtype=np.uint8),
        "esc_index": tiles.esc_index_entries(streams["esc_index"]),
    }
    # arrays the caller owns become the tensors' storage; read-only ones (a file mapping's) are copied
    return {k: torch.from_numpy(v if v.flags.writeable else np.array(v)).to(device) for k, v in out.items()}
