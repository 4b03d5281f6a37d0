"""RMSNorm, as transformers' LlamaRMSNorm computes it, and the same norm in one native call."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import cpu_pointwise
from .changes import changed


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm. `native` is the same norm in one native call (cpu_pointwise), with
    the residual add before it, for a CPU decode step's rows."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def _apply(self, fn, recurse=True):
        """nn.Module's move or cast, which may give the weight new storage: a decode step's plan
        that reads it by address looks again (changes.py)."""
        changed()
        return super()._apply(fn, recurse)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `native` takes x: cpu_pointwise's rows, in the weight's dtype."""
        return cpu_pointwise.takes(x) and x.dtype == self.weight.dtype

    def native(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """forward(x), or with `residual` forward(x + residual) with x += residual made in x's place
        (x is the layer's own residual stream); x (rows, n) in the weight's dtype, `takes` by
        cpu_pointwise. Within an ulp of forward's values (the sum of squares is taken another way)."""
        return cpu_pointwise.rms_norm_cpu(x, self.weight, self.eps, residual)
