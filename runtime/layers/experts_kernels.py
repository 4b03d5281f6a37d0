"""The table of routed-experts kernels: each row one way to compute an `UnweightExperts` layer's
output for the router's choice, for a weight kind (runtime/kernels/weight.py) on a device, as
linear_kernels.KERNELS is for one linear.

A row names its pipeline (the autotuner's and UNWEIGHT_PIPELINE's name), says whether it takes the
experts' weights for a number of (token, expert) pairs on a device (`can_implement`), and computes
(`apply`). The layer lists the rows that read its weights' kind, and the autotuner chooses among
those that can take the call; a subclass names another table (the vLLM plugin swaps one row).

| pipeline | `TilesWeight` (CPU) | `QTilesWeight` (CUDA) |
| --- | --- | --- |
| `decode_matmul` | the routed experts decoded, then F.linear per expert | the same |
| `fused` (pairs <= FUSED_MAX_PAIRS) | a grouped numba GEMV call a weight | a grouped Triton GEMV launch a weight |

(On CUDA the grouped launch reads the expert ids on the device: no host sync.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cpu_gemv import tiles_grouped_gemv_cpu
from ..kernels.weight import QTilesWeight, TilesWeight
from .inputs import compute_dtype

FUSED_MAX_PAIRS = 256  # (token, expert) pairs up to which `fused` competes; larger batches decode and multiply
ACTIVATIONS = ("silu", "gelu")  # act_and_mul(h) = act(h[:, :I]) * h[:, I:]


def act_and_mul(h: torch.Tensor, activation: str) -> torch.Tensor:
    """(..., 2I) -> (..., I): the activation of the gate half times the up half."""
    gate, up = h.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate) * up
    raise ValueError(f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")


def check_routing(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str, hidden: int):
    """ValueError naming what of an experts layer's call does not fit: the activation, x (T, hidden),
    and the router's choice (T, k) ids and weights."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    if x.dim() != 2 or x.shape[1] != hidden or topk_ids.shape != topk_weights.shape:
        raise ValueError(
            f"x {list(x.shape)}, topk_weights {list(topk_weights.shape)} and topk_ids {list(topk_ids.shape)} "
            f"do not fit experts of hidden size {hidden}"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {list(topk_ids.shape)} must be (tokens, k) for {x.shape[0]} tokens")


def experts_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts compute in: BF16 for BF16 x (on the CPU too), else compute_dtype."""
    return torch.bfloat16 if x.dtype is torch.bfloat16 else compute_dtype(x.device)


@dataclass(frozen=True)
class Routing:
    """One call's (token, slot) pairs grouped by expert: pairs sorted by expert id (stably, so in
    token order within an expert); group g, the pairs [starts[g], starts[g + 1]), goes to expert
    experts[g]."""

    tokens: torch.Tensor  # (P,) the token of each pair
    scale: torch.Tensor  # (P, 1) its router weight
    experts: torch.Tensor  # the routed experts, ascending (int64, on the host)
    starts: np.ndarray  # (len(experts) + 1,)
    xs: torch.Tensor  # (P, H) each pair's input (times its weight with weights_on_input)

    @classmethod
    def of(cls, layer: nn.Module, x: torch.Tensor, w: torch.Tensor, topk_ids: torch.Tensor, on_input: bool) -> Routing:
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1).to(torch.int64)
        order = torch.argsort(flat, stable=True)
        if flat.numel():
            lo, hi = (int(v) for v in torch.aminmax(flat))
            if lo < 0 or hi >= layer.num_experts:
                raise ValueError(f"expert ids must lie in [0, {layer.num_experts})")
        counts = torch.bincount(flat, minlength=layer.num_experts).cpu()
        experts = torch.nonzero(counts).reshape(-1)
        starts = np.concatenate([[0], np.cumsum(counts[experts].numpy())])
        tokens, scale = order // k, w.reshape(-1)[order][:, None]
        return cls(tokens, scale, experts, starts, x[tokens] * scale if on_input else x[tokens])

    def combine(self, y: torch.Tensor, t: int, on_input: bool, dtype: torch.dtype) -> torch.Tensor:
        """(T, H) in `dtype`: each pair's output y (P, H), times its weight unless that scaled the
        input (then rounded to `dtype`), summed per token."""
        out = torch.zeros(t, y.shape[1], dtype=dtype, device=y.device)
        out.index_add_(0, self.tokens, (y if on_input else y * self.scale).to(dtype))
        return out


class ExpertsKernel:
    """One row of KERNELS: `name`, the weight kind(s) it reads, the device type it runs on (None: any).
    `apply` takes the layer (an UnweightExperts: w13 and w2, their sizes) and the call's arguments
    as UnweightExperts.forward has checked them, and returns x's dtype."""

    name: ClassVar[str]
    weight_kind: ClassVar[type | tuple[type, ...]]
    device_type: ClassVar[str | None] = None

    @classmethod
    def can_implement(cls, weight: TilesWeight | QTilesWeight, pairs: int, device: torch.device) -> bool:
        """Whether this kernel takes experts whose weights are `weight`'s kind for `pairs` (token,
        expert) pairs (a batch bucket) on `device`."""
        return isinstance(weight, cls.weight_kind) and cls.device_type in (None, device.type)

    @staticmethod
    def apply(layer: nn.Module, x, topk_weights, topk_ids, activation: str, weights_on_input: bool) -> torch.Tensor:
        raise NotImplementedError


