"""What a BF16 KV cache costs in exactness when the compute is FP32 (`--kv-cache-dtype bfloat16` on
a CPU): greedy tokens of SmolLM2-135M-Instruct against transformers' FP32 greedy tokens.

For each prompt (--prompts chat questions, fixed), --tokens greedy tokens (no EOS stop) from:
  ours FP32 KV   unweight.load(dtype="float32"): FP32 compute and cache
  ours BF16 KV   unweight.load(dtype="float32", kv_cache_dtype="bfloat16")
  HF BF16        transformers with the whole model in BF16 (what a BF16 deployment computes)
each compared token by token with transformers in FP32: whether the whole run is equal, and where
the first difference is.

Run:  python benchmarks/kv_dtype_bench.py [--tokens 64] [--out benchmarks/results/kv_dtype_bench.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from serve_bench import prepare_model
from side_by_side import cpu_flags, write_record

import unweight
from unweight.defaults import cache_dir
from unweight.testing import smollm2_bf16

QUESTIONS = [
    "What is the capital of France?",
    "Write a short story about a robot who learns to paint.",
    "List the planets of the solar system and one fact about each.",
    "Explain how a bicycle stays upright.",
    "Give me three tips for learning a new language.",
    "What causes the seasons on Earth?",
    "Describe the water cycle in simple terms.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet.",
    "How do vaccines work?",
    "What is a prime number? Give examples.",
    "Write a haiku about autumn.",
    "What are the benefits of regular exercise?",
    "How does a refrigerator keep food cold?",
    "Name five famous painters and one work by each.",
    "What is the difference between weather and climate?",
]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        tokens = []
        for _ in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def our_greedy(model, ids: list[int], n: int) -> list[int]:
    seq = model.new_sequence()
    try:
        last, tokens = model.prefill(seq, ids), []
        for _ in range(n):
            tokens.append(int(last.argmax()))
            last = model.decode_step([seq], [tokens[-1]])[0]
    finally:
        model.free(seq)
    return tokens


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=len(QUESTIONS))
    ap.add_argument("--model-dir")
    ap.add_argument("--out", default="benchmarks/results/kv_dtype_bench.json")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from unweight.runtime.generate import encode_prompt

    torch.set_grad_enabled(False)
    uw = prepare_model(args.model_dir)
    src = smollm2_bf16(cache_dir() / "smollm2-bf16")
    tok = unweight.load_tokenizer(uw)
    runs = {
        "ours FP32 KV": (our_greedy, unweight.load(uw, dtype="float32")),
        "ours BF16 KV": (our_greedy, unweight.load(uw, dtype="float32", kv_cache_dtype="bfloat16")),
        "HF BF16": (hf_greedy, AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()),
    }
    oracle = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    results = {name: [] for name in runs}
    for q in QUESTIONS[: args.prompts]:
        ids = encode_prompt(tok, [{"role": "user", "content": q}], chat=True)
        want = hf_greedy(oracle, ids, args.tokens)
        for name, (fn, model) in runs.items():
            results[name].append(first_difference(fn(model, ids, args.tokens), want))
    print(f"CPU: {cpu_flags()}; {args.prompts} chat prompts, {args.tokens} greedy tokens each, against HF FP32")
    print("| run | prompts equal throughout | first difference, median (range) where one exists |")
    print("| --- | ---: | --- |")
    summary = {}
    for name, diffs in results.items():
        at = [d for d in diffs if d is not None]
        where = f"{statistics.median(at):.0f} ({min(at)}-{max(at)})" if at else "-"
        print(f"| {name} | {diffs.count(None)} / {len(diffs)} | {where} |")
        summary[name] = {"equal": diffs.count(None), "prompts": len(diffs), "first_difference": diffs}
    write_record(
        args.out,
        {"benchmark": "kv_dtype_bench", "date": time.strftime("%Y-%m-%d"), "args": vars(args), "summary": summary},
    )


if __name__ == "__main__":
    main()
