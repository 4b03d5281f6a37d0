"""The runtime's decode step, tokens/s: compressed weights against the same runtime on dense BF16
weights, and transformers' own BF16 decode beside them as the outside anchor.

The model is a random Llama-3.1-8B-shaped `CausalLM` (runtime/model/llama.py; --tiny: a small one
of the same form; --config DIR: a checkpoint folder's shape). Its layers are each their own copy in
memory: one layer's random N(0, 0.02) BF16 weights are made, and encoded once, then copied, so a
step streams every layer's bytes as a real model's does (encoding 8B weights afresh would take
minutes of a borrowed GPU's time for the same bytes read). The two variants differ only in the
linears: `UnweightLinear` (the resident layout, the autotuner's pipeline) against a plain BF16
`F.linear`; the embedding, attention, norms, the KV cache and the step itself are the same code.
Each batch's sequences start with --context tokens already in the cache (their keys and values
are zeros: attention costs the same whatever they hold).

Each variant runs each decode path (--modes; CausalLM.set_decode_graph): "off", block tables on the
host as the CPU runs by default (there the batch's attention is one kernel call per layer), and
"graph" (captured CUDA graphs, the default on CUDA) or "compile" (torch.compile of the same
one-graph step, on the CPU).

Beside each measured ratio: the ratio that the bytes predict, BF16's weight bytes over the
compressed ones (what a step bound by reading weights gains at best).

`--hf` times transformers' decode of a LlamaForCausalLM of the same shape, random weights, in BF16,
with a static cache (and torch.compile's reduce-overhead mode on CUDA), as (time of N new tokens -
time of 1) / (N - 1).

Run:  python benchmarks/decode_bench.py [--device cuda] [--tiny | --config DIR] [--batches 1,8,32] [--context 1024]
      [--steps 16] [--modes off,graph] [--hf] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_by_side import cpu_flags, write_record  # noqa: E402

from unweight.runtime.layers.linear import UnweightLinear, compute_dtype  # noqa: E402
from unweight.runtime.model.config import ModelConfig  # noqa: E402
from unweight.runtime.model.llama import CausalLM  # noqa: E402

LLAMA_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
)
TINY = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32
)


class DenseLinear(nn.Module):
    """The baseline: the weight held in the compute dtype (BF16 on CUDA; on the CPU fp32, as a dense
    CPU runtime holds it rather than converting BF16 at every step) and multiplied by F.linear,
    with the `rows` lookup the model's embedding takes. Its stored bytes are counted as BF16's."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.to(compute_dtype(weight.device)))
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))

    def rows(self, ids: torch.Tensor | None, dtype: torch.dtype = torch.bfloat16, check: bool = True) -> torch.Tensor:
        w = self.weight if ids is None else self.weight[ids.to(self.weight.device)]
        return w.to(dtype)

    @property
    def stored_bytes(self) -> int:
        return 2 * self.weight.numel()


def _copy(module: nn.Module) -> nn.Module:
    """The module over its own copy of its buffers (the weight streams); settings shared."""
    new = copy.copy(module)
    new._buffers = {k: v.clone() for k, v in module._buffers.items()}
    return new


def model_config(tiny: bool, context: int, folder: Path | None = None) -> ModelConfig:
    """Llama-3.1-8B's shape, the tiny one, or a checkpoint folder's own (its config.json)."""
    if folder is not None:
        return ModelConfig.from_folder(folder)
    shape = TINY if tiny else LLAMA_8B
    return ModelConfig(model_type="llama", rms_norm_eps=1e-5, max_position_embeddings=max(8192, 2 * context), **shape)


