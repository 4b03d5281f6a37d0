"""Rotary position embeddings (RoPE) with the scalings of the Llama family: none, linear, llama3.

Frequencies follow Hugging Face transformers' `modeling_rope_utils` (the test oracle); cos/sin are
computed in fp32 for the positions asked, then cast to the activations' dtype.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """(head_dim // 2,) fp32 angular frequency per rotated pair."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling
    kind = rs.get("rope_type", "default")
    if kind == "linear":
        return inv / float(rs["factor"])
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
        factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old_len = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return torch.where(medium, smoothed, scaled)
    return inv


class Rope:
    """cos/sin for any positions; apply() rotates (tokens, heads, head_dim) tensors in place of
    transformers' rotate_half convention (pairs are (i, i + head_dim/2))."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        self.inv_freq = inv_frequencies(cfg).to(device)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (positions, 1, head_dim) for positions 0..length-1 at least, computed once
        (and again, doubled, when a longer sequence comes): each decode step only indexes it."""
        cos, _ = self._tables.get(dtype, (None, None))
        if cos is None or cos.shape[0] < length:
            n = max(length, 256, 2 * (0 if cos is None else cos.shape[0]))
            freqs = torch.arange(n, device=self.inv_freq.device).to(torch.float32)[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
            self._tables[dtype] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return self._tables[dtype]

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, end: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, 1, head_dim) cos and sin for integer positions (tokens,), all below `end`. Give
        `end` when positions lie on a GPU: finding it there would wait for the device."""
        cos, sin = self._table(int(positions.max()) + 1 if end is None else end, dtype)
        return cos[positions], sin[positions]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
