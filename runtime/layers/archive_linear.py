"""`ArchiveLinear`: a linear layer over archive-layout streams (any codec: rans, zstd or raw), the
smallest resident size, W decoded on the CPU at every forward into the thread's workspace. It is
for memory-starved runs, not for speed (UnweightLinear is the serving layer)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import workspace
from .inputs import check_parts, check_row_ids, compute_input


class ArchiveLinear(nn.Module):
    """y = x @ W^T + b with W kept in its archive-layout streams (rans, zstd or raw) on the CPU.

    W may be several checkpoint tensors stacked by rows (parts). Every forward decodes W on the
    CPU threads (numba) into a workspace shared by all layers on the thread (`workspace.Workspace`), then
    multiplies on the input's device (on the CPU in fp32, converting W a block of rows at a time).
    Resident memory is the archive size plus that workspace, the size of the largest W decoded.
    `rows(ids)` decodes only the rans chunks that hold those rows."""

    def __init__(self, parts: list[tuple], bias: torch.Tensor | None = None, threads: int | None = None):
        super().__init__()
        from unweight.codec.tensor_codec import check_entry

        self.in_features = check_parts([e for e, _ in parts])
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
    def _weight_bytes(self) -> int:  # W in BF16: every part is 2-D BF16 (check_parts)
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
        check_row_ids(ids, self.out_features)
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
        x = compute_input(x, x.device, lambda m: None)
        nbytes = self._weight_bytes
        # W is consumed before returning, unless autograd keeps it for a backward pass: then it gets
        # its own memory, and the product is a plain F.linear (the blocked one writes with out=)
        keeps_w = torch.is_grad_enabled() and x.requires_grad
        w = self._decode_into(np.empty(nbytes, dtype=np.uint8) if keeps_w else workspace.WORKSPACE.take(nbytes))
        if x.device.type == "cpu" and x.dtype != torch.bfloat16 and not keeps_w:
            y = workspace.linear_in_row_blocks(x, w)
        else:
            y = F.linear(x, w.to(device=x.device, dtype=x.dtype))
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        codecs = ",".join(sorted({e.codec for e in self.entries}))
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, layout=archive ({codecs}), "
            f"stored_bytes={self.stored_bytes}"
        )
