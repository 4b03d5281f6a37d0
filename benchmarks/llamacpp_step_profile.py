"""Where one decode step of llama.cpp's goes, by part (#54), for docs/kernels.md beside our own
step's (step_profile.py): the same parts, from llama.cpp's own graph.

llama-cpp-python built for this CPU (tests/envs.py's `llamacpp_site`), on the BF16 GGUF of the
model (llamacpp_bench.py makes both), prefills --prompt random token ids, then decodes --tokens
greedy tokens one `eval` at a time, in a process of its own, twice over:

- plain: the step's wall time, llama.cpp as it runs;
- by node: a second context with ggml's scheduler callback (`cb_eval`), which asks to see every
  node of the step's graph, so the scheduler computes the graph one node at a time and each node's
  time is the gap between the callback's two calls for it. Each node then starts its own parallel
  region where llama.cpp's whole graph runs in one: that cost lands in every node, and the step
  node by node exceeds the plain one by it. Each part is reported as measured and less that cost
  (the excess over the plain step, per node, times the part's nodes).

The nodes go to the parts of step_profile.py (its PARTS) by their operator and the name llama.cpp's graph gives
them: matrix products named Qcur/Kcur/Vcur (q, k, v: three products, where the runtime makes one),
attn_out (o), ffn_gate/ffn_up, ffn_down and result_output (the LM head); RMS_NORM and the norms'
weight products; attention (ROPE, the KV cache stores, the attention products, softmax or
FLASH_ATTN_EXT); the MLP's activation (SwiGLU); the residual adds; everything else is `rest`, with
what the plain step spends outside the graph (the batch, logits out, Python).

    python benchmarks/llamacpp_step_profile.py [--models smollm2,llama-1b] [--prompt 256] [--tokens 32]
        [--rounds 3] [--threads N] [--out benchmarks/results/llamacpp_step_profile.json]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test support: envs
sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_bench import bf16_folder, gguf, run_child, start  # noqa: E402
from side_by_side import write_record  # noqa: E402
from step_profile import PARTS  # noqa: E402

# the child: llama.cpp's steps, plain then node by node, as JSON on stdout
CHILD = r"""
import ctypes, json, sys, time
import numpy as np
import llama_cpp
from llama_cpp import _internals

job = json.load(sys.stdin)
llm = llama_cpp.Llama(model_path=job["gguf"], n_threads=job["threads"], n_threads_batch=job["threads"],
                      n_ctx=job["ctx"], n_batch=job["ctx"], verbose=False)
lib = ctypes.CDLL(job["lib"] + "/libggml-base.so")
lib.ggml_get_name.restype = lib.ggml_op_desc.restype = ctypes.c_char_p
lib.ggml_get_name.argtypes = lib.ggml_op_desc.argtypes = [ctypes.c_void_p]
seen = {"on": False, "at": 0.0, "nodes": []}


@llama_cpp.ggml_backend_sched_eval_callback
def each_node(t, ask, _):
    if not seen["on"]:
        return not ask  # the prompt: no node asked for, the graph runs whole
    now = time.perf_counter()
    if ask:  # the scheduler computes up to this node, then calls again
        seen["at"] = now
        return True
    seen["nodes"].append((lib.ggml_get_name(t).decode(), lib.ggml_op_desc(t).decode(), now - seen["at"]))
    return True


vocab = llm.n_vocab()
plain = llm._ctx
params = llm.context_params
params.cb_eval = each_node
by_node = _internals.LlamaContext(model=llm._model, params=params, verbose=False)
out = {"plain_s": [], "steps": []}
for r in range(job["rounds"]):
    for which in ("plain", "by_node"):
        llm._ctx = plain if which == "plain" else by_node
        llm.reset()
        llm._ctx.kv_cache_clear()
        llm.eval(job["prompt"])
        tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))
        for _ in range(job["tokens"]):
            seen["on"], seen["nodes"] = which == "by_node", []
            t0 = time.perf_counter()
            llm.eval([tok])
            tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))
            dt = time.perf_counter() - t0
            seen["on"] = False
            if which == "plain":
                out["plain_s"].append(dt)
            else:
                out["steps"].append({"wall_s": dt, "nodes": seen["nodes"]})
