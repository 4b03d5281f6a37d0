"""Worker processes of `unweight serve`: prefill, decode, or one aggregated worker.

Each worker loads the compressed model itself, connects to the router's control socket and runs a
loop:
- prefill: one prompt at a time -> first token -> KV cache exported and sent to the decode worker
  the router chose (a compute-bound phase: large matmuls, the decode-then-matmul pipeline wins);
- decode: continuous batching. KV caches arriving from prefill workers join the running batch
  between steps, finished sequences leave it, one `decode_step` advances every sequence by one
  token (memory-bound: the fused compressed GEMV wins);
- worker (--no-disagg): both in one process; a waiting prompt is prefilled between decode steps,
  stalling every running sequence meanwhile: the baseline disaggregation is measured against.
Token ids go back to the router, which detokenises and streams.
"""

from __future__ import annotations

import base64
import logging
import os
import signal
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass

import torch

from ..kv_cache import CacheFullError, SeqCache
from ..loader import load
from ..sampling import SamplingParams, sample, sample_rows
from .kv_link import KVLink, Transfer
from .protocol import HEARTBEAT_S, pack, unpack

log = logging.getLogger(__name__)


def sampling_from(job: dict) -> tuple[SamplingParams, set[int]]:
    s = job["sampling"]
    params = SamplingParams(max_new_tokens=s["max_tokens"], temperature=s["temperature"], top_p=s["top_p"], top_k=s.get("top_k", 0), seed=s.get("seed"))
    return params, set(s.get("eos", []))


def rng_state(gen: torch.Generator | None) -> str | None:
    return None if gen is None else base64.b64encode(gen.get_state().numpy().tobytes()).decode()


def rng_from(state: str | None) -> torch.Generator | None:
    if state is None:
        return None
    g = torch.Generator()
    g.set_state(torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8))
    return g


@dataclass(slots=True)
class Slot:
    """One sequence in the running decode batch."""

    rid: str
    seq: SeqCache
    token: int  # the last token, fed to the next step
    generated: int  # tokens made so far (the first came from prefill)
    params: SamplingParams
    gen: torch.Generator | None
    eos: set[int]


