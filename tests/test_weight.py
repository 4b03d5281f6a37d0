"""The compressed weight values (runtime/kernels/weight.py): each validates its streams once, when
made, with a ValueError naming what is wrong; the transcoders between them are bit-exact; and a
layer's kernel table lists the pipelines of its weight's kind."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from helpers import random_bf16
from unweight.codec import tiles
from unweight.runtime.kernels import qtiles
from unweight.runtime.kernels.transcode import qtiles_to_tiles, tiles_to_qtiles
from unweight.runtime.kernels.weight import QTilesWeight, TilesWeight
from unweight.runtime.layers.linear import PIPELINES, UnweightLinear


def bits(w: torch.Tensor) -> np.ndarray:
    return w.view(torch.int16).numpy().view(np.uint16).ravel()


def test_tiles_weight_checks_its_streams():
    w = random_bf16(24, 80, seed=1)
    p, streams = tiles.encode(bits(w), 24, 80, 16)
    value = TilesWeight.from_numpy(streams, p, 24, 80)
    assert value.shape == (24, 80) and value.device.type == "cpu" and value.params == p
    assert value.stored_bytes == sum(t.numel() * t.element_size() for t in value.streams().values())
    assert list(value.streams()) == list(TilesWeight.ROLES)
    s = value.streams()
    with pytest.raises(ValueError, match="'sm' holds 1919 entries"):
        value.with_streams({"sm": s["sm"][:-1]})
    with pytest.raises(ValueError, match="'esc_index' must be torch.int64"):
        value.with_streams({"esc_index": s["esc_index"].int()})
    with pytest.raises(ValueError, match="block 12"):
        TilesWeight(**s, rows=24, cols=80, base=p.base, block=12)
    with pytest.raises(ValueError, match="rows -1"):
        TilesWeight(**s, rows=-1, cols=80, base=p.base, block=16)
    assert value.with_streams(s) is not value  # a new value: caches keyed by the old one are not reused


def test_qtiles_weight_checks_its_streams():
    w = random_bf16(6, 70, seed=2)
    q = qtiles.encode(bits(w), 6, 70)
    value = QTilesWeight.from_streams(q, 6, 70)
    assert value.mode == int(q["mode"][0]) and list(value.streams()) == list(QTilesWeight.ROLES)
    with pytest.raises(ValueError, match="a 6-row matrix of 96 stored columns, not \\(6, 200\\)"):
        QTilesWeight.from_streams(q, 6, 200)
    with pytest.raises(ValueError, match="mode must be 0 or 1"):
        QTilesWeight.from_streams(q, 6, 70, mode=2)
    with pytest.raises(ValueError, match="'esc_row' must be torch.int32"):
        value.with_streams({"esc_row": value.esc_row.long()})
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="share a device"):
            value.with_streams({"sm": value.sm.cuda()})


def test_transcoding_between_the_kinds_is_bit_exact():
    w = random_bf16(40, 96, seed=3)
    w.view(torch.int16).view(-1)[::7] = 0x0001
    p, streams = tiles.encode(bits(w), 40, 96, 32)
    value = TilesWeight.from_numpy(streams, p, 40, 96)
    q = tiles_to_qtiles(value)
    host = {k: t.numpy() for k, t in q.streams().items()} | {"mode": np.array([q.mode], np.uint8)}
    assert np.array_equal(qtiles.decode_reference(host, 40, 96).ravel(), bits(w))
    back = qtiles_to_tiles(q, 32)
    assert back.block == 32 and all(
        torch.equal(a, b) for a, b in zip(back.streams().values(), value.streams().values())
    )


def test_a_layer_lists_the_pipelines_of_its_weights_kind():
    lin = UnweightLinear.from_weight(random_bf16(8, 64, seed=4))
    assert lin._pipelines(1, torch.device("cpu")) == PIPELINES == ("decode_matmul", "fused")
    assert lin._pipelines(1, torch.device("cuda")) == ()  # a tiles weight has no CUDA rows
    lin._cpu_gemv()  # a plan over the streams' addresses, where the x86 kernels take them
    assert lin._plan_key is lin.compressed_weight
    twin = copy.deepcopy(lin)
    assert twin.compressed_weight is not lin.compressed_weight and twin._plan is twin._plan_key is None
    assert twin.compressed_weight.sm is twin._buffers["sm"]  # the value and the buffers stay one set of tensors
