"""`LazyWeight`: a checkpoint tensor handed to vLLM's weight loaders undecoded.

vLLM's model code routes each checkpoint tensor to a parameter's `weight_loader` (renaming q/k/v
into qkv_proj, gate/up into gate_up_proj, experts into their stacked parameters). A LazyWeight goes
through that routing as it is: a tensor subclass on the meta device with the original shape and
dtype, holding only (checkpoint, name). Then

- the plugin's own loaders (runtime/vllm/plugin.py) read `.uw_checkpoint` and `.uw_name` and decode only
  the rank's slice;
- any other loader gets real data on first use: `narrow` on dim 0 decodes only those rows (rans
  chunks, tiles rows: an embedding's vocabulary shard), `narrow` on dim 1 decodes the tensor a few
  MiB of rows at a time, keeping those columns; every other operation decodes the tensor whole.
- `unsqueeze(0)` and then `unbind()` (dim 0), which vLLM's MoE expert loader applies to every
  expert tensor, decode nothing: they give a LazyWeight with a leading unit dimension, and back.

Shape, dtype and size queries never decode. This module needs torch, not vLLM.
"""

from __future__ import annotations

import torch

from unweight.reader import CompressedCheckpoint

ROW_BATCH_BYTES = 8 << 20  # rows decoded at a time by a narrow on dim 1

# What a weight loader may ask of a tensor without touching its data.
_METADATA = {
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.element_size,
    torch.Tensor.shape.__get__,
    torch.Tensor.dtype.__get__,
    torch.Tensor.ndim.__get__,
    torch.Tensor.is_meta.__get__,
    torch.Tensor.__len__,
}


class LazyWeight(torch.Tensor):
    """Tensor `name` of `checkpoint`, decoded only when its data is used (see the module docstring)."""

    uw_checkpoint: CompressedCheckpoint
    uw_name: str
    uw_lead: int  # leading unit dimensions before the tensor's own (unsqueeze(0)); 0 but in vLLM's MoE loader

    @staticmethod
    def __new__(cls, checkpoint: CompressedCheckpoint, name: str, lead: int = 0) -> LazyWeight:
        entry = checkpoint.entry(name)
        meta = torch.empty((1,) * lead + tuple(entry.shape), dtype=checkpoint.torch_dtype(name), device="meta")
        t = torch.Tensor._make_subclass(cls, meta)
        t.uw_checkpoint, t.uw_name, t.uw_lead = checkpoint, name, lead
        return t

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dim 0, decoded (only what holds them, where the codec allows)."""
        return self.uw_checkpoint.get_rows(self.uw_name, start, stop)

    def block(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """Rows [r0, r1) and columns [c0, c1) of a 2-D tensor, decoded a few MiB of rows at a time."""
        cols = self.shape[1]
        if not (0 <= r0 <= r1 <= self.shape[0] and 0 <= c0 <= c1 <= cols):
            raise ValueError(
                f"block [{r0}:{r1}, {c0}:{c1}] lies outside tensor {self.uw_name!r} of shape {list(self.shape)}"
            )
        if (c0, c1) == (0, cols):
            return self.rows(r0, r1)
        with torch._C.DisableTorchFunctionSubclass():
            out = torch.empty(r1 - r0, c1 - c0, dtype=self.dtype)
        step = max(1, ROW_BATCH_BYTES // max(1, cols * self.element_size()))
        for a in range(r0, r1, step):
            b = min(r1, a + step)
            out[a - r0 : b - r0] = self.rows(a, b)[:, c0:c1]
        return out

    def materialize(self) -> torch.Tensor:
        """The whole tensor, decoded (CPU, bit-exact), in this LazyWeight's shape."""
        t = self.uw_checkpoint.get_tensor(self.uw_name)
        return t.reshape(self.shape) if self.uw_lead else t

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"LazyWeight({self.uw_name!r}, shape={list(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        lazy = args[0] if args and isinstance(args[0], LazyWeight) else None
        if lazy is not None and not kwargs:
            if func is torch.Tensor.narrow and not lazy.uw_lead:
                return lazy._narrow(*args[1:])
            if func is torch.Tensor.unsqueeze and args[1:] == (0,):
                return LazyWeight(lazy.uw_checkpoint, lazy.uw_name, lazy.uw_lead + 1)
            if func is torch.Tensor.unbind and args[1:] in ((), (0,)) and lazy.uw_lead:
                return (LazyWeight(lazy.uw_checkpoint, lazy.uw_name, lazy.uw_lead - 1),)
        args, kwargs = torch.utils._pytree.tree_map(_dense, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        dim = dim + self.dim() if dim < 0 else dim
        start, length = int(start), int(length)
        if dim == 0:
            return self.rows(start, start + length)
        if dim == 1 and self.dim() == 2:
            return self.block(0, self.shape[0], start, start + length)
        with torch._C.DisableTorchFunctionSubclass():
            return self.materialize().narrow(dim, start, length)


def _dense(x):
    return x.materialize() if isinstance(x, LazyWeight) else x
