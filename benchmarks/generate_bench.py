"""Side-by-side generation benchmark: unweight's runtime against transformers and bitsandbytes.

One run loads the same model (SmolLM2-135M-Instruct, BF16) in each of these forms and measures
all of them on the same prompts:

  * unweight, serving layout  (`unweight.load(dir, layout="serving")`: fixed-rate tiles)
  * unweight, serving layout computing in BF16  (`dtype="bfloat16"`; the serving row computes
    in dtype="auto": BF16 on CUDA and on AVX512_BF16 CPUs, FP32 on other CPUs)
  * unweight, archive layout  (`layout="archive"`: decodes every weight at every step, so it
    decodes --slow-tokens tokens instead of --tokens)
  * transformers BF16         (the speed baseline: "vs bf16" is decode tokens/s over its own)
  * transformers FP32         (the numerical reference for the drift columns)
  * bitsandbytes int8 and NF4 (from the same BF16 folder; a mode that cannot run on this
    device becomes a row with the error instead of stopping the run)

All transformers rows use attention "eager" (--attn) and a manual greedy loop over the KV cache
under no_grad, like unweight's prefill/decode_step loop, so every row does the same work: no
EOS stop, prefill computes the last position's logits only.

Per row:
  weights MB    resident weight bytes (unweight: `resident_weight_bytes()`; others: the unique
                storages of parameters and buffers, plus bitsandbytes' scale/quant-state tensors)
  load s        wall time of the load call
  TTFT ms       prefill of a ~100-token chat prompt up to the first greedy token (median of
                --repeats runs after a warm-up run)
  decode tok/s  N greedy decode steps after the prefill / their wall time (median, same runs)
  vs bf16       decode tok/s over the transformers BF16 row's
  drift         one full forward over a fixed ~200-token English text, against the FP32 row:
                max |logit difference|, mean KL(p_fp32 || p_row) over positions (nats), and
                top-1 agreement (fraction of positions whose argmax equals FP32's)

Every figure is measured in the run; nothing is hard-coded. The compressed folder is made once
with `unweight.compress` (cached next to the BF16 fixture and reused).

Run:  python benchmarks/generate_bench.py [--device cpu|cuda] [--tokens 64] [--model-dir DIR]
                                          [--out benchmarks/results/generate_bench.json]
Needs transformers (the `dev` extra) and bitsandbytes (the `bench` extra).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import inspect
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import unweight
from unweight.defaults import cache_dir
from unweight.runtime.generate import encode_prompt
from unweight.testing import smollm2_bf16

ROWS = ("uw-serving", "uw-bf16", "uw-archive", "hf-bf16", "hf-fp32", "bnb-int8", "bnb-nf4")
MB = 1e6
T0 = time.perf_counter()

# The user turn of the timed prompt; with SmolLM2's chat template (system turn included) it is
# about 100 tokens.
CHAT_PROMPT = (
    "I am planning a small vegetable garden behind my house. The plot gets about six hours of "
    "sun in the morning and shade in the afternoon, and the soil is heavy clay that stays wet "
    "after rain. Which vegetables would grow well there, how should I improve the soil before "
    "planting, and what should I do each month of the first season?"
)

# Plain prose for the drift measurement (about 200 tokens), not a chat turn: drift is a property
# of the weights and arithmetic, so any ordinary text will do.
DRIFT_TEXT = (
    "The lighthouse stood on a narrow spit of rock at the mouth of the harbour, and for more than "
    "a century its keepers had climbed the same spiral stair each evening to light the lamp. The "
    "work was simple but never easy. In winter the wind came straight off the sea, driving salt "
    "spray against the windows until the glass turned white, and the keeper had to scrape it "
    "clean by hand so that the beam would carry. In summer the nights were short, but fog could "
    "roll in without warning, and then the horn had to be sounded every thirty seconds until "
    "dawn. The last keeper, a quiet man who had once been a schoolteacher, kept a logbook in "
    "which he recorded the weather, the ships that passed, and the birds that rested on the "
    "gallery rail. When the light was finally automated, he was given a week to pack his things. "
    "He left the logbook on the table in the watch room, open to the final page, where he had "
    "written only the date and a single line: the lamp is lit, and the sea is calm."
)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def log_once():
    """A logging filter that lets each distinct message through once."""
    seen = set()

    def keep(record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if msg in seen:
            return False
        seen.add(msg)
        return True

    return keep


def median(xs: list[float]) -> float:
    return statistics.median(xs)


# ---------------------------------------------------------------- model folders
def model_folders(model_dir: str | None) -> tuple[Path, Path]:
    """(BF16 Hugging Face folder, its unweight-compressed folder), compressing once if needed."""
    if model_dir is None:
        bf16_dir = smollm2_bf16(cache_dir() / "smollm2-bf16")
        uw_dir = cache_dir() / "smollm2-uw"
    else:
        bf16_dir = Path(model_dir).resolve()
        # Keyed by the source path so two folders with the same name do not share a cache entry.
        key = hashlib.sha1(str(bf16_dir).encode()).hexdigest()[:8]
        uw_dir = cache_dir() / f"{bf16_dir.name}-{key}-uw"
    if not uw_dir.exists():
        # compress() writes into a staging folder and renames it at the end, so an existing
        # folder is always a finished one.
        log(f"compressing {bf16_dir} -> {uw_dir}")
        unweight.compress(bf16_dir, uw_dir)
    return bf16_dir, uw_dir


# ---------------------------------------------------------------- weight bytes
def storage_bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def quant_state_tensors(obj) -> list[torch.Tensor]:
    """The tensors bitsandbytes keeps beside a quantised weight (int8 row scales `SCB`; the NF4
    QuantState's absmax, code and nested state), which are not parameters or buffers."""
    found = []
    scb = getattr(obj, "SCB", None)
    if isinstance(scb, torch.Tensor):
        found.append(scb)
    qs = getattr(obj, "quant_state", None)
    while qs is not None:
        found += [v for v in vars(qs).values() if isinstance(v, torch.Tensor)]
        qs = getattr(qs, "state2", None)
    return found


def hf_weight_bytes(model) -> int:
    params = [*model.parameters(), *model.buffers()]
    extra = [t for p in params for t in quant_state_tensors(p)]
    return storage_bytes(params + extra, set())


# ---------------------------------------------------------------- one generation run
def run_unweight(model, ids: list[int], steps: int) -> tuple[float, float, list[int]]:
    """(prefill-to-first-token seconds, seconds of `steps` decode steps, generated ids)."""
    seq = model.new_sequence()
    t0 = time.perf_counter()
    tok = int(model.prefill(seq, ids).argmax())  # int() waits for the device
    t1 = time.perf_counter()
    out = [tok]
    for _ in range(steps):
        tok = int(model.decode_step([seq], [tok])[0].argmax())
        out.append(tok)
    t2 = time.perf_counter()
    model.free(seq)
    return t1 - t0, t2 - t1, out


def hf_cache_kw(model) -> str:
    # transformers 5 renamed past_key_values to cache (the old name still works, with a warning).
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def hf_cache_of(out):
    return out.cache if hasattr(out, "cache") else out.past_key_values


def hf_keep_last(model) -> dict:
    # Prefill needs the last position's logits only (as unweight's prefill computes); without
    # this transformers projects every position onto the 49k-token vocabulary.
    params = inspect.signature(type(model).forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return {name: 1}
    return {}


def run_hf(model, ids: list[int], steps: int) -> tuple[float, float, list[int]]:
    dev = model.device
    cache_kw, keep = hf_cache_kw(model), hf_keep_last(model)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(torch.tensor([ids], device=dev), use_cache=True, **keep)
        tok = int(out.logits[0, -1].argmax())
        t1 = time.perf_counter()
        cache, toks = hf_cache_of(out), [tok]
        for _ in range(steps):
            out = model(torch.tensor([[tok]], device=dev), use_cache=True, **{cache_kw: cache})
            cache = hf_cache_of(out)
            tok = int(out.logits[0, -1].argmax())
            toks.append(tok)
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, toks


# ---------------------------------------------------------------- full-text logits
def logits_unweight(model, ids: list[int]) -> torch.Tensor:
    seq = model.new_sequence()
    logits = model.prefill(seq, ids, all_logits=True)
    model.free(seq)
    return logits.float().cpu()


def logits_hf(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids], device=model.device), use_cache=False).logits[0].float().cpu()


