"""The prefill worker's fairness: a prompt's n choices prefilled once, and prompts taking turns in
chunks (#51 item 4), measured at the client against `unweight serve` disaggregated on loopback (one
prefill and one decode worker, started as benchmarks/serve_bench.py starts them).

Each round sends, one case after the other to an otherwise idle server (streaming, temperature 0,
ignore_eos, so every choice decodes exactly its max_tokens; token-id prompts drawn with a fixed seed,
a fresh prompt for each request, the same ones for every server in a round):
  idle    a short chat (one user message "Hi!", --chat-max-tokens 8) alone: its TTFT;
  case 1  a --prompt-tokens (1,000) prompt, --max-tokens 16, with n=1, then another with n=--n (16):
          wall time (request sent -> [DONE]) of each, and n / 1. Prefilled once for all its choices,
          n=16 costs about what n=1 does (decode batches the choices); prefilled once per choice, first
          in first out, it took about 15x. vLLM's prefix-cache counters
          (vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total, in tokens) are read from
          /metrics before and after the n=16 request, once the workers' heartbeats have reported
          (the same values twice, 1 s apart): a shared prefill shows n x prompt queries and
          (n - 1) x prompt hits;
  case 2  the n=16 request again (a new prompt) and, --delay (0.5) s after it, the short chat from a
          second client: the chat's TTFT (from its own sending), and / idle;
  case 3  a --long-tokens (3,584) prompt, n=1, and --delay s after it the short chat: the chat's TTFT,
          and / idle. With prompts taking turns in PREFILL_CHUNK (512) token chunks it waits for at
          most about one chunk; first in, first out it waited for the whole long prefill.
Servers that lack the counters (older code) report none.

--checkout PATH runs a second server from another checkout of this repository (its own cli, runtime,
unweight and formats folders, importable through a folder of links laid out as pyproject.toml's
package-dir says, on PYTHONPATH, the server started from that folder; checked before the run): both
servers start once, warm up, and take turns round by round (A B, B A, ...), and the table puts the
other checkout beside this one with the ratio this / other. The idle server of the two runs nothing
meanwhile; what other processes (it included) used of the CPU during each turn is recorded.

Run:  git worktree add /tmp/uw-before fe112e5~1
      python benchmarks/fairness_bench.py [--checkout /tmp/uw-before] [--repeats 3]
                                          [--out benchmarks/results/fairness_bench.json]
      git worktree remove --force /tmp/uw-before
The model (SmolLM2-135M-Instruct, compressed) is made once and cached. Prints a markdown table of
medians (ranges) over the rounds and writes the JSON record with every request's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serve_bench import ROOT, CpuMeter, Job, Result, Server, prepare_model, run_one
from side_by_side import cpu_flags, write_record

CHAT = [{"role": "user", "content": "Hi!"}]
VOCAB = (1000, 40000)  # token ids drawn for prompts: ordinary tokens of SmolLM2's 49,152
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"


# -- another checkout -----------------------------------------------------------------------------


def git_commit(path: Path) -> tuple[str | None, bool]:
    """The checkout's HEAD and whether its code folders have changes not committed."""
    try:
        head = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "-C", str(path), "status", "--porcelain", "--", "cli", "runtime", "unweight", "formats"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return head.stdout.strip() or None, bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, False


def link_checkout(checkout: Path, into: Path) -> Path:
    """A folder under `into` from which `import unweight...` finds the checkout's code: the package
    folders of its pyproject.toml's package-dir, linked where the installed package has them."""
    text = (checkout / "pyproject.toml").read_text()  # tomllib is Python 3.11's; the table is one string pair a line
    section = re.search(r"^\[tool\.setuptools\.package-dir\]\n(.*?)(?:^\[|\Z)", text, re.M | re.S)
    dirs = dict(re.findall(r'^"([\w.]+)"\s*=\s*"([^"]+)"', section.group(1), re.M)) if section else {}
    if "unweight" not in dirs:
        raise SystemExit(f"--checkout {checkout}: no [tool.setuptools.package-dir] for unweight in its pyproject.toml")
    root = into / "site"
    pkg = root / "unweight"
    pkg.mkdir(parents=True)
    for entry in (checkout / dirs["unweight"]).iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for name, folder in dirs.items():
        if name == "unweight":
            continue
        parts = name.split(".")
        if len(parts) != 2 or parts[0] != "unweight":
            raise SystemExit(f"--checkout {checkout}: package-dir {name!r} is not unweight.<name>")
        (pkg / parts[1]).symlink_to((checkout / folder).resolve())
    return root


