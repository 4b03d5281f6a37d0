"""Goodput as DistServe measures it: requests per second that meet both a TTFT and a TPOT SLO, for
`unweight serve` disaggregated across hosts, disaggregated on one host, and `--no-disagg`.

Workload (one seeded schedule, the same for every set-up): Poisson arrivals at each --rates value
for --duration s; each request a streamed /v1/completions of a prompt of token ids whose length is
log-uniform in --prompt-tokens (e.g. 128-1024), with max_tokens uniform in --output-tokens and
ignore_eos (so every set-up is asked for the same tokens), greedy, with the usage chunk (the tokens
counted by the server: a count of chunks with text misses tokens whose text is not yet whole).

Per request (serve_bench.run_one, at the client): TTFT, and TPOT = (e2e - TTFT) / (tokens - 1).
A request meets the SLOs when it finished without error, TTFT <= --slo-ttft and TPOT <= --slo-tpot.
Every request that did not finish has an error, counted by kind in `error_kinds` (error_kind): an
HTTP status, an error event in the stream (by its message), a stream cut without [DONE], one with
fewer tokens than asked for, a client-side exception (by its type), or cut at the drain deadline.
Goodput = requests meeting both / the schedule's duration. DistServe (Zhong et al., OSDI 2024)
defines it so, and compares systems at the rate where one stops meeting the SLOs.

Set-ups, the same 2 cores in all (1 thread a worker when disaggregated, 2 for the one worker), the
same server options (server_options) and the kernels' pipelines the autotuner picks:
  hosts   router, prefill, decode and client each in a network namespace (tests/hosts.py),
          the prefill host's link shaped to --link (tc tbf), KV streamed, sealed, and coded
          when the link, measured, is slower than the codec (--kv-compression auto)
  disagg  the same roles on loopback, started by `unweight serve`
  agg     `unweight serve --no-disagg`

Run as root:  python benchmarks/goodput_bench.py [--rates 0.3,0.6,1.0] [--duration 90]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from kv_handoff_bench import ROLES, serve, stop
from serve_bench import Job, Result, Server, prepare_model, run_one
from side_by_side import cpu_flags, write_record

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test support: network namespaces
from hosts import Hosts  # noqa: E402


def schedule(args, rate: float, name: str) -> list[Job]:
    rng = random.Random(args.seed)
    lo, hi = (int(x) for x in args.prompt_tokens.split("-"))
    olo, ohi = (int(x) for x in args.output_tokens.split("-"))
    jobs, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > args.duration:
            return jobs
        n = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        body = {
            "model": name,
            "prompt": [rng.randrange(1000, 40000) for _ in range(n)],
            "max_tokens": rng.randint(olo, ohi),
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            # the tokens as the server counts them: a token whose text is not yet whole (a random
            # prompt makes many) comes in a chunk with no text, which a count of chunks would miss
            "stream_options": {"include_usage": True},
        }
        jobs.append(Job(len(jobs), "mixed", t, "/v1/completions", body, n))


async def run_schedule(url: str, jobs: list[Job], args) -> list[Result]:
    """Each job at its time (serve_bench.run_one), at most --concurrency at once; one still running
    --drain-timeout s after --duration is cut. Whatever a request raised is its error, and one that
    ended without an error but with fewer tokens than asked for is "short": none fails unnamed."""
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    async with httpx.AsyncClient(
        base_url=url, timeout=httpx.Timeout(args.request_timeout, connect=10), limits=limits
    ) as c:
        sem = asyncio.Semaphore(args.concurrency)
        results = [Result(j.index, j.kind, j.at) for j in jobs]
        t0 = time.perf_counter()

        async def one(job: Job, res: Result) -> None:
            try:
                await run_one(c, job, sem, t0, res)
            except Exception as e:  # noqa: BLE001 - the client's own failure is this request's error, by its type
                res.error = f"client {type(e).__name__}: {e}"

        tasks = [asyncio.create_task(one(j, r)) for j, r in zip(jobs, results)]
        deadline = args.duration + args.drain_timeout
        _, pending = await asyncio.wait(tasks, timeout=max(1.0, t0 + deadline - time.perf_counter()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for r, j, t in zip(results, jobs, tasks):
        if t in pending:
            r.error = f"not finished {deadline:.0f} s after the start ({r.chunks} chunks received)"
        elif r.error is None and r.tokens < j.body["max_tokens"]:
            r.error = f"short stream: {r.tokens} of {j.body['max_tokens']} tokens"
    return results


def measure(url: str, args, rate: float, name: str, jobs: list[Job] | None = None) -> list[dict]:
    jobs = schedule(args, rate, name) if jobs is None else jobs
    results = asyncio.run(run_schedule(url, jobs, args))
    return [
        {"ttft": r.ttft, "tokens": r.tokens, "e2e": r.e2e, "error": r.error, "prompt": j.prompt_tokens}
        for r, j in zip(results, jobs)
    ]


def error_kind(error: str) -> str:
    """A failed request's error, without what differs from one request to the next (numbers, the
    chunks it got): "HTTP 429", "error event: <message>", "not finished", "short stream",
    "client ReadTimeout", "stream ended without [DONE]", ..."""
    for prefix in ("not finished", "short stream", "stream ended without [DONE]"):
        if error.startswith(prefix):
            return prefix
    if error.startswith("HTTP "):
        return error.split(":")[0]
    if error.startswith("error event: "):
        return re.sub(r"\d+", "N", error)[:100]
    return re.sub(r"\d+", "N", error.split(":")[0])[:100]  # an exception, by its type


def goodput(rows: list[dict], args) -> dict:
    good = 0
    tpots = []
    for r in rows:
        if r["error"] is not None or r["ttft"] is None or r["tokens"] < 2:
            continue
        tpot = (r["e2e"] - r["ttft"]) / (r["tokens"] - 1)
        tpots.append(tpot)
        good += r["ttft"] <= args.slo_ttft and tpot <= args.slo_tpot
    ttfts = [r["ttft"] for r in rows if r["ttft"] is not None]
    return {
        "requests": len(rows),
        "good": good,
        "goodput": good / args.duration,
        "errors": sum(r["error"] is not None for r in rows),
        "error_kinds": dict(Counter(error_kind(r["error"]) for r in rows if r["error"] is not None)),
        "ttft_p50": statistics.median(ttfts) if ttfts else None,
        "tpot_p50": statistics.median(tpots) if tpots else None,
    }


def run_hosts(model: Path, args, rate: float) -> list[dict]:
    hosts = Hosts(ROLES)
    tmp = Path(tempfile.mkdtemp())
    secret = tmp / "secret"
    secret.write_text("g" * 48 + "\n")
    secret.chmod(0o600)
    with open(tmp / "server.log", "w") as log:
        procs = serve(hosts, model, secret, "auto", "auto", log, server_options(args))
        try:
            hosts.limit("prefill", args.link)
            r = subprocess.run(
                ["ip", "netns", "exec", hosts.ns["client"], sys.executable, __file__, "--client"]
                + [f"http://{hosts.addr['router']}:8000", "--rate", str(rate)]
                + [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in PASSED],
                capture_output=True,
                text=True,
                timeout=args.duration + args.drain_timeout + 400,
            )
            if r.returncode:
                raise RuntimeError(r.stderr[-3000:])
            return json.loads(r.stdout.splitlines()[-1])
        finally:
            stop(procs)
            hosts.close()
            print(f"hosts {rate}: server log {tmp / 'server.log'}", flush=True)


def server_options(args) -> tuple[str, ...]:
    """The options serve_bench.Server gives the loopback set-ups, for the hosts set-up's roles."""
    return (
        *("--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue)),
        *("--max-model-len", str(args.max_model_len)),
    )


PASSED = ("duration", "seed", "prompt_tokens", "output_tokens", "concurrency", "request_timeout", "drain_timeout")


def wait_ready(url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="0.3,0.6,1.0", help="Poisson arrival rates, requests/s")
    ap.add_argument("--duration", type=float, default=90)
    ap.add_argument("--prompt-tokens", default="128-1024")
    ap.add_argument("--output-tokens", default="32-128")
    ap.add_argument("--slo-ttft", type=float, default=10.0, help="seconds")
    ap.add_argument("--slo-tpot", type=float, default=0.25, help="seconds a token")
    ap.add_argument("--link", default="1gbit", help="the hosts set-up's link (tc tbf rate)")
    ap.add_argument("--setups", default="hosts,disagg,agg")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--drain-timeout", type=float, default=120)
    ap.add_argument("--model-dir")
    ap.add_argument("--out", default="benchmarks/results/goodput_bench.json")
    ap.add_argument("--client", help=argparse.SUPPRESS)  # inside the client's namespace: measure URL
    ap.add_argument("--rate", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    # what serve_bench's Server and run_workload read
    args.max_batch, args.max_queue, args.max_model_len, args.worker_threads = 16, 256, 2048, 0
    if args.client:
        wait_ready(args.client)
        print(json.dumps(measure(args.client, args, args.rate, "uw")))
        return
    model = prepare_model(args.model_dir)
    print(f"CPU: {cpu_flags()}")
    table: dict = {}
    for rate in (float(x) for x in args.rates.split(",")):
        for setup in args.setups.split(","):
            if setup == "hosts":
                rows = run_hosts(model, args, rate)
            else:
                server = Server(model, setup, args, Path(tempfile.mkdtemp()) / "server.log")
                try:
                    server.wait_ready(300)
                    url = server.url
                    rows = measure(url, args, rate, model.name)
                finally:
                    server.stop()
            table[f"{setup} {rate}"] = summary = goodput(rows, args)
            print(setup, rate, summary, flush=True)
    print(
        f"\nCPU: {cpu_flags()}; prompts {args.prompt_tokens} tokens, outputs {args.output_tokens}, "
        f"{args.duration:.0f} s of Poisson arrivals a cell; SLOs TTFT <= {args.slo_ttft} s, TPOT <= {args.slo_tpot} s"
    )
    print("| rate (req/s) | set-up | goodput (req/s) | met SLOs / sent | TTFT p50 | TPOT p50 |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for key, c in table.items():
        setup, rate = key.split()
        ttft = f"{c['ttft_p50']:.2f} s" if c["ttft_p50"] is not None else "-"
        tpot = f"{c['tpot_p50'] * 1000:.0f} ms" if c["tpot_p50"] is not None else "-"
        print(f"| {rate} | {setup} | {c['goodput']:.3f} | {c['good']}/{c['requests']} | {ttft} | {tpot} |")
    write_record(
        args.out,
        {"benchmark": "goodput_bench", "date": time.strftime("%Y-%m-%d"), "args": vars(args), "table": table},
    )


if __name__ == "__main__":
    main()
