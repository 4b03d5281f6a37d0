"""Where one decode step's time goes (#54): the runtime's step at batch 1 on the CPU, by part.

The model (SmolLM2-135M compressed, or --model DIR) prefills a prompt of --prompt random token ids,
then decodes --tokens greedy tokens one step at a time, in two variants that differ only in the
linears: `unweight` (UnweightLinear: the resident tiles, the autotuner's pipeline) and `dense`
(the same runtime with each linear's decoded weight in a plain F.linear, in the compute dtype, as
the compressed model's twin in tests/test_generate.py). The variants alternate, --rounds times.

Per variant:
  step ms      each decode step's wall time, no hooks (median and range over steps and rounds);
  layer by layer  the same steps through the layers' modules, one launcher a kernel (a decode step's
               plan of native calls, runtime/model/native_step.py, off);
  by part      those steps timed again with a forward hook before and after every module, each
               module's time less its children's: the linears by name (q/k/v, o, gate/up, down,
               lm_head), the RMS norms, attention's own work (rope, the KV cache write, the attend),
               the MLP's activation (silu x up), the layers' residual adds, and the rest of the step
               (embedding lookup, the step's plan and positions, the loop in Python): the step's wall
               time less the modules'. The hooks' own cost lands in the parts and is reported as the
               hooked step's excess over the plain one;
  torch ops    the aten operators a step calls, counted by torch.profiler over 16 more steps;
  GB/s         the linears' weight bytes (resident for unweight; for dense, the weight in the compute
               dtype, as F.linear reads it) over their time.

Run:  python benchmarks/step_profile.py [--model DIR] [--dtype auto|float32|bfloat16] [--prompt 256]
                                        [--tokens 64] [--rounds 3] [--threads N] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import unweight
from unweight.runtime.layers.linear import UnweightLinear
from unweight.runtime.model.llama import MLP, Attention, DecoderLayer, RMSNorm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import prepare_model  # noqa: E402
from side_by_side import cpu_flags, write_record  # noqa: E402

LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
PARTS = (*LINEARS, "norms", "attention", "activation", "residuals", "rest")


class DenseLinear(nn.Module):
    """A linear's decoded BF16 weight in a plain F.linear, in the compute dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.weight = weight.to(dtype)
        self.bias = bias
        self.weight_bytes = self.weight.numel() * self.weight.element_size()  # what F.linear reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def densify(model: nn.Module) -> None:
    """Every UnweightLinear of `model` replaced by its DenseLinear (a tied head shares its twin)."""
    twins: dict[int, DenseLinear] = {}
    for module in list(model.modules()):
        for attr, child in list(module.named_children()):
            if isinstance(child, UnweightLinear) and attr != "embed_tokens":  # the lookup reads rows()
                if id(child) not in twins:
                    twins[id(child)] = DenseLinear(child.decoded_weight(), child.bias, model.compute_dtype)
                setattr(module, attr, twins[id(child)])


def part_of(name: str, module: nn.Module) -> str | None:
    leaf = name.rpartition(".")[2]
    if leaf in LINEARS:
        return leaf
    if isinstance(module, RMSNorm):
        return "norms"
    if isinstance(module, Attention):
        return "attention"
    if isinstance(module, MLP):
        return "activation"
    if isinstance(module, DecoderLayer):
        return "residuals"
    return None


