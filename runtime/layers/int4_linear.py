"""`Int4Linear`: a linear layer whose weight is compressed-tensors W4A16 (INT4 codes, BF16 group
scales, zero points where the codes are asymmetric) kept coded in the resident `int4` layout (../kernels/int4.py).

`forward(x)` is x @ W.T by the CPU INT4 kernels (cpu_int4.int4_linear_cpu: fused for a few rows
of x, decoded rows and torch's GEMM for more), summed in fp32 and returned in x's dtype, the bias
added after. A layer in the GPU's layout (`gpu_layout()`, Int4ScalesWeight) runs the W4A16 GEMV
(kernels/int4_matmul.py) instead: the rows of x as the grouped launch's pairs, all on the one
weight, so one launch (each row reads W; no kernel takes several rows of x within the budget).
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.cpu_int4 import int4_linear_cpu
from ..kernels.weight import Int4ScalesWeight, Int4Weight, PlainInt4Weight


class Int4Linear(nn.Module):
    """W (out_features, in_features) as an Int4Weight (or a PlainInt4Weight where coding would not
    make it smaller); its streams are the module's buffers."""

    def __init__(self, weight: Int4Weight | PlainInt4Weight | Int4ScalesWeight):
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

    def _apply(self, fn, *args, **kwargs):
        """nn.Module's, then the weight over the moved buffers (`.to("cuda")` moves the streams)."""
        super()._apply(fn, *args, **kwargs)
        w = self.weight_int4
        self.weight_int4 = w.with_streams({role: getattr(self, f"int4_{role}") for role in w.ROLES})
        return self

    def gpu_layout(self) -> Int4Linear:
        """The same weight with its codes as stored and its scales coded (the W4A16 GEMV's), on the
        CPU: move it with `.to(device)`. ValueError for asymmetric codes, which the GEMV does not take."""
        w = Int4ScalesWeight.from_int4(self.weight_int4.to("cpu"))
        if not w.symmetric:
            raise ValueError(
                "an INT4 linear with zero points (asymmetric codes) has no GPU layout: the GEMV takes none"
            )
        return Int4Linear(w)

    @property
    def stored_bytes(self) -> int:
        return self.weight_int4.stored_bytes

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """(..., in_features) -> (..., out_features), x's dtype."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x {list(x.shape)} does not end in the layer's {self.in_features} input features")
        x2 = x.reshape(-1, self.in_features)
        if isinstance(self.weight_int4, Int4ScalesWeight):
            from ..kernels.int4_matmul import int4_experts_linear  # triton: imported where it runs

            # every row of x a pair on the one weight (expert 0): one launch, each pair reading W
            ids = torch.zeros(x2.shape[0], dtype=torch.int32, device=x2.device)
            y = int4_experts_linear(x2, self.weight_int4, ids, self.out_features, out_dtype=torch.float32)
        else:
            y = int4_linear_cpu(x2, self.weight_int4)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
