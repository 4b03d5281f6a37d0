"""The KV hand-off between hosts: bytes on the wire and time, coded or raw, at 1 and 10 Gbit/s.

The router, the prefill worker, the decode worker and the client each run in a network namespace of
their own (tests/hosts.py: veth links to a bridge), so the KV cache crosses a real link;
`tc tbf` shapes what the prefill host sends to --rates. Sealing is on (the workers are not on
loopback), as it would be between machines.

For each KV cache dtype (--dtypes) and each `--kv-compression` (off, on; alternated, --rounds times)
one server is started; at each rate it answers --requests streaming completions of a --tokens-token
prompt (token ids drawn with a fixed seed), 4 tokens each. Measured at the client:
  first   request sent -> first token (the prefill: the hand-off starts after it)
  second  request sent -> second token (the first decode step needs the whole cache)
  hand-off second - first (the transfer, and one decode step)
and from the router's /metrics over the run: the cache's bytes and the frames' bytes. What the
decode host received is counted too, and broken into parts (`bytes` in the JSON, and a second table):
  received  the decode host's eth0 rx bytes (Ethernet, IP and TCP headers included)
  from prefill  TCP payload from the prefill host: the frames, plus the link's own exchanges
            (the gloo handshake, the proof, lengths, the probe when --kv-compression is auto)
  from router   TCP payload from the router (the control channel: jobs, heartbeat replies)
  headers   received - payload: Ethernet, IP and TCP headers of what arrived
  retransmitted segments (the prefill host's TcpRetransSegs) and packets the shaping dropped.

Run as root:  python benchmarks/kv_handoff_bench.py [--tokens 2048] [--rates 1gbit,10gbit]
The model (SmolLM2-135M-Instruct, compressed) is made once and cached. ~5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from serve_bench import prepare_model
from side_by_side import cpu_flags, write_record

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test support: network namespaces
from hosts import Hosts  # noqa: E402

ROLES = ("router", "prefill", "decode", "client")
CLIENT = r"""
import json, random, sys, time, httpx
url, n, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(0)
out = []
with httpx.Client(base_url=url, timeout=300) as c:
    deadline = time.monotonic() + 300
    while True:
        try:
            if c.get("/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            sys.exit("server not ready")
        time.sleep(0.3)
    for i in range(n + 1):  # the first one warms up
        prompt = [rng.randrange(1000, 40000) for _ in range(tokens)]
        body = {"model": "uw", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}
        t0, stamps = time.perf_counter(), []
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: {") and '"error"' in line:
                    sys.exit(line)
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"] is not None:
                    stamps.append(time.perf_counter() - t0)
        if i:
            out.append({"first": stamps[0], "second": stamps[1]})
    metrics = c.get("/metrics").text
print(json.dumps({"runs": out, "metrics": metrics}))
"""


def counter(metrics: str, name: str) -> float:
    return sum(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith(name + "{"))


def commands(
    router: str, model: Path, secret: Path, dtype: str, compression: str, options: tuple[str, ...] = ()
) -> dict[str, tuple[list[str], dict[str, str]]]:
    """The command line and environment of the router (at address `router`), the prefill and the
    decode worker: one thread a worker (as the loopback server splits 2 cores), `options` for every
    role, and the kernels' pipelines the autotuner picks, as `unweight serve` runs them (none forced:
    `fused` everywhere made a prefill several times slower)."""
    base = [sys.executable, "-m", "unweight.cli.main", "serve", str(model), "--control-secret-file", str(secret)]
    base += ["--kv-cache-dtype", dtype, "--kv-compression", compression, "--worker-threads", "1"]
    base += ["--served-model-name", "uw", *options]
    out = {"router": [*base, "--role", "router", "--host", router, "--port", "8000", "--control-port", "5555"]}
    for role in ("prefill", "decode"):
        out[role] = [*base, "--role", role, "--name", f"{role}-0", "--router-address", f"{router}:5555"]
    return {role: (cmd, dict(os.environ)) for role, cmd in out.items()}


def serve(
    hosts: Hosts, model: Path, secret: Path, dtype: str, compression: str, log, options: tuple[str, ...] = ()
) -> dict[str, subprocess.Popen]:
    """Start `commands`, each role on its host, their stderr to `log`."""
    cmds = commands(hosts.addr["router"], model, secret, dtype, compression, options)
    return {role: hosts.run(role, *cmd, env=env, stderr=log) for role, (cmd, env) in cmds.items()}


def snapshot(hosts: Hosts) -> dict:
    return {
        "decode": hosts.counters("decode"),
        "prefill": hosts.counters("prefill"),
        "received": hosts.received("decode"),
    }


def breakdown(before: dict, after: dict, raw: float, frames: float) -> dict:
    """What the decode host received between two snapshots, in parts (bytes; see the docstring)."""

    def got(peer: str) -> int:
        return after["received"].get(peer, 0) - before["received"].get(peer, 0)

    received = after["decode"]["rx_bytes"] - before["decode"]["rx_bytes"]
    return {
        "cache": raw,
        "frames": frames,
        "received": received,
        "from_prefill": got("prefill"),
        "link_exchanges": got("prefill") - frames,  # handshake, proof, lengths, probe
        "from_router": got("router"),
        "headers": received - got("prefill") - got("router") - got("client"),
        "packets": after["decode"]["rx_packets"] - before["decode"]["rx_packets"],
        "retransmitted_segments": after["prefill"]["tcp_retrans_segs"] - before["prefill"]["tcp_retrans_segs"],
        "qdisc_drops": after["prefill"]["qdisc_drops"] - before["prefill"]["qdisc_drops"],
    }


def stop(procs: dict) -> None:
    for p in procs.values():
        p.send_signal(signal.SIGTERM)
    for p in procs.values():
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--rates", default="1gbit,10gbit")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model-dir")
    ap.add_argument("--out", default="benchmarks/results/kv_handoff_bench.json")
    args = ap.parse_args()
    model = prepare_model(args.model_dir)
    rates = args.rates.split(",")
    print(f"CPU: {cpu_flags()}")
    results: dict = {}
    hosts = Hosts(ROLES)
    tmp = Path(tempfile.mkdtemp())
    secret = tmp / "secret"
    secret.write_text("b" * 48 + "\n")
    secret.chmod(0o600)
    log = open(tmp / "workers.log", "w")  # noqa: SIM115
    try:
        for rnd in range(args.rounds):
            for dtype in args.dtypes.split(","):
                order = ("off", "on") if rnd % 2 == 0 else ("on", "off")  # alternated between rounds
                for compression in order:
                    procs = serve(hosts, model, secret, dtype, compression, log)
                    try:
                        seen = 0.0, 0.0
                        for rate in rates:
                            hosts.limit("prefill", rate)
                            before = snapshot(hosts)
                            r = subprocess.run(
                                ["ip", "netns", "exec", hosts.ns["client"], sys.executable, "-c", CLIENT]
                                + [f"http://{hosts.addr['router']}:8000", str(args.requests), str(args.tokens)],
                                capture_output=True,
                                text=True,
                                timeout=900,
                            )
                            if r.returncode:
                                raise RuntimeError(r.stderr[-2000:])
                            got = json.loads(r.stdout)
                            raw = counter(got["metrics"], "unweight:kv_transfer_bytes_total")
                            wire = counter(got["metrics"], "unweight:kv_wire_bytes_total")
                            cell = results.setdefault(
                                f"{dtype} {rate} {compression}", {"runs": [], "wire/raw": [], "bytes": []}
                            )
                            cell["runs"] += got["runs"]
                            cell["wire/raw"].append((wire - seen[1]) / (raw - seen[0]))
                            cell["bytes"].append(breakdown(before, snapshot(hosts), raw - seen[0], wire - seen[1]))
                            seen = raw, wire
                            print(
                                dtype,
                                rate,
                                compression,
                                got["runs"],
                                f"wire/raw {cell['wire/raw'][-1]:.3f}",
                                flush=True,
                            )
                    finally:
                        stop(procs)
    finally:
        log.close()
        hosts.close()

    def med(values):
        return statistics.median(values), min(values), max(values)

    print(f"\nCPU: {cpu_flags()}; prompt {args.tokens} tokens, {args.requests} requests x {args.rounds} rounds a cell")
    print("| KV dtype | link | hand-off raw ms | hand-off coded ms | coded / raw | wire / cache (coded) |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    summary = {}
    for dtype in args.dtypes.split(","):
        for rate in rates:
            off, on = results[f"{dtype} {rate} off"], results[f"{dtype} {rate} on"]
            h_off = med([r["second"] - r["first"] for r in off["runs"]])
            h_on = med([r["second"] - r["first"] for r in on["runs"]])
            ratio = med(on["wire/raw"])
            summary[f"{dtype} {rate}"] = {
                "handoff_raw_s": h_off,
                "handoff_coded_s": h_on,
                "coded_over_raw": h_on[0] / h_off[0],
                "wire_over_cache_coded": ratio,
                "wire_over_cache_raw": med(off["wire/raw"]),
                "first_token_s": med([r["first"] for r in on["runs"] + off["runs"]]),
            }
            print(
                f"| {dtype} | {rate} | {h_off[0] * 1e3:.0f} ({h_off[1] * 1e3:.0f}-{h_off[2] * 1e3:.0f}) "
                f"| {h_on[0] * 1e3:.0f} ({h_on[1] * 1e3:.0f}-{h_on[2] * 1e3:.0f}) | {h_on[0] / h_off[0]:.2f} "
                f"| {ratio[0]:.3f} |"
            )
    print_bytes(results, args.dtypes.split(","), rates)
    write_record(
        args.out,
        {
            "benchmark": "kv_handoff_bench",
            "date": time.strftime("%Y-%m-%d"),
            "args": vars(args),
            "summary": summary,
            "cells": results,
        },
    )


def print_bytes(results: dict, dtypes: list[str], rates: list[str]) -> None:
    """The decode host's received bytes in parts, summed over a cell's runs, as multiples of the cache."""
    print(
        "\n| KV dtype | link | coding | cache MB | frames | received | from prefill, not frames | from router "
        "| headers | retransmitted segments | qdisc drops |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for dtype in dtypes:
        for rate in rates:
            for compression in ("off", "on"):
                b = results[f"{dtype} {rate} {compression}"]["bytes"]
                total = {k: sum(x[k] for x in b) for k in b[0]}
                cache = total["cache"]
                share = [f"{total[k] / cache:.4f}×" for k in ("frames", "received")]
                share += [f"{total[k] / 1e6:.3f} MB" for k in ("link_exchanges", "from_router", "headers")]
                print(
                    f"| {dtype} | {rate} | {compression} | {cache / 1e6:.1f} | {' | '.join(share)} "
                    f"| {total['retransmitted_segments']} | {total['qdisc_drops']} |"
                )


if __name__ == "__main__":
    main()
