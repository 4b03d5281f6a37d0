"""`LazyWeight`: a checkpoint tensor handed to vLLM's weight loaders undecoded.

vLLM's model code routes each checkpoint tensor to a parameter's `weight_loader` (renaming q/k/v
into qkv_proj, gate/up into gate_up_proj, experts into their stacked parameters). A LazyWeight goes
through that routing as it is: a tensor subclass on the meta device with the original shape and
dtype, holding only (checkpoint, name). Then

- the plugin's own loaders (runtime/vllm/plugin.py) read `.uw_checkpoint` and `.uw_name` and decode only
  the rank's slice;
- any other loader gets real data on first use. `narrow` on dims 0 and 1 gives a narrower
  LazyWeight, still undecoded; its data is then decoded for that window only (rows: only what
  holds them, rans chunks or tiles rows, an embedding's vocabulary shard; columns: a few MiB of
  rows at a time). `copy_` into a parameter compares the shapes first, so a tensor that does not
  fit is refused before anything is decoded, and no decode may produce more than `limit` bytes.
  The whole tensor is decoded with the CRC-32 of its original bytes checked.
- `unsqueeze(0)` and then `unbind()` (dim 0), which vLLM's MoE expert loader applies to every
  expert tensor, decode nothing: they give a LazyWeight with a leading unit dimension, and back.
- A fused experts tensor (3-D, (E, H, 2I) or (E, I, H), as Llama 4 stores them) may be transposed
  in its last two dimensions and chunked or narrowed along its last stored one (gate from up), as
  vLLM's Llama 4 loader does, still undecoded; `expert` then decodes one expert's block of it,
  only the rows of the expert that hold the block (of gate_up, which `compress` codes transposed,
  only the rank's rows of gate and of up).

Shape, dtype and size queries never decode. This module needs torch, not vLLM.
"""

from __future__ import annotations

import torch

from unweight.reader import CompressedCheckpoint

