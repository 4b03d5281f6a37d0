"""The plugin's methods for layers that a compressed-tensors source quantized W4A16 (Kimi K2.5's
routed experts: symmetric INT4 codes, BF16 group scales; or asymmetric codes with zero points), on
the CPU: their weights stay coded in the resident `int4` layout and run on unweight's own INT4 kernels.

- MoE experts: vLLM-CPU's own compressed-tensors MoE method needs a WNA16 MoE kernel that not
  every CPU has (none without AMX on an AVX2 AMD EPYC: "No WNA16 MoE backend supports the
  deployment configuration"). `UnweightInt4MoEMethod` registers the parameters that method
  registers (`w13_weight_packed`, `w13_weight_scale`, `w13_weight_shape` and w2's, and
  `w13_weight_zero_point` and w2's for asymmetric codes), so vLLM's own
  expert loader fills them and narrows them per tensor-parallel rank as it does for that method;
  once the layer is loaded it codes them into an `Int4Experts` (runtime/layers/int4_experts.py:
  w13 and w2 each one stacked `Int4Weight`) and frees them. `apply` runs the custom op
  `unweight::int4_experts` on the router's choice.
- Linear layers: `UnweightInt4LinearMethod` wraps vLLM's compressed-tensors linear method, whose
  WNA16 scheme registers and loads the layer's `weight_packed`, `weight_scale` and, for asymmetric
  codes, `weight_zero_point` (a merged or
  row-parallel layer's shards and rank parts as vLLM places them); once loaded they are coded into
  an `Int4Linear` (runtime/layers/int4_linear.py) and freed, and `apply` runs the custom op
  `unweight::int4_linear` instead of vLLM's W4A16 GEMM.

An experts layer is coded as soon as its last expert tensor is loaded (its loader keeps the rank's
parts of the others until then), so the load holds one layer's uncoded experts at a time; a
linear layer holds its weight uncoded (vLLM's scheme allocates it when the model is built) until
the plugin's loader has read the checkpoint and codes it (`code`). On CUDA (vLLM has Marlin's
kernels, and the int4 layout no GPU kernel yet), and for experts under expert parallelism, with
biases or another activation, vLLM's own compressed-tensors method keeps the layer.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.utils import set_weight_attrs

from . import experts
from .experts import _activation
from .registry import Registry

# the experts' parameters as vLLM's compressed-tensors WNA16 MoE method names them (its loader maps
# each expert's weight_packed, weight_scale and weight_shape to them)
PARAMETERS = ("w13_weight_packed", "w2_weight_packed", "w13_weight_scale", "w2_weight_scale")
SHAPES = ("w13_weight_shape", "w2_weight_shape")
ZERO_POINTS = ("w13_weight_zero_point", "w2_weight_zero_point")  # asymmetric codes only
KINDS = {"packed": "packed", "scale": "scale", "shape": "shape", "point": "zero"}  # by a parameter's last word


def _value(v) -> str:
    return str(getattr(v, "value", v)).lower()


def w4a16_scheme(source, layer: nn.Module, prefix: str) -> tuple[int, bool] | None:
    """(group size, symmetric) where the compressed-tensors config `source` quantizes this experts
    layer as the int4 layout holds it (pack-quantized, 4-bit integers, symmetric or with zero points,
    in groups of a power of two of 32 or more, activations unquantized, no activation order), else None."""
    source._add_fused_moe_to_target_scheme_map()  # as vLLM's get_moe_method asks: experts are fused linears
    names = [f"{prefix}.0.{p}" for p in (layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name)]
    schemes = [source.get_scheme_dict(layer, name) for name in names]
    scheme = schemes[0]
    if scheme is None or any(s != scheme for s in schemes) or scheme.get("input_activations") is not None:
        return None
    w = scheme.get("weights")
    if w is None or scheme.get("format") != "pack-quantized":
        return None
    group = _plain_group(w.num_bits, w.type, w.strategy, w.group_size, getattr(w, "actorder", None))
    return None if group is None else (group, bool(w.symmetric))


def _plain_group(num_bits, kind, strategy, group, actorder=None) -> int | None:
    """The group size of weights the int4 layout holds (4-bit integers in groups of a power of two of
    32 or more, no activation order), else None."""
    plain = num_bits == 4 and _value(kind) == "int" and _value(strategy) == "group" and not actorder
    group = group or 0
    return group if plain and group >= 32 and group & (group - 1) == 0 else None


def linear_group(method, layer: nn.Module) -> int | None:
    """The group size where the source's method for this linear layer is compressed-tensors WNA16
    with weights the int4 layout holds, on the CPU; else None."""
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16 import (
        CompressedTensorsWNA16,
    )
    from vllm.platforms import current_platform

    scheme = getattr(layer, "scheme", None)
    if not current_platform.is_cpu() or type(scheme) is not CompressedTensorsWNA16:
        return None
    return _plain_group(scheme.num_bits, "int", scheme.strategy, scheme.group_size)


def unsupported(moe) -> str | None:
    """Why a layer of this FusedMoEConfig keeps vLLM's own compressed-tensors method, or None."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "the int4 layout's kernels run on the CPU only"
    return experts.unsupported(moe)  # what the BF16 experts method cannot hold, neither can this one