print(json.dumps(out))
"""

# (operator, name pattern) -> part; the first that matches takes the node
RULES = [
    ("MUL_MAT", r"^(Qcur|Kcur|Vcur)-\d+$", "qkv_proj"),
    ("MUL_MAT", r"^attn_out-\d+$", "o_proj"),
    ("MUL_MAT", r"^ffn_(gate|up)-\d+$", "gate_up_proj"),
    ("MUL_MAT", r"^ffn_(down|out)-\d+$", "down_proj"),
    ("MUL_MAT", r"^result_output$", "lm_head"),
    ("RMS_NORM", r"", "norms"),
    ("MUL", r"^(attn_norm|ffn_norm|norm|result_norm)(-\d+)?$", "norms"),
    ("ROPE", r"", "attention"),
    ("SET_ROWS", r"", "attention"),
    ("CPY", r"^(k|v)_cache", "attention"),
    ("FLASH_ATTN_EXT", r"", "attention"),
    ("SOFT_MAX", r"", "attention"),
    ("MUL_MAT", r"^(kq|kqv)(-\d+)?", "attention"),
    ("CONT", r"^kqv_out", "attention"),
    ("GLU", r"", "activation"),
    ("SWIGLU", r"", "activation"),
    ("SILU", r"", "activation"),
    ("MUL", r"^ffn_(gate_par|swiglu)", "activation"),
    ("ADD", r"^(ffn_inp|l_out)-\d+$", "residuals"),
]


def part_of(name: str, op: str) -> str:
    for rule_op, pattern, part in RULES:
        if op == rule_op and re.search(pattern, name):
            return part
    return "rest"


def profile(name: str, site: Path, args) -> dict:
    src = bf16_folder(name)
    path = gguf(src, site)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 49152, (args.prompt,), generator=g).tolist()
    job = {"gguf": str(path), "prompt": prompt, "tokens": args.tokens, "rounds": args.rounds}
    job |= {"threads": args.threads, "ctx": args.prompt + args.tokens + 8, "lib": str(site / "llama_cpp" / "lib")}
    out = run_child(site, CHILD, job)
    parts, counts, other = [], dict.fromkeys(PARTS, 0), {}
    for step in out["steps"]:
        t = dict.fromkeys(PARTS, 0.0)
        for node, op, s in step["nodes"]:
            part = part_of(node, op)
            t[part] += s
            counts[part] += 1
            if part == "rest":
                key = op + " " + re.sub(r"-\d+$", "-N", node)
                other[key] = other.get(key, 0.0) + s
        t["rest"] += step["wall_s"] - sum(s for _, _, s in step["nodes"])  # outside the graph
        parts.append(t)
    plain = statistics.median(out["plain_s"])
    by_node = statistics.median(s["wall_s"] for s in out["steps"])
    med = {p: statistics.median(t[p] for t in parts) for p in PARTS}
    nodes = {p: counts[p] / len(parts) for p in PARTS}
    # what running node by node costs a node (a parallel region started, two callbacks), taken off
    # each part by its count of nodes for its share of the plain step
    per_node = (by_node - plain) / sum(nodes.values())
    est = {p: max(0.0, med[p] - nodes[p] * per_node) for p in PARTS}
    print(f"\n{name}: {path.name}, {args.threads} threads, {len(out['plain_s'])} plain steps, {len(parts)} by node")
    print(
        f"step ms: plain {1e3 * plain:.2f}, node by node {1e3 * by_node:.2f} ({by_node / plain:.2f}x; "
        f"{1e6 * per_node:.1f} us a node over {sum(nodes.values()):.0f} nodes)"
    )
    print("| part | nodes | ms node by node | ms, less the per-node cost | share of the plain step |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for p in PARTS:
        print(f"| {p} | {nodes[p]:.0f} | {1e3 * med[p]:.3f} | {1e3 * est[p]:.3f} | {100 * est[p] / plain:.1f}% |")
    steps = len(parts)
    rest = sorted(other.items(), key=lambda kv: -kv[1])[:8]
    print("rest, inside the graph: " + ", ".join(f"{k} {1e3 * v / steps:.3f} ms" for k, v in rest))
    return {
        "gguf": str(path),
        "plain_step_ms": {"median": 1e3 * plain, "min": 1e3 * min(out["plain_s"]), "max": 1e3 * max(out["plain_s"])},
        "node_by_node_step_ms": 1e3 * by_node,
        "parts_ms_node_by_node": {p: 1e3 * v for p, v in med.items()},
        "nodes_by_part": nodes,
        "per_node_cost_us": 1e6 * per_node,
        "parts_ms_less_per_node_cost": {p: 1e3 * v for p, v in est.items()},
        "rest_in_graph_ms": {k: 1e3 * v / steps for k, v in rest},
        "nodes_per_step": statistics.median(len(s["nodes"]) for s in out["steps"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,llama-1b")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp's threads (default: torch's, the runtime's)")
    ap.add_argument("--out", default="benchmarks/results/llamacpp_step_profile.json")
    args = ap.parse_args()
    args.threads = args.threads or torch.get_num_threads()
    names, site, record = start(args.models)
    record |= {"prompt": args.prompt, "tokens": args.tokens, "threads": args.threads, "models": {}}
    for name in names:
        record["models"][name] = profile(name, site, args)
    write_record(args.out, record)


if __name__ == "__main__":
    main()
