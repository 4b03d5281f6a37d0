"""`Int4Experts`: a mixture-of-experts layer's routed experts in INT4 (compressed-tensors W4A16:
4-bit codes, BF16 group scales, and zero points where the codes are asymmetric), kept in the
resident `int4` layout (../kernels/int4.py).

E experts, each a gated MLP y = w2 @ act_and_mul(w13 @ x), w13 (2I, H) (the gate's I rows, then the
up projection's) and w2 (H, I). Each of the two weights is one `Int4Weight` (a `PlainInt4Weight` where
coding would not make it smaller) for all experts,
stacked by rows (w13: (E * 2I, H), w2: (E * H, I)): the layout keeps rows independent, so expert e
is a row range, read alone by the CPU kernels (cpu_int4.int4_linear_cpu's `rows`).

`forward(x, topk_weights, topk_ids)` runs each routed expert on the tokens routed to it: the
fused GEMV for a few tokens, decoded rows and torch's GEMM for more (the launcher picks). Only
the routed experts' coded bytes are read. A layer in the GPU's layout (`gpu_layout()`: the codes
as stored, the scales coded, Int4ScalesWeight) runs the W4A16 GEMV of kernels/int4_matmul.py
instead, every (token, expert) pair one program row of a grouped launch, w13 then w2: wherever its
streams are (on the CPU, through Triton's interpreter). The intermediate activation is rounded to x's dtype, as
a BF16 model's MLP rounds it. `reference_int4_experts` is the plain computation on the weights
decoded back to dense, the tests' oracle.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..kernels import int4
from ..kernels.cpu_int4 import int4_linear_cpu
from ..kernels.weight import Int4ScalesWeight, Int4Weight, PlainInt4Weight, int4_weight
from .experts_kernels import act_and_mul, check_routing


def stacked(
    packed: torch.Tensor, scales: torch.Tensor, group: int, zero: torch.Tensor | None = None
) -> Int4Weight | PlainInt4Weight:
    """One weight of (E, N, K / 8) packed codes, (E, N, K / group) BF16 scales and, for asymmetric
    codes, (E, ceil(N / 8), K / group) zero-point words packed along N; rows stacked: in the `int4`
    layout where that is smaller than the source, else as the source holds it (int4_weight)."""
    e, n, words = packed.shape
    if scales.shape[:2] != (e, n) or scales.shape[2] * group != words * 8:
        raise ValueError(
            f"INT4 experts: scales {list(scales.shape)} do not fit codes {list(packed.shape)} in groups of {group}"
        )
    if zero is not None:
        if tuple(zero.shape) != (e, -(-n // 8), scales.shape[2]):
            raise ValueError(
                f"INT4 experts: zero points {list(zero.shape)} do not fit codes {list(packed.shape)} in groups of "
                f"{group} (they are packed eight rows to a word)"
            )
        z = zero.detach().cpu().contiguous().to(torch.int32).numpy()
        zero = int4.pack_zero_points(np.concatenate([int4.zero_source(z[i], n, z.shape[2]) for i in range(e)]))
    bf16 = scales.to(torch.bfloat16)
    if not torch.equal(bf16.float(), scales.float()):
        raise ValueError("INT4 experts: their scales are not BF16 values (the int4 layout holds BF16 scales)")
    p = packed.detach().cpu().contiguous().numpy().reshape(e * n, words)
    s = bf16.detach().cpu().contiguous().view(torch.int16).numpy().reshape(e * n, -1)
    return int4_weight(p, s, words * 8, group, zero)


class Int4Experts(nn.Module):
    """A layer's routed INT4 experts, coded (see the module docstring)."""

    def __init__(self, w13: Int4Weight | PlainInt4Weight, w2: Int4Weight | PlainInt4Weight, experts: int):
        """w13 and w2 both in the CPU kinds, or both Int4ScalesWeight (the GPU's)."""
        super().__init__()
        hidden, inter = w13.cols, w2.cols
        if w13.rows != experts * 2 * inter or w2.rows != experts * hidden:
            raise ValueError(
                f"INT4 experts: w13 ({w13.rows} x {w13.cols}) and w2 ({w2.rows} x {w2.cols}) are not {experts} "
                "experts' stacked weights"
            )
        if isinstance(w13, Int4ScalesWeight) != isinstance(w2, Int4ScalesWeight):
            raise ValueError("INT4 experts: w13 and w2 must both be in the GPU's layout (Int4ScalesWeight) or neither")
        self.experts, self.hidden, self.intermediate = experts, hidden, inter
        self.w13, self.w2 = w13, w2
        for name, w in (("w13", w13), ("w2", w2)):  # buffers: counted as the layer's memory, moved with it
            for role, t in w.streams().items():
                self.register_buffer(f"{name}_{role}", t, persistent=False)

    def _apply(self, fn, *args, **kwargs):
        """nn.Module's, then the weights over the moved buffers (`.to("cuda")` moves the streams)."""
        super()._apply(fn, *args, **kwargs)
        for name in ("w13", "w2"):
            w = getattr(self, name)
            setattr(self, name, w.with_streams({role: getattr(self, f"{name}_{role}") for role in w.ROLES}))
        return self

    @property
    def on_gpu_layout(self) -> bool:
        """Whether the weights are in the GPU's layout (forward runs the Triton GEMV)."""
        return isinstance(self.w13, Int4ScalesWeight)

    def gpu_layout(self) -> Int4Experts:
        """The same experts with their codes as stored and their scales coded (Int4ScalesWeight:
        what the W4A16 GEMV reads on a GPU), on the CPU: move it with `.to(device)`. ValueError for
        asymmetric codes, which the GEMV does not take."""
        ws = [Int4ScalesWeight.from_int4(w.to("cpu")) for w in (self.w13, self.w2)]
        if not ws[0].symmetric:
            raise ValueError("INT4 experts with zero points (asymmetric codes) have no GPU layout: the GEMV takes none")
        return Int4Experts(ws[0], ws[1], self.experts)

    @classmethod
    def from_packed(
        cls, w13_packed, w13_scale, w2_packed, w2_scale, group: int, w13_zero=None, w2_zero=None
    ) -> Int4Experts:
        """From compressed-tensors' per-expert tensors stacked as vLLM holds them: w13 (E, 2I, H / 8)
        int32 codes and (E, 2I, H / group) scales, w2 (E, H, I / 8) and (E, H, I / group); for
        asymmetric codes their zero points, w13 (E, 2I / 8, H / group) and w2 (E, H / 8, I / group)."""
        return cls(
            stacked(w13_packed, w13_scale, group, w13_zero),
            stacked(w2_packed, w2_scale, group, w2_zero),
            w13_packed.shape[0],
        )

    @property
    def stored_bytes(self) -> int:
        return self.w13.stored_bytes + self.w2.stored_bytes

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: str = "silu",
        weights_on_input: bool = False,
    ) -> torch.Tensor:
        """(T, H) -> (T, H), x's dtype: sum over j of topk_weights[:, j] * expert topk_ids[:, j](x)
        (with `weights_on_input`, vLLM's apply_router_weight_on_input: the weight scales the
        expert's input instead), summed in fp32."""
        check_routing(x, topk_weights, topk_ids, activation, self.hidden)
        ids = topk_ids.to(torch.int64)
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < self.experts):
            raise ValueError(f"expert ids {int(ids.min())}..{int(ids.max())} are not within the {self.experts} experts")
        if self.on_gpu_layout:
            return self._grouped(x, topk_weights, ids, activation, weights_on_input)
        out = torch.zeros(x.shape[0], self.hidden, dtype=torch.float32)
        two_i, h = 2 * self.intermediate, self.hidden
        for e in torch.unique(ids).tolist():
            tokens, slots = (ids == e).nonzero(as_tuple=True)
            weight = topk_weights[tokens, slots].float()[:, None]
            xe = x[tokens]
            if weights_on_input:
                xe = (xe.float() * weight).to(x.dtype)
            gate_up = int4_linear_cpu(xe, self.w13, rows=(e * two_i, (e + 1) * two_i)).to(x.dtype)
            y = int4_linear_cpu(act_and_mul(gate_up, activation), self.w2, rows=(e * h, (e + 1) * h))
            out.index_add_(0, tokens, y if weights_on_input else y * weight)
        return out.to(x.dtype)

    def _grouped(self, x, topk_weights, ids, activation: str, weights_on_input: bool) -> torch.Tensor:
        """forward in the GPU's layout: the grouped GEMV over every (token, slot) pair, w13 (each
        token's row of x read by its k pairs) then w2, the slots' outputs weighted and summed in fp32.
        The ids were checked (the kernel trusts them)."""
        from ..kernels.int4_matmul import int4_experts_linear  # triton: imported where it runs

        t, k = ids.shape
        pairs = ids.reshape(-1).to(torch.int32)
        weight = topk_weights.float().reshape(-1, 1)
        if weights_on_input:
            xin, x_div = (x.repeat_interleave(k, dim=0).float() * weight).to(x.dtype), 1
        else:
            xin, x_div = x, k
        gate_up = int4_experts_linear(xin.contiguous(), self.w13, pairs, 2 * self.intermediate, x_div)
        y = int4_experts_linear(
            act_and_mul(gate_up, activation).contiguous(), self.w2, pairs, self.hidden, 1, torch.float32
        )
        if not weights_on_input:
            y = y * weight
        return y.reshape(t, k, self.hidden).sum(dim=1).to(x.dtype)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 (E, 2I, H), w2 (E, H, I)) fp32, decoded back (int4.decode_reference) and dequantized."""
        out = []
        for w, n in ((self.w13, 2 * self.intermediate), (self.w2, self.hidden)):
            out.append(torch.from_numpy(dequantized(w)).reshape(self.experts, n, w.cols))
        return out[0], out[1]


def dequantized(w: Int4Weight | PlainInt4Weight) -> np.ndarray:
    """W (rows, cols) fp32, (nibble - zero) * scale from the bits decoded back (int4.decode_reference):
    exact, and the plain reference of the kernels' rows."""
    packed, scales = w.decode()
    zero = w.zero_points()
    z = 8.0 if zero is None else int4.unpack_zero_points(zero, w.rows).astype(np.float32)
    s = (scales.astype(np.uint32) << 16).view(np.float32)
    codes = int4.unpack_nibbles(packed, w.cols).astype(np.float32).reshape(w.rows, -1, w.group)
    return ((codes - np.asarray(z, np.float32)[..., None]) * s[..., None]).reshape(w.rows, w.cols)


def reference_int4_experts(experts: Int4Experts, x, topk_weights, topk_ids, activation="silu", weights_on_input=False):
    """The oracle: each token and slot in fp32 on the dense weights, the intermediate rounded to x's dtype."""
    w13, w2 = experts.dense()
    out = torch.zeros(x.shape[0], experts.hidden, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e, w = int(topk_ids[t, j]), float(topk_weights[t, j])
            xt = (x[t].float() * w).to(x.dtype) if weights_on_input else x[t]
            h = (w13[e].double() @ xt.double()).to(x.dtype)
            y = w2[e].double() @ act_and_mul(h[None], activation)[0].double()
            out[t] += y if weights_on_input else w * y
    return out
