"""transformers on the CPU: `from_pretrained` of a compressed folder (the unweight quantizer) against
`from_pretrained` of its BF16 source, in the same compute dtype.

Models: SmolLM2-135M-Instruct (real weights), or with --model 8b-layers a random Llama with
Llama-3.1-8B's layer shapes (hidden 4096, MLP 14336, 32 query and 8 kv heads; --layers of them,
a 32000-token vocabulary, untied head).

Each side runs in a fresh process, the sides alternated over --rounds, so that a slow spell of the
machine hits both. In each: the load (`from_pretrained` wall time), the resident weight bytes
(`get_memory_footprint()`: parameters and buffers; the compressed side's streams are buffers), then
--reps greedy generations of 1 token (TTFT) and of --tokens tokens of a fixed prompt: decode
tokens/s = (tokens - 1) / (time - TTFT). Goals (issue #28): resident weights <= 0.72x BF16, decode
tokens/s >= 1.0x. With --task lora, instead: LoRA (PEFT, rank 8 on every linear of the decoder
layers) trained for --reps steps on a batch of 4 x 64 tokens after one warm-up step: the median
step time. Every run reports the process's peak RSS.

    python benchmarks/hf_bench.py [--task generate|lora] [--model smollm2|8b-layers] [--dtype float32|bfloat16]
                                  [--rounds 3] [--reps 3] [--tokens 32] [--layers 2]
                                  [--out benchmarks/results/hf_bench.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from side_by_side import cpu_flags, table

EIGHT_B_LAYER = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=32000,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(path: str, task: str, dtype: str, reps: int, tokens: int, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    import unweight  # noqa: F401  (registers the quantizer; the BF16 side loads as it would without it)

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    load_s = time.perf_counter() - t0
    weights = model.get_memory_footprint()
    if task == "lora":
        return lora_worker(model, reps, out, {"load_s": load_s, "weight_bytes": weights})
    ids = torch.randint(3, 500, (1, 64), generator=torch.Generator().manual_seed(0))

    def run(n: int) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t

    run(tokens)  # warm-up: the autotuner's first choices, page faults
    ttft, decode = [], []
    for _ in range(reps):
        t1, tn = run(1), run(tokens)
        ttft.append(t1)
        decode.append((tokens - 1) / (tn - t1))
    got = {
        "load_s": load_s,
        "weight_bytes": weights,
        "ttft_s": ttft,
        "decode_tok_s": decode,
        "peak_rss_bytes": peak_rss(),
    }
    Path(out).write_text(json.dumps(got))


def lora_worker(model, steps: int, out: str, got: dict) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(3, 500, (4, 64), generator=torch.Generator().manual_seed(0))
    times = []
    for step in range(steps + 1):  # the first is a warm-up
        t = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if step:
            times.append(time.perf_counter() - t)
    Path(out).write_text(json.dumps({**got, "step_s": times, "peak_rss_bytes": peak_rss()}))


def source(args) -> Path:
    from unweight.defaults import cache_dir
    from unweight.testing import smollm2_bf16

    if args.model == "smollm2":
        return smollm2_bf16(cache_dir() / "smollm2-bf16")
    dst = cache_dir() / f"bench-8b-layers-{args.layers}"
    if not dst.exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(num_hidden_layers=args.layers, **EIGHT_B_LAYER)
        with torch.device("cpu"):
            model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        tmp = dst.with_name(dst.name + ".tmp")
        model.save_pretrained(tmp)
        tmp.rename(dst)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="generate", choices=["generate", "lora"])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "8b-layers"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/hf_bench.json")
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker[0], args.task, args.dtype, args.reps, args.tokens, args.worker[1])

    src = source(args)
    with tempfile.TemporaryDirectory() as td:
        uw = Path(td) / "model-uw"
        subprocess.run(
            [sys.executable, "-m", "unweight.cli.main", "compress", str(src), str(uw)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        sides = {"transformers, BF16 folder": str(src), "transformers + unweight": str(uw)}
        runs: dict[str, list[dict]] = {s: [] for s in sides}
        for r in range(args.rounds):
            for side, model in sides.items():
                out = Path(td) / f"{r}-{len(runs[side])}-{len(side)}.json"
                opts = [
                    "--dtype",
                    args.dtype,
                    "--task",
                    args.task,
                    "--reps",
                    str(args.reps),
                    "--tokens",
                    str(args.tokens),
                ]
                cmd = [sys.executable, __file__, "--worker", model, str(out), *opts]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"{side} failed:\n{(done.stdout + done.stderr)[-3000:]}")
                runs[side].append(json.loads(out.read_text()))
                print(f"round {r + 1}: {side} done", file=sys.stderr)
    base, ours = (runs[s] for s in sides)
    bf16_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))  # the BF16 checkpoint (headers aside)

    print(
        f"\n{args.model}, {args.task}, {args.dtype} compute, {args.tokens} tokens, {args.rounds} rounds x "
        f"{args.reps} reps; {cpu_flags()}\n"
    )
    rows = [("load (s)", "load_s"), ("weights resident", "weight_bytes"), ("peak RSS", "peak_rss_bytes")]
    if args.task == "generate":
        rows += [("TTFT (s)", "ttft_s"), ("decode tokens/s", "decode_tok_s")]
    else:
        rows += [("LoRA step (s)", "step_s")]
    summary = table(base, ours, rows, ("bf16", "unweight"))
    resident = summary["weight_bytes"]["unweight"] / bf16_bytes
    summary["resident_vs_bf16_checkpoint"] = resident
    print(f"\ncompressed weights resident / the BF16 checkpoint's {bf16_bytes / 2**20:,.1f} MiB: {resident:.3f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "cpu": cpu_flags(), "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
