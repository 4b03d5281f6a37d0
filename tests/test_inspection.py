"""unweight.inspect against a plain reference: the statistics recomputed from the original bytes
with np.bincount, one file at a time and with worker processes, and a damaged shard's error."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import unweight
from helpers import random_bf16, write_checkpoint
from unweight import inspection
from unweight.errors import CorruptDataError
from unweight.formats import SafetensorsFile
from unweight.inspection import EXPONENT_FIELDS, entropy_bits


def reference(dtype: str, data: bytes) -> tuple[float | None, list[int] | None, float | None]:
    """(exponent entropy, exponent histogram, order-0 bound) by bincount over the whole tensor."""
    size = {"U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "BF16": 2, "F16": 2, "I16": 2, "F32": 4}[dtype]
    words = np.frombuffer(data, dtype={1: np.uint8, 2: np.uint16, 4: np.uint32}[size])
    exp = hist = None
    if dtype in EXPONENT_FIELDS:
        _, shift, mask = EXPONENT_FIELDS[dtype]
        counts = np.bincount((words >> shift) & mask, minlength=mask + 1)
        exp, hist = entropy_bits(counts), counts.tolist()
    bound = entropy_bits(np.bincount(words)) if size <= 2 else None
    return exp, hist, bound


def checkpoint(tmp_path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "bf16": random_bf16(96, 80, seed=2),
        "bf16_small": random_bf16(3, 5, seed=3),
        "f16": (torch.randn(64, 33, generator=g) * 0.1).half(),
        "f32": torch.randn(40, 7, generator=g),
        "u8": torch.randint(0, 256, (300,), generator=g, dtype=torch.uint8),
        "i8": torch.randint(-128, 128, (17, 9), generator=g, dtype=torch.int8),
        "i16": torch.randint(-300, 300, (50, 4), generator=g, dtype=torch.int16),
        "f8": (torch.randn(64, 16, generator=g)).to(torch.float8_e4m3fn),
        "zeros": torch.zeros(8, 8, dtype=torch.bfloat16),
    }


@pytest.mark.parametrize("layout", ["archive", "serving"])
def test_statistics_match_a_bincount_of_the_original_bytes(tmp_path, layout):
    tensors = checkpoint(tmp_path)
    src = write_checkpoint(tmp_path / "src" / "model.safetensors", tensors)
    out = tmp_path / "uw"
    unweight.compress(src.parent, out, layout=layout, threads=1)
    got = {s.name: s for s in unweight.inspect(out, threads=2)}
    assert set(got) == set(tensors)
    with SafetensorsFile(src) as sf:
        for name, info in sf.tensors.items():
            s = got[name]
            data = sf.bytes_of(name).tobytes()
            exp, hist, bound = reference(info.dtype, data)
            assert (s.dtype, s.original_bytes) == (info.dtype, len(data)), name
            assert (
                s.exponent_entropy == pytest.approx(exp, abs=1e-12) if exp is not None else s.exponent_entropy is None
            )
            assert (None if s.exponent_histogram is None else s.exponent_histogram.tolist()) == hist, name
            assert s.order0_bound == pytest.approx(bound, abs=1e-12) if bound is not None else s.order0_bound is None
    assert got["zeros"].order0_bound == 0.0 and got["zeros"].exponent_entropy == 0.0


def shards(tmp_path, n: int = 3):
    """A folder of n containers with their index, 12 tensors each."""
    src = tmp_path / "src"
    weight_map = {}
    for k in range(n):
        file = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        names = {
            f"model.layers.{k}.mlp.experts.{e}.up_proj.weight": random_bf16(8, 16, seed=k * 100 + e) for e in range(12)
        }
        write_checkpoint(src / file, names)
        weight_map |= dict.fromkeys(names, file)
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    out = tmp_path / "uw"
    unweight.compress(src, out, threads=1)
    return out


def test_worker_processes_give_what_one_process_gives(tmp_path, monkeypatch):
    out = shards(tmp_path)
    alone = [s.to_json(histogram=True) for s in unweight.inspect(out, threads=1)]
    monkeypatch.setattr(inspection, "PARALLEL_HEADER_BYTES", 0)  # three small files go to workers too
    assert [s.to_json(histogram=True) for s in unweight.inspect(out, threads=2, processes=2)] == alone
    assert [
        s.to_json(histogram=True) for s in unweight.inspect(out, threads=2, max_memory=4 << 20, processes=2)
    ] == alone


def test_a_damaged_shard_read_by_a_worker_is_named(tmp_path, monkeypatch):
    out = shards(tmp_path)
    shard = out / "model-00002-of-00003.safetensors"
    with SafetensorsFile(shard) as sf:
        name = next(n for n in sf.tensors if n.endswith("#words"))
        offset = sf.data_start + sf.tensors[name].begin
    raw = bytearray(shard.read_bytes())
    raw[offset : offset + 16] = bytes(16)
    shard.write_bytes(raw)
    monkeypatch.setattr(inspection, "PARALLEL_HEADER_BYTES", 0)
    with pytest.raises(CorruptDataError) as e:
        unweight.inspect(out, threads=2, processes=2)
    assert e.value.path == str(shard) and e.value.tensor == name.split("#")[0], e.value