class Hooks:
    """Exclusive time per part: each hooked module's wall time less its hooked children's."""

    def __init__(self, model: nn.Module):
        self.ns: dict[str, int] = defaultdict(int)
        self.stack: list[list] = []  # [part, start, children's ns]
        self.handles, self.patched = [], []
        seen = set()
        for name, module in model.named_modules(remove_duplicate=False):  # a tied lm_head under its own name
            part = part_of(name, module)
            if part is None or id(module) in seen:
                continue
            seen.add(id(module))
            self.handles.append(module.register_forward_pre_hook(lambda m, a, p=part: self._enter(p)))
            self.handles.append(module.register_forward_hook(lambda m, a, out: self._leave()))
            if isinstance(module, RMSNorm):  # a decode step calls its native twin, past the hooks
                self.patched.append(module)
                module.native = self._timed(module.native, part)

    def _timed(self, fn, part: str):
        def timed(*args, **kw):
            self._enter(part)
            try:
                return fn(*args, **kw)
            finally:
                self._leave()

        return timed

    def _enter(self, part: str) -> None:
        self.stack.append([part, time.perf_counter_ns(), 0])

    def _leave(self) -> None:
        part, start, children = self.stack.pop()
        took = time.perf_counter_ns() - start
        self.ns[part] += took - children
        if self.stack:
            self.stack[-1][2] += took

    def take(self) -> dict[str, int]:
        out, self.ns = dict(self.ns), defaultdict(int)
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for module in self.patched:
            del module.native


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """The bytes each linear part reads a step: resident for UnweightLinear, the compute dtype's for DenseLinear."""
    out: dict[str, int] = defaultdict(int)
    seen = set()
    for name, module in model.named_modules(remove_duplicate=False):
        leaf = name.rpartition(".")[2]
        if leaf in LINEARS and id(module) not in seen:
            seen.add(id(module))
            out[leaf] += module.stored_bytes if isinstance(module, UnweightLinear) else module.weight_bytes
    return dict(out)


def run_steps(model, prompt: list[int], tokens: int, hooks: Hooks | None) -> tuple[list[float], list[dict]]:
    """Prefill, then `tokens` greedy decode steps: each step's seconds and, hooked, its parts' ns."""
    seq = model.new_sequence()
    try:
        logits = model.prefill(seq, prompt)
        token = int(logits.argmax())
        times, parts = [], []
        for _ in range(tokens):
            if hooks is not None:
                hooks.take()
            t0 = time.perf_counter_ns()
            logits = model.decode_step([seq], [token])
            took = time.perf_counter_ns() - t0
            token = int(logits[0].argmax())
            times.append(took / 1e9)
            if hooks is not None:
                p = hooks.take()
                p["rest"] = took - sum(p.values())
                parts.append(p)
        return times, parts
    finally:
        model.free(seq)


@contextlib.contextmanager
def layer_by_layer(model):
    """Decode steps through the layers' modules (their native calls one launcher at a time), not as
    the step's plan of native calls: the plan's step has no module for a hook to time."""
    model._native_step = lambda x: None
    try:
        yield
    finally:
        del model._native_step


