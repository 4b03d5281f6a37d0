"""Serving benchmark: `unweight serve` disaggregated (prefill and decode workers) against
`--no-disagg` (one aggregated worker), under the same open-loop load, on loopback.

One run starts the server in each mode in turn (disaggregated first, then aggregated), waits for
GET /health to answer 200, sends a few unmeasured warm-up requests, then replays the same
arrival schedule (same seeds, same prompts, same times) against it, lets the requests in flight
finish, and stops the server with SIGTERM (then kills its process group if anything is left).

The workload mixes two classes of streaming requests (stream: true, include_usage):
  short  a short user question to /v1/chat/completions, max_tokens --short-max-tokens,
         temperature 0, one every --short-interval s: several run at once in the decode batch;
  long   a prompt of >= --long-tokens tokens (numbered English sentences made from a seeded
         generator, token count checked with the model's tokenizer) to /v1/completions,
         max_tokens --long-max-tokens, one every --long-interval s. In aggregated mode each long
         prefill stalls every running sequence for its whole duration; disaggregated, it runs in
         the prefill worker while the decode worker keeps stepping.
Arrivals are at fixed intervals (--arrivals fixed) or Poisson with a fixed seed (--arrivals
poisson), from t=0 up to --duration s, at most --max-requests requests, at most --concurrency
in flight from the client (one that waits for a slot counts its wait as "queue" time, not TTFT).

Measured at the client, per request:
  TTFT  request sent -> first SSE chunk carrying content
  ITL   gaps between consecutive content chunks (pooled over requests; the TPOT a user sees)
  e2e   request sent -> `data: [DONE]`
  tokens completion_tokens from the final usage chunk (content chunks if it is missing)
  errors non-200 statuses, error events in the stream, a stream without [DONE], transport errors
Per mode and class: requests sent/done/errors, TTFT p50/p99, ITL p50/p99 (over every request
that measured them, also those cut short by an error or the deadline), e2e p50 (successful
requests); per mode: output tokens/s (all tokens delivered) and requests/s (successful) over the
run's wall time (first arrival -> last response). A request still running --drain-timeout s
after --duration is cancelled and counts as an error.
The server's /health is sampled every second during the run (worker states, restarts, queue
depths, running batch sizes) to show stalls, queues and crashes, and so is the CPU time of the
machine, of the server's processes and of this client: "other" cores are what other processes
used meanwhile (a shared machine skews every figure; the run warns when it happened).

Headline: p99 ITL of the short chats, disaggregated / aggregated (target <= 0.5), and total
output tokens/s, disaggregated / aggregated (target >= 0.9). Every figure is measured in the run.
The load is open-loop (arrivals do not wait for answers) and greedy, so both modes are asked for
the same tokens: the tokens/s ratio is then the ratio of the times each took to deliver them, and
falls below 1 when a mode cannot keep up with the arrivals (or fails requests).

Local workers split the machine's cores (--worker-threads 0, the server's default): on 2 cores
the disaggregated prefill and decode workers get 1 thread each, the aggregated worker 2.

Run:  python benchmarks/serve_bench.py [--duration 90] [--short-interval 2.5] [--long-interval 12]
                                       [--model-dir DIR] [--out benchmarks/results/serve_bench.json]
The model (SmolLM2-135M-Instruct, compressed) is made once with `unweight.compress` and cached;
a whole run with the defaults takes 4-6 minutes on 2 CPU cores (two server starts of ~20 s,
warm-ups, 2 x ~100 s of load).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from unweight.runtime.generate import encode_prompt

ROOT = Path(__file__).resolve().parents[1]
MODES = {"disagg": [], "agg": ["--no-disagg"]}
OTHER_CPU_WARN = 0.2  # mean cores used by other processes during a run above which the run warns

SHORT_QUESTIONS = [
    "Explain how a bicycle gear system works.",
    "Describe the water cycle in a few sentences.",
    "What are the main causes of the seasons on Earth?",
    "Give me some tips for learning a new language.",
    "Why is the sky blue? Explain simply.",
    "Describe how bread is made, step by step.",
    "What should I pack for a weekend hiking trip?",
    "Explain what a computer's memory is used for.",
    "How do plants make their food?",
    "Write a short story about a cat who finds a key.",
    "What are the benefits of regular exercise?",
    "Explain the difference between weather and climate.",
]

# Vocabulary for the long prompts: numbered sentences whose parts are drawn by a seeded generator,
# so every long prompt is different ordinary English (they share only their first line).
SUBJECTS = [
    "the old miller",
    "a young teacher",
    "the harbour master",
    "my neighbour",
    "the village baker",
    "a travelling musician",
    "the city council",
    "an elderly farmer",
    "the ship's captain",
    "a curious student",
    "the night watchman",
    "the librarian",
]
VERBS = [
    "carried",
    "repaired",
    "painted",
    "described",
    "discovered",
    "sold",
    "measured",
    "photographed",
    "borrowed",
    "planted",
    "cleaned",
    "counted",
]
OBJECTS = [
    "a wooden boat",
    "the stone bridge",
    "three baskets of apples",
    "an ancient map",
    "the broken clock",
    "a pair of boots",
    "the red lantern",
    "seven silver coins",
    "a box of letters",
    "the garden gate",
    "a bundle of firewood",
    "the blue bicycle",
]
PLACES = [
    "near the river",
    "behind the church",
    "at the edge of the forest",
    "in the crowded market",
    "on the windy hill",
    "beside the railway station",
    "under the old oak tree",
    "in the quiet library",
    "along the northern road",
    "at the harbour",
]
TIMES = [
    "early in the morning",
    "after the storm",
    "before the festival",
    "late one evening",
    "during the long winter",
    "on a warm afternoon",
    "at the end of the harvest",
    "while the bells were ringing",
]
REASONS = [
    "because nobody else would",
    "so that the children could see it",
    "as the mayor had asked",
    "for reasons nobody understood",
    "to settle an old argument",
    "in the hope of a reward",
    "without telling anyone",
    "although it was raining",
]


# -- workload -------------------------------------------------------------------------------------


@dataclass(slots=True)
class Job:
    index: int
    kind: str  # short | long
    at: float  # seconds after the start of the schedule
    endpoint: str
    body: dict
    prompt_tokens: int


def long_prompt(rng: random.Random, tokenizer, min_tokens: int) -> tuple[str, int]:
    sentences: list[str] = []
    while True:
        for _ in range(8):
            i = len(sentences) + 1
            s = (
                f"{i}. {rng.choice(TIMES).capitalize()}, {rng.choice(SUBJECTS)} {rng.choice(VERBS)} "
                f"{rng.choice(OBJECTS)} {rng.choice(PLACES)}, {rng.choice(REASONS)}."
            )
            sentences.append(s)
        text = (
            "Here are some notes about a small town.\n"
            + "\n".join(sentences)
            + "\nIn one sentence, the most surprising note was"
        )
        n = len(encode_prompt(tokenizer, text))  # as the server encodes it
        if n >= min_tokens:
            return text, n


def arrival_times(rng: random.Random, interval: float, offset: float, duration: float, poisson: bool) -> list[float]:
    times, t = [], offset
    while t < duration:
        times.append(t)
        t += rng.expovariate(1 / interval) if poisson else interval
    return times


def build_workload(args, tokenizer, model_name: str) -> list[Job]:
    rng = random.Random(args.seed)
    poisson = args.arrivals == "poisson"
    events = [
        (t, "short")
        for t in arrival_times(random.Random(args.seed + 1), args.short_interval, 0.0, args.duration, poisson)
    ]
    events += [
        (t, "long")
        for t in arrival_times(
            random.Random(args.seed + 2), args.long_interval, args.long_offset, args.duration, poisson
        )
    ]
    events.sort()
    events = events[: args.max_requests]
    jobs = []
    for i, (t, kind) in enumerate(events):
        if kind == "short":
            messages = [{"role": "user", "content": rng.choice(SHORT_QUESTIONS)}]
            body = {"model": model_name, "messages": messages, "max_tokens": args.short_max_tokens, "temperature": 0}
            n = len(encode_prompt(tokenizer, messages))  # as the server encodes it
            endpoint = "/v1/chat/completions"
        else:
            prompt, n = long_prompt(rng, tokenizer, args.long_tokens)
            body = {"model": model_name, "prompt": prompt, "max_tokens": args.long_max_tokens, "temperature": 0}
            endpoint = "/v1/completions"
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        jobs.append(Job(i, kind, t, endpoint, body, n))
    return jobs


# -- client ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class Result:
    index: int
    kind: str
    scheduled: float
    queue_s: float = 0.0  # waiting for a client slot
    status: int | None = None
    ttft: float | None = None
    e2e: float | None = None
    gaps: list[float] = field(default_factory=list)
    chunks: int = 0
    tokens: int = 0
    error: str | None = None
    end: float = 0.0  # seconds after the start of the schedule


def content_of(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "delta" in c:  # chat.completion.chunk
        return (c["delta"] or {}).get("content") or ""
    return c.get("text") or ""  # text_completion


async def run_one(client: httpx.AsyncClient, job: Job, sem: asyncio.Semaphore, t0: float, res: Result) -> Result:
    """Send one job at its time and fill `res` as the stream goes (a cancelled request keeps
    what it measured up to then)."""
    await asyncio.sleep(max(0.0, t0 + job.at - time.perf_counter()))
    ready = time.perf_counter()
    async with sem:
        sent = time.perf_counter()
        res.queue_s = sent - ready
        last = None
        done = False
        usage = None
        try:
            async with client.stream("POST", job.endpoint, json=job.body) as r:
                res.status = r.status_code
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    res.error = f"HTTP {r.status_code}: {text[:200]}"
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        now = time.perf_counter()
                        data = line[6:]
                        if data == "[DONE]":
                            done = True
                            break
                        chunk = json.loads(data)
                        if "error" in chunk:
                            res.error = f"error event: {chunk['error'].get('message')}"
                            continue
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        if content_of(chunk):
                            res.chunks = res.tokens = res.chunks + 1
                            if last is None:
                                res.ttft = now - sent
                            else:
                                res.gaps.append(now - last)
                            last = now
                    if not done and res.error is None:
                        res.error = "stream ended without [DONE]"
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            res.error = f"{type(e).__name__}: {e}"
        finally:
            end = time.perf_counter()
            res.e2e, res.end = end - sent, end - t0
        res.tokens = usage["completion_tokens"] if usage else res.chunks
        return res


class CpuMeter:
    """CPU time of the whole machine, of the server's process group and of this process, from
    /proc: what other tenants of a shared machine used during a run shows up as "other"."""

    def __init__(self, pgid: int | None):
        self.pgid = pgid
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.start = self.read()

    def read(self) -> dict | None:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
            busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # all but idle and iowait
            server = sum(_cpu_ticks(pid) for pid in _live_in_group(self.pgid)) if self.pgid else 0
            return {"t": time.perf_counter(), "busy": busy, "server": server, "client": _cpu_ticks(os.getpid())}
        except (OSError, ValueError, IndexError):
            return None

    def since_start(self) -> dict | None:
        """Mean cores busy since the start: total, server, this client, others."""
        now = self.read()
        if now is None or self.start is None or now["t"] <= self.start["t"]:
            return None
        dt = now["t"] - self.start["t"]
        cores = {k: (now[k] - self.start[k]) / self.hz / dt for k in ("busy", "server", "client")}
        cores["server"] = max(cores["server"], 0.0)  # a worker that died took its ticks with it
        cores["other"] = max(0.0, cores["busy"] - cores["server"] - cores["client"])
        return {k: round(v, 3) for k, v in cores.items()}


def _cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime
    except (OSError, ValueError, IndexError):
        return 0


async def monitor(client: httpx.AsyncClient, t0: float, samples: list, stop: asyncio.Event, pgid: int | None) -> None:
    """/health every second, and the CPU used over the last second (by the server and by others)."""
    while not stop.is_set():
        meter = CpuMeter(pgid)
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass
        sample: dict = {"t": round(time.perf_counter() - t0, 2), "cpu_cores": meter.since_start()}
        try:
            r = await client.get("/health", timeout=5)
            sample |= {"status": r.status_code, "workers": r.json().get("workers", [])}
        except (httpx.HTTPError, ValueError) as e:
            sample |= {"status": None, "error": f"{type(e).__name__}: {e}"}
        samples.append(sample)


async def run_workload(
    url: str, jobs: list[Job], args, pgid: int | None = None
) -> tuple[list[Result], float, list[dict], dict | None]:
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    timeout = httpx.Timeout(args.request_timeout, connect=10)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        sem = asyncio.Semaphore(args.concurrency)
        samples: list[dict] = []
        stop = asyncio.Event()
        results = [Result(j.index, j.kind, j.at) for j in jobs]
        meter = CpuMeter(pgid)
        t0 = time.perf_counter()
        mon = asyncio.create_task(monitor(client, t0, samples, stop, pgid))
        tasks = [asyncio.create_task(run_one(client, j, sem, t0, r)) for j, r in zip(jobs, results)]
        deadline = args.duration + args.drain_timeout
        _, pending = await asyncio.wait(tasks, timeout=max(1.0, t0 + deadline - time.perf_counter()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for r, t in zip(results, tasks):
            if t in pending:
                r.error = f"not finished {deadline:.0f} s after the start" + (
                    "" if r.ttft is None else f" ({r.chunks} chunks received)"
                )
        cpu = meter.since_start()
        wall = max((r.end for r in results), default=0.0)
        stop.set()
        await mon
        return results, wall, samples, cpu


async def warm_up(url: str, jobs: list[Job], n: int) -> list[str]:
    """Unmeasured requests: one of each class first, in turn (loads code paths, autotunes shapes)."""
    picks = [next(j for j in jobs if j.kind == k) for k in ("short", "long") if any(j.kind == k for j in jobs)][
        : max(n, 0)
    ]
    errors = []
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300, connect=10)) as client:
        sem = asyncio.Semaphore(1)
        for j in picks:
            r = await run_one(
                client,
                Job(-1, j.kind, 0.0, j.endpoint, j.body, j.prompt_tokens),
                sem,
                time.perf_counter(),
                Result(-1, j.kind, 0.0),
            )
            if r.error:
                errors.append(f"{j.kind}: {r.error}")
    return errors


# -- server ---------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # zombies of our own group count as gone once reaped; list the live members
    return any(_live_in_group(pgid))


def _live_in_group(pgid: int):
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            yield int(d.name)


class Server:
    """`unweight serve` in a process group of its own. `extra_args` go after the flags from `args`;
    `env` and `cwd` (default: this environment, the repository root) let another checkout's code run
    (benchmarks/fairness_bench.py --checkout)."""

    def __init__(
        self,
        model: Path,
        mode: str,
        args,
        log_path: Path,
        extra_args: tuple[str, ...] = (),
        env: dict | None = None,
        cwd: Path = ROOT,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "unweight.cli.main",
            "serve",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-batch",
            str(args.max_batch),
            "--max-queue",
            str(args.max_queue),
            "--max-model-len",
            str(args.max_model_len),
            *MODES[mode],
        ]
        if args.worker_threads:
            cmd += ["--worker-threads", str(args.worker_threads)]
        cmd += extra_args
        self.cmd = cmd
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
        )
        self.pgid = self.proc.pid  # start_new_session: the server leads its own process group
        self.ready_s: float | None = None
        self.worker_pids: list[int] = []

    def wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.url, timeout=5) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"server exited with {self.proc.returncode} while starting; see "
                        f"{self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    r = http.get("/health")
                    if r.status_code == 200:
                        self.ready_s = time.perf_counter() - self.started
                        h = r.json()
                        self.worker_pids = [w["pid"] for w in h["workers"] if w.get("pid")]
                        return h
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
        raise TimeoutError(f"server not ready after {timeout:.0f} s; see {self.log_path}")

    def health(self) -> dict | None:
        try:
            return httpx.get(f"{self.url}/health", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return None

    def metrics(self) -> str | None:
        try:
            return httpx.get(f"{self.url}/metrics", timeout=5).text
        except httpx.HTTPError:
            return None

    def stop(self, grace: float = 30) -> dict:
        """SIGTERM the router; wait; then SIGKILL the whole process group if anything is left."""
        h = self.health()
        if h:
            self.worker_pids = sorted(set(self.worker_pids) | {w["pid"] for w in h["workers"] if w.get("pid")})
        info: dict = {"exit_code": None, "stop_s": None, "killed": [], "left_after_kill": []}
        t = time.perf_counter()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            info["exit_code"] = self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            info["killed"].append(self.proc.pid)
        deadline = time.monotonic() + 10  # workers exit after the router; give them a moment
        while group_alive(self.pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = sorted(set(_live_in_group(self.pgid)) | {p for p in self.worker_pids if _alive(p)})
        if left:
            info["killed"] += left
            try:
                os.killpg(self.pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for p in left:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)
        info["exit_code"] = self.proc.returncode
        info["stop_s"] = round(time.perf_counter() - t, 2)
        info["left_after_kill"] = [p for p in self.worker_pids if _alive(p)]
        self.log.close()
        return info

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -- statistics -----------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile, linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarise(results: list[Result], kind: str | None) -> dict:
    rs = [r for r in results if kind is None or r.kind == kind]
    ok = [r for r in rs if r.error is None]
    # latencies of every request that measured them: one cut short by an error or the deadline
    # still saw its first token and its gaps (leaving them out would hide the worst stalls)
    ttft = [r.ttft for r in rs if r.ttft is not None]
    gaps = [g for r in rs for g in r.gaps]
    tpot = [(r.e2e - r.ttft) / (r.tokens - 1) for r in ok if r.ttft is not None and r.tokens > 1]
    return {
        "sent": len(rs),
        "done": len(ok),
        "errors": len(rs) - len(ok),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "ttft_max_s": max(ttft, default=None),
        "itl_p50_s": pct(gaps, 50),
        "itl_p99_s": pct(gaps, 99),
        "itl_max_s": max(gaps, default=None),
        "itl_samples": len(gaps),
        "tpot_mean_s": sum(tpot) / len(tpot) if tpot else None,
        "e2e_p50_s": pct([r.e2e for r in ok], 50),
        "e2e_p99_s": pct([r.e2e for r in ok], 99),
        "queue_max_s": max((r.queue_s for r in rs), default=0.0),
        "output_tokens": sum(r.tokens for r in rs),  # delivered to clients, also by requests that failed later
        "output_tokens_ok": sum(r.tokens for r in ok),
    }


def worker_summary(samples: list[dict]) -> dict:
    """Per worker, over the /health samples: max running/queued, restarts, states other than ready."""
    out: dict = {}
    for s in samples:
        for w in s.get("workers", []):
            d = out.setdefault(
                w["name"],
                {"role": w["role"], "max_running": 0, "max_queued": 0, "restarts": 0, "pids": [], "bad_states": []},
            )
            d["max_running"] = max(d["max_running"], w["running"])
            d["max_queued"] = max(d["max_queued"], w["queued"])
            d["restarts"] = max(d["restarts"], w["restarts"])
            if w["pid"] not in d["pids"]:
                d["pids"].append(w["pid"])
            if w["state"] != "ready":
                d["bad_states"].append([s["t"], w["state"]])
    unhealthy = [[s["t"], s["status"], s.get("error")] for s in samples if s["status"] != 200]
    return {"workers": out, "health_not_200": unhealthy}


def server_events(m: dict) -> list[str]:
    """What looked wrong in a mode: errors by message, worker restarts and states, exceptions in the log."""
    lines = []
    by_msg: dict[str, int] = {}
    for e in m["errors"]:
        key = re.sub(r" \(\d+ chunks received\)", "", e["error"] or "")[:120]
        by_msg[key] = by_msg.get(key, 0) + 1
    lines += [f"{n} x {msg}" for msg, n in sorted(by_msg.items(), key=lambda kv: -kv[1])]
    for name, w in m["health"]["workers"].items():
        if w["restarts"] or w["bad_states"]:
            states = sorted({s for _, s in w["bad_states"]})
            lines.append(
                f"worker {name}: {w['restarts']} restart(s), pids {w['pids']}, seen {states} in "
                f"{len(w['bad_states'])} health sample(s)"
            )
    try:
        log = Path(m["server_log"]).read_text(errors="replace").splitlines()
    except OSError:
        log = []
    tracebacks = sum(line.startswith("Traceback") for line in log)
    if tracebacks:
        last = next(
            (
                line
                for line in reversed(log)
                if line and not line.startswith(" ") and ("Error" in line or "Exception" in line)
            ),
            "",
        )
        lines.append(f"server log: {tracebacks} traceback(s); last: {last[:200]}")
    if not m["server_alive_after_run"]:
        lines.append("the server process had exited before the end of the run")
    if m["stop"]["killed"] or m["stop"]["left_after_kill"]:
        lines.append(f"stop: had to SIGKILL {m['stop']['killed']}; still alive: {m['stop']['left_after_kill']}")
    cpu = m.get("cpu_cores")
    if cpu and cpu["other"] > OTHER_CPU_WARN:
        peak = max((x["cpu_cores"]["other"] for x in m["health_samples"] if x.get("cpu_cores")), default=0.0)
        lines.append(
            f"WARNING: other processes used {cpu['other']:.2f} cores on average during the run (peak {peak:.2f} over "
            f"1 s); "
            f"the server used {cpu['server']:.2f}, this client {cpu['client']:.2f}, of {os.cpu_count()}"
        )
    m["events"] = lines
    return lines


# -- main -----------------------------------------------------------------------------------------


def machine_info() -> dict:
    cpu = ""
    try:
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "",
        )
    except OSError:
        pass
    mem = None
    try:
        mem = round(
            int(
                next(
                    line.split()[1]
                    for line in Path("/proc/meminfo").read_text().splitlines()
                    if line.startswith("MemTotal")
                )
            )
            / 2**20,
            1,
        )
    except (OSError, StopIteration):
        pass
    import torch

    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "httpx": httpx.__version__,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": mem,
        "loadavg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "git_commit": commit,
        "env": {
            k: v
            for k, v in os.environ.items()
            if k.startswith("UNWEIGHT_") or k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
        },
    }


def prepare_model(model_dir: str | None) -> Path:
    if model_dir:
        return Path(model_dir)
    import unweight
    from unweight.defaults import cache_dir
    from unweight.testing import smollm2_bf16

    dst = cache_dir() / "smollm2-uw"
    if not dst.exists():
        src = smollm2_bf16(cache_dir() / "smollm2-bf16")
        unweight.compress(src, dst)
    return dst


def fmt(x: float | None, scale: float = 1000, digits: int = 0) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def print_table(modes: dict) -> None:
    head = (
        f"{'mode':<7} {'class':<6} {'sent':>5} {'done':>5} {'err':>4} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8} {'ITL max':>8} {'e2e p50':>8} {'tokens':>7} {'tok/s':>6} {'req/s':>6}"
    )
    print(head)
    print(f"{'':<7} {'':<6} {'':>5} {'':>5} {'':>4} {'ms':>9} {'ms':>9} {'ms':>8} {'ms':>8} {'ms':>8} {'s':>8}")
    print("-" * len(head))
    for mode, m in modes.items():
        if "failed" in m:
            print(f"{mode:<7} (did not start: {m['failed'].splitlines()[0][:90]})")
            continue
        for cls in ("short", "long", "all"):
            s = m["classes"][cls]
            rate = f"{m['tokens_per_s']:6.2f} {m['requests_per_s']:6.3f}" if cls == "all" else ""
            print(
                f"{mode:<7} {cls:<6} {s['sent']:>5} {s['done']:>5} {s['errors']:>4} {fmt(s['ttft_p50_s']):>9} "
                f"{fmt(s['ttft_p99_s']):>9} "
                f"{fmt(s['itl_p50_s']):>8} {fmt(s['itl_p99_s']):>8} {fmt(s['itl_max_s']):>8} "
                f"{fmt(s['e2e_p50_s'], 1, 2):>8} {s['output_tokens']:>7} {rate}"
            )


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model-dir", help="compressed model folder (default: the cached SmolLM2-135M-Instruct, made if missing)"
    )
    p.add_argument("--modes", default="disagg,agg", help="comma-separated, in run order: disagg, agg")
    p.add_argument(
        "--duration", type=float, default=90, help="seconds of arrivals per mode (then in-flight requests finish)"
    )
    p.add_argument("--max-requests", type=int, default=200, help="at most this many requests per mode")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=90,
        help="seconds after --duration before unfinished requests count as errors",
    )
    p.add_argument("--arrivals", choices=("fixed", "poisson"), default="fixed")
    p.add_argument("--short-interval", type=float, default=2.5, help="seconds between short chats (mean, with poisson)")
    p.add_argument(
        "--long-interval", type=float, default=12.0, help="seconds between long prompts (mean, with poisson)"
    )
    p.add_argument("--long-offset", type=float, default=4.0, help="first long prompt at this many seconds")
    p.add_argument("--long-tokens", type=int, default=1000, help="least prompt tokens of a long prompt")
    p.add_argument("--long-max-tokens", type=int, default=16)
    p.add_argument("--short-max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32, help="most requests in flight from the client")
    p.add_argument(
        "--warmup", type=int, default=2, help="unmeasured warm-up requests per mode (a short chat, then a long prompt)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch", type=int, default=16, help="server --max-batch")
    p.add_argument("--max-queue", type=int, default=64, help="server --max-queue")
    p.add_argument("--max-model-len", type=int, default=2048, help="server --max-model-len (sizes the KV caches)")
    p.add_argument(
        "--worker-threads", type=int, default=0, help="server --worker-threads (0: the server splits the cores)"
    )
    p.add_argument("--ready-timeout", type=float, default=240, help="seconds to wait for /health 200")
    p.add_argument("--request-timeout", type=float, default=180)
    p.add_argument(
        "--itl-target", type=float, default=0.5, help="target for short-chat p99 ITL, disagg / agg (at most)"
    )
    p.add_argument("--throughput-target", type=float, default=0.9, help="target for tokens/s, disagg / agg (at least)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve_bench.json"))
    args = p.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad := [m for m in modes if m not in MODES]:
        p.error(f"unknown mode(s) {bad}; choose from {list(MODES)}")

    run_start = time.perf_counter()
    import unweight

    model = prepare_model(args.model_dir)
    tokenizer = unweight.load_tokenizer(model)
    name = model.resolve().name
    jobs = build_workload(args, tokenizer, name)
    n_short = sum(j.kind == "short" for j in jobs)
    n_long = len(jobs) - n_short
    long_tokens = [j.prompt_tokens for j in jobs if j.kind == "long"]
    print(
        f"model {model} ({name}); per mode: {n_short} short chats every {args.short_interval} s, {n_long} long prompts "
        f"({min(long_tokens, default=0)}-{max(long_tokens, default=0)} tokens) every {args.long_interval} s, over "
        f"{args.duration} s ({args.arrivals})",
        flush=True,
    )
    if long_tokens and min(long_tokens) < args.long_tokens:
        raise SystemExit("a long prompt is shorter than --long-tokens")

    log_dir = Path(tempfile.mkdtemp(prefix="serve_bench_"))
    report: dict = {
        "benchmark": "serve_bench",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "settings": {**vars(args), "model": str(model), "served_model": name},
        "workload": {
            "short": n_short,
            "long": n_long,
            "long_prompt_tokens": long_tokens,
            "short_prompt_tokens": sorted({j.prompt_tokens for j in jobs if j.kind == "short"}),
            "schedule": [[round(j.at, 3), j.kind] for j in jobs],
        },
        "modes": {},
    }
    servers: list[Server] = []
    try:
        for mode in modes:
            t_mode = time.perf_counter()
            print(f"\n[{mode}] starting the server ...", flush=True)
            server = Server(model, mode, args, log_dir / f"{mode}.log")
            servers.append(server)
            try:
                health = server.wait_ready(args.ready_timeout)
            except (RuntimeError, TimeoutError) as e:  # record it and go on with the next mode
                print(f"[{mode}] FAILED to start: {e}", flush=True)
                report["modes"][mode] = {
                    "failed": str(e),
                    "server_command": server.cmd,
                    "stop": server.stop(grace=10),
                    "server_log": str(server.log_path),
                    "server_log_tail": server.log_tail(),
                }
                servers.remove(server)
                continue
            print(
                f"[{mode}] ready in {server.ready_s:.1f} s: {[(w['name'], w['pid']) for w in health['workers']]}",
                flush=True,
            )
            t = time.perf_counter()
            warm_errors = asyncio.run(warm_up(server.url, jobs, args.warmup))
            warm_s = time.perf_counter() - t
            print(
                f"[{mode}] warm-up {warm_s:.1f} s{'; errors: ' + '; '.join(warm_errors) if warm_errors else ''}",
                flush=True,
            )
            print(f"[{mode}] running the workload ({len(jobs)} requests) ...", flush=True)
            results, wall, samples, cpu = asyncio.run(run_workload(server.url, jobs, args, server.pgid))
            metrics_text = server.metrics()
            alive_after = server.proc.poll() is None
            stop_info = server.stop()
            servers.remove(server)
            classes = {k: summarise(results, None if k == "all" else k) for k in ("short", "long", "all")}
            total_tokens = classes["all"]["output_tokens"]
            errors = [
                {"index": r.index, "kind": r.kind, "at": r.scheduled, "status": r.status, "error": r.error}
                for r in results
                if r.error
            ]
            report["modes"][mode] = {
                "server_command": server.cmd,
                "ready_s": round(server.ready_s, 2),
                "warmup_s": round(warm_s, 2),
                "warmup_errors": warm_errors,
                "wall_s": round(wall, 3),
                "cpu_cores": cpu,
                "tokens_per_s": total_tokens / wall if wall else 0.0,
                "requests_per_s": classes["all"]["done"] / wall if wall else 0.0,
                "classes": classes,
                "errors": errors,
                "server_alive_after_run": alive_after,
                "stop": stop_info,
                "health": worker_summary(samples),
                "health_samples": samples,
                "server_metrics": {
                    line.split(" ")[0]: line.split(" ")[1]
                    for line in (metrics_text or "").splitlines()
                    if line.startswith(
                        (
                            "http_requests_total",
                            "vllm:generation_tokens_total",
                            "unweight:kv_transfer_bytes_total",
                            "vllm:time_to_first_token_seconds_count",
                            "vllm:time_to_first_token_seconds_sum",
                            "vllm:inter_token_latency_seconds_count",
                            "vllm:inter_token_latency_seconds_sum",
                        )
                    )
                },
                "server_log": str(server.log_path),
                "server_log_tail": server.log_tail(),
                "requests": [
                    {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(r).items() if k != "gaps"}
                    | {"gaps": [round(g, 4) for g in r.gaps]}
                    for r in results
                ],
                "mode_s": round(time.perf_counter() - t_mode, 1),
            }
            for line in server_events(report["modes"][mode]):
                print(f"[{mode}] {line}", flush=True)
            c = classes
            print(
                f"[{mode}] done in {wall:.1f} s: {c['all']['done']}/{c['all']['sent']} ok, {c['all']['errors']} "
                f"errors, cpu cores {cpu}, "
                f"{total_tokens / wall if wall else 0:.2f} tok/s; stopped in {stop_info['stop_s']} s (exit "
                f"{stop_info['exit_code']}"
                f"{', killed ' + str(stop_info['killed']) if stop_info['killed'] else ''})",
                flush=True,
            )
    finally:
        for s in servers:  # interrupted: leave nothing running
            s.stop(grace=10)

    print()
    print_table(report["modes"])
    headline = {}
    if {"disagg", "agg"} <= report["modes"].keys() and not any("failed" in m for m in report["modes"].values()):
        d, a = report["modes"]["disagg"], report["modes"]["agg"]
        di, ai = d["classes"]["short"]["itl_p99_s"], a["classes"]["short"]["itl_p99_s"]
        itl_ratio = di / ai if di is not None and ai else None
        tok_ratio = d["tokens_per_s"] / a["tokens_per_s"] if a["tokens_per_s"] else None
        headline = {
            "short_itl_p99_ratio": itl_ratio,
            "short_itl_p99_target": args.itl_target,
            "short_itl_p99_met": itl_ratio is not None and itl_ratio <= args.itl_target,
            "tokens_per_s_ratio": tok_ratio,
            "tokens_per_s_target": args.throughput_target,
            "tokens_per_s_met": tok_ratio is not None and tok_ratio >= args.throughput_target,
        }
        print()
        print(
            f"short-chat p99 ITL, disagg / agg: {fmt(di)} ms / {fmt(ai)} ms = "
            f"{'-' if itl_ratio is None else f'{itl_ratio:.3f}'}"
            f"  (target <= {args.itl_target}: {'met' if headline['short_itl_p99_met'] else 'NOT met'})"
        )
        print(
            f"output tokens/s,    disagg / agg: {d['tokens_per_s']:.2f} / {a['tokens_per_s']:.2f} = "
            f"{'-' if tok_ratio is None else f'{tok_ratio:.3f}'}"
            f"  (target >= {args.throughput_target}: {'met' if headline['tokens_per_s_met'] else 'NOT met'})"
        )
    report["headline"] = headline
    report["total_run_s"] = round(time.perf_counter() - run_start, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\ntotal run time {report['total_run_s']} s; wrote {out} (server logs in {log_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
