"""One stream on the CPU against llama.cpp: unweight's decode step against llama.cpp's, in process,
on the same BF16 weights and the same threads.

- llama.cpp: llama-cpp-python built from source for this CPU (`GGML_NATIVE`; tests/envs.py's
  `llamacpp_site`, made once), on a BF16 GGUF made by llama.cpp's own converter from the BF16
  folder; `Llama.eval` over the prompt, then one `eval` a token, the next token the argmax of its
  logits. It runs in a process of its own (its threads and allocator apart from torch's).
- unweight: `unweight.load` on the compressed folder (`--dtype auto`: BF16 on an AVX512_BF16 CPU),
  `prefill`, then one `decode_step` a token, the next token the argmax of its logits.

Each side gets the same prompts of random token ids (seeded) and generates --tokens tokens greedily;
TTFT is the prompt's forward and its first token, ITL each later step. The sides alternate, the order
reversed every other round, --rounds rounds. Models (--models):

| name | what |
| --- | --- |
| smollm2 | SmolLM2-135M-Instruct (the tests' BF16 folder of the real model) |
| llama-1b | Llama-3.2-1B's shape with random weights (2.5 GB in BF16, far past L3: the bytes decide) |

With --served, then both sides' OpenAI servers over HTTP, started one at a time and alternated the
same way: `unweight serve --no-disagg` on the compressed folder, and llama-cpp-python's own server
(`python -m llama_cpp.server`) on the GGUF, on the same threads. Each takes the prompts as text (the
random ids decoded by the folder's tokenizer; each server tokenizes them itself) in streamed greedy
completions of exactly --tokens tokens (`min_tokens`); TTFT and ITL at the client, one chunk a
token. Last, unweight's served figures against its in-process ones of the same run: what the
server's token path adds.

    python benchmarks/llamacpp_bench.py [--models smollm2,llama-1b] [--prompts 8] [--prompt-len 256]
        [--tokens 64] [--rounds 2] [--threads N] [--served] [--out benchmarks/results/llamacpp_bench.json]

The first run builds llama-cpp-python (about 10 minutes on two cores) and converts each folder.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test support: envs
from cpu_serve_bench import Running  # noqa: E402
from serve_bench import free_port  # noqa: E402
from side_by_side import cpu_flags, table, write_record  # noqa: E402

NAME = "bench"  # the model name both servers answer to

# Llama-3.2-1B's config.json, less what the runtime does not read; SmolLM2's tokenizer pads to its vocabulary
LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=4096,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)

# The llama.cpp side, run by the llama-cpp-python site's interpreter: a job as JSON on stdin, its runs on stdout.
LLAMACPP_CHILD = r"""
import json, sys, time
import numpy as np
import llama_cpp
job = json.load(sys.stdin)
llm = llama_cpp.Llama(model_path=job["gguf"], n_threads=job["threads"], n_threads_batch=job["threads"],
                      n_ctx=job["ctx"], n_batch=job["ctx"], verbose=False)
vocab = llm.n_vocab()
def argmax():  # of the last token's logits (llama.cpp keeps only those without logits_all)
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))
runs = []
for prompt in job["prompts"]:
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    ids = [argmax()]
    ttft = time.perf_counter() - t0
    itl = []
    for _ in range(job["tokens"] - 1):
        t0 = time.perf_counter()
        llm.eval(ids[-1:])
        ids.append(argmax())
        itl.append(time.perf_counter() - t0)
    runs.append({"ttft_s": ttft, "itl_s": itl, "ids": ids})
print(json.dumps({"runs": runs, "system_info": llama_cpp.llama_print_system_info().decode()}))
"""


def bf16_folder(name: str) -> Path:
    """The model's BF16 Hugging Face folder, made once in the cache."""
    from unweight.defaults import cache_dir
    from unweight.testing import smollm2_bf16

    smollm2 = smollm2_bf16(cache_dir() / "smollm2-bf16")
    if name == "smollm2":
        return smollm2
    from tiny_models import _save
    from transformers import LlamaConfig, LlamaForCausalLM

    dst = cache_dir() / "llama-1b-random-bf16"
    if not dst.exists():
        torch.manual_seed(0)
        print(f"making {dst} (random weights in Llama-3.2-1B's shape) ...", flush=True)
        _save(LlamaForCausalLM(LlamaConfig(**LLAMA_1B)), dst, smollm2)
    return dst