def random_weights(cfg: ModelConfig, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """One layer's weights (stacked as the runtime multiplies them), the embedding and lm_head."""
    g = torch.Generator(device=device).manual_seed(seed)
    hd, d = cfg.head_dim, cfg.hidden_size
    shapes = {
        "qkv_proj": ((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, d),
        "o_proj": (d, cfg.num_heads * hd),
        "gate_up_proj": (2 * cfg.intermediate_size, d),
        "down_proj": (d, cfg.intermediate_size),
        "embed_tokens": (cfg.vocab_size, d),
        "lm_head": (cfg.vocab_size, d),
    }
    return {k: (torch.randn(*s, generator=g, device=device) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}


def build(
    cfg: ModelConfig, weights: dict[str, torch.Tensor], compressed: bool, device: torch.device, cache_tokens: int
):
    """A CausalLM on `device` whose linears are UnweightLinear (compressed) or DenseLinear."""

    def make(w):
        return UnweightLinear.from_weight(w.cpu(), device=device).to(device) if compressed else DenseLinear(w)

    made = {k: make(w) for k, w in weights.items()}
    with torch.device("meta"):
        model = CausalLM(cfg)
    dtype = compute_dtype(device)
    for i, layer in enumerate(model.model.layers):
        # the first layer takes the made modules, the rest their copies: distinct memory, same bytes
        own = (lambda m: m) if i == 0 else _copy
        layer.self_attn.qkv_proj = own(made["qkv_proj"])
        layer.self_attn.o_proj = own(made["o_proj"])
        layer.mlp.gate_up_proj = own(made["gate_up_proj"])
        layer.mlp.down_proj = own(made["down_proj"])
    model.model.embed_tokens, model.lm_head = made["embed_tokens"], made["lm_head"]
    for mod in model.modules():
        if hasattr(mod, "eps") and isinstance(getattr(mod, "weight", None), nn.Parameter):  # the RMS norms
            mod.weight = nn.Parameter(torch.ones(mod.weight.shape, dtype=dtype, device=device), requires_grad=False)
    model.init_cache(cache_tokens, dtype)
    return model.eval()


def weight_bytes(model: CausalLM) -> int:
    return sum(
        m.stored_bytes for m in model.modules() if isinstance(m, (UnweightLinear, DenseLinear))
    )  # lm_head and the embedding are separate matrices here


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


WARMUP, REPEATS = 2, 3


def cache_tokens_for(batch: int, context: int, steps: int, block: int = 16) -> int:
    """KV room for `batch` sequences through time_decode, in whole blocks each, and the one scratch
    block of a graph decoder."""
    return batch * block * -(-(context + WARMUP + REPEATS * steps) // block) + block


def time_decode(model: CausalLM, batch: int, context: int, steps: int, repeats: int = REPEATS) -> dict:
    """Median seconds of one decode step of `batch` sequences that hold `context` tokens."""
    device = model.device
    seqs = [model.new_sequence() for _ in range(batch)]
    for s in seqs:
        model.cache.reserve(s, context)
        s.length = context
    tokens = torch.arange(batch) % model.config.vocab_size
    try:
        for _ in range(WARMUP):  # warm-up: kernels compile, the autotuner chooses
            model.decode_step(seqs, tokens)
        per_step = []
        for _ in range(repeats):
            sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                logits = model.decode_step(seqs, tokens)
            sync(device)
            per_step.append((time.perf_counter() - t0) / steps)
        assert logits.shape == (batch, model.config.vocab_size) and bool(torch.isfinite(logits).all())
    finally:
        for s in seqs:
            model.free(s)
    return {"step_s": statistics.median(per_step), "range_s": [min(per_step), max(per_step)]}


def hf_decode(cfg: ModelConfig, batch: int, context: int, steps: int, device: torch.device) -> dict:
    """transformers' own BF16 decode of the same shape: static cache, compiled on CUDA."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(hf_cfg).to(dtype).eval()
    compiled = device.type == "cuda"
    if compiled:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(0, cfg.vocab_size, (batch, context), device=device)

    def run(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        model.generate(
            ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static", pad_token_id=0
        )
        sync(device)
        return time.perf_counter() - t0

    run(steps)  # warm-up: compiles
    one, full = statistics.median(run(1) for _ in range(2)), statistics.median(run(steps) for _ in range(2))
    return {
        "step_s": max(full - one, 1e-9) / (steps - 1),
        "compiled": compiled,
        "dtype": str(dtype).removeprefix("torch."),
        "transformers": transformers.__version__,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a small model of the same form (checks the script)")
    ap.add_argument("--config", type=Path, default=None, help="a checkpoint folder whose config.json gives the shape")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=None, help="tokens already in each sequence's cache")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per timing")
    ap.add_argument("--hf", action="store_true", help="also time transformers' own decode")
    ap.add_argument("--hf-only", action="store_true", help="time transformers' own decode alone")
    ap.add_argument(
        "--modes",
        default=None,
        help="decode paths (CausalLM.set_decode_graph): off (per sequence), graph, compile, eager; default: off,graph "
        "on CUDA, off,compile on the CPU",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    batches = [int(b) for b in args.batches.split(",")]
    modes = (args.modes or ("off,graph" if device.type == "cuda" else "off,compile")).split(",")
    context = args.context or (64 if args.tiny else 1024)
    cfg = model_config(args.tiny, context, args.config)
    t_start = time.perf_counter()
    weights = None if args.hf_only else random_weights(cfg, device)
    cache_tokens = cache_tokens_for(max(batches), context, args.steps)
    rows = []
    for variant in () if args.hf_only else ("bf16", "unweight"):
        t0 = time.perf_counter()
        model = build(cfg, weights, variant == "unweight", device, cache_tokens)
        print(f"{variant}: built in {time.perf_counter() - t0:.1f} s, {weight_bytes(model) / 1e9:.2f} GB", flush=True)
        for mode in modes:
            model.set_decode_graph(None if mode == "off" else mode)
            for b in batches:
                r = {
                    "variant": variant,
                    "mode": mode,
                    "batch": b,
                    "weight_bytes": weight_bytes(model),
                    **time_decode(model, b, context, args.steps),
                }
                rows.append(r)
                print(
                    f"  {mode:>7} batch {b:>3}: {b / r['step_s']:9.1f} tokens/s ({1e3 * r['step_s']:.2f} ms a step)",
                    flush=True,
                )
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del weights
    hf = []
    if args.hf or args.hf_only:
        for b in batches:
            r = {"batch": b, **hf_decode(cfg, b, context, args.steps, device)}
            hf.append(r)
            print(f"  transformers batch {b:>3}: {b / r['step_s']:9.1f} tokens/s", flush=True)
    table = hf_table(batches, hf) if args.hf_only else ratio_table(batches, modes, rows, hf)
    print("\n" + "\n".join(table))
    if device.type == "cpu":
        print(f"CPU: {cpu_flags()}")
    if args.json:
        write_record(
            args.json,
            {
                "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "model": str(args.config) if args.config else "tiny" if args.tiny else "Llama-3.1-8B-shaped",
                "context": context,
                "steps": args.steps,
                "rows": rows,
                "transformers": hf,
                "table": table,
                "seconds": time.perf_counter() - t_start,
            },
        )
    return 0


def hf_table(batches: list[int], hf: list[dict]) -> list[str]:
    table = ["| batch | transformers tok/s | compiled |", "| ---: | ---: | --- |"]
    return table + [f"| {b} | {b / r['step_s']:.1f} | {r['compiled']} |" for b, r in zip(batches, hf)]


def ratio_table(batches: list[int], modes: list[str], rows: list[dict], hf: list[dict]) -> list[str]:
    """Markdown rows, one per path and batch: tokens/s, the measured ratio and the one the bytes
    predict, and against transformers' own decode when it ran."""
    by = {(r["variant"], r["mode"], r["batch"]): r for r in rows}
    table = [
        "| path | batch | BF16 tok/s | unweight tok/s | ratio | bytes predict | transformers tok/s | "
        "unweight / transformers |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode in modes:
        for i, b in enumerate(batches):
            d, u = by[("bf16", mode, b)], by[("unweight", mode, b)]
            ratio, predicted = d["step_s"] / u["step_s"], d["weight_bytes"] / u["weight_bytes"]
            u["ratio_vs_bf16"], u["predicted_ratio"] = ratio, predicted
            h = f"{b / hf[i]['step_s']:.1f} | {hf[i]['step_s'] / u['step_s']:.2f}x" if hf else "- | -"
            tok_s = f"{b / d['step_s']:.1f} | {b / u['step_s']:.1f}"
            table.append(f"| {mode} | {b} | {tok_s} | {ratio:.2f}x | {predicted:.2f}x | {h} |")
    return table


if __name__ == "__main__":
    sys.exit(main())
