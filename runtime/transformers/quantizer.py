"""`UnweightHfQuantizer`: transformers' `from_pretrained` on a folder made by `unweight compress`.

transformers calls it twice around its own loader:

1. before (`_process_model_before_weight_loading`, the model on the meta device): open the
   folder's containers, plan which checkpoint tensors fill which model tensor (plan.py: transformers'
   own renamings and expert merges, every shape compared, nothing missing), swap the classes of the
   modules that stay compressed (modules.py) and take every planned tensor out of the state dict.
   transformers' loader then finds nothing to load or initialise in them: the containers' streams and
   placeholders are all unexpected keys to it, and are not listed;
2. after (`_process_model_after_weight_loading`): fill them. 2-D BF16 weights of nn.Linear and
   nn.Embedding become UnweightLinears (tiles on the CPU, qtiles on CUDA: archive-layout tensors
   are transcoded), MoE experts UnweightExperts, and everything else is decoded once into the dtype
   the model has for it. Each tensor is checked (stream CRC-32s, or the CRC-32 of its decoded bytes)
   and lands on the device the device map gives its module.

The model cannot be saved by `save_pretrained` (is_serializable is False: transformers refuses
with an error naming the method); `unweight compress` of the original folder makes the checkpoint.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from unweight.errors import FormatError, SourceError
from unweight.formats.dtypes import TORCH_DTYPES
from unweight.hf_config import QUANT_METHOD, SOURCE_KEY

from . import modules as m
from .plan import LoadPlan, Target, make_plan

# The reader and the layers load numba, imported here only when a folder loads: `import unweight` in a
# process where transformers is loaded imports this module, and vLLM's CPU worker, which scans every
# module's globals at start, fails on llvmlite's (runtime/vllm/plugin.py).
if TYPE_CHECKING:
    from unweight.reader import CompressedCheckpoint

    from ..layers.linear import UnweightLinear

log = logging.getLogger(__name__)


class UnweightConfig(QuantizationConfigMixin):
    """The `quantization_config` that `unweight compress` writes: {"quant_method": "unweight"}, and
    the source's own quantization_config where the source was quantized (compressed-tensors)."""

    def __init__(self, **kwargs):
        self.quant_method = QUANT_METHOD
        self.source_quantization_config = kwargs.get(SOURCE_KEY)

    def to_dict(self) -> dict:
        source = self.source_quantization_config
        return {"quant_method": QUANT_METHOD} | ({SOURCE_KEY: source} if source is not None else {})


class UnweightHfQuantizer(HfQuantizer):
    """Loads a compressed folder into any transformers model class, its weights kept compressed."""

    requires_calibration = True  # only folders made by `unweight compress`: never quantizes on the fly
    requires_parameters_quantization = False

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.ckpt: CompressedCheckpoint | None = None
        self.plan: LoadPlan | None = None
        self._standin: torch.dtype | None = None  # the dtype update_dtype gave for the source weights' unknown one

    def validate_environment(self, *args, device_map=None, **kwargs):
        source = self.quantization_config.source_quantization_config
        if source is not None:
            method = source.get("quant_method") if isinstance(source, dict) else source
            raise ValueError(
                f"unweight: this folder was compressed from a {method} checkpoint, whose quantized layers the "
                f"transformers integration does not load; serve it with vLLM, or `unweight decompress` it and load "
                f"the result with transformers' {method} support"
            )
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("unweight: a device_map with 'disk' offload is not supported; keep the model on cpu/cuda")

    def update_device_map(self, device_map):
        """No device_map: everything on the default device (cpu, or a `with torch.device(...)` block's),
        said as a device map. Between our two hooks the model holds no parameters at all, and transformers
        (from 5.2x, where hub kernels are on by default) asks `model.device` there unless a map names it."""
        if device_map is None:
            return {"": torch.empty(0).device}
        return device_map

    def update_dtype(self, dtype):
        """The model's dtype. One that is no floating-point type is what transformers read off the
        container's uint8 streams: `dtype=None` (or `torch_dtype=None`) makes AutoConfig set the config's
        dtype to None, and "auto" then takes the first floating-point tensor's dtype of the checkpoint,
        which a container has none of. The uncompressed folder loads in its weights' dtype there: BF16
        stands in for it until the folder is open (_source_dtype corrects it where it is another)."""
        if isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
            self._standin = torch.bfloat16
            return self._standin
        return dtype

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, dtype=None, **kwargs):
        if not checkpoint_files:
            raise SourceError("unweight: transformers gave the quantizer no checkpoint files to read")
        # the folder, as its index and member list say, whichever files transformers picked: it takes a
        # model.safetensors before an index, and a stale one beside the shards must be refused, not read
        path = os.path.dirname(os.fspath(checkpoint_files[0]))
        from unweight.reader import CompressedCheckpoint

        self._t0 = time.perf_counter()
        self.ckpt = CompressedCheckpoint(path)
        try:
            if self._standin is not None:  # (transformers 5 passes no dtype here)
                dtype = _source_dtype(model, self.ckpt, checkpoint_files[0], self._standin)
            dtype_plan = model._get_dtype_plan(dtype) if dtype is not None and hasattr(model, "_get_dtype_plan") else {}
            self.plan = make_plan(model, self.ckpt, dtype_plan)
            _swap(model, self.plan)
        except BaseException:
            self.ckpt.close()
            raise
        # transformers ties and reports nothing of what the plan fills: it is all outside its state dict
        model.all_tied_weights_keys = {}
        model._keys_to_ignore_on_load_unexpected = {"."}
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        try:
            report = _fill(model, self.ckpt, self.plan)
        finally:
            self.ckpt.close()
        del model._keys_to_ignore_on_load_unexpected  # the class's own again
        report["seconds"] = time.perf_counter() - self._t0
        model.unweight_report = report
        log.info(
            "unweight: %s: %d linears, %d embeddings and %d experts layers kept compressed; %d tensors decoded; "
            "weights resident %.1f MB for %.1f MB uncompressed (%.3fx); %.2f s",
            self.ckpt.path,
            report["linears"],
            report["embeddings"],
            report["experts"],
            report["decoded"],
            report["resident_bytes"] / 1e6,
            report["original_bytes"] / 1e6,
            report["resident_bytes"] / max(1, report["original_bytes"]),
            report["seconds"],
        )
        if self.plan.unused:
            log.warning("unweight: %s: tensors the model does not use: %s", self.ckpt.path, ", ".join(self.plan.unused))
        return model

    def is_serializable(self, safe_serialization=None):
        log.warning(
            "unweight: save_pretrained cannot write a model loaded from a compressed folder (its weights are "
            "compressed modules, not tensors); the folder itself is the checkpoint: copy it, or run `unweight "
            "compress` on the original. PEFT adapters save as usual (peft_model.save_pretrained)."
        )
        return False

    @property
    def is_trainable(self) -> bool:
        return True  # adapters (PEFT) train on the frozen compressed base

    @property
    def is_qat_trainable(self) -> bool:
        return False


