"""A CPU decode step's decoder layers as one plan of native calls (`NativeStep`).

Through the layers' modules, each launcher checks its tensors, allocates its output and reads the
addresses of its streams and buffers again, some ten times a layer, and at one row that costs a
third of the step (docs/kernels.md, "Where a CPU decode step's time goes"). A decode step of `rows`
rows (`Step.native`: one new token per sequence, on the CPU) calls the same kernels here with their
arguments made once:
the weights' streams and the norms' weights as the layers hold them, and buffers of the plan's own
for every activation, at fixed addresses. Each step then adds only what moves: the cache's
address (it grows), the rotary rows, slots, block tables and lengths.

Every call is the one the layers' native path makes (`DecoderLayer.forward` with `step.native`),
in the same order on the same dtypes, so the step's bits are that path's; tests hold the two
equal, and that path to the torch code.

A plan is made for a model whose layers the kernels take: each linear an `UnweightLinear` whose
autotuned pipeline at this many rows is `fused` and whose streams the x86 kernels read (cpu_gemv.
gemv_call), the norms, cache and activations in one dtype (fp32, or BF16 where the chunk kernels
write BF16), no q/k norm. It is checked against what the layers hold (their weight values, the norms' weights,
the pipeline override), and anything replaced makes a new plan. That check touches some ten objects
a layer, which a step's weights have pushed out of the caches: on SmolLM2 it took 0.29 ms of a 6.4 ms
step. So it runs only after something may have changed (changes.py).
"""

from __future__ import annotations

import math
import os

import numba
import numpy as np
import torch
import torch.nn.functional as F

from ..kernels.cpu_attention import _paged_decode_at
from ..kernels.cpu_gemv import _PARALLEL, gemv_call
from ..kernels.cpu_pointwise import _rms_norm_at, _rope_store_at
from ..layers.autotune import FORCE_ENV
from ..layers.linear import UnweightLinear
from .changes import changes, watch
from .norm import RMSNorm


def _linears(layer) -> list:
    attn, mlp = layer._modules["self_attn"]._modules, layer._modules["mlp"]._modules
    return [attn["qkv_proj"], attn["o_proj"], mlp["gate_up_proj"], mlp["down_proj"]]


def _norms(layer) -> list:
    return [layer._modules["input_layernorm"], layer._modules["post_attention_layernorm"]]


def _held(layers: list, final) -> list:
    """What a plan is made from, as the layers hold it now (a linear or norm replaced holds another
    value): the final norm, each linear's weight value and bias, each norm's weight and its address
    (a parameter's data may be swapped in place). Read through the modules' own dicts, past
    nn.Module's attribute lookup."""
    held = [final]
    for norm_layers in ([final],) + tuple(_norms(layer) for layer in layers):
        for norm in norm_layers:
            weight = norm._parameters["weight"]
            held += [weight, weight.data_ptr()]
    for layer in layers:
        for lin in _linears(layer):
            held += [lin.__dict__.get("compressed_weight"), lin._parameters.get("bias")]
    return held


