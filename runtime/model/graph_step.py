"""The decode step as one graph: the whole batch's attention over the paged KV cache at once, from
block tables that live on the device, with no Python loop over sequences and nothing that waits
for the device, so that the step can be captured (a CUDA graph) or compiled (torch.compile,
fullgraph) and replayed.

`GraphDecoder(model)` runs `CausalLM.decode_step` this way:
- on the host, each step reserves the sequences' cache room and fills small static buffers
  (tokens, positions, block tables, lengths), the batch padded to a bucket (BATCH_BUCKETS) and the
  block tables to a width bucket (a power of two of blocks), so a handful of shapes cover every
  step; padding rows write to a scratch block and attend to it alone;
- `step(...)` is then a pure function of tensors: the linears and the embedding's row lookup are
  custom ops (`unweight::linear`, `unweight::rows`) with fake implementations, so a tracer sees
  their shapes and never their kernels, which keep their own pipelines and autotuner;
- on CUDA each (batch, width) bucket is captured once as a `torch.cuda.CUDAGraph` (after an eager
  warm-up, which also lets the autotuner choose) and replayed; `mode="compile"` compiles the step
  with torch.compile(fullgraph=True) instead; `mode="eager"` runs it as it is (for debugging).

Attention gathers each sequence's blocks (B, width * block_size tokens) and masks positions at or
beyond its length (and outside a sliding window); it is the math the per-sequence path computes,
over padded keys whose weights are exactly zero.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.linear import ArchiveLinear
from ..layers.transfer import to_device
from .kv_cache import SeqCache
from .rope import Rope

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MODES = ("graph", "compile", "eager")
MIN_WIDTH = 4  # blocks: the narrowest block table

# modules the custom ops call, by a name the graph holds as a constant (vLLM's layer-name pattern)
_MODULES: weakref.WeakValueDictionary[str, nn.Module] = weakref.WeakValueDictionary()


def _register(module: nn.Module) -> str:
    name = f"{type(module).__name__}@{id(module):x}"
    _MODULES[name] = module
    return name


@torch.library.custom_op("unweight::linear", mutates_args=())
def linear_op(x: torch.Tensor, module: str) -> torch.Tensor:
    """x through a registered linear (its pipeline, autotuned; its bias)."""
    return _MODULES[module](x)


@linear_op.register_fake
def _(x: torch.Tensor, module: str) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], _MODULES[module].out_features)


@torch.library.custom_op("unweight::rows", mutates_args=())
def rows_op(ids: torch.Tensor, module: str, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a registered matrix (the embedding), ids checked on the host already."""
    return _MODULES[module].rows(ids, dtype, check=False).to(ids.device)


@rows_op.register_fake
def _(ids: torch.Tensor, module: str, dtype: torch.dtype) -> torch.Tensor:
    return ids.new_empty(ids.shape[0], _MODULES[module].in_features, dtype=dtype)


def bucket(n: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int:
    """The smallest bucket that holds n (n itself beyond the last)."""
    return next((b for b in buckets if b >= n), n)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    positions: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """One new query per sequence, q (B, H, hd), over its cached keys and values: k_cache, v_cache
    (blocks, block_size, KVH, hd) of one layer, tables (B, W) block ids, lengths (B,) tokens held
    (the new one included), positions (B,) the new token's. Returns (B, H, hd)."""
    b, w = tables.shape
    bs, kvh, hd = k_cache.shape[1:]
    k = k_cache[tables].view(b, w * bs, kvh, hd).transpose(1, 2).to(q.dtype)  # (B, KVH, L, hd)
    v = v_cache[tables].view(b, w * bs, kvh, hd).transpose(1, 2).to(q.dtype)
    kpos = torch.arange(w * bs, device=q.device)[None, :]
    mask = kpos < lengths[:, None]
    if window is not None:
        mask = mask & (kpos > positions[:, None] - window)
    o = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask[:, None, None, :], enable_gqa=True)
    return o[:, :, 0, :]


