"""A prefill worker of `unweight serve`: one prompt at a time -> first token; its KV cache streams
to the decode worker the router chose, each layer as soon as the prefill is past it (a
compute-bound phase: large matmuls, the decode-then-matmul pipeline wins)."""

from __future__ import annotations

import queue

import numpy as np

from ..model.kv_cache import SeqCache
from .kv_link import Transfer, TransferResult
from .worker_base import Worker, lp_item


class PrefillWorker(Worker):
    """One prompt at a time -> first token; its KV cache streams to the decode worker the router
    chose, each layer as soon as the prefill is past it (compute-bound: large matmuls)."""

    ROLE, JOB, LINK_RANK = "prefill", "prefill", 0

    @staticmethod
    def cache_tokens(max_len: int, pool: int) -> int:
        return max_len  # one sequence of the admitted context at a time

    def _transfer_done(self, t: TransferResult) -> None:
        if t.error is not None and not t.aborted:  # aborted: its request already ended here
            self.fail(t.rid, t.error)

    def _stream(self, job: dict) -> Transfer:
        """The job's hand-off, started as its prefill starts (`prefilling`: the router tells the
        decode worker to expect it): from here it is sent whole, or aborted."""
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

    def step(self) -> None:
        self.poll(0 if self.waiting else 50)
        self._drain_transfers()
        if not self.waiting:
            return
        job = self.waiting.popleft()
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
            done = self._first_token(job, stream)
        finally:
            if done is None or done[3] is not None or sent < cache.layers:
                t.layers.put(None)  # failed or ended during the prefill: the transfer is aborted
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
