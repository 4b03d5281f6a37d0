"""The vLLM plugin: quantization method `unweight`, its linear method and its model loader.

Imported only by vLLM's plugin loader (`register` in runtime/vllm/__init__.py), in every vLLM
process; the classes live at module level because vLLM pickles the config into its engine.

- `UnweightConfig` is what `quantization_config: {"quant_method": "unweight"}` in config.json
  selects. A folder compressed from a compressed-tensors checkpoint (Kimi K2.5's INT4 experts)
  keeps the source's config in it (`source_quantization_config`): on the CPU, MoE experts and
  linears it quantizes W4A16 get `UnweightInt4MoEMethod` and `UnweightInt4LinearMethod`
  (runtime/vllm/int4.py: kept coded in the int4 layout, run by unweight's INT4 kernels); the
  other layers it quantizes get vLLM's
  compressed-tensors methods, their packed codes and scales decoded at load to the source's bytes;
  the rest is as below. Linear layers get `UnweightLinearMethod` (a weight that is
  not BF16 stays dense there, logged once); MoE experts get `UnweightMoEMethod`
  (runtime/vllm/experts.py; vLLM's own unquantized method where it cannot hold them, logged once);
  the embedding and the lm_head get `UnweightEmbeddingMethod`: the rank's rows of the vocabulary
  compressed like a linear's, looked up by rows and multiplied by the lm_head's linear pipelines;
  a tied lm_head uses its embedding's, so one compressed copy serves both.
- `UnweightModelLoader` replaces vLLM's default loader for `--load-format auto` (and is also
  `--load-format unweight`); for any other checkpoint it is the default loader unchanged. For an
  unweight folder it hands vLLM's model code every tensor as a `LazyWeight`, undecoded.
- A linear layer's weight loader takes the rank's block of each tensor (`shards.plan`), decodes
  only that block into a buffer of the rank's weight, and once every shard is in, encodes the
  buffer as `tiles` (CPU) or `qtiles` (CUDA) in an `UnweightLinear` and drops it: the rank holds
  its compressed shard, and the largest decoded memory at any time is one layer's rank slice.
- `apply` runs the layer, under torch.compile through the custom op `unweight::linear` (one op
  with a fake implementation), in eager mode directly; it picks its pipeline per batch bucket with the autotuner:
  fused (numba GEMV on the CPU, the Triton kernel on CUDA) or decode + matmul. On the CPU, decode
  + matmul multiplies with vLLM's own CPU GEMM dispatch (oneDNN or sgl), so that forced
  (`UNWEIGHT_PIPELINE=decode_matmul`) it gives vLLM's unquantized logits bit for bit; it packs the
  weight at every call, so the CPU has a third pipeline, `decode_linear` (decode + F.linear).
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    LinearMethodBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.model_loader import default_loader
from vllm.model_executor.model_loader import register_model_loader as _register_loader
from vllm.model_executor.utils import set_weight_attrs

from unweight.hf_config import SOURCE_KEY  # (json only: no codec)

from . import experts, int4, shards
from .registry import Registry, log, warn_once

# unweight's codec (numba, llvmlite) is imported only when a model loads: vLLM's CPU worker scans every
# loaded module's globals when it starts, after the plugins, and llvmlite's function wrappers break that
# scan (AttributeError: '_lib_fn_wrapper' object has no attribute 'get').

NAME = "unweight"


@register_quantization_config(NAME)
class UnweightConfig(QuantizationConfig):
    """quant_method "unweight": lossless, entropy-coded BF16 weights (see the module docstring)."""

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # any GPU Triton runs on, and the CPU

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    def __init__(self, source: QuantizationConfig | None = None):
        self.source = source  # the source checkpoint's own method (compressed-tensors), or None
        super().__init__()

    @property
    def packed_modules_mapping(self) -> dict[str, list[str]]:
        return self._packed_modules_mapping

    @packed_modules_mapping.setter
    def packed_modules_mapping(self, mapping: dict[str, list[str]]) -> None:
        # vLLM sets the model's (qkv_proj: [q_proj, k_proj, v_proj], ...) once the model class is known;
        # compressed-tensors matches fused layers' names to its targets through it
        self._packed_modules_mapping = mapping
        if self.source is not None:
            self.source.packed_modules_mapping = mapping

    @classmethod
    def from_config(cls, config: dict) -> UnweightConfig:
        if config.get("quant_method", NAME) != NAME:
            raise ValueError(f"quantization_config has quant_method {config.get('quant_method')!r}, not {NAME!r}")
        source = config.get(SOURCE_KEY)
        if source is None:
            return cls()
        method = source.get("quant_method") if isinstance(source, dict) else None
        if method != "compressed-tensors":
            raise ValueError(
                f"quantization_config's {SOURCE_KEY} has quant_method {method!r}: the unweight plugin serves "
                f"compressed-tensors sources only"
            )
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
            CompressedTensorsConfig,
        )

        return cls(CompressedTensorsConfig.from_config(source))

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        if self.source is not None:  # its targets and ignore list, renamed as the model's layers are
            self.source.apply_vllm_mapper(hf_to_vllm_mapper)

    def get_quant_method(self, layer: nn.Module, prefix: str):
        if self.source is not None:
            if isinstance(layer, RoutedExperts) and (scheme := int4.w4a16_scheme(self.source, layer, prefix)):
                why = int4.unsupported(layer.moe_config)
                if why is None:  # INT4 experts kept coded, on unweight's own kernels
                    return int4.UnweightInt4MoEMethod(layer.moe_config, *scheme, prefix)
                warn_once(f"INT4 experts of {prefix!r} keep vLLM's compressed-tensors method: {why}")
            method = self.source.get_quant_method(layer, prefix)
            if isinstance(layer, LinearBase) and (group := int4.linear_group(method, layer)):
                return int4.UnweightInt4LinearMethod(method, group, prefix)  # a W4A16 weight kept coded
            if method is not None and not isinstance(method, (UnquantizedLinearMethod, UnquantizedFusedMoEMethod)):
                # quantized in the source (INT4 codes and scales): its own method, the tensors decoded at load
                layer.uw_source = isinstance(layer, (LinearBase, RoutedExperts))  # (attention gets its KV-cache scales)
                return method
        if isinstance(layer, LinearBase):
            if prefix.rsplit(".", 1)[-1] in DENSE_LINEARS:
                warn_once(f"{DENSE_LINEARS[prefix.rsplit('.', 1)[-1]]}: these layers keep a dense weight")
                return UnquantizedLinearMethod()
            return UnweightLinearMethod(prefix)
        if isinstance(layer, VocabParallelEmbedding):
            if layer.shard_indices.num_added_elements:
                warn_once(f"{prefix!r} has an added (LoRA) vocabulary: its rows keep a dense weight")
                return None
            return UnweightEmbeddingMethod(prefix)
        if isinstance(layer, RoutedExperts):
            why = experts.unsupported(layer.moe_config)
            if why is None:
                return experts.UnweightMoEMethod(layer.moe_config, prefix)
            warn_once(f"MoE experts of {prefix!r} are decoded to dense weights at load (vLLM's own MoE): {why}")
            return UnquantizedFusedMoEMethod(layer.moe_config)
        return None  # attention: vLLM's own


# Linear layers that keep vLLM's own dense weight, by the last part of their name, and why
DENSE_LINEARS = {
    "kv_b_proj": (
        "MLA's kv_b_proj (about 1 GB of Kimi K2.5's 594 GB) is read whole at load by vLLM's MLA attention, which "
        "absorbs it into dense W_UK and W_UV; kept dense, their layout is the one unquantized vLLM's summation "
        "order follows"
    ),
}

_KINDS = (  # most specific first: QKV and merged layers are column-parallel layers too
    (QKVParallelLinear, "qkv"),
    (MergedColumnParallelLinear, "merged"),
    (ColumnParallelLinear, "column"),
    (RowParallelLinear, "row"),
    (ReplicatedLinear, "replicated"),
)


def _kind(layer: nn.Module) -> str:
    for cls, kind in _KINDS:
        if isinstance(layer, cls):
            return kind
    raise ValueError(
        f"layer {getattr(layer, 'prefix', '?')!r}: {type(layer).__name__} is not a linear layer the plugin knows"
    )


class _Pending:
    """A layer's rank-local weight while its shards come in: decoded values, dropped once encoded."""

    def __init__(self, rows: int, cols: int, expected: frozenset):
        self.rows, self.cols, self.expected = rows, cols, expected
        self.values: torch.Tensor | None = None  # (rows, cols) in the tensors' dtype, from the first shard on
        self.dtype: torch.dtype | None = None
        self.seen: set = set()

    @property
    def numel(self) -> int:
        return self.rows * self.cols