def checkout_env(checkout: Path, into: Path) -> tuple[dict, Path]:
    """The environment and folder to start `unweight serve` from so that it, and the workers it
    starts, run the checkout's code; refuses (SystemExit) if the import would find other code."""
    root = link_checkout(checkout, into)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    probe = (
        "import unweight, unweight.cli.main, unweight.runtime.serve.worker as w, os; "
        "print(os.path.realpath(unweight.__file__)); print(os.path.realpath(w.__file__))"
    )
    r = subprocess.run([sys.executable, "-c", probe], env=env, cwd=root, capture_output=True, text=True, timeout=120)
    found = r.stdout.split()
    want = checkout.resolve()
    if r.returncode or len(found) != 2 or not all(Path(f).is_relative_to(want) for f in found):
        raise SystemExit(f"--checkout {checkout}: its code is not what imports: {found or r.stderr.strip()[-300:]}")
    return env, root


# -- one round against one server -----------------------------------------------------------------


def token_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(*VOCAB) for _ in range(n)]


def completion(name: str, prompt: list[int], n: int, max_tokens: int, at: float = 0.0) -> Job:
    body = {"model": name, "prompt": prompt, "n": n, "max_tokens": max_tokens}
    body |= {"temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    return Job(0, f"n={n}", at, "/v1/completions", body, len(prompt))


def chat(name: str, max_tokens: int, at: float = 0.0) -> Job:
    body = {"model": name, "messages": CHAT, "max_tokens": max_tokens}
    body |= {"temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    return Job(0, "chat", at, "/v1/chat/completions", body, 0)


async def send(client: httpx.AsyncClient, *jobs: Job) -> list[Result]:
    """The jobs at their times (seconds after now), each from a connection of its own."""
    t0 = time.perf_counter()
    sem = asyncio.Semaphore(len(jobs))
    return list(await asyncio.gather(*(run_one(client, j, sem, t0, Result(0, j.kind, j.at)) for j in jobs)))


def counter(metrics: str, name: str) -> float | None:
    values = [float(x.split()[-1]) for x in metrics.splitlines() if x.startswith((name + "{", name + " "))]
    return sum(values) if values else None


async def settled_counters(client: httpx.AsyncClient) -> tuple[float | None, float | None]:
    """The prefix-cache counters once the heartbeats have reported: the same twice, 1 s apart (none
    where the server has no such counters)."""
    now = None
    for _ in range(30):
        text = (await client.get("/metrics")).text
        now, was = (counter(text, PREFIX_QUERIES), counter(text, PREFIX_HITS)), now
        if now == was or now == (None, None):
            break
        await asyncio.sleep(1.0)
    return now


def check(r: Result, want_tokens: int, errors: list[str]) -> float | None:
    """r's end-to-end time, or None (and a line in `errors`) if it failed or came back short."""
    if r.error or r.tokens != want_tokens:
        errors.append(f"{r.kind}: {r.error or f'{r.tokens} tokens, not {want_tokens}'}")
        return None
    return r.e2e


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


async def one_round(url: str, name: str, args, seed: int, pgid: int) -> dict:
    """The cases in turn on one server; prompts drawn from `seed` (the same for every server)."""
    p, n, mt, ct = args.prompt_tokens, args.n, args.max_tokens, args.chat_max_tokens
    errors: list[str] = []
    meter, start = CpuMeter(pgid), time.perf_counter()
    timeout = httpx.Timeout(args.request_timeout, connect=10)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=httpx.Limits(max_connections=8)) as client:
        (idle,) = await send(client, chat(name, ct))
        (one,) = await send(client, completion(name, token_prompt(seed + 1, p), 1, mt))
        before = await settled_counters(client)
        (many,) = await send(client, completion(name, token_prompt(seed + 2, p), n, mt))
        after = await settled_counters(client)
        many2, chat2 = await send(
            client, completion(name, token_prompt(seed + 3, p), n, mt), chat(name, ct, at=args.delay)
        )
        long, chat3 = await send(
            client, completion(name, token_prompt(seed + 4, args.long_tokens), 1, mt), chat(name, ct, at=args.delay)
        )
    cpu = meter.since_start()
    idle_ttft = idle.ttft if check(idle, ct, errors) is not None else None
    n1_s, n_s = check(one, mt, errors), check(many, n * mt, errors)
    ttft2 = chat2.ttft if check(chat2, ct, errors) is not None else None
    ttft3 = chat3.ttft if check(chat3, ct, errors) is not None else None
    long_ok = check(long, mt, errors) is not None
    deltas = [None if a is None or b is None else b - a for a, b in zip(before, after)]
    return {
        "n1_s": n1_s,
        "n_s": n_s,
        "n_over_n1": ratio(n_s, n1_s),
        "chat_idle_ttft_s": idle_ttft,
        "n_beside_chat_s": check(many2, n * mt, errors),
        "chat_behind_n_ttft_s": ttft2,
        "chat_behind_n_over_idle": ratio(ttft2, idle_ttft),
        "long_ttft_s": long.ttft if long_ok else None,
        "chat_behind_long_ttft_s": ttft3,
        "chat_behind_long_over_idle": ratio(ttft3, idle_ttft),
        "prefix_queries_delta": deltas[0],
        "prefix_hits_delta": deltas[1],
        "cpu_cores": cpu,
        "round_s": round(time.perf_counter() - start, 1),
        "errors": errors,
        "requests": {
            k: {"ttft_s": r.ttft, "e2e_s": r.e2e, "tokens": r.tokens, "sent_at_s": r.scheduled, "error": r.error}
            for k, r in (
                ("chat_idle", idle),
                ("n1", one),
                ("n", many),
                ("n_beside_chat", many2),
                ("chat_behind_n", chat2),
                ("long", long),
                ("chat_behind_long", chat3),
            )
        },
    }


async def warm_up(url: str, name: str, args) -> list[str]:
    """Unmeasured: a chat, then a --prompt-tokens prompt with n=2 (its shared copy, its chunks)."""
    errors: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.request_timeout, connect=10)) as client:
        (r,) = await send(client, chat(name, args.chat_max_tokens))
        check(r, args.chat_max_tokens, errors)
        (r,) = await send(client, completion(name, token_prompt(args.seed - 1, args.prompt_tokens), 2, 4))
        check(r, 8, errors)
    return errors