def drift(ref: torch.Tensor, got: torch.Tensor) -> dict:
    logp_ref, logp_got = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (logp_ref.exp() * (logp_ref - logp_got)).sum(-1)
    return {
        "max_abs_logit_diff": float((ref - got).abs().max()),
        "mean_kl_nats": float(kl.mean()),
        "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
        "positions": ref.shape[0],
    }


# ---------------------------------------------------------------- loaders
def load_row(name: str, bf16_dir: Path, uw_dir: Path, dev: str, attn: str):
    """(model, kind) where kind is "uw" or "hf"."""
    if name == "uw-bf16":
        return unweight.load(uw_dir, device=dev, dtype="bfloat16"), "uw"
    if name.startswith("uw-"):
        return unweight.load(uw_dir, device=dev, layout=name.removeprefix("uw-")), "uw"
    from transformers import AutoModelForCausalLM

    if name in ("hf-bf16", "hf-fp32"):
        dtype = torch.bfloat16 if name == "hf-bf16" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=dtype, attn_implementation=attn).to(dev)
        return model.eval(), "hf"
    from transformers import BitsAndBytesConfig

    if name == "bnb-int8":
        q = BitsAndBytesConfig(load_in_8bit=True)
    else:
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(
        bf16_dir, quantization_config=q, device_map=dev, attn_implementation=attn
    )
    return model.eval(), "hf"


