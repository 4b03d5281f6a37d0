"""The plugin's MoE method: a vLLM RoutedExperts layer whose experts stay compressed.

`UnweightMoEMethod` registers no dense expert weights. Its weight loader takes each expert's
gate (w1), up (w3) and down (w2) tensor, keeps the rank's part (w1 and w3 split on the
intermediate dimension, w2 on its input, as vLLM's own loader splits them) and encodes each expert
into the layer's stacked tiles as soon as it is whole; once every local expert of the layer is in,
they become an `UnweightExperts` (runtime/layers/experts.py: w13 and w2 stacked; tiles, transcoded
to qtiles on CUDA). The largest decoded memory at any time is one expert's rank-local part.

`apply` gets the router's choice (vLLM routes first) and runs the custom op `unweight::experts`,
whose pipeline the autotuner picks per batch bucket:
- `fused`: UnweightExperts' own (one grouped numba GEMV call per weight on the CPU, one grouped
  Triton GEMV launch per weight on CUDA): only the routed experts' compressed bytes are read;
- `decode_matmul` (the plugin's own row in the experts' kernel table, runtime/layers/experts_kernels.py):
  the routed experts decoded and handed to **vLLM's own fused-MoE kernel** (the
  one its unquantized method would run, prepacked as that method prepacks, their ids renumbered),
  so that forced (`UNWEIGHT_PIPELINE=decode_matmul`) it gives vLLM's unquantized output bit for bit.

A layer this cannot hold falls back to vLLM's unquantized method, decoded at load and logged
once: experts with biases, without a gated activation, under expert parallelism, or not BF16.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.utils import set_weight_attrs

from .registry import Registry, warn_once

# the gated activations UnweightExperts computes: its ACTIVATIONS, not imported, since importing
# unweight.runtime.layers.experts loads numba, which must wait until a model loads (plugin.py)
ACTIVATIONS = ("silu", "gelu")

SHARDS = ("w1", "w3", "w2")


def unsupported(moe) -> str | None:
    """Why a layer of this FusedMoEConfig cannot keep compressed experts, or None."""
    if moe.has_bias:
        return "its experts have biases"
    if not moe.is_act_and_mul:
        return "its experts have no gated activation"
    if moe.moe_parallel_config.use_ep:
        return "expert parallelism is on"
    if _activation(moe.activation) not in ACTIVATIONS:
        return f"its activation is {moe.activation}"
    return None


class _Pending:
    """A layer's local experts while their tensors come in. BF16 experts are encoded expert by
    expert as soon as each is whole (w13's gate and up rows, w2's rows: `tiles.RowsEncoder`), so
    the most held decoded is an expert whose gate or up half is still missing; other dtypes are
    gathered dense (vLLM's own MoE then runs them)."""

    def __init__(self, experts: int, hidden: int, intermediate: int):
        self.experts, self.hidden, self.intermediate = experts, hidden, intermediate
        self.dtype: torch.dtype | None = None
        self.w13 = self.w2 = None  # RowsEncoders of (E*2I, H) and (E*H, I); or dense (E, 2I, H) and (E, H, I)
        self.halves: dict[int, torch.Tensor] = {}  # expert -> its (2I, H) w13 while one half is in
        self.seen: set[tuple[int, str]] = set()

    @property
    def numel(self) -> int:  # w13 and w2 together
        return 3 * self.experts * self.hidden * self.intermediate

    def start(self, dtype: torch.dtype) -> None:
        from unweight.codec.tiles import RowsEncoder

        e, h, i = self.experts, self.hidden, self.intermediate
        self.dtype = dtype
        if dtype == torch.bfloat16:
            self.w13, self.w2 = RowsEncoder(e * 2 * i, h), RowsEncoder(e * h, i)
        else:
            self.w13, self.w2 = torch.empty(e, 2 * i, h, dtype=dtype), torch.empty(e, h, i, dtype=dtype)

    def put(self, expert: int, shards: tuple[str, ...], part: torch.Tensor) -> None:
        """Expert `expert`'s rank-local w2 (H, I), or rows of its w13 (gate's I, up's I, or both)."""
        h, i = self.hidden, self.intermediate
        if isinstance(self.w2, torch.Tensor):  # dense
            if shards == ("w2",):
                self.w2[expert] = part
            else:
                start = 0 if shards[0] == "w1" else i
                self.w13[expert, start : start + len(part)] = part
        elif shards == ("w2",):
            self.w2.put(expert * h, _u16(part))
        elif len(shards) == 2:
            self.w13.put(expert * 2 * i, _u16(part))
        else:
            half = self.halves.setdefault(expert, torch.empty(2 * i, h, dtype=self.dtype))
            half[0 if shards[0] == "w1" else i :][:i] = part
            if {(expert, "w1"), (expert, "w3")} - self.seen <= {(expert, shards[0])}:
                self.w13.put(expert * 2 * i, _u16(self.halves.pop(expert)))
        self.seen.update((expert, s) for s in shards)


def _u16(t: torch.Tensor) -> np.ndarray:
    """A BF16 tensor's bit patterns, flattened (C order)."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)


class UnweightMoEMethod(FusedMoEMethodBase):
    """vLLM's FusedMoEMethodBase over compressed experts (see the module docstring)."""

    def __init__(self, moe, prefix: str = ""):
        super().__init__(moe)
        self.prefix = prefix
        self.vllm = UnquantizedFusedMoEMethod(moe)  # its kernel: the exact pipeline, and the dense fallback

    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        extra_weight_attrs.pop("weight_loader", None)
        loader = _ExpertLoader(layer, self.prefix)
        for name in ("w13_weight", "w2_weight"):  # no memory: the loader builds the compressed experts instead
            param = nn.Parameter(torch.empty(0, dtype=params_dtype), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, {**extra_weight_attrs, "weight_loader": loader})
        intermediate = self.moe.intermediate_size_per_partition_unpadded or intermediate_size_per_partition
        layer.uw_pending = _Pending(num_experts, self.moe.hidden_dim_unpadded or hidden_size, intermediate)
        layer.uw_index = -1
        layer.uw_dense = False

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pending = layer.uw_pending
        if pending is not None:
            missing = sorted({(e, s) for e in range(pending.experts) for s in SHARDS} - pending.seen)
            e, s = missing[0]
            raise ValueError(
                f"layer {self.prefix!r}: the checkpoint gave no weight for {len(missing)} expert shard(s), "
                f"the first expert {e}'s {s}"
            )
        if layer.uw_dense:
            self.vllm.process_weights_after_loading(layer)  # prepacks the dense experts as vLLM does
        else:
            self.vllm._init_moe_kernel(layer)  # the exact pipeline's kernel, run on the routed experts

    def get_fused_moe_quant_config(self, layer: nn.Module):
        return self.vllm.get_fused_moe_quant_config(layer)

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input) -> torch.Tensor:
        if layer.uw_dense:
            return self.vllm.apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        return torch.ops.unweight.experts(x, topk_weights, topk_ids, layer.uw_index)