def round_line(rec: dict, n: int) -> str:
    def s(key: str) -> str:
        return "-" if rec[key] is None else f"{rec[key]:.2f} s"

    return (
        f"n=1 {s('n1_s')}, n={n} {s('n_s')}; chat TTFT idle {s('chat_idle_ttft_s')}, behind n={n} "
        f"{s('chat_behind_n_ttft_s')}, behind long {s('chat_behind_long_ttft_s')}; round {rec['round_s']} s, "
        f"cpu cores {rec['cpu_cores']}" + (f"; ERRORS {rec['errors']}" if rec["errors"] else "")
    )


# -- table ----------------------------------------------------------------------------------------

ROWS = [
    ("{p}-token prompt, n=1: wall time (s)", "n1_s", "s"),
    ("{p}-token prompt, n={n}: wall time (s)", "n_s", "s"),
    ("n={n} / n=1", "n_over_n1", "x"),
    ("prefix-cache queries over the n={n} request (tokens)", "prefix_queries_delta", "tokens"),
    ("prefix-cache hits over the n={n} request (tokens)", "prefix_hits_delta", "tokens"),
    ("short chat TTFT, idle server (s)", "chat_idle_ttft_s", "s"),
    ("short chat TTFT, {d} s after the n={n} request (s)", "chat_behind_n_ttft_s", "s"),
    ("  / idle", "chat_behind_n_over_idle", "x"),
    ("n={n} request's wall time beside that chat (s)", "n_beside_chat_s", "s"),
    ("short chat TTFT, {d} s after a {L}-token prompt (s)", "chat_behind_long_ttft_s", "s"),
    ("  / idle", "chat_behind_long_over_idle", "x"),
    ("{L}-token prompt's TTFT beside that chat (s)", "long_ttft_s", "s"),
]