class UnweightLinearMethod(LinearMethodBase):
    """A vLLM linear layer whose rank-local weight is an UnweightLinear (see the module docstring)."""

    def __init__(self, prefix: str = ""):
        self.prefix = prefix

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        kind = _kind(layer)
        pending = _Pending(sum(output_partition_sizes), input_size_per_partition, shards.shard_ids(kind, layer))
        _placeholder(layer, params_dtype, extra_weight_attrs, _ShardLoader(layer, kind, self.prefix), pending)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pending = getattr(layer, "uw_pending", None)
        if pending is not None and layer.uw_index < 0:
            missing = sorted(map(str, pending.expected - pending.seen))
            raise ValueError(f"layer {self.prefix!r}: the checkpoint gave no weight for shard(s) {', '.join(missing)}")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # torch.compile traces the custom op; eager calls the layer's forward itself, without the
        # op's dispatch (7 µs of a small layer's 60 on the CPU, 120 times a SmolLM2 step) or
        # nn.Module.__call__'s (0.8 µs: the submodule is the plugin's own, and no hook is put on it)
        y = torch.ops.unweight.linear(x, layer.uw_index) if torch.compiler.is_compiling() else layer.uw.forward(x)
        return y + bias if bias is not None else y


def _placeholder(layer: nn.Module, dtype: torch.dtype, attrs: dict, loader, pending: _Pending) -> None:
    """The layer's `weight`: an empty parameter (no memory of the weight's size) whose loader builds
    the compressed layer instead, with vLLM's attributes but its own loader."""
    attrs.pop("weight_loader", None)
    weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
    layer.register_parameter("weight", weight)
    set_weight_attrs(weight, {**attrs, "weight_loader": loader})
    layer.uw_pending, layer.uw_index = pending, -1


