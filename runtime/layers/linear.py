"""`UnweightLinear`: a linear layer whose weight stays in the serving layout.

Resident memory is the compressed size: the module holds one compressed weight value
(`compressed_weight`, runtime/kernels/weight.py), its streams registered as buffers, and never keeps
a decoded copy (the CPU's decode-then-matmul reuses one buffer per thread, shared by every layer, of
at most workspace.WORKSPACE_MAX_BYTES). Each forward picks a pipeline for (device, shape, batch
bucket) through the autotuner, among the rows of the kernel table (linear_kernels.py) that take its
weight: `decode_matmul` (decode W, then F.linear) and `fused` (W rebuilt in cache or in registers).

Moving the layer between the CPU and a GPU (`.to`, `.cuda`, `.cpu`) transcodes its weight
(kernels/transcode.py): the stored `tiles` layout on the CPU, the resident `qtiles` layout that the
CUDA kernels read.

The CPU computes in fp32 by default (every BF16 weight is exactly an fp32 value, and CPUs without
BF16 units are faster in fp32), or in BF16 when x is BF16; CUDA computes in BF16. Input of another
dtype is cast, the reason logged once.
`rows(ids)` decodes whole rows: the embedding lookup of a (possibly tied) embedding matrix.

`ArchiveLinear` (archive_linear.py), the same layer over archive-layout streams, is re-exported here.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch
from torch import nn

from unweight.codec import tiles

from ..kernels.cpu_gemv import gemv_plan, tiles_rows_cpu
from ..kernels.transcode import encode_weight, qtiles_to_tiles, tiles_to_qtiles
from ..kernels.weight import QTilesWeight, TilesWeight
from .archive_linear import ArchiveLinear
from .autotune import DEFAULT, FORCE_ENV, Autotuner, batch_bucket, code_version, device_name
from .inputs import check_parts, check_row_ids, compute_dtype, compute_input
from .linear_kernels import KERNELS, PIPELINES, kernels_for
from .transfer import to_device

__all__ = ["KERNELS", "PIPELINES", "ArchiveLinear", "UnweightLinear", "compute_dtype"]

log = logging.getLogger(__name__)


class _CompressedMatmul(torch.autograd.Function):
    """x @ W^T through a layer's pipeline, with a backward for x alone (W is frozen): W is decoded
    again for it, so nothing of W is kept between the two passes (LoRA training on the compressed
    base holds the compressed weights, not dense copies)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: UnweightLinear, pipeline: str) -> torch.Tensor:
        ctx.layer = layer
        return layer.run(pipeline, x)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        return grad_y @ ctx.layer.decoded_weight(grad_y.dtype), None, None


