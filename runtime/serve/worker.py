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
from ..sampling import Pick, Sequence, choose_rows
from ..threads import governor, set_threads
from .kv_link import KVLink, Transfer
from .protocol import HEARTBEAT_S, pack, unpack

log = logging.getLogger(__name__)


def lp_item(pick: Pick) -> list | None:
    """A token's logprobs as they travel: [logprob, [[id, logprob], ...]], or None."""
    return None if pick.logprob is None else [pick.logprob, [list(t) for t in pick.top]]


@dataclass(slots=True)
class Slot:
    """One sequence in the running decode batch: its KV cache and its generation state."""

    rid: str
    cache: SeqCache
    seq: Sequence


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
        self.cores = governor() if self.model.device.type == "cpu" else None
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
            self.model.free(slot.cache)
        elif rid in self.pending:
            self.cancelled.add(rid)  # its KV is still arriving: drop it when it lands
        self.waiting = deque(w for w in self.waiting if (w[0] if isinstance(w, tuple) else w)["id"] != rid)

    # -- phases -------------------------------------------------------------------------------
    def prefill(self, job: dict) -> tuple[SeqCache, Sequence, Pick, str | None]:
        """Run a prompt: its KV cache, its generation state, the first token and a finish reason.
        With `prompt_logprobs` set, the prompt's own logprobs go to the router first."""
        seq = Sequence.from_state(job["seq"], self.model.config.vocab_size)
        if self.cores is not None:
            self.cores.step()
        cache = self.model.new_sequence()
        try:
            tokens = torch.tensor(seq.prompt, dtype=torch.int64)
            top = job.get("prompt_logprobs")
            if top is not None:
                logits, scored = self.model.prefill_logprobs(cache, tokens, top)
                self.send({"op": "prompt_logprobs", "id": job["id"], "items": [[lp, [list(t) for t in alts]] for lp, alts in scored]})
            else:
                logits = self.model.prefill(cache, tokens)
            pick = seq.choose(logits)
        except BaseException:
            self.model.free(cache)
            raise
        return cache, seq, pick, seq.append(pick.token)

    def _picks(self, logits: torch.Tensor, slots: list[Slot]) -> list[Pick | None]:
        """The batch's choices; should one sequence's fail, only that one is lost (None)."""
        try:
            return choose_rows(logits, [s.seq for s in slots])
        except Exception:  # noqa: BLE001 - never expected (sampling is total); isolate it rather than lose the batch
            log.exception("%s: batched sampling failed; choosing row by row", self.name)
        picks = []
        for row, slot in zip(logits, slots):
            try:
                picks.append(choose_rows(row[None], [slot.seq])[0])
            except Exception as e:  # noqa: BLE001
                picks.append(None)
                self.fail(slot.rid, f"sampling failed: {type(e).__name__}: {e}")
        return picks

    def decode_step(self) -> None:
        if self.cores is not None:
            self.cores.step()  # fewer threads while another process holds a core
        slots = list(self.running.values())
        logits = self.model.decode_step([s.cache for s in slots], [s.seq.output[-1] for s in slots])
        items = []
        for slot, pick in zip(slots, self._picks(logits, slots)):
            reason = None if pick is None else slot.seq.append(pick.token)
            if pick is not None:
                items.append([slot.rid, None if reason == "stop" else pick.token, reason, None if reason == "stop" else lp_item(pick)])
            if pick is None or reason is not None:
                self.model.free(self.running.pop(slot.rid).cache)
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
            cache, seq, pick, reason = self.prefill(job)
        except (ValueError, CacheFullError) as e:
            self.fail(job["id"], str(e))
            return
        if reason is not None:
            self.model.free(cache)
            self.emit([[job["id"], None if reason == "stop" else pick.token, reason, None if reason == "stop" else lp_item(pick)]])
            return
        kv = self.model.cache.export(cache).cpu()  # gloo moves host tensors; a GPU cache is staged through them
        self.model.free(cache)
        self.send({"op": "prefilled", "id": job["id"], "tag": job["tag"], "first_token": pick.token, "logprobs": lp_item(pick), "seq": seq.state(),
                   "kv_shape": list(kv.shape), "kv_dtype": str(kv.dtype).removeprefix("torch."), "kv_bytes": kv.numel() * kv.element_size(), "decode": job["decode"]})
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
                seq = Sequence.from_state(job["seq"], self.model.config.vocab_size)
                if not seq.output:
                    raise ValueError("a decode job needs the sequence's first token")
                cache = self.model.cache.import_(kv)
            except (ValueError, CacheFullError) as e:
                self.fail(job["id"], str(e))
                continue
            self.running[job["id"]] = Slot(job["id"], cache, seq)

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
                cache, seq, pick, reason = self.prefill(job)
            except (ValueError, CacheFullError) as e:
                self.fail(job["id"], str(e))
                cache = None
            if cache is not None:
                self.emit([[job["id"], None if reason == "stop" else pick.token, reason, None if reason == "stop" else lp_item(pick)]])
                if reason is not None:
                    self.model.free(cache)
                else:
                    self.running[job["id"]] = Slot(job["id"], cache, seq)
        if self.running:
            self.decode_step()


def main(role: str, name: str, model_path: str, router: tuple[str, int], kv_store: tuple[str, int] | None, device: str,
         max_batch: int, max_model_len: int | None, parent_pid: int | None, threads: int | None = None) -> None:
    """Entry point of a worker process (`unweight serve --role prefill|decode|worker`). threads:
    CPU threads for torch and numba (workers sharing one machine split its cores)."""
    torch.set_grad_enabled(False)
    if threads:
        set_threads(threads)
    Worker(role, name, model_path, router, kv_store, device, max_batch, max_model_len, parent_pid).run()