class _ShardLoader:
    """The weight_loader of an UnweightLinearMethod layer's weight: (param, tensor, shard_id)."""

    def __init__(self, layer: nn.Module, kind: str, prefix: str):
        self.layer, self.kind, self.prefix = layer, kind, prefix

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        from .lazy import LazyWeight

        layer, pending = self.layer, self.layer.uw_pending
        name = loaded.uw_name if isinstance(loaded, LazyWeight) else f"{self.prefix}.weight"
        if pending.dtype is None:
            pending.dtype = loaded.dtype
            if loaded.dtype != torch.bfloat16:
                warn_once(
                    f"tensor {name!r} is {loaded.dtype}, not BF16: its layer keeps a dense weight (vLLM's own GEMM)"
                )
        elif loaded.dtype != pending.dtype:
            raise ValueError(f"tensor {name!r} is {loaded.dtype}, the layer's other shards {pending.dtype}")
        block = shards.plan(self.kind, layer, shard_id, tuple(loaded.shape), name)
        if block.cols != pending.cols or block.dst0 + block.rows > pending.rows:
            raise ValueError(f"tensor {name!r} of shape {list(loaded.shape)} does not fit layer {self.prefix!r}")
        if isinstance(loaded, LazyWeight):
            part = loaded.block(block.src0, block.src0 + block.rows, block.col0, block.col0 + block.cols)
        else:  # a model's loader that transformed the tensor first: it is dense already
            part = loaded[block.src0 : block.src0 + block.rows, block.col0 : block.col0 + block.cols]
        if pending.values is None:
            pending.values = torch.empty(pending.rows, pending.cols, dtype=pending.dtype)
        pending.values[block.dst0 : block.dst0 + block.rows] = part
        pending.seen.add(shard_id)
        if pending.seen >= pending.expected:
            _finish(layer, pending, param)


