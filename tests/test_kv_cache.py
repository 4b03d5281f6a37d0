"""The paged KV cache on its own: block tables, growth, limits, export/import."""

from __future__ import annotations

import pytest
import torch

from unweight.runtime.model.kv_cache import CacheFullError, KVCache, SeqCache


def cache(**kw) -> KVCache:
    return KVCache(layers=2, kv_heads=1, head_dim=4, dtype=torch.float32, block_size=4, **kw)


def fill(c: KVCache, seq: SeqCache, n: int, start: float = 0.0) -> torch.Tensor:
    """Write n tokens whose K = V = position-derived values into every layer."""
    c.reserve(seq, n)
    kv = torch.arange(n * 4, dtype=torch.float32).reshape(n, 1, 4) + start
    for layer in range(c.layers):
        c.write(layer, seq, seq.length, kv + layer, -(kv + layer))
    seq.length += n
    return kv


def test_sequences_share_the_pool_and_read_back_in_order():
    c = cache(initial_blocks=2)
    a, b = SeqCache(), SeqCache()
    ka = fill(c, a, 6)
    kb = fill(c, b, 3, start=100)
    ka2 = fill(c, a, 5, start=1000)  # a grows past its blocks, interleaved with b's
    k, v = c.read(1, a, a.length)
    assert torch.equal(k, torch.cat((ka, ka2)) + 1) and torch.equal(v, -k)
    assert torch.equal(c.read(0, b, 3)[0], kb)
    assert c.num_blocks >= 4 and c.used_blocks == len(a.blocks) + len(b.blocks) == 3 + 1


def test_free_gives_blocks_back_and_the_limit_holds():
    c = cache(initial_blocks=1, max_blocks=3)
    a = SeqCache()
    fill(c, a, 12)
    with pytest.raises(CacheFullError, match="3 of 3 blocks"):
        c.reserve(SeqCache(), 1)
    c.free(a)
    assert a.blocks == [] and a.length == 0 and c.used_blocks == 0
    fill(c, SeqCache(), 12)  # the freed blocks serve again


def test_export_import_round_trip():
    src, dst = cache(), cache()
    s = SeqCache()
    fill(src, s, 7)
    data = src.export(s)
    assert data.shape == (2, 2, 7, 1, 4)
    t = dst.import_(data)
    assert t.length == 7 and torch.equal(dst.export(t), data)
    with pytest.raises(ValueError, match="does not fit"):
        dst.import_(torch.zeros(3, 2, 7, 1, 4))


def test_a_pool_grown_in_inference_mode_still_takes_writes_outside_it():
    """The decode worker grows the pool inside a decode step (inference mode) and imports caches
    between steps (outside it): growth must not turn the pool into inference tensors."""
    c = cache(initial_blocks=2)
    with torch.inference_mode():
        c.reserve(SeqCache(), 12)
    t = c.import_(torch.ones(2, 2, 3, 1, 4))
    assert t.length == 3
