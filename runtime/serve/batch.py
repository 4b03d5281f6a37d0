"""The running batch of a decode or aggregated worker: its sequences (Slot), its KV pool's
admission and preemption, and one decode step of every running sequence."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from ..model.kv_cache import CacheFullError, SeqCache
from ..model.sampling import Pick, Sequence, choose_rows
from .protocol import RateLimitedLog
from .worker_base import Worker, log, lp_item


@dataclass(slots=True)
class Slot:
    """One sequence in the running decode batch: its KV cache and its generation state."""

    rid: str
    cache: SeqCache
    seq: Sequence


class BatchWorker(Worker):
    """A worker with a running batch: sequences join it within the KV pool, step together, and
    leave it when they finish (DecodeWorker, AggregatedWorker)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pool_log = RateLimitedLog(log)  # preemptions: worth knowing about, not every one
        self.running: dict[str, Slot] = {}
        self.preempted: deque[tuple[Slot, torch.Tensor]] = deque()  # swapped out to host memory while the pool was full

    def running_count(self) -> int:
        return len(self.running)

    def queued_count(self) -> int:
        return len(self.waiting) + len(self.preempted)

    def cancel(self, rid: str) -> None:
        slot = self.running.pop(rid, None)
        if slot is not None:
            self.model.free(slot.cache)
        super().cancel(rid)
        self.preempted = deque(p for p in self.preempted if p[0].rid != rid)

    # -- the KV pool: admission and preemption ---------------------------------------------------
    # A sequence joins the batch only if the pool has room for it and for the next step of those
    # already running; when a step would still not fit (sequences grow), the newest sequence is
    # swapped out to host memory and comes back first once blocks are free. The admitted context
    # fits the pool (protocol.context_limits), so a sequence alone always fits: nothing is failed
    # for want of room.
    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.model.cache.block_size)

    def _free_blocks(self) -> int:
        cache = self.model.cache
        return cache.max_blocks - cache.used_blocks

    def _step_blocks(self) -> int:
        """New blocks the next decode step of the running batch needs."""
        return sum(max(0, self._blocks(s.cache.length + 1) - len(s.cache.blocks)) for s in self.running.values())

    def _fits(self, tokens: int) -> bool:
        """Room for a sequence of `tokens` stored tokens (and its next one) beside the running batch."""
        return not self.running or self._blocks(tokens + 1) + self._step_blocks() <= self._free_blocks()

    def _preempt_newest(self) -> None:
        rid, slot = next(reversed(self.running.items()))
        kv = self.model.cache.export(slot.cache).cpu()
        self.model.free(self.running.pop(rid).cache)
        self.preempted.append((slot, kv))
        self.pool_log.warning(
            "%s: KV pool full (%d blocks of %d tokens): %s swapped out (%d tokens) until blocks free up",
            self.name,
            self.model.cache.max_blocks,
            self.model.cache.block_size,
            rid,
            kv.shape[2],
        )

    def _make_room(self) -> None:
        while len(self.running) > 1 and self._step_blocks() > self._free_blocks():
            self._preempt_newest()

    def _resume_preempted(self) -> None:
        """Swapped-out sequences come back before any new one is admitted (oldest first)."""
        while self.preempted and len(self.running) < self.max_batch and self._fits(self.preempted[0][1].shape[2]):
            slot, kv = self.preempted.popleft()
            slot.cache = self.model.cache.import_(kv)
            self.running[slot.rid] = slot

    def _step(self) -> None:
        """One decode step of the running batch, within the pool."""
        self._make_room()
        try:
            self.decode_step()
        except CacheFullError as e:  # not expected after _make_room; if it happens, shrink the batch
            if len(self.running) > 1:
                self._preempt_newest()
            else:  # one sequence longer than the pool: only a router configured unlike this worker sends one
                rid, slot = self.running.popitem()
                self.model.free(slot.cache)
                self.fail(rid, str(e))

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
        self._stepped(slots, self.model.decode_step([s.cache for s in slots], [s.seq.output[-1] for s in slots]))

    def _stepped(self, slots: list[Slot], logits: torch.Tensor) -> None:
        """The running batch's next tokens from its step's logits: emitted, finished sequences freed."""
        items = []
        for slot, pick in zip(slots, self._picks(logits, slots)):
            reason = None if pick is None else slot.seq.append(pick.token)
            if pick is not None:
                items.append(
                    [
                        slot.rid,
                        None if reason == "stop" else pick.token,
                        reason,
                        None if reason == "stop" else lp_item(pick),
                    ]
                )
            if pick is None or reason is not None:
                self.model.free(self.running.pop(slot.rid).cache)
        self.emit(items)