def _finish(layer: nn.Module, pending: _Pending, param: nn.Parameter) -> None:
    device = param.device
    weight, pending.values = pending.values, None
    if weight.dtype == torch.bfloat16:
        values = weight.view(torch.int16).numpy().view(np.uint16).reshape(-1)
        uw = _linear_class().from_values(values, pending.rows, pending.cols, None, device)
        del values, weight
    else:
        uw = _DenseLinear(weight)
    if device.type != "cpu":
        uw = uw.to(device)
    layer.uw = uw  # a submodule: vLLM moves it, and counts its buffers as the layer's weight
    layer.uw_index = _LAYERS.add(uw)


class UnweightEmbeddingMethod(QuantizeMethodBase):
    """A VocabParallelEmbedding (the embedding, or a ParallelLMHead) whose rank's rows of the
    vocabulary are an UnweightLinear: `embedding` looks rows up (exact in the model's dtype), `apply`
    is the lm_head's x @ W^T through the linear's pipelines, and a tied lm_head takes its embedding's
    layer, so that one compressed copy serves both."""

    def __init__(self, prefix: str = ""):
        self.prefix = prefix

    def create_weights(
        self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int], *sizes, **attrs
    ) -> None:  # (sizes: the whole vocabulary's input and output sizes; attrs: params_dtype and vLLM's attributes)
        pending = _Pending(sum(output_partition_sizes), input_size_per_partition, frozenset([None]))
        _placeholder(layer, attrs.pop("params_dtype"), attrs, _VocabLoader(layer, self.prefix), pending)

    def tie_weights(self, layer: nn.Module, embed_tokens: nn.Module) -> nn.Module:
        if not isinstance(embed_tokens.quant_method, UnweightEmbeddingMethod):  # a dense (or the source's) embedding
            warn_once(f"{self.prefix!r} is tied to an embedding the plugin does not hold: it shares that one's weight")
            layer.quant_method = embed_tokens.quant_method
            return layer.quant_method.tie_weights(layer, embed_tokens)
        layer.weight = embed_tokens.weight
        layer.uw_tied = (embed_tokens,)  # (a tuple: not registered as a submodule of the lm_head)
        layer.uw_pending = None  # the checkpoint gives no tensor of its own
        return layer

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        tied = getattr(layer, "uw_tied", None)
        if tied is not None:
            embed = tied[0]
            if embed.uw_index < 0:
                raise ValueError(f"layer {self.prefix!r}: the checkpoint gave no weight for its tied embedding")
            layer.uw, layer.uw_index = embed.uw, embed.uw_index
        elif layer.uw_index < 0:
            what = f"layer {self.prefix!r}" if self.prefix else "the embedding"
            raise ValueError(f"{what}: the checkpoint gave no weight for it")

    apply = UnweightLinearMethod.apply  # the lm_head's logits: x @ W^T, as a linear's

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        # torch.compile traces the custom op; eager looks the rows up itself, without the op's dispatch
        if torch.compiler.is_compiling():
            return torch.ops.unweight.rows(ids, layer.uw_index, layer.params_dtype)
        return _lookup(layer.uw, ids, layer.params_dtype)


class _VocabLoader:
    """The weight_loader of an UnweightEmbeddingMethod layer's weight: the rank's rows of the
    vocabulary (VocabParallelEmbedding's shard of the tensor's rows; padding rows zero)."""

    def __init__(self, layer: nn.Module, prefix: str):
        self.layer, self.prefix = layer, prefix

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        from .lazy import LazyWeight

        layer, pending = self.layer, self.layer.uw_pending
        name = loaded.uw_name if isinstance(loaded, LazyWeight) else f"{self.prefix}.weight"
        # (vLLM's model code builds some embeddings without a prefix: the tensor's name gives the layer's)
        prefix = self.prefix or name.removesuffix(".weight")
        if pending is None:
            raise ValueError(f"tensor {name!r}: layer {prefix!r} is tied to the embedding and takes no weight")
        if tuple(loaded.shape) != (layer.org_vocab_size, pending.cols):
            raise ValueError(
                f"tensor {name!r} has shape {list(loaded.shape)}, but layer {prefix!r} needs "
                f"{[layer.org_vocab_size, pending.cols]}"
            )
        if loaded.dtype != torch.bfloat16:
            warn_once(f"tensor {name!r} is {loaded.dtype}, not BF16: its layer keeps a dense weight")
        r0, r1 = layer.shard_indices.org_vocab_start_index, layer.shard_indices.org_vocab_end_index
        part = loaded.block(r0, r1, 0, pending.cols) if isinstance(loaded, LazyWeight) else loaded[r0:r1]
        pending.dtype = loaded.dtype
        pending.values = torch.zeros(pending.rows, pending.cols, dtype=loaded.dtype)
        pending.values[: r1 - r0] = part
        pending.seen.add(None)
        _finish(layer, pending, param)


