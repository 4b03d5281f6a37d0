"""KV-cache hand-off between a prefill worker and a decode worker over torch.distributed.

Every (prefill, decode) pair gets its own two-rank gloo process group (prefill is rank 0, decode
rank 1), made on first use through the TCPStore that the router hosts, under a prefix naming both
workers' incarnations. A restarted worker has a new incarnation, so its peers build fresh groups
with it, and a dead worker only breaks the groups it was in: the rest of the server keeps going.

Transfers run on one background thread per peer (the worker's loop never blocks on the network);
results come back through a queue that the worker's loop drains between steps. Each transfer's
tag is the request's number, so concurrent hand-offs on one pair cannot be confused.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .protocol import KV_TIMEOUT_S

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class Transfer:
    rid: str
    tag: int
    peer: str
    peer_incarnation: str
    tensor: torch.Tensor | None = None  # what to send, or what was received
    shape: tuple[int, ...] = ()
    dtype: str = "float32"
    error: str | None = None


class KVLink:
    """One worker's end of its hand-offs. `rank` 0 sends (prefill), 1 receives (decode)."""

    def __init__(self, store_address: tuple[str, int], incarnation: str, rank: int, bind_host: str = "127.0.0.1"):
        host, port = store_address
        timeout = datetime.timedelta(seconds=KV_TIMEOUT_S)
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        # gloo's own listening socket: on the address this worker reaches the router from, not
        # wherever gloo's default (the hostname's address) would put it
        self.options = dist.ProcessGroupGloo._Options()
        self.options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
        self.options._timeout = timeout
        self.incarnation, self.rank, self.timeout = incarnation, rank, timeout
        self.done: queue.Queue[Transfer] = queue.Queue()  # finished transfers, for the worker loop
        self._groups: dict[tuple[str, str], dist.ProcessGroup] = {}
        self._queues: dict[tuple[str, str], queue.Queue] = {}
        self._lock = threading.Lock()

    def submit(self, t: Transfer) -> None:
        """Queue a send (rank 0, t.tensor set) or a receive (rank 1, t.shape/t.dtype set)."""
        key = (t.peer, t.peer_incarnation)
        with self._lock:
            q = self._queues.get(key)
            if q is None:
                q = self._queues[key] = queue.Queue()
                threading.Thread(target=self._serve_peer, args=(key, q), name=f"kv-{t.peer}", daemon=True).start()
        q.put(t)

    def _group(self, key: tuple[str, str]) -> dist.ProcessGroup:
        g = self._groups.get(key)
        if g is None:
            pre, dec = (self.incarnation, key[1]) if self.rank == 0 else (key[1], self.incarnation)
            store = dist.PrefixStore(f"kv/{pre}/{dec}", self.store)
            g = self._groups[key] = dist.ProcessGroupGloo(store, self.rank, 2, self.options)
        return g

    def _serve_peer(self, key: tuple[str, str], q: queue.Queue) -> None:
        while True:
            t = q.get()
            if t is None:
                return
            try:
                g = self._group(key)
                if self.rank == 0:
                    g.send([t.tensor], 1, t.tag).wait()
                else:
                    buf = torch.empty(t.shape, dtype=DTYPES[t.dtype])
                    g.recv([buf], 0, t.tag).wait()
                    t.tensor = buf
            except Exception as e:  # noqa: BLE001 - a dead peer surfaces as many error types; the request fails, the worker lives
                t.error = f"KV transfer with {t.peer} failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                self._groups.pop(key, None)  # the group is broken: rebuild it for the next transfer
                if self.rank == 0:
                    t.tensor = None
            self.done.put(t)

    def close(self) -> None:
        with self._lock:
            for q in self._queues.values():
                q.put(None)