class DecodeMatmul(ExpertsKernel):
    """The routed experts decoded in the compute dtype, then F.linear per expert (large batches,
    training: torch's ops give x and the router weights their gradients)."""

    name, weight_kind = "decode_matmul", (TilesWeight, QTilesWeight)

    @staticmethod
    def apply(layer, x, topk_weights, topk_ids, activation, weights_on_input):
        dtype = experts_dtype(x)
        r = Routing.of(layer, x.to(dtype), topk_weights.to(dtype), topk_ids, weights_on_input)
        w13, w2 = layer.expert_weights(r.experts, dtype)
        y = torch.cat(
            [
                F.linear(act_and_mul(F.linear(r.xs[a:b], w13[g]), activation), w2[g])
                for g, (a, b) in enumerate(zip(r.starts[:-1], r.starts[1:]))
            ]
        )
        return r.combine(y, x.shape[0], weights_on_input, dtype).to(x.dtype)


class _Fused(ExpertsKernel):
    @classmethod
    def can_implement(cls, weight, pairs: int, device: torch.device) -> bool:
        return pairs <= FUSED_MAX_PAIRS and super().can_implement(weight, pairs, device)


class CpuFused(_Fused):
    """One grouped numba GEMV call a weight: each routed expert's rows times the pairs routed to it."""

    name, weight_kind, device_type = "fused", TilesWeight, "cpu"

    @staticmethod
    def apply(layer, x, topk_weights, topk_ids, activation, weights_on_input):
        dtype = experts_dtype(x)
        r = Routing.of(layer, x.to(dtype), topk_weights.to(dtype), topk_ids, weights_on_input)
        rows, ids = 2 * layer.intermediate, r.experts.numpy()
        h = tiles_grouped_gemv_cpu(r.xs, layer.w13.compressed_weight, r.starts, ids * rows, rows)  # fp32 sums
        hid = act_and_mul(h.to(dtype), activation)  # in BF16 as decode_matmul's F.linear gives it
        y = tiles_grouped_gemv_cpu(hid, layer.w2.compressed_weight, r.starts, ids * layer.hidden, layer.hidden)
        return r.combine(y, x.shape[0], weights_on_input, dtype).to(x.dtype)


class CudaFused(_Fused):
    """Two grouped Triton GEMV launches over all (token, slot) pairs, the expert ids read on the
    device (qtiles_experts_linear): no host sync."""

    name, weight_kind, device_type = "fused", QTilesWeight, "cuda"

    @staticmethod
    def apply(layer, x, topk_weights, topk_ids, activation, weights_on_input):
        from ..kernels.qtiles_matmul import qtiles_experts_linear

        dtype = experts_dtype(x)
        xc, w = x.to(dtype), topk_weights.to(dtype)
        t, k = topk_ids.shape
        ids = topk_ids.reshape(-1)
        if weights_on_input:  # pair p = (t, j) reads x[t] * w[t, j]
            xc, x_div = (xc[:, None, :] * w[:, :, None]).reshape(t * k, layer.hidden), 1
        else:
            x_div = k
        h = qtiles_experts_linear(xc, layer.w13.compressed_weight, ids, 2 * layer.intermediate, x_div)
        y = qtiles_experts_linear(act_and_mul(h, activation), layer.w2.compressed_weight, ids, layer.hidden, 1)
        y = y.view(t, k, layer.hidden)
        y = y.sum(1) if weights_on_input else (y.float() * w[:, :, None].float()).sum(1)
        return y.to(x.dtype)


KERNELS: tuple[type[ExpertsKernel], ...] = (DecodeMatmul, CpuFused, CudaFused)
PIPELINES = tuple(dict.fromkeys(k.name for k in KERNELS))  # ("decode_matmul", "fused")