class NativeStep:
    """The decoder layers and the final norm of one model for decode steps of `rows` rows in `dtype`
    on the CPU."""

    def __init__(self, model, rows: int, dtype: torch.dtype):
        cfg = model.config
        layers = list(model.model.layers)
        self.rows, self.layers = rows, layers
        watch()
        final = model.model.norm
        self.held, self.forced, self.seen = _held(layers, final), os.environ.get(FORCE_ENV), changes()
        d, nq, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.nq, self.nkv, self.hd = nq, nkv, hd
        self.bf16 = dtype is torch.bfloat16
        self.window = cfg.sliding_window or 0
        self.scale = np.float32(1.0 / math.sqrt(hd))
        inter = layers[0].mlp.down_proj.in_features
        # the activations, each at a fixed address: (rows, width)
        new = lambda width, dt=dtype: torch.empty(rows, width, dtype=dt)  # noqa: E731
        self.h, self.normed, self.out = new(d), new(d), new(d)
        self.qkv = new((nq + 2 * nkv) * hd)
        self.q32, self.out32 = new(nq * hd, torch.float32), new(nq * hd, torch.float32)  # the attention's
        self.attended = self.out32 if dtype is torch.float32 else new(nq * hd)
        self.o, self.gate_up, self.act, self.down = new(d), new(2 * inter), new(inter), new(d)
        self.q_heads = self.qkv.view(rows, nq + 2 * nkv, hd)[:, :nq]  # q as rope leaves it
        self.q32_heads = self.q32.view(rows, nq, hd)
        self.gate, self.up = self.gate_up[:, :inter], self.gate_up[:, inter:]
        at = lambda t: t.data_ptr()  # noqa: E731

        def norm(w, residual, out) -> tuple:  # _rms_norm_at's args: h (+= residual), then its norm into out
            add = (at(residual), rows) if residual is not None else (0, 0)
            return (at(self.h), *add, at(w.weight), w.eps, at(out), rows, d, self.bf16)

        # per layer: (norm args, [(kernel, args, bias, y)] of the four linears, norm 2 args). Each
        # layer's last residual add (h += down) is made by the next norm's call, in h's place.
        self.calls = []
        for i, layer in enumerate(layers):
            linears = []
            for lin, (x, y) in zip(
                _linears(layer),
                [(self.normed, self.qkv), (self.attended, self.o), (self.normed, self.gate_up), (self.act, self.down)],
            ):
                kernel, streams, parts = gemv_call(lin.compressed_weight, dtype)
                linears.append((kernel, (at(x), rows, *streams, at(y), parts), lin.bias, y))
            w1, w2 = _norms(layer)
            self.calls.append((norm(w1, self.down if i else None, self.normed), linears, norm(w2, self.o, self.normed)))
        self.final = norm(final, self.down, self.out)

    @classmethod
    def make(cls, model, x: torch.Tensor) -> NativeStep | None:
        """A plan for decode steps of x's rows (x: the step's embedded tokens, its compute dtype), or
        None where the kernels do not take the model's layers (the layers' own path runs the step)."""
        cfg, cache, dtype = model.config, model.cache, x.dtype
        if x.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or cfg.qk_norm:
            return None
        if cache.k.dtype is not dtype or not (cache.k.is_contiguous() and cache.v.is_contiguous()):
            return None
        linears = [_linears(layer) for layer in model.model.layers]
        if any(type(lin) is not UnweightLinear for four in linears for lin in four):
            return None
        d, nq, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        inter = linears[0][3].in_features
        # (out, in) of each layer's linears, as the plan's buffers are sized: the kernels write by address
        shapes = [((nq + 2 * nkv) * hd, d), (d, nq * hd), (2 * inter, d), (d, inter)]
        for norm in [model.model.norm] + [norm for layer in model.model.layers for norm in _norms(layer)]:
            w = norm.weight
            if type(norm) is not RMSNorm or w.dtype is not dtype or w.shape != (d,) or not w.is_contiguous():
                return None
            if w.device != x.device:
                return None
        for four in linears:
            for lin, shape in zip(four, shapes, strict=True):
                if (lin.out_features, lin.in_features) != shape:
                    return None
                if gemv_call(lin.compressed_weight, dtype) is None:
                    return None
                b = lin.bias
                if b is not None and (b.dtype is not dtype or b.shape != shape[:1] or b.device != x.device):
                    return None
                # the autotuner's pipeline for these rows (timed now if it never was)
                if lin.pipeline(torch.zeros(x.shape[0], lin.in_features, dtype=dtype))[0] != "fused":
                    return None
        return cls(model, x.shape[0], dtype)

    def holds(self, model) -> bool:
        """Whether this plan is still made of what the model's layers hold."""
        if os.environ.get(FORCE_ENV) != self.forced or len(model.model.layers) != len(self.layers):
            return False
        if changes() == self.seen:
            return True
        seen = changes()
        if list(model.model.layers) != self.layers:
            return False
        now = _held(self.layers, model.model.norm)
        same = len(now) == len(self.held) and all(
            a is b or (type(a) is int and a == b) for a, b in zip(now, self.held, strict=True)
        )
        if same:
            self.seen = seen  # registrations elsewhere: this plan still holds
        return same

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step, cache) -> torch.Tensor:
        """The decoder layers and the final norm of one decode step: x (rows, hidden) the embedded
        tokens; returns the final norm of the residual stream after the last layer (the plan's own
        buffer: valid until the next step)."""
        nq, nkv, hd, rows, bf16 = self.nq, self.nkv, self.hd, self.rows, self.bf16
        cos, sin = cos.contiguous(), sin.contiguous()
        slots, tables, lengths = step.slots, step.tables.contiguous(), step.lengths
        k_cache, v_cache = cache.k, cache.v  # (layers, blocks, block_size, kv heads, hd)
        layer_bytes = k_cache.stride(0) * k_cache.element_size()
        k0, v0 = k_cache.data_ptr(), v_cache.data_ptr()
        shape = tuple(k_cache.shape[1:])
        cache_slots = shape[0] * shape[1]
        rope = (self.qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows, nq, nkv, hd)
        attend = (self.q32.data_ptr(), tables.data_ptr(), lengths.data_ptr(), (rows, nq, hd), shape, tables.shape[1])
        attend_tail = (self.window, self.scale, self.out32.data_ptr(), bf16, numba.get_num_threads(), 0)
        h = self.h
        h.copy_(x)
        with _PARALLEL:
            for i, (norm1, linears, norm2) in enumerate(self.calls):
                k_at, v_at = k0 + i * layer_bytes, v0 + i * layer_bytes
                (kq, qkv_args, qkv_bias, qkv), (ko, o_args, o_bias, o) = linears[0], linears[1]
                (kg, gu_args, gu_bias, gate_up), (kd, down_args, down_bias, down) = linears[2], linears[3]
                _rms_norm_at(*norm1)
                kq(*qkv_args)
                if qkv_bias is not None:
                    qkv.add_(qkv_bias)
                _rope_store_at(*rope, k_at, v_at, cache_slots, slots.data_ptr(), bf16)
                self.q32_heads.copy_(self.q_heads)
                _paged_decode_at(attend[0], k_at, v_at, *attend[1:], *attend_tail)
                if bf16:
                    self.attended.copy_(self.out32)
                ko(*o_args)
                if o_bias is not None:
                    o.add_(o_bias)
                _rms_norm_at(*norm2)  # h += o, in h's place; then the norm of h
                kg(*gu_args)
                if gu_bias is not None:
                    gate_up.add_(gu_bias)
                torch.mul(F.silu(self.gate), self.up, out=self.act)
                kd(*down_args)
                if down_bias is not None:
                    down.add_(down_bias)
            _rms_norm_at(*self.final)  # h += down; the final norm of h
        return self.out