class UnweightInt4MoEMethod(FusedMoEMethodBase):
    """vLLM's FusedMoEMethodBase over INT4 experts kept coded (see the module docstring)."""

    def __init__(self, moe, group: int, symmetric: bool = True, prefix: str = ""):
        super().__init__(moe)
        self.group, self.symmetric, self.prefix = group, symmetric, prefix

    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        e, h, i, g = num_experts, hidden_size, intermediate_size_per_partition, self.group
        if h % g or i % g:
            raise ValueError(
                f"layer {self.prefix!r}: INT4 groups of {g} do not divide the hidden size {h} and the rank's "
                f"intermediate size {i} (use a tensor-parallel size that keeps whole groups)"
            )
        if not self.symmetric and i % 8:
            raise ValueError(
                f"layer {self.prefix!r}: the rank's intermediate size {i} does not hold whole words of INT4 zero "
                "points (eight rows a word; use a tensor-parallel size that keeps them)"
            )
        extra_weight_attrs.pop("weight_loader", None)
        loader = _Int4Loader(layer, self)
        names = PARAMETERS + SHAPES + (() if self.symmetric else ZERO_POINTS)
        for name in names:  # vLLM's compressed-tensors WNA16 names; no memory: the loader fills pending
            param = nn.Parameter(torch.empty(0, dtype=torch.int32), requires_grad=False)
            layer.register_parameter(name, param)
            kind = KINDS[name.split("_")[-1]]
            set_weight_attrs(param, {**extra_weight_attrs, "weight_loader": loader, "uw_kind": kind})
        layer.uw_pending = _Int4Pending(e, h, i, g, self.symmetric)
        layer.uw_index = -1

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.code(layer)

    def code(self, layer: nn.Module) -> None:
        """The layer's experts coded into an Int4Experts and their uncoded tensors dropped, once: as
        soon as the last of them is loaded (so the load holds one layer's uncoded experts at a
        time), else when the loader has read the checkpoint (ValueError naming a missing one)."""
        from unweight.runtime.layers.int4_experts import Int4Experts

        pending = layer.uw_pending
        if pending is None:
            return
        missing = pending.missing()
        if missing:
            e, shard, kind = missing[0]
            raise ValueError(
                f"layer {self.prefix!r}: the checkpoint gave no INT4 {kind} for {len(missing)} expert shard(s), "
                f"the first expert {e}'s {shard}"
            )
        coded = Int4Experts.from_packed(
            pending.w13_packed,
            pending.w13_scale,
            pending.w2_packed,
            pending.w2_scale,
            self.group,
            pending.w13_zero,
            pending.w2_zero,
        )
        layer.uw_pending = None
        coded.uw_activation = _activation(layer.activation)
        coded.uw_on_input = bool(layer.apply_router_weight_on_input)
        layer.uw_int4 = coded  # a submodule: vLLM counts its buffers as the layer's weight
        layer.uw_index = _INT4.add(coded)

    def get_fused_moe_quant_config(self, layer: nn.Module):
        return FUSED_MOE_UNQUANTIZED_CONFIG  # the activations stay unquantized; the experts are the op's own

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input) -> torch.Tensor:
        return torch.ops.unweight.int4_experts(x, topk_weights, topk_ids, layer.uw_index)


