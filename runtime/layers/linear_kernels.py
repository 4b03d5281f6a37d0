"""The table of linear kernels: each row one way to compute y = x @ W^T for a weight kind
(runtime/kernels/weight.py) on a device, in the manner of vLLM's `MPLinearKernel` table.

A row names its pipeline (the name the autotuner caches its choices under, and UNWEIGHT_PIPELINE
forces), says whether it takes a weight for m rows of x on a device (`can_implement`), and computes
(`apply`). A new weight kind or kernel is one more class in KERNELS; UnweightLinear lists the rows
of its weight's kind and lets the autotuner choose among them.

| pipeline | `TilesWeight` (CPU) | `QTilesWeight` (CUDA) |
| --- | --- | --- |
| `decode_matmul` | numba decode in x's dtype into a workspace, then F.linear | Triton decode to BF16, then F.linear |
| `fused` | numba GEMV that rebuilds each row in cache | Triton kernel that decodes W in registers (m <= MAX_M) |
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cpu_gemv import tiles_gemv_cpu, tiles_rows_cpu
from ..kernels.weight import QTilesWeight, TilesWeight
from . import workspace


class LinearKernel:
    """One row of KERNELS: `name`, the weight kind it reads, the device type it runs on. `apply`
    takes the layer (an UnweightLinear: its `compressed_weight`, shape, decode and plan cache)."""

    name: ClassVar[str]
    weight_kind: ClassVar[type]
    device_type: ClassVar[str]

    @classmethod
    def can_implement(cls, weight: TilesWeight | QTilesWeight, m: int, device: torch.device) -> bool:
        """Whether this kernel takes `weight` for m rows of x (a batch bucket) on `device`."""
        return isinstance(weight, cls.weight_kind) and device.type == cls.device_type

    @staticmethod
    def apply(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T in x's dtype, W the layer's weight (x on its device, in its compute dtype)."""
        raise NotImplementedError


def _decode_matmul(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.decoded_weight(x.dtype))


class CpuDecodeMatmul(LinearKernel):
    """W decoded in x's dtype, then F.linear (prefill, large batches)."""

    name, weight_kind, device_type = "decode_matmul", TilesWeight, "cpu"

    @staticmethod
    def apply(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        nbytes = layer.out_features * layer.in_features * x.element_size()
        grad = torch.is_grad_enabled() and x.requires_grad
        if x.device.type != "cpu" or nbytes > workspace.WORKSPACE_MAX_BYTES or grad:
            return _decode_matmul(layer, x)
        # W written straight in x's dtype into this thread's workspace, which F.linear is done
        # with before any other layer decodes there: no fresh pages to fault in, no fp32 copy
        buf = workspace.WORKSPACE.take(nbytes)
        w = torch.from_numpy(buf).view(x.dtype).view(layer.out_features, layer.in_features)
        return F.linear(x, tiles_rows_cpu(layer.compressed_weight, None, x.dtype, out=w))


class CpuFused(LinearKernel):
    """The numba GEMV that rebuilds each row of W in cache (decode-time batches)."""

    name, weight_kind, device_type = "fused", TilesWeight, "cpu"

    @staticmethod
    def apply(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        plan = layer._cpu_gemv()
        y = plan(x) if plan is not None else tiles_gemv_cpu(x, layer.compressed_weight)
        return y if y.dtype is x.dtype else y.to(x.dtype)


class CudaDecodeMatmul(LinearKernel):
    """The Triton decode to BF16, then F.linear (prefill, batches over MAX_M)."""

    name, weight_kind, device_type = "decode_matmul", QTilesWeight, "cuda"
    apply = staticmethod(_decode_matmul)


class CudaFused(LinearKernel):
    """The Triton kernels that decode W in registers: batches up to MAX_M rows."""

    name, weight_kind, device_type = "fused", QTilesWeight, "cuda"

    @classmethod
    def can_implement(cls, weight, m: int, device: torch.device) -> bool:
        if not super().can_implement(weight, m, device):
            return False
        from ..kernels.qtiles_matmul import MAX_M

        return m <= MAX_M

    @staticmethod
    def apply(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from ..kernels.qtiles_matmul import qtiles_linear

        return qtiles_linear(x, layer.compressed_weight)


KERNELS: tuple[type[LinearKernel], ...] = (CpuDecodeMatmul, CudaDecodeMatmul, CpuFused, CudaFused)
PIPELINES = tuple(dict.fromkeys(k.name for k in KERNELS))  # ("decode_matmul", "fused")


def kernels_for(
    weight: TilesWeight | QTilesWeight, table: tuple[type[LinearKernel], ...] = KERNELS
) -> dict[str, type[LinearKernel]]:
    """The rows of `table` that read `weight`'s kind, by pipeline name, in table order."""
    return {k.name: k for k in table if isinstance(weight, k.weight_kind)}
