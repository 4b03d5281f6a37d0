"""`CausalLM`: a compact Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) over a paged KV cache.

Module names mirror Hugging Face's (`model.layers.3.self_attn.o_proj`, `lm_head`, ...), except
that q/k/v and gate/up are stacked into one matmul each (`qkv_proj`, `gate_up_proj`: fewer,
larger kernel calls); runtime/model/loader.py maps checkpoint names with a table. The skeleton is built on the
meta device; the loader swaps every linear and the embedding for an `UnweightLinear` (layout
"archive": an `ArchiveLinear`) and assigns the decoded norms.

Two explicit entry points, one per phase:
- `prefill(seq, tokens)`: a whole prompt (or the next chunk of one) of one sequence;
- `decode_step(seqs, tokens)`: one new token for each of several sequences (a running batch).
Both run the same `_forward` over a flat batch of tokens, where `segments` say which sequence each
run of tokens belongs to; linears see every token at once, attention runs per sequence, except
that on the CPU the sequences with one new token each (a decode step's) attend in one kernel call
per layer straight from the paged cache (runtime/kernels/cpu_attention.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_pointwise
from ..kernels.cpu_attention import paged_decode_attention_cpu
from ..layers.transfer import to_device
from .config import ModelConfig
from .kv_cache import KVCache, SeqCache
from .native_step import NativeStep
from .norm import RMSNorm
from .rope import Rope
from .sampling import token_logprobs


@dataclass(slots=True)
class Step:
    """What every layer of one forward shares: the segments (seq, new tokens) in row order, each
    new token's cache slot, and the sequences from segment `batched` on (one new token each, a
    decode step's rows, on the CPU) that attend as one batch through `tables` and `lengths`
    (positions attended, the new one's included); `batched` is len(segments) when none do.

    A step of decode rows only (`native`) takes the native kernels between the linears
    (cpu_pointwise: norms with the residual add, rope with the cache's store), where a
    chain of torch operators cost more than the linears at one row. A prompt takes torch's
    operators, which round as transformers' do: its BF16 logits are transformers' bit for bit."""

    segments: list[tuple[SeqCache, int]]
    slots: torch.Tensor
    batched: int
    tables: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    native: bool = False  # every row a decode row on the CPU, fp32 or BF16: the layers' native path

    @classmethod
    def plan(cls, cache: KVCache, segments: list[tuple[SeqCache, int]]) -> Step:
        """The step of these segments, their room reserved and lengths not yet advanced."""
        batched = len(segments)
        if cache.k.device.type == "cpu" and cache.k.dtype in (torch.float32, torch.bfloat16):
            while batched and segments[batched - 1][1] == 1:
                batched -= 1
        step = cls(segments, cache.slots(segments), batched)
        if batched < len(segments):
            ones = [seq for seq, _ in segments[batched:]]
            step.tables = cache.tables(ones)
            step.lengths = torch.tensor([seq.length + 1 for seq in ones], dtype=torch.int64)
            step.native = batched == 0
        return step


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.qkv_proj = nn.Linear(d, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, bias=False)  # q, k, v stacked
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.cfg = cfg

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer: int,
        cache: KVCache,
        step: Step,
    ) -> torch.Tensor:
        cfg = self.cfg
        n, nq, nkv, hd = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.qkv_proj(x).view(n, nq + 2 * nkv, hd)
        if step.native and not cfg.qk_norm and cache.k.dtype == qkv.dtype and cpu_pointwise.takes(qkv):
            # rope and the cache's store in one native call, q rotated in qkv's place
            flat = (-1, nkv, hd)
            k_cache, v_cache = cache.k[layer].view(flat), cache.v[layer].view(flat)
            cpu_pointwise.rope_store_cpu(qkv, cos, sin, nq, nkv, k_cache, v_cache, step.slots)
            q = qkv[:, :nq]
        else:
            q, k, v = qkv.split([nq, nkv, nkv], dim=1)  # (tokens, heads, head_dim)
            if cfg.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = Rope.apply(q, cos, sin), Rope.apply(k, cos, sin)
            cache.write_slots(layer, step.slots, k, v)
        if step.batched == 0 and step.tables is not None:  # a decode step's rows only: one kernel call
            out = paged_decode_attention_cpu(
                q, cache.k[layer], cache.v[layer], step.tables, step.lengths, cfg.sliding_window, check=False
            )
            return self.o_proj(out.view(n, -1))
        out = torch.empty_like(q)
        t0 = 0
        for seq, count in step.segments[: step.batched]:
            start = seq.length
            ks, vs = cache.read(layer, seq, start + count)  # (L, kv_heads, head_dim)
            # a cache in another dtype than the compute (--kv-cache-dtype) is widened or rounded here
            ks, vs = ks.to(q.dtype), vs.to(q.dtype)
            out[t0 : t0 + count] = _attend(q[t0 : t0 + count], ks, vs, start, cfg.sliding_window)
            t0 += count
        if step.tables is not None:
            out[t0:] = paged_decode_attention_cpu(
                q[t0:], cache.k[layer], cache.v[layer], step.tables, step.lengths, cfg.sliding_window, check=False
            )
        return self.o_proj(out.view(n, -1))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None) -> torch.Tensor:
    """Causal attention of q (T, H, hd) at positions start.. over k, v (L, KVH, hd), L = start + T.
    One BF16 query on the CPU (a decode step) attends in FP32 and is rounded once: torch's CPU
    attention kernel takes 7x as long in BF16 as in FP32 for one query (159 against 22 us at 270
    positions, 9 heads of 64, avx512_bf16 EPYC), and widening K and V costs less than the gap."""
    t, length = q.shape[0], k.shape[0]
    if t == 1 and q.dtype == torch.bfloat16 and q.device.type == "cpu":
        return _attend(q.float(), k.float(), v.float(), start, window).to(q.dtype)
    mask = None
    if t > 1 or (window is not None and length > window):
        qpos = torch.arange(start, start + t, device=q.device)[:, None]
        kpos = torch.arange(length, device=q.device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True
    )
    return o[0].transpose(0, 1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # gate, up stacked
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, layer, cache, step):
        if step.native and self.input_layernorm.takes(x):
            attended = self.self_attn(self.input_layernorm.native(x), cos, sin, layer, cache, step)
            if attended.dtype == x.dtype:  # the residual add made in x's place, inside the norm's call
                return x + self.mlp(self.post_attention_layernorm.native(x, residual=attended))
        else:
            attended = self.self_attn(self.input_layernorm(x), cos, sin, layer, cache, step)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The whole model; `cache` (a KVCache) is created by `init_cache` once weights are loaded."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.cache: KVCache | None = None
        self.rope: Rope | None = None
        self.compute_dtype = torch.float32
        self.graph_decoder = None  # set_decode_graph: decode steps as one graph
        self._native_steps: dict[tuple, NativeStep | None] = {}  # (rows, dtype) -> a CPU decode step's plan

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def init_cache(
        self, max_tokens: int, dtype: torch.dtype, block_size: int = 16, kv_dtype: torch.dtype | None = None
    ) -> None:
        """Create the KV cache (room for max_tokens tokens over all sequences, in `kv_dtype`, by
        default the compute dtype `dtype`) and the rotary tables."""
        cfg = self.config
        self.compute_dtype = dtype
        self.cache = KVCache(
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            kv_dtype or dtype,
            self.device,
            block_size,
            max_blocks=-(-max_tokens // block_size),
            # on a GPU the pool is made whole at once: a captured decode graph holds its address
            initial_blocks=-(-max_tokens // block_size) if self.device.type == "cuda" else 16,
        )
        self.rope = Rope(cfg, self.device)
        self.graph_decoder = None
        self._native_steps = {}

    def set_decode_graph(self, mode: str | None) -> None:
        """How decode steps run: None, sequence by sequence (attention per sequence, the block
        tables on the host); or as one graph of the whole batch (runtime/model/graph_step.py):
        "graph" (captured as CUDA graphs and replayed, the default on CUDA), "compile"
        (torch.compile, fullgraph) or "eager" (that same step, uncompiled: for debugging)."""
        from .graph_step import GraphDecoder

        new = None if mode is None else GraphDecoder(self, mode)  # a bad mode is refused before anything changes
        if self.graph_decoder is not None:
            self.cache.free(self.graph_decoder.scratch)
        self.graph_decoder = new

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    def new_sequence(self) -> SeqCache:
        return SeqCache()

    def free(self, seq: SeqCache) -> None:
        self.cache.free(seq)

    @torch.inference_mode()
    def _forward(
        self, tokens: torch.Tensor, segments: list[tuple[SeqCache, int]], on_layer: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Final-norm hidden states (tokens, hidden) for a flat batch of new tokens; `on_layer(i)`
        is called once layer i has stored the new tokens' K and V."""
        cache = self.cache
        self._check_context(segments)
        for seq, count in segments:
            cache.reserve(seq, count)
        step = Step.plan(cache, segments)
        # positions and token ids are known on the host: nothing in a step waits for the device
        positions = [p for s, c in segments for p in range(s.length, s.length + c)]
        positions = to_device(torch.tensor(positions, dtype=torch.int64), self.device)
        cos, sin = self.rope.cos_sin(positions, self.compute_dtype, end=max(s.length + c for s, c in segments))
        # the ids were checked on the host by every caller (_check_tokens)
        x = self.model.embed_tokens.rows(tokens, self.compute_dtype, check=False).to(self.device)
        native = self._native_step(x) if step.native and on_layer is None else None
        if native is not None:  # the same kernels as the layers' native path, their arguments made once
            x = native.run(x, cos, sin, step, cache)  # the final norm's too
        else:
            for i, layer in enumerate(self.model.layers):
                x = layer(x, cos, sin, i, cache, step)
                if on_layer is not None:
                    on_layer(i)
            norm = self.model.norm
            x = norm.native(x) if step.native and norm.takes(x) else norm(x)
        for seq, count in segments:
            seq.length += count
        return x

    def _native_step(self, x: torch.Tensor) -> NativeStep | None:
        """The plan of a decode step of x's rows (native_step.py), made at its first step and again
        whenever the layers hold other weights; None where the kernels do not take the layers."""
        key = (x.shape[0], x.dtype)
        plan = self._native_steps.get(key, False)  # False: none made yet; None: the layers take the step
        if plan and not plan.holds(self):
            self._native_steps.clear()  # every plan holds the replaced weights: none may keep them alive
            plan = False
        if plan is False:
            plan = self._native_steps[key] = NativeStep.make(self, x)
        return plan

    def _apply(self, fn, recurse=True):
        """nn.Module's move or cast (.to, .cuda, ...), after dropping the decode steps' plans: they hold
        the weights as they lay (a model moved to a GPU would keep its CPU streams alive in them)."""
        self._native_steps = {}
        return super()._apply(fn, recurse)

    def _check_context(self, segments: list[tuple[SeqCache, int]]) -> None:
        """Every sequence has room in the context length for its new tokens (before any is reserved)."""
        for seq, count in segments:
            if seq.length + count > self.max_context:
                raise ValueError(
                    f"sequence would reach {seq.length + count} tokens, over the context length {self.max_context}"
                )

    def _check_tokens(self, tokens) -> torch.Tensor:
        """Token ids (a tensor or a list of ints) as a flat int64 tensor, each in [0, vocab_size). A
        short list is checked in Python: at a decode step the tensor reductions cost more."""
        vocab = self.config.vocab_size
        if type(tokens) is list and len(tokens) <= 64 and all(type(t) is int for t in tokens):
            if not all(0 <= t < vocab for t in tokens):
                raise ValueError(f"token ids must lie in [0, {vocab})")
            return torch.tensor(tokens, dtype=torch.int64)
        tokens = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
            raise ValueError(f"token ids must lie in [0, {vocab})")
        return tokens

    def prefill(
        self, seq: SeqCache, tokens, all_logits: bool = False, on_layer: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Run a prompt (or its next chunk) of one sequence; fp32 logits of its last token
        (vocab,), or of every token (tokens, vocab) with all_logits. `on_layer(i)`: called as soon
        as layer i's K and V of these tokens are in the cache (a hand-off streams them from there)."""
        tokens = self._check_tokens(tokens)
        if tokens.numel() == 0:
            raise ValueError("prefill needs at least one token")
        h = self._forward(tokens, [(seq, tokens.numel())], on_layer)
        return self.lm_head(h).float() if all_logits else self.lm_head(h[-1:]).float()[0]

    def prefill_logprobs(
        self, seq: SeqCache, tokens, top: int, chunk: int = 256, on_layer: Callable[[int], None] | None = None
    ) -> tuple[torch.Tensor, list[tuple[float, list[tuple[int, float]]]]]:
        """`prefill` that also scores the prompt: fp32 logits of its last token, and for every
        token after the first its log-probability given the tokens before it and the `top` best
        (id, logprob) there. lm_head runs on `chunk` rows at a time, so a long prompt never holds
        (tokens, vocab) logits at once."""
        tokens = self._check_tokens(tokens)
        if tokens.numel() == 0:
            raise ValueError("prefill needs at least one token")
        h = self._forward(tokens, [(seq, tokens.numel())], on_layer)
        scored = []
        for a in range(0, tokens.numel() - 1, chunk):
            b = min(a + chunk, tokens.numel() - 1)
            scored += token_logprobs(self.lm_head(h[a:b]), tokens[a + 1 : b + 1], top, chunk)
        return self.lm_head(h[-1:]).float()[0], scored

    def decode_step(self, seqs: list[SeqCache], tokens) -> torch.Tensor:
        """One new token for each sequence of a running batch; fp32 logits (batch, vocab)."""
        tokens = self._check_tokens(tokens)
        if tokens.numel() != len(seqs) or not seqs:
            raise ValueError(
                f"decode_step needs one token per sequence ({len(seqs)} sequences, {tokens.numel()} tokens)"
            )
        if self.graph_decoder is None:
            return self.lm_head(self._forward(tokens, [(s, 1) for s in seqs])).float()
        self._check_context([(s, 1) for s in seqs])
        with torch.inference_mode():
            return self.graph_decoder(seqs, tokens)

    def prefill_with_step(
        self, seq: SeqCache, prompt, seqs: list[SeqCache], tokens
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`prefill(seq, prompt)` and `decode_step(seqs, tokens)` in one forward: the running
        batch's rows ride on the prompt's matmuls instead of waiting for them and then taking a
        step of their own (vLLM's chunked prefill batches them so too). Returns the prompt's last
        fp32 logits (vocab,) and the batch's (batch, vocab). Always sequence by sequence, even
        with a decode graph set."""
        prompt, tokens = self._check_tokens(prompt), self._check_tokens(tokens)
        n = prompt.numel()
        if n == 0 or tokens.numel() != len(seqs) or not seqs:
            raise ValueError(
                f"prefill_with_step needs a prompt and one token per sequence ({n} prompt tokens, "
                f"{len(seqs)} sequences, {tokens.numel()} tokens)"
            )
        h = self._forward(torch.cat([prompt, tokens]), [(seq, n)] + [(s, 1) for s in seqs])
        logits = self.lm_head(h[n - 1 :]).float()
        return logits[0], logits[1:]

    def resident_weight_bytes(self) -> int:
        """Bytes of every weight the model holds (compressed streams, decoded norms, biases),
        each storage counted once (tied embeddings share theirs)."""
        seen, total = set(), 0
        for t in [*self.parameters(), *self.buffers()]:
            key = (t.device, t.untyped_storage().data_ptr())
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total