class _Int4Pending:
    """A layer's rank-local experts while their tensors come in, as the source stores them: w13's
    and w2's packed codes, scales and (asymmetric codes) zero points, allocated when the first of
    each arrives. Zero points are packed eight rows to a word: w1's and w3's words stack as their
    rows do, w2's columns are its groups."""

    def __init__(self, experts: int, hidden: int, intermediate: int, group: int, symmetric: bool = True):
        self.experts, self.hidden, self.intermediate, self.group = experts, hidden, intermediate, group
        self.kinds = ("packed", "scale") if symmetric else ("packed", "scale", "zero")
        self.w13_packed = self.w2_packed = self.w13_scale = self.w2_scale = self.w13_zero = self.w2_zero = None
        self.seen: set[tuple[int, str, str]] = set()

    @property
    def numel(self) -> int:  # the int32 words of all the layer's codes (the loader's bound on a tensor)
        return 3 * self.experts * self.hidden * self.intermediate // 8

    def shape(self, shard: str, kind: str, ranks: int, local: bool = False) -> tuple[int, int]:
        """A whole expert tensor's shape (before the rank's part is taken), or with `local` the rank's part."""
        h, i = self.hidden, self.intermediate * (1 if local else ranks)
        per = 8 if kind == "packed" else self.group
        if kind == "zero":  # packed along the rows, eight a word
            return (i // 8, h // self.group) if shard != "w2" else (-(-h // 8), i // self.group)
        return (i, h // per) if shard != "w2" else (h, i // per)

    def put(self, expert: int, shard: str, kind: str, part: torch.Tensor) -> None:
        w2 = shard == "w2"
        name = f"{'w2' if w2 else 'w13'}_{kind}"
        if getattr(self, name) is None:
            rows, cols = self.shape(shard, kind, 1, local=True)
            shape = (self.experts, rows, cols) if w2 else (self.experts, 2 * rows, cols)
            setattr(self, name, torch.empty(shape, dtype=part.dtype if kind == "scale" else torch.int32))
        whole = getattr(self, name)
        if part.dtype != whole.dtype:
            raise ValueError(f"INT4 experts: an expert's {kind} is {part.dtype}, the layer's others {whole.dtype}")
        n = whole.shape[1] // 2
        rows = whole[expert] if w2 else whole[expert, (0 if shard == "w1" else n) :][:n]
        rows.copy_(part)
        self.seen.add((expert, shard, kind))

    def missing(self) -> list[tuple[int, str, str]]:
        every = {(e, s, k) for e in range(self.experts) for s in ("w1", "w3", "w2") for k in self.kinds}
        return sorted(every - self.seen)


class _Int4Loader:
    """The weight_loader of an INT4 experts layer's parameters: (param, tensor, weight_name,
    shard_id, expert_id). Takes the rank's part of each expert's packed codes and scales (rows of
    w1 and w3, columns of w2, as vLLM's compressed-tensors method narrows them: decoded only there
    for a LazyWeight) into the layer's pending experts, checks each weight_shape, and codes the
    layer when its last expert tensor is in."""

    def __init__(self, layer: nn.Module, method: UnweightInt4MoEMethod):
        self.layer, self.method = layer, method

    def __call__(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        from .experts import SHARDS, _block

        if shard_id not in SHARDS:
            raise ValueError(f"tensor {weight_name!r}: expert shard id {shard_id!r} is not w1, w2 or w3")
        local = self.layer._map_global_expert_id_to_local_expert_id(expert_id)
        if local < 0:
            return False if return_success else None
        pending, kind = self.layer.uw_pending, param.uw_kind
        if pending is None:
            raise ValueError(f"tensor {weight_name!r}: layer {self.method.prefix!r} already has all its experts")
        par = self.layer.moe_config.moe_parallel_config
        rank, ranks = par.tp_rank, par.tp_size
        if kind == "shape":  # the expert weight's (rows, columns) before packing
            got = [int(v) for v in _block(loaded_weight.reshape(1, -1), None, [(0, 1)], (0, 2)).reshape(-1)]
            want = list(pending.shape(shard_id, "scale", ranks))
            want[-1] *= pending.group
            if got != want:
                raise ValueError(f"layer {self.method.prefix!r}: {weight_name} says {got}, the layer needs {want}")
            return True if return_success else None
        full = pending.shape(shard_id, kind, ranks)
        if tuple(loaded_weight.shape) != full:
            raise ValueError(
                f"layer {self.method.prefix!r}: expert {local}'s {shard_id} {kind} ({weight_name}) has shape "
                f"{list(loaded_weight.shape)}, the layer needs {list(full)}"
            )
        part = full[0] // ranks if shard_id != "w2" else full[1] // ranks
        if shard_id == "w2":
            rows, cols = [(0, full[0])], (rank * part, (rank + 1) * part)
        else:
            rows, cols = [(rank * part, (rank + 1) * part)], (0, full[1])
        pending.put(local, shard_id, kind, _block(loaded_weight, None, rows, cols))
        if not pending.missing():
            self.method.code(self.layer)
        return True if return_success else None


class UnweightInt4LinearMethod(LinearMethodBase):
    """vLLM's compressed-tensors linear method over a W4A16 weight kept coded (module docstring)."""

    def __init__(self, source, group: int, prefix: str = ""):
        self.source, self.group, self.prefix = source, group, prefix

    def create_weights(self, layer: nn.Module, *args, **kwargs) -> None:
        self.source.create_weights(layer, *args, **kwargs)  # weight_packed, weight_scale, weight_shape
        layer.uw_index = -1

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.code(layer)

    def code(self, layer: nn.Module) -> None:
        """The loaded weight coded into an Int4Linear, the uncoded tensors freed (once)."""
        from unweight.runtime.layers.int4_linear import Int4Linear

        if layer.uw_index >= 0:
            return
        zero = getattr(layer, "weight_zero_point", None)  # vLLM's scheme registers it for asymmetric codes
        zero = None if zero is None else zero.data
        linear = Int4Linear.from_packed(layer.weight_packed.data, layer.weight_scale.data, self.group, zero)
        for name in ("weight_packed", "weight_scale", "weight_shape") + (
            () if zero is None else ("weight_zero_point",)
        ):
            setattr(layer, name, nn.Parameter(torch.empty(0, dtype=getattr(layer, name).dtype), requires_grad=False))
        layer.uw_int4 = linear
        layer.uw_index = _INT4.add(linear)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.ops.unweight.int4_linear(x, layer.uw_index)
        return y if bias is None else y + bias


_INT4 = Registry()  # the live coded INT4 layers (experts and linears) of this process, by uw_index


@torch.library.custom_op("unweight::int4_experts", mutates_args=())
def _int4_experts_op(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: int) -> torch.Tensor:
    """The routed experts' output (T, H) for the process's INT4 experts layer number `layer`."""
    e = _INT4[layer]
    return e(x, topk_weights, topk_ids, e.uw_activation, e.uw_on_input)


@_int4_experts_op.register_fake
def _(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], _INT4[layer].hidden))


@torch.library.custom_op("unweight::int4_linear", mutates_args=())
def _int4_linear_op(x: torch.Tensor, layer: int) -> torch.Tensor:
    """x @ W.T (..., out_features) for the process's INT4 linear layer number `layer`."""
    return _INT4[layer](x)


@_int4_linear_op.register_fake
def _(x: torch.Tensor, layer: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], _INT4[layer].out_features))