def compressed(src: Path) -> Path:
    import unweight
    from unweight.defaults import cache_dir

    dst = cache_dir() / f"{src.name}-uw"
    if not dst.exists():
        unweight.compress(src, dst)
    return dst


def gguf(src: Path, site: Path) -> Path:
    """`src` as a BF16 GGUF by llama.cpp's converter (from the same source as the binding), made once."""
    from unweight.defaults import cache_dir

    dst = cache_dir() / f"{src.name}.bf16.gguf"
    if not dst.exists():
        tmp = dst.with_suffix(".tmp")
        env = {**os.environ, "PYTHONPATH": f"{site / 'convert' / 'gguf-py'}:{site / 'convert'}"}
        cmd = [sys.executable, site / "convert" / "convert_hf_to_gguf.py", src, "--outtype", "bf16", "--outfile", tmp]
        print(f"converting {src} to {dst} (llama.cpp's convert_hf_to_gguf.py) ...", flush=True)
        done = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"convert_hf_to_gguf.py failed: {done.stderr.strip()[-2000:]}")
        tmp.rename(dst)
    return dst


def gguf_weight_bytes(path: Path) -> int:
    """The bytes of the GGUF's tensors (a tied embedding once: it is read whole as the output layer)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


def run_child(site: Path, code: str, job: dict) -> dict:
    """`code` run by this interpreter with the llama.cpp site on its path, `job` as JSON on its stdin;
    what it prints as JSON."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(job), capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


def run_llamacpp(site: Path, path: Path, prompts: list[list[int]], tokens: int, threads: int) -> dict:
    job = {"gguf": str(path), "prompts": prompts, "tokens": tokens, "threads": threads}
    job["ctx"] = max(map(len, prompts)) + tokens
    return run_child(site, LLAMACPP_CHILD, job)


def start(models: str) -> tuple[list[str], Path, dict]:
    """The --models named (smollm2, llama-1b; anything else refused), llama.cpp's site for this CPU
    (built on first use), and a record begun with the date and llama.cpp's version."""
    from envs import LLAMACPP_REQUIREMENT, llamacpp_site

    names = models.split(",")
    if unknown := set(names) - {"smollm2", "llama-1b"}:
        raise SystemExit(f"--models: unknown {', '.join(sorted(unknown))} (smollm2, llama-1b)")
    print(f"CPU: {cpu_flags()}\nbuilding or finding {LLAMACPP_REQUIREMENT} for this CPU ...", flush=True)
    site = llamacpp_site()
    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "llama_cpp": LLAMACPP_REQUIREMENT}
    return names, site, record


def run_unweight(model, prompts: list[list[int]], tokens: int) -> dict:
    runs = []
    for prompt in prompts:
        seq = model.new_sequence()
        try:
            t0 = time.perf_counter()
            ids = [int(model.prefill(seq, prompt).argmax())]
            ttft = time.perf_counter() - t0
            itl = []
            for _ in range(tokens - 1):
                t0 = time.perf_counter()
                ids.append(int(model.decode_step([seq], ids[-1:])[0].argmax()))
                itl.append(time.perf_counter() - t0)
        finally:
            model.free(seq)
        runs.append({"ttft_s": ttft, "itl_s": itl, "ids": ids})
    return {"runs": runs}