class UnweightLinear(nn.Module):
    """y = x @ W^T + b with W (out_features, in_features) BF16 stored as `tiles` streams."""

    AUTOTUNE_TAG = ""  # a subclass whose pipelines differ keeps its choices apart in the autotuner's cache
    KERNELS = KERNELS  # the kernel table its pipelines come from (a subclass may bring its own rows)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        streams: dict[str, np.ndarray],
        params: dict,
        bias: torch.Tensor | None = None,
        autotuner: Autotuner | None = None,
    ):
        super().__init__()
        p = tiles.TilesParams.from_json(params)
        tiles.check(streams, p, out_features, in_features)  # a corrupt tile set stops here
        self._setup(TilesWeight.from_numpy(streams, p, out_features, in_features), bias, autotuner)

    def _setup(self, weight: TilesWeight | QTilesWeight, bias, autotuner) -> None:
        self.out_features, self.in_features = weight.shape
        # the tiles block size a weight held as qtiles takes when it moves back to the CPU
        self._tiles_block = weight.block if isinstance(weight, TilesWeight) else tiles.DEFAULT_BLOCK
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.autotuner = autotuner or DEFAULT
        self._warned: set[str] = set()
        self._chosen: dict[tuple, str] = {}
        self.assign_weight(weight)

    def assign_weight(self, weight: TilesWeight | QTilesWeight) -> None:
        """Hold `weight` (W of this layer's shape, in either layout): its streams become the
        module's buffers (state_dict, .to, memory accounting), named by role, and the launchers
        take the value itself, `compressed_weight`. Whoever replaces the streams calls this (the
        layer does at every move: nn.Module._apply), so the value never lags its buffers."""
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(
                f"a {weight.shape} weight cannot replace this layer's {(self.out_features, self.in_features)}"
            )
        old = self.__dict__.get("compressed_weight")
        if old is not None:
            for role in old.ROLES:
                self._buffers.pop(role, None)
        for role, t in weight.streams().items():
            self.register_buffer(role, t)
        self.compressed_weight = weight
        self._kernels = kernels_for(weight, self.KERNELS)  # the rows of the table that read it, by pipeline
        # the fused CPU GEMV's plan and the value it was made for (_cpu_gemv)
        self._plan_key, self._plan = None, None

    @classmethod
    def from_values(
        cls, values: np.ndarray, out_f: int, in_f: int, bias, device, autotuner: Autotuner | None = None
    ) -> UnweightLinear:
        """A layer from W as uint16 values, encoded once into the layout `device` reads: for a GPU
        straight into qtiles, without the tiles encode and decode that moving it there would run."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(encode_weight(values, out_f, in_f, device), bias, autotuner)
        return layer

    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, device: torch.device | str | None = None, **kw
    ) -> UnweightLinear:
        """Compress a dense (out, in) BF16 weight into a new layer, on the CPU; with `device` a GPU,
        already in the layout the GPU reads (move it there with .to)."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            raise ValueError(f"weight must be a 2-D bfloat16 tensor, not {weight.dtype}{list(weight.shape)}")
        out_f, in_f = weight.shape
        values = weight.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16).ravel()
        return cls.from_values(values, out_f, in_f, bias, device, **kw)

    @classmethod
    def from_entry(
        cls,
        entry,
        streams: dict[str, np.ndarray],
        bias: torch.Tensor | None = None,
        threads: int | None = None,
        device: torch.device | str | None = None,
        **kw,
    ) -> UnweightLinear:
        """A layer from one tensor of a compressed checkpoint. Serving-layout tensors are checked
        and taken as they are; archive-layout ones (any codec) are transcoded at load time:
        decoded on the CPU, then re-encoded as tiles, or as qtiles when `device` is a GPU. Errors
        name the tensor."""
        from unweight.codec import decode_tensor
        from unweight.errors import CorruptDataError

        if not tiles.applies(entry.dtype, entry.shape):
            raise ValueError(
                f"tensor {entry.name!r}: a linear weight must be 2-D BF16, not {entry.dtype}{list(entry.shape)}"
            )
        out_f, in_f = entry.shape
        try:
            if entry.codec == "tiles":
                return cls(in_f, out_f, streams, entry.params, bias, **kw)
            values = decode_tensor(entry, streams, threads).view(np.uint16)
        except CorruptDataError:
            raise
        except ValueError as e:
            raise CorruptDataError(None, str(e), entry.name) from None
        return cls.from_values(values, out_f, in_f, bias, device, **kw)

    @classmethod
    def from_entries(
        cls,
        parts: list[tuple],
        bias: torch.Tensor | None = None,
        threads: int | None = None,
        device: torch.device | str | None = None,
        **kw,
    ) -> UnweightLinear:
        """One layer whose rows are those of several checkpoint tensors, stacked in order (q, k
        and v as one qkv matmul): each is decoded, the rows concatenated and encoded as tiles
        (qtiles for a GPU `device`)."""
        if len(parts) == 1:
            return cls.from_entry(*parts[0], bias, threads, device, **kw)
        from unweight.codec import decode_tensor

        in_f = check_parts([e for e, _ in parts])
        values = np.concatenate([decode_tensor(e, st, threads).view(np.uint16) for e, st in parts])
        out_f = sum(e.shape[0] for e, _ in parts)
        return cls.from_values(values, out_f, in_f, bias, device, **kw)

    @property
    def stored_bytes(self) -> int:
        """Resident bytes of the weight (the streams), as held on the module's device."""
        return self.compressed_weight.stored_bytes

    def _apply(self, fn, recurse=True):
        """Transcode the streams when the layer moves between the CPU and a GPU, then move them, and
        hold the value of the streams as they lie afterwards (moved, or shared: share_memory_ moves
        a tensor's storage in place)."""
        w = self.compressed_weight
        target = fn(torch.empty(0, dtype=torch.uint8, device=w.device)).device.type
        if (target == "cuda") != isinstance(w, QTilesWeight):
            self._transcode(target)
        out = super()._apply(fn, recurse)
        self._reassign()
        return out

    def _load_from_state_dict(self, *args, **kw):
        """Loaded streams (copied in place, or assigned: load_state_dict(assign=True)) make a new value."""
        super()._load_from_state_dict(*args, **kw)
        self._reassign()

    def _reassign(self) -> None:
        """A new value over the buffers as they are now."""
        b, w = self._buffers, self.compressed_weight
        self.assign_weight(w.with_streams({role: b[role] for role in w.ROLES}))

    def _transcode(self, target: str) -> None:
        """Hold the weight in the layout `target` reads (qtiles for "cuda", else tiles), its streams
        on the CPU (nn.Module._apply moves them after)."""
        w = self.compressed_weight
        if target == "cuda":
            self.assign_weight(tiles_to_qtiles(w))
        else:
            new = qtiles_to_tiles(w, self._tiles_block)
            self._tiles_block = new.block
            self.assign_weight(new)

    def decoded_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The weight, decoded now into a temporary tensor on the module's device (exact in BF16
        or fp32)."""
        return self.rows(None, dtype)

    def rows(self, ids: torch.Tensor | None, dtype: torch.dtype = torch.bfloat16, check: bool = True) -> torch.Tensor:
        """Rows `ids` of the weight (all rows if None), shape (len(ids), in_features), decoded on
        the module's device; ids must lie in [0, out_features). Checking them waits for the device
        when they lie on a GPU: give host ids (the model does) and the lookup never waits, or ids
        checked already with check=False (a captured graph may not wait)."""
        if check:
            check_row_ids(ids, self.out_features)
        w = self.compressed_weight
        if w.device.type == "cuda":
            from unweight.runtime.kernels.qtiles_decode import qtiles_decode

            return qtiles_decode(w, None if ids is None else to_device(ids, w.device)).to(dtype)
        return tiles_rows_cpu(w, ids, dtype)

    def _pipelines(self, m: int, device: torch.device) -> tuple[str, ...]:
        """The pipelines that can take m rows of x on the device: the names of the kernel table's
        rows (linear_kernels.KERNELS) that implement this weight there."""
        w = self.compressed_weight
        return tuple(name for name, k in self._kernels.items() if k.can_implement(w, m, device))

    def run(self, pipeline: str, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T through one pipeline, without the autotuner or the bias (forward adds both)."""
        return self._kernels[pipeline].apply(self, x)

    def __getstate__(self) -> dict:
        """Pickled or deep-copied without the CPU GEMV's plan (a closure over the streams' addresses),
        which the copy makes again for its own streams (its value is a copy too: another key)."""
        return {**super().__getstate__(), "_plan_key": None, "_plan": None}

    def _cpu_gemv(self):
        """The fused CPU GEMV's plan for the streams as they lie now (cpu_gemv.gemv_plan), keyed by
        the value it was made for, by identity: a move or a replacement of the streams makes a new
        value (assign_weight), and a copy of the layer drops the plan (__getstate__)."""
        w = self.compressed_weight
        if self._plan_key is not w:
            self._plan = gemv_plan(w)
            self._plan_key = w
        return self._plan

    def pipeline(self, x: torch.Tensor) -> tuple[str, torch.Tensor | None]:
        """(the pipeline this layer runs x through, x @ W^T if choosing it just computed that, else
        None): the autotuner's choice for x's device, batch bucket and dtype, remembered per layer.
        x as forward's compute_input makes it."""
        m = x.numel() // self.in_features if self.in_features else 0
        bucket = batch_bucket(m)
        memo = (x.device, bucket, x.dtype, os.environ.get(FORCE_ENV))  # the choice, without rebuilding its key
        name = self._chosen.get(memo)
        if name is not None:
            return name, None
        dtype = str(x.dtype).removeprefix("torch.")
        where = device_name(x.device) + (f"|{self.AUTOTUNE_TAG}" if self.AUTOTUNE_TAG else "")
        key = f"{where}|{self.out_features}x{self.in_features}|m{bucket}|{dtype}|{code_version()}"
        name, y = self.autotuner.choose(
            key, {p: (lambda p=p: self.run(p, x)) for p in self._pipelines(bucket, x.device)}, x.device
        )
        self._chosen[memo] = name
        return name, y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = self.compressed_weight.device
        x = compute_input(x, device, self._note)
        if x.device != device:
            raise ValueError(f"input is on {x.device}, the layer on {device}")
        name, y = self.pipeline(x)
        if torch.is_grad_enabled() and x.requires_grad:
            y = _CompressedMatmul.apply(x, self, name)
        elif y is None:
            y = self.run(name, x)
        return y + self.bias if self.bias is not None else y

    def _note(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.info("UnweightLinear(%d, %d): %s", self.in_features, self.out_features, message)

    def extra_repr(self) -> str:
        layout = self.compressed_weight.layout
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, layout={layout}, "
            f"stored_bytes={self.stored_bytes}"
        )
