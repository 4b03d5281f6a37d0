"""Decode speed when another process takes a core: the runtime's thread settings against the
alternatives, on a quiet machine and beside a busy-looping competitor.

Each measurement is a fresh process (thread pools and OpenMP wait policies are fixed when a
runtime starts) that loads the compressed SmolLM2-135M-Instruct, warms up, and times --tokens
greedy decode steps after a ~40-token prompt (`unweight.stream`, no EOS stop). "busy" runs it
while one `python -c "while True: pass"` process spins. Settings, each an environment:

  runtime       the defaults of `unweight generate` and the serve workers: every core, fewer
                while other processes hold some (runtime/threads.py)
  all cores     every core throughout (UNWEIGHT_THREAD_GOVERNOR=0): what the runtime did before
  one thread    OMP_NUM_THREADS=1, NUMBA_NUM_THREADS=1: no parallel regions at all

The runs alternate (setting by setting, quiet then busy, --repeats rounds), and every figure is a
median with its range. A competitor that did not get a core's worth of CPU, or other processes
using the machine meanwhile, are reported: a shared machine skews the figures.

Run:  python benchmarks/contention_bench.py [--tokens 48] [--repeats 3] [--out benchmarks/results/contention_bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {
    "runtime": {},
    "all cores": {"UNWEIGHT_THREAD_GOVERNOR": "0"},
    "one thread": {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"},
}
PROMPT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle. "
    "Make it vivid and a little sad, with a twist at the end."
)


def child(model: str, tokens: int) -> None:
    import torch

    import unweight

    torch.set_grad_enabled(False)
    m, tok = unweight.load(model), unweight.load_tokenizer(model)
    for n in (4, tokens):  # the first run warms numba and the allocator
        g = unweight.stream(m, tok, PROMPT, max_new_tokens=n, ignore_eos=True)
        for _ in g:
            pass
    r = g.result
    print(
        json.dumps(
            {"tok_s": r.decode_tokens_per_s, "tokens": len(r.token_ids), "threads_at_end": torch.get_num_threads()}
        )
    )


def cpu_seconds() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def measure(model: str, tokens: int, env: dict, busy: bool) -> dict:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        t0, c0 = time.monotonic(), cpu_seconds()
        done = subprocess.run(
            [sys.executable, __file__, "--child", model, "--tokens", str(tokens)],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=600,
        )
        wall, cpu = time.monotonic() - t0, cpu_seconds() - c0
        if done.returncode:
            raise RuntimeError(done.stderr[-2000:])
        out = json.loads(done.stdout.strip().splitlines()[-1])
        if spinner is not None:
            with open(f"/proc/{spinner.pid}/stat") as f:
                st = f.read().split()
            out["competitor_cores"] = (int(st[13]) + int(st[14])) / os.sysconf("SC_CLK_TCK") / wall
        out["machine_cores"] = cpu / wall
        return out
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--model-dir", default=None, help="a compressed SmolLM2 folder (default: made once in the fixture cache)"
    )
    ap.add_argument("--out", default="benchmarks/results/contention_bench.json")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.tokens)
        return
    model = args.model_dir
    if model is None:
        import unweight
        from unweight.defaults import cache_dir
        from unweight.testing import smollm2_bf16

        model = str(cache_dir() / "smollm2-uw-bench")
        if not Path(model, "config.json").exists():
            unweight.compress(smollm2_bf16(), model)
    runs: dict[tuple[str, bool], list[dict]] = {}
    for r in range(args.repeats):
        for name, env in SETTINGS.items():
            for busy in (False, True):
                runs.setdefault((name, busy), []).append(measure(model, args.tokens, env, busy))
        print(f"round {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    rows = []
    print(
        f"{'setting':<12} {'machine':<6} {'decode tok/s (median, range)':>30} {'busy / quiet':>13} "
        f"{'competitor cores':>17} {'machine cores':>14}"
    )
    for name in SETTINGS:
        quiet = statistics.median(x["tok_s"] for x in runs[(name, False)])
        for busy in (False, True):
            xs = [x["tok_s"] for x in runs[(name, busy)]]
            med = statistics.median(xs)
            comp = statistics.median(x.get("competitor_cores", 0.0) for x in runs[(name, busy)])
            cores = statistics.median(x["machine_cores"] for x in runs[(name, busy)])
            rows.append(
                {
                    "setting": name,
                    "busy": busy,
                    "env": SETTINGS[name],
                    "tok_s": xs,
                    "median": med,
                    "vs_quiet": med / quiet,
                    "competitor_cores": comp,
                    "machine_cores": cores,
                    "threads_at_end": [x["threads_at_end"] for x in runs[(name, busy)]],
                }
            )
            print(
                f"{name:<12} {'busy' if busy else 'quiet':<6} {med:>12.1f} ({min(xs):.1f}-{max(xs):.1f}){'':>7} "
                f"{med / quiet:>12.2f}x {comp:>17.2f} {cores:>14.2f}"
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "tokens": args.tokens,
                "repeats": args.repeats,
                "cpus": os.cpu_count(),
                "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
