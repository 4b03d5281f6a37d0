"""`Int4Linear`: a linear layer whose weight is compressed-tensors W4A16 (INT4 codes, BF16 group
scales, zero points where the codes are asymmetric) kept coded in the resident `int4` layout (../kernels/int4.py).

`forward(x)` is x @ W.T by the CPU INT4 kernels (cpu_int4.int4_linear_cpu: fused for a few rows
of x, decoded rows and torch's GEMM for more), summed in fp32 and returned in x's dtype, the bias
added after.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.cpu_int4 import int4_linear_cpu
from ..kernels.weight import Int4Weight, PlainInt4Weight


class Int4Linear(nn.Module):
    """W (out_features, in_features) as an Int4Weight (or a PlainInt4Weight where coding would not
    make it smaller); its streams are the module's buffers."""

    def __init__(self, weight: Int4Weight | PlainInt4Weight):
        super().__init__()
        self.weight_int4 = weight
        self.in_features, self.out_features = weight.cols, weight.rows
        for role, t in weight.streams().items():  # counted as the layer's memory, moved with it
            self.register_buffer(f"int4_{role}", t, persistent=False)

    @classmethod
    def from_packed(
        cls, packed: torch.Tensor, scales: torch.Tensor, group: int, zero: torch.Tensor | None = None
    ) -> Int4Linear:
        """From compressed-tensors' `weight_packed` (N, K / 8) int32, `weight_scale` (N, K / group) and,
        for asymmetric codes, `weight_zero_point` (ceil(N / 8), K / group) int32."""
        from .int4_experts import stacked

        return cls(stacked(packed[None], scales[None], group, None if zero is None else zero[None]))

    @property
    def stored_bytes(self) -> int:
        return self.weight_int4.stored_bytes

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """(..., in_features) -> (..., out_features), x's dtype."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x {list(x.shape)} does not end in the layer's {self.in_features} input features")
        y = int4_linear_cpu(x.reshape(-1, self.in_features), self.weight_int4)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