class Worker:
    def __init__(self, role: str, name: str, model_path: str, router: tuple[str, int], kv_store: tuple[str, int] | None,
                 device: str, max_batch: int, max_model_len: int | None, parent_pid: int | None):
        import zmq

        self.role, self.name, self.max_batch, self.parent_pid = role, name, max_batch, parent_pid
        self.incarnation = uuid.uuid4().hex[:12]
        cache_tokens = (max_model_len or 8192) * (max_batch if role != "prefill" else 1)
        self.model = load(model_path, device, max_cache_tokens=cache_tokens)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, name.encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.router_url = f"tcp://{router[0]}:{router[1]}"
        self.sock.connect(self.router_url)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.link = KVLink(kv_store, self.incarnation, 0 if role == "prefill" else 1) if role in ("prefill", "decode") else None
        self.running: dict[str, Slot] = {}
        self.waiting: deque = deque()  # prompts (aggregated) or received caches (decode) not yet running
        self.pending: dict[str, dict] = {}  # decode: jobs whose KV is on its way
        self.cancelled: set[str] = set()
        self.stopping = False
        self.send({"op": "hello", "role": role, "pid": os.getpid(), "incarnation": self.incarnation})

    # -- messages -----------------------------------------------------------------------------
    def send(self, msg: dict) -> None:
        self.sock.send(pack(msg))

    def emit(self, items: list) -> None:
        if items:
            self.send({"op": "tokens", "items": items})

    def poll(self, timeout_ms: int) -> None:
        import zmq

        if self.poller.poll(timeout_ms):
            while True:
                try:
                    data = self.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.handle(unpack(data))

    def _beat(self) -> None:
        """Heartbeats from a thread with a socket of its own (`NAME#beat`; ZeroMQ sockets are not
        shared between threads), so a long prefill or step never makes the worker look dead.
        Also stops the worker if the router that started it is gone: no orphans."""
        import zmq

        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"{self.name}#beat".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.router_url)
        try:
            while not self.stopping:
                cache = self.model.cache
                sock.send(pack({"op": "beat", "running": len(self.running), "queued": len(self.waiting) + len(self.pending),
                                "kv_blocks_used": cache.used_blocks, "kv_blocks_total": cache.max_blocks}))
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    self.stopping = True
                time.sleep(HEARTBEAT_S)
        finally:
            sock.close()

    def handle(self, msg: dict) -> None:
        op = msg["op"]
        if op == "shutdown":
            self.stopping = True
        elif op == "cancel":
            self.cancel(msg["id"])
        elif op == "prefill" and self.role == "prefill":
            self.waiting.append(msg)
        elif op == "generate" and self.role == "worker":
            self.waiting.append(msg)
        elif op == "decode" and self.role == "decode":
            self.pending[msg["id"]] = msg
            if msg.get("discard"):  # sends and receives must pair up on a link: take it, then drop it
                self.cancelled.add(msg["id"])
            self.link.submit(Transfer(msg["id"], msg["tag"], msg["prefill"], msg["prefill_incarnation"], shape=tuple(msg["kv_shape"]), dtype=msg["kv_dtype"]))
        else:
            log.warning("%s: ignoring %s", self.name, op)

    def cancel(self, rid: str) -> None:
        slot = self.running.pop(rid, None)
        if slot is not None:
            self.model.free(slot.seq)
        elif rid in self.pending:
            self.cancelled.add(rid)  # its KV is still arriving: drop it when it lands
        self.waiting = deque(w for w in self.waiting if (w[0] if isinstance(w, tuple) else w)["id"] != rid)

    # -- phases -------------------------------------------------------------------------------
    def prefill(self, job: dict) -> tuple[SeqCache, int, SamplingParams, torch.Generator | None, set[int], str | None]:
        """Run a prompt; returns its cache, first token, sampling state and a finish reason."""
        params, eos = sampling_from(job)
        gen = params.generator()
        seq = self.model.new_sequence()
        try:
            logits = self.model.prefill(seq, torch.tensor(job["tokens"]))
        except BaseException:
            self.model.free(seq)
            raise
        token = sample(logits, params, gen)
        reason = "stop" if token in eos else "length" if params.max_new_tokens <= 1 else None
        return seq, token, params, gen, eos, reason

    def decode_step(self) -> None:
        slots = list(self.running.values())
        logits = self.model.decode_step([s.seq for s in slots], [s.token for s in slots])
        items = []
        for slot, token in zip(slots, sample_rows(logits, [s.params for s in slots], [s.gen for s in slots])):
            slot.generated += 1
            if token in slot.eos:
                items.append([slot.rid, None, "stop"])
            elif slot.generated >= slot.params.max_new_tokens:
                items.append([slot.rid, token, "length"])
            else:
                items.append([slot.rid, token, None])
                slot.token = token
                continue
            self.model.free(self.running.pop(slot.rid).seq)
        self.emit(items)

    def fail(self, rid: str, error: str) -> None:
        self.send({"op": "failed", "id": rid, "error": error})

    # -- loops --------------------------------------------------------------------------------
    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        step = {"prefill": self._prefill_loop, "decode": self._decode_loop, "worker": self._aggregated_loop}[self.role]
        beat = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        beat.start()
        try:
            while not self.stopping:
                step()
        finally:
            self.stopping = True
            beat.join(timeout=2 * HEARTBEAT_S)
            if self.link is not None:
                self.link.close()
            self.sock.close()
            self.ctx.term()

    def _prefill_loop(self) -> None:
        self.poll(0 if self.waiting else 50)
        self._drain_transfers()
        if not self.waiting:
            return
        job = self.waiting.popleft()
        try:
            seq, token, params, gen, eos, reason = self.prefill(job)
        except (ValueError, CacheFullError) as e:
            self.fail(job["id"], str(e))
            return
        if reason is not None:
            self.model.free(seq)
            self.emit([[job["id"], None if reason == "stop" else token, reason]])
            return
        kv = self.model.cache.export(seq).cpu()  # gloo moves host tensors; a GPU cache is staged through them
        self.model.free(seq)
        self.send({"op": "prefilled", "id": job["id"], "tag": job["tag"], "first_token": token, "kv_shape": list(kv.shape), "kv_dtype": str(kv.dtype).removeprefix("torch."),
                   "rng": rng_state(gen), "kv_bytes": kv.numel() * kv.element_size(), "decode": job["decode"]})
        self.link.submit(Transfer(job["id"], job["tag"], job["decode"], job["decode_incarnation"], tensor=kv))

    def _drain_transfers(self) -> None:
        """Finished KV transfers: failures are reported; received caches queue for the batch."""
        while self.link is not None and not self.link.done.empty():
            t = self.link.done.get()
            job = self.pending.pop(t.rid, None) if self.role == "decode" else None
            if t.rid in self.cancelled:
                self.cancelled.discard(t.rid)
                continue
            if t.error is not None:
                self.fail(t.rid, t.error)
            elif job is not None:
                self.waiting.append((job, t.tensor))

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            job, kv = self.waiting.popleft()
            try:
                seq = self.model.cache.import_(kv)
            except (ValueError, CacheFullError) as e:
                self.fail(job["id"], str(e))
                continue
            params, eos = sampling_from(job)
            self.running[job["id"]] = Slot(job["id"], seq, job["first_token"], 1, params, rng_from(job.get("rng")), eos)

    def _decode_loop(self) -> None:
        self.poll(0 if self.running else 20)
        self._drain_transfers()
        self._admit()
        if self.running:
            self.decode_step()

    def _aggregated_loop(self) -> None:
        self.poll(0 if (self.running or self.waiting) else 50)
        if self.waiting and len(self.running) < self.max_batch:
            job = self.waiting.popleft()  # the whole prompt now: every running sequence waits for it
            try:
                seq, token, params, gen, eos, reason = self.prefill(job)
            except (ValueError, CacheFullError) as e:
                self.fail(job["id"], str(e))
                seq = None
            if seq is not None:
                if reason is not None:
                    self.model.free(seq)
                    self.emit([[job["id"], None if reason == "stop" else token, reason]])
                else:
                    self.emit([[job["id"], token, None]])
                    self.running[job["id"]] = Slot(job["id"], seq, token, 1, params, gen, eos)
        if self.running:
            self.decode_step()


def main(role: str, name: str, model_path: str, router: tuple[str, int], kv_store: tuple[str, int] | None, device: str,
         max_batch: int, max_model_len: int | None, parent_pid: int | None, threads: int | None = None) -> None:
    """Entry point of a worker process (`unweight serve --role prefill|decode|worker`). threads:
    CPU threads for torch and numba (workers sharing one machine split its cores)."""
    torch.set_grad_enabled(False)
    if threads:
        import numba

        torch.set_num_threads(threads)
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    Worker(role, name, model_path, router, kv_store, device, max_batch, max_model_len, parent_pid).run()