def served(side: str, site: Path, path: Path, uw: Path, args, threads: int, log: Path) -> Running:
    """One side's OpenAI server, started and ready: `unweight serve --no-disagg` on the compressed
    folder, or llama-cpp-python's own server (`python -m llama_cpp.server`) on the GGUF, on the same
    threads and context."""
    ctx, port = str(args.prompt_len * 2 + args.tokens), str(free_port())
    where = ["--host", "127.0.0.1", "--port", port]
    if side == "unweight":
        cmd = [sys.executable, "-m", "unweight.cli.main", "serve", str(uw), "--no-disagg", "--dtype", args.dtype]
        cmd += ["--worker-threads", str(threads), "--max-model-len", ctx, "--served-model-name", NAME, *where]
        server = Running(cmd, log, dict(os.environ))
    else:
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--model_alias", NAME, *where]
        cmd += ["--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", ctx, "--n_batch", ctx]
        env = {**os.environ, "PYTHONPATH": f"{site}:{site / 'server'}"}
        server = Running(cmd, log, env, ready="/v1/models")
    try:
        server.wait_ready(600)
    except Exception:
        server.stop()
        raise
    return server


def run_served(url: str, prompts: list[str], tokens: int) -> dict:
    """Each prompt as one streamed greedy completion of exactly `tokens` tokens (min_tokens, which both
    servers take), timed at the client: TTFT from the request to the first chunk with text, ITL the
    gaps between chunks with text (a token a chunk, but for a piece of a character a server holds
    back), decode tokens/s the tokens after the first over the time from its chunk to the last one."""
    runs = []
    # one client for every request, as an application holds one: httpx.stream() makes a new one a
    # call, and that took 16-28 ms here (its TLS context), all of it inside the TTFT measured
    with httpx.Client(timeout=600) as client:
        for text in prompts:
            runs.append(_streamed(client, url, text, tokens))
    return {"runs": runs}


