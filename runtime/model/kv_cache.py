"""The paged KV cache a model owns, and the per-sequence handle into it.

Layout (docs/runtime.md, "The KV cache"): two tensors, keys and values, each
    (layers, blocks, block_size, kv_heads, head_dim)
in the model's compute dtype. A sequence owns a list of blocks (its block table); token t of the
sequence lives in block table[t // block_size], row t % block_size, in every layer. Blocks are
handed out from a free list and given back when a sequence is freed, so many sequences of
different lengths share one pool without fragmentation. The pool starts small and doubles when it
runs out, up to `max_blocks` (then `CacheFullError`).

For disaggregated serving a sequence's cache leaves as one contiguous tensor
(`export`: (layers, 2, tokens, kv_heads, head_dim)) and enters another process's pool with
`import_`, which allocates fresh blocks there: block ids never cross process boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layers.transfer import to_device

DEFAULT_BLOCK_SIZE = 16


class CacheFullError(RuntimeError):
    """The KV cache has no room for another block."""


@dataclass(slots=True)
class SeqCache:
    """One sequence's block table and length (tokens whose K/V are stored)."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0
    _block_ids: torch.Tensor | None = None  # blocks as a tensor, rebuilt when the table changes


class KVCache:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_blocks: int = 1 << 16,
        initial_blocks: int = 16,
    ):
        if block_size <= 0 or max_blocks <= 0:
            raise ValueError(f"block_size {block_size} and max_blocks {max_blocks} must be positive")
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.block_size, self.max_blocks = block_size, max_blocks
        n = min(initial_blocks, max_blocks)
        shape = (layers, n, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(n - 1, -1, -1))

    # -- capacity ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.k.element_size()

    def _grow(self, need: int) -> None:
        old = self.num_blocks
        new = min(self.max_blocks, max(2 * old, old + need))
        if new - old < need:
            raise CacheFullError(
                f"KV cache full: {self.used_blocks} of {self.max_blocks} blocks of {self.block_size} tokens in use"
            )
        pad = (self.layers, new - old, self.block_size, self.kv_heads, self.head_dim)
        with torch.inference_mode(
            False
        ):  # normal tensors, whatever mode grew them: later in-place writes may run in either
            self.k = torch.cat((self.k, self.k.new_zeros(pad)), dim=1)
            self.v = torch.cat((self.v, self.v.new_zeros(pad)), dim=1)
        self._free = list(range(new - 1, old - 1, -1)) + self._free

    # -- sequences --------------------------------------------------------------------------
    def reserve(self, seq: SeqCache, tokens: int) -> None:
        """Make room for `tokens` more tokens of seq (all or nothing)."""
        need = -(-(seq.length + tokens) // self.block_size) - len(seq.blocks)
        if need <= 0:
            return
        if need > len(self._free):
            self._grow(need - len(self._free))
        seq.blocks.extend(self._free.pop() for _ in range(need))
        seq._block_ids = None

    def free(self, seq: SeqCache) -> None:
        """Give the sequence's blocks back; the handle is empty afterwards."""
        self._free.extend(reversed(seq.blocks))
        seq.blocks.clear()
        seq.length = 0
        seq._block_ids = None

    def _ids(self, seq: SeqCache) -> torch.Tensor:
        if seq._block_ids is None:
            seq._block_ids = to_device(torch.tensor(seq.blocks, dtype=torch.int64), self.k.device)
        return seq._block_ids

    def slots(self, segments: list[tuple[SeqCache, int]]) -> torch.Tensor:
        """Where the new tokens go: for each (seq, count), rows seq.length.. of seq (room reserved),
        as flat slots of a layer (block * block_size + row), made on the host once per step."""
        bs = self.block_size
        flat = [
            seq.blocks[p // bs] * bs + p % bs for seq, count in segments for p in range(seq.length, seq.length + count)
        ]
        return to_device(torch.tensor(flat, dtype=torch.int64), self.k.device)

    def tables(self, seqs: list[SeqCache]) -> torch.Tensor:
        """The sequences' block tables as one (len(seqs), widest) int64 tensor on the host, short
        rows padded with block 0 (never read: a reader stops at the sequence's length)."""
        width = max(len(s.blocks) for s in seqs)
        return torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s in seqs], dtype=torch.int64)

    def write_slots(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (tokens, kv_heads, head_dim) at `slots` (from slots()) of one layer."""
        flat = (-1, self.kv_heads, self.head_dim)
        self.k[layer].view(flat).index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer].view(flat).index_copy_(0, slots, v.to(self.v.dtype))

    def write(self, layer: int, seq: SeqCache, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (tokens, kv_heads, head_dim) at positions start.. of seq (room reserved)."""
        pos = torch.arange(start, start + k.shape[0], device=self.k.device)
        self.write_slots(layer, self._ids(seq)[pos // self.block_size] * self.block_size + pos % self.block_size, k, v)

    def read(self, layer: int, seq: SeqCache, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0..length-1 of seq, each (length, kv_heads, head_dim)."""
        nb = -(-length // self.block_size)
        ids = self._ids(seq)[:nb]
        flat = (-1, self.kv_heads, self.head_dim)
        return self.k[layer].index_select(0, ids).view(flat)[:length], self.v[layer].index_select(0, ids).view(flat)[
            :length
        ]

    # -- hand-off between processes ---------------------------------------------------------
    def export(self, seq: SeqCache) -> torch.Tensor:
        """The sequence's cache as one contiguous tensor (layers, 2, length, kv_heads, head_dim)."""
        return torch.stack([self.export_layer(seq, layer, seq.length) for layer in range(self.layers)])

    def export_layer(self, seq: SeqCache, layer: int, length: int) -> torch.Tensor:
        """One layer of the sequence's first `length` positions as a new tensor (2, length, kv_heads,
        head_dim): what a hand-off sends as soon as a prefill is past that layer."""
        return torch.stack(self.read(layer, seq, length))

    def import_(self, data: torch.Tensor) -> SeqCache:
        """A new sequence holding `data` as export() made it (possibly in another process)."""
        want = (self.layers, 2)
        if data.dim() != 5 or tuple(data.shape[:2]) != want or tuple(data.shape[3:]) != (self.kv_heads, self.head_dim):
            raise ValueError(
                f"KV data of shape {list(data.shape)} does not fit this cache ({self.layers}, 2, tokens, "
                f"{self.kv_heads}, {self.head_dim})"
            )
        seq = SeqCache()
        data = data.to(self.k.device)  # it travels through host memory between processes
        length = data.shape[2]
        self.reserve(seq, length)
        for layer in range(self.layers):
            self.write(layer, seq, 0, data[layer, 0], data[layer, 1])
        seq.length = length
        return seq
