"""Hosts that are really separate on one machine, in network namespaces: what the tests and
benchmarks of the server's multi-host roles run on (root only). Test support only: the package does
not ship it."""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import threading

CLONE_NEWNET = 0x40000000


def _setns(ns: str | int) -> None:
    """setns(2) of the calling thread into a network namespace: a path under /run/netns, or an fd."""
    fd = os.open(ns, os.O_RDONLY) if isinstance(ns, str) else ns
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET):
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
    finally:
        if isinstance(ns, str):
            os.close(fd)


def _sh(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


class Hosts:
    """Hosts that are really separate on one machine: a network namespace for each of `roles`, each
    with one link (eth0, a veth) to a bridge in a namespace of its own. Addresses are 10.231.N.i/24
    (N from this process's id, i from 1 in the order of `roles`) and exist only inside these
    namespaces; `close` removes them all. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2;
    raises RuntimeError naming the command that failed."""

    def __init__(self, roles: tuple[str, ...]):
        tag = os.getpid() % 10000
        self.ns = {role: f"uw{tag}-{role}" for role in (*roles, "switch")}
        self.addr = {role: f"10.231.{tag % 250}.{i + 1}" for i, role in enumerate(roles)}
        self.port = {role: f"uwb{tag}{role[0]}{i}" for i, role in enumerate(roles)}  # the bridge's end of each link
        made = []
        try:
            for ns in self.ns.values():
                _sh("ip", "netns", "add", ns)
                made.append(ns)
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
            sw = self.ns["switch"]
            _sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", sw, "link", "set", "br0", "up")
            for role in roles:
                ns = self.ns[role]
                _sh(
                    *("ip", "link", "add", "eth0", "netns", ns),
                    *("type", "veth", "peer", "name", self.port[role]),
                    *("netns", sw),
                )
                _sh("ip", "-n", ns, "addr", "add", f"{self.addr[role]}/24", "dev", "eth0")
                _sh("ip", "-n", ns, "link", "set", "eth0", "up")
                _sh("ip", "-n", sw, "link", "set", self.port[role], "master", "br0")
                _sh("ip", "-n", sw, "link", "set", self.port[role], "up")
        except Exception:
            for ns in made:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            raise

    def link(self, role: str, up: bool) -> None:
        _sh("ip", "-n", self.ns["switch"], "link", "set", self.port[role], "up" if up else "down")

    def limit(self, role: str, rate: str | None) -> None:
        """Shape what `role` sends to `rate` (tc's token bucket, e.g. "1gbit"); None: no limit."""
        ns = self.ns[role]
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root"], capture_output=True)
        if rate is not None:
            # a bucket of 256 KiB, up to 50 ms of queue: the shape of a switched link, not of a burst
            _sh(
                *("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root"),
                *("tbf", "rate", rate, "burst", "256kb", "latency", "50ms"),
            )

    def _in(self, role: str, *cmd: str) -> str:
        r = subprocess.run(["ip", "netns", "exec", self.ns[role], *cmd], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{' '.join(cmd)} in {role}: {r.stderr.strip()}")
        return r.stdout

    def counters(self, role: str) -> dict[str, int]:
        """What `role`'s link and TCP stack counted so far: eth0's rx/tx bytes and packets (frames
        as the kernel saw them, Ethernet, IP and TCP headers included), TCP segments in, out and
        retransmitted, and what its qdisc (the shaping, if any) dropped."""
        stats = "/sys/class/net/eth0/statistics/"  # `ip netns exec` mounts the namespace's own /sys
        out = {k: int(self._in(role, "cat", stats + k)) for k in ("rx_bytes", "rx_packets", "tx_bytes", "tx_packets")}
        head, values = (
            row.split() for row in self._in(role, "cat", "/proc/net/snmp").splitlines() if row[:4] == "Tcp:"
        )
        tcp = dict(zip(head[1:], values[1:], strict=True))
        out |= {"tcp_in_segs": int(tcp["InSegs"]), "tcp_out_segs": int(tcp["OutSegs"])}
        out["tcp_retrans_segs"] = int(tcp["RetransSegs"])
        qdiscs = json.loads(self._in(role, "tc", "-s", "-j", "qdisc", "show", "dev", "eth0") or "[]")
        out["qdisc_drops"] = sum(q.get("drops", 0) for q in qdiscs)
        return out

    def received(self, role: str) -> dict[str, int]:
        """TCP payload bytes `role` has received on its open connections, by the peer's role (what
        the kernel acknowledged in order: a retransmitted segment counts once)."""
        by_addr = {a: r for r, a in self.addr.items()}
        got: dict[str, int] = {}
        peer = None
        for line in self._in(role, "ss", "-tinH").splitlines():
            if not line[:1].isspace():  # a connection: state, queues, local address, peer address
                peer = by_addr.get(line.split()[4].rsplit(":", 1)[0])
            elif peer is not None and (m := re.search(r"bytes_received:(\d+)", line)):
                got[peer] = got.get(peer, 0) + int(m.group(1))
        return got

    def enter(self, role: str):
        """Move the calling thread into `role`'s network namespace (a namespace is a thread's own):
        every socket it opens from now on, and every process it starts, is on that host. Returns
        the function that moves it back."""
        back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        _setns(f"/run/netns/{self.ns[role]}")

        def leave() -> None:
            try:
                _setns(back)
            finally:
                os.close(back)

        return leave

    def call(self, role: str, fn, *args, **kw):
        """fn(*args, **kw) as code on `role`'s host: run on a thread of this process that entered the
        host's network namespace, so every socket it opens is there. Returns what fn returns;
        raises what it raises."""
        out: dict = {}

        def inside() -> None:
            try:
                self.enter(role)
                out["value"] = fn(*args, **kw)
            except BaseException as e:  # noqa: BLE001 (handed to the caller's thread)
                out["error"] = e

        t = threading.Thread(target=inside, name=f"on-{role}")
        t.start()
        t.join()
        if "error" in out:
            raise out["error"]
        return out["value"]

    def run(self, role: str, *cmd: str, **kw) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.ns[role], *cmd], start_new_session=True, **kw)

    def close(self) -> None:
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
