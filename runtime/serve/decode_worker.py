"""A decode worker of `unweight serve`: continuous batching. KV caches arriving from prefill
workers join the running batch between steps, finished sequences leave it, one decode step
advances every sequence by one token (memory-bound: the fused compressed GEMV wins)."""

from __future__ import annotations

import time

import torch

from ..model.kv_cache import CacheFullError
from ..model.sampling import Sequence
from .batch import BatchWorker, Slot
from .kv_link import Transfer, TransferResult
from .protocol import KV_TIMEOUT_S

STALE_S = 3 * KV_TIMEOUT_S  # a received KV cache (or a failed hand-off) waits this long for its decode job


class DecodeWorker(BatchWorker):
    """Continuous batching: KV caches arriving from prefill workers join the running batch between
    steps, finished sequences leave it (memory-bound: the fused compressed GEMV)."""

    ROLE, JOB, LINK_RANK = "decode", "decode", 1

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # hand-offs announced (`expect`) whose KV is on its way, with their job once it came (None
        # before); KV that landed before its job; hand-offs that failed before their job came;
        # hand-offs to drop as they land. An entry left by a request that ended elsewhere goes after STALE_S.
        self.pending: dict[str, dict | None] = {}
        self.arrived: dict[str, tuple[torch.Tensor, float]] = {}
        self.lost: dict[str, tuple[str, float]] = {}
        self.cancelled: set[str] = set()

    def queued_count(self) -> int:
        return super().queued_count() + len(self.pending)

    @staticmethod
    def _rid_of(waiting) -> str:
        return waiting[0]["id"]  # (job, received cache)

    def cancel(self, rid: str) -> None:
        if rid not in self.running and rid in self.pending:
            self.cancelled.add(rid)  # its KV is still arriving: drop it when it lands
        super().cancel(rid)
        self.arrived.pop(rid, None)
        self.lost.pop(rid, None)

    def _transfer_done(self, t: TransferResult) -> None:
        """A received cache queued for the batch or kept for its job; a failure reported or kept."""
        job = self.pending.pop(t.rid, None)
        if t.rid in self.cancelled:
            self.cancelled.discard(t.rid)
        elif t.error is not None:
            if job is not None:
                self.fail(t.rid, t.error, "kv_transfer_failed")
            elif not t.aborted:  # its job may still come: it fails then
                self.lost[t.rid] = (t.error, time.monotonic())
        elif job is not None:
            self.waiting.append((job, t.tensor))
        else:
            self.arrived[t.rid] = (t.tensor, time.monotonic())

    def _forget_stale(self) -> None:
        now = time.monotonic()
        for held in (self.arrived, self.lost):
            for rid in [rid for rid, (_, at) in held.items() if now - at > STALE_S]:
                del held[rid]  # its request ended before its decode job came (the router failed it)

    def handle(self, msg: dict) -> None:
        if msg["op"] == "expect":
            self.expect(msg)
        else:
            super().handle(msg)

    def expect(self, msg: dict) -> None:
        """A hand-off announced as its prefill starts: post the receive now, so each layer is taken
        as the prefill worker sends it."""
        cache = self.model.cache
        if msg["tokens"] > self.max_len:
            raise ValueError(f"a KV cache of {msg['tokens']} tokens is over this worker's context {self.max_len}")
        shape = (cache.layers, 2, msg["tokens"], cache.kv_heads, cache.head_dim)
        self.pending[msg["id"]] = None
        if msg["discard"]:  # sends and receives pair up in order on a link: take it, then drop it
            self.cancelled.add(msg["id"])
        self.link.submit(
            Transfer(
                msg["id"],
                msg["tag"],
                msg["prefill"],
                msg["prefill_incarnation"],
                shape=shape,
                dtype=str(cache.k.dtype).removeprefix("torch."),
            )
        )

    def accept(self, msg: dict) -> None:
        """A decode job: its sequence joins the batch once its KV is here (it may be already)."""
        rid = msg["id"]
        if rid in self.arrived:
            self.waiting.append((msg, self.arrived.pop(rid)[0]))
        elif rid in self.lost:
            self.fail(rid, self.lost.pop(rid)[0], "kv_transfer_failed")
        elif rid in self.pending:
            self.pending[rid] = msg
        else:
            raise ValueError("no KV hand-off was announced to this worker for this request")

    def _admit(self) -> None:
        self._resume_preempted()
        while (
            self.waiting
            and not self.preempted
            and len(self.running) < self.max_batch
            and self._fits(self.waiting[0][1].shape[2])
        ):
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

    def step(self) -> None:
        self.poll(0 if self.running else 20)
        self._drain_transfers()
        self._forget_stale()
        self._admit()
        if self.running:
            self._step()