def _source_dtype(model, ckpt: CompressedCheckpoint, first_file, standin: torch.dtype) -> torch.dtype:
    """The dtype transformers' "auto" takes from the uncompressed folder's weights (the first
    floating-point tensor, float8 aside, of the first file, by name), given to `model` (built on the
    meta device in `standin`, by update_dtype) and its config where it differs."""
    names = sorted(ckpt.keys())
    real = {f: os.path.realpath(f) for f in {ckpt.file_of(n) for n in names}}
    first = os.path.realpath(first_file)
    names = [n for n in names if real[ckpt.file_of(n)] == first] or names
    dtypes = (getattr(torch, TORCH_DTYPES.get(ckpt.entry(n).dtype, ""), None) for n in names)
    found = next((d for d in dtypes if isinstance(d, torch.dtype) and d.is_floating_point and d.itemsize > 1), None)
    if found is None or found == standin:
        return standin
    for module in model.modules():  # as if built in `found`: what the stand-in made, not what a module fixes
        for t in [*module._parameters.values(), *module._buffers.values()]:
            if t is not None and t.dtype == standin:
                t.data = t.data.to(found)
    for config in [model.config, *(getattr(model.config, k, None) for k in model.config.sub_configs)]:
        if config is not None:
            config.dtype = found
    return found


def _swap(model, plan: LoadPlan) -> None:
    """Swap the classes of the modules that stay compressed; take every planned tensor out of the
    state dict (modules.detach_tensor)."""
    for t in plan.targets.values():
        module = model.get_submodule(t.module)
        if t.kind == "linear":
            module.__class__ = m.linear_class(type(module))
        elif t.kind == "embedding":
            module.__class__ = m.embedding_class(type(module))
        m.detach_tensor(module, t.attr)
    for name in plan.experts:
        module = model.get_submodule(name)
        module.__class__ = m.experts_class(type(module))
    for key, source in plan.tied.items():
        module, _, attr = key.rpartition(".")
        owner = model.get_submodule(module)
        if plan.targets[source].kind in ("linear", "embedding"):  # shares the source's compressed matrix
            if isinstance(owner, torch.nn.Linear):
                owner.__class__ = m.linear_class(type(owner))
            elif isinstance(owner, torch.nn.Embedding):
                owner.__class__ = m.embedding_class(type(owner))
            else:
                raise SourceError(
                    f"{key} is tied to {source}, but {type(owner).__name__} cannot share a compressed matrix"
                )
        m.detach_tensor(owner, attr)


def _device_map(model) -> list[tuple[str, torch.device]]:
    """(module prefix, device), longest prefix first, from the device map transformers resolved."""
    dm = getattr(model, "hf_device_map", None) or {}
    out = [(k, torch.device(v if not isinstance(v, int) else f"cuda:{v}")) for k, v in dm.items() if v != "disk"]
    return sorted(out, key=lambda kv: -len(kv[0]))


def _device_of(dm, module: str) -> torch.device:
    for prefix, dev in dm:
        if prefix == "" or module == prefix or module.startswith(prefix + "."):
            return dev
    return torch.device("cpu")