@functools.cache
def _linear_class() -> type:
    """UnweightLinear whose CPU decode + matmul multiplies with vLLM's CPU GEMM dispatch, the one
    that vLLM's unquantized layers use, rather than F.linear (see the module docstring)."""
    from unweight.runtime.layers import linear_kernels as lk
    from unweight.runtime.layers.linear import UnweightLinear

    class VllmDecodeMatmul(lk.CpuDecodeMatmul):
        """W decoded, then vLLM's CPU GEMM dispatch (which packs W at each call)."""

        @staticmethod
        def apply(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return _vllm_cpu_gemm(layer.decoded_weight(x.dtype))(x)

    class DecodeLinear(lk.CpuDecodeMatmul):
        """UnweightLinear's own CPU decode + F.linear: no repacking per call."""

        name = "decode_linear"

    class VllmUnweightLinear(UnweightLinear):
        AUTOTUNE_TAG = "vllm"
        KERNELS = tuple(VllmDecodeMatmul if k is lk.CpuDecodeMatmul else k for k in lk.KERNELS) + (DecodeLinear,)

    return VllmUnweightLinear


class _DenseLinear(nn.Module):
    """The fallback for a weight the tiles cannot hold (not BF16): dense, multiplied as vLLM's
    unquantized layers multiply (its CPU GEMM dispatch; F.linear on a GPU)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.out_features, self.in_features = weight.shape
        self._gemm = self._gemm_dtype = None  # the packed GEMM, made at the first CPU forward of a dtype

    def rows(self, ids: torch.Tensor, dtype: torch.dtype, check: bool = True) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.weight).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return torch.nn.functional.linear(x, self.weight.to(x.dtype))
        if self._gemm_dtype != x.dtype:
            self._gemm, self._gemm_dtype = _vllm_cpu_gemm(self.weight.to(x.dtype)), x.dtype
        return self._gemm(x)


def _vllm_cpu_gemm(weight: torch.Tensor):
    """x -> x @ weight^T through vLLM's CPU GEMM dispatch, the one its unquantized layers use
    (oneDNN or its small-GEMM kernel), which packs `weight` here, once per call of this function."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = SimpleNamespace(weight=weight)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    return lambda x: layer.cpu_linear(x, layer.weight, None)


_LAYERS = Registry()  # the live built layers of this process, by uw_index


@torch.library.custom_op("unweight::linear", mutates_args=())
def _linear(x: torch.Tensor, layer: int) -> torch.Tensor:
    """y = x @ W^T for the process's layer number `layer` (one opaque op for torch.compile)."""
    return _LAYERS[layer](x)


@_linear.register_fake
def _(x: torch.Tensor, layer: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], _LAYERS[layer].out_features))