def torch_ops(model, prompt: list[int], tokens: int) -> dict[str, float]:
    """torch's operators a decode step calls (torch.profiler over `tokens` steps), per step: every
    aten operator's calls, nested ones included (aten::to calls aten::_to_copy), most called first."""
    from torch.profiler import ProfilerActivity, profile

    seq = model.new_sequence()
    try:
        token = int(model.prefill(seq, prompt).argmax())
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(tokens):
                token = int(model.decode_step([seq], [token])[0].argmax())
    finally:
        model.free(seq)
    calls = {e.key: e.count / tokens for e in prof.key_averages() if e.key.startswith("aten::")}
    return dict(sorted(calls.items(), key=lambda kv: -kv[1]))


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a compressed folder (default: SmolLM2-135M, compressed once)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--prompt", type=int, default=256, help="prompt length in random token ids")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps a run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the runtime's)")
    ap.add_argument("--out", default="benchmarks/results/step_profile.json")
    args = ap.parse_args()
    model_dir = prepare_model(args.model)
    cpu = cpu_flags()
    variants = {}
    for name in ("unweight", "dense"):
        m = unweight.load(model_dir, dtype=args.dtype, threads=args.threads)
        if name == "dense":
            densify(m)
        variants[name] = m
    dtype = str(variants["unweight"].compute_dtype).removeprefix("torch.")
    g = torch.Generator().manual_seed(0)
    vocab = variants["unweight"].config.vocab_size
    prompt = torch.randint(0, vocab, (args.prompt,), generator=g).tolist()
    print(f"CPU: {cpu}\nmodel {model_dir}; compute {dtype}; torch threads {torch.get_num_threads()}", flush=True)
    for m in variants.values():  # warm: the autotuner's choices, numba's loads, the allocator
        run_steps(m, prompt, 4, None)

    plain: dict[str, list[float]] = defaultdict(list)
    hooked: dict[str, list[float]] = defaultdict(list)
    parts: dict[str, list[dict]] = defaultdict(list)
    layered: list[float] = []
    for r in range(args.rounds):
        for name, m in variants.items():
            times, _ = run_steps(m, prompt, args.tokens, None)
            plain[name] += times
            with layer_by_layer(m):  # a step's plan (native_step.py) calls no module: the hooks see the layers'
                if name == "unweight":
                    layered += run_steps(m, prompt, args.tokens, None)[0]
                hooks = Hooks(m)
                try:
                    times, p = run_steps(m, prompt, args.tokens, hooks)
                finally:
                    hooks.remove()
            hooked[name] += times
            parts[name] += p
            last = statistics.median(plain[name][-args.tokens :])
            print(f"round {r + 1} {name}: step {1e3 * last:.2f} ms", flush=True)

    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "model": str(model_dir)}
    record |= {"dtype": dtype, "threads": torch.get_num_threads(), "prompt": args.prompt, "tokens": args.tokens}
    record |= {"rounds": args.rounds, "variants": {}}
    print(f"\n| part | {' | '.join(f'{n} ms' for n in variants)} | {' | '.join(f'{n} GB/s' for n in variants)} |")
    print("| --- |" + " ---: |" * (2 * len(variants)))
    for name, m in variants.items():
        wb = weight_bytes(m)
        by_part = {p: summary([s.get(p, 0) / 1e6 for s in parts[name]]) for p in PARTS}
        record["variants"][name] = {
            "step_ms": summary([1e3 * t for t in plain[name]]),
            "hooked_step_ms": summary([1e3 * t for t in hooked[name]]),
            "parts_ms": by_part,
            "weight_bytes": wb,
            "GBps": {p: wb[p] / (by_part[p]["median"] / 1e3) / 1e9 for p in LINEARS if by_part[p]["median"] > 0},
            "aten_calls_per_step": torch_ops(m, prompt, 16),
        }
    v = record["variants"]
    for p in PARTS:
        ms = " | ".join(f"{v[n]['parts_ms'][p]['median']:.3f}" for n in variants)
        gbps = " | ".join(f"{v[n]['GBps'][p]:.1f}" if p in v[n]["GBps"] else "-" for n in variants)
        print(f"| {p} | {ms} | {gbps} |")
    v["unweight"]["layered_step_ms"] = summary([1e3 * t for t in layered])
    v["dense"]["layered_step_ms"] = v["dense"]["step_ms"]  # no plan takes DenseLinear: the same runs
    rows = (("hooked_step_ms", "step, hooked"), ("layered_step_ms", "step, layer by layer"), ("step_ms", "step"))
    for key, label in rows:
        row = " | ".join(f"{v[n][key]['median']:.2f} ({v[n][key]['min']:.2f}-{v[n][key]['max']:.2f})" for n in variants)
        print(f"| {label} | {row} |" + " - |" * len(variants))
    linear_ms = {n: sum(v[n]["parts_ms"][p]["median"] for p in LINEARS) for n in variants}
    for n in variants:
        mb = sum(v[n]["weight_bytes"].values()) / 1e6
        layers, step = v[n]["layered_step_ms"]["median"], v[n]["step_ms"]["median"]
        print(
            f"{n}: linears {linear_ms[n]:.2f} ms of a {layers:.2f} ms step through the layers "
            f"({step:.2f} ms as run), {mb:.1f} MB read"
        )
        calls = v[n]["aten_calls_per_step"]
        top = ", ".join(f"{k.removeprefix('aten::')} {c:.0f}" for k, c in list(calls.items())[:10])
        print(f"  torch operators a step: {sum(calls.values()):.0f} calls, nested ones included; most: {top}")
    print(f"CPU: {cpu}")
    write_record(args.out, record)


if __name__ == "__main__":
    main()