def stats(rounds: list[dict], key: str) -> dict | None:
    values = [r[key] for r in rounds if r.get(key) is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def cell(s: dict | None, unit: str) -> str:
    if s is None:
        return "-"
    f = {"s": "{:.3f}", "x": "{:.2f}x", "tokens": "{:,.0f}"}[unit]
    out = f.format(s["median"])
    return out if s["min"] == s["max"] else f"{out} ({f.format(s['min'])}–{f.format(s['max'])})"


def print_table(sides: dict[str, list[dict]], args) -> dict:
    """Medians (ranges) per side; with two sides, the ratio of their medians, the last / the first."""
    names = list(sides)
    head = "| figure | " + " | ".join(f"{n} median (range)" for n in names)
    if len(names) == 2:
        head += f" | {names[1]} / {names[0]}"
    print(head + " |")
    print("| --- |" + " ---: |" * (len(names) + (len(names) == 2)))
    summary = {}
    for label, key, unit in ROWS:
        per = {n: stats(sides[n], key) for n in names}
        summary[key] = per
        line = f"| {label.format(p=f'{args.prompt_tokens:,}', n=args.n, d=args.delay, L=f'{args.long_tokens:,}')} | "
        line += " | ".join(cell(per[n], unit) for n in names)
        if len(names) == 2:
            a, b = per[names[0]], per[names[1]]
            r = b["median"] / a["median"] if a and b and a["median"] else None
            summary[key] = per | {"ratio": r}
            line += f" | {'-' if r is None else f'{r:.2f}x'}"
        print(line + " |")
    return summary


# -- main -----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-dir", help="compressed model folder (default: the cached SmolLM2-135M-Instruct)")
    p.add_argument("--checkout", type=Path, help="another checkout of this repository, run beside this one")
    p.add_argument("--repeats", type=int, default=3, help="rounds (each server runs every case once a round)")
    p.add_argument("--prompt-tokens", type=int, default=1000, help="prompt of cases 1 and 2")
    p.add_argument("--n", type=int, default=16, help="choices of the n request")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens out per choice of the prompts")
    p.add_argument("--long-tokens", type=int, default=3584, help="prompt of case 3")
    p.add_argument("--chat-max-tokens", type=int, default=8)
    p.add_argument("--delay", type=float, default=0.5, help="seconds from a prompt to the chat sent behind it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch", type=int, default=32, help="server --max-batch (room for the n choices and chat)")
    p.add_argument("--max-queue", type=int, default=64, help="server --max-queue")
    p.add_argument("--max-model-len", type=int, default=4096, help="server --max-model-len")
    p.add_argument(
        "--kv-cache-tokens", type=int, help="server --kv-cache-tokens (default: n choices of the prompt, and more)"
    )
    p.add_argument("--worker-threads", type=int, default=0, help="server --worker-threads (0: split the cores)")
    p.add_argument("--ready-timeout", type=float, default=240)
    p.add_argument("--request-timeout", type=float, default=900)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fairness_bench.json"))
    args = p.parse_args()
    if args.repeats < 1 or args.n < 2 or min(args.prompt_tokens, args.long_tokens, args.max_tokens) < 1:
        p.error("--repeats, --prompt-tokens, --long-tokens and --max-tokens are at least 1, --n at least 2")
    if max(args.prompt_tokens, args.long_tokens) + args.max_tokens > args.max_model_len:
        p.error("a prompt and its --max-tokens exceed --max-model-len")
    if args.checkout is not None and not (args.checkout / "pyproject.toml").is_file():
        p.error(f"--checkout {args.checkout}: not a checkout of this repository (no pyproject.toml)")
    if args.kv_cache_tokens is None:  # every sequence of the busiest case at once, and a margin
        args.kv_cache_tokens = (args.n + 2) * (args.prompt_tokens + args.max_tokens) + args.long_tokens + 1024
    return args


def start(label: str, model: Path, args, log_dir: Path, env: dict | None, cwd: Path) -> Server:
    extra = ("--kv-cache-tokens", str(args.kv_cache_tokens))
    log = log_dir / f"{label.replace(' ', '-')}.log"
    server = Server(model, "disagg", args, log, extra_args=extra, env=env, cwd=cwd)
    try:
        health = server.wait_ready(args.ready_timeout)
    except (RuntimeError, TimeoutError) as e:
        server.stop(grace=10)
        raise SystemExit(f"[{label}] the server did not start: {e}") from None
    print(f"[{label}] ready in {server.ready_s:.1f} s: {[(w['name'], w['pid']) for w in health['workers']]}")
    return server


def main() -> int:
    args = parse_args()
    run_start = time.perf_counter()
    import unweight

    model = prepare_model(args.model_dir)
    name = model.resolve().name
    from unweight.runtime.generate import encode_prompt

    chat_tokens = len(encode_prompt(unweight.load_tokenizer(model), CHAT))
    log_dir = Path(tempfile.mkdtemp(prefix="fairness_bench_"))
    here, here_dirty = git_commit(ROOT)
    sides: dict[str, dict] = {}
    if args.checkout is not None:
        env, cwd = checkout_env(args.checkout, log_dir)
        commit, dirty = git_commit(args.checkout)
        sides[f"other {commit[:7] if commit else args.checkout.name}"] = {
            "checkout": str(args.checkout.resolve()),
            "commit": commit,
            "uncommitted_changes": dirty,
            "env": env,
            "cwd": cwd,
        }
    sides[f"this {here[:7] if here else 'checkout'}"] = {
        "checkout": str(ROOT),
        "commit": here,
        "uncommitted_changes": here_dirty,
        "env": None,
        "cwd": ROOT,
    }
    print(f"CPU: {cpu_flags()}; model {model} ({name}); short chat {chat_tokens} prompt tokens")
    servers: dict[str, Server] = {}
    try:
        for label, side in sides.items():
            servers[label] = start(label, model, args, log_dir, side.pop("env"), side.pop("cwd"))
            side |= {"server_command": servers[label].cmd, "ready_s": round(servers[label].ready_s, 2)}
            side["warmup_errors"] = asyncio.run(warm_up(servers[label].url, name, args))
            side["rounds"] = []
            if side["warmup_errors"]:
                print(f"[{label}] warm-up errors: {side['warmup_errors']}")
        labels = list(sides)
        for rnd in range(args.repeats):
            for label in labels if rnd % 2 == 0 else labels[::-1]:  # alternated between rounds
                s = servers[label]
                rec = asyncio.run(one_round(s.url, name, args, args.seed + 100 * rnd, s.pgid))
                sides[label]["rounds"].append(rec)
                print(f"[{label}] round {rnd + 1}/{args.repeats}: {round_line(rec, args.n)}", flush=True)
        for label, s in servers.items():
            sides[label]["health_after"] = s.health()
    finally:
        for label, s in servers.items():
            sides[label]["stop"] = s.stop(grace=10)
            sides[label]["server_log_tail"] = s.log_tail()
    print(
        f"\nCPU: {cpu_flags()}; SmolLM2-135M-Instruct compressed, disaggregated (1 prefill + 1 decode worker), "
        f"loopback; medians (ranges) over {args.repeats} round(s)\n"
    )
    summary = print_table({label: side["rounds"] for label, side in sides.items()}, args)
    record = {
        "benchmark": "fairness_bench",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "settings": {**vars(args), "checkout": str(args.checkout) if args.checkout else None, "model": str(model)},
        "chat_prompt_tokens": chat_tokens,
        "sides": sides,
        "summary": summary,
        "server_logs": str(log_dir),
        "total_run_s": round(time.perf_counter() - run_start, 1),
    }
    print(f"\ntotal run time {record['total_run_s']} s (server logs in {log_dir})")
    write_record(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
