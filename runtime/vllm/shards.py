"""Which part of a checkpoint tensor a tensor-parallel rank's linear layer holds.

vLLM splits a column-parallel layer's output rows across ranks (merged q/k/v and gate/up per
logical shard, k and v replicated when there are fewer kv heads than ranks) and a row-parallel
layer's input columns. `plan` gives, for one checkpoint tensor loaded into one layer, the rows of
the layer's rank-local weight it fills and the rows and columns of the tensor it takes, from the
layer's own attributes, so that only that block is ever decoded. It reads attributes, not
classes: the caller says which kind of layer it is (`kind`), which keeps this file free of vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Block:
    """Rows [dst0, dst0 + rows) of the rank's weight come from rows [src0, src0 + rows) and columns
    [col0, col0 + cols) of the checkpoint tensor."""

    dst0: int
    src0: int
    rows: int
    col0: int
    cols: int


KINDS = ("qkv", "merged", "column", "row", "replicated")


def plan(kind: str, layer, shard_id, shape: tuple[int, ...], name: str) -> Block:
    """The Block that checkpoint tensor `name` of `shape` gives the rank's weight of `layer`, a
    vLLM linear layer of `kind` (KINDS) loaded with shard id `shard_id`. Raises ValueError naming
    the tensor when the tensor does not fit the layer."""
    if len(shape) != 2:
        raise ValueError(f"tensor {name!r} of shape {list(shape)} is not a 2-D linear weight")
    want = full_shape(kind, layer, shard_id, name)
    if tuple(shape) != want:  # as vLLM refuses a BF16 tensor that does not fit: nothing is cropped or left unset
        raise ValueError(
            f"tensor {name!r} has shape {list(shape)}, but layer {getattr(layer, 'prefix', '') or '?'!r} needs "
            f"{list(want)} there"
        )
    rank = layer.tp_rank
    in_part = getattr(layer, "input_size_per_partition", layer.input_size)
    if kind == "row":
        block = Block(0, 0, shape[0], rank * in_part, in_part)
    elif kind == "qkv":
        heads, kv_heads, head, v_head = layer.num_heads, layer.num_kv_heads, layer.head_size, layer.v_head_size
        kv_rank = rank // layer.num_kv_head_replicas
        offsets = {
            "q": (0, heads * head, rank),
            "k": (heads * head, kv_heads * head, kv_rank),
            "v": ((heads + kv_heads) * head, kv_heads * v_head, kv_rank),
        }
        dst0, rows, shard_rank = offsets[shard_id]
        block = Block(dst0, shard_rank * rows, rows, 0, in_part)
    elif kind == "merged":
        sizes = [s // layer.tp_size for s in layer.output_sizes]
        block = Block(sum(sizes[:shard_id]), rank * sizes[shard_id], sizes[shard_id], 0, in_part)
    elif kind == "column":
        rows = layer.output_size_per_partition
        block = Block(0, rank * rows, rows, 0, in_part)
    else:  # replicated (full_shape has refused any other kind, and shard ids the kind has not)
        block = Block(0, 0, layer.output_size, 0, layer.input_size)
    if block.src0 + block.rows > shape[0] or block.col0 + block.cols > shape[1]:
        raise ValueError(
            f"tensor {name!r} of shape {list(shape)} does not hold rows [{block.src0}, {block.src0 + block.rows}) and "
            f"columns [{block.col0}, {block.col0 + block.cols}) that tensor-parallel rank {rank} of {layer.tp_size} "
            f"needs"
        )
    return block


def full_shape(kind: str, layer, shard_id, name: str) -> tuple[int, int]:
    """The shape the whole checkpoint tensor loaded with `shard_id` into `layer` must have (before
    any tensor-parallel split): what the layer was built for, from its own attributes."""
    if kind == "qkv":
        rows = {
            "q": layer.total_num_heads * layer.head_size,
            "k": layer.total_num_kv_heads * layer.head_size,
            "v": layer.total_num_kv_heads * layer.v_head_size,
        }
        if shard_id not in rows:
            raise ValueError(f"tensor {name!r}: shard id {shard_id!r} of a qkv layer is not q, k or v")
        return rows[shard_id], layer.input_size
    if kind == "merged":
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(layer.output_sizes):
            raise ValueError(
                f"tensor {name!r}: shard id {shard_id!r} of a merged layer is not in 0..{len(layer.output_sizes) - 1}"
            )
        return layer.output_sizes[shard_id], layer.input_size
    if kind in KINDS:
        return layer.output_size, layer.input_size
    raise ValueError(f"unknown linear kind {kind!r}")


def shard_ids(kind: str, layer) -> frozenset:
    """The shard ids whose tensors together fill a layer's rank-local weight."""
    if kind == "qkv":
        return frozenset("qkv")
    if kind == "merged":
        return frozenset(range(len(layer.output_sizes)))
    return frozenset([None])
