"""The modules a transformers model holds once the unweight quantizer has loaded it.

Each is the model's own module, its class swapped for a subclass whose forward reads compressed
weights, so everything else about it stays (names, attributes, hooks, isinstance checks: PEFT wraps
`CompressedLinear` because it is an `nn.Linear`):

| module | becomes | forward |
| --- | --- | --- |
| `nn.Linear` (and subclasses) | `CompressedLinear` | `UnweightLinear` (self.compressed), plus the bias |
| `nn.Embedding` (and subclasses: Gemma's keeps its scale) | `CompressedEmbedding` | rows decoded per lookup |
| experts holding 3-D `gate_up_proj` and `down_proj` | `CompressedExperts` | `UnweightExperts` (self.compressed) |

Two experts layouts are known: transformers' common one, `gate_up_proj` (E, 2I, H) and `down_proj`
(E, H, I) with `forward(hidden_states, top_k_index, top_k_weights)` (Qwen3-MoE, Mixtral,
DeepSeek-V3, ...), and Llama 4's, `gate_up_proj` (E, H, 2I) and `down_proj` (E, I, H) with
`forward(hidden_states)` over E equal groups of rows, one per expert (`experts_kind` "top_k" and
"llama4"; plan.py tells them apart).

Between the swap and the fill (the quantizer's two hooks), a swapped module holds no tensor: its
weight is a meta tensor kept as a plain attribute, outside the state dict, so transformers' own
loader neither loads nor initialises it (`detach_tensor`). Once filled, `weight` is a `WeightView`
made at each read, on the device the compressed matrix is on then (it moves with `.to()`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils._pytree import tree_map

if TYPE_CHECKING:  # the layers load numba, which vLLM's CPU worker must not see at start (runtime/vllm/plugin.py)
    from ..layers.experts import UnweightExperts
    from ..layers.linear import UnweightLinear


class WeightView(torch.Tensor):
    """Stands for a compressed module's weight where model code reads `module.weight`: it has the
    weight's shape, dtype and device (Gemma's embedding reads its dtype, Llama 4's model its device,
    PEFT both) and holds no data. Any op on it decodes the weight first (`decode()`), so reading it is
    exact, and slow; an in-place op raises: the compressed weight is read-only."""

    @staticmethod
    def __new__(cls, decode, shape, dtype: torch.dtype, device: torch.device):
        view = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        view.decode = decode  # () -> the dense weight, a new tensor of this shape, dtype and device
        return view

    def __repr__(self) -> str:
        return f"WeightView(shape={list(self.shape)}, dtype={self.dtype}, device={self.device}: compressed)"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func._schema.is_mutable:
            raise RuntimeError(f"{func.__name__}: an unweight compressed weight is read-only")
        dense = lambda a: a.decode() if isinstance(a, WeightView) else a  # noqa: E731
        return func(*tree_map(dense, args), **tree_map(dense, kwargs or {}))


def _view_of(compressed: UnweightLinear, dtype: torch.dtype) -> WeightView:
    shape = (compressed.out_features, compressed.in_features)
    return WeightView(lambda: compressed.decoded_weight(dtype), shape, dtype, compressed.sm.device)


def _derived(cls: type, base: type, compressed: type) -> type:
    """`compressed` itself for `base` (nn.Linear, nn.Embedding); for a subclass of it, a subclass of
    `cls` that reaches `compressed`'s forward where `cls` calls its base's (Gemma's scaled embedding
    calls nn.Embedding.forward, then scales)."""
    if cls is base:
        return compressed
    return type(f"Compressed{cls.__name__}", (cls, compressed), {"__module__": __name__})


def detach_tensor(module: nn.Module, name: str) -> torch.Tensor:
    """Take parameter or buffer `name` out of the module's state dict, leaving the (meta) tensor as a
    plain attribute marked initialised: transformers' loader then neither loads nor initialises it."""
    t = module._parameters.pop(name, None)
    if t is None:
        t = module._buffers.pop(name)
        module._non_persistent_buffers_set.discard(name)
    t._is_hf_initialized = True
    module.__dict__[name] = t  # past any descriptor: a swapped class's `weight` property reads it from here
    return t


def attach_tensor(module: nn.Module, name: str, value: torch.Tensor, buffer: bool) -> None:
    """Put a filled tensor back where detach_tensor took it from (frozen, if a parameter)."""
    module.__dict__.pop(name, None)
    value._is_hf_initialized = True
    if buffer:
        module.register_buffer(name, value)
    else:
        module.register_parameter(name, nn.Parameter(value, requires_grad=False))


class _CompressedMatrix:
    """`weight` of a module whose matrix is `self.compressed` (an UnweightLinear)."""

    @property
    def weight(self) -> torch.Tensor:
        compressed = self._modules.get("compressed")
        if compressed is None:  # between the quantizer's hooks: the meta tensor detach_tensor left
            return self.__dict__["weight"]
        return _view_of(compressed, self.weight_dtype)

    @property
    def stored_bytes(self) -> int:
        return self.compressed.stored_bytes


class CompressedLinear(_CompressedMatrix, nn.Linear):
    """An nn.Linear whose weight is `self.compressed`, an UnweightLinear; the bias stays dense."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.compressed(x)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class CompressedEmbedding(_CompressedMatrix, nn.Embedding):
    """An nn.Embedding whose table is `self.compressed` (an UnweightLinear read by rows): a lookup
    decodes only the rows of the ids asked for, in the dtype the model's table had."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.compressed.rows(ids.reshape(-1), self.weight_dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class CompressedExperts(nn.Module):
    """A MoE layer's routed experts as `self.compressed`, an UnweightExperts (`experts_kind`: see above).

    With gradients asked for (LoRA training on the frozen base) the experts run the decode-then-
    matmul pipeline, whose torch ops give the input and the routing weights their gradients."""

    def forward(self, hidden_states: torch.Tensor, top_k_index=None, top_k_weights=None) -> torch.Tensor:
        x = hidden_states.reshape(-1, self.compressed.hidden)
        if self.experts_kind == "llama4":  # E equal groups of rows, group e for expert e
            e = self.compressed.num_experts
            top_k_index = torch.arange(e, device=x.device).repeat_interleave(x.shape[0] // e)[:, None]
            top_k_weights = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)
        y = self.compressed(x, top_k_weights, top_k_index, self.activation)
        return y.reshape(hidden_states.shape)

    @property
    def stored_bytes(self) -> int:
        return self.compressed.stored_bytes


def linear_class(cls: type) -> type:
    return _derived(cls, nn.Linear, CompressedLinear)


def embedding_class(cls: type) -> type:
    return _derived(cls, nn.Embedding, CompressedEmbedding)


def experts_class(cls: type) -> type:
    """A subclass of the experts module whose forward is CompressedExperts' (the model's own, often
    wrapped by transformers' experts dispatch, is replaced whole)."""
    return type(f"Compressed{cls.__name__}", (CompressedExperts, cls), {"__module__": __name__})


def fill_matrix(module: nn.Module, compressed: UnweightLinear, dtype: torch.dtype) -> None:
    """Give a CompressedLinear or CompressedEmbedding its matrix, read in `dtype` (the model's for it)."""
    module.__dict__.pop("weight", None)
    module.compressed = compressed
    module.weight_dtype = dtype


def fill_experts(module: nn.Module, compressed: UnweightExperts, kind: str, activation: str) -> None:
    for name in ("gate_up_proj", "down_proj"):
        module.__dict__.pop(name, None)
    module.compressed = compressed
    module.experts_kind = kind
    module.activation = activation
