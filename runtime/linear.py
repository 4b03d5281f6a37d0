"""`UnweightLinear`: a linear layer whose weight stays in the serving layout.

Resident memory is the compressed size: the module holds the `tiles` streams as buffers and never
keeps a decoded copy. Each forward picks a pipeline for (device, shape, batch bucket) through the
autotuner:

| pipeline | CPU | CUDA |
| --- | --- | --- |
| `decode_matmul` | numba decode to BF16, then F.linear | Triton decode to BF16, then F.linear (cuBLAS) |
| `fused` | numba GEMV that rebuilds each row in cache | Triton kernel that rebuilds tiles in registers |

Input that a kernel cannot take (a dtype other than BF16) is cast, with the reason logged once.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from unweight.codec import tiles

from .autotune import DEFAULT, Autotuner, batch_bucket, device_name
from .tile_tensors import tile_tensors

log = logging.getLogger(__name__)
PIPELINES = ("decode_matmul", "fused")
MAX_TRITON_BLOCK = 4096  # the decode kernel gives one program an escape block


class UnweightLinear(nn.Module):
    """y = x @ W^T + b with W (out_features, in_features) BF16 stored as `tiles` streams."""

    def __init__(self, in_features: int, out_features: int, streams: dict[str, np.ndarray], params: dict, bias: torch.Tensor | None = None, autotuner: Autotuner | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.params = tiles.TilesParams.from_json(params)
        tiles.check(streams, self.params, out_features, in_features)  # a corrupt tile set stops here
        for role, tensor in tile_tensors(streams).items():
            self.register_buffer(role, tensor)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.autotuner = autotuner or DEFAULT
        self._warned: set[str] = set()

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, **kw) -> "UnweightLinear":
        """Compress a dense (out, in) BF16 weight into a new layer."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            raise ValueError(f"weight must be a 2-D bfloat16 tensor, not {weight.dtype}{list(weight.shape)}")
        out_f, in_f = weight.shape
        values = weight.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16).ravel()
        p, streams = tiles.encode(values, out_f, in_f)
        return cls(in_f, out_f, streams, p.to_json(), bias, **kw)

    @classmethod
    def from_entry(cls, entry, streams: dict[str, np.ndarray], bias: torch.Tensor | None = None, threads: int | None = None, **kw) -> "UnweightLinear":
        """A layer from one tensor of a compressed checkpoint. Serving-layout tensors are checked
        and taken as they are; archive-layout ones (any codec) are transcoded at load time:
        decoded on the CPU, then re-encoded as tiles. Errors name the tensor."""
        from unweight.codec import decode_tensor
        from unweight.errors import CorruptDataError

        if not tiles.applies(entry.dtype, entry.shape):
            raise ValueError(f"tensor {entry.name!r}: a linear weight must be 2-D BF16, not {entry.dtype}{list(entry.shape)}")
        out_f, in_f = entry.shape
        try:
            if entry.codec == "tiles":
                return cls(in_f, out_f, streams, entry.params, bias, **kw)
            values = decode_tensor(entry, streams, threads).view(np.uint16)
        except CorruptDataError:
            raise
        except ValueError as e:
            raise CorruptDataError(None, str(e), entry.name) from None
        p, tile_streams = tiles.encode(values, out_f, in_f)
        return cls(in_f, out_f, tile_streams, p.to_json(), bias, **kw)

    @property
    def stored_bytes(self) -> int:
        """Resident bytes of the weight (the streams), as held on the module's device."""
        return sum(b.numel() * b.element_size() for b in (self.sm, self.codes, self.esc, self.esc_index))

    def _streams(self) -> dict[str, torch.Tensor]:
        return {"sm": self.sm, "codes": self.codes, "esc": self.esc, "esc_index": self.esc_index}

    def decoded_weight(self) -> torch.Tensor:
        """The BF16 weight, decoded now into a temporary tensor on the module's device."""
        block = self.params.block
        if self.sm.device.type == "cuda":
            if block & (block - 1) == 0 and block <= MAX_TRITON_BLOCK:
                from unweight.runtime.kernels.tiles_decode import tiles_decode

                return tiles_decode(self._streams(), self.params.to_json(), self.out_features, self.in_features)
            self._note(f"escape block {block} is not a power of two <= {MAX_TRITON_BLOCK}: decoding on the CPU instead of with Triton")
        flat = tiles.decode(self._host_streams(), self.params, self.out_features, self.in_features)
        weight = torch.from_numpy(flat.view(np.int16)).view(torch.bfloat16).reshape(self.out_features, self.in_features)
        return weight.to(self.sm.device)

    def _host_streams(self) -> dict[str, np.ndarray]:
        n_esc = int(self.esc_index[-1])
        return {
            "sm": self.sm.cpu().numpy(), "codes": self.codes.cpu().numpy(), "esc": self.esc.cpu().numpy()[:n_esc],
            "esc_index": self.esc_index.cpu().numpy().astype("<u4").view(np.uint8),
        }

    def _candidates(self, x: torch.Tensor) -> dict:
        if x.device.type == "cuda":
            from unweight.runtime.kernels.tiles_matmul import tiles_linear

            fused = lambda: tiles_linear(x, self._streams(), self.params.to_json(), self.out_features, self.in_features)  # noqa: E731
        else:
            from unweight.runtime.cpu_gemv import tiles_gemv_cpu

            fused = lambda: tiles_gemv_cpu(x, self._streams(), self.params.base, self.params.block, self.out_features, self.in_features).to(x.dtype)  # noqa: E731
        return {"decode_matmul": lambda: F.linear(x, self.decoded_weight()), "fused": fused}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            self._note(f"input is {x.dtype}; computing in bfloat16 as the weight is stored")
            x = x.to(torch.bfloat16)
        if x.device != self.sm.device:
            raise ValueError(f"input is on {x.device}, the layer on {self.sm.device}")
        m = x.numel() // self.in_features if self.in_features else 0
        key = f"{device_name(x.device)}|{self.out_features}x{self.in_features}|m{batch_bucket(m)}"
        candidates = self._candidates(x)
        name, y = self.autotuner.choose(key, candidates, x.device)
        if y is None:
            y = candidates[name]()
        return y + self.bias if self.bias is not None else y

    def _note(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.info("UnweightLinear(%d, %d): %s", self.in_features, self.out_features, message)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, layout=tiles, stored_bytes={self.stored_bytes}"
