"""`UnweightExperts`: a mixture-of-experts layer's routed experts, their weights in the serving layout.

E experts, each a gated MLP y = w2 @ act_and_mul(w13 @ x) with w13 (2I, H) (the gate's I rows,
then the up projection's) and w2 (H, I), all BF16. Each of the two weights is held for all
experts as one stacked `UnweightLinear` (w13: (E * 2I, H), w2: (E * H, I)), expert e's weight
being rows [e * 2I, (e + 1) * 2I) (rows [e * H, (e + 1) * H)): both layouts (tiles on the CPU,
qtiles on CUDA) keep rows independent, so an expert is a row range, and moving the layer between
devices transcodes it as UnweightLinear does.

`forward(x, topk_weights, topk_ids)` takes the router's choice (T tokens, k experts each) and
picks a pipeline per (shape, batch bucket) with the autotuner, among the rows of the experts' kernel
table (experts_kernels.py) that take the call:

- `fused`: on the CPU, one grouped numba GEMV call a weight, each routed expert's rows times the
  tokens routed to it; on CUDA, one grouped Triton GEMV launch per weight over all (token, slot)
  pairs, the expert ids read on the device: no host sync;
- `decode_matmul`: the routed experts decoded (in the compute dtype: BF16 for BF16 x and on CUDA,
  else fp32), then F.linear per expert.

Only the routed experts are read: a decode step of a top-k MoE touches k experts' bytes a token.
`reference_experts` below is the plain fp32 computation on dense weights that the tests hold both
pipelines to. `expert_weights(ids)` decodes whole experts (the vLLM plugin hands them to vLLM's
own fused-MoE kernel).
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from .autotune import DEFAULT, FORCE_ENV, Autotuner, batch_bucket, code_version, device_name
from .experts_kernels import ACTIVATIONS, FUSED_MAX_PAIRS, KERNELS, PIPELINES, act_and_mul, check_routing
from .linear import UnweightLinear
from .linear_kernels import kernels_for

__all__ = ["ACTIVATIONS", "FUSED_MAX_PAIRS", "PIPELINES", "UnweightExperts", "act_and_mul", "reference_experts"]


def reference_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    weights_on_input: bool = False,
) -> torch.Tensor:
    """The oracle: sum over slots j of topk_weights[t, j] * expert topk_ids[t, j](x[t]), in fp32, one
    token and slot at a time, on dense w13 (E, 2I, H) and w2 (E, H, I)."""
    x, w13, w2 = x.float(), w13.float(), w2.float()
    out = torch.zeros(x.shape[0], w2.shape[1])
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e, w = int(topk_ids[t, j]), float(topk_weights[t, j])
            xt = x[t] * w if weights_on_input else x[t]
            y = w2[e] @ act_and_mul(w13[e] @ xt, activation)
            out[t] += y if weights_on_input else w * y
    return out


class UnweightExperts(nn.Module):
    """E routed experts with w13 (E, 2I, H) and w2 (E, H, I) as stacked UnweightLinear layers."""

    AUTOTUNE_TAG = "experts"
    KERNELS = KERNELS  # the kernel table this class chooses from (experts_kernels.py)

    def __init__(self, w13: UnweightLinear, w2: UnweightLinear, num_experts: int, autotuner: Autotuner | None = None):
        super().__init__()
        if num_experts < 1 or w13.out_features % (2 * num_experts) or w2.out_features % num_experts:
            raise ValueError(
                f"{num_experts} experts do not divide w13's {w13.out_features} rows into gate/up pairs or w2's "
                f"{w2.out_features} rows"
            )
        self.num_experts = num_experts
        self.hidden = w13.in_features
        self.intermediate = w13.out_features // (2 * num_experts)
        if (w2.in_features, w2.out_features // num_experts) != (self.intermediate, self.hidden):
            raise ValueError(
                f"w2 is ({w2.out_features}, {w2.in_features}) for {num_experts} experts; w13 needs "
                f"({num_experts * self.hidden}, {self.intermediate})"
            )
        self.w13, self.w2 = w13, w2
        self.autotuner = autotuner or DEFAULT
        self._chosen: dict[tuple, str] = {}

    @classmethod
    def from_values(
        cls,
        w13: np.ndarray,
        w2: np.ndarray,
        num_experts: int,
        hidden: int,
        intermediate: int,
        device: torch.device | str | None = None,
    ) -> UnweightExperts:
        """From the experts' BF16 bit patterns (uint16), w13 as (E, 2I, H) and w2 as (E, H, I) in
        any shape of those sizes, encoded for `device` (tiles on the CPU, qtiles on CUDA)."""
        rows13, rows2 = num_experts * 2 * intermediate, num_experts * hidden
        if w13.size != rows13 * hidden or w2.size != rows2 * intermediate:
            raise ValueError(
                f"w13 has {w13.size} values and w2 {w2.size}; {num_experts} experts of hidden size {hidden} and "
                f"intermediate size {intermediate} need {rows13 * hidden} and {rows2 * intermediate}"
            )
        lin = UnweightLinear.from_values
        return cls(
            lin(w13.reshape(-1), rows13, hidden, None, device),
            lin(w2.reshape(-1), rows2, intermediate, None, device),
            num_experts,
        )

    @classmethod
    def from_tiles(cls, w13: tuple, w2: tuple, num_experts: int, hidden: int, intermediate: int) -> UnweightExperts:
        """From tile sets already encoded (`tiles.RowsEncoder.finish()`: (params, streams)) of w13
        stacked as (E*2I, H) and w2 as (E*H, I), on the CPU."""
        (p13, s13), (p2, s2) = w13, w2
        return cls(
            UnweightLinear(hidden, num_experts * 2 * intermediate, s13, p13.to_json()),
            UnweightLinear(intermediate, num_experts * hidden, s2, p2.to_json()),
            num_experts,
        )

    @property
    def stored_bytes(self) -> int:
        return self.w13.stored_bytes + self.w2.stored_bytes

    def expert_weights(self, ids, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 (n, 2I, H), w2 (n, H, I)) of experts `ids` (host ints), decoded on the layer's device."""
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_experts):
            raise ValueError(f"expert ids must lie in [0, {self.num_experts})")
        n, i2 = ids.numel(), 2 * self.intermediate
        rows13 = (ids[:, None] * i2 + torch.arange(i2)).reshape(-1)
        rows2 = (ids[:, None] * self.hidden + torch.arange(self.hidden)).reshape(-1)
        return (
            self.w13.rows(rows13, dtype).reshape(n, i2, self.hidden),
            self.w2.rows(rows2, dtype).reshape(n, self.hidden, self.intermediate),
        )

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: str = "silu",
        weights_on_input: bool = False,
    ) -> torch.Tensor:
        """(T, H) -> (T, H): sum over j of topk_weights[:, j] * expert topk_ids[:, j](x) (with
        `weights_on_input`, vLLM's apply_router_weight_on_input: the weight scales the expert's
        input instead of its output). Computes in BF16 for BF16 x (on the CPU too, as UnweightLinear
        does: the fused GEMV by vdpbf16ps where the CPU has it), else in compute_dtype(device);
        returns x's dtype."""
        check_routing(x, topk_weights, topk_ids, activation, self.hidden)
        device = self.w13.compressed_weight.device
        if x.device != device:
            raise ValueError(f"input is on {x.device}, the experts on {device}")
        if torch.is_grad_enabled() and (x.requires_grad or topk_weights.requires_grad):
            # training adapters on the frozen base: torch's ops give x and the routing weights their
            # gradients (the routed experts' decoded weights are kept for the backward pass)
            return self.run("decode_matmul", x, topk_weights, topk_ids, activation, weights_on_input)
        pairs = topk_ids.numel()
        bucket = batch_bucket(pairs)
        memo = (x.device, bucket, x.dtype, os.environ.get(FORCE_ENV))
        name, y = self._chosen.get(memo), None
        args = (x, topk_weights, topk_ids, activation, weights_on_input)
        if name is None:
            where = device_name(x.device) + f"|{self.AUTOTUNE_TAG}"
            shape = f"{self.num_experts}x{2 * self.intermediate}x{self.hidden}"
            key = f"{where}|{shape}|p{bucket}|{str(x.dtype).removeprefix('torch.')}|{code_version()}"
            name, y = self.autotuner.choose(
                key, {p: (lambda p=p: self.run(p, *args)) for p in self._pipelines(bucket, device)}, device
            )
            self._chosen[memo] = name
        return self.run(name, *args) if y is None else y

    def _kernels(self) -> dict:
        """The rows of the class's kernel table that read the experts' weight kind, by pipeline."""
        return kernels_for(self.w13.compressed_weight, self.KERNELS)

    def _pipelines(self, pairs: int, device: torch.device) -> tuple[str, ...]:
        w = self.w13.compressed_weight
        return tuple(name for name, k in self._kernels().items() if k.can_implement(w, pairs, device))

    def run(self, pipeline: str, x, topk_weights, topk_ids, activation, weights_on_input) -> torch.Tensor:
        """The experts through one pipeline (a row of the kernel table), without the autotuner."""
        return self._kernels()[pipeline].apply(self, x, topk_weights, topk_ids, activation, weights_on_input)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}, "
            f"stored_bytes={self.stored_bytes}"
        )
