"""What the KV link sends besides its frames, counted on a real link: two gloo ranks in a network
namespace of their own (`unshare --net`), whose loopback carries nothing else, so its byte counter
is the link's bytes, headers and all.

- With `--kv-compression` on or off there is nothing to decide, so no probe of the link: a transfer
  costs its frames and a few kB of proof, lengths and TCP headers (it cost 4 MiB more: the probe).
- With auto, the probe is sent once on the new group and its rate is the link's: timed until the
  receiver has all of it, so a link shaped to 100 Mbit/s measures at most that (the sender's socket
  buffers took most of the probe at once, which read as several times the link's rate). The workers
  listen on an address of their own (10.77.0.1, on `lo` as any local address is), for on loopback
  auto sends raw frames and no probe.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for the namespace and `tc`): without it the test fails
saying so.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from unweight.runtime.serve.kv_link import PROBE_BYTES

pytestmark = pytest.mark.slow

SCRIPT = r"""
import json, subprocess, sys
import torch, torch.distributed as dist
from unweight.runtime.serve.kv_link import KVLink, Transfer
from unweight.runtime.kv.secret import kv_link_key

compression, rate, host = sys.argv[1], sys.argv[2], sys.argv[3]
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
if host != "127.0.0.1":  # a local address that is not loopback's: its packets still go through lo
    subprocess.run(["ip", "addr", "add", f"{host}/32", "dev", "lo"], check=True)
if rate != "none":  # both directions go through lo's one qdisc
    subprocess.run(
        ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"],
        check=True,
    )

def lo_bytes():  # /proc/net/dev is this namespace's (/sys/class/net is the one /sys was mounted in)
    with open("/proc/net/dev") as f:
        return next(int(row.split(":")[1].split()[0]) for row in f if row.strip().startswith("lo:"))

key, store = kv_link_key("s" * 40), dist.HashStore()
p = KVLink(store, key, "inc-p", 0, bind_host=host, compression=compression, encryption="off")
d = KVLink(store, key, "inc-d", 1, bind_host=host, compression=compression, encryption="off")
kv = torch.randn(4, 2, 256, 4, 64)  # 4 layers, 1 MiB in FP32
before = lo_bytes()
p.submit(Transfer("r1", 1, "decode-0", "inc-d", tensor=kv))
d.submit(Transfer("r1", 1, "prefill-0", "inc-p", shape=tuple(kv.shape), dtype="float32"))
sent, got = p.done.get(timeout=120), d.done.get(timeout=120)
assert got.tensor is not None and torch.equal(got.tensor, kv), (sent.error, got.error)
print(json.dumps({
    "link_bytes": lo_bytes() - before,
    "wire_bytes": sent.wire_bytes,
    "rate": next(iter(p._groups.values())).link_rate,
    "compressed": sent.compressed,
}))
"""


def transfer_in_a_namespace(compression: str, rate: str | None, host: str = "10.77.0.1") -> dict:
    r = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", SCRIPT, compression, rate or "none", host],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode and ("unshare" in r.stderr and "ermission" in r.stderr or "Operation not permitted" in r.stderr):
        pytest.fail(f"cannot make a network namespace here (needs root): {r.stderr.strip()[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.parametrize("compression,host", [("off", "10.77.0.1"), ("on", "10.77.0.1"), ("auto", "127.0.0.1")])
def test_a_link_that_does_not_choose_whether_to_code_sends_no_probe(compression, host):
    """On or off, or auto on loopback (raw frames: no byte crosses a network)."""
    got = transfer_in_a_namespace(compression, None, host)
    assert got["rate"] == 0.0 and got["compressed"] == (compression == "on")
    extra = got["link_bytes"] - got["wire_bytes"]
    assert 0 < extra < 64 << 10, got  # the gloo handshake, the proof, lengths, TCP/IP headers: no 4 MiB probe


def test_the_auto_probe_is_sent_once_and_measures_the_link_not_the_socket_buffers():
    got = transfer_in_a_namespace("auto", "100mbit")
    assert PROBE_BYTES < got["link_bytes"] - got["wire_bytes"] < PROBE_BYTES + (64 << 10), got
    # 12.5 MB/s, and a 256 KiB bucket's head start on 4 MiB: at most 1.07x that; slower only if the machine is
    assert 0 < got["rate"] <= 1.12 * 12.5e6, got
    assert got["compressed"], got  # a link this slow is slower than the codec