def measure_row(
    name: str, bf16_dir: Path, uw_dir: Path, args, prompt_ids: list[int], drift_ids: list[int]
) -> tuple[dict, torch.Tensor]:
    steps = args.slow_tokens if name == "uw-archive" else args.tokens
    log(f"{name}: loading")
    t0 = time.perf_counter()
    model, kind = load_row(name, bf16_dir, uw_dir, args.device, args.attn)
    load_s = time.perf_counter() - t0
    weight_bytes = model.resident_weight_bytes() if kind == "uw" else hf_weight_bytes(model)
    run = run_unweight if kind == "uw" else run_hf
    log(
        f"{name}: loaded in {load_s:.1f}s, {weight_bytes / MB:.1f} MB of weights; drift forward over {len(drift_ids)} "
        f"tokens"
    )
    logits = logits_unweight(model, drift_ids) if kind == "uw" else logits_hf(model, drift_ids)
    # The warm-up run is a full one: first calls allocate caches, pick kernels, fault pages in.
    log(f"{name}: warm-up, then {args.repeats} runs of prefill {len(prompt_ids)} + {steps} decode steps")
    run(model, prompt_ids, steps)
    ttft, decode, toks = [], [], None
    for i in range(args.repeats):
        p, d, toks = run(model, prompt_ids, steps)
        ttft.append(p)
        decode.append(d)
        log(f"{name}: run {i + 1}: prefill {p * 1e3:.0f} ms, {steps / d:.2f} tok/s")
    row = {
        "row": name,
        "decode_steps": steps,
        "weight_bytes": weight_bytes,
        "load_s": load_s,
        "ttft_s": median(ttft),
        "ttft_runs_s": ttft,
        "decode_tok_s": steps / median(decode),
        "decode_runs_s": decode,
        "generated_ids": toks,
    }
    del model
    gc.collect()
    return row, logits