@torch.library.custom_op("unweight::rows", mutates_args=())
def _rows(ids: torch.Tensor, layer: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` (any shape) of the process's layer number `layer`, in `dtype`: (*ids.shape, in_features)."""
    return _lookup(_LAYERS[layer], ids, dtype)


def _lookup(uw: nn.Module, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` (any shape) of a layer's weight in `dtype`: (*ids.shape, in_features)."""
    return uw.rows(ids.reshape(-1), dtype).reshape(*ids.shape, -1)


@_rows.register_fake
def _(ids: torch.Tensor, layer: int, dtype: torch.dtype) -> torch.Tensor:
    return ids.new_empty((*ids.shape, _LAYERS[layer].in_features), dtype=dtype)


class UnweightModelLoader(default_loader.DefaultModelLoader):
    """vLLM's default loader, except for an unweight folder: every tensor goes to the model's
    weight loaders as a LazyWeight, and the checkpoint's stored streams are checked against their
    CRC-32s as they are read."""

    def download_model(self, model_config) -> None:
        if model_config.quantization != NAME:
            return super().download_model(model_config)
        self._folder(model_config)

    def load_weights(self, model: nn.Module, model_config) -> None:
        if model_config.quantization != NAME:
            return super().load_weights(model, model_config)
        from unweight.reader import CompressedCheckpoint

        from .lazy import LazyWeight

        _keep_llvmlite_out_of_vllms_kernel_scan()
        expected = _expected_parameters(model)
        limit = _largest_weight(model) * 4 * _tp_size()  # fp32 parameters' bytes; a TP rank reads whole tensors
        with CompressedCheckpoint(self._folder(model_config)) as ckpt:
            loaded = model.load_weights((name, LazyWeight(ckpt, name, limit=limit)) for name in ckpt.keys())
            stats, checked, whole = ckpt.integrity, ckpt.checked_tensors(), ckpt.decoded_tensors()
        if loaded is not None:  # vLLM's own check, which it runs for unquantized models only
            missing = sorted(expected - set(loaded))
            if missing:
                raise ValueError(
                    f"{model_config.model}: the checkpoint has no tensor for {len(missing)} of the model's parameters "
                    f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); refusing to serve a model with "
                    f"weights left unset"
                )
        for m in model.modules():  # INT4 layers coded now, so that what this rank holds is logged whole
            if isinstance(
                getattr(m, "quant_method", None), (int4.UnweightInt4MoEMethod, int4.UnweightInt4LinearMethod)
            ):
                m.quant_method.code(m)
        log.info(
            "unweight: %s: %d tensors checked, %d by the CRC-32 of their bytes decoded whole, the others by their "
            "streams' CRC-32s (%.2f s in stream checks)",
            model_config.model,
            checked,
            whole,
            stats.seconds,
        )
        held = resident(model)
        log.info(
            "unweight: tensor-parallel rank %d of %d holds %d compressed linears, %d compressed embeddings and "
            "%d compressed experts layers: %d bytes resident, %d in BF16 (%.1f %%); %d layers as the source "
            "quantized them",
            _tp_rank(),
            _tp_size(),
            held["linears"],
            held["embeddings"],
            held["experts"],
            held["stored_bytes"],
            held["bf16_bytes"],
            100 * held["stored_bytes"] / max(1, held["bf16_bytes"]),
            held["source"],
        )
        if held["int4_experts"] or held["int4_linears"]:
            log.info(
                "unweight: tensor-parallel rank %d holds %d INT4 experts layers and %d INT4 linears (coded where "
                "smaller): %d bytes resident, %d as the source stores them (%.1f %%)",
                _tp_rank(),
                held["int4_experts"],
                held["int4_linears"],
                held["int4_bytes"],
                held["int4_source_bytes"],
                100 * held["int4_bytes"] / max(1, held["int4_source_bytes"]),
            )

    def _folder(self, model_config) -> str:
        """The local folder of the checkpoint: the path given, or the Hub snapshot vLLM downloads."""
        if os.path.isdir(model_config.model):
            return model_config.model
        from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf

        return download_weights_from_hf(
            model_config.model, self.load_config.download_dir, ["*.safetensors", "*.json"], model_config.revision
        )


def _expected_parameters(model: nn.Module) -> set[str]:
    """The parameters the checkpoint must give: all but the plugin's linear layers' (empty until
    built: their loaders check their shards) and the KV-cache scales that a source's quantization
    method gives attention layers, which vLLM sets itself when the checkpoint has none
    (compressed-tensors gives them to every layer). The plugin's embeddings are empty too, but
    expected: a tied lm_head shares its embedding's parameter, so it is not listed twice."""
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    scales, embeddings = [], []
    for name, m in model.named_modules():
        method = getattr(m, "quant_method", None)
        if isinstance(method, BaseKVCacheMethod):
            scales.append(f"{name}.")
        elif isinstance(method, UnweightEmbeddingMethod):
            embeddings.append(f"{name}.")
    scales, embeddings = tuple(scales), tuple(embeddings)
    return {
        name
        for name, p in model.named_parameters()
        if (p.numel() or name.startswith(embeddings)) and not (scales and name.startswith(scales))
    }


