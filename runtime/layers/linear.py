"""`UnweightLinear`: a linear layer whose weight stays in the serving layout.

Resident memory is the compressed size: the module holds the `tiles` streams as buffers and never
keeps a decoded copy (the CPU's decode-then-matmul reuses one buffer per thread, shared by every
layer, of at most WORKSPACE_MAX_BYTES). Each forward picks a pipeline for (device, shape, batch bucket) through the
autotuner:

| pipeline | CPU (`tiles` streams) | CUDA (`qtiles` streams, runtime/kernels/qtiles.py) |
| --- | --- | --- |
| `decode_matmul` | numba decode in x's dtype into a workspace, then F.linear | Triton decode to BF16, then F.linear |
| `fused` | numba GEMV that rebuilds each row in cache | Triton kernel that decodes W in registers (batches up to 32) |

Moving the layer between the CPU and a GPU (`.to`, `.cuda`, `.cpu`) transcodes its streams: the
stored `tiles` layout on the CPU, the resident `qtiles` layout that the CUDA kernels read.

The CPU computes in fp32 by default (every BF16 weight is exactly an fp32 value, and CPUs without
BF16 units are faster in fp32), or in BF16 when x is BF16; CUDA computes in BF16. Input of another
dtype is cast, the reason logged once.
`rows(ids)` decodes whole rows: the embedding lookup of a (possibly tied) embedding matrix.

`ArchiveLinear` is the same layer over archive-layout streams (any codec): the smallest resident
size, decoded on the CPU at every forward. It is for memory-starved runs, not for speed.
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from unweight.codec import tiles

from ..kernels.cpu_gemv import gemv_plan, tiles_gemv_cpu, tiles_rows_cpu
from ..kernels.transcode import encode_weight, qtiles_to_tiles, tiles_to_qtiles
from ..kernels.weight import QTilesWeight, TilesWeight
from .autotune import DEFAULT, FORCE_ENV, Autotuner, batch_bucket, code_version, device_name
from .transfer import to_device

log = logging.getLogger(__name__)
PIPELINES = ("decode_matmul", "fused")


def compute_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype activations take on a device: fp32 on the CPU, BF16 on CUDA."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def _compute_input(x: torch.Tensor, device: torch.device, note) -> torch.Tensor:
    if x.dtype is torch.bfloat16 or x.dtype is torch.float32 and device.type != "cuda":
        return x  # (the common case first: every forward passes here)
    want = compute_dtype(device)
    note(f"input is {x.dtype}; computing in {want}")
    return x.to(want)


def _check_parts(entries) -> int:
    """in_features shared by 2-D BF16 tensors that are stacked by rows; errors name the tensor."""
    for e in entries:
        if not tiles.applies(e.dtype, e.shape):
            raise ValueError(f"tensor {e.name!r}: a linear weight must be 2-D BF16, not {e.dtype}{list(e.shape)}")
        if e.shape[1] != entries[0].shape[1]:
            raise ValueError(
                f"tensor {e.name!r} has {e.shape[1]} columns, {entries[0].name!r} {entries[0].shape[1]}: they cannot "
                f"be stacked"
            )
    return entries[0].shape[1]


# Bytes of W (in x's dtype) converted at a time: about a Zen 3 core's L2. SmolLM2-135M decode steps in
# the archive layout, against 256 KiB: 128 KiB 1.00x, 512 KiB and 1 MiB 1.12x, 4 MiB 0.95x.
ROW_BLOCK_BYTES = 512 << 10


def _linear_in_row_blocks(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w.to(x.dtype)) for a BF16 `w` on the CPU, converting w a block of rows at a time
    into one small buffer that stays in cache, instead of writing and reading back a whole copy
    of W in x's dtype (twice W's bytes)."""
    n, k = w.shape
    xs = x.reshape(-1, k)
    step = max(1, ROW_BLOCK_BYTES // (k * x.element_size()))
    yt = torch.empty(n, xs.shape[0], dtype=x.dtype)
    buf = torch.empty(min(step, n), k, dtype=x.dtype)
    xt = xs.t()
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        block = buf[: r1 - r0]
        block.copy_(w[r0:r1])
        torch.mm(block, xt, out=yt[r0:r1])
    return yt.t().reshape(*x.shape[:-1], n)


class _Workspace(threading.local):
    """One growing, 8-byte aligned byte buffer per thread. ArchiveLinear.forward decodes W into it
    and consumes W before returning, so W's pages are faulted in once per thread instead of at
    every forward (an 8B-shaped 14336x4096 layer's CPU forward ran 1.17x faster, 1536x576 1.28x).
    Peak memory is what decoding into fresh memory reached; between forwards the buffer stays, the
    size of the largest weight decoded on that thread."""

    buf: np.ndarray | None = None

    def take(self, nbytes: int) -> np.ndarray:
        if self.buf is None or self.buf.nbytes < nbytes:
            self.buf = None  # drop the old one before allocating the larger
            self.buf = np.empty(-(-nbytes // 8), dtype=np.uint64).view(np.uint8)
        return self.buf[:nbytes]


_WORKSPACE = _Workspace()
# The largest W (in x's dtype) that UnweightLinear's CPU decode-then-matmul decodes into the
# workspace; a larger one (an 8B's MLP, a vocabulary) gets fresh memory, freed after its product,
# so the workspace never holds more than this. 256-row BF16 products of SmolLM2's shapes against
# fresh memory and a BF16 copy of an fp32 decode: 3-10% less time each.
WORKSPACE_MAX_BYTES = 32 << 20


def _check_row_ids(ids: torch.Tensor | None, rows: int) -> None:
    """Row ids (None: all rows) must lie in [0, rows): a bad token id is refused before any
    kernel indexes with it."""
    if ids is not None and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        raise ValueError(f"row ids must lie in [0, {rows})")


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

        in_f = _check_parts([e for e, _ in parts])
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
            _check_row_ids(ids, self.out_features)
        w = self.compressed_weight
        if w.device.type == "cuda":
            from unweight.runtime.kernels.qtiles_decode import qtiles_decode

            return qtiles_decode(w, None if ids is None else to_device(ids, w.device)).to(dtype)
        return tiles_rows_cpu(w, ids, dtype)

    def _pipelines(self, m: int, device: torch.device) -> tuple[str, ...]:
        """The pipelines that can take m rows of x on the device."""
        from unweight.runtime.kernels.qtiles_matmul import MAX_M

        return PIPELINES if device.type != "cuda" or m <= MAX_M else ("decode_matmul",)

    def run(self, pipeline: str, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T through one pipeline, without the autotuner or the bias (forward adds both); a
        subclass may replace one (the vLLM plugin's multiplies through vLLM's own GEMM)."""
        if pipeline == "decode_matmul":
            nbytes = self.out_features * self.in_features * x.element_size()
            if x.device.type != "cpu" or nbytes > WORKSPACE_MAX_BYTES or torch.is_grad_enabled() and x.requires_grad:
                return F.linear(x, self.decoded_weight(x.dtype))
            # W written straight in x's dtype into this thread's workspace, which F.linear is done
            # with before any other layer decodes there: no fresh pages to fault in, no fp32 copy
            buf = _WORKSPACE.take(nbytes)
            w = torch.from_numpy(buf).view(x.dtype).view(self.out_features, self.in_features)
            return F.linear(x, tiles_rows_cpu(self.compressed_weight, None, x.dtype, out=w))
        if x.is_cuda:  # (is_cuda, not device.type: a fifth of a microsecond a call)
            from unweight.runtime.kernels.qtiles_matmul import qtiles_linear

            return qtiles_linear(x, self.compressed_weight)
        plan = self._cpu_gemv()
        y = plan(x) if plan is not None else tiles_gemv_cpu(x, self.compressed_weight)
        return y if y.dtype is x.dtype else y.to(x.dtype)

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = self.compressed_weight.device
        x = _compute_input(x, device, self._note)
        if x.device != device:
            raise ValueError(f"input is on {x.device}, the layer on {device}")
        m = x.numel() // self.in_features if self.in_features else 0
        bucket = batch_bucket(m)
        memo = (x.device, bucket, x.dtype, os.environ.get(FORCE_ENV))  # the choice, without rebuilding its key
        name, y = self._chosen.get(memo), None
        if name is None:
            dtype = str(x.dtype).removeprefix("torch.")
            where = device_name(x.device) + (f"|{self.AUTOTUNE_TAG}" if self.AUTOTUNE_TAG else "")
            key = f"{where}|{self.out_features}x{self.in_features}|m{bucket}|{dtype}|{code_version()}"
            name, y = self.autotuner.choose(
                key, {p: (lambda p=p: self.run(p, x)) for p in self._pipelines(bucket, x.device)}, x.device
            )
            self._chosen[memo] = name
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


class ArchiveLinear(nn.Module):
    """y = x @ W^T + b with W kept in its archive-layout streams (rans, zstd or raw) on the CPU.

    W may be several checkpoint tensors stacked by rows (parts). Every forward decodes W on the
    CPU threads (numba) into a workspace shared by all layers on the thread (`_Workspace`), then
    multiplies on the input's device (on the CPU in fp32, converting W a block of rows at a time).
    Resident memory is the archive size plus that workspace, the size of the largest W decoded.
    `rows(ids)` decodes only the rans chunks that hold those rows."""

    def __init__(self, parts: list[tuple], bias: torch.Tensor | None = None, threads: int | None = None):
        super().__init__()
        from unweight.codec.tensor_codec import check_entry

        self.in_features = _check_parts([e for e, _ in parts])
        self.out_features = sum(e.shape[0] for e, _ in parts)
        self.entries = [e for e, _ in parts]
        self.threads = threads
        self._names: list[dict[str, str]] = []
        for i, (entry, streams) in enumerate(parts):
            check_entry(entry, streams)
            names = {role: f"stream{i}_{role}" for role in sorted(streams)}
            for role, buf in names.items():  # owned copies: the module must outlive the file mapping
                self.register_buffer(buf, torch.from_numpy(np.array(streams[role], dtype=np.uint8)), persistent=False)
            self._names.append(names)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @property
    def stored_bytes(self) -> int:
        return sum(getattr(self, b).numel() for names in self._names for b in names.values())

    @property
    def _weight_bytes(self) -> int:  # W in BF16: every part is 2-D BF16 (_check_parts)
        return 2 * self.out_features * self.in_features

    def _part_streams(self, part: int) -> dict[str, np.ndarray]:
        return {role: getattr(self, b).numpy() for role, b in self._names[part].items()}

    def decoded_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """W decoded afresh, a tensor the caller owns."""
        return self._decode_into(np.empty(self._weight_bytes, dtype=np.uint8)).to(dtype)

    def _decode_into(self, buf: np.ndarray) -> torch.Tensor:
        """W decoded into `buf` (W's BF16 bytes), each part straight into its rows (a part that would
        start off an 8-byte boundary, which decode_tensor's `out` needs, is decoded and copied)."""
        from unweight.codec import decode_tensor

        at = 0
        for i, entry in enumerate(self.entries):
            streams = self._part_streams(i)
            rows = buf[at : at + entry.nbytes]
            if rows.ctypes.data % 8:
                rows[:] = decode_tensor(entry, streams, self.threads, verify=False)
            else:
                decode_tensor(entry, streams, self.threads, verify=False, out=rows)
            at += entry.nbytes
        return torch.from_numpy(buf).view(torch.bfloat16).reshape(self.out_features, self.in_features)

    def rows(self, ids: torch.Tensor | None, dtype: torch.dtype = torch.bfloat16, check: bool = True) -> torch.Tensor:
        """Rows `ids` (all if None, on the CPU), shape (len(ids), in_features), on ids' device:
        each part decodes only what holds the rows asked of it (codec.decode_rows), so an embedding
        lookup of a few tokens decodes a few chunks instead of the whole matrix. The ids are always
        checked (check is accepted as UnweightLinear.rows takes it: this lookup runs on the host)."""
        _check_row_ids(ids, self.out_features)
        if ids is None:
            return self.decoded_weight(dtype)
        from unweight.codec import decode_rows

        flat = ids.reshape(-1).cpu().numpy().astype(np.int64)
        out = torch.empty(len(flat), self.in_features, dtype=torch.bfloat16)
        start = 0
        for i, entry in enumerate(self.entries):
            stop = start + entry.shape[0]
            where = np.flatnonzero((flat >= start) & (flat < stop))
            if len(where):
                got = decode_rows(entry, self._part_streams(i), flat[where] - start, self.threads)
                out[torch.from_numpy(where)] = torch.from_numpy(got.view(np.int16)).view(torch.bfloat16)
            start = stop
        return out.to(device=ids.device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _compute_input(x, x.device, lambda m: None)
        nbytes = self._weight_bytes
        # W is consumed before returning, unless autograd keeps it for a backward pass: then it gets
        # its own memory, and the product is a plain F.linear (the blocked one writes with out=)
        keeps_w = torch.is_grad_enabled() and x.requires_grad
        w = self._decode_into(np.empty(nbytes, dtype=np.uint8) if keeps_w else _WORKSPACE.take(nbytes))
        if x.device.type == "cpu" and x.dtype != torch.bfloat16 and not keeps_w:
            y = _linear_in_row_blocks(x, w)
        else:
            y = F.linear(x, w.to(device=x.device, dtype=x.dtype))
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        codecs = ",".join(sorted({e.codec for e in self.entries}))
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, layout=archive ({codecs}), "
            f"stored_bytes={self.stored_bytes}"
        )
