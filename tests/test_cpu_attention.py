"""The CPU decode attention (runtime/kernels/cpu_attention.py) against its oracle, torch's
scaled_dot_product_attention over the gathered blocks (graph_step.paged_attention): every cache
dtype it reads, grouped query heads, block boundaries, sliding windows, scattered block tables."""

from __future__ import annotations

import pytest
import torch

from unweight.runtime.kernels.cpu_attention import paged_decode_attention_cpu
from unweight.runtime.model.graph_step import paged_attention


def _case(heads, kv_heads, lengths, dtype, block_size=16, head_dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lengths)
    blocks = len(lengths) * width + 3
    k = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(len(lengths), heads, head_dim, generator=g)
    tables = torch.randperm(blocks, generator=g)[: len(lengths) * width].view(len(lengths), width)  # scattered
    return q, k, v, tables, torch.tensor(lengths, dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("window", [None, 5, 40])
def test_paged_decode_attention_is_torchs_over_the_gathered_blocks(dtype, heads, kv_heads, window):
    """Lengths of one position, a whole block, one past it and a long row, in one batch; a BF16
    cache is widened exactly, so both dtypes are held to the same fp32 tolerance."""
    lengths = [1, 16, 17, 300, 45]
    q, k, v, tables, n = _case(heads, kv_heads, lengths, dtype)
    want = paged_attention(q, k.float(), v.float(), tables, n, n - 1, window)
    got = paged_decode_attention_cpu(q, k, v, tables, n, window)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("window", [None, 40])
def test_a_row_attended_in_parts_is_torchs(dtype, parts, window):
    """Each (sequence, KV head) split into parts of its blocks, each with its own maximum and sum,
    then combined: uneven parts, parts past a short row's end (which hold nothing), a window."""
    lengths = [300, 1, 45, 17]
    q, k, v, tables, n = _case(9, 3, lengths, dtype)
    want = paged_attention(q, k.float(), v.float(), tables, n, n - 1, window)
    got = paged_decode_attention_cpu(q, k, v, tables, n, window, parts=parts)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("parts", [1, 3])
def test_a_nan_key_spreads_to_its_heads_in_parts_as_whole(parts):
    """A NaN in one key makes its KV head's outputs NaN, as torch's attention does, however the row
    is split; the other heads stay finite."""
    q, k, v, tables, n = _case(9, 3, [300], torch.float32)
    k[tables[0, 2], 5, 1, 7] = float("nan")  # position 37, KV head 1
    want = paged_attention(q, k, v, tables, n, n - 1, None)
    got = paged_decode_attention_cpu(q, k, v, tables, n, parts=parts)
    assert torch.equal(got.isnan(), want.isnan()) and want[0, 3:6].isnan().all() and not want[0, :3].isnan().any()
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=0, atol=2e-6)


def test_parts_give_each_thread_two_tasks_and_none_a_short_one():
    """One sequence of 3 KV heads on 2 threads: 2 parts a head; 4 threads: 3; never past MAX_SPLITS,
    and no part under MIN_SPLIT_BLOCKS blocks (a short row stays whole)."""
    from unweight.runtime.kernels.cpu_attention import MAX_SPLITS, MIN_SPLIT_BLOCKS, _splits

    one = torch.tensor([300]).numpy()  # 19 blocks of 16
    assert [_splits(one, 0, 16, 3, threads) for threads in (1, 2, 4, 64)] == [1, 2, 3, MAX_SPLITS]
    assert _splits(torch.tensor([16 * (2 * MIN_SPLIT_BLOCKS - 1)]).numpy(), 0, 16, 1, 64) == 1  # 7 blocks
    assert _splits(one, 32, 16, 3, 2) == 1  # a window of 32 positions: 3 blocks at most
    assert _splits(torch.tensor([300, 300, 300]).numpy(), 0, 16, 3, 2) == 1  # 9 tasks already


def test_a_bfloat16_query_comes_back_in_bfloat16_rounded_once():
    q, k, v, tables, n = _case(9, 3, [33, 7], torch.bfloat16)
    qb = q.to(torch.bfloat16)
    got = paged_decode_attention_cpu(qb, k, v, tables, n)
    exact = paged_decode_attention_cpu(qb.float(), k, v, tables, n)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), exact.to(torch.bfloat16).view(torch.int16))


def test_an_empty_batch_and_refused_caches():
    q, k, v, tables, n = _case(4, 2, [5], torch.float32)
    assert paged_decode_attention_cpu(q[:0], k, v, tables[:0], n[:0]).shape == (0, 4, 64)
    with pytest.raises(ValueError, match="fp32 or BF16 cache, not torch.float16"):
        paged_decode_attention_cpu(q, k.half(), v.half(), tables, n)
    with pytest.raises(ValueError, match="4 query heads of 64 do not share a cache of \\(3, 64\\)"):
        paged_decode_attention_cpu(q, *_case(3, 3, [5], torch.float32)[1:3], tables, n)
    with pytest.raises(ValueError, match="lengths must lie in \\[1, 16\\]"):
        paged_decode_attention_cpu(q, k, v, tables, n + 12)
    with pytest.raises(ValueError, match="block ids must lie in \\[0, 4\\)"):
        paged_decode_attention_cpu(q, k, v, tables + 4, n)