class _ExpertLoader:
    """The weight_loader of both expert parameters: (param, tensor, weight_name, shard_id, expert_id).

    A 3-D tensor holds every expert (Llama 4's fused `experts.gate_up_proj` and `down_proj`, which
    vLLM transposes and chunks into gate and up): each expert's block is taken in turn, decoded
    from only the stored rows of that expert that hold the rank's part. The gate half of a fused
    gate_up tensor brings its up half along, both from one decode of the expert's rows."""

    def __init__(self, layer: nn.Module, prefix: str):
        self.layer, self.prefix = layer, prefix
        self.taken_with_gate: set[tuple[str, tuple[int, int] | None]] = set()  # up halves already in

    def __call__(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        from .lazy import LazyWeight

        if shard_id not in SHARDS:
            raise ValueError(f"tensor {weight_name!r}: expert shard id {shard_id!r} is not w1, w2 or w3")
        if loaded_weight.dim() != 3:
            done = self._one(loaded_weight, None, weight_name, shard_id, expert_id, param.device, False)
            return done if return_success else None
        lazy = isinstance(loaded_weight, LazyWeight)
        if lazy and (loaded_weight.uw_name, loaded_weight.uw_cols) in self.taken_with_gate:
            return True if return_success else None
        pair = lazy and shard_id == "w1" and _gate_half(loaded_weight)
        done = [
            self._one(loaded_weight, e, weight_name, shard_id, expert_id + e, param.device, pair)
            for e in range(len(loaded_weight))
        ]
        if pair:
            width = loaded_weight.uw_cols[1]
            self.taken_with_gate.add((loaded_weight.uw_name, (width, 2 * width)))
        return any(done) if return_success else None

    def _one(self, loaded, index, name: str, shard_id: str, expert_id: int, device, pair: bool) -> bool:
        """Takes expert `expert_id`'s tensor (matrix `index` of a 3-D `loaded`, or `loaded` itself):
        False if another rank holds that expert."""
        local = self.layer._map_global_expert_id_to_local_expert_id(expert_id)
        if local < 0:
            return False
        if self.layer.uw_pending is None:
            raise ValueError(f"tensor {name!r}: layer {self.prefix!r} already has all its experts")
        self._take(self.layer.uw_pending, loaded, index, name, shard_id, local, device, pair)
        return True

    def _take(self, pending: _Pending, loaded, index, name: str, shard_id: str, expert: int, device, pair) -> None:
        if pending.dtype is None:
            pending.start(loaded.dtype)
        elif loaded.dtype != pending.dtype:
            raise ValueError(f"tensor {name!r} is {loaded.dtype}, the layer's other experts {pending.dtype}")
        h, i = pending.hidden, pending.intermediate
        par = self.layer.moe_config.moe_parallel_config
        rank, ranks = par.tp_rank, par.tp_size
        want = (i * ranks, h) if shard_id != "w2" else (h, i * ranks)
        shape = tuple(loaded.shape[1:] if index is not None else loaded.shape)
        if shape != want:
            raise ValueError(
                f"layer {self.prefix!r}: expert {expert}'s {shard_id} tensor ({name}) has shape {list(shape)}, "
                f"the layer needs {list(want)}"
            )
        if shard_id == "w2":
            rows, cols = [(0, h)], (rank * i, (rank + 1) * i)
        else:
            rows, cols = [(rank * i, (rank + 1) * i)], (0, h)
        if pair:  # and the up half's rows, from the whole gate_up tensor: w13's gate rows, then its up rows
            rows, loaded = [*rows, (i * ranks + rank * i, i * ranks + (rank + 1) * i)], loaded.unchunked()
        # w13 is the gate's I rows, then the up projection's
        pending.put(expert, ("w1", "w3") if pair else (shard_id,), _block(loaded, index, rows, cols))
        if len(pending.seen) == 3 * pending.experts:
            _finish(self.layer, pending, device)


def _gate_half(lazy) -> bool:
    """Whether a 3-D LazyWeight is the first half of its stored tensor's last dim, seen transposed:
    the gate of a fused gate_up experts tensor, as vLLM's Llama 4 loader chunks it."""
    cols = lazy.uw_cols
    full = lazy.uw_checkpoint.entry(lazy.uw_name).shape[-1]
    return lazy.uw_t and cols is not None and cols[0] == 0 and 2 * cols[1] == full


def _block(loaded, index, rows: list[tuple[int, int]], cols: tuple[int, int]) -> torch.Tensor:
    """Row ranges `rows` (stacked) and columns `cols` of `loaded` (2-D), or of its matrix `index`
    (3-D); decoded only there for a LazyWeight."""
    from .lazy import LazyWeight

    if isinstance(loaded, LazyWeight):
        if index is not None:
            return loaded.expert(index, rows, *cols)
        return torch.cat([loaded.block(a, b, *cols) for a, b in rows])
    matrix = loaded if index is None else loaded[index]
    return torch.cat([matrix[a:b, cols[0] : cols[1]] for a, b in rows])


def _finish(layer: nn.Module, pending: _Pending, device: torch.device) -> None:
    layer.uw_pending = None
    method = layer.quant_method
    if pending.dtype != torch.bfloat16:  # vLLM's own unquantized experts on dense weights
        warn_once(f"experts of {method.prefix!r} are {pending.dtype}, not BF16: they stay dense (vLLM's own MoE)")
        layer.uw_dense = True
        dtype = layer.w13_weight.dtype
        layer.w13_weight = nn.Parameter(pending.w13.to(device=device, dtype=dtype), requires_grad=False)
        layer.w2_weight = nn.Parameter(pending.w2.to(device=device, dtype=dtype), requires_grad=False)
        return
    experts = _experts_class().from_tiles(
        pending.w13.finish(), pending.w2.finish(), pending.experts, pending.hidden, pending.intermediate
    )
    pending.w13 = pending.w2 = None
    experts.uw_method, experts.uw_activation = method, layer.activation
    experts.uw_on_input = bool(layer.apply_router_weight_on_input)
    if torch.device(device).type != "cpu":
        experts = experts.to(device)  # (transcoded into the layout the GPU reads)
    layer.uw_experts = experts  # a submodule: vLLM moves it, and counts its buffers as the layer's weight
    layer.uw_index = _EXPERTS.add(experts)


_EXPERTS = Registry()  # the live built experts layers of this process, by uw_index


@functools.cache
def _experts_class() -> type:
    """UnweightExperts whose `decode_matmul` row runs vLLM's own fused-MoE kernel on the routed experts."""
    from unweight.runtime.layers import experts_kernels as ek
    from unweight.runtime.layers.experts import UnweightExperts

    class VllmDecodeMatmul(ek.DecodeMatmul):
        """The routed experts decoded, then vLLM's unquantized fused-MoE kernel on them."""

        @staticmethod
        def apply(layer, x, topk_weights, topk_ids, activation, weights_on_input):
            return _vllm_moe(layer, x, topk_weights, topk_ids)

    class VllmUnweightExperts(UnweightExperts):
        AUTOTUNE_TAG = "vllm-experts"
        KERNELS = tuple(VllmDecodeMatmul if k is ek.DecodeMatmul else k for k in ek.KERNELS)
        uw_method: UnweightMoEMethod  # set by _finish: the layer's method, its activation and router-weight mode
        uw_activation = None
        uw_on_input = False

    return VllmUnweightExperts


def _vllm_moe(experts, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """vLLM's unquantized fused-MoE kernel on the routed experts only: decoded into a scratch layer,
    readied as vLLM's unquantized method readies a layer's experts (padding, prepacking), the ids
    renumbered to that scratch layer's."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import convert_to_unquantized_kernel_format

    method = experts.uw_method.vllm
    used, local_ids = torch.unique(topk_ids, return_inverse=True)
    scratch = _Scratch(*experts.expert_weights(used.cpu(), x.dtype), method.moe, experts.uw_activation)
    w13, w2 = convert_to_unquantized_kernel_format(
        method.unquantized_backend, method.moe, scratch.w13_weight, scratch.w2_weight, scratch
    )
    scratch.w13_weight, scratch.w2_weight = (nn.Parameter(w, requires_grad=False) for w in (w13, w2))
    method.moe_kernel.fused_experts.process_weights_after_loading(scratch)  # pads and prepacks, on the CPU
    return method.moe_kernel.apply(
        hidden_states=x,
        w1=scratch.w13_weight,
        w2=scratch.w2_weight,
        topk_weights=topk_weights,
        topk_ids=local_ids.to(topk_ids.dtype),
        activation=experts.uw_activation,
        apply_router_weight_on_input=experts.uw_on_input,
        global_num_experts=len(used),
        expert_map=None,
        shared_experts=None,
        shared_experts_input=None,
    )


class _Scratch(nn.Module):
    """What vLLM's unquantized MoE method readies and runs its kernel on: the routed experts' weights."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, moe_config, activation):
        super().__init__()
        self.w13_weight = nn.Parameter(w13, requires_grad=False)
        self.w2_weight = nn.Parameter(w2, requires_grad=False)
        self.moe_config, self.activation = moe_config, activation


@torch.library.custom_op("unweight::experts", mutates_args=())
def _experts_op(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: int) -> torch.Tensor:
    """The routed experts' output (T, H) for the process's experts layer number `layer`."""
    e = _EXPERTS[layer]
    return e(x, topk_weights, topk_ids, _activation(e.uw_activation), e.uw_on_input)


@_experts_op.register_fake
def _(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], _EXPERTS[layer].hidden))


def _activation(act) -> str:
    """vLLM's MoEActivation (or a string) as UnweightExperts names it: "silu", "gelu", ..."""
    return str(getattr(act, "value", act)).lower()