class GraphDecoder:
    """Decode steps of a CausalLM as one captured (or compiled) graph per shape bucket."""

    def __init__(self, model, mode: str | None = None, backend: str = "inductor"):
        if mode is None:
            mode = "graph" if model.device.type == "cuda" else "eager"
        if mode not in MODES:
            raise ValueError(f"graph mode {mode!r} is not one of {', '.join(MODES)}")
        if mode == "graph" and any(isinstance(m, ArchiveLinear) for m in model.modules()):
            raise ValueError("the archive layout decodes on the host at every step: no CUDA graph can hold it")
        if mode == "graph" and model.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device; use mode 'compile' or 'eager'")
        self.model, self.mode = model, mode
        cfg, cache = model.config, model.cache
        self.block_size = cache.block_size
        self.max_width = -(-cfg.max_position_embeddings // self.block_size)
        self.scratch = SeqCache()  # the block that padding rows write to and read
        cache.reserve(self.scratch, 1)
        self.scratch_block = self.scratch.blocks[0]
        bb = model.model
        self.embed = _register(bb.embed_tokens)
        self.lm_head = _register(model.lm_head)
        self.linears = [
            tuple(
                _register(m)
                for m in (ly.self_attn.qkv_proj, ly.self_attn.o_proj, ly.mlp.gate_up_proj, ly.mlp.down_proj)
            )
            for ly in bb.layers
        ]
        # the rotary table for every position the model allows, made once: a step only indexes it
        self.cos, self.sin = model.rope._table(cfg.max_position_embeddings, model.compute_dtype)
        self._graphs: dict[tuple[int, int], tuple] = {}
        compiled = mode == "compile"
        self._compiled = torch.compile(self.step, fullgraph=True, dynamic=False, backend=backend) if compiled else None

    # -- the step: tensors in, logits out ---------------------------------------------------------
    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """fp32 logits (B, vocab) of one token per row; writes each row's K/V into the cache."""
        model, cfg = self.model, self.model.config
        dtype, bs = model.compute_dtype, self.block_size
        b = tokens.shape[0]
        nh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos, sin = self.cos[positions], self.sin[positions]  # (B, 1, hd)
        slots = tables.gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs
        x = rows_op(tokens, self.embed, dtype)
        for i, layer in enumerate(model.model.layers):
            qkv_name, o_name, gu_name, down_name = self.linears[i]
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            qkv = linear_op(h, qkv_name).view(b, nh + 2 * kvh, hd)
            q, k, v = qkv.split([nh, kvh, kvh], dim=1)
            if cfg.qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = Rope.apply(q, cos, sin), Rope.apply(k, cos, sin)
            kl, vl = k_cache[i], v_cache[i]
            kl.view(-1, kvh, hd).index_copy_(0, slots, k.to(kl.dtype))
            vl.view(-1, kvh, hd).index_copy_(0, slots, v.to(vl.dtype))
            o = paged_attention(q, kl, vl, tables, lengths, positions, cfg.sliding_window)
            x = x + linear_op(o.reshape(b, nh * hd), o_name)
            gate, up = linear_op(layer.post_attention_layernorm(x), gu_name).chunk(2, dim=-1)
            x = x + linear_op(F.silu(gate) * up, down_name)
        return linear_op(model.model.norm(x), self.lm_head).float()

    # -- the host side: buffers, buckets, replay ------------------------------------------------
    def _inputs(self, seqs: list[SeqCache], tokens: torch.Tensor, batch: int, width: int) -> list[torch.Tensor]:
        n = len(seqs)
        tok = torch.zeros(batch, dtype=torch.int64)
        tok[:n] = tokens
        pos = torch.zeros(batch, dtype=torch.int64)
        pos[:n] = torch.tensor([s.length for s in seqs])
        tables = torch.full((batch, width), self.scratch_block, dtype=torch.int64)
        for r, s in enumerate(seqs):
            tables[r, : len(s.blocks)] = torch.tensor(s.blocks[:width])
        return [to_device(t, self.model.device) for t in (tok, pos, tables, pos + 1)]

    def __call__(self, seqs: list[SeqCache], tokens: torch.Tensor) -> torch.Tensor:
        """fp32 logits (len(seqs), vocab); room reserved and lengths advanced as decode_step does."""
        cache = self.model.cache
        for s in seqs:
            cache.reserve(s, 1)
        batch = bucket(len(seqs))
        width = min(self.max_width, max(MIN_WIDTH, 1 << (max(len(s.blocks) for s in seqs) - 1).bit_length()))
        inputs = self._inputs(seqs, tokens, batch, width)
        if self.mode == "graph":
            logits = self._replay(batch, width, inputs)
        else:
            fn = self._compiled or self.step
            logits = fn(*inputs, cache.k, cache.v)
        for s in seqs:
            s.length += 1
        return logits[: len(seqs)]

    def _replay(self, batch: int, width: int, inputs: list[torch.Tensor]) -> torch.Tensor:
        cache = self.model.cache
        key = (batch, width)
        entry = self._graphs.get(key)
        if entry is not None and entry[3] is not cache.k:  # the cache grew: its tensors moved
            self._graphs.clear()
            entry = None
        if entry is None:
            static = [t.clone() for t in inputs]
            stream = torch.cuda.Stream(self.model.device)
            stream.wait_stream(torch.cuda.current_stream(self.model.device))
            with torch.cuda.stream(stream):
                self.step(*static, cache.k, cache.v)  # warm-up: Triton compiles, the autotuner chooses
            torch.cuda.current_stream(self.model.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self.step(*static, cache.k, cache.v)
            entry = self._graphs[key] = (graph, static, out, cache.k)
        graph, static, out, _ = entry
        for dst, src in zip(static, inputs):
            dst.copy_(src)
        graph.replay()
        return out.clone()  # the next replay overwrites `out`: the caller's logits must outlive it
