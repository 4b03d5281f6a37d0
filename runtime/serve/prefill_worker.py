"""A prefill worker of `unweight serve`: prompts -> first tokens; each one's KV cache streams to
the decode worker the router chose, each layer as soon as the prefill is past it (a compute-bound
phase: large matmuls, the decode-then-matmul pipeline wins).

Prompts take turns, PREFILL_CHUNK tokens at a time, round robin among those that the pool holds
(vLLM's chunked prefill, with its token budget of one chunk); a prompt that arrives during a chunk
comes next, so a short prompt behind a long one waits at most one chunk, not the whole long prompt.
A prompt's last chunk runs with its hand-off, so that hand-offs reach the link in the order prompts
finish. A prompt scored for its logprobs (echo) runs whole, as does one that a prompt just run
repeats (a copy: worker_base.SharedPrompt).
"""

from __future__ import annotations

import queue
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..model.kv_cache import SeqCache
from .kv_link import Transfer, TransferResult
from .worker_base import Worker, _job_error, _prompt_key, lp_item

PREFILL_CHUNK = 512  # tokens of one prompt a step runs before the next prompt's turn


@dataclass(slots=True)
class Prefilling:
    """A prompt part-way in: its job and its KV cache, whose length is the tokens run so far."""

    job: dict
    cache: SeqCache


class PrefillWorker(Worker):
    """One prompt at a time -> first token; its KV cache streams to the decode worker the router
    chose, each layer as soon as the prefill is past it (compute-bound: large matmuls)."""

    ROLE, JOB, LINK_RANK = "prefill", "prefill", 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.turns: deque[Prefilling] = deque()  # prompts part-way in, in the order of their next turn

    @staticmethod
    def cache_tokens(max_len: int, pool: int) -> int:
        return max_len + PREFILL_CHUNK  # a prompt of the admitted context, and a short one beside it

    def queued_count(self) -> int:
        return len(self.waiting) + len(self.turns)

    def cancel(self, rid: str) -> None:
        super().cancel(rid)
        for p in [p for p in self.turns if p.job["id"] == rid]:
            self.turns.remove(p)
            self.model.free(p.cache)

    def not_started(self) -> Iterator[dict]:
        """Waiting prompts, and those admitted to take turns whose first chunk has not run."""
        yield from self.waiting
        yield from (p.job for p in self.turns if p.cache.length == 0)

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.model.cache.block_size)

    def _admit(self) -> None:
        """Waiting prompts take a turn, in order, each once the pool can hold it whole beside those
        part-way in (a prompt that does not fit yet lets a later one that does go by). A prompt that
        repeats one taking turns (a request's other choices) waits for it, and starts from its copy."""
        cache = self.model.cache
        held = sum(self._blocks(len(p.job["seq"]["prompt"])) - len(p.cache.blocks) for p in self.turns)
        going = {_prompt_key(p.job) for p in self.turns}
        for job in list(self.waiting):
            key = _prompt_key(job)
            if key in going and not self.repeats_shared(key):
                continue
            need = self._blocks(len(job["seq"]["prompt"]))
            if need + held <= cache.max_blocks - cache.used_blocks:
                self.waiting.remove(job)
                self.turns.append(Prefilling(job, self.model.new_sequence()))
                going.add(key)
                held += need

    def _last_turn(self, p: Prefilling) -> bool:
        job = p.job
        left = len(job["seq"]["prompt"]) - p.cache.length
        return left <= PREFILL_CHUNK or job.get("prompt_logprobs") is not None or self.repeats_shared(_prompt_key(job))

    def step(self) -> None:
        self.poll(0 if self.waiting or self.turns else 50)
        self._drain_transfers()
        self._admit()
        if not self.turns:
            return
        p = self.turns[0]  # (it stays in `turns` while it runs: the heartbeat counts it queued)
        if self._last_turn(p):
            self._finish(p.job, p.cache)
            self.turns.popleft()
            return
        try:  # one chunk, then the next prompt's turn
            if self.cores is not None:
                self.cores.step()
            start = p.cache.length
            self.model.prefill(p.cache, torch.tensor(p.job["seq"]["prompt"][start : start + PREFILL_CHUNK]))
        except Exception as e:  # noqa: BLE001 - a job that cannot run fails alone
            self.turns.popleft()
            self.model.free(p.cache)
            self.fail(p.job["id"], _job_error(e))
            return
        self.poll(0, jobs_only=True)  # a prompt sent during the chunk takes its turn before this one's next
        self._admit()
        self.turns.rotate(-1)

    def _stream(self, job: dict) -> Transfer:
        """The job's hand-off, started as its prefill's last turn starts (`prefilling`: the router
        tells the decode worker to expect it): from here it is sent whole, or aborted."""
        cache = self.model.cache
        tokens = len(job["seq"]["prompt"])
        self.send({"op": "prefilling", "id": job["id"], "tag": job["tag"], "tokens": tokens})
        t = Transfer(
            job["id"],
            job["tag"],
            job["decode"],
            job["decode_incarnation"],
            shape=(cache.layers, 2, tokens, cache.kv_heads, cache.head_dim),
            dtype=str(cache.k.dtype).removeprefix("torch."),
            layers=queue.Queue(),
        )
        self.link.submit(t)
        return t

    def _finish(self, job: dict, seq_cache: SeqCache) -> None:
        """The prompt's last turn (the rest of it, or all of it): its layers stream as they are
        done, then its first token goes to the router."""
        cache = self.model.cache
        t = self._stream(job)
        shape, tokens = t.shape, t.shape[2]
        sent = 0

        def stream(seq: SeqCache, i: int) -> None:  # gloo moves host tensors: a GPU layer is staged through one
            nonlocal sent
            t.layers.put(cache.export_layer(seq, i, tokens).cpu())
            sent += 1

        done = None
        try:
            done = self._first_token(job, stream, None if seq_cache.length == 0 else seq_cache)
        finally:
            if done is None or done[3] is not None or sent < cache.layers:
                t.layers.put(None)  # failed or ended during the prefill: the transfer is aborted
        if seq_cache.length == 0:
            self.model.free(seq_cache)  # (an empty handle: the prompt ran whole, in a cache of its own)
        if done is None or done[3] is not None:
            return
        seq_cache, seq, pick, _ = done
        self.model.free(seq_cache)
        self.send(
            {
                "op": "prefilled",
                "id": job["id"],
                "tag": job["tag"],
                "first_token": pick.token,
                "logprobs": lp_item(pick),
                "seq": seq.state(),
                "kv_bytes": int(np.prod(shape)) * cache.k.element_size(),
                "decode": job["decode"],
            }
        )

    def _transfer_done(self, t: TransferResult) -> None:
        if t.error is not None and not t.aborted:  # aborted: its request already ended here
            self.fail(t.rid, t.error, "kv_transfer_failed")