def _keep_llvmlite_out_of_vllms_kernel_scan() -> None:
    """vLLM's CPU worker, as it starts, reads `vars(value).get(...)` of every global of every loaded
    module. llvmlite's library object (loaded with unweight's codec) answers `__dict__`, as any
    name, with a function wrapper, so once a model has loaded here the next vllm.LLM in this process
    fails (AttributeError: '_lib_fn_wrapper' object has no attribute 'get'): a notebook that starts
    again after a refused folder. An empty __dict__ in its function table answers that scan."""
    try:
        from llvmlite.binding import ffi

        ffi.lib._fntab.setdefault("__dict__", {})
    except (ImportError, AttributeError):  # another llvmlite: nothing to mend, or nothing we know how to
        pass


def _largest_weight(model: nn.Module) -> int:
    """Elements of the largest weight this rank holds: its parameters, and what the plugin's layers
    build at load (their parameters are empty until then)."""
    n = max((p.numel() for p in model.parameters()), default=0)
    for module in model.modules():
        pending = getattr(module, "uw_pending", None)
        if pending is not None:
            n = max(n, pending.numel)
    return n


def resident(model: nn.Module) -> dict:
    """What the plugin built in `model` (this rank's): its compressed linears, embeddings (a tied
    lm_head counted once, with its embedding) and experts layers, their resident bytes and what the
    same weights take in BF16, how many layers kept the source's quantization (compressed-tensors'
    INT4, decoded at load to the source's tensors), and the INT4 experts layers it holds coded
    (their resident bytes, and what the source's codes and BF16 scales of them take)."""
    built: dict[int, tuple[str, nn.Module]] = {}
    for m in model.modules():
        uw = getattr(m, "uw", None)
        if isinstance(uw, _linear_class()):
            kind = "embeddings" if isinstance(m.quant_method, UnweightEmbeddingMethod) else "linears"
            built.setdefault(id(uw), (kind, uw))
    matrices = [uw for _, uw in built.values()]
    layers = [m.uw_experts for m in model.modules() if hasattr(m, "uw_experts")]
    coded = [m.uw_int4 for m in model.modules() if hasattr(m, "uw_int4")]  # Int4Experts and Int4Linear layers
    weights = [w for c in coded for w in ((c.w13, c.w2) if hasattr(c, "w13") else (c.weight_int4,))]
    return {
        "int4_experts": sum(hasattr(c, "w13") for c in coded),
        "int4_linears": sum(not hasattr(c, "w13") for c in coded),
        "int4_bytes": sum(c.stored_bytes for c in coded),
        "int4_source_bytes": sum(w.source_bytes for w in weights),
        "linears": sum(kind == "linears" for kind, _ in built.values()),
        "embeddings": sum(kind == "embeddings" for kind, _ in built.values()),
        "experts": len(layers),
        "stored_bytes": sum(m.stored_bytes for m in matrices + layers),
        "bf16_bytes": sum(2 * m.in_features * m.out_features for m in matrices)
        + sum(2 * e.num_experts * 3 * e.hidden * e.intermediate for e in layers),
        "source": sum(1 for m in model.modules() if getattr(m, "uw_source", False)),
    }


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def _tp_size() -> int:
    from vllm.distributed import get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_world_size()


def register() -> None:
    """Register the loader: as `--load-format unweight`, and in place of vLLM's default loader
    for `auto` (which it is, for every checkpoint that is not an unweight folder)."""
    from vllm.model_executor import model_loader

    _register_loader(NAME)(UnweightModelLoader)
    if model_loader._LOAD_FORMAT_TO_MODEL_LOADER.get("auto") is default_loader.DefaultModelLoader:
        model_loader._LOAD_FORMAT_TO_MODEL_LOADER["auto"] = UnweightModelLoader
