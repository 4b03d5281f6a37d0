"""The transcoders between the weight kinds (weight.py), and the encoder of BF16 values into the
kind a device reads: the stored `tiles` layout on the CPU, the resident `qtiles` layout on CUDA.

Every conversion is bit-exact (the tests decode both sides). They run on the host, in numpy and
numba: a layer moving between the CPU and a GPU transcodes once, at the move, never per forward.
"""

from __future__ import annotations

import numpy as np
import torch

from unweight.codec import tiles

from . import qtiles
from .weight import QTilesWeight, TilesWeight


def reads_qtiles(device: torch.device | str | None) -> bool:
    """Whether a weight on `device` is held as qtiles (CUDA) rather than tiles (anywhere else)."""
    return device is not None and torch.device(device).type == "cuda"


def encode_weight(
    values: np.ndarray, rows: int, cols: int, device: torch.device | str | None = None
) -> TilesWeight | QTilesWeight:
    """W as uint16 BF16 bits (rows * cols, C order), encoded once into the layout `device` reads,
    its streams on the CPU (a layer moves them with .to): for a GPU straight into qtiles, without
    the tiles encode and decode that moving a tiles weight there would run."""
    if not reads_qtiles(device):
        p, streams = tiles.encode(values, rows, cols)
        return TilesWeight.from_numpy(streams, p, rows, cols)
    return QTilesWeight.from_streams(qtiles.encode(values, rows, cols), rows, cols)


def tiles_to_qtiles(w: TilesWeight) -> QTilesWeight:
    """The same W in the qtiles layout, its streams on the CPU."""
    host = {role: t.cpu().numpy() for role, t in w.streams().items()}
    host["esc_index"] = host["esc_index"].astype("<u4").view(np.uint8)
    host["esc"] = host["esc"][: int(host["esc_index"].view("<u4")[-1])]  # (tile_tensors keeps one byte at least)
    q = qtiles.from_tiles(host, w.params.to_json(), w.rows, w.cols)
    return QTilesWeight.from_streams(q, w.rows, w.cols)


def qtiles_to_tiles(w: QTilesWeight, block: int = tiles.DEFAULT_BLOCK) -> TilesWeight:
    """The same W in the tiles layout with escape-index blocks of `block` columns, its streams in the
    CPU's stream arena."""
    host = {role: t.cpu().numpy() for role, t in w.streams().items()}
    values = qtiles.decode_reference({**host, "mode": np.array([w.mode], np.uint8)}, w.rows, w.cols).ravel()
    p, streams = tiles.encode(values, w.rows, w.cols, block)
    return TilesWeight.from_numpy(streams, p, w.rows, w.cols)