def _named(ckpt: CompressedCheckpoint, name: str, fn):
    """fn(), with a codec error that names only the tensor given its file too."""
    try:
        return fn()
    except FormatError as e:
        if e.path is not None or e.tensor not in ckpt:
            raise
        raise type(e)(ckpt.file_of(e.tensor), e.reason, e.tensor) from None


def _compressed_linear(ckpt, name: str, dev: torch.device) -> UnweightLinear:
    from ..layers.linear import UnweightLinear

    entry = ckpt.entry(name)
    decoded = entry.codec != "tiles"  # transcoded: its decode checks the CRC-32 of the original bytes
    streams = ckpt.streams(name, check=not decoded)
    return _named(ckpt, name, lambda: UnweightLinear.from_entry(entry, streams, None, None, dev).to(dev))


def _values(ckpt, t: Target) -> np.ndarray:
    """The target's BF16 bit patterns (uint16), combined from its sources as the converter would."""
    stacks = []
    for group in t.sources:
        parts = [ckpt.get_bytes(n).view(np.uint16).reshape(ckpt.entry(n).shape) for n in group]
        stacks.append(np.stack(parts) if t.concat_dim is not None or len(t.sources) > 1 or len(group) > 1 else parts[0])
    return stacks[0] if len(stacks) == 1 else np.concatenate(stacks, axis=t.concat_dim)


def _dense(ckpt, t: Target) -> torch.Tensor:
    stacks = []
    for group in t.sources:
        parts = [ckpt.get_tensor(n) for n in group]
        stacks.append(
            torch.stack(parts) if t.concat_dim is not None or len(t.sources) > 1 or len(group) > 1 else parts[0]
        )
    value = stacks[0] if len(stacks) == 1 else torch.cat(stacks, dim=t.concat_dim)
    return value.to(t.dtype)


def _fill(model, ckpt: CompressedCheckpoint, plan: LoadPlan) -> dict:
    from ..layers.experts import UnweightExperts

    dm = _device_map(model)
    report = dict(linears=0, embeddings=0, experts=0, decoded=0, resident_bytes=0, original_bytes=0)
    kept: dict[str, UnweightLinear] = {}
    for key, t in plan.targets.items():
        module, dev = model.get_submodule(t.module), _device_of(dm, t.module)
        report["original_bytes"] += sum(ckpt.entry(n).nbytes for n in t.names)
        if t.kind == "linear":
            kept[key] = lin = _compressed_linear(ckpt, t.names[0], dev)
            m.fill_matrix(module, lin, t.dtype)
            report["linears"] += 1
        elif t.kind == "embedding":
            kept[key] = lin = _compressed_linear(ckpt, t.names[0], dev)
            m.fill_matrix(module, lin, t.dtype)
            report["embeddings"] += 1
        elif t.kind == "dense":
            value = _named(ckpt, t.names[0], lambda t=t: _dense(ckpt, t))
            m.attach_tensor(module, t.attr, value.to(dev), t.buffer)
            report["decoded"] += 1
            if len(t.shape) >= 2 and value.numel() >= 1 << 16:
                log.info(
                    "unweight: %s is decoded once (%s%s)",
                    key,
                    str(value.dtype).removeprefix("torch."),
                    list(value.shape),
                )
    for name, (kind, activation) in plan.experts.items():
        module, dev = model.get_submodule(name), _device_of(dm, name)
        w13 = _named(ckpt, name, lambda: _values(ckpt, plan.targets[f"{name}.gate_up_proj"]))
        w2 = _named(ckpt, name, lambda: _values(ckpt, plan.targets[f"{name}.down_proj"]))
        if kind == "llama4":  # (E, H, 2I), (E, I, H) -> (E, 2I, H), (E, H, I)
            w13, w2 = w13.transpose(0, 2, 1), w2.transpose(0, 2, 1)
        e, i2, h = w13.shape
        experts = UnweightExperts.from_values(
            np.ascontiguousarray(w13), np.ascontiguousarray(w2), e, h, i2 // 2, dev
        ).to(dev)
        m.fill_experts(module, experts, kind, activation)
        report["experts"] += 1
    for key, source in plan.tied.items():
        module, _, attr = key.rpartition(".")
        owner = model.get_submodule(module)
        src_module, _, src_attr = source.rpartition(".")
        if source in kept:
            m.fill_matrix(owner, kept[source], plan.targets[source].dtype)
        else:
            owner.__dict__.pop(attr, None)
            setattr(owner, attr, getattr(model.get_submodule(src_module), src_attr))
    report["resident_bytes"] = model.get_memory_footprint()
    return report


def register() -> None:
    """Register UnweightConfig and UnweightHfQuantizer under QUANT_METHOD (idempotent); the package's
    `register()` and import hook call this."""
    from transformers.quantizers import auto

    if QUANT_METHOD not in auto.AUTO_QUANTIZER_MAPPING:
        auto.register_quantization_config(QUANT_METHOD)(UnweightConfig)
        auto.register_quantizer(QUANT_METHOD)(UnweightHfQuantizer)


register()  # when this module is imported first, transformers' registry loaded inside its import