# ---------------------------------------------------------------- report
def fmt(v, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def table(rows: list[dict], default_steps: int) -> str:
    head = (
        "row",
        "steps",
        "weights MB",
        "load s",
        "TTFT ms",
        "decode tok/s",
        "vs bf16",
        "max|dlogit|",
        "KL fp32||row",
        "top1 agree",
        "note",
    )
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append((r["row"], *["-"] * 9, f"failed: {r['error']}"))
            continue
        d = r.get("drift") or {}
        note = "reference" if r["row"] == "hf-fp32" else ""
        if r["decode_steps"] != default_steps:
            note = (note + "; " if note else "") + f"only {r['decode_steps']} decode steps (slow)"
        lines.append(
            (
                r["row"],
                str(r["decode_steps"]),
                fmt(r["weight_bytes"] / MB, ".1f"),
                fmt(r["load_s"], ".1f"),
                fmt(r["ttft_s"] * 1e3, ".0f"),
                fmt(r["decode_tok_s"], ".2f"),
                fmt(r.get("vs_bf16"), ".2f"),
                fmt(d.get("max_abs_logit_diff"), ".3g"),
                fmt(d.get("mean_kl_nats"), ".2e"),
                fmt(d.get("top1_agreement"), ".4f"),
                note,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = []
    for j, line in enumerate(lines):
        cells = [c.ljust(w) if i in (0, len(head) - 1) else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
        out.append("  ".join(cells).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def machine_info(dev: str) -> dict:
    import transformers

    try:
        import bitsandbytes

        bnb_version = bitsandbytes.__version__
    except ImportError:
        bnb_version = None
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "bitsandbytes": bnb_version,
        "unweight": unweight.__version__,
    }
    if dev.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(dev))
    return info


# ---------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:n] (default cpu)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy decode steps per timed run (default 64)")
    ap.add_argument(
        "--slow-tokens",
        type=int,
        default=8,
        help="decode steps for the unweight archive row, which decodes every weight at every step (default 8)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row after one warm-up run (default 3)")
    ap.add_argument(
        "--model-dir",
        default=None,
        help="a BF16 Hugging Face Llama-family folder (default: the SmolLM2-135M-Instruct fixture)",
    )
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    ap.add_argument("--attn", default="eager", help="transformers attn_implementation (default eager)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "generate_bench.json"))
    args = ap.parse_args(argv)
    rows_wanted = [r for r in args.rows.split(",") if r]
    unknown = set(rows_wanted) - set(ROWS)
    if unknown:
        ap.error(f"unknown rows: {', '.join(sorted(unknown))}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")

    torch.manual_seed(0)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    # bitsandbytes' int8 matmul logs its fp16 cast at every call (thousands of lines); once is enough.
    logging.getLogger("bitsandbytes.autograd._functions").addFilter(log_once())

    bf16_dir, uw_dir = model_folders(args.model_dir)
    tok = unweight.load_tokenizer(uw_dir)
    prompt_ids = encode_prompt(tok, CHAT_PROMPT, chat=True)
    drift_ids = encode_prompt(tok, DRIFT_TEXT)
    log(
        f"model {bf16_dir}; prompt {len(prompt_ids)} tokens, drift text {len(drift_ids)} tokens; device "
        f"{args.device}, {torch.get_num_threads()} threads"
    )

    # FP32 goes first: every other row's drift is measured against its logits.
    order = sorted(rows_wanted, key=lambda r: r != "hf-fp32")
    results, ref = {}, None
    for name in order:
        if name.startswith("bnb-"):
            # bitsandbytes' backends differ by device and version; a mode that cannot load or
            # run here is a finding to report, not a reason to lose the other rows.
            try:
                row, logits = measure_row(name, bf16_dir, uw_dir, args, prompt_ids, drift_ids)
            except Exception as e:  # noqa: BLE001
                msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                log(f"{name}: failed: {msg}")
                results[name] = {"row": name, "error": msg}
                gc.collect()
                continue
        else:
            row, logits = measure_row(name, bf16_dir, uw_dir, args, prompt_ids, drift_ids)
        if name == "hf-fp32":
            ref = logits
        row["drift"] = drift(ref, logits) if ref is not None else None
        results[name] = row

    base = results.get("hf-bf16", {}).get("decode_tok_s")
    rows = [results[r] for r in ROWS if r in results]
    for r in rows:
        if "error" not in r:
            r["vs_bf16"] = r["decode_tok_s"] / base if base else None
            r["sample_text"] = tok.decode(r["generated_ids"])

    print(
        f"generate_bench: {bf16_dir.name}, device {args.device}, prompt {len(prompt_ids)} tokens, "
        f"drift text {len(drift_ids)} tokens, median of {args.repeats} runs after 1 warm-up"
    )
    print(table(rows, args.tokens))

    report = {
        "benchmark": "generate_bench",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(args.device),
        "settings": {
            "device": args.device,
            "tokens": args.tokens,
            "slow_tokens": args.slow_tokens,
            "repeats": args.repeats,
            "attn_implementation": args.attn,
            "model_dir": str(bf16_dir),
            "compressed_dir": str(uw_dir),
            "prompt_tokens": len(prompt_ids),
            "drift_tokens": len(drift_ids),
            "seed": 0,
            "chat_prompt": CHAT_PROMPT,
            "drift_text": DRIFT_TEXT,
        },
        "rows": rows,
        "total_s": time.perf_counter() - T0,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    log(f"wrote {out} ({report['total_s']:.0f}s in all)")


if __name__ == "__main__":
    main()