def _streamed(client: httpx.Client, url: str, text: str, tokens: int) -> dict:
    """One prompt's streamed completion through `client`, timed as run_served says."""
    body = {"model": NAME, "prompt": text, "max_tokens": tokens, "min_tokens": tokens, "temperature": 0}
    arrivals, t0, end, done = [], time.perf_counter(), None, 0
    with client.stream("POST", url + "/v1/completions", json=body | {"stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices") or ():
                end = time.perf_counter()
                if choice.get("text"):
                    arrivals.append(end)
                done += choice.get("finish_reason") is not None
    if not arrivals or done != 1:
        raise SystemExit(f"{url}: a completion of {len(arrivals)} chunks with text, {done} finish reasons")
    return {
        "ttft_s": arrivals[0] - t0,
        "itl_s": [b - a for a, b in zip(arrivals, arrivals[1:])],
        "decode_tok_s": (tokens - 1) / (end - arrivals[0]),
        "chunks": len(arrivals),
    }


def figures(result: dict) -> dict:
    """One side's round: per prompt decode tokens/s (after the first token), ITL p50 and TTFT, in ms."""
    runs = result["runs"]
    return {
        "decode_tok_s": [r.get("decode_tok_s") or len(r["itl_s"]) / sum(r["itl_s"]) for r in runs],
        "itl_p50_ms": [1e3 * statistics.median(r["itl_s"]) for r in runs],
        "ttft_ms": [1e3 * r["ttft_s"] for r in runs],
    }


def bench(name: str, site: Path, args) -> dict:
    import unweight

    src = bf16_folder(name)
    uw, path = compressed(src), gguf(src, site)
    if args.threads:  # the compute threads, torch's and numba's (load's `threads` are the decoder's)
        from unweight.runtime.threads import set_threads

        set_threads(args.threads)
    model = unweight.load(uw, dtype=args.dtype)
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    vocab = min(model.config.vocab_size, 49152)  # ids the tokenizer has (the 1B shape pads SmolLM2's)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    dtype = str(model.compute_dtype).removeprefix("torch.")
    print(f"\n{name}: {uw} ({dtype}) against {path}, {threads} threads", flush=True)
    run_unweight(model, prompts[:1], 4)  # warm: the autotuner's choices, numba's loads, the allocator
    sides: dict[str, list[dict]] = {"llama.cpp": [], "unweight": []}
    info, ids = "", {}
    for r in range(args.rounds):
        for side in ("llama.cpp", "unweight") if r % 2 == 0 else ("unweight", "llama.cpp"):
            if side == "llama.cpp":
                out = run_llamacpp(site, path, prompts, args.tokens, threads)
                info = out["system_info"]
            else:
                out = run_unweight(model, prompts, args.tokens)
            ids[side] = out["runs"][0]["ids"]
            sides[side].append(figures(out))
            med = statistics.median(sides[side][-1]["decode_tok_s"])
            print(f"round {r + 1} {side}: decode {med:.1f} tok/s", flush=True)
    rows = [("decode tok/s", "decode_tok_s"), ("ITL p50 ms", "itl_p50_ms"), ("TTFT ms", "ttft_ms")]
    summary = table(sides["llama.cpp"], sides["unweight"], rows, ("llama.cpp", "unweight"))
    same = next((i for i, (a, b) in enumerate(zip(ids["llama.cpp"], ids["unweight"])) if a != b), len(ids["unweight"]))
    weights = {"llama.cpp": gguf_weight_bytes(path), "unweight": model.resident_weight_bytes()}
    print(
        f"weights read a token: llama.cpp {weights['llama.cpp'] / 1e6:.1f} MB, unweight {weights['unweight'] / 1e6:.1f}"
        f" MB ({weights['unweight'] / weights['llama.cpp']:.2f}x); the first prompt's greedy ids agree for {same}"
        f" of {args.tokens} tokens (BF16 sums in another order part them on near ties)\nllama.cpp: {info}"
    )
    record = {"dtype": dtype, "threads": threads, "summary": summary, "rounds": sides, "weight_bytes": weights}
    record |= {"same_leading_ids": same, "llama_cpp_system_info": info, "compressed": str(uw), "gguf": str(path)}
    if args.served:
        del model  # the server loads its own
        g = torch.Generator().manual_seed(1)  # one more prompt for the servers' warm-ups: a server keeping its
        warm = torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()  # last prompt would not see it again
        texts = [tokenizer_of(src).decode(p) for p in [*prompts, warm]]
        record["served"] = bench_served(site, path, uw, texts, args, threads, sides["unweight"])
    return record


def tokenizer_of(src: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(src)


def bench_served(site: Path, path: Path, uw: Path, texts: list[str], args, threads: int, in_process: list) -> dict:
    """The prompts as text (each server tokenizes them) through both servers, started one at a time,
    alternated as the in-process sides are; then unweight's served ITL against its in-process ITL of
    this run."""
    sides: dict[str, list[dict]] = {"llama.cpp": [], "unweight": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side in ("llama.cpp", "unweight") if r % 2 == 0 else ("unweight", "llama.cpp"):
                server = served(side, site, path, uw, args, threads, Path(tmp) / f"{side}-{r}.log")
                try:
                    run_served(server.url, texts[-1:], 4)  # warm-up, on a prompt measured on neither side
                    out = run_served(server.url, texts[:-1], args.tokens)
                finally:
                    server.stop()
                sides[side].append(figures(out))
                med = statistics.median(sides[side][-1]["decode_tok_s"])
                print(f"round {r + 1} {side}, served: decode {med:.1f} tok/s", flush=True)
    rows = [("decode tok/s", "decode_tok_s"), ("ITL p50 ms", "itl_p50_ms"), ("TTFT ms", "ttft_ms")]
    print("served over HTTP (streamed completions of the prompts as text):")
    summary = table(sides["llama.cpp"], sides["unweight"], rows, ("llama.cpp", "unweight"))
    print("unweight served against in process, this run:")
    over = table(in_process, sides["unweight"], rows, ("in process", "served"))
    return {"summary": summary, "rounds": sides, "unweight_served_over_in_process": over}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,llama-1b")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="both sides' threads (default: the runtime's)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"), help="unweight's compute")
    ap.add_argument(
        "--served", action="store_true", help="also both OpenAI servers over HTTP, and unweight served/in process"
    )
    ap.add_argument("--out", default="benchmarks/results/llamacpp_bench.json")
    args = ap.parse_args()
    names, site, record = start(args.models)
    record |= {"prompts": args.prompts, "prompt_len": args.prompt_len, "tokens": args.tokens, "models": {}}
    for name in names:
        record["models"][name] = bench(name, site, args)
    print(f"CPU: {cpu_flags()}")
    write_record(args.out, record)


if __name__ == "__main__":
    main()
