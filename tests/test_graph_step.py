"""The decode step as one graph (runtime/model/graph_step.py) on the real SmolLM2, against the
per-sequence path: the batch's attention over device block tables, padded buckets, the linears as
custom ops; torch.compile builds it with no graph break, and on CUDA it is captured and replayed."""

from __future__ import annotations

import pytest
import torch

import unweight
from unweight.runtime.model.graph_step import BATCH_BUCKETS, GraphDecoder, bucket, paged_attention
from unweight.runtime.model.llama import _attend

PROMPTS = ([1, 2, 3], list(range(10, 40)), [5] * 17)  # one to three blocks of 16: rows of different widths


@pytest.fixture(scope="module")
def model(smollm2_uw):
    return unweight.load(smollm2_uw[0], dtype="float32")


def greedy(model, mode: str | None, steps: int = 6) -> list[torch.Tensor]:
    """Logits of `steps` batched greedy decode steps of the three prompts (one crosses a block);
    mode "keep": the model's decoder as it is."""
    if mode != "keep":
        model.set_decode_graph(mode)
    seqs = [model.new_sequence() for _ in PROMPTS]
    try:
        tokens = torch.stack([model.prefill(s, torch.tensor(p)).argmax() for s, p in zip(seqs, PROMPTS)])
        out = []
        for _ in range(steps):
            logits = model.decode_step(seqs, tokens)
            out.append(logits)
            tokens = logits.argmax(-1)
        return out
    finally:
        for s in seqs:
            model.free(s)
        model.set_decode_graph(None)


@pytest.mark.slow
def test_graph_step_gives_the_per_sequence_paths_tokens(model):
    """Batch 3 runs padded to 4; the rows' logits are the per-sequence path's within fp32 rounding
    (the attention sums run over padded keys whose weights are exactly zero), the tokens the same."""
    ref, got = greedy(model, None), greedy(model, "eager")
    for a, b in zip(ref, got):
        assert b.shape == a.shape == (3, model.config.vocab_size)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        assert torch.allclose(a, b, rtol=0, atol=1e-4 * a.abs().max().item())
    assert model.cache.used_blocks == 0  # every sequence's blocks, and the scratch block, given back


@pytest.mark.slow
def test_step_compiles_whole_and_decodes_like_the_eager_step(model):
    """torch.compile(step, fullgraph=True) traces the whole decode step, every layer, the paged
    attention, the K/V writes and the custom ops' fake kernels, with no graph break; the model's
    steps through it (compile mode; aot_eager: the same kernels, through AOT autograd's
    functionalisation) give the eager graph step's logits bit for bit, step after step, so the
    cache writes happened as well."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = greedy(model, "eager", 4)
    model.set_decode_graph(None)
    model.graph_decoder = GraphDecoder(model, "compile", backend="aot_eager")
    compiled = greedy(model, "keep", 4)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    for a, b in zip(eager, compiled):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_is_per_sequence_attention(window):
    """Against the per-sequence `_attend` over the same keys, gathered by hand: any lengths,
    block tables in any order, GQA, a sliding window."""
    g = torch.Generator().manual_seed(0)
    bs, kvh, h, hd, blocks = 4, 2, 6, 8, 12
    k_cache, v_cache = (torch.randn(blocks, bs, kvh, hd, generator=g) for _ in range(2))
    tables = torch.tensor([[7, 2, 9, 0], [3, 0, 0, 0], [11, 5, 1, 4]])
    lengths = torch.tensor([10, 2, 16])
    q = torch.randn(3, h, hd, generator=g)
    got = paged_attention(q, k_cache, v_cache, tables, lengths, lengths - 1, window)
    for r in range(3):
        keys = k_cache[tables[r]].reshape(-1, kvh, hd)[: lengths[r]]
        vals = v_cache[tables[r]].reshape(-1, kvh, hd)[: lengths[r]]
        want = _attend(q[r : r + 1], keys, vals, int(lengths[r]) - 1, window)[0]
        assert torch.allclose(got[r], want, atol=1e-6)


def test_buckets_and_modes():
    assert [bucket(n) for n in (1, 3, 8, 9, 300)] == [1, 4, 8, 16, 300]
    assert BATCH_BUCKETS[0] == 1


def test_a_bad_mode_is_refused(model):
    with pytest.raises(ValueError, match="not one of"):
        model.set_decode_graph("fast")
    with pytest.raises(ValueError, match="CUDA graphs need"):
        model.set_decode_graph("graph")
    assert model.graph_decoder is None


@pytest.mark.gpu
def test_cuda_graph_replay_equals_the_eager_step(tmp_path):
    """On CUDA the model replays captured graphs by default; the logits are the eager graph
    step's, bit for bit, and the per-sequence path's tokens. A tiny random Llama made here, so
    that the GPU machine (no Hub, no PyPI) runs it too (benchmarks/device_run.py)."""
    from tiny_models import tiny_family

    folder = tmp_path / "uw"
    unweight.compress(tiny_family("llama", tmp_path / "tiny"), folder, layout="serving")
    gpu = unweight.load(folder, device="cuda")
    assert gpu.graph_decoder is not None and gpu.graph_decoder.mode == "graph"
    replayed = greedy(gpu, "keep")
    eager = greedy(gpu, "eager")
    per_seq = greedy(gpu, None)
    for a, b, c in zip(replayed, eager, per_seq):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        assert torch.equal(a.argmax(-1), c.argmax(-1))


def test_the_archive_layout_is_never_captured(smollm2_uw, monkeypatch):
    """Archive-layout linears decode on the host at every forward: load never picks CUDA graphs
    for them, and asking for one is refused; an unknown mode in the environment is named."""
    archive = unweight.load(smollm2_uw[0], layout="archive")
    with pytest.raises(ValueError, match="archive layout"):
        GraphDecoder(archive, "graph")
    monkeypatch.setenv("UNWEIGHT_DECODE_GRAPH", "fastest")
    with pytest.raises(ValueError, match="UNWEIGHT_DECODE_GRAPH='fastest' is not one of"):
        unweight.load(smollm2_uw[0])