ROW_BATCH_BYTES = 8 << 20  # rows decoded at a time by a block of some columns

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
    """Tensor `name` of `checkpoint` (or a window of its first two dimensions), decoded only when
    its data is used (see the module docstring). A decode of more than `limit` bytes is refused
    before it starts, naming the file and tensor: the loader sets it to what the model's largest
    parameter holds, so a tensor that declares more than any layer can take costs nothing."""

    uw_checkpoint: CompressedCheckpoint
    uw_name: str
    uw_lead: int  # leading unit dimensions before the tensor's own (unsqueeze(0)); 0 but in vLLM's MoE loader
    uw_rows: tuple[int, int]  # the window of dim 0 (the whole dimension unless narrowed)
    uw_cols: tuple[int, int] | None  # the window of the stored tensor's last dim (None: all of it)
    uw_t: bool  # a 3-D tensor's last two dims swapped (the stored tensor's (E, A, B) seen as (E, B, A))
    uw_limit: int | None  # the most bytes one decode may produce (None: no limit but the reader's)

    @staticmethod
    def __new__(
        cls,
        checkpoint: CompressedCheckpoint,
        name: str,
        lead: int = 0,
        *,
        rows: tuple[int, int] | None = None,
        cols: tuple[int, int] | None = None,
        limit: int | None = None,
        transposed: bool = False,
    ) -> LazyWeight:
        shape = list(checkpoint.entry(name).shape)
        rows = rows or (0, shape[0] if shape else 0)
        if shape:
            shape[0] = rows[1] - rows[0]
        if cols is not None:
            shape[-1] = cols[1] - cols[0]
        if transposed:
            shape[-2], shape[-1] = shape[-1], shape[-2]
        meta = torch.empty((1,) * lead + tuple(shape), dtype=checkpoint.torch_dtype(name), device="meta")
        t = torch.Tensor._make_subclass(cls, meta)
        t.uw_checkpoint, t.uw_name, t.uw_lead, t.uw_rows, t.uw_cols, t.uw_limit, t.uw_t = (
            checkpoint,
            name,
            lead,
            rows,
            cols,
            limit,
            transposed,
        )
        return t

    def _like(self, lead: int | None = None, rows=None, cols=None, transposed: bool | None = None) -> LazyWeight:
        return LazyWeight(
            self.uw_checkpoint,
            self.uw_name,
            self.uw_lead if lead is None else lead,
            rows=rows or self.uw_rows,
            cols=cols or self.uw_cols,
            limit=self.uw_limit,
            transposed=self.uw_t if transposed is None else transposed,
        )

    @property
    def _own_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[self.uw_lead :])

    def _allow(self, rows: int, cols_bytes: int | None = None, in_slab: bool = False, transposed: bool = False) -> None:
        """Refuse, before decoding, a decode of `rows` rows (of one slab's, `in_slab`; of a slab's
        matrix transposed, `transposed`; kept whole, or `cols_bytes` of each) that allocates more
        than uw_limit bytes."""
        own, ckpt = self._own_shape, self.uw_checkpoint
        nbytes = ckpt.rows_memory(self.uw_name, rows, in_slab, transposed)  # what the reader allocates
        if cols_bytes is not None:  # and what is kept of them
            nbytes = max(nbytes, rows * cols_bytes)
        if self.uw_limit is not None and nbytes > self.uw_limit:
            raise ValueError(
                f"{self.uw_checkpoint.file_of(self.uw_name)}: tensor {self.uw_name!r} declares shape "
                f"{list(self.uw_checkpoint.entry(self.uw_name).shape)}: decoding {list(own)} of it would take "
                f"{nbytes:,} bytes, more than the model's largest parameter holds ({self.uw_limit:,}); refused "
                f"before decoding (a wrong or hostile checkpoint)"
            )

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of this window's dim 0, all columns of the tensor, decoded (only what
        holds them, where the codec allows; the whole tensor with its CRC-32 checked, when that is
        what is asked for)."""
        r0 = self.uw_rows[0]
        self._allow(stop - start)
        if (start + r0, stop + r0) == (0, self.uw_checkpoint.entry(self.uw_name).shape[0]):
            # the streams' CRC-32s first: damage is named as damage, not as a decode error
            self.uw_checkpoint.streams(self.uw_name)
            return self.uw_checkpoint.get_tensor(self.uw_name)
        return self.uw_checkpoint.get_rows(self.uw_name, r0 + start, r0 + stop)

    def block(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """Rows [r0, r1) and columns [c0, c1) of this 2-D window, decoded a few MiB of rows at a time."""
        rows, cols = self._own_shape
        if not (0 <= r0 <= r1 <= rows and 0 <= c0 <= c1 <= cols):
            raise ValueError(
                f"block [{r0}:{r1}, {c0}:{c1}] lies outside tensor {self.uw_name!r} of shape {[rows, cols]}"
            )
        full = self.uw_checkpoint.entry(self.uw_name).shape[1]
        c0, c1 = (c0, c1) if self.uw_cols is None else (c0 + self.uw_cols[0], c1 + self.uw_cols[0])
        if (c0, c1) == (0, full):
            return self.rows(r0, r1)
        self._allow(r1 - r0, (c1 - c0) * self.element_size())
        with torch._C.DisableTorchFunctionSubclass():
            out = torch.empty(r1 - r0, c1 - c0, dtype=self.dtype)
        step = max(1, ROW_BATCH_BYTES // max(1, full * self.element_size()))
        for a in range(r0, r1, step):
            b = min(r1, a + step)
            out[a - r0 : b - r0] = self.rows(a, b)[:, c0:c1]
        return out

    def expert(self, index: int, rows: list[tuple[int, int]], c0: int, c1: int) -> torch.Tensor:
        """Row ranges `rows` (stacked) and columns [c0, c1) of matrix `index` of this 3-D window
        (an expert of a fused experts tensor), decoded from only that expert's stored rows that hold
        them. Decoded whole, expert after expert in order, the tensor's CRC-32 is checked."""
        if self.uw_lead or self.dim() != 3:
            raise ValueError(f"tensor {self.uw_name!r} of shape {list(self.shape)} is not a 3-D experts tensor")
        n, height, width = self.shape
        if not 0 <= index < n or not 0 <= c0 <= c1 <= width or any(not 0 <= a <= b <= height for a, b in rows):
            raise ValueError(
                f"rows {rows} and columns [{c0}:{c1}] of expert {index} lie outside tensor {self.uw_name!r} of shape "
                f"{list(self.shape)}"
            )
        slab, off = self.uw_rows[0] + index, 0 if self.uw_cols is None else self.uw_cols[0]
        get = self.uw_checkpoint.get_rows
        if self.uw_t:  # the view's rows are the stored matrix's columns: rows of it transposed
            self._allow(sum(b - a for a, b in rows), transposed=True)
            return torch.cat(
                [get(self.uw_name, off + a, off + b, slab=slab, transposed=True)[:, c0:c1] for a, b in rows]
            )
        self._allow(sum(b - a for a, b in rows), in_slab=True)
        return torch.cat([get(self.uw_name, a, b, slab=slab)[:, off + c0 : off + c1] for a, b in rows])

    def unchunked(self) -> LazyWeight:
        """This window with the stored tensor's last dimension whole again (the gate and up halves
        of a fused gate_up tensor, from either)."""
        return LazyWeight(
            self.uw_checkpoint,
            self.uw_name,
            self.uw_lead,
            rows=self.uw_rows,
            limit=self.uw_limit,
            transposed=self.uw_t,
        )

    def materialize(self) -> torch.Tensor:
        """This window of the tensor, decoded (CPU, bit-exact), in this LazyWeight's shape; the
        whole tensor is decoded with its CRC-32 checked."""
        own = self._own_shape
        if len(own) > 2 and (self.uw_cols is not None or self.uw_t):
            t = self.rows(0, own[0])  # the dim-0 window, whole, then its last dims' window
            if self.uw_cols is not None:
                t = t[..., self.uw_cols[0] : self.uw_cols[1]]
            t = t.transpose(-1, -2) if self.uw_t else t
        elif self.uw_cols is not None:
            t = self.block(0, own[0], 0, own[1])
        elif not own:  # a scalar
            self._allow(1)
            t = self.uw_checkpoint.get_tensor(self.uw_name)
        else:
            t = self.rows(0, own[0])
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
        if lazy is not None and not lazy.uw_lead and lazy.dim() == 3:  # a fused experts tensor
            if func is torch.Tensor.transpose and not kwargs and {d % 3 for d in args[1:]} == {1, 2}:
                return lazy._like(transposed=not lazy.uw_t)
            if func is torch.Tensor.chunk and len(args) + len(kwargs) <= 3:
                return lazy._chunk(*args[1:], **kwargs)
        if lazy is not None and not kwargs:
            if func is torch.Tensor.narrow and not lazy.uw_lead:
                return lazy._narrow(*args[1:])
            if func is torch.Tensor.unsqueeze and args[1:] == (0,):
                return lazy._like(lead=lazy.uw_lead + 1)
            if func is torch.Tensor.unbind and args[1:] in ((), (0,)) and lazy.uw_lead:
                return (lazy._like(lead=lazy.uw_lead - 1),)
        if func is torch.Tensor.copy_ and len(args) == 2 and isinstance(args[1], LazyWeight):
            dst, src = args
            if not _fits(src.shape, dst.shape):  # checked before a byte is decoded
                raise ValueError(
                    f"{src.uw_checkpoint.file_of(src.uw_name)}: tensor {src.uw_name!r} of shape {list(src.shape)} "
                    f"cannot load into a parameter of shape {list(dst.shape)}"
                )
        args, kwargs = torch.utils._pytree.tree_map(_dense, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _chunk(self, chunks: int, dim: int = 0) -> tuple[torch.Tensor, ...]:
        """torch.chunk of this tensor, as narrow windows (undecoded where _narrow keeps them so)."""
        size = self.shape[dim]
        step = -(-size // chunks)
        return tuple(self._narrow(dim, s, min(step, size - s)) for s in range(0, size, step))

    def _narrow(self, dim: int, start: int, length: int) -> LazyWeight:
        """A narrower window, still undecoded: dim 0, and the stored tensor's last dim (dim 1 of a
        2-D tensor; of a 3-D one, dim 2, or dim 1 when transposed); materialized along any other."""
        dim = dim + self.dim() if dim < 0 else dim
        start, length = int(start), int(length)
        size = self.shape[dim]
        if not 0 <= start <= start + length <= size:
            raise IndexError(
                f"narrow({dim}, {start}, {length}) lies outside tensor {self.uw_name!r} of {list(self.shape)}"
            )
        if dim == 0:
            r0 = self.uw_rows[0]
            return self._like(rows=(r0 + start, r0 + start + length))
        stored = 3 - dim if self.uw_t else dim  # (uw_t: a 3-D tensor, dims 1 and 2 swapped)
        if stored == self.dim() - 1 and self.dim() in (2, 3):
            c0 = 0 if self.uw_cols is None else self.uw_cols[0]
            return self._like(cols=(c0 + start, c0 + start + length))
        with torch._C.DisableTorchFunctionSubclass():
            return self.materialize().narrow(dim, start, length)


def _fits(src: torch.Size, dst: torch.Size) -> bool:
    """Whether copy_ takes a `src` into a `dst` of these shapes: equal, or `src` broadcast to it (a
    scalar into a one-element parameter, as vLLM's scale loaders do)."""
    if src == dst:
        return True
    try:
        return torch.broadcast_shapes(src, dst) == dst
    except RuntimeError:
        return False


def _dense(x):
    return x.materialize() if isinstance(x, LazyWeight) else x
